// The fake CUDA runtime (see include/cuda_runtime.h), plus the two functions of
// csrc/ring/cuda_kernels.h that the multi-process collectives call.
#include <cuda_runtime.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
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
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ring/cpu_executor.h"
#include "ring/cuda_kernels.h"

namespace {

// Upper bound of the random delay before a queued operation (FAKE_CUDA_JITTER_US, default 200):
// it lets streams of one rank and of different ranks interleave in many orders.
int jitter_us() {
  static const int us = getenv("FAKE_CUDA_JITTER_US") ? atoi(getenv("FAKE_CUDA_JITTER_US")) : 200;
  return us;
}

std::atomic<int> g_names{0};
std::mutex g_mu;
std::map<void*, std::pair<std::string, size_t>> g_allocated;  // cudaMalloc: name and size
std::map<void*, size_t> g_opened;                              // cudaIpcOpenMemHandle: size

std::string fresh_name(const char* kind) {
  return std::string("/fkcuda-") + std::to_string(getpid()) + "-" + kind + "-" +
         std::to_string(g_names++);
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
  std::atomic<uint64_t> recorded;
  std::atomic<uint64_t> done[kGenerations];
  bool complete(uint64_t g) const { return g == 0 || done[g % kGenerations].load() >= g; }
};
constexpr size_t kEventBytes = (sizeof(EventState) + 4095) / 4096 * 4096;

FakeStream* stream_of(cudaStream_t s) {
  static FakeStream* legacy = new FakeStream();
  return s != nullptr ? s : legacy;
}

}  // namespace

struct FakeEvent {
  EventState* state;
  std::string name;  // shared-memory name of an interprocess event, else empty
  bool owner;
};

cudaError_t cudaGetLastError() { return cudaSuccess; }
const char* cudaGetErrorName(cudaError_t) { return "cudaErrorFake"; }
const char* cudaGetErrorString(cudaError_t) { return "an error of the fake CUDA runtime"; }
cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int) { return cudaSuccess; }
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int) {
  std::memset(prop, 0, sizeof(*prop));  // one UUID for every rank: a shared GPU
  return cudaSuccess;
}

cudaError_t cudaMalloc(void** ptr, size_t bytes) {
  const std::string name = fresh_name("mem");
  *ptr = map_shm(name, bytes, true);
  if (*ptr == nullptr) return cudaErrorUnknown;
  std::lock_guard<std::mutex> lock(g_mu);
  g_allocated[*ptr] = {name, bytes};
  return cudaSuccess;
}
cudaError_t cudaFree(void* ptr) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_allocated.find(ptr);
  if (it == g_allocated.end()) return cudaErrorInvalidValue;
  munmap(ptr, it->second.second);
  shm_unlink(it->second.first.c_str());
  g_allocated.erase(it);
  return cudaSuccess;
}
cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t* handle, void* ptr) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_allocated.find(ptr);
  if (it == g_allocated.end()) return cudaErrorInvalidValue;  // only whole allocations
  std::memset(handle, 0, sizeof(*handle));
  const uint64_t bytes = it->second.second;
  std::memcpy(handle->reserved, &bytes, sizeof(bytes));
  std::snprintf(handle->reserved + 8, 56, "%s", it->second.first.c_str());
  return cudaSuccess;
}
cudaError_t cudaIpcOpenMemHandle(void** ptr, cudaIpcMemHandle_t handle, unsigned) {
  uint64_t bytes;
  std::memcpy(&bytes, handle.reserved, sizeof(bytes));
  *ptr = map_shm(handle.reserved + 8, bytes, false);
  if (*ptr == nullptr) return cudaErrorUnknown;
  std::lock_guard<std::mutex> lock(g_mu);
  g_opened[*ptr] = bytes;
  return cudaSuccess;
}
cudaError_t cudaIpcCloseMemHandle(void* ptr) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_opened.find(ptr);
  if (it == g_opened.end()) return cudaErrorInvalidValue;
  munmap(ptr, it->second);
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
  e->state->recorded = 0;
  for (auto& d : e->state->done) d = 0;
  *event = e;
  return cudaSuccess;
}
// The state stays mapped: as in CUDA, waits already queued on the event still complete.
cudaError_t cudaEventDestroy(cudaEvent_t event) {
  if (!event->name.empty() && event->owner) shm_unlink(event->name.c_str());
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  EventState* st = event->state;
  const uint64_t g = ++st->recorded;
  stream_of(stream)->push([st, g] { st->done[g % kGenerations].store(g); });
  return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t event) {
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

void launch_step(const Task* tasks, int ntasks, DType dtype, Op op, bool reduce, bool last,
                 int nranks, cudaStream_t stream) {
  const std::vector<Task> work(tasks, tasks + ntasks);
  stream_of(stream)->push([=] {
    for (const Task& t : work) {
      if (reduce) {
        ::rr::cpu::combine(dtype, op, t.dst, t.src, t.n, last, nranks);
      } else {
        std::memcpy(t.dst, t.src, size_t(t.n * elem_size(dtype)));
      }
    }
  });
}

void check_device_supported(int) {}

}  // namespace cuda
}  // namespace rr
