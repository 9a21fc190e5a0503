#include "host_group.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <new>
#include <sstream>
#include <thread>

#include "../ring/cpu_executor.h"
#include "../ring/types.h"

namespace rr {
namespace dist {

static_assert(std::atomic<uint64_t>::is_always_lock_free, "cross-process atomics need lock-free");
static_assert(std::atomic<uint32_t>::is_always_lock_free, "cross-process atomics need lock-free");
static_assert(sizeof(std::atomic<uint32_t>) == 4, "the futex word must be 32 bits");

namespace {

constexpr uint64_t kMagic = 0x34646572676e6972ULL;  // "ringred4"
constexpr size_t kHeaderBytes = (sizeof(Header) + 4095) / 4096 * 4096;
constexpr size_t kP2PCounterBytes = (sizeof(P2PCounters) + 4095) / 4096 * 4096;

// RINGREDUCE_SMALL_BYTES's default: all-reduces up to this size take the one-round path
// (cpu_collectives.cpp). Measured with bench/shm_latency.py (float32 sum, 2 cores, loop period
// per call), against the ring that stages only what the successor reads, in alternating halves:
// with 2 ranks the one round wins at 8 B-8 KiB (0.8 vs 1.4 us at 8 B), ties at 16-32 KiB and
// loses at 64 KiB (13.2 vs 10.8 us: every rank reduces the whole tensor, the ring only its
// chunk); with 4 ranks on the 2 cores it wins up to 32 KiB (20.6 vs 24.9 us) and ties at
// 64-128 KiB (33.0 vs 33.1, 52.9 vs 53.4).
constexpr int64_t kDefaultSmallBytes = 32 << 10;
// Its largest accepted value: every segment holds two slots of this size.
constexpr int64_t kMaxSmallBytes = 16 << 20;
// RINGREDUCE_TWO_SHOT_{MIN,MAX}_BYTES' defaults: where every rank's waits sleep (more ranks than
// cores), all-reduces of 512 KiB-2 MiB take the two-shot path (3 hand-offs a round instead of
// the ring's 2N - 1; the ring's bits). Measured with bench/load.py, 4 ranks on the 2-core
// machine, float32 sum, 9 runs alternated with the ring (bench/RESULTS.md, issue 49): beside one
// busy loop per core 1 MiB took 3.2 ms a call (median) against the ring's 3.9, 2 MiB 5.0
// against 6.0, quiet 0.88 and 2.2 against 1.21 and 2.5; a probe showed it 20-25 % slower than
// the ring quiet at 4-8 MiB (every rank copies its whole round in, where the ring reads its own
// operand in place), and 256 KiB is bimodal by run on either path.
constexpr int64_t kDefaultTwoShotMinBytes = 512 << 10;
constexpr int64_t kDefaultTwoShotMaxBytes = 2 << 20;
// How long a wait spins before it sleeps on the futex, when every rank of the group can have
// a core of its own (RINGREDUCE_SPIN_US overrides). A wait that gives its core away - a futex
// sleep, or a sched_yield while another process wants the core - costs a scheduler slice
// (0.75-3 ms) when the cores are busy: the other process runs its slice before this rank is
// back. So the spin is about a slice long and never yields: a peer that is running publishes
// within it, and only a peer that is far behind sends this rank to sleep. Measured with
// bench/load.py, 2 ranks on the 2-core machine beside one busy loop per core (bench/RESULTS.md,
// issue 49): a 50 us spin with a sched_yield every 64 pauses took 56 us-7.9 ms per 8 B call and
// 3.1-3.6 ms per 1 MiB one (3.3-7x its quiet time), a 1 ms spin without yields 11-20 us and
// 0.40-0.62 ms (0.8-1.2x); a 200 us spin left runs of 2.9 ms at 8 B. On a quiet machine the
// spin ends as soon as the peer publishes (0.6-1.3 us at 8 B): a longer one costs only where a
// peer is late, at most 1 ms of a core per wait.
constexpr int64_t kDefaultSpinNs = 1000000;
constexpr int64_t kMaxSpinNs = 10000000;
// sched_yield calls before sleeping where the group has more ranks than this process has
// cores (no spin there): a peer of this group that is ready to run on this core runs now
// rather than after a futex round trip (4 ranks on 2 quiet cores: 147-211 us per 8 B call with
// them, 267-462 without). RINGREDUCE_SPIN_YIELD=1 also yields inside the spin, every 64 pauses,
// and before every sleep (the behaviour before issue 49, for comparison).
constexpr int kYields = 4;
// RINGREDUCE_SHARED_CORE_BYTES's default. Where other processes keep every core busy, the
// scheduler may put two ranks on one core and their loads on the other: both cores then hold
// two tasks, and the balancer leaves them. A rank that spins for its peer then holds off the
// very process it waits for: 2 ranks, 64 MiB, beside one busy loop per core, took 19 ms per
// call quiet, 37-50 ms with the ranks on separate cores and 110-150 ms in runs with them on one
// (both pinned to one core: 142 ms; bench/RESULTS.md). From this size up a spinning waiter
// checks every 64 pauses whether its peer last published from its own CPU and yields to it.
// Not below: for small collectives the spin, which keeps the ranks looking busy, is what gets
// them moved apart (a wait that gave its core away on a shared CPU kept 8 B calls at 50 us for
// whole runs; bench/RESULTS.md, "Same core"), and a call's work is too short for the spin to
// cost much.
constexpr int64_t kDefaultSharedCoreBytes = 1 << 20;
// RINGREDUCE_MOVE_US's default: below RINGREDUCE_SHARED_CORE_BYTES, a spinning waiter that has
// spun this long and finds that its peer last published from its own CPU moves itself to
// another CPU (move_off_this_cpu), once per wait. Such a pair stays on one core for whole runs
// otherwise: both cores hold two busy tasks, which the balancer calls balanced, and every
// hand-off costs a spin (2-4.6 ms per 8 B-64 KiB call). Measured with bench/load.py, 2 ranks
// beside one busy loop per core in the ranks' session, 12 runs of each alternated, the async and
// the inline backend in each (bench/RESULTS.md, issue 49): sizes 8 B-64 KiB over 1 ms per call
// in 15 of 72 (sweep, size) cells without it, 4 sweeps stalled at every size; 2 of 72 with it,
// none past one size. Quiet, the ranks sit on cores of their own and never meet the condition.
// 0 turns it off; groups whose waits do not spin never move.
constexpr int64_t kDefaultMoveUs = 50;

// Bytes of each point-to-point ring: a quarter of the staging size shared among the
// destinations, at least a page. Larger messages stream through in pieces; this only bounds
// how much a send can leave behind without the receiver.
int64_t ring_bytes_for(int64_t capacity, int nranks) {
  const int64_t share = capacity / (4 * int64_t(nranks)) / 4096 * 4096;
  return share > 4096 ? share : 4096;
}

using Clock = std::chrono::steady_clock;

std::string errno_text(int err) { return std::string(std::strerror(err)); }

uint64_t own_pid_ns() {
  struct stat st;
  if (stat("/proc/self/ns/pid", &st) != 0) return 0;
  return uint64_t(st.st_ino);
}

// Sleeps on `word` while it still holds `expected`, for at most `ns` nanoseconds. Not
// FUTEX_PRIVATE: the word lives in memory shared between processes.
void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, int64_t ns) {
  struct timespec ts;
  ts.tv_sec = time_t(ns / 1000000000);
  ts.tv_nsec = long(ns % 1000000000);
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// sched_attr as the kernel's sched_setattr(2) takes it (glibc has no wrapper before 2.41).
struct SchedAttr {
  uint32_t size;
  uint32_t sched_policy;
  uint64_t sched_flags;
  int32_t sched_nice;
  uint32_t sched_priority;
  uint64_t sched_runtime;
  uint64_t sched_deadline;
  uint64_t sched_period;
};

// RINGREDUCE_SLICE_US's default where waits do not spin (more ranks than cores): the shortest
// slice the kernel grants (0.1 ms). A collective is a chain of hand-offs, and in such groups a
// rank waits for its peer asleep: it must get a core back when the peer publishes. With the
// kernel's slice (0.7 ms x (1 + log2 CPUs), 1.4 ms on 2 cores) it queues behind whatever runs
// there - a busy loop, a data loader - until that one's slice ends; with a short slice its
// earlier deadline lets it preempt at once. Its share of the CPU stays the same. Measured with
// bench/load.py beside one busy loop per core in the ranks' session (bench/RESULTS.md, issue
// 49), 4 ranks on 2 cores: 8 B 5.5 -> 0.31 ms per call, 16 MiB 113 -> 38 ms. Where waits spin
// (a core per rank), the short slice only cuts the spin short in favour of the other
// processes: 2 ranks lost 2 ms per 8 B call in every loaded run with it, none without, so there
// the default is the kernel's slice.
constexpr int64_t kDefaultSliceNs = 100000;
constexpr uint64_t kResetOnFork = 0x01;  // SCHED_FLAG_RESET_ON_FORK

// Asks the scheduler for time slices of `ns` for the calling thread, keeping its policy and
// nice value (the fair class's custom slice, Linux 6.12+: a shorter slice gives an earlier
// deadline, so a woken waiter preempts a task that has run longer instead of queueing behind
// its whole slice); `ns` 0 gives the thread back the kernel's default slice and the
// reset-on-fork flag it had before its first ask. A syscall only where the value differs from
// the thread's previous call: a thread that serves a group asking for a short slice and then
// one asking for nothing (a spinning group, which a short slice would cut short) runs each
// with its own. A kernel that refuses it (older, or a policy other than SCHED_OTHER) leaves
// the thread as it was.
void ask_for_slice(int64_t ns) {
  thread_local int64_t asked = 0;
  thread_local uint64_t own_flags = 0;
  if (asked == ns) return;
  const bool first = asked == 0;
  asked = ns;
  SchedAttr a{};
  if (syscall(SYS_sched_getattr, 0, &a, unsigned(sizeof(a)), 0u) != 0) return;
  if (a.sched_policy != SCHED_OTHER) return;
  if (first) own_flags = a.sched_flags & kResetOnFork;
  a.size = sizeof(a);
  a.sched_flags = ns > 0 ? kResetOnFork : own_flags;
  a.sched_runtime = uint64_t(ns);  // 0: the kernel's default slice
  syscall(SYS_sched_setattr, 0, &a, 0u);
}

// Moves the calling thread off the CPU it runs on, to another that its affinity mask allows,
// and gives it back its mask at once (the scheduler keeps it where it now runs until it has a
// reason to move it). At most once per 10 ms per thread; nothing where the mask allows one CPU
// or cannot be read. Where other processes keep every core busy, the scheduler may put two
// spinning ranks on one core and the others' tasks on the other: two tasks per core, balanced
// in its eyes, so it leaves them, and each hand-off waits for a whole spin.
void move_off_this_cpu() {
  thread_local Clock::time_point last{};
  const auto now = Clock::now();
  if (now - last < std::chrono::milliseconds(10)) return;
  last = now;
  cpu_set_t mask;
  CPU_ZERO(&mask);
  if (sched_getaffinity(0, sizeof(mask), &mask) != 0) return;
  const int cpu = sched_getcpu();
  if (cpu < 0 || cpu >= CPU_SETSIZE || !CPU_ISSET(cpu, &mask) || CPU_COUNT(&mask) < 2) return;
  cpu_set_t others = mask;
  CPU_CLR(cpu, &others);
  if (sched_setaffinity(0, sizeof(others), &others) != 0) return;
  sched_setaffinity(0, sizeof(mask), &mask);
}

// CPUs this process may run on (its affinity mask, which taskset and cgroup cpusets narrow).
int usable_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
  const long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? int(n) : 1;
}

std::string seconds(std::chrono::nanoseconds d) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f s", double(d.count()) / 1e9);
  return buf;
}

std::string desc_text(const Desc& d) {
  std::ostringstream s;
  s << kind_name(Kind(d.kind)) << " #" << d.seq;
  if (d.count >= 0) s << (d.dtype >= 0 ? " count=" : " bytes=") << d.count;
  if (d.dtype >= 0) s << " dtype=" << dtype_name(DType(d.dtype));
  if (d.op >= 0) s << " op=" << op_name(Op(d.op));
  if (d.root >= 0) s << " root=" << d.root;
  s << (d.device < 0 ? " on cpu" : " on cuda");
  if (Kind(d.kind) == Kind::AllReduce && d.round == kSmallRound) s << " (small-message path)";
  if (Kind(d.kind) == Kind::AllReduce && d.path == kTwoShotPath) s << " (two-shot path)";
  return s.str();
}

}  // namespace

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::None: return "nothing";
    case Kind::AllReduce: return "all_reduce";
    case Kind::Broadcast: return "broadcast";
    case Kind::AllGather: return "all_gather";
    case Kind::ReduceScatter: return "reduce_scatter";
    case Kind::Barrier: return "barrier";
    case Kind::CudaSetup: return "cuda_setup";
    case Kind::Gather: return "gather";
    case Kind::Scatter: return "scatter";
    case Kind::AllToAll: return "all_to_all";
  }
  return "?";
}

HostGroup::HostGroup(int rank, int nranks, int64_t capacity, double timeout_s,
                     const std::string& tag)
    : rank_(rank), nranks_(nranks), capacity_(capacity), p2p_ring_bytes_(0),
      small_bytes_(env_int("RINGREDUCE_SMALL_BYTES", kDefaultSmallBytes, 0, kMaxSmallBytes,
                           "a number of bytes (0 disables the one-round small all-reduce)")),
      two_shot_min_(env_int("RINGREDUCE_TWO_SHOT_MIN_BYTES", kDefaultTwoShotMinBytes, 0,
                            int64_t(1) << 62, "a number of bytes (the smallest all-reduce "
                            "that takes the two-shot path where waits sleep)")),
      two_shot_max_(env_int("RINGREDUCE_TWO_SHOT_MAX_BYTES", kDefaultTwoShotMaxBytes, 0,
                            int64_t(1) << 62, "a number of bytes (the largest all-reduce that "
                            "takes the two-shot path where waits sleep; 0: none)")),
      half_once_(::rr::cpu::half_rounding_setting() == ::rr::cpu::HalfRounding::Once),
      cuda_half_once_(::rr::cpu::cuda_half_rounding_setting() == ::rr::cpu::HalfRounding::Once),
      headers_(size_t(nranks), nullptr) {
  // Spinning only pays while the peer runs on another core. With more ranks than cores a
  // spinning rank takes the core from the peer it waits for: there it yields and sleeps at once.
  spin_ns_ = env_int("RINGREDUCE_SPIN_US", -1, 0, kMaxSpinNs / 1000,
                     "a number of microseconds (how long a wait spins before it sleeps)");
  spin_ns_ = spin_ns_ >= 0 ? spin_ns_ * 1000 : (nranks <= usable_cpus() ? kDefaultSpinNs : 0);
  spin_yield_ = env_int("RINGREDUCE_SPIN_YIELD", 0, 0, 1,
                        "0 or 1 (1: waits yield inside their spin, the old behaviour)") != 0;
  slice_ns_ = env_int("RINGREDUCE_SLICE_US", -1, 0, 100000,
                      "a number of microseconds (0: ask for nothing)");
  slice_ns_ = slice_ns_ >= 0 ? slice_ns_ * 1000 : (spin_ns_ > 0 ? 0 : kDefaultSliceNs);
  move_ns_ = env_int("RINGREDUCE_MOVE_US", kDefaultMoveUs, 0, kMaxSpinNs / 1000,
                     "a number of microseconds (0: never move off a peer's CPU)") * 1000;
  if (spin_ns_ == 0) move_ns_ = 0;  // the move is made from inside the spin: no CPU to record
  shared_core_bytes_ = env_int("RINGREDUCE_SHARED_CORE_BYTES", kDefaultSharedCoreBytes, 0,
                               int64_t(1) << 62, "a number of bytes (collectives from this size "
                               "up yield to a peer on the same CPU)");
  if (nranks < 1 || nranks > kMaxRanks)
    throw std::invalid_argument("ringreduce: world size must be in [1, " +
                                std::to_string(kMaxRanks) + "]; got " + std::to_string(nranks));
  if (rank < 0 || rank >= nranks)
    throw std::invalid_argument("ringreduce: rank must be in [0, " + std::to_string(nranks) +
                                "); got " + std::to_string(rank));
  if (capacity < 4096 || capacity % 4096 != 0)
    throw std::invalid_argument("ringreduce: shared-memory staging size must be a positive "
                                "multiple of 4096 bytes; got " + std::to_string(capacity));
  set_timeout(timeout_s);
  name_ = "/ringreduce-" + tag + "-r" + std::to_string(rank);
  const int fd = shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0)
    throw std::runtime_error("ringreduce: shm_open(" + name_ + ") failed: " + errno_text(errno));
  linked_ = true;
  p2p_ring_bytes_ = ring_bytes_for(capacity, nranks);
  // Page-aligned whatever the staging capacity, and each slot (its head and data) a whole
  // number of cache lines, so every slot starts on a line of its own.
  small_offset_ = (kHeaderBytes + size_t(capacity) + kP2PCounterBytes +
                   size_t(nranks) * size_t(p2p_ring_bytes_) + 4095) / 4096 * 4096;
  small_stride_ = 64 + (size_t(small_bytes_) + 63) / 64 * 64;
  map_bytes_ = small_offset_ + (2 * small_stride_ + 4095) / 4096 * 4096;
  // posix_fallocate reserves the pages now: without it a full /dev/shm shows up later as
  // SIGBUS on first touch instead of an error here.
  int err = posix_fallocate(fd, 0, off_t(map_bytes_));
  void* p = MAP_FAILED;
  if (err == 0) {
    p = mmap(nullptr, map_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) err = errno;
  }
  ::close(fd);
  if (err != 0) {
    shm_unlink(name_.c_str());
    linked_ = false;
    throw std::runtime_error("ringreduce: could not allocate " + std::to_string(map_bytes_) +
                             " bytes of shared memory for " + name_ + ": " + errno_text(err) +
                             " (is /dev/shm full? set RINGREDUCE_SHM_BYTES lower)");
  }
  Header* h = new (p) Header();
  h->magic = kMagic;
  h->rank = rank;
  h->nranks = nranks;
  h->pid = int64_t(getpid());
  h->pid_ns = own_pid_ns();
  h->capacity = capacity;
  h->small_bytes = small_bytes_;
  h->half_once = half_once_ ? 1 : 0;
  h->cuda_half_once = cuda_half_once_ ? 1 : 0;
  h->waits_sleep = waits_sleep() ? 1 : 0;
  h->two_shot_min = two_shot_min_;
  h->two_shot_max = two_shot_max_;
  h->progress.store(0, std::memory_order_relaxed);
  h->last_cpu.store(-1, std::memory_order_relaxed);
  h->wake.store(0, std::memory_order_relaxed);
  h->waiters.store(0, std::memory_order_relaxed);
  h->waiting_for.store(-1, std::memory_order_relaxed);
  h->cuda_released.store(0, std::memory_order_relaxed);
  h->cuda_closing.store(0, std::memory_order_relaxed);
  h->cuda_leaving.store(0, std::memory_order_relaxed);
  h->small_done.store(0, std::memory_order_relaxed);
  h->p2p_bell.store(0, std::memory_order_relaxed);
  h->p2p_waiters.store(0, std::memory_order_relaxed);
  P2PCounters* counters = new (static_cast<char*>(p) + kHeaderBytes + size_t(capacity))
      P2PCounters();
  for (int q = 0; q < kMaxRanks; ++q) {
    counters->sent[q].value.store(0, std::memory_order_relaxed);
    counters->consumed[q].value.store(0, std::memory_order_relaxed);
  }
  for (int s = 0; s < 2; ++s) {
    SmallSlot* slot = new (static_cast<char*>(p) + small_offset_ + size_t(s) * small_stride_)
        SmallSlot();
    slot->desc.seq = 0;  // matches no collective (they count from 1)
    slot->ready.store(0, std::memory_order_relaxed);
  }
  h->state.store(kLive, std::memory_order_release);
  headers_[size_t(rank)] = h;
}

HostGroup::~HostGroup() {
  try {
    close();
  } catch (...) {
  }
}

void HostGroup::set_timeout(double seconds) {
  if (!(seconds > 0))
    throw std::invalid_argument("ringreduce: timeout must be positive; got " +
                                std::to_string(seconds) + " s");
  timeout_ = std::chrono::nanoseconds(int64_t(seconds * 1e9));
}

void HostGroup::attach(const std::vector<std::string>& names) {
  if (int(names.size()) != nranks_)
    throw std::invalid_argument("ringreduce: attach needs one segment name per rank");
  for (int r = 0; r < nranks_; ++r) {
    if (r == rank_ || headers_[size_t(r)] != nullptr) continue;
    const std::string& n = names[size_t(r)];
    const int fd = shm_open(n.c_str(), O_RDWR, 0600);
    if (fd < 0)
      throw CommError("ringreduce: could not open rank " + std::to_string(r) +
                      "'s shared memory " + n + ": " + errno_text(errno) +
                      " (all ranks must run on one host and share /dev/shm)");
    struct stat st{};
    void* p = MAP_FAILED;
    const bool stat_ok = fstat(fd, &st) == 0;
    if (stat_ok && size_t(st.st_size) == map_bytes_)
      p = mmap(nullptr, map_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    const int err = errno;
    std::string why = errno_text(err);
    if (p == MAP_FAILED && stat_ok && size_t(st.st_size) != map_bytes_)
      why = "size differs: " + size_mismatch(fd, size_t(st.st_size));
    ::close(fd);
    if (p == MAP_FAILED)
      throw CommError("ringreduce: could not map rank " + std::to_string(r) + "'s shared memory " +
                      n + " (" + why + ")");
    Header* h = static_cast<Header*>(p);
    headers_[size_t(r)] = h;
    if (h->magic != kMagic || h->rank != r || h->nranks != nranks_)
      throw CommError("ringreduce: rank " + std::to_string(r) + "'s shared memory " + n +
                      " does not belong to this group (rank " + std::to_string(h->rank) +
                      " of " + std::to_string(h->nranks) + "; expected rank " +
                      std::to_string(r) + " of " + std::to_string(nranks_) + ")");
    // Both sizes decide which path a collective takes: ranks that differ would deadlock or
    // exchange garbage instead of failing, so the group refuses to form.
    if (!same_settings(h)) throw CommError(setting_mismatch(h));
  }
  // Which path an all-reduce takes must be the same on every rank: the two-shot path only
  // where every rank's waits sleep (each rank counts its own cores; they may differ).
  all_sleep_ = true;
  for (const Header* h : headers_) all_sleep_ = all_sleep_ && h->waits_sleep == 1;
}

bool HostGroup::same_settings(const Header* h) const {
  return h->small_bytes == small_bytes_ && h->capacity == capacity_ &&
         h->half_once == (half_once_ ? 1 : 0) && h->cuda_half_once == (cuda_half_once_ ? 1 : 0) &&
         h->two_shot_min == two_shot_min_ && h->two_shot_max == two_shot_max_;
}

std::string HostGroup::setting_mismatch(const Header* h) const {
  const int peer = h->rank;
  std::ostringstream s;
  s << "ringreduce: rank " << peer << " and rank " << rank_ << " (this one) were started with "
    << "different settings: ";
  if (h->capacity != capacity_)
    s << "RINGREDUCE_SHM_BYTES " << h->capacity << " on rank " << peer << " but " << capacity_
      << " here; ";
  if (h->small_bytes != small_bytes_)
    s << "RINGREDUCE_SMALL_BYTES " << h->small_bytes << " on rank " << peer << " but "
      << small_bytes_ << " here; ";
  if (h->half_once != (half_once_ ? 1 : 0))
    s << "RINGREDUCE_HALF_ROUNDING " << (h->half_once ? "once" : "per_hop") << " on rank " << peer
      << " but " << (half_once_ ? "once" : "per_hop") << " here; ";
  if (h->cuda_half_once != (cuda_half_once_ ? 1 : 0))
    s << "RINGREDUCE_CUDA_HALF_ROUNDING " << (h->cuda_half_once ? "once" : "per_hop") << " on rank "
      << peer << " but " << (cuda_half_once_ ? "once" : "per_hop") << " here; ";
  if (h->two_shot_min != two_shot_min_)
    s << "RINGREDUCE_TWO_SHOT_MIN_BYTES " << h->two_shot_min << " on rank " << peer << " but "
      << two_shot_min_ << " here; ";
  if (h->two_shot_max != two_shot_max_)
    s << "RINGREDUCE_TWO_SHOT_MAX_BYTES " << h->two_shot_max << " on rank " << peer << " but "
      << two_shot_max_ << " here; ";
  s << "every rank must use the same values";
  return s.str();
}

std::string HostGroup::size_mismatch(int fd, size_t size) const {
  // The header says which setting differs, when the segment is at least a header long and
  // of this build's layout.
  if (size >= kHeaderBytes) {
    void* p = mmap(nullptr, kHeaderBytes, PROT_READ, MAP_SHARED, fd, 0);
    if (p != MAP_FAILED) {
      const Header* h = static_cast<const Header*>(p);
      std::string text;
      if (h->magic == kMagic && !same_settings(h))
        text = setting_mismatch(h);
      munmap(p, kHeaderBytes);
      if (!text.empty()) return text.substr(std::string("ringreduce: ").size());
    }
  }
  return "are RINGREDUCE_SHM_BYTES and RINGREDUCE_SMALL_BYTES the same on every rank, and every "
         "rank running the same build of ringreduce?";
}

void HostGroup::unlink() {
  if (linked_) {
    shm_unlink(name_.c_str());
    linked_ = false;
  }
}

void HostGroup::close() {
  std::lock_guard<std::mutex> lock(state_mu_);
  if (closed_) return;
  unlink();
  Header* own = headers_[size_t(rank_)];
  if (own != nullptr && own->state.load(std::memory_order_acquire) == kLive) {
    std::snprintf(own->message, sizeof(own->message), "%s",
                  "it closed its process group (destroy_process_group or exit)");
    own->state.store(kClosed, std::memory_order_release);
    own->wake.fetch_add(1, std::memory_order_seq_cst);
    futex_wake_all(&own->wake);
  }
  for (Header*& h : headers_) {
    if (h != nullptr) munmap(h, map_bytes_);
    h = nullptr;
  }
  closed_.store(true, std::memory_order_release);
}

char* HostGroup::staging(int r) const {
  return reinterpret_cast<char*>(headers_[size_t(r)]) + kHeaderBytes;
}

P2PCounters* HostGroup::p2p_counters(int r) const {
  return reinterpret_cast<P2PCounters*>(staging(r) + capacity_);
}

char* HostGroup::p2p_ring(int owner, int dst) const {
  return staging(owner) + capacity_ + kP2PCounterBytes + size_t(dst) * size_t(p2p_ring_bytes_);
}

SmallSlot* HostGroup::small_slot(int r, int s) const {
  return reinterpret_cast<SmallSlot*>(reinterpret_cast<char*>(headers_[size_t(r)]) +
                                      small_offset_ + size_t(s) * small_stride_);
}

void HostGroup::ring_bell(int r) const {
  Header* h = headers_[size_t(r)];
  h->p2p_bell.fetch_add(1, std::memory_order_seq_cst);
  if (h->p2p_waiters.load(std::memory_order_seq_cst) != 0) futex_wake_all(&h->p2p_bell);
}

void HostGroup::ring_own_bell() {
  std::lock_guard<std::mutex> lock(state_mu_);
  if (!closed_) ring_bell(rank_);
}

void HostGroup::wait_bell(uint32_t seen, int64_t ns) const {
  if (ns <= 0) return;
  Header* own = headers_[size_t(rank_)];
  own->p2p_waiters.fetch_add(1, std::memory_order_seq_cst);
  if (own->p2p_bell.load(std::memory_order_seq_cst) == seen) futex_wait(&own->p2p_bell, seen, ns);
  own->p2p_waiters.fetch_sub(1, std::memory_order_seq_cst);
}

Ctx HostGroup::begin(Kind kind, int64_t bytes) {
  shared_core_yield_ = bytes >= 0 && bytes >= shared_core_bytes_;
  if (closed_) throw CommError("ringreduce: " + std::string(kind_name(kind)) +
                               " on a process group that was already destroyed");
  Header* own = headers_[size_t(rank_)];
  if (own->state.load(std::memory_order_acquire) != kLive)
    throw CommError("ringreduce: " + std::string(kind_name(kind)) + " on rank " +
                    std::to_string(rank_) + ": this process group failed earlier and cannot be "
                    "used any more: " + own->message);
  for (int r = 0; r < nranks_; ++r) {
    if (headers_[size_t(r)] == nullptr)
      throw CommError("ringreduce: " + std::string(kind_name(kind)) +
                      " before every rank's shared memory was attached");
  }
  Ctx c;
  c.kind = kind;
  c.seq = ++seq_;
  c.start = Clock::now();
  ask_for_slice(slice_ns_);
  c.deadline = c.start + timeout_;
  return c;
}

void HostGroup::publish(uint64_t value) {
  Header* own = headers_[size_t(rank_)];
  if (shared_core_yield_ || move_ns_ > 0)
    own->last_cpu.store(sched_getcpu(), std::memory_order_relaxed);
  own->progress.store(value, std::memory_order_seq_cst);
  own->wake.fetch_add(1, std::memory_order_seq_cst);
  if (own->waiters.load(std::memory_order_seq_cst) != 0) futex_wake_all(&own->wake);
}

bool process_exited(int64_t pid) {
  if (kill(pid_t(pid), 0) != 0 && errno == ESRCH) return true;
  // A killed child that its parent has not reaped yet is a zombie: still "exists".
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return true;
  const size_t paren = line.rfind(')');
  if (paren == std::string::npos || paren + 2 >= line.size()) return false;
  const char state = line[paren + 2];
  return state == 'Z' || state == 'X';
}

bool HostGroup::peer_dead(int peer) const {
  const Header* h = headers_[size_t(peer)];
  if (h->pid_ns == 0 || h->pid_ns != own_pid_ns()) return false;
  return process_exited(int64_t(h->pid));
}

std::string HostGroup::describe(const Ctx& ctx) const {
  return std::string(kind_name(ctx.kind)) + " #" + std::to_string(ctx.seq) + " on rank " +
         std::to_string(rank_);
}

std::string HostGroup::where_is(int peer) const {
  const uint64_t at = headers_[size_t(peer)]->progress.load(std::memory_order_acquire);
  if (at <= base_) return "has not started this collective";
  return "is at step " + std::to_string(at - base_) + " of this phase";
}

void HostGroup::raise_peer_problem(int peer, uint64_t target, const Ctx& ctx,
                                   const char* what, Problem problem) const {
  const Header* h = headers_[size_t(peer)];
  std::ostringstream s;
  s << "ringreduce: " << describe(ctx);
  const std::string who = "rank " + std::to_string(peer) + " (pid " + std::to_string(h->pid) + ")";
  switch (problem) {
    case Problem::Timeout:
      // "(the group's timeout is ...)" names the knob, and holds " timeout ", the word that
      // torch's own tests (and tools matching its errors) look for.
      s << " timed out after " << seconds(Clock::now() - ctx.start) << " (the group's timeout "
        << "is " << seconds(timeout_) << ") waiting for " << who;
      break;
    case Problem::Exited: s << " failed: " << who << " exited"; break;
    case Problem::Aborted: s << " failed: " << who << " failed"; break;
    case Problem::Closed: s << " failed: " << who << " closed its process group"; break;
  }
  if (problem != Problem::Timeout) s << " while this rank waited for it";
  s << " " << what << "; rank " << peer << " " << where_is(peer) << " (this rank needs step "
    << (target - base_) << ")";
  if (problem == Problem::Timeout) {
    // The peer may itself be blocked: follow who waits for whom to the rank holding up the ring.
    std::vector<bool> seen(size_t(nranks_), false);
    seen[size_t(rank_)] = true;
    int cur = peer;
    while (!seen[size_t(cur)]) {
      seen[size_t(cur)] = true;
      const int next = headers_[size_t(cur)]->waiting_for.load(std::memory_order_acquire);
      if (next < 0 || next >= nranks_ || seen[size_t(next)]) break;
      s << "; rank " << cur << " is itself waiting for rank " << next << " (pid "
        << headers_[size_t(next)]->pid << "), which " << where_is(next);
      cur = next;
    }
  }
  if (problem == Problem::Aborted) s << "; rank " << peer << " reports: " << h->message;
  throw CommError(s.str());
}

void HostGroup::wait(int peer, uint64_t target, const Ctx& ctx, const char* what) const {
  const Header* h = headers_[size_t(peer)];
  wait_until(peer, target,
             [h, target] { return h->progress.load(std::memory_order_acquire) >= target; }, ctx,
             what);
}

void HostGroup::wait_small(int peer, int s, uint64_t target, const Ctx& ctx,
                           const char* what) const {
  const Header* h = headers_[size_t(peer)];
  const SmallSlot* slot = small_slot(peer, s);
  const uint64_t seq = ctx.seq;
  // The slot first: in the common case it is the one line this wait reads.
  wait_until(peer, target,
             [h, slot, seq, target] {
               return slot->ready.load(std::memory_order_acquire) == seq ||
                      h->progress.load(std::memory_order_acquire) >= target;
             },
             ctx, what);
}

template <typename Ready>
void HostGroup::wait_until(int peer, uint64_t target, Ready ready, const Ctx& ctx,
                           const char* what) const {
  Header* h = headers_[size_t(peer)];
  if (ready()) return;
  // Spin (where the group fits the cores), then sleep; yield before sleeping only where the
  // group does not fit the cores (see kDefaultSpinNs and kYields). The clock is read every 64
  // pauses.
  if (spin_ns_ > 0) {
    const auto spun = Clock::now();
    const auto until = spun + std::chrono::nanoseconds(spin_ns_);
    auto move_at = move_ns_ > 0 ? spun + std::chrono::nanoseconds(move_ns_) : until;
    for (uint32_t i = 1;; ++i) {
      cpu_relax();
      if (ready()) return;
      if ((i & 63) == 0) {
        const auto now = Clock::now();
        if (now >= until) break;
        if (spin_yield_) {
          sched_yield();
          continue;
        }
        // A peer that last published from this CPU: yield to it (large collectives), or move
        // off its CPU (once per wait, after move_ns_).
        const bool move = !shared_core_yield_ && now >= move_at;
        if (move) move_at = until;
        if ((shared_core_yield_ || move) &&
            h->last_cpu.load(std::memory_order_relaxed) == sched_getcpu()) {
          if (move) {
            move_off_this_cpu();
          } else {
            sched_yield();
          }
        }
      }
    }
  }
  const int yields = spin_ns_ == 0 || spin_yield_ ? kYields : 0;
  for (int i = 0; i < yields; ++i) {
    sched_yield();
    if (ready()) return;
  }
  // Tells peers whom this rank is blocked on, for their timeout messages. Cleared when the
  // wait succeeds; left in place when it fails, so that a peer timing out at the same moment
  // still sees where the ring is stuck.
  std::atomic<int32_t>& mark = headers_[size_t(rank_)]->waiting_for;
  mark.store(peer, std::memory_order_release);
  auto next_liveness_check = Clock::now();
  for (;;) {
    const uint32_t w = h->wake.load(std::memory_order_seq_cst);
    h->waiters.fetch_add(1, std::memory_order_seq_cst);
    // The seq_cst load of `progress` pairs with publish(): a publish after it wakes this sleep.
    const bool done = ready() || h->progress.load(std::memory_order_seq_cst) >= target;
    const uint32_t st = h->state.load(std::memory_order_seq_cst);
    const auto now = Clock::now();
    if (!done && st == kLive && now < ctx.deadline) {
      const int64_t left = std::chrono::duration_cast<std::chrono::nanoseconds>(
                               ctx.deadline - now).count();
      futex_wait(&h->wake, w, left < 50000000 ? left : 50000000);
    }
    h->waiters.fetch_sub(1, std::memory_order_seq_cst);
    if (ready()) {
      mark.store(-1, std::memory_order_release);
      return;
    }
    const uint32_t state = h->state.load(std::memory_order_acquire);
    if (state == kAborted) raise_peer_problem(peer, target, ctx, what, Problem::Aborted);
    if (state == kClosed) raise_peer_problem(peer, target, ctx, what, Problem::Closed);
    const Header* me = headers_[size_t(rank_)];
    if (me->state.load(std::memory_order_acquire) != kLive)
      throw CommError("ringreduce: " + describe(ctx) + " stopped " + what + " while waiting for "
                      "rank " + std::to_string(peer) + ": this rank's process group failed: " +
                      me->message);
    const auto t = Clock::now();
    if (t >= ctx.deadline) raise_peer_problem(peer, target, ctx, what, Problem::Timeout);
    if (t >= next_liveness_check) {
      if (peer_dead(peer)) raise_peer_problem(peer, target, ctx, what, Problem::Exited);
      next_liveness_check = t + std::chrono::milliseconds(200);
    }
  }
}

void HostGroup::check_not_failed(int peer, uint64_t target, const Ctx& ctx,
                                 const char* what) const {
  const Header* h = headers_[size_t(peer)];
  // A peer that published more than `target` finished this phase before it failed.
  // The abort (a release store of `state`) comes after the peer's small_finished in its program
  // order, so a rank that sees the abort also sees small_done.
  if (h->state.load(std::memory_order_acquire) == kAborted &&
      h->progress.load(std::memory_order_acquire) <= target &&
      h->small_done.load(std::memory_order_acquire) < ctx.seq)
    raise_peer_problem(peer, target, ctx, what, Problem::Aborted);
}

void HostGroup::small_finished(const Ctx& ctx) {
  headers_[size_t(rank_)]->small_done.store(ctx.seq, std::memory_order_release);
}

void HostGroup::wait_all(uint64_t target, const Ctx& ctx, const char* what) const {
  for (int i = 1; i < nranks_; ++i) wait((rank_ + i) % nranks_, target, ctx, what);
}

void HostGroup::set_desc(const Desc& d) { headers_[size_t(rank_)]->desc = d; }

void HostGroup::check_desc(int peer, const Ctx& ctx) const {
  compare_descs(headers_[size_t(rank_)]->desc, headers_[size_t(peer)]->desc, peer, ctx);
}

void HostGroup::fill_small_slot(int s, const Desc& d, const void* data, int64_t bytes) {
  SmallSlot* slot = small_slot(rank_, s);
  slot->desc = d;
  // An empty tensor's data may be null.
  if (bytes > 0) std::memcpy(small_data(rank_, s, bytes), data, size_t(bytes));
  slot->ready.store(d.seq, std::memory_order_release);
}

void HostGroup::check_small_desc(int peer, int s, const Ctx& ctx) const {
  compare_descs(small_slot(rank_, s)->desc, small_slot(peer, s)->desc, peer, ctx);
}

void HostGroup::compare_descs(const Desc& a, const Desc& b_seen, int peer, const Ctx& ctx) const {
  if (a.seq == b_seen.seq && a.kind == b_seen.kind && a.dtype == b_seen.dtype &&
      a.op == b_seen.op && a.root == b_seen.root && a.count == b_seen.count &&
      a.round == b_seen.round && a.path == b_seen.path && (a.device < 0) == (b_seen.device < 0))
    return;
  // A peer that took the other path (ring or small all-reduce, because it was given another
  // size) described collective #seq in the other place: report that description. The peer may
  // be writing its next one meanwhile; this only words the message.
  Desc b = b_seen;
  const Desc candidates[3] = {headers_[size_t(peer)]->desc, small_slot(peer, 0)->desc,
                              small_slot(peer, 1)->desc};
  for (const Desc& d : candidates) {
    if (b.seq != a.seq && d.seq == a.seq) b = d;
  }
  std::ostringstream s;
  s << "ringreduce: " << describe(ctx) << ": ranks disagree: rank " << rank_ << " called "
    << desc_text(a) << " but rank " << peer << " called " << desc_text(b)
    << " (every rank must make the same collectives in the same order, with the same number "
       "of elements, dtype, op and root)";
  throw CommError(s.str());
}

void HostGroup::fail(const std::string& msg) {
  std::lock_guard<std::mutex> lock(state_mu_);
  if (closed_) return;
  Header* own = headers_[size_t(rank_)];
  if (own->state.load(std::memory_order_acquire) != kLive) return;
  std::snprintf(own->message, sizeof(own->message), "%s", msg.c_str());
  own->state.store(kAborted, std::memory_order_seq_cst);
  own->wake.fetch_add(1, std::memory_order_seq_cst);
  futex_wake_all(&own->wake);
  own->p2p_bell.fetch_add(1, std::memory_order_seq_cst);  // this rank's p2p thread stops too
  futex_wake_all(&own->p2p_bell);
}

bool HostGroup::aborted_peer(int& peer, std::string& message) {
  std::lock_guard<std::mutex> lock(state_mu_);
  if (closed_) return false;
  for (int r = 0; r < nranks_ && size_t(r) < headers_.size(); ++r) {
    const Header* h = headers_[size_t(r)];
    if (r == rank_ || h == nullptr || h->state.load(std::memory_order_acquire) != kAborted) {
      continue;
    }
    peer = r;
    message.assign(h->message, strnlen(h->message, sizeof(h->message)));
    return true;
  }
  return false;
}

bool HostGroup::peer_gone(int peer) const {
  return headers_[size_t(peer)]->state.load(std::memory_order_acquire) != kLive ||
         peer_dead(peer);
}

bool HostGroup::begin_cuda_close() const {
  if (closed()) return false;
  headers_[size_t(rank_)]->cuda_closing.store(1, std::memory_order_seq_cst);
  return true;
}

bool HostGroup::may_close_imports_of(int peer) const {
  return headers_[size_t(peer)]->cuda_leaving.load(std::memory_order_seq_cst) == 0 &&
         !peer_dead(peer);
}

bool HostGroup::release_cuda_and_wait(Clock::time_point deadline, Clock::duration aborted_grace,
                                      Clock::duration closing_wait) const {
  if (closed()) return false;
  headers_[size_t(rank_)]->cuda_released.store(1, std::memory_order_seq_cst);
  bool all = true;
  for (int r = 0; r < nranks_ && all; ++r) {
    if (r == rank_) continue;
    const Header* h = headers_[size_t(r)];
    auto next_liveness_check = Clock::now();
    Clock::time_point give_up = deadline;
    bool aborted_seen = false;
    while (h->cuda_released.load(std::memory_order_acquire) == 0) {
      const auto t = Clock::now();
      if (t >= next_liveness_check) {
        if (peer_dead(r)) break;  // its process is gone, and with it its mappings
        next_liveness_check = t + std::chrono::milliseconds(100);
      }
      // A peer announces its release before it closes its group (release, then acquire: the
      // announcement is visible once the state is). A closed peer without it never will. An
      // aborted one is still tearing down, or never will (its own GPU work stuck on a dead
      // rank, or no teardown at all): it gets `aborted_grace`. Giving up at once would let
      // this process exit, freeing what the peer has mapped, while the peer may be about to
      // close its mappings: undefined behaviour in CUDA, on the peer's side.
      const uint32_t state = h->state.load(std::memory_order_acquire);
      if (state != kLive && h->cuda_released.load(std::memory_order_acquire) == 0) {
        if (state != kAborted) {
          if (!peer_dead(r)) all = false;
          break;
        }
        if (!aborted_seen) {
          aborted_seen = true;
          give_up = std::min(deadline, t + aborted_grace);
        }
      }
      if (t >= give_up) {
        all = false;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  if (all) return true;
  // Leaving with this rank's exports possibly still mapped by some peer: say so first, then
  // let every peer that had already begun closing its imports (and so may be closing this
  // rank's right now, having seen no "leaving") finish. A peer that begins later sees it.
  headers_[size_t(rank_)]->cuda_leaving.store(1, std::memory_order_seq_cst);
  const Clock::time_point end = Clock::now() + closing_wait;
  for (int r = 0; r < nranks_; ++r) {
    if (r == rank_) continue;
    const Header* h = headers_[size_t(r)];
    if (h->cuda_closing.load(std::memory_order_seq_cst) == 0) continue;
    while (h->cuda_released.load(std::memory_order_acquire) == 0 && !peer_dead(r) &&
           Clock::now() < end) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  return false;
}

}  // namespace dist
}  // namespace rr
