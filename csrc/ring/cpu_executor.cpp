#include "cpu_executor.h"
#include "env.h"

// GCC 12's AVX-512 intrinsics start from _mm512_undefined_*(), which its -Wmaybe-uninitialized
// reports wherever they are inlined (GCC bug 105593, fixed in GCC 13): quiet for this header.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace rr {
namespace cpu {

namespace {

template <typename T, Op op>
void combine_typed(T* dst, const T* own, const T* src, int64_t n, bool last, int nranks) {
  using R = Reducer<T, op>;
  if (op == Op::Avg && last) {
    const typename R::D divisor = typename R::D(nranks);
    for (int64_t i = 0; i < n; ++i) dst[i] = R::last_step(own[i], src[i], divisor);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = R::step(own[i], src[i]);
  }
}

// Float sums (and averages) are most of the traffic: these loops are compiled for AVX-512, AVX2
// and the baseline, and the first call picks the widest the CPU has (__builtin_cpu_supports;
// not GCC's target_clones, whose ifunc resolvers run before ThreadSanitizer is initialised and
// crash tests/test_fused.py's TSan build), AVX-512 only for loops of at least
// avx512_min_bytes() (below). One IEEE add (then one division on an average's
// last hop) per element in any width, so every width gives the generic loop's bits.
// Each loop notes its width (simd_width_ran), written only when it changes: the ranks' threads
// share the variable, and the same width again costs them a load.
std::atomic<int> width_ran{-1};

inline void note_width(int width) {
  if (width_ran.load(std::memory_order_relaxed) != width) {
    width_ran.store(width, std::memory_order_relaxed);
  }
}

#define RR_ADD_LOOPS(SUFFIX, WIDTH, ATTR)                                                   \
  template <typename F>                                                                   \
  ATTR void add_##SUFFIX(F* dst, const F* own, const F* src, int64_t n) {                  \
    note_width(WIDTH);                                                                    \
    for (int64_t i = 0; i < n; ++i) dst[i] = own[i] + src[i];                              \
  }                                                                                       \
  template <typename F>                                                                   \
  ATTR void add_div_##SUFFIX(F* dst, const F* own, const F* src, int64_t n, F d) {         \
    note_width(WIDTH);                                                                    \
    for (int64_t i = 0; i < n; ++i) dst[i] = (own[i] + src[i]) / d;                        \
  }
RR_ADD_LOOPS(avx512, 2, __attribute__((target("avx512f"))))
RR_ADD_LOOPS(avx2, 1, __attribute__((target("avx2"))))
RR_ADD_LOOPS(base, 0, )
#undef RR_ADD_LOOPS

template <typename F>
struct AddLoops {
  void (*add)(F*, const F*, const F*, int64_t);
  void (*add_div)(F*, const F*, const F*, int64_t, F);
};

// 2: AVX-512, 1: AVX2, 0: baseline. The widest the CPU has, or narrower where
// RINGREDUCE_CPU_SIMD (avx512, avx2 or baseline; for tests and comparisons) asks for less.
int simd_width() {
  __builtin_cpu_init();
  int width = __builtin_cpu_supports("avx512f") ? 2 : __builtin_cpu_supports("avx2") ? 1 : 0;
  const char* want = std::getenv("RINGREDUCE_CPU_SIMD");
  if (want != nullptr && *want != '\0') {
    const std::string w(want);
    if (w != "avx512" && w != "avx2" && w != "baseline")
      throw std::invalid_argument("ringreduce: RINGREDUCE_CPU_SIMD must be avx512, avx2 or "
                                  "baseline; got '" + w + "'");
    width = std::min(width, w == "avx512" ? 2 : w == "avx2" ? 1 : 0);
  }
  return width;
}

// RINGREDUCE_CPU_AVX512_MIN_BYTES's default: float sum loops over fewer bytes than this run
// AVX2's loops even where the CPU has AVX-512. On an Intel Xeon (2-core VM), AVX-512 after a
// pause of a few ms slowed the next ~1 ms of calls (a 1 KiB all-reduce 6.5 instead of 5.2 us for
// its first 150-200 calls), where AVX2's ran at full speed from the first call and no slower at
// 1 KiB-64 KiB; from 256 KiB the two were within the runs' spread, and the large loops keep
// AVX-512 (docs/DESIGN.md, bench/RESULTS.md 2026-12-07).
constexpr int64_t kDefaultAvx512MinBytes = 256 << 10;

int64_t avx512_min_bytes() {
  return env_int("RINGREDUCE_CPU_AVX512_MIN_BYTES", kDefaultAvx512MinBytes, 0, int64_t(1) << 62,
                 "a number of bytes (the shortest float sum loop that runs AVX-512's loops; 0: "
                 "every loop)");
}

template <typename F>
AddLoops<F> loops_of_width(int width) {
  switch (width) {
    case 2: return AddLoops<F>{add_avx512<F>, add_div_avx512<F>};
    case 1: return AddLoops<F>{add_avx2<F>, add_div_avx2<F>};
    default: return AddLoops<F>{add_base<F>, add_div_base<F>};
  }
}

// A kind of loop in two widths: the widest allowed (simd_width) for loops of at least
// avx512_min_bytes(), at most AVX2 below. Each kind chooses once per process.
template <typename L>
struct WidthChoice {
  L narrow;
  L wide;
  int64_t wide_from;  // elements

  const L& of(int64_t n) const { return n >= wide_from ? wide : narrow; }
};

// of_width(width) gives the loops of a width (2, 1, 0) over elements of esize bytes.
template <typename L, typename OfWidth>
WidthChoice<L> choose_width(OfWidth of_width, int64_t esize) {
  const int width = simd_width();
  const int64_t min_bytes = avx512_min_bytes();
  return WidthChoice<L>{of_width(std::min(width, 1)), of_width(width),
                        (min_bytes + esize - 1) / esize};
}

template <typename F>
const AddLoops<F>& add_loops(int64_t n) {
  static const WidthChoice<AddLoops<F>> choice =
      choose_width<AddLoops<F>>(loops_of_width<F>, int64_t(sizeof(F)));
  return choice.of(n);
}

template <typename F>
void add_or_divide(bool divide, void* dst, const void* own, const void* src, int64_t n,
                   int nranks) {
  const AddLoops<F>& loops = add_loops<F>(n);
  auto* d = static_cast<F*>(dst);
  auto* a = static_cast<const F*>(own);
  auto* b = static_cast<const F*>(src);
  if (divide) loops.add_div(d, a, b, n, F(nranks)); else loops.add(d, a, b, n);
}

// True when the SIMD loops above handled it.
bool simd_combine(DType dtype, Op op, void* dst, const void* own, const void* src, int64_t n,
                  bool last, int nranks) {
  if (op != Op::Sum && op != Op::Avg) return false;
  const bool divide = op == Op::Avg && last;
  if (dtype == DType::F32) {
    add_or_divide<float>(divide, dst, own, src, n, nranks);
    return true;
  }
  if (dtype == DType::F64) {
    add_or_divide<double>(divide, dst, own, src, n, nranks);
    return true;
  }
  return false;
}

}  // namespace

namespace {
bool half_combine(DType dtype, Op op, void* dst, const void* own, const void* src, int64_t n,
                  bool last, int nranks);
}  // namespace

void combine(DType dtype, Op op, void* dst, const void* own, const void* src, int64_t n,
             bool last, int nranks) {
  if (simd_combine(dtype, op, dst, own, src, n, last, nranks)) return;
  if (half_combine(dtype, op, dst, own, src, n, last, nranks)) return;
  RR_DISPATCH(dtype, op,
              combine_typed<T, kOp>(static_cast<T*>(dst), static_cast<const T*>(own),
                                    static_cast<const T*>(src), n, last, nranks));
}

int simd_width_ran() { return width_ran.load(std::memory_order_relaxed); }

void combine(DType dtype, Op op, void* dst, const void* src, int64_t n, bool last, int nranks) {
  combine(dtype, op, dst, dst, src, n, last, nranks);
}

void run(const Plan& plan, DType dtype, Op op, int nranks) {
  const int64_t esize = elem_size(dtype);
  // Within a step the moves write disjoint memory that no other move of the step reads
  // (plan.h), so visiting them in any order is the same ring.
  for (const PlanStep& step : plan) {
    for (const Move& m : step.moves) {
      if (step.reduce) {
        combine(dtype, op, m.dst, m.own, m.src, m.n, step.last, nranks);
      } else {
        if (m.n > 0) std::memcpy(m.dst, m.src, size_t(m.n * esize));  // empty: may be null
      }
    }
  }
}

void all_reduce(void* const* bufs, int nranks, int64_t count, DType dtype, Op op) {
  run(all_reduce_plan(bufs, bufs, nranks, count, elem_size(dtype)), dtype, op, nranks);
}

HalfRounding half_rounding_setting() {
  const char* v = std::getenv("RINGREDUCE_HALF_ROUNDING");
  if (v == nullptr || *v == '\0') return HalfRounding::Once;
  const std::string s(v);
  if (s == "once") return HalfRounding::Once;
  if (s == "per_hop") return HalfRounding::PerHop;
  throw std::invalid_argument("ringreduce: RINGREDUCE_HALF_ROUNDING must be 'once' (float16 and "
                              "bfloat16 sums accumulated in fp32, rounded once) or 'per_hop' "
                              "(rounded on every ring hop); got '" + s + "'");
}

HalfRounding cuda_half_rounding_setting() {
  const char* v = std::getenv("RINGREDUCE_CUDA_HALF_ROUNDING");
  if (v == nullptr || *v == '\0') return HalfRounding::PerHop;
  const std::string s(v);
  if (s == "once") return HalfRounding::Once;
  if (s == "per_hop") return HalfRounding::PerHop;
  throw std::invalid_argument("ringreduce: RINGREDUCE_CUDA_HALF_ROUNDING must be 'per_hop' (the "
                              "default) or 'once'; got '" + s + "'");
}

namespace {

// Elements summed per pass of the baseline loop: the fp32 accumulators (4 KiB) stay in L1 while
// every source's piece is added into them. Also the list API's all-reduce block (below).
constexpr int64_t kOnceBlock = 1024;

// The baseline: auto-vectorised for the CPU the build targets, float16's conversions scalar.
template <typename T>
void sum_once_base(T* dst, const void* const* srcs, int nsrcs, int64_t n, bool divide,
                   float divisor) {
  note_width(0);
  float acc[kOnceBlock];
  for (int64_t i = 0; i < n; i += kOnceBlock) {
    const int64_t len = std::min(kOnceBlock, n - i);
    // Starting from srcs[0] itself (not 0.0f) keeps a sum of -0.0s at -0.0.
    const T* first = static_cast<const T*>(srcs[0]) + i;
    for (int64_t j = 0; j < len; ++j) acc[j] = to_float(first[j]);
    for (int q = 1; q < nsrcs; ++q) {
      const T* s = static_cast<const T*>(srcs[q]) + i;
      for (int64_t j = 0; j < len; ++j) acc[j] += to_float(s[j]);
    }
    if (divide) {
      for (int64_t j = 0; j < len; ++j) acc[j] /= divisor;
    }
    // Every source's elements of this block are read before any of dst's is written, so dst
    // may be one of the sources.
    for (int64_t j = 0; j < len; ++j) dst[i + j] = store_acc<T>(acc[j]);
  }
}

// Element i of the same sum, for the vector loops' tails: the same fp32 operations in the same
// order.
template <typename T>
inline T sum_once_at(const void* const* srcs, int nsrcs, int64_t i, bool divide, float divisor) {
  float acc = to_float(static_cast<const T*>(srcs[0])[i]);
  for (int q = 1; q < nsrcs; ++q) acc += to_float(static_cast<const T*>(srcs[q])[i]);
  if (divide) acc /= divisor;
  return store_acc<T>(acc);
}

// The vector loops: each vector of elements is loaded from every source and converted to fp32
// (exact), summed in rank order with IEEE adds (then one division on an average), and rounded
// once to nearest even, as sum_once_base does element by element: the same bits (NaN payloads
// aside: an add of two NaNs may keep either's). bfloat16 converts with integer operations (the bits of bf16_from_float; AVX512_BF16's
// conversion would flush subnormals), float16 with the F16C / AVX-512 conversions, which round
// to nearest even and overflow to infinity as half_from_float does. All of a vector's loads
// come before its store, so dst may be one of the sources.
//
// Every vector loop asks for its sources' lines kPrefetchElems ahead of its reads: the one-round
// path reads peers' slots just written on other cores, which the hardware's prefetch alone
// brings late (2 ranks, 32 KiB bfloat16 on the Intel Xeon VM: 20.6 to 16.4-16.9 us a call
// with 1 KiB ahead; 256 B-4 KiB ahead all helped, 1 KiB most). Never past the sources' end.
constexpr int64_t kPrefetchElems = 512;  // 1 KiB of 16-bit elements

inline void prefetch_ahead(const void* const* srcs, int nsrcs, int64_t i, int64_t n) {
  if (i + kPrefetchElems >= n) return;
  for (int q = 0; q < nsrcs; ++q) {
    _mm_prefetch(static_cast<const char*>(srcs[q]) + 2 * (i + kPrefetchElems), _MM_HINT_T0);
  }
}

#define RR_MM_PTR(TYPE, P) reinterpret_cast<TYPE*>(P)
#define RR_MM_CPTR(TYPE, P) reinterpret_cast<const TYPE*>(P)
#define RR_AVX512 __attribute__((target("avx512f")))
#define RR_AVX2 __attribute__((target("avx2,f16c")))

RR_AVX512 inline __m512 load16(const bf16_bits* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(RR_MM_CPTR(__m256i, p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
RR_AVX512 inline __m512 load16(const half_bits* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(RR_MM_CPTR(__m256i, p)));
}
RR_AVX512 inline void store16(bf16_bits* p, __m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  _mm256_storeu_si256(RR_MM_PTR(__m256i, p),
                      _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet)));
}
RR_AVX512 inline void store16(half_bits* p, __m512 v) {
  _mm256_storeu_si256(RR_MM_PTR(__m256i, p),
                      _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

template <typename T>
RR_AVX512 void sum_once_avx512(T* dst, const void* const* srcs, int nsrcs, int64_t n, bool divide,
                               float divisor) {
  note_width(2);
  const __m512 by = _mm512_set1_ps(divisor);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    prefetch_ahead(srcs, nsrcs, i, n);
    __m512 acc = load16(static_cast<const T*>(srcs[0]) + i);
    for (int q = 1; q < nsrcs; ++q) {
      acc = _mm512_add_ps(acc, load16(static_cast<const T*>(srcs[q]) + i));
    }
    if (divide) acc = _mm512_div_ps(acc, by);
    store16(dst + i, acc);
  }
  for (; i < n; ++i) dst[i] = sum_once_at<T>(srcs, nsrcs, i, divide, divisor);
}

RR_AVX2 inline __m256 load8(const half_bits* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(RR_MM_CPTR(__m128i, p)));
}
RR_AVX2 inline void store8(half_bits* p, __m256 v) {
  _mm_storeu_si128(RR_MM_PTR(__m128i, p),
                   _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// float16, 16 elements (two vectors) an iteration (bfloat16: sum_once_avx2_bf16 below).
template <typename T>
RR_AVX2 void sum_once_avx2(T* dst, const void* const* srcs, int nsrcs, int64_t n, bool divide,
                           float divisor) {
  note_width(1);
  const __m256 by = _mm256_set1_ps(divisor);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    prefetch_ahead(srcs, nsrcs, i, n);
    const T* first = static_cast<const T*>(srcs[0]) + i;
    __m256 lo = load8(first);
    __m256 hi = load8(first + 8);
    for (int q = 1; q < nsrcs; ++q) {
      const T* src = static_cast<const T*>(srcs[q]) + i;
      lo = _mm256_add_ps(lo, load8(src));
      hi = _mm256_add_ps(hi, load8(src + 8));
    }
    if (divide) {
      lo = _mm256_div_ps(lo, by);
      hi = _mm256_div_ps(hi, by);
    }
    store8(dst + i, lo);
    store8(dst + i + 8, hi);
  }
  for (; i < n; ++i) dst[i] = sum_once_at<T>(srcs, nsrcs, i, divide, divisor);
}

// bfloat16, 16 elements an iteration: zeros interleaved below each element (unpack) make its
// fp32 bits at once, in the order [0-3, 8-11] and [4-7, 12-15]; the pack of the rounded
// results undoes that order lane by lane.
RR_AVX2 inline void load16(const bf16_bits* p, __m256* lo, __m256* hi) {
  const __m256i x = _mm256_loadu_si256(RR_MM_CPTR(__m256i, p));
  *lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), x));
  *hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), x));
}
// The bfloat16 bits of v in the low half of each 32-bit lane (bf16_from_float).
RR_AVX2 inline __m256i round_bf16(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i top = _mm256_srli_epi32(u, 16);
  const __m256i lsb = _mm256_and_si256(top, _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_or_si256(top, _mm256_set1_epi32(0x40)), nan);
}
RR_AVX2 inline void store16(bf16_bits* p, __m256 lo, __m256 hi) {
  // Every lane holds 16 bits, so the unsigned saturation of the pack changes nothing.
  _mm256_storeu_si256(RR_MM_PTR(__m256i, p), _mm256_packus_epi32(round_bf16(lo), round_bf16(hi)));
}

RR_AVX2 void sum_once_avx2_bf16(bf16_bits* dst, const void* const* srcs, int nsrcs, int64_t n,
                                bool divide, float divisor) {
  note_width(1);
  const __m256 by = _mm256_set1_ps(divisor);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    prefetch_ahead(srcs, nsrcs, i, n);
    __m256 lo, hi;
    load16(static_cast<const bf16_bits*>(srcs[0]) + i, &lo, &hi);
    for (int q = 1; q < nsrcs; ++q) {
      __m256 lo_q, hi_q;
      load16(static_cast<const bf16_bits*>(srcs[q]) + i, &lo_q, &hi_q);
      lo = _mm256_add_ps(lo, lo_q);
      hi = _mm256_add_ps(hi, hi_q);
    }
    if (divide) {
      lo = _mm256_div_ps(lo, by);
      hi = _mm256_div_ps(hi, by);
    }
    store16(dst + i, lo, hi);
  }
  for (; i < n; ++i) dst[i] = sum_once_at<bf16_bits>(srcs, nsrcs, i, divide, divisor);
}

#undef RR_AVX2
#undef RR_AVX512
#undef RR_MM_CPTR
#undef RR_MM_PTR

template <typename T>
using OnceLoop = void (*)(T*, const void* const*, int, int64_t, bool, float);

// The once-rounded loops of a width. float16's AVX2 loop needs F16C too; without it float16
// takes the baseline below AVX-512.
template <typename T>
OnceLoop<T> once_loop_of_width(int width) {
  if (width >= 2) return sum_once_avx512<T>;
  if (width == 1 && __builtin_cpu_supports("f16c")) return sum_once_avx2<T>;
  return sum_once_base<T>;
}

template <>
OnceLoop<bf16_bits> once_loop_of_width<bf16_bits>(int width) {
  if (width >= 2) return sum_once_avx512<bf16_bits>;
  if (width == 1) return sum_once_avx2_bf16;
  return sum_once_base<bf16_bits>;
}

// The once-rounded loop for n elements, chosen as add_loops chooses the float ones.
template <typename T>
OnceLoop<T> once_loop(int64_t n) {
  static const WidthChoice<OnceLoop<T>> choice =
      choose_width<OnceLoop<T>>(once_loop_of_width<T>, int64_t(sizeof(T)));
  return choice.of(n);
}

// One per-hop hop of a float16 / bfloat16 sum (RINGREDUCE_HALF_ROUNDING=per_hop): dst =
// round(own + src), on an average's last hop round((own + src) / nranks), Reducer's arithmetic,
// in the vector loops where the CPU has them; the baseline keeps combine_typed.
template <typename T>
bool half_combine_typed(bool divide, void* dst, const void* own, const void* src, int64_t n,
                        int nranks) {
  const OnceLoop<T> loop = once_loop<T>(n);
  if (loop == sum_once_base<T>) {
    note_width(0);
    return false;
  }
  const void* const srcs[2] = {own, src};
  loop(static_cast<T*>(dst), srcs, 2, n, divide, float(nranks));
  return true;
}

bool half_combine(DType dtype, Op op, void* dst, const void* own, const void* src, int64_t n,
                  bool last, int nranks) {
  if (op != Op::Sum && op != Op::Avg) return false;
  const bool divide = op == Op::Avg && last;
  if (dtype == DType::BF16) return half_combine_typed<bf16_bits>(divide, dst, own, src, n, nranks);
  if (dtype == DType::F16) return half_combine_typed<half_bits>(divide, dst, own, src, n, nranks);
  return false;
}

void check_once(DType dtype, Op op, int nsrcs) {
  if (nsrcs < 1 || (op != Op::Sum && op != Op::Avg))
    throw std::logic_error("ringreduce internal error: sum_rounded_once takes sum or avg of at "
                           "least one source; got " + std::to_string(nsrcs) + " and op " +
                           op_name(op));
  if (dtype != DType::BF16 && dtype != DType::F16)
    throw std::logic_error(std::string("ringreduce internal error: sum_rounded_once on ") +
                           dtype_name(dtype) + " (only float16 and bfloat16 round once)");
}

template <typename T>
void all_reduce_once_typed(const void* const* in, void* const* out, int nranks, int64_t count,
                           bool avg) {
  const OnceLoop<T> loop = once_loop<T>(count);
  std::vector<const void*> srcs(static_cast<size_t>(nranks));
  // Block by block: the sum goes to out[0], then is copied to every other output. out[r] may
  // be in[r], which this block has finished reading by then; later blocks are untouched.
  for (int64_t i = 0; i < count; i += kOnceBlock) {
    const int64_t len = std::min(kOnceBlock, count - i);
    for (int r = 0; r < nranks; ++r) srcs[size_t(r)] = static_cast<const T*>(in[r]) + i;
    T* first = static_cast<T*>(out[0]) + i;
    loop(first, srcs.data(), nranks, len, avg, float(nranks));
    for (int r = 1; r < nranks; ++r) {
      std::memcpy(static_cast<T*>(out[r]) + i, first, size_t(len) * sizeof(T));
    }
  }
}

}  // namespace

void sum_rounded_once(DType dtype, Op op, void* dst, const void* const* srcs, int nsrcs,
                      int64_t n) {
  check_once(dtype, op, nsrcs);
  if (n <= 0) return;
  const bool avg = op == Op::Avg;
  if (dtype == DType::BF16) {
    once_loop<bf16_bits>(n)(static_cast<bf16_bits*>(dst), srcs, nsrcs, n, avg, float(nsrcs));
  } else {
    once_loop<half_bits>(n)(static_cast<half_bits*>(dst), srcs, nsrcs, n, avg, float(nsrcs));
  }
}

void all_reduce_once(const void* const* in, void* const* out, int nranks, int64_t count,
                     DType dtype, Op op) {
  check_once(dtype, op, nranks);
  if (count <= 0) return;
  if (dtype == DType::BF16) {
    all_reduce_once_typed<bf16_bits>(in, out, nranks, count, op == Op::Avg);
  } else {
    all_reduce_once_typed<half_bits>(in, out, nranks, count, op == Op::Avg);
  }
}

void reduce_scatter_once(const void* const* in, void* const* out, int nranks, int64_t count,
                         DType dtype, Op op) {
  const int64_t esize = elem_size(dtype);
  std::vector<const void*> srcs(static_cast<size_t>(nranks));
  for (int b = 0; b < nranks; ++b) {
    for (int q = 0; q < nranks; ++q) {
      srcs[size_t(q)] = static_cast<const char*>(in[q]) + int64_t(b) * count * esize;
    }
    // out[b] may be block b of in[b]: the same elements, which sum_rounded_once allows.
    sum_rounded_once(dtype, op, out[b], srcs.data(), nranks, count);
  }
}

}  // namespace cpu
}  // namespace rr
