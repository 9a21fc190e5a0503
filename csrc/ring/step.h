// What one CUDA thread of a ring step does (cuda_kernels.cu's step kernel), as host and device
// code, so that tests/test_step_kernel.py runs it on the CPU for every thread of a simulated
// grid. Torch-free.
#pragma once

#include <cstdint>

#include "types.h"

namespace rr {

// One piece of a ring step: dst = combine(own, src) or dst = src for n elements. `own` left
// null means dst itself (in place).
struct Task {
  void* dst;
  const void* src;
  int64_t n;
  const void* own = nullptr;
};

template <typename T, Op op, bool kReduce, bool kLast>
RR_HD T step_apply(T mine, T incoming, int nranks) {
  if (!kReduce) return incoming;
  if (kLast) return Reducer<T, op>::last_step(mine, incoming, typename Reducer<T, op>::D(nranks));
  return Reducer<T, op>::step(mine, incoming);
}

// The thread numbered `first` of `stride` threads: 16-byte packs first, second, ... when dst,
// own and src are all 16-byte aligned (chunk offsets always are, so this depends only on the
// tensors' own alignment), then the elements after the last pack; element by element from the
// start otherwise. Each element is read (own, src) and written (dst) by one thread only, so
// dst == own (in place) is safe.
//
// kUnroll > 1 (RINGREDUCE_CUDA_STEP_UNROLL, cuda_kernels.cu): a thread loads kUnroll packs of
// src (and own) - first, first + stride, ... - before it combines and stores any, so kUnroll
// loads per thread are in flight at once instead of one; the packs left over go one at a time.
// Each pack is still read and written by its one thread, loads before stores: the same bytes.
// src never overlaps dst or own (it is another rank's buffer or a staging area); dst and own
// may be the same buffer, so only src is restrict-qualified.
template <typename T, Op op, bool kReduce, bool kLast, int kUnroll = 1>
RR_HD void step_thread(const Task& task, int nranks, int64_t first, int64_t stride) {
  static_assert(kUnroll >= 1 && kUnroll <= 8, "1 to 8 packs in flight");
  T* dst = static_cast<T*>(task.dst);
  const T* own = task.own != nullptr ? static_cast<const T*>(task.own) : dst;
  const T* __restrict__ src = static_cast<const T*>(task.src);
  const int64_t n = task.n;
  constexpr int kLanes = Pack<T>::kLanes;
  int64_t head = 0;
  if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(own) |
        reinterpret_cast<uintptr_t>(src)) & 15) == 0) {
    const int64_t npacks = n / kLanes;
    Pack<T>* dp = reinterpret_cast<Pack<T>*>(dst);
    const Pack<T>* op_ = reinterpret_cast<const Pack<T>*>(own);
    const Pack<T>* __restrict__ sp = reinterpret_cast<const Pack<T>*>(src);
    int64_t v = first;
    if (kUnroll > 1) {
      for (; v + (kUnroll - 1) * stride < npacks; v += kUnroll * stride) {
        Pack<T> x[kUnroll];
        Pack<T> mine[kUnroll];
        for (int u = 0; u < kUnroll; ++u) x[u] = sp[v + u * stride];
        if (kReduce) {
          for (int u = 0; u < kUnroll; ++u) mine[u] = op_[v + u * stride];
          for (int u = 0; u < kUnroll; ++u) {
            for (int l = 0; l < kLanes; ++l) {
              x[u].lane[l] =
                  step_apply<T, op, kReduce, kLast>(mine[u].lane[l], x[u].lane[l], nranks);
            }
          }
        }
        for (int u = 0; u < kUnroll; ++u) dp[v + u * stride] = x[u];
      }
    }
    for (; v < npacks; v += stride) {
      Pack<T> x = sp[v];
      if (kReduce) {
        const Pack<T> mine = op_[v];
        for (int l = 0; l < kLanes; ++l) {
          x.lane[l] = step_apply<T, op, kReduce, kLast>(mine.lane[l], x.lane[l], nranks);
        }
      }
      dp[v] = x;
    }
    head = npacks * kLanes;
  }
  for (int64_t i = head + first; i < n; i += stride) {
    dst[i] = step_apply<T, op, kReduce, kLast>(own[i], src[i], nranks);
  }
}

}  // namespace rr
