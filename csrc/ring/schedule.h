// The ring schedule: which chunk each rank receives, reduces and forwards at each step.
// Pure arithmetic, shared by every executor. Torch-free; host and device code (RR_HD), so the
// kernels that run the whole schedule (oneshot.h, fused.h) use these very functions.
//
// N ranks, `count` elements each, split into N chunks. Chunk boundaries are multiples of
// 16 bytes so every chunk of a 16-byte-aligned buffer can be moved with 16-byte vectors; the
// last chunks absorb the uneven tail and may be short or empty (count < N is fine).
//
// Steps are numbered 0 .. 2(N-1)-1 within one all-reduce:
//   reduce-scatter, step s in [0, N-1):  rank r receives chunk (r - s - 1) mod N from rank
//       r - 1 and combines it into its own copy: buf[r][c] = op(buf[r][c], buf[r-1][c]).
//       After the last one rank r holds the fully reduced chunk (r + 1) mod N.
//   all-gather, step N-1+t, t in [0, N-1): rank r copies chunk (r - t) mod N, which rank r-1
//       finished (or received) one step earlier: buf[r][c] = buf[r-1][c].
// Data dependency: rank r's step k reads what rank r-1 wrote at step k-1, and nothing else.
// Chunk c is reduced in the fixed order c, c+1, ..., c+N-1 (mod N), so the result is the
// same on every rank and on every call, whatever the timing.
//
// `shift` rotates which chunk each rank handles by that many positions: with shift 1 rank r
// finishes chunk r (not r + 1), and chunk c is reduced in the order c+1, c+2, ..., c. NCCL's
// reduce_scatter and all_gather put block r on rank r, so plan.h uses shift 1 for those.
#pragma once

#include <cstdint>

#include "types.h"

namespace rr {

struct Range {
  int64_t offset;  // elements
  int64_t count;   // elements
};

struct Step {
  int chunk;      // chunk index moved at this step
  int src_rank;   // the rank read from (always r - 1 mod N)
  bool reduce;    // true: combine into own copy (reduce-scatter); false: copy (all-gather)
  bool last_reduce;  // the final reduce-scatter hop of this chunk (avg divides here)
};

RR_HD int mod(int64_t a, int n) { return int(((a % n) + n) % n); }

RR_HD int64_t num_steps(int nranks) { return nranks > 1 ? 2 * int64_t(nranks - 1) : 0; }

// Elements per chunk (all but the tail), a multiple of 16 bytes' worth of elements.
RR_HD int64_t chunk_elems(int64_t count, int nranks, int64_t elem_size) {
  const int64_t align = elem_size >= 16 ? 1 : 16 / elem_size;
  int64_t per = (count + nranks - 1) / nranks;
  return (per + align - 1) / align * align;
}

RR_HD Range chunk_range(int64_t count, int nranks, int64_t elem_size, int chunk) {
  const int64_t per = chunk_elems(count, nranks, elem_size);
  int64_t begin = per * chunk;
  if (begin > count) begin = count;
  int64_t end = begin + per;
  if (end > count) end = count;
  return Range{begin, end - begin};
}

// Staged executors move a large tensor in rounds, each carrying up to `piece` elements of every
// ring chunk, so every element keeps the chunk (and so the reduction order) the whole-tensor
// schedule gives it. Round `round` carries elements [*begin, *begin + result) of chunk `chunk`.
inline int64_t chunk_piece(int64_t count, int nranks, int64_t elem_size, int chunk,
                           int64_t piece, int64_t round, int64_t* begin) {
  const Range r = chunk_range(count, nranks, elem_size, chunk);
  const int64_t lo = r.count < round * piece ? r.count : round * piece;
  const int64_t hi = r.count < (round + 1) * piece ? r.count : (round + 1) * piece;
  *begin = r.offset + lo;
  return hi - lo;
}

RR_HD Step ring_step(int rank, int nranks, int64_t step, int shift = 0) {
  Step s;
  s.src_rank = mod(rank - 1, nranks);
  if (step < nranks - 1) {
    s.chunk = mod(rank - step - 1 - shift, nranks);
    s.reduce = true;
    s.last_reduce = step == nranks - 2;
  } else {
    s.chunk = mod(rank - (step - (nranks - 1)) - shift, nranks);
    s.reduce = false;
    s.last_reduce = false;
  }
  return s;
}

}  // namespace rr
