#include "cpu_executor.h"

#include <cstring>

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

// Float sums (and averages) are most of the traffic: these loops are compiled for AVX-512,
// AVX2 and the baseline, and the loader picks the widest the CPU has (GCC's target_clones). One
// IEEE add (then one division on an average's last hop) per element in any width, so every
// clone gives the generic loop's bits.
#define RR_SIMD_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

RR_SIMD_CLONES void add_f32(float* dst, const float* own, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = own[i] + src[i];
}
RR_SIMD_CLONES void add_div_f32(float* dst, const float* own, const float* src, int64_t n,
                                float d) {
  for (int64_t i = 0; i < n; ++i) dst[i] = (own[i] + src[i]) / d;
}
RR_SIMD_CLONES void add_f64(double* dst, const double* own, const double* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = own[i] + src[i];
}
RR_SIMD_CLONES void add_div_f64(double* dst, const double* own, const double* src, int64_t n,
                                double d) {
  for (int64_t i = 0; i < n; ++i) dst[i] = (own[i] + src[i]) / d;
}

template <typename F>
void add_or_divide(void (*add)(F*, const F*, const F*, int64_t),
                   void (*add_div)(F*, const F*, const F*, int64_t, F), bool divide, void* dst,
                   const void* own, const void* src, int64_t n, int nranks) {
  auto* d = static_cast<F*>(dst);
  auto* a = static_cast<const F*>(own);
  auto* b = static_cast<const F*>(src);
  if (divide) add_div(d, a, b, n, F(nranks)); else add(d, a, b, n);
}

// True when the SIMD loops above handled it.
bool simd_combine(DType dtype, Op op, void* dst, const void* own, const void* src, int64_t n,
                  bool last, int nranks) {
  if (op != Op::Sum && op != Op::Avg) return false;
  const bool divide = op == Op::Avg && last;
  if (dtype == DType::F32) {
    add_or_divide<float>(add_f32, add_div_f32, divide, dst, own, src, n, nranks);
    return true;
  }
  if (dtype == DType::F64) {
    add_or_divide<double>(add_f64, add_div_f64, divide, dst, own, src, n, nranks);
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
        std::memcpy(m.dst, m.src, size_t(m.n * esize));
      }
    }
  }
}

void all_reduce(void* const* bufs, int nranks, int64_t count, DType dtype, Op op) {
  run(all_reduce_plan(bufs, bufs, nranks, count, elem_size(dtype)), dtype, op, nranks);
}

}  // namespace cpu
}  // namespace rr
