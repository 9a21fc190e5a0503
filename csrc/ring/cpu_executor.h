// CPU executor: the ring schedule of schedule.h run on host memory. Torch-free.
#pragma once

#include <cstdint>

#include "plan.h"
#include "types.h"

namespace rr {
namespace cpu {

// One reduce-scatter hop on n elements: dst[i] = combine(own[i], src[i]); when `last` is set
// and op is Avg, the result is divided by `nranks` before rounding to the storage type.
// dst may be own or src (element by element, in place).
void combine(DType dtype, Op op, void* dst, const void* own, const void* src, int64_t n,
             bool last, int nranks);

// The in-place hop: dst[i] = combine(dst[i], src[i]).
void combine(DType dtype, Op op, void* dst, const void* src, int64_t n, bool last, int nranks);

// The width of the float sum loops (combine's SIMD path) that ran last in this process: 2 AVX-512,
// 1 AVX2, 0 the baseline, -1 none yet. Set by the loops themselves, so it says which loops ran,
// not which were asked for (tests/test_all_reduce.py checks it against RINGREDUCE_CPU_SIMD).
int simd_width_ran();

// Runs a plan (plan.h) over host buffers, one step at a time across all ranks.
void run(const Plan& plan, DType dtype, Op op, int nranks);

// All-reduce `count` elements of `nranks` distinct host buffers in place. Every buffer ends up
// bitwise identical.
void all_reduce(void* const* bufs, int nranks, int64_t count, DType dtype, Op op);

}  // namespace cpu
}  // namespace rr
