#include "cpu_executor.h"
#include "env.h"

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

// The loops for n elements: the widest allowed from avx512_min_bytes() up, at most AVX2 below.
template <typename F>
struct WidthChoice {
  AddLoops<F> narrow;
  AddLoops<F> wide;
  int64_t wide_from;  // elements
};

template <typename F>
const AddLoops<F>& add_loops(int64_t n) {
  static const WidthChoice<F> choice = [] {
    const int width = simd_width();
    const int64_t min_bytes = avx512_min_bytes();
    return WidthChoice<F>{loops_of_width<F>(std::min(width, 1)), loops_of_width<F>(width),
                          (min_bytes + int64_t(sizeof(F)) - 1) / int64_t(sizeof(F))};
  }();
  return n >= choice.wide_from ? choice.wide : choice.narrow;
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

void combine(DType dtype, Op op, void* dst, const void* own, const void* src, int64_t n,
             bool last, int nranks) {
  if (simd_combine(dtype, op, dst, own, src, n, last, nranks)) return;
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

// Elements summed per pass: the fp32 accumulators (4 KiB) stay in L1 while every source's
// piece is added into them.
constexpr int64_t kOnceBlock = 1024;

template <typename T>
void sum_rounded_once_typed(T* dst, const void* const* srcs, int nsrcs, int64_t n, bool avg) {
  float acc[kOnceBlock];
  const float divisor = float(nsrcs);
  for (int64_t i = 0; i < n; i += kOnceBlock) {
    const int64_t len = std::min(kOnceBlock, n - i);
    // Starting from srcs[0] itself (not 0.0f) keeps a sum of -0.0s at -0.0.
    const T* first = static_cast<const T*>(srcs[0]) + i;
    for (int64_t j = 0; j < len; ++j) acc[j] = to_float(first[j]);
    for (int q = 1; q < nsrcs; ++q) {
      const T* s = static_cast<const T*>(srcs[q]) + i;
      for (int64_t j = 0; j < len; ++j) acc[j] += to_float(s[j]);
    }
    if (avg) {
      for (int64_t j = 0; j < len; ++j) acc[j] /= divisor;
    }
    // Every source's elements of this block are read before any of dst's is written, so dst
    // may be one of the sources.
    for (int64_t j = 0; j < len; ++j) dst[i + j] = store_acc<T>(acc[j]);
  }
}

}  // namespace

void sum_rounded_once(DType dtype, Op op, void* dst, const void* const* srcs, int nsrcs,
                      int64_t n) {
  if (nsrcs < 1 || (op != Op::Sum && op != Op::Avg))
    throw std::logic_error("ringreduce internal error: sum_rounded_once takes sum or avg of at "
                           "least one source; got " + std::to_string(nsrcs) + " and op " +
                           op_name(op));
  if (n <= 0) return;
  if (dtype == DType::BF16) {
    sum_rounded_once_typed(static_cast<bf16_bits*>(dst), srcs, nsrcs, n, op == Op::Avg);
  } else if (dtype == DType::F16) {
    sum_rounded_once_typed(static_cast<half_bits*>(dst), srcs, nsrcs, n, op == Op::Avg);
  } else {
    throw std::logic_error(std::string("ringreduce internal error: sum_rounded_once on ") +
                           dtype_name(dtype) + " (only float16 and bfloat16 round once)");
  }
}

void all_reduce_once(const void* const* in, void* const* out, int nranks, int64_t count,
                     DType dtype, Op op) {
  const int64_t esize = elem_size(dtype);
  std::vector<const void*> srcs(static_cast<size_t>(nranks));
  // Block by block: the sum goes to out[0], then is copied to every other output. out[r] may
  // be in[r], which this block has finished reading by then; later blocks are untouched.
  for (int64_t i = 0; i < count; i += kOnceBlock) {
    const int64_t len = std::min(kOnceBlock, count - i);
    for (int r = 0; r < nranks; ++r) srcs[size_t(r)] = static_cast<const char*>(in[r]) + i * esize;
    char* first = static_cast<char*>(out[0]) + i * esize;
    sum_rounded_once(dtype, op, first, srcs.data(), nranks, len);
    for (int r = 1; r < nranks; ++r) {
      std::memcpy(static_cast<char*>(out[r]) + i * esize, first, size_t(len * esize));
    }
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
