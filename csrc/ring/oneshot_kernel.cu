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

// Launched through the kernel's typed pointer, as in cuda_kernels.cu (the fake runtime runs it
// and counts its parameters).
template <typename T, Op op>
void launch(OneshotArgs& a, DType dtype, cudaStream_t stream, int device) {
  static ResidentCache resident;
  // One thread per pack (or element), so a small call takes few blocks and leaves the other SMs
  // to whatever runs beside it; a large one takes one wave of resident blocks and strides.
  const int64_t blocks = oneshot_grid(
      a.count, elem_size(dtype), a.vec,
      resident.get(reinterpret_cast<const void*>(&oneshot_kernel<T, op>), kOneshotThreads,
                   device));
  void* args[] = {&a};
  RR_CUDA_CHECK(cudaLaunchKernel(&oneshot_kernel<T, op>, dim3(unsigned(blocks)),
                                 dim3(kOneshotThreads), args, 0, stream),
                std::string("launching the one-shot all-reduce kernel (") + dtype_name(dtype) +
                    " " + op_name(op) + ", " + std::to_string(a.nranks) + " ranks, " +
                    std::to_string(a.count) + " elements) on cuda:" + std::to_string(device));
}

}  // namespace

void launch_oneshot(const void* const* in, void* const* out, int nranks, int64_t count,
                    DType dtype, Op op, cudaStream_t stream, int device) {
  if (count < 0) {
    throw std::invalid_argument("ringreduce: count must be >= 0, got " + std::to_string(count));
  }
  OneshotArgs a = make_oneshot_args(in, out, nranks, count);
  if (count == 0) return;
  RR_DISPATCH(dtype, op, launch<T, kOp>(a, dtype, stream, device));
}

void run_oneshot(const Lane& lane, const void* const* in, void* const* out, int nranks,
                 int64_t count, DType dtype, Op op) {
  check_capture(&lane, 1, lane.device);
  launch_oneshot(in, out, nranks, count, dtype, op, lane.stream, lane.device);
}

}  // namespace cuda
}  // namespace rr
