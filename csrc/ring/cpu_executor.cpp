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

}  // namespace

void combine(DType dtype, Op op, void* dst, const void* own, const void* src, int64_t n,
             bool last, int nranks) {
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
