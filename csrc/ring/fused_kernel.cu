// The fused ring all-reduce kernel (fused.h's body with the device memory policy) and its
// cooperative launch.
#include "fused_cuda.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda_check.h"
#include "cuda_kernels.h"
#include "fused.h"
#include "launch.h"

namespace rr {
namespace cuda {

namespace {

// %globaltimer: nanoseconds, the same clock on every SM and independent of the SM clock (which
// boost changes), so the bound is wall time; clock64 would count cycles of one SM.
__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// fused.h's Sync on the GPU. Flags are polled and written with volatile accesses (relaxed at
// system scope in the PTX memory model) and made release / acquire by __threadfence
// (fence.sc.gpu): every observer is a block of this grid, on this GPU, whichever device holds
// the buffers.
struct DeviceSync {
  uint64_t* flags;
  uint64_t timeout_ns;

  __device__ bool leader() const { return threadIdx.x == 0; }
  __device__ int first_thread() const { return int(threadIdx.x); }
  __device__ int end_thread() const { return int(threadIdx.x) + 1; }
  __device__ int64_t threads() const { return int64_t(blockDim.x); }
  __device__ void pause() const {}

  __device__ uint64_t load(int64_t w) const {
    return *reinterpret_cast<volatile uint64_t*>(flags + w);
  }
  __device__ void store(int64_t w, uint64_t v) const {
    *reinterpret_cast<volatile uint64_t*>(flags + w) = v;
  }
  __device__ uint64_t fetch_max(int64_t w, uint64_t v) const {
    return atomicMax(reinterpret_cast<unsigned long long*>(flags + w), (unsigned long long)v);
  }

  // Thread 0 polls; the barrier hands its verdict, and the order its fence established, to
  // every thread. `status` is rewritten only at the next wait, after publish's barrier, which
  // every thread passes after reading it here.
  __device__ FusedStatus wait(int64_t w, uint64_t target, uint64_t epoch, uint64_t* seen) const {
    __shared__ int status;
    if (threadIdx.x == 0) {
      FusedStatus st = FusedStatus::Done;
      uint64_t v = load(w);
      if (v < target) {
        const uint64_t start = global_ns();
        while ((v = load(w)) < target) {
          if (load(kFusedFailedEpoch) >= epoch) {
            st = FusedStatus::Aborted;
            break;
          }
          if (global_ns() - start > timeout_ns) {
            st = FusedStatus::TimedOut;
            break;
          }
        }
      }
      __threadfence();  // acquire: the writer's data before every read after the barrier
      *seen = v;
      status = int(st);
    }
    __syncthreads();
    return FusedStatus(status);
  }

  __device__ void publish(int64_t w, uint64_t v) const {
    __syncthreads();  // every thread's loads and stores of the step are done
    if (threadIdx.x == 0) {
      __threadfence();  // release: cumulative over what the barrier ordered before it
      store(w, v);
    }
  }
};

template <typename T, Op op>
__global__ void __launch_bounds__(kFusedThreads)
    fused_kernel(const __grid_constant__ FusedArgs a, uint64_t* flags, uint64_t timeout_ns) {
  DeviceSync sync{flags, timeout_ns};
  fused_all_reduce_block<T, op>(a, int(blockIdx.x) / a.blocks, int(blockIdx.x) % a.blocks, sync);
}

const void* fused_kernel_for(DType dtype, Op op) {
  const void* fn = nullptr;
  RR_DISPATCH(dtype, op, fn = reinterpret_cast<const void*>(&fused_kernel<T, kOp>));
  return fn;
}

// Blocks of `fn` the current device holds at once; throws where cooperative launches are not
// supported (the co-residency the flags need would not be guaranteed).
int64_t cooperative_capacity(const void* fn, int* device_out) {
  int device = 0;
  RR_CUDA_CHECK(cudaGetDevice(&device), "sizing the fused all-reduce's grid");
  int coop = 0;
  RR_CUDA_CHECK(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, device),
                "asking whether cuda:" + std::to_string(device) + " supports cooperative launches");
  if (coop == 0) {
    throw std::runtime_error(
        "ringreduce: the fused all-reduce needs cooperative launches, which cuda:" +
        std::to_string(device) + " does not support");
  }
  if (device_out != nullptr) *device_out = device;
  return resident_blocks(fn, kFusedThreads, device);
}

}  // namespace

void init_fused_flags(void* flags, int64_t bytes, cudaStream_t stream) {
  if (flags == nullptr || bytes < fused_flags_bytes(1, 1)) {
    throw std::invalid_argument("ringreduce: flags must be a device buffer of at least " +
                                std::to_string(fused_flags_bytes(1, 1)) + " bytes, got " +
                                std::to_string(bytes) + " bytes");
  }
  RR_CUDA_CHECK(cudaMemsetAsync(flags, 0, size_t(bytes), stream), "zeroing a fused flag buffer");
}

int64_t fused_resident_blocks(DType dtype, Op op) {
  return cooperative_capacity(fused_kernel_for(dtype, op), nullptr);
}

int fused_max_blocks_per_rank(int nranks, DType dtype, Op op) {
  check_fused_nranks(nranks);  // before asking the device
  return rr::fused_max_blocks_per_rank(nranks, fused_resident_blocks(dtype, op));
}

int fused_blocks_per_rank(int requested, int nranks, int64_t count, DType dtype, Op op,
                          int64_t flags_bytes) {
  check_fused_nranks(nranks);
  return rr::fused_blocks_per_rank(requested, nranks, count, elem_size(dtype),
                                   fused_resident_blocks(dtype, op), flags_bytes);
}

void launch_fused_all_reduce(const void* const* in, void* const* out, int nranks, int64_t count,
                             DType dtype, Op op, int blocks_per_rank, void* flags,
                             int64_t flags_bytes, uint64_t epoch, cudaStream_t stream,
                             uint64_t timeout_ns) {
  const FusedArgs a = make_fused_args(in, out, nranks, count, blocks_per_rank, epoch);
  if (flags == nullptr || reinterpret_cast<uintptr_t>(flags) % 8 != 0 ||
      flags_bytes < fused_flags_bytes(nranks, blocks_per_rank)) {
    throw std::invalid_argument(
        "ringreduce: flags must be an 8-byte aligned device buffer of at least "
        "fused_flags_bytes(nranks=" + std::to_string(nranks) + ", blocks_per_rank=" +
        std::to_string(blocks_per_rank) + ") = " +
        std::to_string(fused_flags_bytes(nranks, blocks_per_rank)) + " bytes, got " +
        std::to_string(flags_bytes) + " bytes" + (flags == nullptr ? " at null" : ""));
  }
  if (timeout_ns == 0) throw std::invalid_argument("ringreduce: timeout_ns must be > 0");
  if (count == 0) return;
  if (nranks == 1) {
    // The ring of one rank is a copy (all_reduce_plan): no steps, no flags.
    if (out[0] != in[0]) {
      RR_CUDA_CHECK(cudaMemcpyAsync(out[0], in[0], size_t(count * elem_size(dtype)),
                                    cudaMemcpyDefault, stream),
                    "copying the one rank of a fused all-reduce");
    }
    return;
  }
  const void* fn = fused_kernel_for(dtype, op);
  int device = 0;
  const int64_t cap = cooperative_capacity(fn, &device);
  const int64_t grid = int64_t(nranks) * blocks_per_rank;
  const std::string what = std::string("the fused all-reduce (") + dtype_name(dtype) + " " +
                           op_name(op) + ", " + std::to_string(nranks) + " ranks x " +
                           std::to_string(blocks_per_rank) + " blocks, " +
                           std::to_string(count) + " elements) on cuda:" + std::to_string(device);
  if (grid > cap) {
    throw std::invalid_argument(
        "ringreduce: nranks * blocks_per_rank must be <= the blocks cuda:" +
        std::to_string(device) + " holds at once (" + std::to_string(cap) +
        ", fused_max_blocks_per_rank), or blocks that wait for blocks never started would "
        "deadlock; got blocks_per_rank=" + std::to_string(blocks_per_rank) + " for " + what);
  }
  FusedArgs args = a;
  uint64_t* words = static_cast<uint64_t*>(flags);
  uint64_t timeout = timeout_ns;
  void* params[] = {&args, &words, &timeout};
  // A cooperative launch starts the grid only when every block can be resident at once, and
  // fails (cudaErrorCooperativeLaunchTooLarge) rather than run part of it.
  RR_CUDA_CHECK(cudaLaunchCooperativeKernel(fn, dim3(unsigned(grid)), dim3(kFusedThreads), params, 0,
                                            stream),
                "launching " + what);
}

void check_fused_all_reduce(const void* flags, uint64_t first_epoch, cudaStream_t stream) {
  if (flags == nullptr) throw std::invalid_argument("ringreduce: flags must not be null");
  std::vector<uint64_t> words(kFusedLineWords);
  const auto read = [&](int64_t n) {
    words.resize(size_t(n));
    RR_CUDA_CHECK(cudaMemcpyAsync(words.data(), flags, size_t(n) * 8, cudaMemcpyDeviceToHost,
                                  stream),
                  "reading the fused all-reduce's failure record");
    RR_CUDA_CHECK(cudaStreamSynchronize(stream), "waiting for the fused all-reduce");
  };
  read(kFusedLineWords);
  if (fused_error_message(words.data(), kFusedLineWords, first_epoch).empty()) return;
  // The failed call used a buffer of at least this size: read its progress flags too.
  const int64_t ranks = int64_t(words[kFusedErrRanks]), blocks = int64_t(words[kFusedErrBlocks]);
  if (ranks >= 1 && ranks <= kFusedMaxRanks && blocks >= 1 && blocks <= (1 << 20)) {
    read(fused_flags_bytes(int(ranks), int(blocks)) / 8);
  }
  throw std::runtime_error(fused_error_message(words.data(), int64_t(words.size()), first_epoch));
}

}  // namespace cuda
}  // namespace rr
