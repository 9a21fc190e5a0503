// The one-shot all-reduce kernel: each thread reduces whole indices (a 16-byte pack or one
// element) over all ranks in the ring's order and writes them to every output (oneshot.h).
#include "oneshot_cuda.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "cuda_check.h"
#include "cuda_kernels.h"
#include "launch.h"
#include "oneshot.h"

namespace rr {
namespace cuda {

namespace {

template <typename T, Op op>
__global__ void __launch_bounds__(kOneshotThreads)
    oneshot_kernel(const __grid_constant__ OneshotArgs a) {
  oneshot_thread<T, op>(a, int64_t(blockIdx.x) * blockDim.x + threadIdx.x,
                        int64_t(gridDim.x) * blockDim.x);
}

}  // namespace

void launch_oneshot(const void* const* in, void* const* out, int nranks, int64_t count,
                    DType dtype, Op op, cudaStream_t stream) {
  if (count < 0) {
    throw std::invalid_argument("ringreduce: count must be >= 0, got " + std::to_string(count));
  }
  OneshotArgs a = make_oneshot_args(in, out, nranks, count);
  if (count == 0) return;
  // Typed, as in cuda_kernels.cu (the fake runtime runs it and counts its parameters).
  void (*kernel)(OneshotArgs) = nullptr;
  RR_DISPATCH(dtype, op, kernel = &oneshot_kernel<T, kOp>);
  const void* fn = reinterpret_cast<const void*>(kernel);
  int device = 0;
  RR_CUDA_CHECK(cudaGetDevice(&device), "launching the one-shot all-reduce");
  // One thread per pack (or element), so a small call takes few blocks and leaves the other SMs
  // to whatever runs beside it; a large one takes one wave of resident blocks and strides.
  const int64_t blocks = oneshot_grid(count, elem_size(dtype), a.vec,
                                      resident_blocks(fn, kOneshotThreads, device));
  void* args[] = {&a};
  RR_CUDA_CHECK(cudaLaunchKernel(kernel, dim3(unsigned(blocks)), dim3(kOneshotThreads), args, 0,
                                 stream),
                std::string("launching the one-shot all-reduce kernel (") + dtype_name(dtype) +
                    " " + op_name(op) + ", " + std::to_string(nranks) + " ranks, " +
                    std::to_string(count) + " elements) on cuda:" + std::to_string(device));
}

void run_oneshot(const Lane& lane, const void* const* in, void* const* out, int nranks,
                 int64_t count, DType dtype, Op op) {
  check_capture(&lane, 1);
  launch_oneshot(in, out, nranks, count, dtype, op, lane.stream);
}

}  // namespace cuda
}  // namespace rr
