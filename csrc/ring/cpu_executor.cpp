#include "cpu_executor.h"

#include <cstring>

#include "schedule.h"

namespace rr {
namespace cpu {

namespace {

template <typename T, Op op>
void combine_typed(T* dst, const T* src, int64_t n, bool last, int nranks) {
  using R = Reducer<T, op>;
  if (op == Op::Avg && last) {
    const typename R::A divisor = typename R::A(nranks);
    for (int64_t i = 0; i < n; ++i) dst[i] = R::last_step(dst[i], src[i], divisor);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = R::step(dst[i], src[i]);
  }
}

}  // namespace

void combine(DType dtype, Op op, void* dst, const void* src, int64_t n, bool last, int nranks) {
  RR_DISPATCH(dtype, op,
              combine_typed<T, kOp>(static_cast<T*>(dst), static_cast<const T*>(src), n, last,
                                    nranks));
}

void all_reduce(void* const* bufs, int nranks, int64_t count, DType dtype, Op op) {
  const int64_t esize = elem_size(dtype);
  const int64_t steps = num_steps(nranks);
  for (int64_t k = 0; k < steps; ++k) {
    // Within a step the ranks touch disjoint chunks of their own buffers and read only what
    // their predecessor wrote at step k-1, so visiting them in any order is the same ring.
    for (int r = 0; r < nranks; ++r) {
      const Step s = ring_step(r, nranks, k);
      const Range c = chunk_range(count, nranks, esize, s.chunk);
      if (c.count == 0) continue;
      char* dst = static_cast<char*>(bufs[r]) + c.offset * esize;
      const char* src = static_cast<const char*>(bufs[s.src_rank]) + c.offset * esize;
      if (s.reduce) {
        combine(dtype, op, dst, src, c.count, s.last_reduce, nranks);
      } else {
        std::memcpy(dst, src, size_t(c.count * esize));
      }
    }
  }
}

}  // namespace cpu
}  // namespace rr
