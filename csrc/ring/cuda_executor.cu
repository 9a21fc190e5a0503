// Single-process CUDA ring: one kernel launch per device per ring step.
//
// Why kernels that read the predecessor's buffer directly rather than cudaMemcpyPeerAsync into
// a staging buffer plus a local reduce: the fused kernel reads the peer chunk once and writes
// the result once (3 bytes of traffic per byte reduced: read mine, read peer, write mine); the
// copy-engine design adds a write and a read of the staging buffer (5, see docs/DESIGN.md),
// and needs a scratch allocation. The staged design is used for neighbour pairs without peer
// access, and everywhere when the caller forces it (RINGREDUCE_TRANSPORT=copy), which makes
// it testable and measurable on one GPU. This choice is the design's prediction; bench/ring.py
// run with both transports on a GPU decides it.
#include "cuda_executor.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <map>
#include <mutex>
#include <stdexcept>

#include "cuda_check.h"
#include "schedule.h"


namespace rr {
namespace cuda {

namespace {

constexpr int kThreads = 512;

struct StepParams {
  Task task[kMaxRanks];
  int nranks;
};

template <typename T, Op op, bool kReduce, bool kLast>
__device__ __forceinline__ T apply(T mine, T incoming, typename Reducer<T, op>::D divisor) {
  if (!kReduce) return incoming;
  if (kLast) return Reducer<T, op>::last_step(mine, incoming, divisor);
  return Reducer<T, op>::step(mine, incoming);
}

// blockIdx.y picks the task (one rank's chunk); blockIdx.x and threads stride over it. 16-byte
// vectors when both pointers are 16-byte aligned (chunk offsets always are, so this depends
// only on the tensors' own alignment), element by element otherwise and for the tail.
template <typename T, Op op, bool kReduce, bool kLast>
__global__ void __launch_bounds__(kThreads) step_kernel(const __grid_constant__ StepParams p) {
  using D = typename Reducer<T, op>::D;
  const Task& task = p.task[blockIdx.y];
  T* dst = static_cast<T*>(task.dst);
  const T* own = task.own != nullptr ? static_cast<const T*>(task.own) : dst;
  const T* src = static_cast<const T*>(task.src);
  const int64_t n = task.n;
  const D divisor = D(p.nranks);
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  constexpr int kVec = 16 / int(sizeof(T));

  int64_t head = 0;
  if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(own) |
        reinterpret_cast<uintptr_t>(src)) & 15) == 0) {
    const int64_t nvec = n / kVec;
    uint4* dv = reinterpret_cast<uint4*>(dst);
    const uint4* ov = reinterpret_cast<const uint4*>(own);
    const uint4* sv = reinterpret_cast<const uint4*>(src);
    for (int64_t i = tid; i < nvec; i += stride) {
      uint4 in = sv[i];
      if (kReduce) {
        uint4 mine = ov[i];
        T m[kVec], x[kVec];
        memcpy(m, &mine, 16);
        memcpy(x, &in, 16);
#pragma unroll
        for (int j = 0; j < kVec; ++j) m[j] = apply<T, op, kReduce, kLast>(m[j], x[j], divisor);
        memcpy(&in, m, 16);
      }
      dv[i] = in;
    }
    head = nvec * kVec;
  }
  for (int64_t i = head + tid; i < n; i += stride) {
    dst[i] = apply<T, op, kReduce, kLast>(own[i], src[i], divisor);
  }
}

template <typename T, Op op, bool kReduce, bool kLast>
const void* kernel_ptr() {
  return reinterpret_cast<const void*>(&step_kernel<T, op, kReduce, kLast>);
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

int blocks_per_sm(const void* fn, int device) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, int> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find({fn, device});
  if (it != cache.end()) return it->second;
  int n = 0;
  RR_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, fn, kThreads, 0),
                "computing the occupancy of a ring kernel on cuda:" + std::to_string(device));
  n = std::max(n, 1);
  cache[{fn, device}] = n;
  return n;
}

// Per-device resources kept across calls: events for cross-device ordering (reused: a wait
// refers to the record queued most recently before it, and every record of a call is queued
// on the host before the waits that need it), and the staging buffer for pairs without peer
// access with an event marking its last use.
struct DeviceState {
  std::vector<cudaEvent_t> events;
  void* stage = nullptr;
  size_t stage_bytes = 0;
  cudaEvent_t stage_free = nullptr;
};

std::mutex g_mutex;
std::map<int, DeviceState> g_devices;
std::map<std::pair<int, int>, bool> g_peer;  // (reader, owner) -> direct access enabled
std::map<int, bool> g_supported;

cudaEvent_t new_event(int device) {
  cudaEvent_t ev;
  RR_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming),
                "creating an event on cuda:" + std::to_string(device));
  return ev;
}

DeviceState& device_state(DeviceGuard& guard, int device, size_t nevents) {
  DeviceState& st = g_devices[device];
  if (st.events.size() < nevents) {
    guard.set(device);
    while (st.events.size() < nevents) st.events.push_back(new_event(device));
  }
  return st;
}

// Enables direct access from `reader` to `owner`'s memory where the hardware allows it.
bool ensure_peer(DeviceGuard& guard, int reader, int owner) {
  auto key = std::make_pair(reader, owner);
  auto it = g_peer.find(key);
  if (it != g_peer.end()) return it->second;
  int can = 0;
  RR_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, reader, owner),
                "asking whether cuda:" + std::to_string(reader) + " can access cuda:" +
                    std::to_string(owner));
  if (can) {
    guard.set(reader);
    cudaError_t err = cudaDeviceEnablePeerAccess(owner, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      cudaGetLastError();
    } else if (err == cudaErrorTooManyPeers || err == cudaErrorPeerAccessUnsupported) {
      cudaGetLastError();  // the hardware said yes but cannot map: stage this pair instead
      can = 0;
    } else if (err != cudaSuccess) {
      fail(err, "cudaDeviceEnablePeerAccess", "enabling peer access from cuda:" +
                                                  std::to_string(reader) + " to cuda:" +
                                                  std::to_string(owner));
    }
  }
  g_peer[key] = can != 0;
  return can != 0;
}

void* ensure_stage(DeviceGuard& guard, DeviceState& st, int device, size_t bytes) {
  if (st.stage_bytes >= bytes) return st.stage;
  guard.set(device);
  const std::string ctx = "allocating a " + std::to_string(bytes) +
                          "-byte staging buffer on cuda:" + std::to_string(device);
  if (st.stage) {
    // The last call that used the buffer recorded stage_free after its final use.
    RR_CUDA_CHECK(cudaEventSynchronize(st.stage_free), ctx);
    RR_CUDA_CHECK(cudaFree(st.stage), ctx);
  }
  st.stage = nullptr;
  st.stage_bytes = 0;
  RR_CUDA_CHECK(cudaMalloc(&st.stage, bytes), ctx);
  st.stage_bytes = bytes;
  if (!st.stage_free) st.stage_free = new_event(device);
  return st.stage;
}

std::string where(int step, int device) {
  return "ring step " + std::to_string(step) + " on cuda:" + std::to_string(device);
}

}  // namespace

void launch_step(const Task* tasks, int ntasks, DType dtype, Op op, bool reduce, bool last,
                 int nranks, cudaStream_t stream) {
  if (ntasks <= 0) return;
  if (ntasks > kMaxRanks) throw std::runtime_error("ringreduce: too many tasks in one step");
  StepParams p;
  int64_t max_n = 0;
  for (int i = 0; i < ntasks; ++i) {
    p.task[i] = tasks[i];
    max_n = std::max(max_n, tasks[i].n);
  }
  p.nranks = nranks;
  if (max_n == 0) return;
  int device = 0;
  RR_CUDA_CHECK(cudaGetDevice(&device), "launching a ring step");
  const void* fn = nullptr;
  // Copies do not depend on the operator: one copy kernel per dtype.
  RR_DISPATCH(dtype, reduce ? op : Op::Sum,
              fn = reduce ? (last ? kernel_ptr<T, kOp, true, true>()
                                  : kernel_ptr<T, kOp, true, false>())
                          : kernel_ptr<T, kOp, false, false>());
  const int64_t esize = elem_size(dtype);
  const int64_t vec = 16 / esize;
  const int64_t want = (max_n / vec + kThreads) / kThreads;
  // One full wave of resident blocks across all tasks of the launch fills the chip; how many
  // fit per SM depends on each instantiation's registers (29-50 on sm_90 per ptxas -v).
  const int64_t cap =
      std::max<int64_t>(1, int64_t(blocks_per_sm(fn, device)) * sm_count(device) / ntasks);
  const dim3 grid(unsigned(std::min(std::max<int64_t>(want, 1), cap)), unsigned(ntasks));
  void* args[] = {&p};
  RR_CUDA_CHECK(cudaLaunchKernel(fn, grid, dim3(kThreads), args, 0, stream),
                std::string("launching the ") + (reduce ? "reduce" : "copy") + " kernel for " +
                    dtype_name(dtype) + " " + op_name(op) + " on cuda:" + std::to_string(device));
}

std::vector<std::string> run(const Plan& plan, const int* rank_device, int nranks, DType dtype,
                             Op op, const DeviceStream* streams, int nstreams, bool force_copy) {
  std::vector<std::string> staged;
  if (plan.empty()) return staged;
  if (nranks > kMaxRanks) {
    throw std::runtime_error("ringreduce: at most " + std::to_string(kMaxRanks) +
                             " ranks are supported, got " + std::to_string(nranks));
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  DeviceGuard guard;

  std::map<int, cudaStream_t> stream_of;
  for (int i = 0; i < nstreams; ++i) stream_of[streams[i].device] = streams[i].stream;
  std::vector<int> devices;  // distinct devices in rank order
  for (int r = 0; r < nranks; ++r) {
    if (!stream_of.count(rank_device[r])) {
      throw std::runtime_error("ringreduce: no stream given for cuda:" +
                               std::to_string(rank_device[r]));
    }
    if (std::find(devices.begin(), devices.end(), rank_device[r]) == devices.end()) {
      devices.push_back(rank_device[r]);
    }
  }
  const bool multi = devices.size() > 1;
  const int64_t steps = int64_t(plan.size());
  const int64_t esize = elem_size(dtype);
  // The largest combine hop: the size of one staging slot.
  int64_t slot_bytes = 0;
  for (const PlanStep& step : plan) {
    for (const Move& m : step.moves) {
      if (step.reduce && m.src_rank != m.rank) slot_bytes = std::max(slot_bytes, m.n * esize);
    }
  }

  // Event layout per device: [0] entry, [1 + k] after step k, [1 + steps] exit.
  std::map<int, DeviceState*> state;
  for (int d : devices) state[d] = &device_state(guard, d, multi ? size_t(steps + 2) : 0);

  // Which ranks read their predecessor through copies (a staging buffer for combine hops,
  // straight into place for copy hops), and their slot in the staging buffer.
  std::vector<int> slot(nranks, -1);
  std::map<int, int> slots_on;
  for (int r = 0; r < nranks && nranks > 1; ++r) {
    const int p = mod(r - 1, nranks);
    const int rd = rank_device[r], pd = rank_device[p];
    const bool no_peer = rd != pd && !ensure_peer(guard, rd, pd);
    if (no_peer || force_copy) slot[r] = slots_on[rd]++;
    if (no_peer) {
      staged.push_back("rank " + std::to_string(r) + " (cuda:" + std::to_string(rd) +
                       ") <- rank " + std::to_string(p) + " (cuda:" + std::to_string(pd) + ")");
    }
  }
  std::map<int, char*> stage;
  if (slot_bytes > 0) {
    for (auto& kv : slots_on) {
      DeviceState& st = *state[kv.first];
      stage[kv.first] = static_cast<char*>(
          ensure_stage(guard, st, kv.first, size_t(kv.second) * size_t(slot_bytes)));
    }
  }

  if (multi) {
    // Entry: no device may write its buffers before every device's earlier work on its own
    // stream (the inputs, and the previous call's reads of the neighbours) is done.
    for (int d : devices) {
      guard.set(d);
      RR_CUDA_CHECK(cudaEventRecord(state[d]->events[0], stream_of[d]), "entering the ring");
    }
    for (int d : devices) {
      guard.set(d);
      for (int e : devices) {
        if (e != d) {
          RR_CUDA_CHECK(cudaStreamWaitEvent(stream_of[d], state[e]->events[0], 0),
                        "ordering cuda:" + std::to_string(d) + " after cuda:" +
                            std::to_string(e) + " at entry");
        }
      }
    }
  }
  for (auto& kv : stage) {
    guard.set(kv.first);
    RR_CUDA_CHECK(cudaStreamWaitEvent(stream_of[kv.first], state[kv.first]->stage_free, 0),
                  "waiting for the staging buffer on cuda:" + std::to_string(kv.first));
  }

  std::vector<Task> tasks;
  for (int64_t k = 0; k < steps; ++k) {
    const PlanStep& step = plan[size_t(k)];
    for (int d : devices) {
      guard.set(d);
      cudaStream_t s = stream_of[d];
      tasks.clear();
      std::vector<int> waited;
      for (const Move& m : step.moves) {
        if (rank_device[m.rank] != d) continue;
        const int pd = rank_device[m.src_rank];
        // A move at step k reads what its predecessor wrote at step k-1 (entry covers k = 0).
        if (pd != d && k > 0 && std::find(waited.begin(), waited.end(), pd) == waited.end()) {
          RR_CUDA_CHECK(cudaStreamWaitEvent(s, state[pd]->events[k], 0), where(int(k), d));
          waited.push_back(pd);
        }
        const void* src = m.src;
        const size_t bytes = size_t(m.n * esize);
        if (m.src_rank != m.rank && slot[m.rank] >= 0) {
          if (!step.reduce) {
            RR_CUDA_CHECK(cudaMemcpyPeerAsync(m.dst, d, src, pd, bytes, s),
                          "copying " + where(int(k), d));
            continue;
          }
          char* tmp = stage[d] + int64_t(slot[m.rank]) * slot_bytes;
          RR_CUDA_CHECK(cudaMemcpyPeerAsync(tmp, d, src, pd, bytes, s),
                        "staging " + where(int(k), d));
          src = tmp;
        }
        tasks.push_back(Task{m.dst, src, m.n, m.own});
      }
      for (size_t i = 0; i < tasks.size(); i += kMaxRanks) {
        const int batch = int(std::min(tasks.size() - i, size_t(kMaxRanks)));
        launch_step(tasks.data() + i, batch, dtype, op, step.reduce, step.last, nranks, s);
      }
      if (multi) {
        RR_CUDA_CHECK(cudaEventRecord(state[d]->events[1 + k], s), where(int(k), d));
      }
    }
  }

  for (auto& kv : stage) {
    guard.set(kv.first);
    RR_CUDA_CHECK(cudaEventRecord(state[kv.first]->stage_free, stream_of[kv.first]),
                  "releasing the staging buffer on cuda:" + std::to_string(kv.first));
  }
  if (multi) {
    // Exit: a device's later work may overwrite its buffers only after every neighbour has
    // finished reading them.
    for (int d : devices) {
      guard.set(d);
      RR_CUDA_CHECK(cudaEventRecord(state[d]->events[1 + steps], stream_of[d]), "leaving the ring");
    }
    for (int d : devices) {
      guard.set(d);
      for (int e : devices) {
        if (e != d) {
          RR_CUDA_CHECK(cudaStreamWaitEvent(stream_of[d], state[e]->events[1 + steps], 0),
                        "ordering cuda:" + std::to_string(d) + " after cuda:" +
                            std::to_string(e) + " at exit");
        }
      }
    }
  }
  return staged;
}

std::vector<std::string> all_reduce(const RankBuffer* bufs, int nranks, int64_t count,
                                    DType dtype, Op op, const DeviceStream* streams,
                                    int nstreams, bool force_copy) {
  std::vector<void*> ptrs;
  std::vector<int> devices;
  for (int r = 0; r < nranks; ++r) {
    ptrs.push_back(bufs[r].ptr);
    devices.push_back(bufs[r].device);
  }
  return run(all_reduce_plan(ptrs.data(), ptrs.data(), nranks, count, elem_size(dtype)),
             devices.data(), nranks, dtype, op, streams, nstreams, force_copy);
}

void check_device_supported(int device) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_supported.find(device);
  if (it != g_supported.end() && it->second) return;
  DeviceGuard guard;
  guard.set(device);
  cudaFuncAttributes attr;
  cudaError_t err = cudaFuncGetAttributes(&attr, kernel_ptr<float, Op::Sum, true, false>());
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
