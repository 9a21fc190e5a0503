// Multi-process collectives on host memory: every process runs its own rank of the ring
// schedule (csrc/ring/schedule.h) over the shared-memory staging areas of a HostGroup.
// Torch-free. Each call is collective: every rank of the group makes the same calls in the
// same order with the same sizes, dtype, op and root; a disagreement raises CommError.
//
// Tensors larger than the staging area go in rounds. An all-reduce round carries one piece of
// every ring chunk, so every element stays in the chunk the whole-tensor schedule puts it in
// and is reduced in the same order: the result is bitwise the single-process core's.
//
// All-reduces of at most HostGroup::small_bytes() bytes (RINGREDUCE_SMALL_BYTES) skip the ring:
// one round through two per-rank slots, every rank reducing all inputs in the ring's order, so
// the bits are the ring's at every size (cpu_collectives.cpp, small_all_reduce).
//
// Where every rank's waits sleep (more ranks than cores; HostGroup::two_shot), all-reduces of
// RINGREDUCE_TWO_SHOT_MIN_BYTES to RINGREDUCE_TWO_SHOT_MAX_BYTES (512 KiB-2 MiB) take a two-shot
// path: 3 hand-offs a round instead of 2N - 1, each element reduced in its ring chunk's order,
// so the bits are still the ring's.
//
// float16 and bfloat16 sums and averages (HostGroup::half_once, RINGREDUCE_HALF_ROUNDING=once,
// the default) are summed in fp32 in rank order 0, 1, ..., N-1 and rounded once instead
// (ring/cpu_executor.h, sum_rounded_once): all_reduce through the small slots or a two-shot
// reduce-scatter + all-gather, reduce_scatter in its own fixed order. The same bits on every
// rank, at every size, and the list API's.
#pragma once

#include <cstdint>

#include "../ring/types.h"
#include "host_group.h"

namespace rr {
namespace dist {
namespace cpu {

// The path an all_reduce of `count` elements takes in group `g` (the same on every rank):
// the one-round small path, the two-shot reduce-scatter + all-gather, or the ring.
enum class AllReducePath { Small, TwoShot, Ring };
AllReducePath all_reduce_path(const HostGroup& g, int64_t count, DType dtype, Op op);
const char* path_name(AllReducePath p);  // "small", "two_shot", "ring"

// In place: every rank's `data` ends up holding the reduction of all ranks' `count` elements.
void all_reduce(HostGroup& g, void* data, int64_t count, DType dtype, Op op);

// `bytes` bytes of rank `root`'s `data` are copied into every other rank's `data`.
void broadcast(HostGroup& g, void* data, int64_t bytes, int root);

// outs[r] (one pointer per rank) receives rank r's `bytes` bytes of `in`.
void all_gather(HostGroup& g, const void* in, void* const* outs, int64_t bytes);

// `in` holds nranks segments of `count` elements; rank r's `out` receives the reduction over
// ranks of segment r, reduced in rank order 0, 1, ..., N-1 on every rank (16-bit float sums
// and averages in fp32, rounded once, unless per_hop).
void reduce_scatter(HostGroup& g, const void* in, void* out, int64_t count, DType dtype, Op op);

void barrier(HostGroup& g);

// Rank `root`'s outs[r] (one pointer per rank; ignored elsewhere) receives rank r's `bytes`
// bytes of `in`.
void gather(HostGroup& g, const void* in, void* const* outs, int64_t bytes, int root);

// Every rank r's `out` receives `bytes` bytes of rank `root`'s ins[r] (ignored elsewhere).
void scatter(HostGroup& g, const void* const* ins, void* out, int64_t bytes, int root);

// ins[q] (in_bytes[q] bytes) goes to rank q, and outs[p] (out_bytes[p] bytes) receives what
// rank p sends to this rank. Sizes may differ from pair to pair; every pair must agree on its
// size (rank p's in_bytes[r] == rank r's out_bytes[p]), or every rank involved raises.
void all_to_all(HostGroup& g, const void* const* ins, const int64_t* in_bytes,
                void* const* outs, const int64_t* out_bytes);

}  // namespace cpu
}  // namespace dist
}  // namespace rr
