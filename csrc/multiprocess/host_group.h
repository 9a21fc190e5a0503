// Host-side rendezvous and synchronisation for the multi-process executors. Torch-free.
//
// Every rank creates one POSIX shared-memory segment: a header (progress counter, state, the
// descriptor of the collective it is in, CUDA IPC handles) followed by a staging area for CPU
// tensors, a point-to-point area (rings per destination, see p2p.h) and two small-message
// slots (cpu_collectives.cpp: the one-round all-reduce). Ranks exchange segment
// names through the process group's store, map every peer's segment, and unlink their own as
// soon as every peer has mapped it, so nothing is left in /dev/shm once the group is up,
// whatever happens to the processes afterwards.
//
// Synchronisation is one monotone 64-bit counter per rank (`progress`). Every rank runs the
// same sequence of collectives, each a sequence of phases, and each phase advances every
// rank's counter by the same amount, so all ranks agree on the value a counter must reach
// ("rank p has finished step k of this phase" is "progress[p] >= base + k + 1"). A rank writes
// its data, then publishes with a release store; a reader waits with acquire loads, so what
// the writer wrote before publishing is visible. Waiters spin up to a scheduler slice without
// yielding (not at all when the group's ranks outnumber this process's cores: they yield
// instead; in collectives from RINGREDUCE_SHARED_CORE_BYTES up they yield to a peer that last
// published from their own CPU), then sleep on a futex next to the counter.
//
// Every wait is bounded by the group's timeout, measured from the start of the collective, and
// fails naming the collective, the peer and the step. A rank whose collective fails marks its
// header aborted with the message, so its neighbours fail at once instead of timing out too.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "../ring/env.h"

namespace rr {
namespace dist {

// True when process `pid` (of this pid namespace) has exited; a zombie not yet reaped counts as
// exited (its memory is gone).
bool process_exited(int64_t pid);

constexpr int kMaxRanks = 64;
constexpr int kIpcHandleBytes = 64;            // sizeof(cudaIpc{Mem,Event}Handle_t)
constexpr int kMaxEvents = 2 * kMaxRanks + 2;  // a ring phase records 2N - 1 events

enum class Kind : int32_t {
  None = 0, AllReduce, Broadcast, AllGather, ReduceScatter, Barrier, CudaSetup, Gather, Scatter,
  AllToAll
};
const char* kind_name(Kind k);

// What a rank is doing in the current phase. Written before the phase's first publish, read by
// peers after it, so that ranks that disagree (shape, dtype, op, root, collective) fail with a
// message instead of exchanging garbage.
struct Desc {
  uint64_t seq;     // collective number in this group, from 1
  int32_t kind;     // Kind
  int32_t dtype;    // rr::DType, -1 for byte collectives
  int32_t op;       // rr::Op, -1 where there is none
  int32_t root;     // broadcast root, -1 otherwise
  int64_t count;    // elements (or bytes for byte collectives) per rank
  int64_t round;    // round within the collective (large CPU tensors go in rounds), or
                    // kSmallRound
  int32_t device;   // -1: host memory; otherwise the CUDA ordinal of the rank's buffer
  int32_t path;     // kTwoShotPath: an all-reduce round of the two-shot path; 0 otherwise
};

// Desc::round of an all-reduce that takes the one-round small-message path.
constexpr int64_t kSmallRound = -1;
// Desc::path of an all-reduce round that takes the two-shot path (cpu_collectives.cpp).
constexpr int32_t kTwoShotPath = 1;

inline Desc make_desc(uint64_t seq, Kind kind, int dtype, int op, int root, int64_t count,
                      int64_t round, int device) {
  Desc d{};
  d.seq = seq;
  d.kind = int32_t(kind);
  d.dtype = dtype;
  d.op = op;
  d.root = root;
  d.count = count;
  d.round = round;
  d.device = device;
  return d;
}

struct IpcSlot {
  unsigned char bytes[kIpcHandleBytes];
};

// CUDA state a rank shares with its peers (opaque bytes here, so this header stays CUDA-free).
// Written once, by the CUDA setup step of the rank's first CUDA collective.
struct CudaArea {
  int32_t device;            // ordinal of the rank's GPU
  int32_t nevents;           // IPC events exported in `events`
  uint64_t device_uuid[2];   // cudaDeviceProp::uuid, to tell "same GPU" across processes
  IpcSlot events[kMaxEvents];
  IpcSlot staging;           // IPC handle of the rank's device staging area (its own cudaMalloc)
  int64_t staging_bytes;     // its size: RINGREDUCE_CUDA_BUFFER_BYTES, the same on every rank
};

enum : uint32_t { kLive = 0, kAborted = 1, kClosed = 2 };

struct alignas(64) Header {
  uint64_t magic;
  int32_t rank;
  int32_t nranks;
  int64_t pid;
  uint64_t pid_ns;   // inode of /proc/self/ns/pid: liveness checks only within one namespace
  int64_t capacity;  // bytes of staging area after the header
  int64_t small_bytes;  // RINGREDUCE_SMALL_BYTES: data bytes of each small-message slot
  int32_t half_once;    // RINGREDUCE_HALF_ROUNDING: 1 once (the default), 0 per_hop
  int32_t cuda_half_once;  // RINGREDUCE_CUDA_HALF_ROUNDING: 1 once, 0 per_hop (the default)
  int32_t waits_sleep;     // 1: this rank's waits do not spin (HostGroup::waits_sleep)
  int64_t two_shot_min;    // RINGREDUCE_TWO_SHOT_MIN_BYTES
  int64_t two_shot_max;    // RINGREDUCE_TWO_SHOT_MAX_BYTES
  alignas(64) std::atomic<uint64_t> progress;
  // The CPU this rank last published from, in collectives of at least
  // RINGREDUCE_SHARED_CORE_BYTES (HostGroup::begin): a waiter on the same CPU yields to it.
  std::atomic<int32_t> last_cpu;
  alignas(64) std::atomic<uint32_t> wake;     // futex word, bumped on every publish
  std::atomic<uint32_t> waiters;              // peers sleeping on `wake`
  alignas(64) std::atomic<int32_t> waiting_for;  // the rank this one is blocked on, or -1
  alignas(64) std::atomic<uint32_t> state;    // kLive / kAborted / kClosed
  std::atomic<uint32_t> cuda_released;        // 1: holds no peer's IPC events or memory any more
  // CUDA teardown's handshake between an importer and an exporter that stops waiting for it
  // (release_cuda_and_wait): 1 once this rank has begun closing its imports of peers' IPC
  // events and memory (begin_cuda_close) / once it gave up waiting for a peer's release and
  // may exit with its exports still mapped there.
  std::atomic<uint32_t> cuda_closing;
  std::atomic<uint32_t> cuda_leaving;
  char message[1024];                         // why, when not kLive
  // The number (Desc::seq) of the last one-round all-reduce this rank finished: a peer that
  // finds this rank aborted tells "failed inside it" from "failed after it" (check_not_failed).
  // On a line of its own: written by every one-round all-reduce and read by peers only after an
  // abort, so that `state`'s line, which peers read in every one, stays in their caches.
  alignas(64) std::atomic<uint64_t> small_done;
  alignas(64) Desc desc;
  alignas(64) CudaArea cuda;
  // Point-to-point (p2p.h): bumped by whoever gives this rank's p2p thread something to do (a
  // peer that sent to it or made room in a ring it writes, a local post); it sleeps on it.
  alignas(64) std::atomic<uint32_t> p2p_bell;
  std::atomic<uint32_t> p2p_waiters;
};

// One counter on its own cache line.
struct alignas(64) Counter {
  std::atomic<uint64_t> value;
};

// A rank's point-to-point area, after its staging area: for each peer q, `sent[q]` counts the
// bytes this rank has written into its ring towards q, `consumed[q]` the bytes this rank has
// read from q's ring towards it. The rings (one per destination, p2p_ring_bytes() each) follow.
struct P2PCounters {
  Counter sent[kMaxRanks];
  Counter consumed[kMaxRanks];
};

// The head of a small-message slot (HostGroup::small_slot), 64-byte aligned. Data of up to
// kInlineSmallBytes follows right after it, in the head's cache line, so that a peer reads the
// descriptor, the publish and the data in one transfer; larger data starts on the next line
// (small_data), where the copies and the combine find it aligned. Each slot carries its own
// descriptor: the header's `desc` cannot serve a phase that starts without a barrier
// (cpu_collectives.cpp, the one-round all-reduce).
struct SmallSlot {
  Desc desc;
  // Desc::seq of the all-reduce whose input the slot holds, stored (release) after the
  // descriptor and the data (HostGroup::fill_small_slot).
  std::atomic<uint64_t> ready;
};
static_assert(sizeof(SmallSlot) == 56, "a small slot's head leaves 8 bytes of its cache line");
constexpr int64_t kInlineSmallBytes = 64 - int64_t(sizeof(SmallSlot));

// Thrown for every failure that involves another rank (timeouts, dead or failed peers,
// mismatched arguments). The binding turns it into a Python RuntimeError.
class CommError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// One collective in progress: its name and number, for messages, and its deadline.
struct Ctx {
  Kind kind;
  uint64_t seq;
  std::chrono::steady_clock::time_point start;
  std::chrono::steady_clock::time_point deadline;
};

class HostGroup {
 public:
  // Creates this rank's segment with `capacity` bytes of staging area. `tag` makes the name
  // unique to this group's incarnation (the same on every rank).
  HostGroup(int rank, int nranks, int64_t capacity, double timeout_s, const std::string& tag);
  ~HostGroup();
  HostGroup(const HostGroup&) = delete;
  HostGroup& operator=(const HostGroup&) = delete;

  const std::string& name() const { return name_; }
  int rank() const { return rank_; }
  int nranks() const { return nranks_; }
  int64_t capacity() const { return capacity_; }
  // All-reduces of at most this many bytes take the one-round small path; 0: never.
  int64_t small_bytes() const { return small_bytes_; }
  // float16 / bfloat16 sums and averages on host memory: summed in fp32 in rank order and
  // rounded once (RINGREDUCE_HALF_ROUNDING=once, the default), or rounded on every ring hop
  // (per_hop). Read when the group is made; every rank must have the same.
  bool half_once() const { return half_once_; }
  // RINGREDUCE_CUDA_HALF_ROUNDING=once when the group was made (the same on every rank): the
  // CUDA collectives' float16 / bfloat16 sums and averages are rounded once.
  bool cuda_half_once() const { return cuda_half_once_; }
  // True when this rank's waits sleep at once instead of spinning: the group's ranks outnumber
  // this process's cores, or RINGREDUCE_SPIN_US=0.
  bool waits_sleep() const { return spin_ns_ == 0; }
  // Whether an all-reduce of `bytes` bytes per rank that rounds like the ring takes the two-shot
  // path with the ring's bits instead of the ring (cpu_collectives.cpp): in a group where every
  // rank's waits sleep (known once attached; the same answer on every rank), for sizes in
  // [RINGREDUCE_TWO_SHOT_MIN_BYTES, RINGREDUCE_TWO_SHOT_MAX_BYTES].
  bool two_shot(int64_t bytes) const {
    return all_sleep_ && two_shot_max_ > 0 && bytes >= two_shot_min_ && bytes <= two_shot_max_;
  }
  void set_timeout(double seconds);
  std::chrono::nanoseconds timeout() const { return timeout_; }

  // Maps every peer's segment (names[r] is rank r's); checks each header.
  void attach(const std::vector<std::string>& names);
  // Removes this rank's segment name; the memory lives on while anyone has it mapped.
  void unlink();
  // Marks this rank closed (peers still waiting on it fail at once) and unmaps everything.
  void close();
  bool closed() const { return closed_.load(std::memory_order_acquire); }

  Header* header(int r) const { return headers_[r]; }
  char* staging(int r) const;
  P2PCounters* p2p_counters(int r) const;
  // Rank `owner`'s ring towards rank `dst` (the owner writes it, dst reads it).
  char* p2p_ring(int owner, int dst) const;
  int64_t p2p_ring_bytes() const { return p2p_ring_bytes_; }
  // Bumps rank r's p2p bell and wakes its p2p thread if it sleeps.
  void ring_bell(int r) const;
  // ring_bell(rank()), safe from any thread at any time, also after close().
  void ring_own_bell();
  // Sleeps while this rank's p2p bell still reads `seen`, at most `ns` nanoseconds.
  void wait_bell(uint32_t seen, int64_t ns) const;
  // Rank r's small-message slot `s` (0 or 1); the data of an all-reduce of `bytes` bytes (at
  // most small_bytes()) lies at small_data(r, s, bytes): in the head's line up to
  // kInlineSmallBytes, 64-byte aligned on the lines after it otherwise.
  SmallSlot* small_slot(int r, int s) const;
  char* small_data(int r, int s, int64_t bytes) const {
    return reinterpret_cast<char*>(small_slot(r, s)) +
           (bytes <= kInlineSmallBytes ? sizeof(SmallSlot) : 64);
  }
  // Fills this rank's small slot `s` for the all-reduce that `d` describes: the descriptor, then
  // `bytes` of `data`, then (release) `ready`, before the phase's publish.
  void fill_small_slot(int s, const Desc& d, const void* data, int64_t bytes);
  // Waits until rank `peer` has filled its small slot `s` for all-reduce `ctx` (its `ready` holds
  // ctx.seq) or has published `target` (a peer that took another path or runs another
  // collective: check_small_desc then says how they disagree). Otherwise as wait().
  void wait_small(int peer, int s, uint64_t target, const Ctx& ctx, const char* what) const;
  // The slot this rank's next small all-reduce writes: 0, 1, 0, ... (the count of small
  // all-reduces, which every rank runs in the same order, so all ranks agree on it).
  int next_small_slot() { return int(small_calls_++ & 1); }
  // The half of the staging area the all-reduce ring's next round uses: they alternate, and
  // every rank counts the same rounds (cpu_collectives.cpp, all_reduce).
  int next_ring_half() { return int(ring_rounds_++ & 1); }
  // True when rank `peer`'s process has exited (checked through /proc, same pid namespace).
  bool peer_dead(int peer) const;

  // Starts a collective: checks that this group is usable and returns its context. `bytes`:
  // the data a rank's side of a CPU collective holds (-1: a CUDA collective); from
  // RINGREDUCE_SHARED_CORE_BYTES up, a waiting rank that finds its peer last ran on its own
  // CPU yields to it instead of spinning.
  Ctx begin(Kind kind, int64_t bytes = -1);
  // Progress value at the start of the next phase; `end_phase(n)` moves past a phase of n steps.
  uint64_t base() const { return base_; }
  void end_phase(uint64_t n) { base_ += n; }

  void publish(uint64_t value);
  // Waits until rank `peer` has published `target`. `what` describes the step for messages
  // (read only when one is raised: a literal costs nothing on the way).
  void wait(int peer, uint64_t target, const Ctx& ctx, const char* what) const;
  void wait(int peer, uint64_t target, const Ctx& ctx, const std::string& what) const {
    wait(peer, target, ctx, what.c_str());
  }
  // Throws like wait() if rank `peer` failed (is aborted) inside this collective: without getting
  // past `target` and without having finished it (small_done). For a phase whose last need of a
  // peer is its publish of `target` (the one-round all-reduce): a peer aborted while still in it
  // must fail this collective, as a wait for it would; one aborted after finishing it must not.
  void check_not_failed(int peer, uint64_t target, const Ctx& ctx, const char* what) const;
  // Records that this rank finished the one-round all-reduce `ctx` (before it returns, so before
  // any later abort of this rank).
  void small_finished(const Ctx& ctx);
  // Waits until every rank has published `target` (skipping this one).
  void wait_all(uint64_t target, const Ctx& ctx, const char* what) const;
  void wait_all(uint64_t target, const Ctx& ctx, const std::string& what) const {
    wait_all(target, ctx, what.c_str());
  }

  // Writes this rank's descriptor for the phase about to be published.
  void set_desc(const Desc& d);
  // Throws a CommError if rank `peer`'s descriptor disagrees with this rank's.
  void check_desc(int peer, const Ctx& ctx) const;
  // The same for the descriptors in small-message slot `s` of this rank and of `peer`.
  void check_small_desc(int peer, int s, const Ctx& ctx) const;

  // Marks this rank aborted with `msg` and wakes its waiters; later collectives fail at once,
  // and a wait in progress on this rank (another thread: ProcessGroup.abort) stops within
  // ~50 ms. Safe to call from any thread at any time, also after close().
  void fail(const std::string& msg);
  std::string describe(const Ctx& ctx) const;  // "all_reduce #3 on rank 1"

  // Teardown of the CUDA path: announces that this rank has released every peer's IPC events
  // and memory, then waits (at most until `deadline`) until every peer has announced the same
  // or has exited. True when all have: this rank's exported events and staging area are then
  // no longer used by anyone and may be freed. A peer whose group is closed without that
  // announcement is not waited for (it never will make it) and makes the answer false; one
  // whose group is aborted is waited for at most `aborted_grace` (it may be tearing down).
  // Before it gives up on a peer (false), it announces that it is leaving, and then waits for
  // every peer that has begun closing its imports (begin_cuda_close) to finish, or to exit, for
  // at most `closing_wait` more: such a peer no longer waits for anything and is a few CUDA
  // calls from done.
  bool release_cuda_and_wait(std::chrono::steady_clock::time_point deadline,
                             std::chrono::steady_clock::duration aborted_grace,
                             std::chrono::steady_clock::duration closing_wait) const;
  // Teardown of the CUDA path, before this rank closes its imports of peers' IPC events and
  // memory: announces that it begins to. False when the group is closed (nothing may be
  // closed then: no peer can be asked).
  bool begin_cuda_close() const;
  // After begin_cuda_close: true when rank `peer`'s imports here may be closed; false when it
  // has exited or left without waiting for this rank (closing or destroying an import after
  // its exporter exited is undefined behaviour in CUDA). The two announcements are
  // sequentially consistent: of this rank's "closing" and the peer's "leaving", at least one
  // side sees the other's, so either the peer waits for this rank's release or this rank
  // leaves the peer's imports alone.
  bool may_close_imports_of(int peer) const;
  // True when rank `peer` has exited, or its group is no longer live (aborted or closed).
  bool peer_gone(int peer) const;
  // The lowest peer whose group failed (its header aborted), with its message; false when none
  // has or this group is closed. Safe from any thread at any time, like fail().
  bool aborted_peer(int& peer, std::string& message);

 private:
  enum class Problem { Timeout, Exited, Aborted, Closed };
  [[noreturn]] void raise_peer_problem(int peer, uint64_t target, const Ctx& ctx,
                                       const char* what, Problem problem) const;
  std::string where_is(int peer) const;  // "is at step 2 of this phase" etc.
  void compare_descs(const Desc& mine, const Desc& theirs, int peer, const Ctx& ctx) const;
  // The waits behind wait() and wait_small(): until `ready()`, which holds once rank `peer` has
  // published `target`, if not before.
  template <typename Ready>
  void wait_until(int peer, uint64_t target, Ready ready, const Ctx& ctx, const char* what) const;
  std::string setting_mismatch(const Header* h) const;
  bool same_settings(const Header* h) const;
  std::string size_mismatch(int fd, size_t size) const;  // why a peer's segment size differs

  int rank_;
  int nranks_;
  int64_t capacity_;
  int64_t p2p_ring_bytes_;
  int64_t small_bytes_;
  int64_t two_shot_min_;
  int64_t two_shot_max_;
  bool all_sleep_ = false;   // every rank's waits sleep (attach)
  bool half_once_;
  bool cuda_half_once_;
  size_t small_offset_ = 0;  // of the small-message slots in every segment
  size_t small_stride_ = 0;  // bytes from one slot to the next
  int64_t spin_ns_;          // how long a wait spins before it sleeps
  bool spin_yield_;          // RINGREDUCE_SPIN_YIELD: sched_yield inside the spin too
  int64_t move_ns_;          // RINGREDUCE_MOVE_US: spin before moving off a peer's CPU (0: never)
  int64_t slice_ns_;         // RINGREDUCE_SLICE_US: the time slice a collective's thread asks for
  int64_t shared_core_bytes_;  // RINGREDUCE_SHARED_CORE_BYTES
  bool shared_core_yield_ = false;  // this collective: yield to a peer on this CPU
  std::chrono::nanoseconds timeout_;
  std::string name_;
  size_t map_bytes_ = 0;
  std::vector<Header*> headers_;
  bool linked_ = false;
  std::atomic<bool> closed_{false};
  // fail() may come from another thread (abort) while close() unmaps: they exclude each other.
  std::mutex state_mu_;
  uint64_t base_ = 0;
  uint64_t seq_ = 0;
  uint64_t small_calls_ = 0;
  uint64_t ring_rounds_ = 0;
};

// Runs one collective's body; on any failure marks this rank aborted (so peers waiting on it
// fail at once, naming it) and rethrows. Failures that are not CommErrors (CUDA errors) are
// rethrown as std::runtime_error prefixed with the collective's description.
template <typename F>
void guarded(HostGroup& g, const Ctx& ctx, F&& body) {
  try {
    body();
  } catch (const CommError& e) {
    g.fail(e.what());
    throw;
  } catch (const std::exception& e) {
    std::string what = e.what();
    const std::string prefix = "ringreduce: ";
    if (what.compare(0, prefix.size(), prefix) == 0) what.erase(0, prefix.size());
    const std::string msg = prefix + g.describe(ctx) + ": " + what;
    g.fail(msg);
    throw std::runtime_error(msg);
  }
}

}  // namespace dist
}  // namespace rr
