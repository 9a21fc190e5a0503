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

// The width of the float sum loops (combine's SIMD path, and sum_rounded_once's for float16 and
// bfloat16) that ran last in this process: 2 AVX-512, 1 AVX2, 0 the baseline, -1 none yet. Set
// by the loops themselves, so it says which loops ran, not which were asked for
// (tests/test_all_reduce.py and test_half_simd.py check it against RINGREDUCE_CPU_SIMD).
int simd_width_ran();

// Runs a plan (plan.h) over host buffers, one step at a time across all ranks.
void run(const Plan& plan, DType dtype, Op op, int nranks);

// All-reduce `count` elements of `nranks` distinct host buffers in place. Every buffer ends up
// bitwise identical.
void all_reduce(void* const* bufs, int nranks, int64_t count, DType dtype, Op op);

// How float16 and bfloat16 sums and averages are rounded on the CPU paths.
//   Once: every element is summed in fp32 in rank order 0, 1, ..., N-1 (acc = in[0];
//     acc += in[1]; ...; acc += in[N-1]; avg: acc /= N) and rounded to the 16-bit type once,
//     at the end: the same bits on every rank, at every size, from call to call.
//   PerHop: the ring's arithmetic, rounded to the 16-bit type on every reduce-scatter hop
//     (N-1 roundings, NCCL's classic ring; what the CUDA paths still do).
enum class HalfRounding : int { Once = 0, PerHop = 1 };

// RINGREDUCE_HALF_ROUNDING: "once" (default, also when unset or blank) or "per_hop"; anything
// else throws std::invalid_argument naming the variable.
HalfRounding half_rounding_setting();

// RINGREDUCE_CUDA_HALF_ROUNDING: "per_hop" (default, also when unset or blank) or "once": how
// the CUDA paths round float16 and bfloat16 sums (once: the bits of the CPU's Once); anything
// else throws std::invalid_argument naming the variable.
HalfRounding cuda_half_rounding_setting();

inline const char* half_rounding_name(HalfRounding h) {
  return h == HalfRounding::Once ? "once" : "per_hop";
}

// Whether (dtype, op) takes the once-rounded sum under `h`: float16 and bfloat16 sum and avg.
inline bool rounds_once(DType dtype, Op op, HalfRounding h) {
  return h == HalfRounding::Once && (dtype == DType::F16 || dtype == DType::BF16) &&
         (op == Op::Sum || op == Op::Avg);
}

// dst[i] = the once-rounded sum (avg: divided by nsrcs) of srcs[0][i], ..., srcs[nsrcs-1][i],
// accumulated in fp32 in that order, for n elements of a 16-bit float type (rounds_once).
// dst may be one of the srcs (the same elements, in place); otherwise it overlaps none.
void sum_rounded_once(DType dtype, Op op, void* dst, const void* const* srcs, int nsrcs,
                      int64_t n);

// The list API's collectives with the once-rounded sum (rounds_once), in the aliasing each
// plan of plan.h allows, nranks >= 2 and count >= 1:
// out[r] = the sum of in[0..nranks) for every r (out[r] may be in[r]);
void all_reduce_once(const void* const* in, void* const* out, int nranks, int64_t count,
                     DType dtype, Op op);
// out[r] = the sum of block r (count elements) of every in[] (nranks * count each); out[r] may
// be block r of in[r].
void reduce_scatter_once(const void* const* in, void* const* out, int nranks, int64_t count,
                         DType dtype, Op op);

}  // namespace cpu
}  // namespace rr
