// The fake CUDA runtime (see include/cuda_runtime.h), plus the two functions of
// csrc/ring/cuda_kernels.h that the multi-process collectives call.
#include <cuda_runtime.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "multiprocess/host_group.h"
#include "ring/cpu_executor.h"
#include "ring/cuda_kernels.h"
#include "ring/oneshot_cuda.h"

namespace {

// Upper bound of the random delay before a queued operation (FAKE_CUDA_JITTER_US, default 200):
// it lets streams of one rank and of different ranks interleave in many orders.
int jitter_us() {
  static const int us = getenv("FAKE_CUDA_JITTER_US") ? atoi(getenv("FAKE_CUDA_JITTER_US")) : 200;
  return us;
}

int env_int(const char* name, int fallback) {
  const char* v = getenv(name);
  return v != nullptr && *v != '\0' ? atoi(v) : fallback;
}

int device_count() {
  static const int n = env_int("FAKE_CUDA_DEVICES", 8);
  return n;
}

// FAKE_CUDA_REFUSE_PEER="a,b": devices a and b cannot access each other's memory.
bool refused(int a, int b) {
  static const std::pair<int, int> pair = [] {
    const char* v = getenv("FAKE_CUDA_REFUSE_PEER");
    int x = -1, y = -1;
    if (v != nullptr && std::sscanf(v, "%d,%d", &x, &y) != 2) x = y = -1;
    return std::make_pair(x, y);
  }();
  return (a == pair.first && b == pair.second) || (a == pair.second && b == pair.first);
}

// As in CUDA, the current device belongs to the host thread.
thread_local int t_current = 0;

struct Region {
  size_t bytes;
  int device;        // the device whose memory it is
  std::string name;  // shared-memory name of the cudaMalloc (its exporter's, when opened)
};

std::atomic<int> g_names{0};
std::mutex g_mu;
std::map<void*, Region> g_allocated;  // cudaMalloc
std::map<void*, Region> g_opened;     // cudaIpcOpenMemHandle
std::map<std::pair<int, int>, bool> g_peer_enabled;  // (device, peer): kernels on device may
                                                     // touch peer's memory

// The device whose memory holds `p`, or -1 for memory the fake did not hand out (the drivers'
// host vectors, which stand for memory of the stream's own device).
int device_of(const void* p) {
  std::lock_guard<std::mutex> lock(g_mu);
  for (const auto* regions : {&g_allocated, &g_opened}) {
    auto it = regions->upper_bound(const_cast<void*>(p));
    if (it == regions->begin()) continue;
    --it;
    const char* b = static_cast<const char*>(it->first);
    if (static_cast<const char*>(p) < b + it->second.bytes) return it->second.device;
  }
  return -1;
}

bool accessible(int device, int memory) {
  if (memory < 0 || memory == device) return true;
  std::lock_guard<std::mutex> lock(g_mu);
  return g_peer_enabled.count({device, memory}) > 0;
}

std::string fresh_name(const char* kind) {
  return std::string("/fkcuda-") + std::to_string(getpid()) + "-" + kind + "-" +
         std::to_string(g_names++);
}

// Strict IPC lifetimes. In CUDA, using an imported allocation or event after its exporter freed
// it (cudaFree, cudaEventDestroy) or exited is undefined behaviour: closing the mapping, waiting
// on, querying, recording or destroying the event. Here the "device" objects live in shared
// memory that outlives the exporter, so such a use would go unseen; instead each use of an
// import first checks its exporter, and a violation ends the process loudly (SIGABRT, with the
// call and the exporter named on stderr), as a crash on a GPU would:
// - any use after the exporter freed the object (the protocol's order is wrong);
// - closing or destroying an import after the exporter exited (teardown has all the time it
//   needs to see that a peer is gone, and must then leave its imports alone).
// A stream wait or query on an exited exporter's event is not flagged: a peer may exit between
// the host handshake that shows its event recorded and this rank's call, and no check on the
// host can close that window (the protocol narrows it to the gap between two calls).

// The pid in a name made by fresh_name ("/fkcuda-<pid>-<kind>-<n>"), or -1.
pid_t exporter_of(const std::string& name) {
  int pid = -1;
  return std::sscanf(name.c_str(), "/fkcuda-%d-", &pid) == 1 ? pid_t(pid) : -1;
}

[[noreturn]] void ipc_violation(const char* call, const std::string& name, const char* why) {
  std::fprintf(stderr, "fake CUDA: %s on an IPC import (%s) whose exporter (pid %d) %s: "
               "undefined behaviour in CUDA\n", call, name.c_str(), int(exporter_of(name)), why);
  std::fflush(stderr);
  std::abort();
}

// Ends the process if the exporter of the shared-memory object `name` has released it (`freed`)
// or, for a call that ends the import (`ending`), has exited. FAKE_CUDA_SLOW_CLOSE_MS (default
// 0) delays the process's first call that ends an import by that long before the check: a
// caller descheduled between its own check that the exporter lives and its call.
void check_import(const char* call, const std::string& name, bool freed, bool ending) {
  static const int slow_close_ms = env_int("FAKE_CUDA_SLOW_CLOSE_MS", 0);
  static std::atomic<bool> slowed{false};
  if (ending && slow_close_ms > 0 && !slowed.exchange(true))
    std::this_thread::sleep_for(std::chrono::milliseconds(slow_close_ms));
  if (freed) ipc_violation(call, name, "has freed it");
  const pid_t exporter = exporter_of(name);
  if (ending && exporter > 0 && ::rr::dist::process_exited(exporter))
    ipc_violation(call, name, "has exited");
}

// True once the exporter has freed the allocation (cudaFree unlinks its name).
bool unlinked(const std::string& name) {
  const int fd = shm_open(name.c_str(), O_RDONLY, 0);
  if (fd >= 0) {
    close(fd);
    return false;
  }
  return errno == ENOENT;
}

void* map_shm(const std::string& name, size_t bytes, bool create) {
  const int fd = shm_open(name.c_str(), create ? (O_CREAT | O_EXCL | O_RDWR) : O_RDWR, 0600);
  if (fd < 0) return nullptr;
  if (create && ftruncate(fd, off_t(bytes)) != 0) {
    close(fd);
    return nullptr;
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  return p == MAP_FAILED ? nullptr : p;
}

}  // namespace

struct FakeStream {
  const int device = t_current;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> queue;  // the front one is running
  bool stop = false;
  std::mt19937 rng{std::random_device{}()};

  FakeStream() { std::thread([this] { run(); }).detach(); }

  void run() {
    for (;;) {
      std::function<void()> op;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return stop || !queue.empty(); });
        if (queue.empty()) return;
        op = queue.front();
      }
      if (jitter_us() > 0 && rng() % 3 == 0)
        std::this_thread::sleep_for(std::chrono::microseconds(rng() % unsigned(jitter_us())));
      op();
      {
        std::lock_guard<std::mutex> lock(mu);
        queue.pop_front();
      }
      cv.notify_all();
    }
  }
  void push(std::function<void()> op) {
    {
      std::lock_guard<std::mutex> lock(mu);
      queue.push_back(std::move(op));
    }
    cv.notify_all();
  }
  bool idle() {
    std::lock_guard<std::mutex> lock(mu);
    return queue.empty();
  }
  void sync() {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return queue.empty(); });
  }
};

namespace {

// Record g of an event completes by storing g in done[g % kGenerations]; a wait for record g
// is satisfied once that slot holds g or later.
constexpr uint64_t kGenerations = 1024;
struct EventState {
  int device;  // the device it was created on (in shared memory: IPC events carry it)
  std::atomic<int> destroyed;  // set by the exporter's cudaEventDestroy
  std::atomic<uint64_t> recorded;
  std::atomic<uint64_t> done[kGenerations];
  bool complete(uint64_t g) const { return g == 0 || done[g % kGenerations].load() >= g; }
};
constexpr size_t kEventBytes = (sizeof(EventState) + 4095) / 4096 * 4096;

// Stream 0 is the legacy default stream of the current device: one per device.
FakeStream* stream_of(cudaStream_t s) {
  if (s != nullptr) return s;
  static std::mutex mu;
  static std::map<int, FakeStream*> legacy;
  std::lock_guard<std::mutex> lock(mu);
  FakeStream*& l = legacy[t_current];
  if (l == nullptr) l = new FakeStream();
  return l;
}

}  // namespace

struct FakeEvent {
  EventState* state;
  std::string name;  // shared-memory name of an interprocess event, else empty
  bool owner;
};

namespace {
// Every API call on an event imported from another process checks its exporter first.
void check_event(const char* call, cudaEvent_t e, bool ending = false) {
  if (!e->owner) check_import(call, e->name, e->state->destroyed.load() != 0, ending);
}
}  // namespace

cudaError_t cudaGetLastError() { return cudaSuccess; }
const char* cudaGetErrorName(cudaError_t err) {
  switch (err) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorPeerAccessUnsupported: return "cudaErrorPeerAccessUnsupported";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorPeerAccessAlreadyEnabled: return "cudaErrorPeerAccessAlreadyEnabled";
    default: return "cudaErrorFake";
  }
}
const char* cudaGetErrorString(cudaError_t) { return "an error of the fake CUDA runtime"; }
cudaError_t cudaGetDevice(int* device) {
  *device = t_current;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= device_count()) return cudaErrorInvalidDevice;
  t_current = device;
  return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (device < 0 || device >= device_count()) return cudaErrorInvalidDevice;
  std::memset(prop, 0, sizeof(*prop));
  prop->uuid.bytes[0] = char(1 + device);  // a UUID per device: ranks on one device share a GPU
  std::snprintf(prop->name, sizeof(prop->name), "fake device %d", device);
  return cudaSuccess;
}
cudaError_t cudaDeviceCanAccessPeer(int* can, int device, int peer) {
  if (device < 0 || device >= device_count() || peer < 0 || peer >= device_count())
    return cudaErrorInvalidDevice;
  *can = device != peer && !refused(device, peer);
  return cudaSuccess;
}
cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned) {
  int can = 0;
  const cudaError_t err = cudaDeviceCanAccessPeer(&can, t_current, peer);
  if (err != cudaSuccess) return err;
  if (!can) return cudaErrorPeerAccessUnsupported;
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_peer_enabled.emplace(std::make_pair(t_current, peer), true).second)
    return cudaErrorPeerAccessAlreadyEnabled;
  return cudaSuccess;
}

cudaError_t cudaMalloc(void** ptr, size_t bytes) {
  const std::string name = fresh_name("mem");
  *ptr = map_shm(name, bytes, true);
  if (*ptr == nullptr) return cudaErrorUnknown;
  std::lock_guard<std::mutex> lock(g_mu);
  g_allocated[*ptr] = Region{bytes, t_current, name};
  return cudaSuccess;
}
cudaError_t cudaFree(void* ptr) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_allocated.find(ptr);
  if (it == g_allocated.end()) return cudaErrorInvalidValue;
  munmap(ptr, it->second.bytes);
  shm_unlink(it->second.name.c_str());
  g_allocated.erase(it);
  return cudaSuccess;
}
cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t* handle, void* ptr) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_allocated.find(ptr);
  if (it == g_allocated.end()) return cudaErrorInvalidValue;  // only whole allocations
  std::memset(handle, 0, sizeof(*handle));
  const uint64_t bytes = it->second.bytes;
  const int32_t device = it->second.device;
  std::memcpy(handle->reserved, &bytes, sizeof(bytes));
  std::memcpy(handle->reserved + 8, &device, sizeof(device));
  std::snprintf(handle->reserved + 12, 52, "%s", it->second.name.c_str());
  return cudaSuccess;
}
// Opened on the current device. Memory of another device needs peer access to it, enabled here
// (cudaIpcMemLazyEnablePeerAccess; without the flag the mapping is refused rather than left
// unusable by kernels).
cudaError_t cudaIpcOpenMemHandle(void** ptr, cudaIpcMemHandle_t handle, unsigned flags) {
  uint64_t bytes;
  int32_t device;
  std::memcpy(&bytes, handle.reserved, sizeof(bytes));
  std::memcpy(&device, handle.reserved + 8, sizeof(device));
  if (device != t_current) {
    int can = 0;
    const cudaError_t err = cudaDeviceCanAccessPeer(&can, t_current, device);
    if (err != cudaSuccess) return err;
    if (!can) return cudaErrorPeerAccessUnsupported;
    if (!(flags & cudaIpcMemLazyEnablePeerAccess)) return cudaErrorInvalidValue;
  }
  *ptr = map_shm(handle.reserved + 12, bytes, false);
  if (*ptr == nullptr) return cudaErrorUnknown;
  std::lock_guard<std::mutex> lock(g_mu);
  if (device != t_current) g_peer_enabled[{t_current, device}] = true;
  g_opened[*ptr] = Region{bytes, device, handle.reserved + 12};
  return cudaSuccess;
}
cudaError_t cudaIpcCloseMemHandle(void* ptr) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_opened.find(ptr);
  if (it == g_opened.end()) return cudaErrorInvalidValue;
  check_import("cudaIpcCloseMemHandle", it->second.name, unlinked(it->second.name), true);
  munmap(ptr, it->second.bytes);
  g_opened.erase(it);
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned flags) {
  auto* e = new FakeEvent{nullptr, "", true};
  if (flags & cudaEventInterprocess) {
    e->name = fresh_name("event");
    e->state = static_cast<EventState*>(map_shm(e->name, kEventBytes, true));
    if (e->state == nullptr) return cudaErrorUnknown;
  } else {
    e->state = new EventState();
  }
  e->state->device = t_current;
  e->state->destroyed = 0;
  e->state->recorded = 0;
  for (auto& d : e->state->done) d = 0;
  *event = e;
  return cudaSuccess;
}
// The state stays mapped: as in CUDA, waits already queued on the event still complete.
cudaError_t cudaEventDestroy(cudaEvent_t event) {
  check_event("cudaEventDestroy", event, /*ending=*/true);
  if (!event->name.empty() && event->owner) {
    event->state->destroyed = 1;
    shm_unlink(event->name.c_str());
  }
  return cudaSuccess;
}
// As on a GPU, an event is recorded only on a stream of the device it was created on.
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  check_event("cudaEventRecord", event);
  EventState* st = event->state;
  if (st->device != stream_of(stream)->device) return cudaErrorInvalidResourceHandle;
  const uint64_t g = ++st->recorded;
  stream_of(stream)->push([st, g] { st->done[g % kGenerations].store(g); });
  return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t event) {
  check_event("cudaEventQuery", event);
  return event->state->complete(event->state->recorded.load()) ? cudaSuccess : cudaErrorNotReady;
}
cudaError_t cudaIpcGetEventHandle(cudaIpcEventHandle_t* handle, cudaEvent_t event) {
  if (event->name.empty()) return cudaErrorInvalidValue;
  std::memset(handle, 0, sizeof(*handle));
  std::snprintf(handle->reserved, sizeof(handle->reserved), "%s", event->name.c_str());
  return cudaSuccess;
}
cudaError_t cudaIpcOpenEventHandle(cudaEvent_t* event, cudaIpcEventHandle_t handle) {
  auto* e = new FakeEvent{nullptr, handle.reserved, false};
  e->state = static_cast<EventState*>(map_shm(e->name, kEventBytes, false));
  if (e->state == nullptr) return cudaErrorUnknown;
  *event = e;
  return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned) {
  *stream = new FakeStream();
  return cudaSuccess;
}
// Returns at once; the worker ends once the queued work has run (the object is leaked).
cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  {
    std::lock_guard<std::mutex> lock(stream->mu);
    stream->stop = true;
  }
  stream->cv.notify_all();
  return cudaSuccess;
}
cudaError_t cudaStreamQuery(cudaStream_t stream) {
  return stream_of(stream)->idle() ? cudaSuccess : cudaErrorNotReady;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned) {
  check_event("cudaStreamWaitEvent", event);
  EventState* st = event->state;
  const uint64_t g = st->recorded.load();
  stream_of(stream)->push([st, g] {
    while (!st->complete(g)) std::this_thread::sleep_for(std::chrono::microseconds(20));
  });
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind,
                            cudaStream_t stream) {
  stream_of(stream)->push([dst, src, bytes] { std::memmove(dst, src, bytes); });
  return cudaSuccess;
}
void fake_stream_sync(cudaStream_t stream) { stream_of(stream)->sync(); }

namespace rr {
namespace cuda {

// A kernel runs on the current device's streams only, and touches memory of its own device or
// of peers it has access to (a GPU would fault).
void launch_step(const Task* tasks, int ntasks, DType dtype, Op op, bool reduce, bool last,
                 int nranks, cudaStream_t stream) {
  FakeStream* s = stream_of(stream);
  if (s->device != t_current) {
    throw std::runtime_error("ringreduce: fake launch_step: a kernel launched on a stream of "
                             "cuda:" + std::to_string(s->device) + " while cuda:" +
                             std::to_string(t_current) + " is current "
                             "(cudaErrorInvalidResourceHandle)");
  }
  for (int i = 0; i < ntasks; ++i) {
    for (const void* p : {static_cast<const void*>(tasks[i].dst), tasks[i].src}) {
      const int d = device_of(p);
      if (!accessible(t_current, d)) {
        throw std::runtime_error("ringreduce: fake launch_step: a kernel on cuda:" +
                                 std::to_string(t_current) + " touches memory of cuda:" +
                                 std::to_string(d) + " without peer access "
                                 "(cudaErrorIllegalAddress)");
      }
    }
  }
  const std::vector<Task> work(tasks, tasks + ntasks);
  s->push([=] {
    for (const Task& t : work) {
      if (reduce) {
        ::rr::cpu::combine(dtype, op, t.dst, t.src, t.n, last, nranks);
      } else {
        std::memcpy(t.dst, t.src, size_t(t.n * elem_size(dtype)));
      }
    }
  });
}

// The once-rounded sum of oneshot_cuda.h, run by the CPU's sum_rounded_once, under the same
// rules as launch_step.
void launch_chunk_once(const void* const* in, void* out, int nranks, int64_t count, DType dtype,
                       Op op, cudaStream_t stream, int device) {
  FakeStream* s = stream_of(stream);
  if (s->device != t_current || device != t_current) {
    throw std::runtime_error("ringreduce: fake launch_chunk_once: a kernel launched on a stream "
                             "of cuda:" + std::to_string(s->device) + " (told cuda:" +
                             std::to_string(device) + ") while cuda:" +
                             std::to_string(t_current) + " is current");
  }
  std::vector<const void*> srcs(in, in + nranks);
  for (const void* p : srcs) {
    if (!accessible(t_current, device_of(p))) {
      throw std::runtime_error("ringreduce: fake launch_chunk_once: a kernel on cuda:" +
                               std::to_string(t_current) + " reads memory of cuda:" +
                               std::to_string(device_of(p)) + " without peer access");
    }
  }
  s->push([=] { ::rr::cpu::sum_rounded_once(dtype, op, out, srcs.data(), nranks, count); });
}

void check_device_supported(int) {}

}  // namespace cuda
}  // namespace rr
