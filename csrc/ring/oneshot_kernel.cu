// The one-shot all-reduce kernel: each thread reduces whole indices (a 16-byte pack or one
// element) over all ranks in the ring's order and writes them to every output (oneshot.h).
#include "oneshot_cuda.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>

#include "cuda_check.h"
#include "oneshot.h"

namespace rr {
namespace cuda {

namespace {

constexpr int kThreads = 256;

template <typename T, Op op>
__global__ void __launch_bounds__(kThreads) oneshot_kernel(const __grid_constant__ OneshotArgs a) {
  oneshot_thread<T, op>(a, int64_t(blockIdx.x) * blockDim.x + threadIdx.x,
                        int64_t(gridDim.x) * blockDim.x);
}

// How many blocks of `fn` the device holds at once (SMs x blocks per SM), computed once per
// kernel and device.
int64_t resident_blocks(const void* fn, int device) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, int64_t> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find({fn, device});
  if (it != cache.end()) return it->second;
  const std::string ctx = "sizing the one-shot kernel's grid on cuda:" + std::to_string(device);
  int sms = 0, per_sm = 0;
  RR_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), ctx);
  RR_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, kThreads, 0), ctx);
  const int64_t n = std::max<int64_t>(1, int64_t(sms) * per_sm);
  cache[{fn, device}] = n;
  return n;
}

}  // namespace

void launch_oneshot(const void* const* in, void* const* out, int nranks, int64_t count,
                    DType dtype, Op op, cudaStream_t stream) {
  if (count < 0) {
    throw std::invalid_argument("ringreduce: count must be >= 0, got " + std::to_string(count));
  }
  OneshotArgs a = make_oneshot_args(in, out, nranks, count);
  if (count == 0) return;
  const void* fn = nullptr;
  RR_DISPATCH(dtype, op, fn = reinterpret_cast<const void*>(&oneshot_kernel<T, kOp>));
  int device = 0;
  RR_CUDA_CHECK(cudaGetDevice(&device), "launching the one-shot all-reduce");
  // One thread per pack (or element), so a small call takes few blocks and leaves the other SMs
  // to whatever runs beside it; a large one takes one wave of resident blocks and strides.
  const int64_t lanes = 16 / elem_size(dtype);
  const int64_t items = a.vec ? std::max(count / lanes, count % lanes) : count;
  const int64_t want = (items + kThreads - 1) / kThreads;
  const int64_t blocks = std::min(want, resident_blocks(fn, device));
  void* args[] = {&a};
  RR_CUDA_CHECK(cudaLaunchKernel(fn, dim3(unsigned(blocks)), dim3(kThreads), args, 0, stream),
                std::string("launching the one-shot all-reduce kernel (") + dtype_name(dtype) +
                    " " + op_name(op) + ", " + std::to_string(nranks) + " ranks, " +
                    std::to_string(count) + " elements) on cuda:" + std::to_string(device));
}

}  // namespace cuda
}  // namespace rr
