// Multi-process CUDA collectives through persistent staging areas (see cuda_collectives.h for
// the protocol).
// Ran on an H100 (2026-11-26): every collective bitwise at 2 to 4 processes on one GPU; see
// docs/GPU_SESSION.md for what failed.
#include "cuda_collectives.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "../ring/cuda_check.h"
#include "../ring/cuda_kernels.h"
#include "../ring/oneshot.h"
#include "../ring/oneshot_cuda.h"
#include "../ring/schedule.h"

namespace rr {
namespace dist {
namespace cuda {

namespace {

using Clock = std::chrono::steady_clock;

// Selects `device` for its scope and restores the previous device only if it changed it (the
// binding already selects the tensor's device, so normally nothing changes).
using ::rr::cuda::DeviceGuard;

// Streams whose end-of-collective events are tracked (see Peers::mark_done).
constexpr size_t kMaxTrackedStreams = 16;
// Teardown waits at most this long (or the group timeout, if shorter) for the GPU and peers.
constexpr std::chrono::seconds kTeardownLimit{10};
// Once a peer has exited or failed, this rank's queued GPU work may wait for an event of the
// peer's that never completes: teardown then gives that work this long before leaking.
constexpr std::chrono::seconds kGoneGrace{1};
// How long teardown waits for an aborted peer to release this rank's staging area and events
// before leaking them: longer than kGoneGrace plus the peer's closing calls, so that a peer
// whose own work was stuck for kGoneGrace and then finished still closes its mappings before
// this process can exit and free what they map.
constexpr std::chrono::seconds kAbortedPeerGrace{3};
// How long a rank that gives up waiting for its peers' release still waits for a peer that has
// begun closing its imports: it waits for nothing, and is a few CUDA calls from done.
constexpr std::chrono::seconds kClosingPeerWait{5};

// One device-to-device copy of `bytes` bytes (skipped when empty).
struct Copy {
  void* dst;
  const void* src;
  int64_t bytes;
};

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

// cudaSuccess: done; cudaErrorNotReady: pending; anything else: a CUDA error (cleared).
cudaError_t query(cudaError_t err) {
  if (err != cudaSuccess && err != cudaErrorNotReady) cudaGetLastError();
  return err;
}

void copy_all(const std::vector<Copy>& copies, cudaStream_t stream, const std::string& what) {
  for (const Copy& c : copies) {
    if (c.bytes <= 0) continue;
    RR_CUDA_CHECK(cudaMemcpyAsync(c.dst, c.src, size_t(c.bytes), cudaMemcpyDefault, stream),
                  what);
  }
}

}  // namespace

class Peers {
 public:
  Peers(HostGroup& g, int device, int64_t staging_bytes)
      : g_(g), device_(device), staging_bytes_(staging_bytes) {}
  // Every wait here is bounded; what cannot be released safely in time is leaked (process exit
  // frees it): destroying an IPC event a peer may still wait on, or freeing memory a peer still
  // has mapped or a queued copy still uses, is undefined behaviour.
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
      if (staging_bytes_ < 4096 || staging_bytes_ % 4096 != 0)
        throw std::invalid_argument(
            "the CUDA staging area (RINGREDUCE_CUDA_BUFFER_BYTES) must be a positive multiple "
            "of 4096 bytes; got " + std::to_string(staging_bytes_));
      DeviceGuard guard(device_);
      ::rr::cuda::check_device_supported(device_);
      // A ring phase records 2N - 1 events (input staged, then one per step); the other
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
      for (cudaEvent_t* e : {&start_, &released_[0], &released_[1], &copied_}) {
        RR_CUDA_CHECK(cudaEventCreateWithFlags(e, cudaEventDisableTiming),
                      "creating this rank's stream-ordering events");
      }
      RR_CUDA_CHECK(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking),
                    "creating this rank's copy stream");
      staging_.assign(size_t(n), nullptr);
      if (n > 1) {
        // Why legacy CUDA IPC (cudaIpcGetMemHandle) rather than the virtual memory API
        // (cuMemCreate, exported as a POSIX file descriptor): the hazard of legacy IPC was the
        // lifetime of memory the caching allocator owns and may free while a peer has it
        // mapped. This area is this rank's own cudaMalloc, freed only at teardown once every
        // peer has closed its mapping, so that hazard is gone. A legacy handle is 64 plain
        // bytes that travel in the shared-memory header; a file descriptor would need a
        // Unix-domain socket (SCM_RIGHTS) or pidfd_getfd (ptrace permission, Linux >= 5.6)
        // between the ranks, plus cuMemSetAccess per device, through the driver API.
        RR_CUDA_CHECK(cudaMalloc(&staging_[size_t(rank)], size_t(staging_bytes_)),
                      "allocating this rank's " + std::to_string(staging_bytes_) + "-byte CUDA "
                      "staging area (RINGREDUCE_CUDA_BUFFER_BYTES; PyTorch's caching allocator "
                      "may hold the memory: allocate it before, or set the variable lower)");
        cudaIpcMemHandle_t h;
        RR_CUDA_CHECK(cudaIpcGetMemHandle(&h, staging_[size_t(rank)]),
                      "exporting this rank's CUDA staging area");
        std::memcpy(area.staging.bytes, &h, sizeof(h));
      }
      area.staging_bytes = staging_bytes_;
      area.device = device_;
      area.nevents = nevents;
      cudaDeviceProp prop;
      RR_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_), "reading the device's UUID");
      std::memcpy(area.device_uuid, &prop.uuid, sizeof(area.device_uuid));

      const uint64_t base = g_.base();
      g_.wait_all(base, ctx, "at the start of CUDA setup");
      g_.set_desc(make_desc(ctx.seq, Kind::CudaSetup, -1, -1, -1, staging_bytes_, 0, device_));
      g_.publish(base + 1);
      peer_events_.assign(size_t(n), {});
      for (int j = 1; j < n; ++j) {
        const int q = (rank + j) % n;
        g_.wait(q, base + 1, ctx, "while exchanging CUDA IPC handles");
        // The descriptor's count is the staging size: ranks with different
        // RINGREDUCE_CUDA_BUFFER_BYTES would cut collectives into different rounds.
        g_.check_desc(q, ctx);
        const CudaArea& pa = g_.header(q)->cuda;
        if (pa.nevents != nevents)
          throw CommError("ringreduce: CUDA setup: rank " + std::to_string(q) + " exported " +
                          std::to_string(pa.nevents) + " events, expected " +
                          std::to_string(nevents));
        const std::string whose = "rank " + std::to_string(q) + "'s";
        const bool same_gpu = std::memcmp(area.device_uuid, pa.device_uuid,
                                          sizeof(pa.device_uuid)) == 0;
        const std::string where =
            " (its cuda:" + std::to_string(pa.device) + " from this rank's cuda:" +
            std::to_string(device_) +
            (same_gpu ? "; both are the same GPU: is it in a compute mode that forbids sharing "
                        "between processes?)"
                      : "; distinct GPUs need peer-to-peer access between them)");
        for (int i = 0; i < nevents; ++i) {
          cudaIpcEventHandle_t h;
          std::memcpy(&h, pa.events[i].bytes, sizeof(h));
          cudaEvent_t e;
          RR_CUDA_CHECK(cudaIpcOpenEventHandle(&e, h), "opening " + whose + " IPC events" + where);
          peer_events_[size_t(q)].push_back(e);
        }
        cudaIpcMemHandle_t h;
        std::memcpy(&h, pa.staging.bytes, sizeof(h));
        void* mapped = nullptr;
        RR_CUDA_CHECK(cudaIpcOpenMemHandle(&mapped, h, cudaIpcMemLazyEnablePeerAccess),
                      "opening " + whose + " CUDA staging area" + where);
        staging_[size_t(q)] = mapped;
      }
      distinct_gpus_ = true;
      for (int a = 0; a < n; ++a)
        for (int b = a + 1; b < n; ++b)
          distinct_gpus_ = distinct_gpus_ &&
                           std::memcmp(g_.header(a)->cuda.device_uuid,
                                       g_.header(b)->cuda.device_uuid,
                                       sizeof(area.device_uuid)) != 0;
      g_.publish(base + 2);
      g_.end_phase(2);
    });
  }

  int device() const { return device_; }
  bool distinct_gpus() const { return distinct_gpus_; }
  cudaEvent_t own(int i) const { return own_[size_t(i)]; }
  cudaEvent_t peer_event(int r, int i) const { return peer_events_[size_t(r)][size_t(i)]; }

  // Each half of the staging area is a slot; successive rounds (of one collective and across
  // collectives) alternate slots, so that a slot's copy-in overlaps the ring on the other.
  // Every rank runs the same rounds, so the sequence is the same on every rank.
  int64_t slot_bytes() const { return staging_bytes_ / 2; }
  int next_slot() { return int(rounds_++ % 2); }
  char* slot(int r, int s) const {
    return static_cast<char*>(staging_[size_t(r)]) + int64_t(s) * slot_bytes();
  }

  // Start of a collective on `stream`: the copies into the staging area come after the work
  // queued there so far (the user's writes to the input).
  void begin(cudaStream_t stream) {
    RR_CUDA_CHECK(cudaEventRecord(start_, stream), "marking the start of the collective");
  }

  // Copies this rank's input of a round into slot `s` on the copy stream, once the caller's
  // earlier work and every peer's reads of the slot's previous contents are done; records IPC
  // event 0 ("input staged") and orders `stream` after it.
  void stage_in(int s, const std::vector<Copy>& copies, cudaStream_t stream) {
    RR_CUDA_CHECK(cudaStreamWaitEvent(copy_stream_, start_, 0),
                  "ordering the copy stream after the collective's stream");
    RR_CUDA_CHECK(cudaStreamWaitEvent(copy_stream_, released_[s], 0),
                  "ordering the copy-in after the peers' reads of the staging slot");
    copy_all(copies, copy_stream_, "copying the input into the staging area");
    RR_CUDA_CHECK(cudaEventRecord(own_[0], copy_stream_), "marking this rank's input staged");
    RR_CUDA_CHECK(cudaStreamWaitEvent(stream, own_[0], 0),
                  "ordering the collective's stream after the copy-in");
  }

  // Slot `s` may be refilled after the work queued on `stream` so far (which waits for every
  // peer's reads of it).
  void release(int s, cudaStream_t stream) {
    RR_CUDA_CHECK(cudaEventRecord(released_[s], stream), "marking the staging slot free");
  }

  // Orders `stream` after everything queued on the copy stream (so far only copy-ins that
  // `stream` already waits for, unless the collective failed part-way). False on a CUDA error.
  bool join(cudaStream_t stream) {
    if (cudaEventRecord(copied_, copy_stream_) != cudaSuccess ||
        cudaStreamWaitEvent(stream, copied_, 0) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return true;
  }

  // Records the end of a collective's work on `stream` (after its waits on the peers' events).
  // Teardown waits for these events instead of the whole device. Returns false when it could
  // not (the work is then untracked; the caller reports it, and teardown leaks).
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
          if (!poll_event(done_.front().event, deadline)) {
            untracked_ = true;
            return false;
          }
          cudaEventDestroy(done_.front().event);
          done_.erase(done_.begin());
        }
      }
      Done d{stream, nullptr};
      if (cudaEventCreateWithFlags(&d.event, cudaEventDisableTiming) != cudaSuccess) {
        cudaGetLastError();
        untracked_ = true;
        return false;
      }
      done_.push_back(d);
      it = done_.end() - 1;
    }
    if (cudaEventRecord(it->event, stream) != cudaSuccess) {
      cudaGetLastError();
      untracked_ = true;
      return false;
    }
    return true;
  }

 private:
  struct Done {
    cudaStream_t stream;
    cudaEvent_t event;
  };

  // Waits until every collective this rank has queued has finished on the GPU (the copy stream
  // included), at most until `deadline`, and at most kGoneGrace more once a peer is gone.
  bool wait_own_work(Clock::time_point deadline) const {
    if (untracked_) return false;
    bool capped = false;
    auto next_check = Clock::now();
    for (;;) {
      cudaError_t status = copy_stream_ ? query(cudaStreamQuery(copy_stream_)) : cudaSuccess;
      for (const Done& d : done_) {
        if (status != cudaSuccess) break;
        status = query(cudaEventQuery(d.event));
      }
      if (status == cudaSuccess) return true;
      if (status != cudaErrorNotReady) return false;
      const auto t = Clock::now();
      if (t >= deadline) return false;
      if (!capped && t >= next_check && !g_.closed()) {
        for (int r = 0; r < g_.nranks() && !capped; ++r) {
          if (r != g_.rank() && g_.peer_gone(r)) {
            deadline = std::min(deadline, t + Clock::duration(kGoneGrace));
            capped = true;
          }
        }
        next_check = t + std::chrono::milliseconds(100);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

  // (a) this rank's GPU work, (b) the peers' events and staging areas opened here, (c) the
  // peers' release of this rank's, (d) this rank's events and staging area. A failed step
  // leaks what it guards until process exit: (a) queued work may still use any of it (it may
  // wait forever for a dead peer's event); (c) a peer that has not released this rank's
  // staging area may still have it mapped (exported memory must outlive every importer's
  // mapping), and a peer that is gone without releasing never will. In (b), the imports of a
  // peer whose process has exited are left alone: its exit freed the memory and events they
  // refer to, and closing or destroying an import after its exporter freed it is undefined
  // behaviour in CUDA (the driver's mappings go when this process exits). So are those of a
  // peer that has stopped waiting for this rank's release and may exit at any moment: the
  // closing/leaving handshake (HostGroup::begin_cuda_close) makes sure that a peer that has not
  // said so waits until this rank is done. Nothing is released once the group is closed.
  void teardown() {
    const Clock::time_point deadline = Clock::now() + std::min<Clock::duration>(
        g_.timeout(), std::chrono::duration_cast<Clock::duration>(kTeardownLimit));
    if (g_.closed() || !wait_own_work(deadline) || !g_.begin_cuda_close()) return;
    const int rank = g_.rank();
    for (size_t r = 0; r < peer_events_.size(); ++r) {
      if (int(r) == rank || !g_.may_close_imports_of(int(r))) continue;
      if (r < staging_.size() && staging_[r] != nullptr) cudaIpcCloseMemHandle(staging_[r]);
      for (cudaEvent_t e : peer_events_[r]) cudaEventDestroy(e);
    }
    peer_events_.clear();
    for (const Done& d : done_) cudaEventDestroy(d.event);
    done_.clear();
    for (cudaEvent_t e : {start_, released_[0], released_[1], copied_})
      if (e != nullptr) cudaEventDestroy(e);
    if (copy_stream_ != nullptr) cudaStreamDestroy(copy_stream_);
    copy_stream_ = nullptr;
    cudaGetLastError();
    if (!g_.release_cuda_and_wait(deadline, kAbortedPeerGrace, kClosingPeerWait)) return;
    for (cudaEvent_t e : own_) cudaEventDestroy(e);
    own_.clear();
    if (rank < int(staging_.size()) && staging_[size_t(rank)] != nullptr)
      cudaFree(staging_[size_t(rank)]);
    staging_.clear();
    cudaGetLastError();
  }

  HostGroup& g_;
  int device_;
  int64_t staging_bytes_;
  bool distinct_gpus_ = false;
  bool untracked_ = false;     // a collective's end could not be recorded: never free anything
  uint64_t rounds_ = 0;        // rounds run so far, for next_slot()
  std::vector<void*> staging_;  // [rank]: this rank's cudaMalloc; others: opened IPC mappings
  std::vector<cudaEvent_t> own_;
  std::vector<std::vector<cudaEvent_t>> peer_events_;
  cudaStream_t copy_stream_ = nullptr;
  cudaEvent_t start_ = nullptr;        // recorded by begin()
  cudaEvent_t released_[2] = {nullptr, nullptr};  // per slot, recorded by release()
  cudaEvent_t copied_ = nullptr;       // recorded by join()
  std::vector<Done> done_;
};

void destroy(Peers* p) { delete p; }

PeersPtr make_peers(HostGroup& g, int device, int64_t staging_bytes) {
  PeersPtr p(new Peers(g, device, staging_bytes));
  p->setup();
  return p;
}

int device_of(const Peers& p) { return p.device(); }

bool distinct_gpus(const Peers& p) { return p.distinct_gpus(); }

namespace {

// Elements of one ring chunk (or of one reduce_scatter segment) carried per round: a slot holds
// one piece of each of the nranks chunks, each a multiple of 16 bytes so pieces stay
// vector-aligned (as in cpu_collectives.cpp, with a slot for the staging area).
int64_t piece_elems(int64_t slot_bytes, int n, int64_t esize) {
  const int64_t align = esize >= 16 ? 1 : 16 / esize;
  return slot_bytes / (int64_t(n) * esize) / align * align;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

Desc device_desc(const Ctx& ctx, int dtype, int op, int root, int64_t count, int64_t round,
                 int device) {
  return make_desc(ctx.seq, ctx.kind, dtype, op, root, count, round, device);
}

std::string start_text(int64_t round) {
  return "at the start of round " + std::to_string(round);
}

std::string step_text(int64_t step, int64_t nsteps, int64_t round) {
  return "at ring step " + std::to_string(step) + "/" + std::to_string(nsteps) + " (round " +
         std::to_string(round) + ")";
}

std::string rank_text(int q) { return "rank " + std::to_string(q); }

// End of a one-shot round (inputs staged at base + 1, reads done at base + 2): this rank's
// stream waits until every rank in `readers` has finished reading this rank's slot on the GPU.
void wait_for_readers(HostGroup& g, Peers& p, const Ctx& ctx, uint64_t base,
                      const std::vector<int>& readers, cudaStream_t stream) {
  for (int q : readers) {
    g.wait(q, base + 2, ctx, "while " + rank_text(q) + " reads this rank's staging slot");
    RR_CUDA_CHECK(cudaStreamWaitEvent(stream, p.peer_event(q, 1), 0),
                  "ordering this rank's stream after " + rank_text(q) + "'s reads");
  }
}

// The end of a one-shot round in slot `s`: this rank's reads of the peers' slots are done (own
// event 1, step base + 2); if other ranks read this rank's slot (`readers`), its stream waits for
// them before the slot is released; then the round closes (base + 3).
void end_round(HostGroup& g, Peers& p, const Ctx& ctx, uint64_t base, int s,
               const std::vector<int>& readers, cudaStream_t stream) {
  RR_CUDA_CHECK(cudaEventRecord(p.own(1), stream), "marking this rank's reads done");
  g.publish(base + 2);
  if (!readers.empty()) {
    wait_for_readers(g, p, ctx, base, readers, stream);
    p.release(s, stream);
  }
  g.publish(base + 3);
  g.end_phase(3);
}

// Runs a collective's body on the rank's device inside guarded(), then joins the copy stream
// into `stream` and records the collective's end there, also when it failed part-way (the
// waits on peer events it queued must be tracked).
template <typename F>
void run_collective(HostGroup& g, const Ctx& ctx, Peers& p, cudaStream_t stream, F&& body) {
  guarded(g, ctx, [&] {
    DeviceGuard guard(p.device());
    p.begin(stream);
    try {
      body();
    } catch (...) {
      p.join(stream);
      p.mark_done(stream, Clock::now() + g.timeout());
      throw;
    }
    if (!p.join(stream) || !p.mark_done(stream, Clock::now() + g.timeout()))
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

// The once-rounded all-reduce (RINGREDUCE_CUDA_HALF_ROUNDING=once; float16 / bfloat16 sum and
// avg): a two-shot in the ring's rounds. Round i stages piece i of every ring chunk into this
// rank's slot (event 0, step base + 1), as the ring does; then this rank sums piece i of its
// own chunk over every rank's slot, in fp32 in rank order, rounded once (launch_chunk_once),
// into its own slot (event 1, base + 2), and copies every rank's finished piece out of that
// rank's slot into the tensor (event 2, base + 3: its reads of the peers' slots are done).
// Every rank reads every slot, so the slot is released once every peer's event 2 is done
// (base + 4). The bits of rr::cpu::all_reduce_once, whatever the staging size.
void two_shot_once(HostGroup& g, const Ctx& ctx, Peers& p, void* data, int64_t count,
                   DType dtype, Op op, cudaStream_t stream) {
  const int n = g.nranks();
  const int rank = g.rank();
  const int64_t esize = elem_size(dtype);
  const int64_t piece = piece_elems(p.slot_bytes(), n, esize);
  const int64_t rounds = std::max<int64_t>(1, ceil_div(chunk_elems(count, n, esize), piece));
  char* user = static_cast<char*>(data);
  const std::vector<int> peers = others(g);
  for (int64_t i = 0; i < rounds; ++i) {
    const uint64_t base = g.base();
    g.wait_all(base, ctx, start_text(i));
    g.set_desc(device_desc(ctx, int(dtype), int(op), -1, count, i, p.device()));
    const int s = p.next_slot();
    // Elements [begin[c], begin[c] + len[c]) of the tensor: piece i of chunk c, at offset
    // c * piece of every slot.
    std::vector<int64_t> begin(static_cast<size_t>(n)), len(static_cast<size_t>(n));
    std::vector<Copy> in;
    for (int c = 0; c < n; ++c) {
      len[size_t(c)] = chunk_piece(count, n, esize, c, piece, i, &begin[size_t(c)]);
      in.push_back(Copy{p.slot(rank, s) + c * piece * esize, user + begin[size_t(c)] * esize,
                        len[size_t(c)] * esize});
    }
    p.stage_in(s, in, stream);
    g.publish(base + 1);
    const int64_t at = rank * piece * esize;
    std::vector<const void*> srcs(size_t(n), nullptr);
    for (int q = 0; q < n; ++q) {
      srcs[size_t(q)] = p.slot(q, s) + at;
      if (q == rank) continue;
      g.wait(q, base + 1, ctx, "waiting for " + rank_text(q) + "'s input (round " +
                                   std::to_string(i) + ")");
      g.check_desc(q, ctx);
      RR_CUDA_CHECK(cudaStreamWaitEvent(stream, p.peer_event(q, 0), 0),
                    "ordering after " + rank_text(q) + "'s copy-in");
    }
    if (len[size_t(rank)] > 0) {
      // In place in this rank's slot: no peer reads this piece of it before event 1.
      ::rr::cuda::launch_chunk_once(srcs.data(), p.slot(rank, s) + at, n, len[size_t(rank)],
                                    dtype, op, stream, p.device());
    }
    RR_CUDA_CHECK(cudaEventRecord(p.own(1), stream), "recording this rank's summed piece");
    g.publish(base + 2);
    std::vector<Copy> out;
    for (int c = 0; c < n; ++c) {
      out.push_back(Copy{user + begin[size_t(c)] * esize, p.slot(c, s) + c * piece * esize,
                         len[size_t(c)] * esize});
      if (c == rank) continue;
      g.wait(c, base + 2, ctx, "waiting for " + rank_text(c) + "'s summed piece (round " +
                                   std::to_string(i) + ")");
      RR_CUDA_CHECK(cudaStreamWaitEvent(stream, p.peer_event(c, 1), 0),
                    "ordering after " + rank_text(c) + "'s summed piece");
    }
    copy_all(out, stream, "copying the summed pieces into the tensor");
    RR_CUDA_CHECK(cudaEventRecord(p.own(2), stream), "marking this rank's reads done");
    g.publish(base + 3);
    for (int q : peers) {
      g.wait(q, base + 3, ctx, "while " + rank_text(q) + " reads this rank's staging slot");
      RR_CUDA_CHECK(cudaStreamWaitEvent(stream, p.peer_event(q, 2), 0),
                    "ordering this rank's stream after " + rank_text(q) + "'s reads");
    }
    p.release(s, stream);
    g.publish(base + 4);
    g.end_phase(4);
  }
}

}  // namespace

// Round i carries piece i of every ring chunk: every element stays in the chunk the
// whole-tensor schedule puts it in, and is reduced in that chunk's order, so the result does
// not depend on the staging size.
void all_reduce(HostGroup& g, Peers& p, void* data, int64_t count, DType dtype, Op op,
                cudaStream_t stream) {
  const Ctx ctx = g.begin(Kind::AllReduce);
  const int n = g.nranks();
  if (n == 1) return;
  if (g.cuda_half_once() && ::rr::oneshot_rounds_once(dtype, op)) {
    run_collective(g, ctx, p, stream,
                   [&] { two_shot_once(g, ctx, p, data, count, dtype, op, stream); });
    return;
  }
  run_collective(g, ctx, p, stream, [&] {
    const int rank = g.rank();
    const int pred = mod(rank - 1, n);
    const int succ = mod(rank + 1, n);
    const int64_t esize = elem_size(dtype);
    const int64_t piece = piece_elems(p.slot_bytes(), n, esize);
    const int64_t rounds =
        std::max<int64_t>(1, ceil_div(chunk_elems(count, n, esize), piece));
    const int64_t steps = num_steps(n);
    char* user = static_cast<char*>(data);
    // The part of chunk c that round i carries: elements [begin, begin + len) of the tensor.
    auto part = [&](int c, int64_t i, int64_t* begin) {
      return chunk_piece(count, n, esize, c, piece, i, begin);
    };
    for (int64_t i = 0; i < rounds; ++i) {
      const uint64_t base = g.base();
      // Every rank has enqueued all of the previous round: its event waits are issued, so the
      // events may be recorded again.
      g.wait_all(base, ctx, start_text(i));
      g.set_desc(device_desc(ctx, int(dtype), int(op), -1, count, i, p.device()));
      const int s = p.next_slot();
      char* own = p.slot(rank, s);
      const char* from = p.slot(pred, s);
      std::vector<Copy> in, out;
      for (int c = 0; c < n; ++c) {
        int64_t begin;
        const int64_t len = part(c, i, &begin);
        char* staged = own + c * piece * esize;
        in.push_back(Copy{staged, user + begin * esize, len * esize});
        out.push_back(Copy{user + begin * esize, staged, len * esize});
      }
      p.stage_in(s, in, stream);
      g.publish(base + 1);
      for (int64_t k = 0; k < steps; ++k) {
        // Rank r's step k reads what its predecessor wrote at step k - 1 (k = 0: its input);
        // the predecessor's event k is recorded after that.
        g.wait(pred, base + 1 + uint64_t(k), ctx, step_text(k, steps, i));
        if (k == 0) g.check_desc(pred, ctx);
        RR_CUDA_CHECK(cudaStreamWaitEvent(stream, p.peer_event(pred, int(k)), 0),
                      "ordering after " + rank_text(pred) + " " + step_text(k, steps, i));
        const Step st = ring_step(rank, n, k);
        int64_t begin;
        const int64_t len = part(st.chunk, i, &begin);
        if (len > 0) {
          const int64_t at = st.chunk * piece * esize;
          ::rr::cuda::Task t{own + at, from + at, len};
          ::rr::cuda::launch_step(&t, 1, dtype, op, st.reduce, st.last_reduce, n, stream);
        }
        RR_CUDA_CHECK(cudaEventRecord(p.own(int(k) + 1), stream),
                      "recording " + step_text(k, steps, i));
        g.publish(base + 2 + uint64_t(k));
      }
      copy_all(out, stream, "copying the result out of the staging area");
      // The successor reads this rank's slot up to its last step: the slot is free after it.
      g.wait(succ, base + 1 + uint64_t(steps), ctx,
             "while the successor finishes reading (round " + std::to_string(i) + ")");
      RR_CUDA_CHECK(cudaStreamWaitEvent(stream, p.peer_event(succ, int(steps)), 0),
                    "ordering this rank's stream after its successor's last read");
      p.release(s, stream);
      g.publish(base + 2 + uint64_t(steps));
      g.end_phase(2 + uint64_t(steps));
    }
  });
}

void broadcast(HostGroup& g, Peers& p, void* data, int64_t bytes, int root, cudaStream_t stream) {
  const Ctx ctx = g.begin(Kind::Broadcast);
  const int n = g.nranks();
  if (n == 1) return;
  run_collective(g, ctx, p, stream, [&] {
    const int rank = g.rank();
    const int pred = mod(rank - 1, n);
    const int64_t cap = p.slot_bytes();
    const int64_t rounds = std::max<int64_t>(1, ceil_div(bytes, cap));
    char* user = static_cast<char*>(data);
    for (int64_t i = 0; i < rounds; ++i) {
      const uint64_t base = g.base();
      const int64_t off = std::min(bytes, i * cap);
      const int64_t len = std::min(bytes, off + cap) - off;
      g.wait_all(base, ctx, start_text(i));
      g.set_desc(device_desc(ctx, -1, -1, root, bytes, i, p.device()));
      const int s = p.next_slot();
      if (rank == root) p.stage_in(s, {Copy{p.slot(rank, s), user + off, len}}, stream);
      g.publish(base + 1);
      g.wait(pred, base + 1, ctx, start_text(i));
      g.check_desc(pred, ctx);
      if (rank != root) {
        g.wait(root, base + 1, ctx, "waiting for the root's data (round " +
                                        std::to_string(i) + ")");
        g.check_desc(root, ctx);
        if (len > 0) {
          RR_CUDA_CHECK(cudaStreamWaitEvent(stream, p.peer_event(root, 0), 0),
                        "ordering after the root's copy-in");
          copy_all({Copy{user + off, p.slot(root, s), len}}, stream, "copying from the root");
        }
      }
      end_round(g, p, ctx, base, s, rank == root ? others(g) : std::vector<int>(), stream);
    }
  });
}

void all_gather(HostGroup& g, Peers& p, const void* in, void* const* outs, int64_t bytes,
                cudaStream_t stream) {
  const Ctx ctx = g.begin(Kind::AllGather);
  const int n = g.nranks();
  const int rank = g.rank();
  const char* user = static_cast<const char*>(in);
  run_collective(g, ctx, p, stream, [&] {
    // In place (the input is this rank's slot of the output) needs no copy of its own.
    const bool own_copy = outs[rank] != in;
    if (n == 1) {
      if (own_copy) copy_all({Copy{outs[0], in, bytes}}, stream, "copying the single rank's input");
      return;
    }
    const int64_t cap = p.slot_bytes();
    const int64_t rounds = std::max<int64_t>(1, ceil_div(bytes, cap));
    for (int64_t i = 0; i < rounds; ++i) {
      const uint64_t base = g.base();
      const int64_t off = std::min(bytes, i * cap);
      const int64_t len = std::min(bytes, off + cap) - off;
      g.wait_all(base, ctx, start_text(i));
      g.set_desc(device_desc(ctx, -1, -1, -1, bytes, i, p.device()));
      const int s = p.next_slot();
      p.stage_in(s, {Copy{p.slot(rank, s), user + off, len}}, stream);
      g.publish(base + 1);
      if (own_copy)
        copy_all({Copy{static_cast<char*>(outs[rank]) + off, user + off, len}}, stream,
                 "copying this rank's own slot");
      for (int q : others(g)) {
        g.wait(q, base + 1, ctx, "waiting for " + rank_text(q) + "'s input (round " +
                                     std::to_string(i) + ")");
        g.check_desc(q, ctx);
        if (len == 0) continue;
        RR_CUDA_CHECK(cudaStreamWaitEvent(stream, p.peer_event(q, 0), 0),
                      "ordering after " + rank_text(q) + "'s copy-in");
        copy_all({Copy{static_cast<char*>(outs[q]) + off, p.slot(q, s), len}}, stream,
                 "copying " + rank_text(q) + "'s input");
      }
      end_round(g, p, ctx, base, s, others(g), stream);
    }
  });
}

void reduce_scatter(HostGroup& g, Peers& p, const void* in, void* out, int64_t count, DType dtype,
                    Op op, cudaStream_t stream) {
  const Ctx ctx = g.begin(Kind::ReduceScatter);
  const int n = g.nranks();
  const int rank = g.rank();
  const int64_t esize = elem_size(dtype);
  const char* user = static_cast<const char*>(in);
  char* result = static_cast<char*>(out);
  run_collective(g, ctx, p, stream, [&] {
    if (n == 1) {
      if (out != in)
        copy_all({Copy{out, in, count * esize}}, stream, "copying the single rank's input");
      return;
    }
    const int64_t piece = piece_elems(p.slot_bytes(), n, esize);
    const int64_t rounds = std::max<int64_t>(1, ceil_div(count, piece));
    const bool once = g.cuda_half_once() && ::rr::oneshot_rounds_once(dtype, op);
    for (int64_t i = 0; i < rounds; ++i) {
      const uint64_t base = g.base();
      const int64_t lo = std::min(count, i * piece);
      const int64_t len = std::min(count, lo + piece) - lo;
      g.wait_all(base, ctx, start_text(i));
      g.set_desc(device_desc(ctx, int(dtype), int(op), -1, count, i, p.device()));
      const int s = p.next_slot();
      std::vector<Copy> staged;
      for (int seg = 0; seg < n; ++seg) {
        staged.push_back(Copy{p.slot(rank, s) + seg * piece * esize,
                              user + (seg * count + lo) * esize, len * esize});
      }
      // In place (`out` is segment `rank` of `in`): this round's part of it is read here,
      // before the reduction below overwrites it, and later rounds read later parts only.
      p.stage_in(s, staged, stream);
      g.publish(base + 1);
      std::vector<const char*> srcs(size_t(n), nullptr);
      for (int q = 0; q < n; ++q) {
        srcs[size_t(q)] = p.slot(q, s) + rank * piece * esize;
        if (q == rank) continue;
        g.wait(q, base + 1, ctx, "waiting for " + rank_text(q) + "'s input (round " +
                                     std::to_string(i) + ")");
        g.check_desc(q, ctx);
        if (len == 0) continue;
        RR_CUDA_CHECK(cudaStreamWaitEvent(stream, p.peer_event(q, 0), 0),
                      "ordering after " + rank_text(q) + "'s copy-in");
      }
      if (len > 0 && once) {
        // Fixed order 0, 1, ..., N-1 in fp32, rounded once (RINGREDUCE_CUDA_HALF_ROUNDING).
        const std::vector<const void*> from(srcs.begin(), srcs.end());
        ::rr::cuda::launch_chunk_once(from.data(), result + lo * esize, n, len, dtype, op, stream,
                                      p.device());
      } else if (len > 0) {
        // Fixed order 0, 1, ..., N-1, the same on every rank and every call.
        char* dst = result + lo * esize;
        copy_all({Copy{dst, srcs[0], len * esize}}, stream, "copying rank 0's segment");
        for (int q = 1; q < n; ++q) {
          ::rr::cuda::Task t{dst, srcs[size_t(q)], len};
          ::rr::cuda::launch_step(&t, 1, dtype, op, true, q == n - 1, n, stream);
        }
      }
      end_round(g, p, ctx, base, s, others(g), stream);
    }
  });
}

}  // namespace cuda
}  // namespace dist
}  // namespace rr
