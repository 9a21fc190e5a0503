// The collectives of the list API as plans: the ring schedule of schedule.h applied to each
// rank's buffers. Torch-free and header-only (both extensions' executors include it).
//
// A plan is a list of steps; a step is a list of moves, all of one kind: combine
// (dst = op(own, src)) or copy (dst = src). Every plan keeps the invariants the executors rely
// on, the same as the all-reduce ring's:
//   - a move of rank r at step k reads its own input, data that no move of this plan writes, or
//     what rank r - 1 wrote at step k - 1 (so one event per step and device orders a ring);
//   - the moves of one step write disjoint memory and none of them writes what another reads
//     (so an executor may run them in any order, or all at once in one kernel);
//   - a buffer a neighbour read at step j is overwritten only at step j + N - 1 or later, and
//     only by a move whose chain of predecessors reaches back to that read (so no extra event
//     is needed against write-after-read).
// Moves with no elements are left out; an empty plan means there is nothing to do.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "schedule.h"

namespace rr {

struct Move {
  int rank;         // whose buffer is written; the move runs where that rank's buffers live
  int src_rank;     // whose buffer is read: the ring predecessor, or `rank` for a local copy
  void* dst;
  const void* own;  // combine: this rank's operand (dst itself when in place); copy: unused
  const void* src;
  int64_t n;        // elements
};

struct PlanStep {
  bool reduce = false;  // combine rather than copy
  bool last = false;    // the final reduce-scatter hop of every chunk (avg divides here)
  std::vector<Move> moves;
};

using Plan = std::vector<PlanStep>;

// A once-rounded collective of float16 / bfloat16 sum or avg (cuda_executor.h
// run_once_rounded), described without torch or CUDA so that the bindings build one either way.
struct OnceCall {
  enum Kind {
    AllReduce,      // out[r] = the sum of in[0..N), count elements each; out[r] may be in[r]
    ReduceScatter,  // out[r] = the sum of block r (count elements) of every in[] (N * count
                    // each); out[r] may be block r of in[r]
    Reduce,         // out[0] = the sum of in[0..N) (count each), on the root's device; it may
                    // be in[root]; work[r]: count elements on rank r's device (not the root's)
  };
  Kind kind = AllReduce;
  const void* const* in = nullptr;
  void* const* out = nullptr;
  void* const* work = nullptr;
  int nranks = 0;
  int64_t count = 0;
  int root = 0;
};

namespace plan_detail {

inline char* at(void* base, int64_t elems, int64_t esize) {
  return static_cast<char*>(base) + elems * esize;
}
inline const char* at(const void* base, int64_t elems, int64_t esize) {
  return static_cast<const char*>(base) + elems * esize;
}

inline void add(PlanStep& step, int rank, int src_rank, void* dst, const void* own,
                const void* src, int64_t n) {
  if (n > 0) step.moves.push_back(Move{rank, src_rank, dst, own, src, n});
}

// A plan whose steps move nothing is no plan.
inline Plan or_empty(Plan plan) {
  for (const PlanStep& step : plan) {
    if (!step.moves.empty()) return plan;
  }
  return {};
}

inline Plan local_copies(const void* const* in, void* const* out, int nranks, int64_t count,
                         int64_t out_offset_per_rank, int64_t esize) {
  PlanStep step;
  for (int r = 0; r < nranks; ++r) {
    void* dst = at(out[r], r * out_offset_per_rank, esize);
    if (dst != in[r]) add(step, r, r, dst, nullptr, in[r], count);
  }
  return or_empty(Plan{step});
}

// Reduce-scatter then all-gather over schedule.h's chunks. part[r] receives rank r's partial
// results and, at the end, the reduced values; part[r] == in[r] is in place. The all-gather
// delivers every chunk to every rank (to = -1), or only along the way to rank `to`.
inline Plan ring_reduce(const void* const* in, void* const* part, int nranks, int64_t count,
                        int64_t esize, int to) {
  Plan plan(size_t(num_steps(nranks)));
  for (int64_t k = 0; k < num_steps(nranks); ++k) {
    PlanStep& step = plan[size_t(k)];
    for (int r = 0; r < nranks; ++r) {
      const Step s = ring_step(r, nranks, k);
      const Range c = chunk_range(count, nranks, esize, s.chunk);
      const int p = s.src_rank;
      step.reduce = s.reduce;
      step.last = s.last_reduce;
      if (s.reduce) {
        // The predecessor's first hop on a chunk sends its own input; later hops its partial.
        const void* src = k == 0 ? in[p] : part[p];
        add(step, r, p, at(part[r], c.offset, esize), at(in[r], c.offset, esize),
            at(src, c.offset, esize), c.count);
      } else {
        // All-gather step t: chunk c left its owner (rank c - 1) t + 1 hops ago.
        const int64_t t = k - (nranks - 1);
        if (to >= 0 && mod(to - (s.chunk - 1), nranks) < t + 1) continue;
        add(step, r, p, at(part[r], c.offset, esize), nullptr, at(part[p], c.offset, esize),
            c.count);
      }
    }
  }
  return plan;
}

}  // namespace plan_detail

// out[r] = the reduction of every in[] (count elements each); out[r] == in[r] is in place.
inline Plan all_reduce_plan(const void* const* in, void* const* out, int nranks, int64_t count,
                            int64_t esize) {
  if (count == 0) return {};
  if (nranks == 1) return plan_detail::local_copies(in, out, 1, count, 0, esize);
  return plan_detail::ring_reduce(in, out, nranks, count, esize, -1);
}

// The reduction of every in[] into `output` on rank `root`, with the bits all_reduce_plan
// gives: the same reduce-scatter, then only the all-gather hops on the way to the root.
// work[r] (count elements, r != root) holds rank r's partials so that no input changes;
// output == in[root] is in place.
inline Plan reduce_plan(const void* const* in, void* output, void* const* work, int root,
                        int nranks, int64_t count, int64_t esize) {
  if (count == 0) return {};
  std::vector<void*> part(work, work + nranks);
  part[size_t(root)] = output;
  if (nranks == 1) return plan_detail::local_copies(in, part.data(), 1, count, 0, esize);
  return plan_detail::ring_reduce(in, part.data(), nranks, count, esize, root);
}

// bufs[root] copied into every other buffer (count elements): a pipelined chain
// root -> root+1 -> ... -> root-1 over schedule.h's chunks. At step k the j-th rank after the
// root copies chunk k - j + 1, which its predecessor received at step k - 1; 2(N-1) steps.
inline Plan broadcast_plan(void* const* bufs, int root, int nranks, int64_t count,
                           int64_t esize) {
  if (count == 0 || nranks == 1) return {};
  Plan plan(size_t(num_steps(nranks)));
  for (int64_t k = 0; k < num_steps(nranks); ++k) {
    for (int j = 1; j < nranks; ++j) {
      const int64_t chunk = k - j + 1;
      if (chunk < 0 || chunk >= nranks) continue;
      const int r = mod(root + j, nranks), p = mod(root + j - 1, nranks);
      const Range c = chunk_range(count, nranks, esize, int(chunk));
      plan_detail::add(plan[size_t(k)], r, p, plan_detail::at(bufs[r], c.offset, esize),
                       nullptr, plan_detail::at(bufs[p], c.offset, esize), c.count);
    }
  }
  return plan;
}

// out[r] (nranks * count elements) = in[0], in[1], ..., in[N-1] (count each), like NCCL:
// rank r's block is copied locally, the others travel the ring (schedule.h with shift 1, so
// the first hop sends the predecessor's own input). in[r] may be out[r]'s block r (in place).
inline Plan all_gather_plan(const void* const* in, void* const* out, int nranks, int64_t count,
                            int64_t esize) {
  if (count == 0) return {};
  Plan plan = plan_detail::local_copies(in, out, nranks, count, count, esize);
  plan.resize(size_t(std::max(nranks - 1, 1)));
  for (int64_t t = 0; t < nranks - 1; ++t) {
    PlanStep& step = plan[size_t(t)];
    for (int r = 0; r < nranks; ++r) {
      const Step s = ring_step(r, nranks, (nranks - 1) + t, 1);
      const int p = s.src_rank;
      const void* src = t == 0 ? in[p] : plan_detail::at(out[p], s.chunk * count, esize);
      plan_detail::add(step, r, p, plan_detail::at(out[r], s.chunk * count, esize), nullptr,
                       src, count);
    }
  }
  return plan_detail::or_empty(plan);
}

// out[r] (count elements) = the reduction of block r (count elements) of every in[] (nranks *
// count each), like NCCL. The reduce-scatter of schedule.h with shift 1: chunk c is combined
// in the order c+1, c+2, ..., c and its last hop writes straight into out[c]. work[r]
// (nranks * count elements) holds rank r's partials so that no input changes; out[r] may be
// in[r]'s block r (in place).
inline Plan reduce_scatter_plan(const void* const* in, void* const* out, void* const* work,
                                int nranks, int64_t count, int64_t esize) {
  if (count == 0) return {};
  if (nranks == 1) return plan_detail::local_copies(in, out, 1, count, 0, esize);
  Plan plan(size_t(nranks - 1));
  for (int64_t k = 0; k < nranks - 1; ++k) {
    PlanStep& step = plan[size_t(k)];
    for (int r = 0; r < nranks; ++r) {
      const Step s = ring_step(r, nranks, k, 1);
      const int p = s.src_rank;
      const int64_t off = s.chunk * count;
      step.reduce = true;
      step.last = s.last_reduce;
      const void* src = plan_detail::at(k == 0 ? in[p] : work[p], off, esize);
      void* dst = s.last_reduce ? out[r] : plan_detail::at(work[r], off, esize);
      plan_detail::add(step, r, p, dst, plan_detail::at(in[r], off, esize), src, count);
    }
  }
  return plan;
}

}  // namespace rr
