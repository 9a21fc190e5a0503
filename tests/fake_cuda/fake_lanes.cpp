// The lazy fake CUDA runtime of include/fake_lanes.h, plus launch_step of
// csrc/ring/cuda_kernels.h and launch_chunk_once of oneshot_cuda.h (the executors' kernels, run
// by the CPU executor's combine and once-rounded sum). Both are weak:
// tests/test_cuda_host_cost.py links the real ones (cuda_kernels.cu and oneshot_kernel.cu
// compiled by the host compiler), whose kernels run through cudaLaunchKernel below.
// Single-threaded: the executor queues, fake_drain() runs.
#include "fake_lanes.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <stdexcept>
#include <vector>

#include "ring/cpu_executor.h"
#include "ring/cuda_kernels.h"
#include "ring/oneshot_cuda.h"

struct FakeEvent {
  int device;
  uint64_t latest = 0;      // id of the most recent record operation, 0: never recorded
  long latest_mark = 0;     // the fake_mark() generation of that record
};

struct FakeOperation {
  uint64_t id = 0;            // queue order across all streams
  std::function<void()> fn;   // kernels and copies
  uint64_t waits_for = 0;     // a wait: the record operation it refers to (0: none)
  bool is_record = false;
};

struct FakeStream {
  int device;
  int index;
  bool capturing = false;
  bool capture_implicit = false;
  std::deque<FakeOperation> queue;
};

namespace {

struct State {
  int ndevices = 1;
  int current = 0;
  std::vector<std::unique_ptr<FakeStream>> owned;
  std::vector<FakeStream*> streams;  // not yet released
  std::vector<std::unique_ptr<FakeEvent>> events;
  std::set<uint64_t> done;  // record operations that have run
  std::map<uint64_t, FakeStream*> recorded_on;  // record operation -> its stream
  uint64_t next_id = 1;
  FakePolicy policy = kFakeOldest;
  FakeStream* prefer = nullptr;
  std::mt19937 rng;
  long fail_in = -1, drop_in = -1;
  long mark = 0, stale = 0, failable = 0;
  std::map<uintptr_t, uintptr_t> staging;  // begin -> end
  long misaligned_staged = 0;
  std::string log;
  std::map<int, FakeStream*> legacy;  // each device's legacy default stream
  std::map<uintptr_t, std::pair<uintptr_t, int>> memory;  // begin -> (end, device)
  std::set<std::pair<int, int>> refused, enabled;  // (device, peer)
  long violations = 0;
  std::string first_violation;
  std::map<std::pair<int, int>, long> peer_copies;  // (dst device, src device) -> calls
  FakeCounts counts;
  int sms = 4, blocks_per_sm = 2;
};

State g;
thread_local int g_inside = 0;

// Counts a runtime call; the scope marks the fake's own allocations.
struct Call : FakeScope {
  explicit Call(const char* name) { ++g.counts.calls[name]; }
};

// Stream 0 is the current device's legacy default stream.
FakeStream* resolve(cudaStream_t s);

// The device of noted memory at `p`, -1 if not noted.
int memory_device(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  auto it = g.memory.upper_bound(a);
  if (it == g.memory.begin()) return -1;
  --it;
  return a < it->second.first ? it->second.second : -1;
}

void violation(const std::string& what) {
  if (g.violations++ == 0) g.first_violation = what;
}

// Whether a kernel on `device` may touch `p`.
void check_access(const void* p, int device, const char* what) {
  const int d = memory_device(p);
  if (d < 0 || d == device || g.enabled.count({device, d}) > 0) return;
  violation(std::string("a kernel on cuda:") + std::to_string(device) + " " + what +
            " memory of cuda:" + std::to_string(d) + " without peer access");
}

// Counts a call that can fail; true if this one must.
bool inject_failure() {
  ++g.failable;
  if (g.fail_in < 0) return false;
  return g.fail_in-- == 0;
}

cudaError_t queue(cudaStream_t stream, FakeOperation op, char letter) {
  FakeStream* s = resolve(stream);
  op.id = g.next_id++;
  s->queue.push_back(std::move(op));
  g.log += letter;
  return cudaSuccess;
}

bool runnable(const FakeStream& s) {
  if (s.queue.empty()) return false;
  const FakeOperation& op = s.queue.front();
  return op.waits_for == 0 || g.done.count(op.waits_for) > 0;
}

}  // namespace

FakeScope::FakeScope() { ++g_inside; }
FakeScope::~FakeScope() { --g_inside; }
bool fake_inside() { return g_inside > 0; }
FakeCounts fake_counts() { return g.counts; }
void fake_set_capacity(int sms, int blocks_per_sm) {
  g.sms = sms;
  g.blocks_per_sm = blocks_per_sm;
}

thread_local uint3 blockIdx, threadIdx;
thread_local dim3 blockDim, gridDim;

void fake_init(int ndevices) { g.ndevices = ndevices; }

cudaStream_t fake_stream(int device) {
  g.owned.push_back(std::make_unique<FakeStream>());
  FakeStream* s = g.owned.back().get();
  s->device = device;
  s->index = int(g.owned.size()) - 1;
  g.streams.push_back(s);
  return s;
}

namespace {

FakeStream* resolve(cudaStream_t s) {
  if (s != nullptr) return s;
  FakeStream*& l = g.legacy[g.current];
  if (l == nullptr) l = fake_stream(g.current);
  // Scheduled again after fake_release_streams().
  if (std::find(g.streams.begin(), g.streams.end(), l) == g.streams.end()) g.streams.push_back(l);
  return l;
}

}  // namespace

void fake_note_memory(const void* p, size_t bytes, int device) {
  const uintptr_t b = reinterpret_cast<uintptr_t>(p);
  g.memory[b] = {b + bytes, device};
}
void fake_forget_memory() { g.memory.clear(); }
void fake_refuse_peer(int a, int b) {
  g.refused.insert({a, b});
  g.refused.insert({b, a});
}
long fake_device_violations(std::string* first) {
  if (first != nullptr) *first = g.first_violation;
  return g.violations;
}
long fake_peer_copies(int dst_device, int src_device) {
  auto it = g.peer_copies.find({dst_device, src_device});
  return it == g.peer_copies.end() ? 0 : it->second;
}

cudaError_t cudaDeviceCanAccessPeer(int* can, int device, int peer) {
  Call call("cudaDeviceCanAccessPeer");
  if (device < 0 || device >= g.ndevices || peer < 0 || peer >= g.ndevices) {
    return cudaErrorInvalidDevice;
  }
  *can = device != peer && g.refused.count({device, peer}) == 0;
  return cudaSuccess;
}

cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned) {
  Call call("cudaDeviceEnablePeerAccess");
  int can = 0;
  const cudaError_t err = cudaDeviceCanAccessPeer(&can, g.current, peer);
  if (err != cudaSuccess) return err;
  if (!can) return cudaErrorPeerAccessUnsupported;
  return g.enabled.insert({g.current, peer}).second ? cudaSuccess
                                                     : cudaErrorPeerAccessAlreadyEnabled;
}

void fake_release_streams() {
  std::vector<FakeStream*> keep;
  for (FakeStream* s : g.streams) {
    if (!s->queue.empty()) keep.push_back(s);
  }
  g.streams.swap(keep);
}

int fake_stream_index(cudaStream_t stream) { return resolve(stream)->index; }
cudaStream_t fake_resolve(cudaStream_t stream) { return resolve(stream); }

void fake_set_policy(FakePolicy policy, cudaStream_t prefer, unsigned seed) {
  g.policy = policy;
  g.prefer = prefer;
  g.rng.seed(seed);
}

void fake_enqueue(cudaStream_t stream, std::function<void()> fn) {
  FakeOperation op;
  op.fn = std::move(fn);
  queue(stream, std::move(op), 'U');
}

namespace {

void run_front(FakeStream* s) {
  FakeOperation op = std::move(s->queue.front());
  s->queue.pop_front();
  if (op.fn) op.fn();
  if (op.is_record) g.done.insert(op.id);
}

// Runs one operation: `s`'s next one if it can run, otherwise (recursively) the next
// operation of the stream holding the record that `s` waits for. False on a cycle.
bool advance(FakeStream* s, size_t depth) {
  if (depth > g.streams.size()) return false;
  if (runnable(*s)) {
    run_front(s);
    return true;
  }
  auto it = g.recorded_on.find(s->queue.front().waits_for);
  return it != g.recorded_on.end() && advance(it->second, depth + 1);
}

}  // namespace

bool fake_drain() {
  for (;;) {
    // Prefer: the chosen stream runs as far ahead as CUDA allows; others run only what it
    // waits for.
    if (g.policy == kFakePrefer && g.prefer != nullptr && !g.prefer->queue.empty()) {
      if (!advance(g.prefer, 0)) {
        std::fprintf(stderr, "fake_lanes: queued waits can never be satisfied\n");
        return false;
      }
      continue;
    }
    std::vector<FakeStream*> ready;
    bool pending = false;
    for (FakeStream* s : g.streams) {
      pending = pending || !s->queue.empty();
      if (runnable(*s)) ready.push_back(s);
    }
    if (ready.empty()) {
      if (pending) std::fprintf(stderr, "fake_lanes: queued waits can never be satisfied\n");
      return !pending;
    }
    FakeStream* pick = ready[0];
    auto id = [](FakeStream* s) { return s->queue.front().id; };
    for (FakeStream* s : ready) {
      switch (g.policy) {
        case kFakeOldest:
        case kFakePrefer:
          if (id(s) < id(pick)) pick = s;
          break;
        case kFakeNewest:
          if (id(s) > id(pick)) pick = s;
          break;
        case kFakeRandom:
          break;
      }
    }
    if (g.policy == kFakeRandom) pick = ready[g.rng() % ready.size()];
    run_front(pick);
  }
}

void fake_fail_call(long n) { g.fail_in = n; }
void fake_drop_wait(long n) { g.drop_in = n; }
void fake_set_capturing(cudaStream_t stream, bool capturing) { stream->capturing = capturing; }
void fake_set_capture_implicit(cudaStream_t stream, bool implicit) {
  stream->capture_implicit = implicit;
}

void fake_note_staging(const void* p, size_t bytes) {
  const uintptr_t b = reinterpret_cast<uintptr_t>(p);
  g.staging[b] = b + bytes;
}
void fake_forget_staging() { g.staging.clear(); }
long fake_misaligned_staged_reads() { return g.misaligned_staged; }

namespace {

bool in_staging(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  auto it = g.staging.upper_bound(a);
  if (it == g.staging.begin()) return false;
  --it;
  return a >= it->first && a < it->second;
}

}  // namespace

void fake_mark() {
  ++g.mark;
  g.log.clear();
  g.failable = 0;
  g.counts = FakeCounts();
}

long fake_stale_waits() { return g.stale; }
std::string fake_log() { return g.log; }
long fake_failable_calls() { return g.failable; }

cudaError_t cudaGetLastError() {
  Call call("cudaGetLastError");
  return cudaSuccess;
}
const char* cudaGetErrorName(cudaError_t err) {
  Call call("cudaGetErrorName");
  switch (err) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    default: return "cudaErrorFake";
  }
}
const char* cudaGetErrorString(cudaError_t) {
  Call call("cudaGetErrorString");
  return "an error of the fake runtime fake_lanes";
}

cudaError_t cudaGetDeviceCount(int* count) {
  Call call("cudaGetDeviceCount");
  *count = g.ndevices;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  Call call("cudaDeviceGetAttribute");
  if (device < 0 || device >= g.ndevices) return cudaErrorInvalidDevice;
  switch (attr) {
    case cudaDevAttrMultiProcessorCount: *value = g.sms; return cudaSuccess;
    case cudaDevAttrComputeCapabilityMajor: *value = 9; return cudaSuccess;
    case cudaDevAttrComputeCapabilityMinor: *value = 0; return cudaSuccess;
    case cudaDevAttrCooperativeLaunch: *value = 1; return cudaSuccess;
  }
  return cudaErrorInvalidValue;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  Call call("cudaGetDeviceProperties");
  if (device < 0 || device >= g.ndevices) return cudaErrorInvalidDevice;
  *prop = cudaDeviceProp{};
  std::snprintf(prop->name, sizeof(prop->name), "fake_lanes device %d", device);
  return cudaSuccess;
}

cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, const void*, int, size_t) {
  Call call("cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  *blocks = g.blocks_per_sm;
  return cudaSuccess;
}

cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attr, const void*) {
  Call call("cudaFuncGetAttributes");
  *attr = cudaFuncAttributes{32, 1024};
  return cudaSuccess;
}

cudaError_t cudaLaunchKernel(const void*, dim3, dim3, void**, size_t, cudaStream_t) {
  Call call("cudaLaunchKernel");
  std::fprintf(stderr, "fake_lanes: an untyped cudaLaunchKernel cannot run\n");
  return cudaErrorInvalidDeviceFunction;
}

cudaError_t fake_launch_kernel(const void*, dim3 grid, dim3 block, size_t param_bytes,
                               cudaStream_t stream, std::function<void()> thread) {
  Call call("cudaLaunchKernel");
  if (inject_failure()) return cudaErrorUnknown;
  FakeStream* s = resolve(stream);
  // As on a GPU: a kernel runs only on a stream of the current device.
  if (s->device != g.current) return cudaErrorInvalidResourceHandle;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || block.x == 0) return cudaErrorInvalidValue;
  ++g.counts.launches;
  g.counts.param_bytes += long(param_bytes);
  FakeOperation op;
  op.fn = [grid, block, thread = std::move(thread)] {
    gridDim = grid;
    blockDim = block;
    for (unsigned z = 0; z < grid.z; ++z) {
      for (unsigned y = 0; y < grid.y; ++y) {
        for (unsigned x = 0; x < grid.x; ++x) {
          blockIdx = uint3{x, y, z};
          for (unsigned t = 0; t < block.x * block.y * block.z; ++t) {
            threadIdx = uint3{t % block.x, t / block.x % block.y, t / (block.x * block.y)};
            thread();
          }
        }
      }
    }
  };
  return queue(s, std::move(op), 'L');
}


cudaError_t cudaGetDevice(int* device) {
  Call call("cudaGetDevice");
  *device = g.current;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  Call call("cudaSetDevice");
  if (device < 0 || device >= g.ndevices) return cudaErrorInvalidValue;
  g.current = device;
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned) {
  Call call("cudaEventCreateWithFlags");
  if (inject_failure()) return cudaErrorUnknown;
  g.events.push_back(std::make_unique<FakeEvent>());
  g.events.back()->device = g.current;
  *event = g.events.back().get();
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  Call call("cudaEventRecord");
  if (inject_failure()) return cudaErrorUnknown;
  // As on a GPU, an event is recorded only on a stream of the device it was created on.
  if (event == nullptr) return cudaErrorInvalidValue;
  FakeStream* s = resolve(stream);
  if (event->device != s->device) return cudaErrorInvalidResourceHandle;
  FakeOperation op;
  op.is_record = true;
  cudaError_t err = queue(s, std::move(op), 'R');
  event->latest = s->queue.back().id;
  g.recorded_on[event->latest] = s;
  event->latest_mark = g.mark;
  return err;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned) {
  Call call("cudaStreamWaitEvent");
  if (inject_failure()) return cudaErrorUnknown;
  if (event == nullptr) return cudaErrorInvalidValue;
  if (event->latest != 0 && event->latest_mark != g.mark) ++g.stale;
  if (g.drop_in >= 0 && g.drop_in-- == 0) {
    g.log += 'w';
    return cudaSuccess;
  }
  FakeOperation op;
  op.waits_for = event->latest;
  return queue(stream, std::move(op), 'W');
}

cudaError_t cudaMemcpyPeerAsync(void* dst, int dst_device, const void* src, int src_device,
                                size_t bytes, cudaStream_t stream) {
  Call call("cudaMemcpyPeerAsync");
  if (inject_failure()) return cudaErrorUnknown;
  if (resolve(stream)->device != dst_device || src_device < 0 || src_device >= g.ndevices) {
    return cudaErrorInvalidValue;
  }
  const int dd = memory_device(dst), sd = memory_device(src);
  if ((dd >= 0 && dd != dst_device) || (sd >= 0 && sd != src_device)) {
    violation("cudaMemcpyPeerAsync names cuda:" + std::to_string(dst_device) + " <- cuda:" +
              std::to_string(src_device) + " for memory of cuda:" + std::to_string(dd) +
              " <- cuda:" + std::to_string(sd));
  }
  ++g.peer_copies[{dst_device, src_device}];
  FakeOperation op;
  op.fn = [=] { std::memcpy(dst, src, bytes); };
  return queue(stream, std::move(op), 'C');
}

cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus* status) {
  Call call("cudaStreamIsCapturing");
  if (inject_failure()) return cudaErrorUnknown;
  FakeStream* s = resolve(stream);
  if (s->capture_implicit) return cudaErrorStreamCaptureImplicit;
  *status = s->capturing ? cudaStreamCaptureStatusActive : cudaStreamCaptureStatusNone;
  return cudaSuccess;
}

namespace rr {
namespace cuda {

__attribute__((weak)) void launch_step(const Task* tasks, int ntasks, DType dtype, Op op,
                                       bool reduce, bool last, int nranks, cudaStream_t stream,
                                       int device) {
  if (inject_failure()) throw std::runtime_error("ringreduce: injected launch failure");
  // A kernel runs on the current device's streams only, and `device` names the current one.
  FakeStream* s = resolve(stream);
  if (device != g.current) {
    throw std::runtime_error("fake_lanes: launch_step told cuda:" + std::to_string(device) +
                             " is current while cuda:" + std::to_string(g.current) + " is");
  }
  if (s->device != g.current) {
    throw std::runtime_error("fake_lanes: launch on a stream of cuda:" +
                             std::to_string(s->device) + " while cuda:" +
                             std::to_string(g.current) + " is current");
  }
  if (ntasks > kMaxRanks) throw std::runtime_error("fake_lanes: too many tasks in one launch");
  std::vector<Task> copy(tasks, tasks + ntasks);
  for (const Task& t : copy) {
    check_access(t.dst, s->device, "writes");
    check_access(t.src, s->device, "reads");
    if (t.own != nullptr) check_access(t.own, s->device, "reads");
    if (in_staging(t.src) && reinterpret_cast<uintptr_t>(t.src) % 16 != 0) ++g.misaligned_staged;
  }
  FakeOperation o;
  o.fn = [=] {
    for (const Task& t : copy) {
      if (reduce) {
        rr::cpu::combine(dtype, op, t.dst, t.own != nullptr ? t.own : t.dst, t.src, t.n, last,
                         nranks);
      } else {
        std::memmove(t.dst, t.src, size_t(t.n * elem_size(dtype)));
      }
    }
  };
  queue(s, std::move(o), 'L');
}

__attribute__((weak)) void launch_chunk_once(const void* const* in, void* out, int nranks,
                                             int64_t count, DType dtype, Op op,
                                             cudaStream_t stream, int device) {
  if (inject_failure()) throw std::runtime_error("ringreduce: injected launch failure");
  FakeStream* s = resolve(stream);
  if (device != g.current || s->device != g.current) {
    throw std::runtime_error("fake_lanes: launch_chunk_once on a stream of cuda:" +
                             std::to_string(s->device) + " told cuda:" + std::to_string(device) +
                             " while cuda:" + std::to_string(g.current) + " is current");
  }
  if (nranks > kMaxRanks) throw std::runtime_error("fake_lanes: too many inputs in one launch");
  std::vector<const void*> srcs(in, in + nranks);
  check_access(out, s->device, "writes");
  for (const void* p : srcs) {
    check_access(p, s->device, "reads");
    if (in_staging(p) && reinterpret_cast<uintptr_t>(p) % 16 != 0) ++g.misaligned_staged;
  }
  FakeOperation o;
  o.fn = [=] { rr::cpu::sum_rounded_once(dtype, op, out, srcs.data(), nranks, count); };
  queue(s, std::move(o), 'L');
}

}  // namespace cuda
}  // namespace rr
