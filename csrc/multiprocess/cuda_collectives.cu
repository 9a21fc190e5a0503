// Multi-process CUDA collectives (see cuda_collectives.h for the protocol).
// NOT RUN: compiled with nvcc, never executed (no GPU was available while it was written).
#include "cuda_collectives.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "../ring/cuda_check.h"
#include "../ring/cuda_executor.h"
#include "../ring/schedule.h"

namespace rr {
namespace dist {
namespace cuda {

namespace {

using Clock = std::chrono::steady_clock;

// Selects `device` for its scope and restores the previous device only if it changed it (the
// binding already selects the tensor's device, so normally nothing changes).
using ::rr::cuda::DeviceGuard;

// Opened peer allocations kept per peer. Torch's caching allocator reuses its allocations, so
// a handful covers a training loop; beyond this the least recently used one is closed.
constexpr size_t kMaxMappingsPerPeer = 32;
// Streams whose end-of-collective events are tracked (see Peers::mark_done).
constexpr size_t kMaxTrackedStreams = 16;
// Teardown waits at most this long (or the group timeout, if shorter) for the GPU and peers.
constexpr std::chrono::seconds kTeardownLimit{10};

// Polls `e` until it has completed. False on timeout or on a CUDA error.
bool poll_event(cudaEvent_t e, Clock::time_point deadline) {
  for (;;) {
    const cudaError_t err = cudaEventQuery(e);
    if (err == cudaSuccess) return true;
    if (err != cudaErrorNotReady) {
      cudaGetLastError();
      return false;
    }
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

}  // namespace

class Peers {
 public:
  Peers(HostGroup& g, int device) : g_(g), device_(device) {}
  // Every wait here is bounded; what cannot be released safely in time is leaked (process exit
  // frees it): destroying an IPC event a peer may still wait on, or unmapping memory a queued
  // kernel still reads, is undefined behaviour.
  ~Peers() {
    try {
      DeviceGuard guard(device_);
      teardown();
    } catch (...) {
    }
  }

  void setup() {
    const Ctx ctx = g_.begin(Kind::CudaSetup);
    const int n = g_.nranks();
    const int rank = g_.rank();
    guarded(g_, ctx, [&] {
      DeviceGuard guard(device_);
      ::rr::cuda::check_device_supported(device_);
      // A ring phase records 2N - 1 events (input ready, then one per step); one-shot
      // collectives use the first two.
      const int nevents = std::max(2, 2 * n - 1);
      CudaArea& area = g_.header(rank)->cuda;
      for (int i = 0; i < nevents; ++i) {
        cudaEvent_t e;
        RR_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming | cudaEventInterprocess),
                     "creating this rank's IPC events");
        own_.push_back(e);
        cudaIpcEventHandle_t h;
        RR_CUDA_CHECK(cudaIpcGetEventHandle(&h, e), "exporting this rank's IPC events");
        std::memcpy(area.events[i].bytes, &h, sizeof(h));
      }
      static_assert(sizeof(cudaIpcEventHandle_t) == kIpcHandleBytes, "IPC handle size");
      static_assert(sizeof(cudaIpcMemHandle_t) == kIpcHandleBytes, "IPC handle size");
      area.device = device_;
      area.nevents = nevents;
      cudaDeviceProp prop;
      RR_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_), "reading the device's UUID");
      std::memcpy(area.device_uuid, &prop.uuid, sizeof(area.device_uuid));

      const uint64_t base = g_.base();
      g_.wait_all(base, ctx, "at the start of CUDA setup");
      g_.set_desc(make_desc(ctx.seq, Kind::CudaSetup, -1, -1, -1, 0, 0, device_));
      g_.publish(base + 1);
      peer_events_.assign(size_t(n), {});
      maps_.assign(size_t(n), {});
      for (int j = 1; j < n; ++j) {
        const int q = (rank + j) % n;
        g_.wait(q, base + 1, ctx, "while exchanging CUDA IPC events");
        g_.check_desc(q, ctx);
        const CudaArea& pa = g_.header(q)->cuda;
        if (pa.nevents != nevents)
          throw CommError("ringreduce: CUDA setup: rank " + std::to_string(q) + " exported " +
                          std::to_string(pa.nevents) + " events, expected " +
                          std::to_string(nevents));
        for (int i = 0; i < nevents; ++i) {
          cudaIpcEventHandle_t h;
          std::memcpy(&h, pa.events[i].bytes, sizeof(h));
          cudaEvent_t e;
          RR_CUDA_CHECK(cudaIpcOpenEventHandle(&e, h),
                       "opening rank " + std::to_string(q) + "'s IPC events (on cuda:" +
                           std::to_string(pa.device) + ")");
          peer_events_[size_t(q)].push_back(e);
        }
      }
      g_.publish(base + 2);
      g_.end_phase(2);
    });
  }

  int device() const { return device_; }
  cudaEvent_t own(int i) const { return own_[size_t(i)]; }

  // Records the end of a collective's work on `stream` (after its waits on the peers' events).
  // Teardown and mapping eviction wait for these events instead of the whole device. Returns
  // false when it could not (the work is then untracked; the caller reports or leaks).
  bool mark_done(cudaStream_t stream, Clock::time_point deadline) {
    auto it = std::find_if(done_.begin(), done_.end(),
                           [&](const Done& d) { return d.stream == stream; });
    if (it == done_.end()) {
      if (done_.size() >= kMaxTrackedStreams) {
        // Make room: forget streams whose last collective has finished, else wait for the
        // oldest one.
        done_.erase(std::remove_if(done_.begin(), done_.end(),
                                   [](const Done& d) {
                                     if (cudaEventQuery(d.event) != cudaSuccess) return false;
                                     cudaEventDestroy(d.event);
                                     return true;
                                   }),
                    done_.end());
        cudaGetLastError();
        if (done_.size() >= kMaxTrackedStreams) {
          if (!poll_event(done_.front().event, deadline)) return false;
          cudaEventDestroy(done_.front().event);
          done_.erase(done_.begin());
        }
      }
      Done d{stream, nullptr};
      if (cudaEventCreateWithFlags(&d.event, cudaEventDisableTiming) != cudaSuccess) {
        cudaGetLastError();
        return false;
      }
      done_.push_back(d);
      it = done_.end() - 1;
    }
    if (cudaEventRecord(it->event, stream) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return true;
  }

  // Waits until every collective this rank has queued has finished on the GPU.
  bool wait_own_work(Clock::time_point deadline) const {
    for (const Done& d : done_)
      if (!poll_event(d.event, deadline)) return false;
    return true;
  }
  cudaEvent_t peer_event(int r, int i) const { return peer_events_[size_t(r)][size_t(i)]; }

  // Publishes `buf` (its allocation's IPC handle and offset) in this rank's header.
  void export_buffer(Buffer buf, const std::string& what) {
    CudaArea& area = g_.header(g_.rank())->cuda;
    cudaIpcMemHandle_t h;
    RR_CUDA_CHECK(cudaIpcGetMemHandle(&h, buf.alloc_base),
                 "exporting the " + what + " (CUDA IPC needs memory that PyTorch's caching "
                 "allocator got from cudaMalloc: it is not with PYTORCH_CUDA_ALLOC_CONF="
                 "expandable_segments:True nor with the backend:cudaMallocAsync allocator)");
    std::memcpy(area.mem.bytes, &h, sizeof(h));
    area.mem_offset = static_cast<char*>(buf.ptr) - static_cast<char*>(buf.alloc_base);
  }

  // Rank r's current buffer, as published in its header, mapped into this process.
  char* peer_buffer(int r, const std::string& what) {
    const CudaArea& area = g_.header(r)->cuda;
    std::vector<Mapping>& maps = maps_[size_t(r)];
    ++clock_;
    for (Mapping& m : maps) {
      if (std::memcmp(m.handle.bytes, area.mem.bytes, kIpcHandleBytes) == 0) {
        m.last_use = clock_;
        return static_cast<char*>(m.base) + area.mem_offset;
      }
    }
    if (maps.size() >= kMaxMappingsPerPeer) {
      size_t lru = 0;
      for (size_t i = 1; i < maps.size(); ++i)
        if (maps[i].last_use < maps[lru].last_use) lru = i;
      // Work already queued may still read the mapping: every read of it was queued by an
      // earlier collective, so waiting for this rank's collectives so far covers them.
      if (!wait_own_work(Clock::now() + g_.timeout()))
        throw std::runtime_error(
            "ringreduce: earlier GPU work reading rank " + std::to_string(r) + "'s memory did "
            "not finish within the group timeout, so its mapping cannot be closed");
      RR_CUDA_CHECK(cudaIpcCloseMemHandle(maps[lru].base), "closing an old peer mapping");
      maps.erase(maps.begin() + long(lru));
    }
    cudaIpcMemHandle_t h;
    std::memcpy(&h, area.mem.bytes, sizeof(h));
    void* base = nullptr;
    const CudaArea& mine = g_.header(g_.rank())->cuda;
    const bool same_gpu =
        std::memcmp(mine.device_uuid, area.device_uuid, sizeof(area.device_uuid)) == 0;
    RR_CUDA_CHECK(cudaIpcOpenMemHandle(&base, h, cudaIpcMemLazyEnablePeerAccess),
                 "opening rank " + std::to_string(r) + "'s " + what + " (its cuda:" +
                     std::to_string(area.device) + " from this rank's cuda:" +
                     std::to_string(device_) +
                     (same_gpu ? "; both are the same GPU: the peer's allocation may already "
                                 "be freed, or the GPU is in a compute mode that forbids "
                                 "sharing between processes"
                               : "; distinct GPUs need peer-to-peer access") + ")");
    Mapping m;
    std::memcpy(m.handle.bytes, area.mem.bytes, kIpcHandleBytes);
    m.base = base;
    m.last_use = clock_;
    maps.push_back(m);
    return static_cast<char*>(base) + area.mem_offset;
  }

 private:
  struct Mapping {
    IpcSlot handle;
    void* base;
    uint64_t last_use;
  };
  struct Done {
    cudaStream_t stream;
    cudaEvent_t event;
  };

  // (a) this rank's GPU work, (b) imported handles, (c) the peers' release, (d) own events.
  void teardown() {
    const Clock::time_point deadline = Clock::now() + std::min<Clock::duration>(
        g_.timeout(), std::chrono::duration_cast<Clock::duration>(kTeardownLimit));
    if (!wait_own_work(deadline)) return;  // queued work may still use peer memory and events
    for (auto& per_peer : maps_)
      for (Mapping& m : per_peer) cudaIpcCloseMemHandle(m.base);
    maps_.clear();
    for (auto& per_peer : peer_events_)
      for (cudaEvent_t e : per_peer) cudaEventDestroy(e);
    peer_events_.clear();
    for (const Done& d : done_) cudaEventDestroy(d.event);
    done_.clear();
    if (!g_.release_cuda_and_wait(deadline)) return;  // a peer may still wait on them: leak
    for (cudaEvent_t e : own_) cudaEventDestroy(e);
    own_.clear();
  }

  HostGroup& g_;
  int device_;
  std::vector<Done> done_;
  std::vector<cudaEvent_t> own_;
  std::vector<std::vector<cudaEvent_t>> peer_events_;
  std::vector<std::vector<Mapping>> maps_;
  uint64_t clock_ = 0;
};

void destroy(Peers* p) { delete p; }

PeersPtr make_peers(HostGroup& g, int device) {
  PeersPtr p(new Peers(g, device));
  p->setup();
  return p;
}

int device_of(const Peers& p) { return p.device(); }

namespace {

Desc device_desc(const Ctx& ctx, int dtype, int op, int root, int64_t count, int device) {
  return make_desc(ctx.seq, ctx.kind, dtype, op, root, count, 0, device);
}

std::string step_text(int64_t step, int64_t nsteps) {
  return "at ring step " + std::to_string(step) + "/" + std::to_string(nsteps);
}

// End of a one-shot phase (input published at base + 1, reads done at base + 2): this rank's
// stream waits until every rank in `readers` has finished reading its buffer on the GPU, so
// work queued after the collective may overwrite or free it.
void wait_for_readers(HostGroup& g, Peers& p, const Ctx& ctx, uint64_t base,
                      const std::vector<int>& readers, cudaStream_t stream) {
  for (int q : readers) {
    g.wait(q, base + 2, ctx, "while rank " + std::to_string(q) + " reads this rank's buffer");
    RR_CUDA_CHECK(cudaStreamWaitEvent(stream, p.peer_event(q, 1), 0),
                 "ordering this rank's stream after rank " + std::to_string(q) + "'s reads");
  }
}

// Runs a collective's body on the rank's device inside guarded(), then records its end on
// `stream`, also when it failed part-way (waits on peer events it queued must be tracked).
template <typename F>
void run_collective(HostGroup& g, const Ctx& ctx, Peers& p, cudaStream_t stream, F&& body) {
  guarded(g, ctx, [&] {
    DeviceGuard guard(p.device());
    try {
      body();
    } catch (...) {
      p.mark_done(stream, Clock::now() + g.timeout());
      throw;
    }
    if (!p.mark_done(stream, Clock::now() + g.timeout()))
      throw std::runtime_error(
          "ringreduce: could not record the end of the collective on the stream (a CUDA error, "
          "or the GPU work of earlier collectives on 16 other streams did not finish within "
          "the group timeout)");
  });
}

std::vector<int> others(const HostGroup& g) {
  std::vector<int> v;
  for (int j = 1; j < g.nranks(); ++j) v.push_back((g.rank() + j) % g.nranks());
  return v;
}

}  // namespace

void all_reduce(HostGroup& g, Peers& p, Buffer buf, int64_t count, DType dtype, Op op,
                cudaStream_t stream) {
  const Ctx ctx = g.begin(Kind::AllReduce);
  const int n = g.nranks();
  if (n == 1) return;
  run_collective(g, ctx, p, stream, [&] {
    const int rank = g.rank();
    const int pred = mod(rank - 1, n);
    const int succ = mod(rank + 1, n);
    const int64_t esize = elem_size(dtype);
    const int64_t steps = num_steps(n);
    const bool empty = count == 0;
    const uint64_t base = g.base();
    // Every rank has enqueued all of the previous phase: its event waits are issued, so the
    // events may be recorded again.
    g.wait_all(base, ctx, "at the start of the collective");
    g.set_desc(device_desc(ctx, int(dtype), int(op), -1, count, p.device()));
    if (!empty) p.export_buffer(buf, "all_reduce tensor");
    RR_CUDA_CHECK(cudaEventRecord(p.own(0), stream), "marking this rank's input ready");
    g.publish(base + 1);
    char* own = static_cast<char*>(buf.ptr);
    char* src_base = nullptr;
    for (int64_t k = 0; k < steps; ++k) {
      g.wait(pred, base + 1 + uint64_t(k), ctx, step_text(k, steps));
      if (k == 0) {
        g.check_desc(pred, ctx);
        if (!empty) src_base = p.peer_buffer(pred, "all_reduce tensor");
      }
      // The predecessor's event k is recorded after its step k - 1 (k = 0: its input ready).
      RR_CUDA_CHECK(cudaStreamWaitEvent(stream, p.peer_event(pred, int(k)), 0),
                   "ordering after rank " + std::to_string(pred) + " " + step_text(k, steps));
      const Step s = ring_step(rank, n, k);
      const Range c = chunk_range(count, n, esize, s.chunk);
      if (c.count > 0) {
        ::rr::cuda::Task t{own + c.offset * esize, src_base + c.offset * esize, c.count};
        ::rr::cuda::launch_step(&t, 1, dtype, op, s.reduce, s.last_reduce, n, stream);
      }
      RR_CUDA_CHECK(cudaEventRecord(p.own(int(k) + 1), stream), "recording " + step_text(k, steps));
      g.publish(base + 2 + uint64_t(k));
    }
    // The successor reads this rank's buffer up to its last step: order this stream after it.
    g.wait(succ, base + 1 + uint64_t(steps), ctx, "while the successor finishes reading");
    RR_CUDA_CHECK(cudaStreamWaitEvent(stream, p.peer_event(succ, int(steps)), 0),
                 "ordering this rank's stream after its successor's last read");
    g.publish(base + 2 + uint64_t(steps));
    g.end_phase(2 + uint64_t(steps));
  });
}

void broadcast(HostGroup& g, Peers& p, Buffer buf, int64_t bytes, int root, cudaStream_t stream) {
  const Ctx ctx = g.begin(Kind::Broadcast);
  const int n = g.nranks();
  if (n == 1) return;
  run_collective(g, ctx, p, stream, [&] {
    const int rank = g.rank();
    const uint64_t base = g.base();
    g.wait_all(base, ctx, "at the start of the collective");
    g.set_desc(device_desc(ctx, -1, -1, root, bytes, p.device()));
    if (rank == root && bytes > 0) p.export_buffer(buf, "broadcast tensor");
    RR_CUDA_CHECK(cudaEventRecord(p.own(0), stream), "marking this rank's input ready");
    g.publish(base + 1);
    const int pred = mod(rank - 1, n);
    g.wait(pred, base + 1, ctx, "at the start of the collective");
    g.check_desc(pred, ctx);
    if (rank != root) {
      g.wait(root, base + 1, ctx, "waiting for the root's data");
      g.check_desc(root, ctx);
      if (bytes > 0) {
        const char* src = p.peer_buffer(root, "broadcast tensor");
        RR_CUDA_CHECK(cudaStreamWaitEvent(stream, p.peer_event(root, 0), 0),
                     "ordering after the root's input");
        RR_CUDA_CHECK(cudaMemcpyAsync(buf.ptr, src, size_t(bytes), cudaMemcpyDefault, stream),
                     "copying from the root");
      }
    }
    RR_CUDA_CHECK(cudaEventRecord(p.own(1), stream), "marking this rank's reads done");
    g.publish(base + 2);
    if (rank == root) wait_for_readers(g, p, ctx, base, others(g), stream);
    g.publish(base + 3);
    g.end_phase(3);
  });
}

void all_gather(HostGroup& g, Peers& p, Buffer in, void* const* outs, int64_t bytes,
                cudaStream_t stream) {
  const Ctx ctx = g.begin(Kind::AllGather);
  const int n = g.nranks();
  const int rank = g.rank();
  run_collective(g, ctx, p, stream, [&] {
    const uint64_t base = g.base();
    if (n > 1) {
      g.wait_all(base, ctx, "at the start of the collective");
      g.set_desc(device_desc(ctx, -1, -1, -1, bytes, p.device()));
      if (bytes > 0) p.export_buffer(in, "all_gather input");
      RR_CUDA_CHECK(cudaEventRecord(p.own(0), stream), "marking this rank's input ready");
      g.publish(base + 1);
    }
    if (bytes > 0 && outs[rank] != in.ptr)
      RR_CUDA_CHECK(cudaMemcpyAsync(outs[rank], in.ptr, size_t(bytes), cudaMemcpyDefault, stream),
                   "copying this rank's own slot");
    if (n == 1) return;
    for (int q : others(g)) {
      g.wait(q, base + 1, ctx, "waiting for rank " + std::to_string(q) + "'s input");
      g.check_desc(q, ctx);
      if (bytes == 0) continue;
      const char* src = p.peer_buffer(q, "all_gather input");
      RR_CUDA_CHECK(cudaStreamWaitEvent(stream, p.peer_event(q, 0), 0),
                   "ordering after rank " + std::to_string(q) + "'s input");
      RR_CUDA_CHECK(cudaMemcpyAsync(outs[q], src, size_t(bytes), cudaMemcpyDefault, stream),
                   "copying rank " + std::to_string(q) + "'s input");
    }
    RR_CUDA_CHECK(cudaEventRecord(p.own(1), stream), "marking this rank's reads done");
    g.publish(base + 2);
    wait_for_readers(g, p, ctx, base, others(g), stream);
    g.publish(base + 3);
    g.end_phase(3);
  });
}

void reduce_scatter(HostGroup& g, Peers& p, Buffer in, void* out, int64_t count, DType dtype,
                    Op op, cudaStream_t stream) {
  const Ctx ctx = g.begin(Kind::ReduceScatter);
  const int n = g.nranks();
  const int rank = g.rank();
  const int64_t esize = elem_size(dtype);
  const int64_t seg_bytes = count * esize;
  run_collective(g, ctx, p, stream, [&] {
    if (n == 1) {
      if (seg_bytes > 0 && out != in.ptr)
        RR_CUDA_CHECK(cudaMemcpyAsync(out, in.ptr, size_t(seg_bytes), cudaMemcpyDefault, stream),
                     "copying the single rank's input");
      return;
    }
    const uint64_t base = g.base();
    g.wait_all(base, ctx, "at the start of the collective");
    g.set_desc(device_desc(ctx, int(dtype), int(op), -1, count, p.device()));
    if (seg_bytes > 0) p.export_buffer(in, "reduce_scatter input");
    RR_CUDA_CHECK(cudaEventRecord(p.own(0), stream), "marking this rank's input ready");
    g.publish(base + 1);
    std::vector<const char*> srcs(size_t(n), nullptr);
    for (int q = 0; q < n; ++q) {
      if (q == rank) {
        srcs[size_t(q)] = static_cast<const char*>(in.ptr) + rank * seg_bytes;
        continue;
      }
      g.wait(q, base + 1, ctx, "waiting for rank " + std::to_string(q) + "'s input");
      g.check_desc(q, ctx);
      if (seg_bytes == 0) continue;
      srcs[size_t(q)] = p.peer_buffer(q, "reduce_scatter input") + rank * seg_bytes;
      RR_CUDA_CHECK(cudaStreamWaitEvent(stream, p.peer_event(q, 0), 0),
                   "ordering after rank " + std::to_string(q) + "'s input");
    }
    if (seg_bytes > 0) {
      // Fixed order 0, 1, ..., N-1. `out` must not overlap `in` (the binding guarantees it).
      RR_CUDA_CHECK(cudaMemcpyAsync(out, srcs[0], size_t(seg_bytes), cudaMemcpyDefault, stream),
                   "copying rank 0's segment");
      for (int q = 1; q < n; ++q) {
        ::rr::cuda::Task t{out, srcs[size_t(q)], count};
        ::rr::cuda::launch_step(&t, 1, dtype, op, true, q == n - 1, n, stream);
      }
    }
    RR_CUDA_CHECK(cudaEventRecord(p.own(1), stream), "marking this rank's reads done");
    g.publish(base + 2);
    wait_for_readers(g, p, ctx, base, others(g), stream);
    g.publish(base + 3);
    g.end_phase(3);
  });
}

}  // namespace cuda
}  // namespace dist
}  // namespace rr
