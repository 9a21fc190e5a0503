#include "cpu_collectives.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "../ring/cpu_executor.h"
#include "../ring/schedule.h"

namespace rr {
namespace dist {
namespace cpu {

namespace {

// Elements of one ring chunk carried per round: the staging area (or each of its `parts`)
// holds one piece of each of the nranks chunks, each a multiple of 16 bytes so chunk pieces
// stay vector-aligned.
int64_t piece_elems(const HostGroup& g, int64_t esize, int64_t parts = 1) {
  const int64_t align = esize >= 16 ? 1 : 16 / esize;
  return g.capacity() / parts / (int64_t(g.nranks()) * esize) / align * align;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

::rr::cpu::HalfRounding half_rounding(const HostGroup& g) {
  return g.half_once() ? ::rr::cpu::HalfRounding::Once : ::rr::cpu::HalfRounding::PerHop;
}

Desc host_desc(const Ctx& ctx, int dtype, int op, int root, int64_t count, int64_t round) {
  return make_desc(ctx.seq, ctx.kind, dtype, op, root, count, round, -1);
}

std::string start_text(int64_t round) {
  return "at the start of round " + std::to_string(round);
}

std::string step_text(const char* phase, int64_t step, int64_t nsteps, int64_t round) {
  return std::string("at ") + phase + " step " + std::to_string(step) + "/" +
         std::to_string(nsteps) + " (round " + std::to_string(round) + ")";
}

// Bytes for each destination when a staging area is split among all ranks (scatter,
// all-to-all): a multiple of 64, so pieces start on cache lines.
int64_t slot_bytes(const HostGroup& g) { return g.capacity() / g.nranks() / 64 * 64; }

// memcpy / memmove of n bytes that pass no pointer when n is 0: an empty tensor's data may be
// null, and memcpy's pointers must not be null even for 0 bytes.
void copy_bytes(void* dst, const void* src, int64_t n) {
  if (n > 0) std::memcpy(dst, src, size_t(n));
}
void move_bytes(void* dst, const void* src, int64_t n) {
  if (n > 0) std::memmove(dst, src, size_t(n));
}

// [*off, *off + returned length) is round i's piece of `total` bytes cut in `piece`-byte pieces.
int64_t round_part(int64_t total, int64_t piece, int64_t i, int64_t* off) {
  *off = std::min(total, i * piece);
  return std::min(total, *off + piece) - *off;
}

void copy_unless_same(void* dst, const void* src, int64_t len) {
  if (dst != src) move_bytes(dst, src, len);
}

// Blocks of the two-destination loops below: small enough that the second write reads the
// first from L1.
constexpr int64_t kBlockBytes = 8 << 10;

// dst = combine(own, src) and dst2 = the same, block by block (dst may be own).
void combine_out(DType dtype, Op op, char* dst, char* dst2, const char* own, const char* src,
                 int64_t count, bool last, int nranks) {
  const int64_t esize = elem_size(dtype);
  const int64_t block = std::max<int64_t>(1, kBlockBytes / esize);
  for (int64_t i = 0; i < count; i += block) {
    const int64_t len = std::min(block, count - i);
    ::rr::cpu::combine(dtype, op, dst + i * esize, own + i * esize, src + i * esize, len, last,
                       nranks);
    copy_bytes(dst2 + i * esize, dst + i * esize, len * esize);
  }
}

// dst = src, and dst2 = src when dst2 is not null, block by block.
void copy_out(char* dst, char* dst2, const char* src, int64_t bytes) {
  if (dst2 == nullptr) {
    copy_bytes(dst, src, bytes);
    return;
  }
  for (int64_t i = 0; i < bytes; i += kBlockBytes) {
    const int64_t len = std::min(kBlockBytes, bytes - i);
    copy_bytes(dst + i, src + i, len);
    copy_bytes(dst2 + i, dst + i, len);
  }
}

// Elements [first, first + len) of a tensor of `count` elements reduced into `out` (element
// `first`'s place) in the ring's order: element i of ring chunk c combined over the ranks' copies
// in the order c, c+1, ..., c-1 (mod N) with the ring's combine. `src(r)` points at rank r's copy
// of element `first`: a small slot (small_all_reduce) or a staging area (two_shot_all_reduce).
template <typename Src>
void reduce_in_ring_order(int n, int64_t count, int64_t first, int64_t len, char* out, Src src,
                          DType dtype, Op op) {
  const int64_t esize = elem_size(dtype);
  for (int c = 0; c < n; ++c) {
    const Range chunk = chunk_range(count, n, esize, c);
    const int64_t lo = std::max(first, chunk.offset);
    const int64_t hi = std::min(first + len, chunk.offset + chunk.count);
    if (lo >= hi) continue;
    const int64_t at = (lo - first) * esize;
    char* dst = out + at;
    for (int j = 1; j < n; ++j) {
      const int r = (c + j) % n;
      // The ring's hop at rank r: combine(own = r's input, incoming = the partial so far). The
      // first hop's partial is rank c's input itself, read where it lies (no copy first).
      const char* partial = j == 1 ? src(c) + at : dst;
      ::rr::cpu::combine(dtype, op, dst, src(r) + at, partial, hi - lo, j == n - 1, n);
    }
  }
}

// The one-round all-reduce of a small tensor (at most g.small_bytes() bytes): every rank copies
// its input into its own small slot, publishes once, waits until every peer has published, and
// reduces all N slots straight into its output.
//
// Bits. Element i of ring chunk c (schedule.h's chunk_range) is reduced in the ring's order
// c, c+1, ..., c-1 (mod N) with the ring's combine (each hop rounded to the dtype, half types
// through fp32, avg divided on the last hop), the order oneshot.h follows on the GPU. So the
// result is the ring's, bit for bit, on every rank: RINGREDUCE_SMALL_BYTES changes the speed,
// never the bits. (Tensors of less than 16 bytes per rank are one chunk: rank order 0..N-1.)
// float16 / bfloat16 sums and averages rounded once (HostGroup::half_once) are the exception:
// every element summed over the slots in rank order 0..N-1 in fp32, rounded once, which is
// two_shot_all_reduce's result at every size.
//
// No barrier at the start or the end. This phase has one step: "my slot holds my input", said
// twice: first by the slot's `ready` (the call's seq, stored after the descriptor and the data),
// then by the publish of base + 1. A waiter (HostGroup::wait_small) reads the slot first: when
// the peer is there, the descriptor, the data (up to 8 bytes) and `ready` come in one cache line,
// and the peer's progress is not read at all. The publish still comes, for the next phase's
// barrier and for a peer that took another path (its slot never gets this seq: the publish ends
// the wait and check_small_desc reports the disagreement). Two slots per rank, used alternately
// by this rank's small all-reduces (next_small_slot: every rank counts the same calls, so all use
// the same slot in a call). Why a rank P never overwrites a slot that a slow peer Q still reads:
// P writes slot s in small all-reduce k + 2 only after it finished small all-reduce k + 1
// (program order), in which it waited for every peer's `ready` or publish of that call; Q stores
// either only after it finished small all-reduce k, its reads of everyone's slot s included
// (program order again; both are release stores and P's wait acquire loads, so Q's reads happen
// before P's writes). Whatever other collectives run between, they do not change this: they
// never touch the small slots, and every rank runs them in the same order, so the count of small
// all-reduces (the slot parity) and the progress values stay in step. The slot's descriptor is
// covered by the same argument, which is why it lives in the slot and not in the header.
//
// The other collectives in turn rely on their start barrier (wait_all(base)): "every peer has
// finished the previous phase, so nobody still reads my staging area or header descriptor".
// After a small phase, progress[q] >= base only says that q has *started* that phase. That
// is enough: q finished every phase before it (it publishes base only after its reads), and in
// the small phase q reads only small slots, which the next phase does not write. After a small
// phase the barrier costs N-1 loads, since every peer is already past base. It cannot be
// dropped after a ring phase, whose last step has rank r + 1 still reading r's staging area
// when r is done.
void small_all_reduce(HostGroup& g, const Ctx& ctx, void* data, int64_t count, DType dtype,
                      Op op) {
  const int n = g.nranks();
  const int rank = g.rank();
  const int64_t esize = elem_size(dtype);
  const int s = g.next_small_slot();
  const uint64_t base = g.base();
  g.fill_small_slot(s, host_desc(ctx, int(dtype), int(op), -1, count, kSmallRound), data,
                    count * esize);
  g.publish(base + 1);
  const char* what = "in the one-round (small message) all_reduce";
  for (int j = 1; j < n; ++j) {
    const int p = (rank + j) % n;
    g.wait_small(p, s, base + 1, ctx, what);
    g.check_small_desc(p, s, ctx);
    g.check_not_failed(p, base + 1, ctx, what);
  }
  if (::rr::cpu::rounds_once(dtype, op, half_rounding(g))) {
    // Every element summed over the slots in rank order 0, 1, ..., N-1 and rounded once: the
    // bits of the larger tensors' two-shot path.
    std::vector<const void*> slots(static_cast<size_t>(n));
    for (int r = 0; r < n; ++r) slots[size_t(r)] = g.small_data(r, s, count * esize);
    ::rr::cpu::sum_rounded_once(dtype, op, data, slots.data(), n, count);
  } else {
    reduce_in_ring_order(n, count, 0, count, static_cast<char*>(data),
                         [&](int r) { return g.small_data(r, s, count * esize); }, dtype, op);
  }
  g.end_phase(1);
  g.small_finished(ctx);
}

// The all-reduce of float16 / bfloat16 sums and averages rounded once (rounds_once) among more
// than two ranks (two take the ring), for tensors above the small path, and of everything else
// where HostGroup::two_shot says so (more ranks than cores): a two-shot reduce-scatter +
// all-gather through the staging areas. Each round carries up to a staging area's worth of
// elements, cut into N pieces (16-byte multiples); rank r owns piece r.
//   1. every rank copies the round's elements into its staging area and publishes base + 1;
//   2. rank r reads piece r from every rank's area and reduces it: rounded once, summed in
//      fp32 in rank order 0, 1, ..., N-1, written over piece r of its own area (no peer reads
//      that piece of its area) and into its tensor; otherwise in the ring's order
//      (reduce_in_ring_order) into its tensor, then over piece r of its own area; it
//      publishes base + 2;
//   3. rank r copies every other rank's finished piece q from rank q's area into its tensor and
//      publishes base + 3.
// Bits: every element is the once-rounded fp32 sum in rank order, or the ring's combine in the
// ring chunk's order, whatever the round and piece sizes and whichever rank computes it, so
// every rank holds the same bits, equal to the small path's, the ring's and the list API's.
// Traffic per rank and round of S bytes: (N-1)/N * S read from peers in step 2 and again in
// step 3, the ring's 2(N-1)/N * S, in 3 steps instead of 2N - 1; plus the local copy in (S) and
// the own piece out. The next round's start barrier (wait_all)
// keeps a rank from overwriting its area while a peer still reads it in step 3.
void two_shot_all_reduce(HostGroup& g, const Ctx& ctx, void* data, int64_t count, DType dtype,
                         Op op) {
  const bool once = ::rr::cpu::rounds_once(dtype, op, half_rounding(g));
  const int n = g.nranks();
  const int rank = g.rank();
  const int64_t esize = elem_size(dtype);
  const int64_t piece = piece_elems(g, esize);
  const int64_t per_round = piece * n;
  const int64_t rounds = std::max<int64_t>(1, ceil_div(count, per_round));
  char* bytes = static_cast<char*>(data);
  std::vector<const void*> srcs(static_cast<size_t>(n));
  for (int64_t i = 0; i < rounds; ++i) {
    const uint64_t base = g.base();
    const int64_t lo = std::min(count, i * per_round);
    const int64_t len = std::min(count, lo + per_round) - lo;
    // This round's pieces: the same cut on every rank, 16-byte multiples except the last.
    const int64_t align = esize >= 16 ? 1 : 16 / esize;
    const int64_t cut = ceil_div(ceil_div(len, n), align) * align;
    auto piece_of = [&](int q, int64_t* off) {
      *off = std::min(len, q * cut);
      return std::min(len, *off + cut) - *off;
    };
    g.wait_all(base, ctx, start_text(i));
    Desc desc = host_desc(ctx, int(dtype), int(op), -1, count, i);
    desc.path = kTwoShotPath;
    g.set_desc(desc);
    copy_bytes(g.staging(rank), bytes + lo * esize, len * esize);
    g.publish(base + 1);
    for (int q = 0; q < n; ++q) {
      if (q == rank) continue;
      g.wait(q, base + 1, ctx, step_text("reduce", q, n, i));
      g.check_desc(q, ctx);
    }
    int64_t off;
    const int64_t mine = piece_of(rank, &off);
    char* result = g.staging(rank) + off * esize;
    char* out = bytes + (lo + off) * esize;
    if (mine > 0 && once) {
      for (int q = 0; q < n; ++q) srcs[size_t(q)] = g.staging(q) + off * esize;
      ::rr::cpu::sum_rounded_once(dtype, op, result, srcs.data(), n, mine);
      copy_bytes(out, result, mine * esize);
    } else if (mine > 0) {
      // Into the tensor first (its own input is staged): the staged piece is still an operand.
      reduce_in_ring_order(n, count, lo + off, mine, out,
                           [&](int r) { return g.staging(r) + off * esize; }, dtype, op);
      copy_bytes(result, out, mine * esize);
    }
    g.publish(base + 2);
    for (int j = 1; j < n; ++j) {
      const int q = (rank + j) % n;
      g.wait(q, base + 2, ctx, step_text("gather", j - 1, n - 1, i));
      const int64_t theirs = piece_of(q, &off);
      copy_bytes(bytes + (lo + off) * esize, g.staging(q) + off * esize, theirs * esize);
    }
    g.publish(base + 3);
    g.end_phase(3);
  }
}

}  // namespace

AllReducePath all_reduce_path(const HostGroup& g, int64_t count, DType dtype, Op op) {
  const int64_t bytes = count * elem_size(dtype);
  if (g.small_bytes() > 0 && bytes <= g.small_bytes()) return AllReducePath::Small;
  // At two ranks the ring's one reduce hop adds the two inputs in rank order and rounds once
  // (below): the two-shot's bits, with half its staging copy.
  if ((::rr::cpu::rounds_once(dtype, op, half_rounding(g)) && g.nranks() > 2) ||
      g.two_shot(bytes))
    return AllReducePath::TwoShot;
  return AllReducePath::Ring;
}

const char* path_name(AllReducePath p) {
  switch (p) {
    case AllReducePath::Small: return "small";
    case AllReducePath::TwoShot: return "two_shot";
    case AllReducePath::Ring: return "ring";
  }
  return "?";
}

void all_reduce(HostGroup& g, void* data, int64_t count, DType dtype, Op op) {
  const Ctx ctx = g.begin(Kind::AllReduce, count * elem_size(dtype));
  const int n = g.nranks();
  if (n == 1) return;
  guarded(g, ctx, [&] {
    const AllReducePath path = all_reduce_path(g, count, dtype, op);
    if (path == AllReducePath::Small) {
      small_all_reduce(g, ctx, data, count, dtype, op);
      return;
    }
    if (path == AllReducePath::TwoShot) {
      two_shot_all_reduce(g, ctx, data, count, dtype, op);
      return;
    }
    const int rank = g.rank();
    const int pred = mod(rank - 1, n);
    const int64_t esize = elem_size(dtype);
    const bool once = ::rr::cpu::rounds_once(dtype, op, half_rounding(g));
    if (once && n != 2)
      throw std::logic_error("ringreduce internal error: a once-rounded ring all_reduce of " +
                             std::to_string(n) + " ranks (only 2 take the ring)");
    // Rounds alternate between the two halves of the staging area, where a half holds a
    // piece of every chunk: a rank writing staging lines its successor read one round earlier
    // stalls on them (measured: 2 ranks, 64 KiB, 13 us a call in one area, 9 in alternate
    // halves). A half holds at least 2048 bytes and at most kMaxRanks chunks of 16 bytes or
    // more, so a piece is never empty.
    static_assert(4096 / 2 / (kMaxRanks * 16) >= 1, "a staging half must hold a piece per rank");
    const int64_t piece = piece_elems(g, esize, 2);
    const int64_t per_chunk = chunk_elems(count, n, esize);
    const int64_t rounds = std::max<int64_t>(1, ceil_div(per_chunk, piece));
    const int64_t steps = num_steps(n);
    char* data_bytes = static_cast<char*>(data);
    // The part of chunk c that round i carries: elements [begin, begin + len) of the tensor.
    auto part = [&](int c, int64_t i, int64_t* begin) {
      return chunk_piece(count, n, esize, c, piece, i, begin);
    };
    for (int64_t i = 0; i < rounds; ++i) {
      const uint64_t base = g.base();
      // Every rank has finished the previous phase, so nobody still reads this staging area.
      g.wait_all(base, ctx, start_text(i));
      g.set_desc(host_desc(ctx, int(dtype), int(op), -1, count, i));
      // Only the piece of chunk `rank` goes into the staging area before the first publish:
      // it is what the successor reads at its step 0. Every other piece is read straight from
      // the tensor as the `own` operand of its reduce-scatter hop, and results go straight to
      // the tensor; the staging area carries only what the successor reads next.
      const int64_t half_offset = g.next_ring_half() * n * piece * esize;
      char* own = g.staging(rank) + half_offset;
      {
        int64_t begin;
        const int64_t len = part(rank, i, &begin);
        copy_bytes(own + rank * piece * esize, data_bytes + begin * esize, len * esize);
      }
      g.publish(base + 1);
      const char* src_area = g.staging(pred) + half_offset;
      for (int64_t k = 0; k < steps; ++k) {
        // Rank r's step k reads what its predecessor wrote at step k - 1 (k = 0: its input).
        g.wait(pred, base + 1 + uint64_t(k), ctx, step_text("ring", k, steps, i));
        if (k == 0) g.check_desc(pred, ctx);
        const Step s = ring_step(rank, n, k);
        int64_t begin;
        const int64_t len = part(s.chunk, i, &begin);
        char* stage = own + s.chunk * piece * esize;
        char* out = data_bytes + begin * esize;
        const char* src = src_area + s.chunk * piece * esize;
        if (len > 0) {
          if (s.reduce) {
            // A partial goes on to the successor; the final value goes to the tensor and on
            // to the successor, whose all-gather starts with it.
            if (once) {
              // Two ranks (all_reduce_path), so this is the only reduce hop: the fp32 sum of
              // rank 0's and rank 1's elements, rounded once, as two_shot_all_reduce makes it.
              const void* srcs[2];
              srcs[rank] = out;
              srcs[pred] = src;
              ::rr::cpu::sum_rounded_once(dtype, op, out, srcs, 2, len);
              copy_bytes(stage, out, len * esize);
            } else if (s.last_reduce) {
              combine_out(dtype, op, out, stage, out, src, len, true, n);
            } else {
              ::rr::cpu::combine(dtype, op, stage, out, src, len, false, n);
            }
          } else {
            // All-gather: into the tensor, and forwarded unless the successor already has it.
            copy_out(out, k + 1 < steps ? stage : nullptr, src, len * esize);
          }
        }
        g.publish(base + 2 + uint64_t(k));
      }
      g.end_phase(1 + uint64_t(steps));
    }
  });
}

void broadcast(HostGroup& g, void* data, int64_t bytes, int root) {
  const Ctx ctx = g.begin(Kind::Broadcast, bytes);
  const int n = g.nranks();
  if (n == 1) return;
  guarded(g, ctx, [&] {
    const int rank = g.rank();
    const int pred = mod(rank - 1, n);
    const int64_t cap = g.capacity();
    const int64_t rounds = std::max<int64_t>(1, ceil_div(bytes, cap));
    char* bytes_ptr = static_cast<char*>(data);
    for (int64_t i = 0; i < rounds; ++i) {
      const uint64_t base = g.base();
      const int64_t off = std::min(bytes, i * cap);
      const int64_t len = std::min(bytes, off + cap) - off;
      g.wait_all(base, ctx, start_text(i));
      g.set_desc(host_desc(ctx, -1, -1, root, bytes, i));
      if (rank == root) copy_bytes(g.staging(rank), bytes_ptr + off, len);
      g.publish(base + 1);
      g.wait(pred, base + 1, ctx, start_text(i));
      g.check_desc(pred, ctx);
      if (rank != root) {
        g.wait(root, base + 1, ctx, step_text("copy", 0, 1, i) + " from the root");
        g.check_desc(root, ctx);
        copy_bytes(bytes_ptr + off, g.staging(root), len);
      }
      g.publish(base + 2);
      g.publish(base + 3);
      g.end_phase(3);
    }
  });
}

void all_gather(HostGroup& g, const void* in, void* const* outs, int64_t bytes) {
  const Ctx ctx = g.begin(Kind::AllGather, bytes * g.nranks());
  const int n = g.nranks();
  guarded(g, ctx, [&] {
    const int rank = g.rank();
    const int64_t cap = g.capacity();
    const int64_t rounds = std::max<int64_t>(1, ceil_div(bytes, cap));
    const char* in_bytes = static_cast<const char*>(in);
    for (int64_t i = 0; i < rounds; ++i) {
      const uint64_t base = g.base();
      const int64_t off = std::min(bytes, i * cap);
      const int64_t len = std::min(bytes, off + cap) - off;
      if (n > 1) {
        g.wait_all(base, ctx, start_text(i));
        g.set_desc(host_desc(ctx, -1, -1, -1, bytes, i));
        copy_bytes(g.staging(rank), in_bytes + off, len);
        g.publish(base + 1);
      }
      // In place (the input is this rank's slot of the output) needs no copy.
      char* mine = static_cast<char*>(outs[rank]) + off;
      if (mine != in_bytes + off) move_bytes(mine, in_bytes + off, len);
      for (int j = 1; j < n; ++j) {
        const int p = (rank + j) % n;
        g.wait(p, base + 1, ctx, step_text("copy", j - 1, n - 1, i));
        g.check_desc(p, ctx);
        copy_bytes(static_cast<char*>(outs[p]) + off, g.staging(p), len);
      }
      if (n > 1) {
        g.publish(base + 2);
        g.publish(base + 3);
        g.end_phase(3);
      }
    }
  });
}

void reduce_scatter(HostGroup& g, const void* in, void* out, int64_t count, DType dtype, Op op) {
  const Ctx ctx = g.begin(Kind::ReduceScatter, count * elem_size(dtype) * g.nranks());
  const int n = g.nranks();
  const int rank = g.rank();
  const int64_t esize = elem_size(dtype);
  if (n == 1) {
    if (out != in) move_bytes(out, in, count * esize);
    return;
  }
  guarded(g, ctx, [&] {
    const int64_t piece = piece_elems(g, esize);
    const int64_t rounds = std::max<int64_t>(1, ceil_div(count, piece));
    const char* in_bytes = static_cast<const char*>(in);
    char* out_bytes = static_cast<char*>(out);
    // The output may be this rank's own segment of the input (reduce_scatter_tensor in place;
    // Comm routes every other overlap through a scratch output). Then ranks 2 and up must stage
    // their own segment too: the first combine (segments 0 and 1) writes the output before
    // they read it. Elsewhere the own segment is read straight from the input, in place.
    const bool in_place = out_bytes == in_bytes + rank * count * esize;
    const bool stage_own = in_place && rank >= 2;
    const bool once = ::rr::cpu::rounds_once(dtype, op, half_rounding(g));
    std::vector<const void*> srcs(static_cast<size_t>(n));
    for (int64_t i = 0; i < rounds; ++i) {
      const uint64_t base = g.base();
      const int64_t lo = std::min(count, i * piece);
      const int64_t len = std::min(count, lo + piece) - lo;
      g.wait_all(base, ctx, start_text(i));
      g.set_desc(host_desc(ctx, int(dtype), int(op), -1, count, i));
      char* own = g.staging(rank);
      for (int seg = 0; seg < n; ++seg) {
        if (seg == rank && !stage_own) continue;  // no peer reads it
        copy_bytes(own + seg * piece * esize, in_bytes + (seg * count + lo) * esize, len * esize);
      }
      g.publish(base + 1);
      // Fixed order 0, 1, ..., N-1, the same on every rank and every call: the first step
      // combines segments 0 and 1 into the output (no copy first), each later one combines
      // the next into it.
      char* dst = out_bytes + lo * esize;
      auto segment = [&](int q) -> const char* {
        if (q == rank && !stage_own) return in_bytes + (rank * count + lo) * esize;
        return g.staging(q) + rank * piece * esize;
      };
      if (once) {
        // Summed in fp32 in the same order and rounded once, after every segment is staged.
        for (int q = 0; q < n; ++q) {
          if (q == rank) continue;
          g.wait(q, base + 1, ctx, step_text("reduce", q, n, i));
          g.check_desc(q, ctx);
          srcs[size_t(q)] = segment(q);
        }
        srcs[size_t(rank)] = segment(rank);
        // dst is segment(rank) itself when in place (and not staged): the same elements.
        if (len > 0) ::rr::cpu::sum_rounded_once(dtype, op, dst, srcs.data(), n, len);
      } else {
        for (int q = 0; q < n; ++q) {
          if (q != rank) {
            g.wait(q, base + 1, ctx, step_text("reduce", q, n, i));
            g.check_desc(q, ctx);
          }
          if (q == 0 || len == 0) continue;
          const char* partial = q == 1 ? segment(0) : dst;
          ::rr::cpu::combine(dtype, op, dst, partial, segment(q), len, q == n - 1, n);
        }
      }
      g.publish(base + 2);
      g.publish(base + 3);
      g.end_phase(3);
    }
  });
}

void barrier(HostGroup& g) {
  const Ctx ctx = g.begin(Kind::Barrier, 0);
  if (g.nranks() == 1) return;
  guarded(g, ctx, [&] {
    const uint64_t base = g.base();
    g.wait_all(base, ctx, "at the start of the barrier");
    g.set_desc(host_desc(ctx, -1, -1, -1, 0, 0));
    g.publish(base + 1);
    for (int j = 1; j < g.nranks(); ++j) {
      const int p = (g.rank() + j) % g.nranks();
      g.wait(p, base + 1, ctx, "in the barrier");
      g.check_desc(p, ctx);
    }
    // A second step, so that no rank overwrites its descriptor (next collective) before
    // every peer has checked it.
    g.publish(base + 2);
    g.end_phase(2);
  });
}

// Phases of two steps, like the barrier's: publish once this rank's data is staged, once more
// when it has read what it needs; the next round starts when every rank has done both.
void gather(HostGroup& g, const void* in, void* const* outs, int64_t bytes, int root) {
  const Ctx ctx = g.begin(Kind::Gather, bytes * g.nranks());
  const int n = g.nranks();
  const int rank = g.rank();
  const char* in_bytes = static_cast<const char*>(in);
  if (n == 1) {
    copy_unless_same(outs[0], in, bytes);
    return;
  }
  guarded(g, ctx, [&] {
    const int64_t cap = g.capacity();
    const int64_t rounds = std::max<int64_t>(1, ceil_div(bytes, cap));
    for (int64_t i = 0; i < rounds; ++i) {
      const uint64_t base = g.base();
      int64_t off;
      const int64_t len = round_part(bytes, cap, i, &off);
      g.wait_all(base, ctx, start_text(i));
      g.set_desc(host_desc(ctx, -1, -1, root, bytes, i));
      if (rank != root) copy_bytes(g.staging(rank), in_bytes + off, len);
      g.publish(base + 1);
      if (rank == root) {
        copy_unless_same(static_cast<char*>(outs[rank]) + off, in_bytes + off, len);
        for (int j = 1; j < n; ++j) {
          const int p = (rank + j) % n;
          g.wait(p, base + 1, ctx, step_text("copy", j - 1, n - 1, i));
          g.check_desc(p, ctx);
          copy_bytes(static_cast<char*>(outs[p]) + off, g.staging(p), len);
        }
      } else {
        g.wait(root, base + 1, ctx, start_text(i) + " (waiting for the root)");
        g.check_desc(root, ctx);
      }
      g.publish(base + 2);
      g.end_phase(2);
    }
  });
}

void scatter(HostGroup& g, const void* const* ins, void* out, int64_t bytes, int root) {
  const Ctx ctx = g.begin(Kind::Scatter, bytes * g.nranks());
  const int n = g.nranks();
  const int rank = g.rank();
  char* out_bytes = static_cast<char*>(out);
  if (n == 1) {
    copy_unless_same(out, ins[0], bytes);
    return;
  }
  guarded(g, ctx, [&] {
    // The root's staging area holds one slot per rank.
    const int64_t slot = slot_bytes(g);
    const int64_t rounds = std::max<int64_t>(1, ceil_div(bytes, slot));
    for (int64_t i = 0; i < rounds; ++i) {
      const uint64_t base = g.base();
      int64_t off;
      const int64_t len = round_part(bytes, slot, i, &off);
      g.wait_all(base, ctx, start_text(i));
      g.set_desc(host_desc(ctx, -1, -1, root, bytes, i));
      if (rank == root) {
        for (int q = 0; q < n; ++q) {
          if (q == root) continue;
          copy_bytes(g.staging(rank) + q * slot, static_cast<const char*>(ins[q]) + off, len);
        }
      }
      g.publish(base + 1);
      if (rank == root) {
        copy_unless_same(out_bytes + off, static_cast<const char*>(ins[rank]) + off, len);
        for (int j = 1; j < n; ++j) {
          const int p = (rank + j) % n;
          g.wait(p, base + 1, ctx, start_text(i));
          g.check_desc(p, ctx);
        }
      } else {
        g.wait(root, base + 1, ctx, step_text("copy", 0, 1, i) + " from the root");
        g.check_desc(root, ctx);
        copy_bytes(out_bytes + off, g.staging(root) + rank * slot, len);
      }
      g.publish(base + 2);
      g.end_phase(2);
    }
  });
}

void all_to_all(HostGroup& g, const void* const* ins, const int64_t* in_bytes,
                void* const* outs, const int64_t* out_bytes) {
  const Ctx ctx = g.begin(Kind::AllToAll, 0);
  const int n = g.nranks();
  const int rank = g.rank();
  if (n == 1) {
    if (in_bytes[0] != out_bytes[0])
      throw std::invalid_argument("ringreduce: " + g.describe(ctx) + ": the input for rank 0 "
                                  "has " + std::to_string(in_bytes[0]) + " bytes but the "
                                  "output from rank 0 has " + std::to_string(out_bytes[0]));
    copy_unless_same(outs[0], ins[0], in_bytes[0]);
    return;
  }
  guarded(g, ctx, [&] {
    // Sizes first: every rank publishes what it sends to and expects from each rank, so a pair
    // that disagrees fails on both sides, and all ranks agree on the number of rounds.
    uint64_t base = g.base();
    g.wait_all(base, ctx, "at the start (size exchange)");
    g.set_desc(host_desc(ctx, -1, -1, -1, -1, -1));
    int64_t* table = reinterpret_cast<int64_t*>(g.staging(rank));
    for (int q = 0; q < n; ++q) {
      table[q] = in_bytes[q];
      table[n + q] = out_bytes[q];
    }
    g.publish(base + 1);
    int64_t most = 0;
    for (int j = 0; j < n; ++j) {
      const int p = (rank + j) % n;
      if (p != rank) {
        g.wait(p, base + 1, ctx, "exchanging split sizes");
        g.check_desc(p, ctx);
      }
      const int64_t* row = reinterpret_cast<const int64_t*>(g.staging(p));
      if (row[rank] != out_bytes[p] || row[n + rank] != in_bytes[p]) {
        const bool to_me = row[rank] != out_bytes[p];
        const int from = to_me ? p : rank;
        const int to = to_me ? rank : p;
        throw CommError("ringreduce: " + g.describe(ctx) + ": split sizes disagree: rank " +
                        std::to_string(from) + " sends " +
                        std::to_string(to_me ? row[rank] : in_bytes[p]) + " bytes to rank " +
                        std::to_string(to) + " but rank " + std::to_string(to) +
                        " expects " + std::to_string(to_me ? out_bytes[p] : row[n + rank]) +
                        " (rank p's input split for rank r must match rank r's output split "
                        "for rank p)");
      }
      for (int q = 0; q < n; ++q) most = std::max(most, row[q]);
    }
    g.publish(base + 2);
    g.end_phase(2);
    const int64_t slot = slot_bytes(g);
    const int64_t rounds = std::max<int64_t>(1, ceil_div(most, slot));
    for (int64_t i = 0; i < rounds; ++i) {
      base = g.base();
      g.wait_all(base, ctx, start_text(i));
      g.set_desc(host_desc(ctx, -1, -1, -1, most, i));
      char* own = g.staging(rank);
      int64_t off;
      for (int q = 0; q < n; ++q) {
        if (q == rank) continue;
        const int64_t len = round_part(in_bytes[q], slot, i, &off);
        copy_bytes(own + q * slot, static_cast<const char*>(ins[q]) + off, len);
      }
      g.publish(base + 1);
      const int64_t self_len = round_part(in_bytes[rank], slot, i, &off);
      copy_unless_same(static_cast<char*>(outs[rank]) + off,
                       static_cast<const char*>(ins[rank]) + off, self_len);
      for (int j = 1; j < n; ++j) {
        const int p = (rank + j) % n;
        g.wait(p, base + 1, ctx, step_text("copy", j - 1, n - 1, i));
        g.check_desc(p, ctx);
        const int64_t len = round_part(out_bytes[p], slot, i, &off);
        copy_bytes(static_cast<char*>(outs[p]) + off, g.staging(p) + rank * slot, len);
      }
      g.publish(base + 2);
      g.end_phase(2);
    }
  });
}

}  // namespace cpu
}  // namespace dist
}  // namespace rr
