// The ring all-reduce of schedule.h as the body of ONE kernel: every step inside, ordered by
// flags in global memory between the blocks of the grid instead of by kernel boundaries.
// Torch-free, host and device code (RR_HD): fused_kernel.cu runs the body on the GPU with a
// policy of __threadfence and volatile/atomic words; tests/fused_driver.cpp runs the same body
// on the CPU, one std::thread per block, with std::atomic words.
//
// Grid: N groups of G blocks; group r is rank r, block b of a group moves slice b (fused_slice)
// of the chunk each step names. Step k of group r is rank r's step k of all_reduce_plan:
// combine (reduce-scatter) or copy (all-gather) slice b of chunk ring_step(r, N, k).chunk from
// rank r-1 into rank r, each thread running the ring step kernel's own body (step.h's
// step_thread) on the slice, so every element gets the same bits as the ring (launch_step,
// rr::cpu::all_reduce) and the one-shot.
//
// Ordering. Block (r, b) reads at step k only slice b of the chunk that block (r-1, b) wrote at
// step k-1 (the ring's chunks travel one rank a step, and the slices are the same function of
// the chunk on every rank), so each block waits on one flag, its predecessor's, never on the
// whole group: a monotone 64-bit word with one writer, published after each step.
//   publish (release): every thread's loads and stores of the step, __syncthreads(), then
//     thread 0 __threadfence() (fence.sc.gpu) and a volatile store of the flag. The barrier
//     orders the block's accesses before thread 0's fence, which is cumulative under the PTX
//     memory model (cooperative groups' grid.sync() relies on the same pattern).
//   wait (acquire): thread 0 polls the predecessor's flag with volatile loads until it shows
//     step k-1 of this call, then __threadfence(), then __syncthreads(); every thread's loads
//     of the predecessor's data follow the barrier.
// Write-after-read. Rank q rewrites a chunk of its buffer only N-1 steps after its successor
// read it: with d = (q - c) mod N, rank q+1 reads chunk c of q's buffer at step d (reduce-
// scatter; step 0 reads q's input) and q overwrites it at step N-1+d (all-gather); the other
// writes of c by q (its reduce-scatter hop at step d-1) come before that read and are what it
// reads. Every wait is on the predecessor's previous step, so block (q, b) at step N-1+d has
// waited, through the chain (q-1, N-2+d), (q-2, N-3+d), ..., (q-(N-1), d) = (q+1, d), for its
// successor's block b to publish step d, which it does only after its reads of step d. So a
// block does run ahead of its successor by more than one step (it starts a step up to N-2 steps
// ahead), but never by more than the distance from the read to the overwrite, and no wait on the
// successor is needed: the ring's own waits order the overwrite after the read (happens-before
// is transitive through the acquire/release pairs). Every step waits and publishes even when
// its slice is empty (count < N, small G), or the chain breaks. tests/test_fused.py checks this
// with one group much slower than the rest (it pauses after its waits and between its reads):
// the lead it measures reaches N-2 and never more, the outputs equal the ring's, and under
// ThreadSanitizer no read and write of a buffer is left unordered.
// Between calls nothing needs ordering: calls on one flag buffer are serialised by the stream.
//
// Epochs. A flag holds epoch * kFusedStepsPerEpoch + (steps done), the epoch being a per-call
// number the host passes in, strictly increasing on one flag buffer (1, 2, 3, ...) and fixed
// stride whatever N: every value a call waits for is above every value an earlier call wrote,
// so flags are zeroed once (init_fused_flags) and never reset, a call that failed half way
// leaves nothing a later call could mistake, and calls with other N or G may share the buffer.
// 64-bit words: with 256 steps an epoch, epochs run to 2^56 - 1, over 2000 years at a million
// calls a second, so they never wrap in practice; the host rejects a larger epoch (zero the
// buffer and start again at 1). A 32-bit word would wrap after 2^24 calls, minutes of small
// all-reduces, and a wrapped flag would look older than a stale one.
// A block whose own flag is already at or above this call's epoch reports the epoch as stale
// (reused, decreasing, or a buffer never zeroed) rather than trusting stale flags.
//
// Bounded waits. Every wait ends after a bound (device: nanoseconds of %globaltimer; host
// simulation: a count of polls); the block then records the failure in line 0 of the flag
// buffer (the first failing block of a call wins an atomic max on the failed-epoch word) and
// returns. Every wait also polls that word, so once one block has failed the others return at
// once. The host turns the record into an exception after the stream is synchronised
// (check_fused_all_reduce, fused_error_message). Nothing hangs silently.
//
// Co-residency. A block that spins waits for a block of the same grid; if that block is not
// resident (more blocks than the GPU holds at once) it never runs and the wait times out. The
// launcher bounds N * G by the occupancy calculation and launches cooperatively, which fails
// rather than start a grid that does not fit (fused_kernel.cu).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "schedule.h"
#include "step.h"
#include "types.h"

namespace rr {

constexpr int kFusedMaxRanks = 64;
// Flag value = epoch * kFusedStepsPerEpoch + steps done; 2 * (kFusedMaxRanks - 1) < 256.
constexpr uint64_t kFusedStepsPerEpoch = 256;
constexpr uint64_t kFusedMaxEpoch = (uint64_t(1) << 56) - 1;

// Flag buffer layout, in 64-bit words. Each word anyone polls has a 128-byte line of its own.
constexpr int64_t kFusedLineBytes = 128;
constexpr int64_t kFusedLineWords = kFusedLineBytes / 8;
// Line 0: the record of the latest call that failed.
constexpr int64_t kFusedFailedEpoch = 0;  // highest epoch in which a block failed (0: none)
constexpr int64_t kFusedErrCode = 1;      // kFusedTimedOut or kFusedStaleEpoch
constexpr int64_t kFusedErrRank = 2;      // the failing block's group (rank) ...
constexpr int64_t kFusedErrBlock = 3;     // ... and block within it
constexpr int64_t kFusedErrStep = 4;      // the step it was about to run
constexpr int64_t kFusedErrSeen = 5;      // the last value it saw of the flag it checked
constexpr int64_t kFusedErrBlocks = 6;    // G of the failing call
constexpr int64_t kFusedErrRanks = 7;     // N of the failing call

// Bytes of flag buffer a call with `nranks` ranks and `blocks` blocks per rank needs: line 0
// plus one line per block. The caller allocates it in device memory (8-byte aligned at least),
// zeroes it once (init_fused_flags) and keeps it for every later call.
inline int64_t fused_flags_bytes(int nranks, int blocks) {
  return kFusedLineBytes * (1 + int64_t(nranks) * int64_t(blocks));
}

// The word block `block` of group `group` publishes its progress in.
RR_HD int64_t fused_progress_word(int group, int block, int blocks) {
  return kFusedLineWords * (1 + int64_t(group) * blocks + block);
}

RR_HD uint64_t fused_flag(uint64_t epoch, int64_t steps_done) {
  return epoch * kFusedStepsPerEpoch + uint64_t(steps_done);
}

// What a wait or a whole block ended with.
enum class FusedStatus : int { Done = 0, TimedOut = 1, Aborted = 2, StaleEpoch = 3 };
// Codes in the record (kFusedErrCode).
constexpr uint64_t kFusedTimedOut = 1;
constexpr uint64_t kFusedStaleEpoch = 2;

// Slice `block` of `blocks` of ring chunk `chunk`: pieces a multiple of 16 bytes, so a slice of
// 16-byte aligned buffers moves as 16-byte packs (step_thread decides from the pointers); the
// last slices take the tail or are empty.
RR_HD Range fused_slice(int64_t count, int nranks, int64_t esize, int chunk, int blocks,
                        int block) {
  const Range c = chunk_range(count, nranks, esize, chunk);
  const int64_t align = esize >= 16 ? 1 : 16 / esize;
  const int64_t per = ((c.count + blocks - 1) / blocks + align - 1) / align * align;
  const int64_t begin = block * per < c.count ? block * per : c.count;
  const int64_t end = begin + per < c.count ? begin + per : c.count;
  return Range{c.offset + begin, end - begin};
}

// The kernel's arguments, passed by value as one __grid_constant__ parameter.
struct FusedArgs {
  const void* in[kFusedMaxRanks];
  void* out[kFusedMaxRanks];
  int nranks;
  int blocks;      // G, blocks per rank
  int64_t count;   // elements per rank
  uint64_t epoch;
};

// out[r] = the all-reduce of in[0..nranks); out[r] == in[r] is in place (all_reduce_plan's data
// flow either way). Throws std::invalid_argument naming the argument and the rule.
inline FusedArgs make_fused_args(const void* const* in, void* const* out, int nranks,
                                 int64_t count, int blocks, uint64_t epoch) {
  if (nranks < 1 || nranks > kFusedMaxRanks) {
    throw std::invalid_argument("ringreduce: the fused all-reduce takes 1 to " +
                                std::to_string(kFusedMaxRanks) + " ranks, got nranks=" +
                                std::to_string(nranks));
  }
  if (count < 0) {
    throw std::invalid_argument("ringreduce: count must be >= 0, got " + std::to_string(count));
  }
  if (blocks < 1) {
    throw std::invalid_argument("ringreduce: blocks_per_rank must be >= 1, got " +
                                std::to_string(blocks));
  }
  if (epoch < 1 || epoch > kFusedMaxEpoch) {
    throw std::invalid_argument(
        "ringreduce: epoch must be in [1, 2^56 - 1] and above every epoch used before on the "
        "same flag buffer, got " + std::to_string(epoch) +
        " (past 2^56 - 1, zero the buffer with init_fused_flags and start again at 1)");
  }
  FusedArgs a{};
  for (int r = 0; r < nranks; ++r) {
    a.in[r] = in[r];
    a.out[r] = out[r];
  }
  a.nranks = nranks;
  a.blocks = blocks;
  a.count = count;
  a.epoch = epoch;
  return a;
}

// Records a failure in line 0 if this block is the first to fail in this call; the failed-epoch
// word doubles as the signal that makes every other block's wait return.
template <class Sync>
RR_HD void fused_record(Sync& sync, const FusedArgs& a, uint64_t code, int group, int block,
                        int64_t step, uint64_t seen) {
  if (!sync.leader()) return;
  if (sync.fetch_max(kFusedFailedEpoch, a.epoch) >= a.epoch) return;
  sync.store(kFusedErrCode, code);
  sync.store(kFusedErrRank, uint64_t(group));
  sync.store(kFusedErrBlock, uint64_t(block));
  sync.store(kFusedErrStep, uint64_t(step));
  sync.store(kFusedErrSeen, seen);
  sync.store(kFusedErrBlocks, uint64_t(a.blocks));
  sync.store(kFusedErrRanks, uint64_t(a.nranks));
}

// What block `block` of group `group` does in one call: every step of rank `group`'s ring for
// slice `block` of each chunk. Every thread of the block calls it.
//
// Sync, the memory policy (fused_kernel.cu: DeviceSync; tests/fused_driver.cpp: HostSync):
//   leader()                 the thread that polls, publishes and records (thread 0)
//   first_thread(), end_thread(), threads()
//                            the simulated threads this call runs ([threadIdx.x, +1) of
//                            blockDim.x on the device; all of them in turn on the host)
//   load(w), store(w, v)     relaxed word access; fetch_max(w, v) atomic, returns the old value
//   wait(w, target, epoch, &seen)
//                            acquire: returns Done once word w >= target (then every thread may
//                            read what its writer published), TimedOut after the bound, Aborted
//                            once a block failed in this epoch; every thread gets the result
//   publish(w, v)            release: every thread's accesses so far happen before w == v
//   pause()                  nothing on the device; the host simulation's random delays
template <typename T, Op op, class Sync>
RR_HD FusedStatus fused_all_reduce_block(const FusedArgs& a, int group, int block, Sync& sync) {
  const int n = a.nranks;
  const int pred = group == 0 ? n - 1 : group - 1;
  const int64_t mine = fused_progress_word(group, block, a.blocks);
  const int64_t theirs = fused_progress_word(pred, block, a.blocks);

  // Only this block writes its flag, and its last write was the previous call's (stream order).
  const uint64_t own = sync.load(mine);
  if (own >= fused_flag(a.epoch, 0)) {
    fused_record(sync, a, kFusedStaleEpoch, group, block, 0, own);
    return FusedStatus::StaleEpoch;
  }

  T* const out = static_cast<T*>(a.out[group]);
  const T* const in = static_cast<const T*>(a.in[group]);
  for (int64_t k = 0; k < num_steps(n); ++k) {
    sync.pause();
    if (k > 0) {
      // Rank r reads what rank r-1 wrote at step k - 1 (schedule.h).
      uint64_t seen = 0;
      const FusedStatus w = sync.wait(theirs, fused_flag(a.epoch, k), a.epoch, &seen);
      if (w == FusedStatus::TimedOut) fused_record(sync, a, kFusedTimedOut, group, block, k, seen);
      if (w != FusedStatus::Done) return w;
    }
    sync.pause();
    const Step s = ring_step(group, n, k);
    const Range r = fused_slice(a.count, n, int64_t(sizeof(T)), s.chunk, a.blocks, block);
    // all_reduce_plan's move: the predecessor's first hop on a chunk sends its input, every
    // later hop its partial; a combine's own operand is this rank's input.
    const T* src = static_cast<const T*>(s.reduce && k == 0 ? a.in[pred] : a.out[pred]);
    const Task task{out + r.offset, src + r.offset, r.count,
                    s.reduce ? static_cast<const void*>(in + r.offset) : nullptr};
    for (int t = sync.first_thread(); t < sync.end_thread(); ++t) {
      // The last hop differs from the others only for avg (Reducer::last_step), so the other
      // ops need one combine loop, not two, in the kernel.
      if (!s.reduce) {
        step_thread<T, op, false, false>(task, n, t, sync.threads());
      } else if (op == Op::Avg && s.last_reduce) {
        step_thread<T, op, true, true>(task, n, t, sync.threads());
      } else {
        step_thread<T, op, true, false>(task, n, t, sync.threads());
      }
      sync.pause();
    }
    sync.publish(mine, fused_flag(a.epoch, k + 1));
  }
  return FusedStatus::Done;
}

// The failure recorded in a flag buffer (its first `nwords` 64-bit words, copied to the host)
// for a call with epoch >= first_epoch, as an error message; empty when there is none. A stuck
// block makes every block downstream of it wait too, and any of them may time out first, so when
// the words cover the failed call's progress flags (and no later call has run) the message also
// names the blocks that got least far: the cause, or the first blocks waiting for it.
inline std::string fused_error_message(const uint64_t* words, int64_t nwords,
                                       uint64_t first_epoch) {
  const uint64_t epoch = words[kFusedFailedEpoch];
  if (epoch == 0 || epoch < first_epoch) return "";
  const int ranks = int(words[kFusedErrRanks]);
  const int blocks = int(words[kFusedErrBlocks]);
  const int rank = int(words[kFusedErrRank]);
  const int64_t step = int64_t(words[kFusedErrStep]);
  // Steps a flag shows done in the failed call; -1: not started in it.
  auto done = [epoch](uint64_t v) {
    return v < fused_flag(epoch, 0) ? int64_t(-1) : int64_t(v - fused_flag(epoch, 0));
  };
  auto progress = [](int64_t d) {
    return d < 0 ? std::string("not started in this call") : std::to_string(d) + " steps done";
  };
  const std::string where = "rank " + std::to_string(rank) + " block " +
                            std::to_string(words[kFusedErrBlock]) + " of " +
                            std::to_string(blocks) + " (" + std::to_string(ranks) + " ranks)";
  const std::string msg = "ringreduce: fused all-reduce of epoch " + std::to_string(epoch) +
                          " failed: ";
  if (words[kFusedErrCode] == kFusedStaleEpoch) {
    return msg + where + " found its flag already at epoch " +
           std::to_string(words[kFusedErrSeen] / kFusedStepsPerEpoch) +
           ": epochs on one flag buffer must strictly increase, and the buffer must be zeroed "
           "(init_fused_flags) before its first use; the outputs are undefined";
  }
  if (words[kFusedErrCode] != kFusedTimedOut) {
    return msg + "unknown error code " + std::to_string(words[kFusedErrCode]);
  }
  const int pred = rank == 0 ? ranks - 1 : rank - 1;
  std::string out = msg + where + " timed out before step " + std::to_string(step) +
                    " waiting for the same block of rank " + std::to_string(pred) +
                    " to finish step " + std::to_string(step - 1) + " (its flag: " +
                    progress(done(words[kFusedErrSeen])) + ")";
  if (ranks >= 1 && blocks >= 1 && ranks <= kFusedMaxRanks &&
      nwords * 8 >= fused_flags_bytes(ranks, blocks)) {
    int64_t low = int64_t(kFusedStepsPerEpoch);
    bool later_call = false;
    for (int r = 0; r < ranks; ++r) {
      for (int b = 0; b < blocks; ++b) {
        const uint64_t v = words[fused_progress_word(r, b, blocks)];
        later_call = later_call || v >= fused_flag(epoch + 1, 0);
        low = done(v) < low ? done(v) : low;
      }
    }
    if (!later_call) {
      std::string least;
      int listed = 0;
      for (int r = 0; r < ranks && listed < 8; ++r) {
        for (int b = 0; b < blocks && listed < 8; ++b) {
          if (done(words[fused_progress_word(r, b, blocks)]) != low) continue;
          least += (listed++ ? ", " : "") + std::to_string(r) + "/" + std::to_string(b);
        }
      }
      out += "; least progress (" + progress(low) + "): rank/block " + least;
    }
  }
  return out + "; every block of the grid must be resident at once (cooperative launch) and "
               "none may fail; the outputs are undefined";
}

}  // namespace rr
