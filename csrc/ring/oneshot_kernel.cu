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

// The once-rounded sum (oneshot_once_thread): float16 and bfloat16 sum and avg only.
template <typename T, Op op>
__global__ void __launch_bounds__(kOneshotThreads)
    oneshot_once_kernel(const __grid_constant__ OneshotArgs a) {
  oneshot_once_thread<T, op>(a, int64_t(blockIdx.x) * blockDim.x + threadIdx.x,
                             int64_t(gridDim.x) * blockDim.x);
}

// Launched through the kernel's typed pointer, as in cuda_kernels.cu (the fake runtime runs it
// and counts its parameters). `resident`: the kernel's own occupancy cache. `once`: the kernel
// is oneshot_once_kernel (for the error message); a.nout < a.nranks: a chunk of the two-shot.
void launch(void (*kernel)(OneshotArgs), ResidentCache& resident, bool once, OneshotArgs& a,
            DType dtype, Op op, cudaStream_t stream, int device) {
  // One thread per pack (or element), so a small call takes few blocks and leaves the other SMs
  // to whatever runs beside it; a large one takes one wave of resident blocks and strides.
  const int64_t blocks = oneshot_grid(
      a.count, elem_size(dtype), a.vec,
      resident.get(reinterpret_cast<const void*>(kernel), kOneshotThreads, device));
  void* args[] = {&a};
  RR_CUDA_CHECK(cudaLaunchKernel(kernel, dim3(unsigned(blocks)), dim3(kOneshotThreads), args, 0,
                                 stream),
                std::string(a.nout < a.nranks ? "launching the two-shot all-reduce's chunk kernel ("
                                               : "launching the one-shot all-reduce kernel (") +
                    dtype_name(dtype) +
                    " " + op_name(op) + (once ? ", rounded once" : "") + ", " +
                    std::to_string(a.nranks) + " ranks, " + std::to_string(a.count) +
                    " elements) on cuda:" + std::to_string(device));
}

template <typename T, Op op>
void launch_ring_order(OneshotArgs& a, DType dtype, cudaStream_t stream, int device) {
  static ResidentCache resident;
  launch(&oneshot_kernel<T, op>, resident, false, a, dtype, op, stream, device);
}

template <typename T, Op op>
void launch_once(OneshotArgs& a, DType dtype, cudaStream_t stream, int device) {
  static ResidentCache resident;
  launch(&oneshot_once_kernel<T, op>, resident, true, a, dtype, op, stream, device);
}

// The once-rounded kernel of (dtype, op), which oneshot_rounds_once takes.
void launch_once_of(OneshotArgs& a, DType dtype, Op op, cudaStream_t stream, int device) {
  const bool avg = op == Op::Avg;
  if (dtype == DType::F16) {
    avg ? launch_once<half_bits, Op::Avg>(a, dtype, stream, device)
        : launch_once<half_bits, Op::Sum>(a, dtype, stream, device);
  } else {
    avg ? launch_once<bf16_bits, Op::Avg>(a, dtype, stream, device)
        : launch_once<bf16_bits, Op::Sum>(a, dtype, stream, device);
  }
}

void check_once(int64_t count, DType dtype, Op op, const char* what) {
  if (count < 0) {
    throw std::invalid_argument("ringreduce: count must be >= 0, got " + std::to_string(count));
  }
  if (!oneshot_rounds_once(dtype, op)) {
    throw std::invalid_argument(std::string("ringreduce: the once-rounded ") + what +
                                " takes float16 and bfloat16 sum and avg; got " +
                                dtype_name(dtype) + " " + op_name(op));
  }
}

}  // namespace

void launch_oneshot(const void* const* in, void* const* out, int nranks, int64_t count,
                    DType dtype, Op op, cudaStream_t stream, int device, bool once) {
  if (once) {
    check_once(count, dtype, op, "one-shot");
  } else if (count < 0) {
    throw std::invalid_argument("ringreduce: count must be >= 0, got " + std::to_string(count));
  }
  OneshotArgs a = make_oneshot_args(in, out, nranks, count);
  if (count == 0) return;
  if (once) {
    launch_once_of(a, dtype, op, stream, device);
    return;
  }
  RR_DISPATCH(dtype, op, launch_ring_order<T, kOp>(a, dtype, stream, device));
}

void launch_chunk_once(const void* const* in, void* out, int nranks, int64_t count, DType dtype,
                       Op op, cudaStream_t stream, int device) {
  check_once(count, dtype, op, "two-shot");
  void* const outs[1] = {out};
  OneshotArgs a = make_oneshot_args(in, outs, nranks, count, 1);
  if (count == 0) return;
  launch_once_of(a, dtype, op, stream, device);
}

}  // namespace cuda
}  // namespace rr
