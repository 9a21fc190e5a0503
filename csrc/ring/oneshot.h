// One-shot all-reduce: every output element computed in one pass from all N inputs, with the
// ring's bits. Torch-free; the element arithmetic is host and device code, so the CPU path
// (oneshot_cpu.cpp) and the CUDA kernel (oneshot_kernel.cu) run the same functions.
//
// Why the order is fixed: floating-point sum, avg and prod are not associative, 16-bit floats
// round to storage on every hop, and max/min choose between two NaNs, or between -0.0 and
// +0.0, by operand position (tests/test_oneshot.py fails with the order reversed). The
// ring (schedule.h) reduces chunk c in the order c, c+1, ..., c+N-1 (mod N); the one-shot
// reduces every element of chunk c in that same order, with the same Reducer calls on the
// storage type, so a caller may switch between the two paths at any size (a threshold per N)
// and get the same bits (up to the payload of a NaN made where two NaNs meet in an add or a
// multiply, docs/DESIGN.md), and every rank gets the same bits either way.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "schedule.h"
#include "types.h"

#if defined(__CUDA_ARCH__)
// Unrolling the loop over ranks lets the loads of several ranks be in flight before the first
// combine needs its operand. 8 is set on paper, not measured.
#define RR_ONESHOT_UNROLL _Pragma("unroll 8")
#else
#define RR_ONESHOT_UNROLL
#endif

namespace rr {

// The ring chunk (chunk_range(count, nranks, esize, c)) that holds element i, 0 <= i < count.
// Chunks are chunk_elems() apart and chunk_elems() * nranks >= count, so this is always a
// non-empty chunk below nranks: the empty chunks at the tail (count < N, or an uneven split)
// hold no element.
RR_HD int chunk_of(int64_t i, int64_t count, int nranks, int64_t esize) {
  return int(i / chunk_elems(count, nranks, esize));
}

// Hop j (1 <= j < N) of a chunk's reduction: the rank that holds x combines the partial `acc`
// arriving from its predecessor, exactly as the ring's reduce-scatter step does
// (Reducer::step(mine = x, incoming = acc)); the last hop divides an average.
template <typename T, Op op>
RR_HD T ring_hop(T x, T acc, bool last, int nranks) {
  using R = Reducer<T, op>;
  return last ? R::last_step(x, acc, typename R::D(nranks)) : R::step(x, acc);
}

template <typename T, Op op>
RR_HD Pack<T> ring_hop(const Pack<T>& x, Pack<T> acc, bool last, int nranks) {
  for (int l = 0; l < Pack<T>::kLanes; ++l) {
    acc.lane[l] = ring_hop<T, op>(x.lane[l], acc.lane[l], last, nranks);
  }
  return acc;
}

// Element (or pack, P = Pack<T>) i of chunk `chunk` reduced over in[0..nranks) in the ring's
// order: acc = in[c][i]; acc = hop(in[c+1][i], acc); ...; acc = last hop(in[c-1][i], acc).
// With one rank the value is a copy, as in the ring (no rounding, no division).
template <typename T, Op op, typename P = T>
RR_HD P reduce_in_ring_order(const void* const* in, int64_t i, int nranks, int chunk) {
  P acc = static_cast<const P*>(in[chunk])[i];
  int r = chunk;
  RR_ONESHOT_UNROLL
  for (int j = 1; j < nranks; ++j) {
    r = r + 1 == nranks ? 0 : r + 1;
    const P x = static_cast<const P*>(in[r])[i];  // a copy: one 16-byte load for a pack
    acc = ring_hop<T, op>(x, acc, j == nranks - 1, nranks);
  }
  return acc;
}

// The CUDA kernel's arguments, passed by value as one __grid_constant__ parameter.
constexpr int kOneshotMaxRanks = 64;

struct OneshotArgs {
  const void* in[kOneshotMaxRanks];
  void* out[kOneshotMaxRanks];
  int nranks;
  // The outputs written, out[0..nout): nranks for an all-reduce; 1 for one rank's piece of a
  // once-rounded collective on several lanes (cuda_executor.h run_once_rounded), whose in[]
  // are every rank's piece. Only the once-rounded body takes nout < nranks (the ring-order
  // body's chunk_of needs the whole tensor).
  int nout;
  int64_t count;
  // Bit r: in[r] (out[r]) is 16-byte aligned, so its packs move as one 16-byte access; the
  // packs of a rank that is not are loaded and stored lane by lane, and only that rank's
  // (a tensor at an odd storage offset slows its own accesses, not every rank's).
  uint64_t in_packed, out_packed;
  bool vec;  // some in[] or out[] is 16-byte aligned: the body moves Pack<T>s
};

// `nout` outputs (1 <= nout <= nranks), or nranks when nout is 0.
inline OneshotArgs make_oneshot_args(const void* const* in, void* const* out, int nranks,
                                     int64_t count, int nout = 0) {
  if (nranks < 1 || nranks > kOneshotMaxRanks) {
    throw std::invalid_argument("ringreduce: the one-shot all-reduce takes 1 to " +
                                std::to_string(kOneshotMaxRanks) + " ranks, got nranks=" +
                                std::to_string(nranks));
  }
  if (nout == 0) nout = nranks;
  if (nout < 1 || nout > nranks) {
    throw std::invalid_argument("ringreduce: the one-shot kernel writes 1 to nranks=" +
                                std::to_string(nranks) + " outputs, got " +
                                std::to_string(nout));
  }
  OneshotArgs a{};
  for (int r = 0; r < nranks; ++r) {
    a.in[r] = in[r];
    if ((reinterpret_cast<uintptr_t>(in[r]) & 15) == 0) a.in_packed |= uint64_t(1) << r;
  }
  for (int r = 0; r < nout; ++r) {
    a.out[r] = out[r];
    if ((reinterpret_cast<uintptr_t>(out[r]) & 15) == 0) a.out_packed |= uint64_t(1) << r;
  }
  a.nranks = nranks;
  a.nout = nout;
  a.count = count;
  a.vec = (a.in_packed | a.out_packed) != 0;
  return a;
}

// Pack v of `base`: one 16-byte access where `packed`, lane by lane otherwise.
template <typename T>
RR_HD Pack<T> load_pack(const void* base, int64_t v, bool packed) {
  if (packed) return static_cast<const Pack<T>*>(base)[v];
  Pack<T> x;
  const T* e = static_cast<const T*>(base) + v * Pack<T>::kLanes;
  for (int l = 0; l < Pack<T>::kLanes; ++l) x.lane[l] = e[l];
  return x;
}

template <typename T>
RR_HD void store_pack(void* base, int64_t v, const Pack<T>& x, bool packed) {
  if (packed) {
    static_cast<Pack<T>*>(base)[v] = x;
    return;
  }
  T* e = static_cast<T*>(base) + v * Pack<T>::kLanes;
  for (int l = 0; l < Pack<T>::kLanes; ++l) e[l] = x.lane[l];
}

// reduce_in_ring_order for pack v, each rank's pack loaded as its alignment allows.
template <typename T, Op op>
RR_HD Pack<T> reduce_pack_in_ring_order(const OneshotArgs& a, int64_t v, int chunk) {
  Pack<T> acc = load_pack<T>(a.in[chunk], v, (a.in_packed >> chunk) & 1);
  int r = chunk;
  RR_ONESHOT_UNROLL
  for (int j = 1; j < a.nranks; ++j) {
    r = r + 1 == a.nranks ? 0 : r + 1;
    const Pack<T> x = load_pack<T>(a.in[r], v, (a.in_packed >> r) & 1);
    acc = ring_hop<T, op>(x, acc, j == a.nranks - 1, a.nranks);
  }
  return acc;
}

// What one CUDA thread does: packs (then the elements after the last whole pack) first,
// first + stride, ... For each index it reads all N inputs before writing any of the N
// outputs, and nothing else touches that index, so out[r] == in[r] (in place) is safe.
template <typename T, Op op>
RR_HD void oneshot_thread(const OneshotArgs& a, int64_t first, int64_t stride) {
  constexpr int64_t kLanes = Pack<T>::kLanes;
  const int64_t esize = int64_t(sizeof(T));
  int64_t head = 0;
  if (a.vec) {
    const int64_t npacks = a.count / kLanes;
    for (int64_t v = first; v < npacks; v += stride) {
      const int c = chunk_of(v * kLanes, a.count, a.nranks, esize);
      const Pack<T> x = reduce_pack_in_ring_order<T, op>(a, v, c);
      for (int r = 0; r < a.nranks; ++r) store_pack<T>(a.out[r], v, x, (a.out_packed >> r) & 1);
    }
    head = npacks * kLanes;
  }
  for (int64_t i = head + first; i < a.count; i += stride) {
    const int c = chunk_of(i, a.count, a.nranks, esize);
    const T x = reduce_in_ring_order<T, op>(a.in, i, a.nranks, c);
    for (int r = 0; r < a.nranks; ++r) static_cast<T*>(a.out[r])[i] = x;
  }
}

// The once-rounded one-shot (float16 / bfloat16 sum and avg, T = half_bits or bf16_bits):
// every element is summed in fp32 in rank order 0, 1, ..., N-1, starting from in[0]'s value
// itself (a sum of -0.0s stays -0.0), an average divided by N in fp32, and rounded to T once:
// the arithmetic of rr::cpu::sum_rounded_once (cpu_executor.cpp), so the CPU paths and this
// kernel give the same bits. Plain fp32 adds and one IEEE division (no fused operation can
// apply; nvcc divides to IEEE unless --use_fast_math or -prec-div=false, which the builds do not
// pass). One thread, as oneshot_thread: packs first, then the elements after the last pack;
// all N inputs of an index are read before any of its outputs, out[0..nout), is written (in
// place is safe).
template <typename T, Op op>
RR_HD T round_sum_once(float acc, int nranks) {
  if (op == Op::Avg) acc /= float(nranks);
  return store_acc<T>(acc);
}

template <typename T, Op op>
RR_HD void oneshot_once_thread(const OneshotArgs& a, int64_t first, int64_t stride) {
  constexpr int kLanes = Pack<T>::kLanes;
  int64_t head = 0;
  if (a.vec) {
    const int64_t npacks = a.count / kLanes;
    for (int64_t v = first; v < npacks; v += stride) {
      const Pack<T> x0 = load_pack<T>(a.in[0], v, a.in_packed & 1);
      float acc[kLanes];
      for (int l = 0; l < kLanes; ++l) acc[l] = to_float(x0.lane[l]);
      RR_ONESHOT_UNROLL
      for (int r = 1; r < a.nranks; ++r) {
        const Pack<T> x = load_pack<T>(a.in[r], v, (a.in_packed >> r) & 1);
        for (int l = 0; l < kLanes; ++l) acc[l] += to_float(x.lane[l]);
      }
      Pack<T> y;
      for (int l = 0; l < kLanes; ++l) y.lane[l] = round_sum_once<T, op>(acc[l], a.nranks);
      for (int r = 0; r < a.nout; ++r) store_pack<T>(a.out[r], v, y, (a.out_packed >> r) & 1);
    }
    head = npacks * kLanes;
  }
  for (int64_t i = head + first; i < a.count; i += stride) {
    float acc = to_float(static_cast<const T*>(a.in[0])[i]);
    RR_ONESHOT_UNROLL
    for (int r = 1; r < a.nranks; ++r) acc += to_float(static_cast<const T*>(a.in[r])[i]);
    const T y = round_sum_once<T, op>(acc, a.nranks);
    for (int r = 0; r < a.nout; ++r) static_cast<T*>(a.out[r])[i] = y;
  }
}

// Whether the once-rounded one-shot takes (dtype, op): float16 and bfloat16 sum and avg.
inline bool oneshot_rounds_once(DType dtype, Op op) {
  return (dtype == DType::F16 || dtype == DType::BF16) && (op == Op::Sum || op == Op::Avg);
}

namespace cpu {

// out[r] = the all-reduce of in[0..nranks), count elements each, bit for bit what all_reduce
// (the ring, cpu_executor.h) gives. out[r] == in[r] is in place; otherwise out[r] overlaps no
// in[] or out[] buffer. Any number of ranks.
void all_reduce_oneshot(const void* const* in, void* const* out, int nranks, int64_t count,
                        DType dtype, Op op);

}  // namespace cpu
}  // namespace rr
