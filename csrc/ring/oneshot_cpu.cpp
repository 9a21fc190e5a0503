#include "oneshot.h"

namespace rr {
namespace cpu {

namespace {

template <typename T, Op op>
void all_reduce_oneshot_typed(const void* const* in, void* const* out, int nranks,
                              int64_t count) {
  for (int c = 0; c < nranks; ++c) {
    const Range chunk = chunk_range(count, nranks, int64_t(sizeof(T)), c);
    for (int64_t i = chunk.offset; i < chunk.offset + chunk.count; ++i) {
      const T x = reduce_in_ring_order<T, op>(in, i, nranks, c);
      for (int r = 0; r < nranks; ++r) static_cast<T*>(out[r])[i] = x;
    }
  }
}

}  // namespace

void all_reduce_oneshot(const void* const* in, void* const* out, int nranks, int64_t count,
                        DType dtype, Op op) {
  RR_DISPATCH(dtype, op, all_reduce_oneshot_typed<T, kOp>(in, out, nranks, count));
}

}  // namespace cpu
}  // namespace rr
