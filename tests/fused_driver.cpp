// Runs the fused all-reduce kernel's body (csrc/ring/fused.h) on the CPU: one std::thread per
// simulated block, flags as std::atomic words with acquire/release (HostSync, the host's memory
// policy), random yields and sleeps at every pause point so that groups run at different
// speeds, one group at a time much slower than the rest (a reader that lags, so that its
// predecessor runs as far ahead of it as the waits allow). Results are compared byte for byte
// with rr::cpu::all_reduce (the ring). Checks the protocol (who waits for what, epochs, failure
// records), not the GPU's memory model; run under ThreadSanitizer, an access to a buffer that
// the acquire/release pairs leave unordered against a write is reported as a race.
//
// Usage:
//   fused_driver check DTYPE SEED [--no-wait]
//       ops sum, max, avg x 2..8 ranks x 1..3 blocks per rank x odd and tiny sizes (count < N
//       included), in place and out of place, 16-byte aligned (pack path) or not (element
//       path), every call with the next epoch on ONE flag buffer that is never reset (so N and
//       G change between calls on it). Prints "op=NAME calls=C mismatches=M failures=F"; exits
//       1 unless M == F == 0. --no-wait drops every wait (the mutation the test must catch).
//   fused_driver stuck SEED
//       one group never starts: every other block must end TimedOut or Aborted within the poll
//       bound and the record must name a timed-out block; then a late-starting group within the
//       bound, and a normal call on the same buffer, must succeed.
//   fused_driver stale SEED
//       a call repeating the last epoch must fail as StaleEpoch; the next epoch then succeeds.
//   fused_driver args
//       make_fused_args refuses bad arguments with a message naming them.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "driver_buffers.h"
#include "ring/cpu_executor.h"
#include "ring/fused.h"

using namespace rr;

namespace {

struct HostConfig {
  int threads = 1;            // simulated threads per block
  int64_t spin_limit = 0;     // polls before a wait times out
  bool skip_waits = false;    // mutation: every wait returns at once
  int slow_group = -1;        // this group pauses much longer
};

// fused.h's Sync on the host: a block is one std::thread that runs its simulated threads in
// turn. Spins are bounded by a count of polls (the device bounds them by time). Only the wait's
// successful poll (acquire) and publish (release) order memory, as on the device; every other
// word access is relaxed.
struct HostSync {
  std::atomic<uint64_t>* flags;
  const HostConfig* cfg;
  std::mt19937_64 rng;
  bool slow;
  int64_t succ_word;                // the successor's flag (same block), for `lead`
  std::atomic<int64_t>* lead;       // the most steps this block started ahead of it

  bool leader() const { return true; }
  int first_thread() const { return 0; }
  int end_thread() const { return cfg->threads; }
  int64_t threads() const { return cfg->threads; }

  uint64_t load(int64_t w) const { return flags[w].load(std::memory_order_relaxed); }
  void store(int64_t w, uint64_t v) const { flags[w].store(v, std::memory_order_relaxed); }
  uint64_t fetch_max(int64_t w, uint64_t v) const {
    uint64_t old = flags[w].load(std::memory_order_relaxed);
    while (old < v && !flags[w].compare_exchange_weak(old, v, std::memory_order_relaxed)) {
    }
    return old;
  }

  FusedStatus wait(int64_t w, uint64_t target, uint64_t epoch, uint64_t* seen) const {
    *seen = 0;
    if (cfg->skip_waits) return FusedStatus::Done;
    for (int64_t polls = 0;; ++polls) {
      *seen = flags[w].load(std::memory_order_acquire);
      if (*seen >= target) {
        note_lead(int64_t(target - fused_flag(epoch, 0)), epoch);
        return FusedStatus::Done;
      }
      if (flags[kFusedFailedEpoch].load(std::memory_order_relaxed) >= epoch) {
        return FusedStatus::Aborted;
      }
      if (polls >= cfg->spin_limit) return FusedStatus::TimedOut;
      std::this_thread::yield();
    }
  }

  void publish(int64_t w, uint64_t v) const { flags[w].store(v, std::memory_order_release); }

  // About to run step k: how many steps ahead of the successor is this block? It overwrites at
  // step k what the successor reads at step k - (N-1) (fused.h), so the waits must keep the
  // lead at N-2 or less; the test also wants to see it reach N-2 (the window exercised). The
  // successor's publishes the wait's chain covers happen before this load, so it sees them
  // (coherence); relaxed, so that it adds no ordering ThreadSanitizer would then credit.
  void note_lead(int64_t k, uint64_t epoch) const {
    const uint64_t v = flags[succ_word].load(std::memory_order_relaxed);
    const int64_t done = v >= fused_flag(epoch, 0) ? int64_t(v - fused_flag(epoch, 0)) : 0;
    int64_t old = lead->load();
    while (k - done > old && !lead->compare_exchange_weak(old, k - done)) {
    }
  }

  void pause() {
    const uint64_t x = rng() % 1000;
    if (slow) {
      if (x < 100) std::this_thread::sleep_for(std::chrono::microseconds(20 + rng() % 200));
      else if (x < 600) std::this_thread::yield();
    } else if (x < 150) {
      std::this_thread::yield();
    } else if (x < 160) {
      std::this_thread::sleep_for(std::chrono::microseconds(rng() % 30));
    }
  }
};

const int64_t kSizes[] = {0, 1, 2, 3, 5, 7, 17, 33, 100, 257, 1001, 4099};
constexpr int kMaxN = 8, kMaxG = 3;

struct Flags {
  std::vector<std::atomic<uint64_t>> words;
  explicit Flags(int64_t bytes) : words(size_t(bytes / 8)) {
    for (auto& w : words) w.store(0);
  }
  std::vector<uint64_t> copy() const {
    std::vector<uint64_t> l;
    for (const auto& w : words) l.push_back(w.load());
    return l;
  }
  std::string error(uint64_t first_epoch) const {
    const std::vector<uint64_t> w = copy();
    return fused_error_message(w.data(), int64_t(w.size()), first_epoch);
  }
};

template <typename T, Op op>
FusedStatus run_block(const FusedArgs& a, int group, int block, HostSync sync) {
  return fused_all_reduce_block<T, op>(a, group, block, sync);
}

// One call: a thread per block of every group but `absent`; group `late` starts after
// `late_us`. Returns every block's status (Done for absent ones); *lead (if given) the most
// steps any block started ahead of its successor.
std::vector<FusedStatus> run_call(const FusedArgs& a, DType dtype, Op op, Flags& flags,
                                  const HostConfig& cfg, uint64_t seed, int absent = -1,
                                  int late = -1, int late_us = 0, int64_t* lead = nullptr) {
  std::vector<FusedStatus> status(size_t(a.nranks * a.blocks), FusedStatus::Done);
  std::atomic<int64_t> max_lead{0};
  std::vector<std::thread> threads;
  for (int g = 0; g < a.nranks; ++g) {
    if (g == absent) continue;
    for (int b = 0; b < a.blocks; ++b) {
      HostSync sync{flags.words.data(), &cfg,
                    std::mt19937_64(seed * 7919u + uint64_t(g * kMaxG + b)), g == cfg.slow_group,
                    fused_progress_word((g + 1) % a.nranks, b, a.blocks), &max_lead};
      FusedStatus* out = &status[size_t(g * a.blocks + b)];
      threads.emplace_back([=, &a]() {
        if (g == late) std::this_thread::sleep_for(std::chrono::microseconds(late_us));
        FusedStatus st = FusedStatus::Done;
        RR_DISPATCH(dtype, op, st = (run_block<T, kOp>(a, g, b, sync)));
        *out = st;
      });
    }
  }
  for (std::thread& t : threads) t.join();
  if (lead != nullptr) *lead = max_lead.load();
  return status;
}

// Every block ran every step of this epoch and no failure was recorded for it.
int64_t check_flags(const FusedArgs& a, const Flags& flags, const std::vector<FusedStatus>& st) {
  int64_t bad = 0;
  for (int g = 0; g < a.nranks; ++g) {
    for (int b = 0; b < a.blocks; ++b) {
      const uint64_t v = flags.words[size_t(fused_progress_word(g, b, a.blocks))].load();
      const FusedStatus s = st[size_t(g * a.blocks + b)];
      if (s != FusedStatus::Done || v != fused_flag(a.epoch, num_steps(a.nranks))) {
        if (++bad <= 3) {
          std::printf("FAILURE epoch=%llu rank=%d block=%d status=%d flag=%llu\n",
                      (unsigned long long)a.epoch, g, b, int(s), (unsigned long long)v);
        }
      }
    }
  }
  const std::string msg = flags.error(a.epoch);
  if (!msg.empty()) {
    std::printf("FAILURE %s\n", msg.c_str());
    ++bad;
  }
  return bad;
}

// One call's buffers: in[] (offset bytes past 16-byte alignment), out[] (in[] itself when in
// place), the ring's result on a copy of the inputs, and the inputs as they were.
struct Case {
  std::vector<Buf> in, out, ring, orig;
  std::vector<void*> pin, pout;
  int64_t bytes = 0;

  Case(DType dtype, Op op, int n, int64_t count, bool inplace, int64_t offset,
       std::mt19937_64& rng) {
    bytes = count * elem_size(dtype);
    std::vector<void*> pring;
    Values values{std::mt19937_64(rng()), 0};
    for (int r = 0; r < n; ++r) {
      in.emplace_back(bytes, offset);
      fill(in.back().data, count, dtype, values);
      out.emplace_back(bytes, offset);
      std::memset(out.back().data, 0x5A, size_t(bytes));
      for (std::vector<Buf>* copy : {&ring, &orig}) {
        copy->emplace_back(bytes, 0);
        std::memcpy(copy->back().data, in.back().data, size_t(bytes));
      }
    }
    for (int r = 0; r < n; ++r) {
      pring.push_back(ring[size_t(r)].data);
      pin.push_back(in[size_t(r)].data);
      pout.push_back(inplace ? in[size_t(r)].data : out[size_t(r)].data);
    }
    cpu::all_reduce(pring.data(), n, count, dtype, op);
  }

  // Ranks whose output differs from the ring's, or (out of place) whose input changed.
  int64_t mismatches(const char* what, Op op, int blocks, uint64_t epoch) const {
    int64_t bad = 0;
    for (size_t r = 0; r < in.size(); ++r) {
      const bool out_ok = std::memcmp(pout[r], ring[r].data, size_t(bytes)) == 0;
      const bool in_ok = pout[r] == pin[r] || std::memcmp(pin[r], orig[r].data, size_t(bytes)) == 0;
      if (out_ok && in_ok) continue;
      if (++bad <= 1) {
        std::printf("MISMATCH %s op=%s nranks=%zu blocks=%d bytes=%lld rank=%zu epoch=%llu%s\n",
                    what, op_name(op), in.size(), blocks, (long long)bytes, r,
                    (unsigned long long)epoch, in_ok ? "" : " (input changed)");
      }
    }
    return bad;
  }
};

int run_check(DType dtype, uint64_t seed, bool skip_waits) {
  Flags flags(fused_flags_bytes(kMaxN, kMaxG));  // one buffer, zeroed once, for every call
  uint64_t epoch = 0;
  int64_t total = 0;
  std::mt19937_64 rng(seed);
  int64_t leads[kMaxN + 1] = {};
  for (Op op : {Op::Sum, Op::Max, Op::Avg}) {
    int64_t calls = 0, mismatches = 0, failures = 0;
    for (int n = 2; n <= kMaxN; ++n) {
      for (int g = 1; g <= kMaxG; ++g) {
        for (int64_t count : kSizes) {
          const bool inplace = rng() % 2 == 0;
          const int64_t offset = rng() % 2 == 0 ? 0 : elem_size(dtype);
          const Case c(dtype, op, n, count, inplace, offset, rng);
          HostConfig cfg;
          const int kThreadChoices[] = {1, 3, 16};
          cfg.threads = kThreadChoices[rng() % 3];
          cfg.spin_limit = int64_t(1) << 40;  // no bound needed here; run_stuck tests it
          cfg.skip_waits = skip_waits;
          cfg.slow_group = rng() % 3 == 0 ? int(rng() % uint64_t(n)) : -1;
          const FusedArgs a = make_fused_args(c.pin.data(), c.pout.data(), n, count, g, ++epoch);
          int64_t lead = 0;
          const std::vector<FusedStatus> st =
              run_call(a, dtype, op, flags, cfg, rng(), -1, -1, 0, &lead);
          leads[n] = std::max(leads[n], lead);
          if (lead > n - 2 && !skip_waits) {
            std::printf("FAILURE a block started step k with its successor short of step "
                        "k-(N-1): %lld steps ahead, nranks=%d (write-after-read)\n",
                        (long long)lead, n);
            ++failures;
          }
          ++calls;
          failures += check_flags(a, flags, st);
          mismatches += c.mismatches(inplace ? "in place" : "out of place", op, g, epoch);
        }
      }
    }
    std::printf("op=%s calls=%lld mismatches=%lld failures=%lld\n", op_name(op),
                (long long)calls, (long long)mismatches, (long long)failures);
    total += mismatches + failures;
  }
  // How far ahead of its successor a block got, against the most the waits allow (N-2 steps
  // when it starts a step: the tests want the bound reached, i.e. the hazard window exercised).
  std::printf("lead");
  for (int n = 2; n <= kMaxN; ++n) std::printf(" n%d=%lld/%d", n, (long long)leads[n], n - 2);
  std::printf("\n");
  return total == 0 ? 0 : 1;
}

// A normal call after a failure on the same buffer, with the next epoch.
int64_t healthy_call(Flags& flags, uint64_t epoch, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const int n = 4, g = 2;
  const Case c(DType::F32, Op::Sum, n, 1001, true, 0, rng);
  HostConfig cfg;
  cfg.threads = 3;
  cfg.spin_limit = int64_t(1) << 40;
  const FusedArgs a = make_fused_args(c.pin.data(), c.pout.data(), n, 1001, g, epoch);
  const std::vector<FusedStatus> st = run_call(a, DType::F32, Op::Sum, flags, cfg, rng());
  return check_flags(a, flags, st) + c.mismatches("after a failure", Op::Sum, g, epoch);
}

int run_stuck(uint64_t seed) {
  std::mt19937_64 rng(seed);
  Flags flags(fused_flags_bytes(kMaxN, kMaxG));
  int64_t bad = 0;
  uint64_t epoch = 0;
  for (int n : {2, 4, 8}) {
    const int g = n == 8 ? 3 : 2;
    const int stuck = int(rng() % uint64_t(n));
    const Case c(DType::F32, Op::Sum, n, 4099, true, 0, rng);
    HostConfig cfg;
    cfg.threads = 3;
    cfg.spin_limit = 20000;
    const FusedArgs a = make_fused_args(c.pin.data(), c.pout.data(), n, 4099, g, ++epoch);
    const auto t0 = std::chrono::steady_clock::now();
    const std::vector<FusedStatus> st = run_call(a, DType::F32, Op::Sum, flags, cfg, rng(), stuck);
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    int timed_out = 0, aborted = 0, other = 0;
    for (int r = 0; r < n; ++r) {
      for (int b = 0; b < g; ++b) {
        if (r == stuck) continue;
        const FusedStatus s = st[size_t(r * g + b)];
        timed_out += s == FusedStatus::TimedOut;
        aborted += s == FusedStatus::Aborted;
        other += s != FusedStatus::TimedOut && s != FusedStatus::Aborted;
      }
    }
    const std::vector<uint64_t> line = flags.copy();
    const std::string msg = flags.error(epoch);
    const std::string least = std::to_string(stuck) + "/0";
    const bool record_ok = line[kFusedFailedEpoch] == epoch &&
                           line[kFusedErrCode] == kFusedTimedOut &&
                           int(line[kFusedErrRank]) != stuck && int(line[kFusedErrRanks]) == n &&
                           line[kFusedErrStep] >= 1 &&
                           line[kFusedErrSeen] < fused_flag(epoch, int64_t(line[kFusedErrStep])) &&
                           msg.find("timed out") != std::string::npos &&
                           msg.find("least progress (not started in this call): rank/block " +
                                    least) != std::string::npos;
    std::printf("stuck nranks=%d blocks=%d absent=%d: timed_out=%d aborted=%d other=%d in %.0f ms; "
                "record_ok=%d: %s\n", n, g, stuck, timed_out, aborted, other, ms, int(record_ok),
                msg.c_str());
    if (timed_out == 0 || other != 0 || !record_ok) ++bad;

    // A group that starts late, but within the bound, delays the call and nothing else.
    {
      const Case late(DType::F32, Op::Sum, n, 4099, false, 0, rng);
      HostConfig lcfg;
      lcfg.threads = 3;
      lcfg.spin_limit = int64_t(1) << 40;
      const FusedArgs la = make_fused_args(late.pin.data(), late.pout.data(), n, 4099, g, ++epoch);
      const std::vector<FusedStatus> lst =
          run_call(la, DType::F32, Op::Sum, flags, lcfg, rng(), -1, stuck, 20000);
      const int64_t lbad =
          check_flags(la, flags, lst) + late.mismatches("late group", Op::Sum, g, epoch);
      std::printf("late nranks=%d blocks=%d group %d 20 ms late: %s\n", n, g, stuck,
                  lbad == 0 ? "ok" : "FAILED");
      bad += lbad;
    }
    const int64_t after = healthy_call(flags, ++epoch, rng());
    std::printf("next epoch on the same buffer: %s\n", after == 0 ? "ok" : "FAILED");
    bad += after;
  }
  std::printf("stuck failures=%lld\n", (long long)bad);
  return bad == 0 ? 0 : 1;
}

int run_stale(uint64_t seed) {
  std::mt19937_64 rng(seed);
  Flags flags(fused_flags_bytes(kMaxN, kMaxG));
  int64_t bad = healthy_call(flags, 5, rng());
  // The same epoch again: every block finds its own flag at epoch 5 and refuses.
  const Case c(DType::F32, Op::Sum, 4, 1001, true, 0, rng);
  HostConfig cfg;
  cfg.threads = 3;
  cfg.spin_limit = 20000;
  const FusedArgs a = make_fused_args(c.pin.data(), c.pout.data(), 4, 1001, 2, 5);
  const std::vector<FusedStatus> st = run_call(a, DType::F32, Op::Sum, flags, cfg, rng());
  int stale = 0;
  for (FusedStatus s : st) stale += s == FusedStatus::StaleEpoch;
  const std::vector<uint64_t> line = flags.copy();
  const std::string msg = flags.error(5);
  const bool ok = line[kFusedErrCode] == kFusedStaleEpoch &&
                  msg.find("strictly increase") != std::string::npos;
  std::printf("stale: %d of %zu blocks refused; %s\n", stale, st.size(), msg.c_str());
  if (stale != int(st.size()) || !ok) ++bad;
  const int64_t after = healthy_call(flags, 6, rng());
  std::printf("next epoch on the same buffer: %s\n", after == 0 ? "ok" : "FAILED");
  bad += after;
  std::printf("stale failures=%lld\n", (long long)bad);
  return bad == 0 ? 0 : 1;
}

// make_fused_args refuses what the kernel cannot run, naming the argument.
int run_args() {
  std::vector<uint8_t> storage(64);
  void* bufs[2] = {storage.data(), storage.data() + 32};
  struct Bad { int nranks; int64_t count; int blocks; uint64_t epoch; const char* names; };
  const Bad bad[] = {{0, 4, 1, 1, "nranks=0"},      {65, 4, 1, 1, "nranks=65"},
                     {2, -1, 1, 1, "count must be"}, {2, 4, 0, 1, "blocks_per_rank"},
                     {2, 4, 1, 0, "epoch"},          {2, 4, 1, kFusedMaxEpoch + 1, "epoch"}};
  int failures = 0;
  for (const Bad& b : bad) {
    std::string what = "no exception";
    try {
      make_fused_args(bufs, bufs, b.nranks, b.count, b.blocks, b.epoch);
    } catch (const std::invalid_argument& e) {
      what = e.what();
    }
    const bool ok = what.find(b.names) != std::string::npos;
    failures += !ok;
    std::printf("%s: %s\n", ok ? "refused" : "FAILURE", what.c_str());
  }
  std::printf("args failures=%d\n", failures);
  return failures == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr,
                 "usage: %s check DTYPE SEED [--no-wait] | stuck SEED | stale SEED | args\n",
                 argv[0]);
    return 2;
  }
  const std::string mode = argv[1];
  if (mode == "check" && argc >= 4) {
    const DType kDtypes[] = {DType::F32, DType::F64, DType::F16, DType::I32, DType::I8};
    for (DType d : kDtypes) {
      if (std::string(dtype_name(d)) == argv[2]) {
        return run_check(d, std::stoull(argv[3]), argc > 4 && std::string(argv[4]) == "--no-wait");
      }
    }
    std::fprintf(stderr, "unknown dtype %s\n", argv[2]);
    return 2;
  }
  if (mode == "args") return run_args();
  if (mode == "stuck" && argc >= 3) return run_stuck(std::stoull(argv[2]));
  if (mode == "stale" && argc >= 3) return run_stale(std::stoull(argv[2]));
  std::fprintf(stderr, "unknown mode %s\n", mode.c_str());
  return 2;
}
