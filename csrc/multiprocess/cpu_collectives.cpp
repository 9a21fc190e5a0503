#include "cpu_collectives.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "../ring/cpu_executor.h"
#include "../ring/schedule.h"

namespace rr {
namespace dist {
namespace cpu {

namespace {

// Elements of one ring chunk carried per round: the staging area holds one piece of each of
// the nranks chunks, each a multiple of 16 bytes so chunk pieces stay vector-aligned.
int64_t piece_elems(const HostGroup& g, int64_t esize) {
  const int64_t align = esize >= 16 ? 1 : 16 / esize;
  return g.capacity() / (int64_t(g.nranks()) * esize) / align * align;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

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

}  // namespace

void all_reduce(HostGroup& g, void* data, int64_t count, DType dtype, Op op) {
  const Ctx ctx = g.begin(Kind::AllReduce);
  const int n = g.nranks();
  if (n == 1) return;
  guarded(g, ctx, [&] {
    const int rank = g.rank();
    const int pred = mod(rank - 1, n);
    const int64_t esize = elem_size(dtype);
    const int64_t piece = piece_elems(g, esize);
    const int64_t per_chunk = chunk_elems(count, n, esize);
    const int64_t rounds = std::max<int64_t>(1, ceil_div(per_chunk, piece));
    const int64_t steps = num_steps(n);
    char* data_bytes = static_cast<char*>(data);
    // The part of chunk c that round i carries: elements [begin, begin + len) of the tensor.
    auto part = [&](int c, int64_t i, int64_t* begin) {
      const Range r = chunk_range(count, n, esize, c);
      const int64_t lo = std::min(r.count, i * piece);
      const int64_t hi = std::min(r.count, (i + 1) * piece);
      *begin = r.offset + lo;
      return hi - lo;
    };
    for (int64_t i = 0; i < rounds; ++i) {
      const uint64_t base = g.base();
      // Every rank has finished the previous phase, so nobody still reads this staging area.
      g.wait_all(base, ctx, start_text(i));
      g.set_desc(host_desc(ctx, int(dtype), int(op), -1, count, i));
      char* own = g.staging(rank);
      for (int c = 0; c < n; ++c) {
        int64_t begin;
        const int64_t len = part(c, i, &begin);
        std::memcpy(own + c * piece * esize, data_bytes + begin * esize, size_t(len * esize));
      }
      g.publish(base + 1);
      const char* src_area = g.staging(pred);
      for (int64_t k = 0; k < steps; ++k) {
        // Rank r's step k reads what its predecessor wrote at step k - 1 (k = 0: its input).
        g.wait(pred, base + 1 + uint64_t(k), ctx, step_text("ring", k, steps, i));
        if (k == 0) g.check_desc(pred, ctx);
        const Step s = ring_step(rank, n, k);
        int64_t begin;
        const int64_t len = part(s.chunk, i, &begin);
        char* dst = own + s.chunk * piece * esize;
        const char* src = src_area + s.chunk * piece * esize;
        if (len > 0) {
          if (s.reduce) {
            ::rr::cpu::combine(dtype, op, dst, src, len, s.last_reduce, n);
          } else {
            std::memcpy(dst, src, size_t(len * esize));
          }
        }
        g.publish(base + 2 + uint64_t(k));
      }
      for (int c = 0; c < n; ++c) {
        int64_t begin;
        const int64_t len = part(c, i, &begin);
        std::memcpy(data_bytes + begin * esize, own + c * piece * esize, size_t(len * esize));
      }
      g.publish(base + 2 + uint64_t(steps));
      g.end_phase(2 + uint64_t(steps));
    }
  });
}

void broadcast(HostGroup& g, void* data, int64_t bytes, int root) {
  const Ctx ctx = g.begin(Kind::Broadcast);
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
      if (rank == root) std::memcpy(g.staging(rank), bytes_ptr + off, size_t(len));
      g.publish(base + 1);
      g.wait(pred, base + 1, ctx, start_text(i));
      g.check_desc(pred, ctx);
      if (rank != root) {
        g.wait(root, base + 1, ctx, step_text("copy", 0, 1, i) + " from the root");
        g.check_desc(root, ctx);
        std::memcpy(bytes_ptr + off, g.staging(root), size_t(len));
      }
      g.publish(base + 2);
      g.publish(base + 3);
      g.end_phase(3);
    }
  });
}

void all_gather(HostGroup& g, const void* in, void* const* outs, int64_t bytes) {
  const Ctx ctx = g.begin(Kind::AllGather);
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
        std::memcpy(g.staging(rank), in_bytes + off, size_t(len));
        g.publish(base + 1);
      }
      // In place (the input is this rank's slot of the output) needs no copy.
      char* mine = static_cast<char*>(outs[rank]) + off;
      if (mine != in_bytes + off) std::memmove(mine, in_bytes + off, size_t(len));
      for (int j = 1; j < n; ++j) {
        const int p = (rank + j) % n;
        g.wait(p, base + 1, ctx, step_text("copy", j - 1, n - 1, i));
        g.check_desc(p, ctx);
        std::memcpy(static_cast<char*>(outs[p]) + off, g.staging(p), size_t(len));
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
  const Ctx ctx = g.begin(Kind::ReduceScatter);
  const int n = g.nranks();
  const int rank = g.rank();
  const int64_t esize = elem_size(dtype);
  if (n == 1) {
    if (out != in) std::memmove(out, in, size_t(count * esize));
    return;
  }
  guarded(g, ctx, [&] {
    const int64_t piece = piece_elems(g, esize);
    const int64_t rounds = std::max<int64_t>(1, ceil_div(count, piece));
    const char* in_bytes = static_cast<const char*>(in);
    char* out_bytes = static_cast<char*>(out);
    for (int64_t i = 0; i < rounds; ++i) {
      const uint64_t base = g.base();
      const int64_t lo = std::min(count, i * piece);
      const int64_t len = std::min(count, lo + piece) - lo;
      g.wait_all(base, ctx, start_text(i));
      g.set_desc(host_desc(ctx, int(dtype), int(op), -1, count, i));
      char* own = g.staging(rank);
      for (int seg = 0; seg < n; ++seg) {
        std::memcpy(own + seg * piece * esize, in_bytes + (seg * count + lo) * esize,
                    size_t(len * esize));
      }
      g.publish(base + 1);
      // Fixed order 0, 1, ..., N-1, the same on every rank and every call.
      char* dst = out_bytes + lo * esize;
      for (int q = 0; q < n; ++q) {
        if (q != rank) {
          g.wait(q, base + 1, ctx, step_text("reduce", q, n, i));
          g.check_desc(q, ctx);
        }
        const char* src = g.staging(q) + rank * piece * esize;
        if (q == 0) {
          std::memcpy(dst, src, size_t(len * esize));
        } else if (len > 0) {
          ::rr::cpu::combine(dtype, op, dst, src, len, q == n - 1, n);
        }
      }
      g.publish(base + 2);
      g.publish(base + 3);
      g.end_phase(3);
    }
  });
}

void barrier(HostGroup& g) {
  const Ctx ctx = g.begin(Kind::Barrier);
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

}  // namespace cpu
}  // namespace dist
}  // namespace rr
