// The ring's kernels: one launch per lane per ring step (csrc/ring/cuda_executor.cu queues
// them), also used by the multi-process CUDA collectives; plus device queries. Torch-free.
//
// Why kernels that read the predecessor's buffer directly rather than cudaMemcpyPeerAsync into
// a staging buffer plus a local reduce: the fused kernel reads the peer chunk once and writes
// the result once (3 bytes of traffic per byte reduced: read mine, read peer, write mine); the
// copy-engine design adds a write and a read of the staging buffer (5, see docs/DESIGN.md),
// and needs a scratch allocation. The staged design is used for neighbour pairs without peer
// access, and everywhere when the caller forces it (RINGREDUCE_TRANSPORT=copy), which makes
// it testable and measurable on one GPU. This choice is the design's prediction; bench/ring.py
// run with both transports on a GPU decides it.
#include "cuda_kernels.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <tuple>

#include "cuda_check.h"
#include "launch.h"

namespace rr {
namespace cuda {

namespace {

struct StepParams {
  Task task[kStepTasks];
  int nranks;
};

// blockIdx.y picks the task (one rank's chunk); blockIdx.x and threads stride over it
// (step.h's step_thread), kUnroll packs in flight per thread.
template <typename T, Op op, bool kReduce, bool kLast, int kUnroll>
__global__ void __launch_bounds__(kStepThreads) step_kernel(const __grid_constant__ StepParams p) {
  step_thread<T, op, kReduce, kLast, kUnroll>(p.task[blockIdx.y], p.nranks,
                                              int64_t(blockIdx.x) * blockDim.x + threadIdx.x,
                                              int64_t(gridDim.x) * blockDim.x);
}

template <typename T, Op op, bool kReduce, bool kLast, int kUnroll>
const void* kernel_ptr() {
  return reinterpret_cast<const void*>(&step_kernel<T, op, kReduce, kLast, kUnroll>);
}

// RINGREDUCE_CUDA_STEP_UNROLL: how many 16-byte packs each thread of a step kernel keeps in
// flight (step.h's kUnroll): 1, the default, or 4. Read once, at the process's first step
// launch. Not the default until a GPU run shows it right and faster (issue 46: at 1-16 MiB one
// load in flight per thread leaves the step latency-bound).
int step_unroll() {
  static const int unroll = [] {
    const char* v = std::getenv("RINGREDUCE_CUDA_STEP_UNROLL");
    if (v == nullptr || *v == '\0' || std::strcmp(v, "1") == 0) return 1;
    if (std::strcmp(v, "4") == 0) return 4;
    throw std::invalid_argument(std::string("ringreduce: RINGREDUCE_CUDA_STEP_UNROLL must be 1 "
                                            "(the default) or 4; got '") + v + "'");
  }();
  return unroll;
}

// One step kernel's launches, kStepTasks tasks each. Launched through the kernel's typed
// pointer (CUDA's template overload of cudaLaunchKernel), so that the fake runtime of
// tests/fake_cuda can run the kernel and count its parameters' bytes.
template <typename T, Op op, bool kReduce, bool kLast, int kUnroll>
void launch_steps(const Task* tasks, int ntasks, DType dtype, Op caller_op, int nranks,
                  cudaStream_t stream, int device) {
  static ResidentCache resident;
  for (int i = 0; i < ntasks; i += kStepTasks) {
    const int batch = std::min(kStepTasks, ntasks - i);
    StepParams p;
    int64_t max_n = 0;
    for (int j = 0; j < batch; ++j) {
      p.task[j] = tasks[i + j];
      max_n = std::max(max_n, tasks[i + j].n);
    }
    p.nranks = nranks;
    if (max_n == 0) continue;
    // One full wave of resident blocks across all tasks of the launch fills the chip; how many
    // fit per SM depends on each instantiation's registers (docs/PTXAS.md).
    const dim3 grid(unsigned(step_grid_x(max_n, elem_size(dtype), batch,
                                         resident.get(kernel_ptr<T, op, kReduce, kLast, kUnroll>(),
                                                      kStepThreads, device))),
                    unsigned(batch));
    void* args[] = {&p};
    RR_CUDA_CHECK(cudaLaunchKernel(&step_kernel<T, op, kReduce, kLast, kUnroll>, grid,
                                   dim3(kStepThreads), args, 0, stream),
                  std::string("launching the ") + (kReduce ? "reduce" : "copy") +
                      " kernel for " + dtype_name(dtype) + " " + op_name(caller_op) +
                      " on cuda:" + std::to_string(device));
  }
}

int sm_count(int device) {
  static std::array<std::atomic<int>, 256> cache{};
  if (device < 0 || device >= int(cache.size())) return 1;
  int v = cache[device].load(std::memory_order_relaxed);
  if (v == 0) {
    RR_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, device),
                  "reading the SM count of cuda:" + std::to_string(device));
    cache[device].store(v, std::memory_order_relaxed);
  }
  return v;
}

int blocks_per_sm(const void* fn, int threads, int device) {
  static std::mutex mu;
  static std::map<std::tuple<const void*, int, int>, int> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find({fn, threads, device});
  if (it != cache.end()) return it->second;
  int n = 0;
  RR_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, fn, threads, 0),
                "computing the occupancy of a ring kernel on cuda:" + std::to_string(device));
  n = std::max(n, 1);
  cache[{fn, threads, device}] = n;
  return n;
}

// The reduce, last-reduce or copy kernel of one unroll.
template <typename T, Op op, int kUnroll>
void launch_kind(const Task* tasks, int ntasks, DType dtype, Op caller_op, bool reduce, bool last,
                 int nranks, cudaStream_t stream, int device) {
  if (!reduce) {
    launch_steps<T, op, false, false, kUnroll>(tasks, ntasks, dtype, caller_op, nranks, stream,
                                               device);
  } else if (last) {
    launch_steps<T, op, true, true, kUnroll>(tasks, ntasks, dtype, caller_op, nranks, stream,
                                             device);
  } else {
    launch_steps<T, op, true, false, kUnroll>(tasks, ntasks, dtype, caller_op, nranks, stream,
                                              device);
  }
}

std::mutex g_mutex;
std::map<int, bool> g_supported;

}  // namespace

void launch_step(const Task* tasks, int ntasks, DType dtype, Op op, bool reduce, bool last,
                 int nranks, cudaStream_t stream, int device) {
  if (ntasks <= 0) return;
  if (ntasks > kMaxRanks) throw std::runtime_error("ringreduce: too many tasks in one step");
  // Copies do not depend on the operator: one copy kernel per dtype.
  const bool unrolled = step_unroll() == 4;
  RR_DISPATCH(dtype, reduce ? op : Op::Sum,
              unrolled ? launch_kind<T, kOp, 4>(tasks, ntasks, dtype, op, reduce, last, nranks,
                                                stream, device)
                       : launch_kind<T, kOp, 1>(tasks, ntasks, dtype, op, reduce, last, nranks,
                                                stream, device));
}

void launch_step(const Task* tasks, int ntasks, DType dtype, Op op, bool reduce, bool last,
                 int nranks, cudaStream_t stream) {
  int device = 0;
  RR_CUDA_CHECK(cudaGetDevice(&device), "launching a ring step");
  launch_step(tasks, ntasks, dtype, op, reduce, last, nranks, stream, device);
}

int64_t resident_blocks(const void* fn, int threads, int device) {
  return int64_t(blocks_per_sm(fn, threads, device)) * sm_count(device);
}

void check_device_supported(int device) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_supported.find(device);
  if (it != g_supported.end() && it->second) return;
  DeviceGuard guard;
  guard.set(device);
  cudaFuncAttributes attr;
  cudaError_t err = cudaFuncGetAttributes(&attr, kernel_ptr<float, Op::Sum, true, false, 1>());
  if (err == cudaErrorNoKernelImageForDevice || err == cudaErrorInvalidDeviceFunction) {
    cudaGetLastError();
    int major = 0, minor = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
    throw std::runtime_error(
        "ringreduce was compiled for compute capabilities '" RINGREDUCE_ARCH_LIST
        "' (RINGREDUCE_CUDA_ARCH_LIST), which cannot run on cuda:" + std::to_string(device) + " (compute capability " +
        std::to_string(major) + "." + std::to_string(minor) +
        "); rebuild with RINGREDUCE_CUDA_ARCH_LIST including " + std::to_string(major) + "." +
        std::to_string(minor));
  }
  if (err != cudaSuccess) fail(err, "cudaFuncGetAttributes", "checking cuda:" + std::to_string(device));
  g_supported[device] = true;
}

int device_count() {
  int n = 0;
  cudaError_t err = cudaGetDeviceCount(&n);
  if (err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver) {
    cudaGetLastError();
    return 0;
  }
  if (err != cudaSuccess) fail(err, "cudaGetDeviceCount", "counting devices");
  return n;
}

std::vector<std::vector<int>> peer_access_matrix() {
  const int n = device_count();
  std::vector<std::vector<int>> m(n, std::vector<int>(n, 0));
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      if (i == j) {
        m[i][j] = 1;
      } else {
        RR_CUDA_CHECK(cudaDeviceCanAccessPeer(&m[i][j], i, j),
                      "asking whether cuda:" + std::to_string(i) + " can access cuda:" +
                          std::to_string(j));
      }
    }
  }
  return m;
}

std::string device_name(int device) {
  cudaDeviceProp prop;
  RR_CUDA_CHECK(cudaGetDeviceProperties(&prop, device), "reading cuda:" + std::to_string(device));
  return prop.name;
}

}  // namespace cuda
}  // namespace rr
