// Launch geometry of the CUDA kernels (block sizes, grid sizes, the fused kernel's blocks per
// rank and flag buffer, staging slots) as plain host functions of the device's capacity.
// Torch-free and CUDA-free: the launchers (cuda_kernels.cu, oneshot_kernel.cu,
// fused_kernel.cu, cuda_executor.cu) and the bindings call them with what they ask the device
// (resident blocks: SMs x the occupancy calculation), and the host compiler builds them too, so
// tests/test_launch_geometry.py checks them on a CPU for the capacities of real GPUs. Host code
// that only nvcc compiled is how a flag buffer too small for the suggested block count went
// unseen (issue 21).
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "fused.h"
#include "schedule.h"

namespace rr {

// Threads a block of each kernel (also their __launch_bounds__). Set on paper, not measured.
constexpr int kStepThreads = 512;
constexpr int kOneshotThreads = 256;
constexpr int kFusedThreads = 512;

// Staging slots (cuda_executor.cu) start at multiples of this many bytes, so a slot's data is as
// aligned as the kernels' 16-byte packs need (step.h takes packs only when dst, own and src all
// are): a stride of the largest hop's bytes (132 for a reduce_scatter of 33 floats) would put
// every slot after the first off the pack path.
constexpr int64_t kStageSlotAlign = 16;

inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

// Bytes between consecutive staging slots for combine hops of up to `max_hop_bytes`.
inline int64_t stage_slot_stride(int64_t max_hop_bytes) {
  return round_up(max_hop_bytes, kStageSlotAlign);
}

// grid.x of one ring-step launch (grid.y is the task count): enough blocks for the longest
// task's 16-byte packs (one per thread), within one wave of `resident` blocks (SMs x blocks per
// SM of this kernel) shared by the launch's `ntasks` tasks; at least 1.
inline int64_t step_grid_x(int64_t max_n, int64_t esize, int ntasks, int64_t resident) {
  const int64_t lanes = esize >= 16 ? 1 : 16 / esize;
  const int64_t want = (max_n / lanes + kStepThreads) / kStepThreads;
  const int64_t cap = std::max<int64_t>(1, resident / std::max(ntasks, 1));
  return std::min(std::max<int64_t>(want, 1), cap);
}

// Blocks of one one-shot launch: a thread per pack (`vec`) or element, within one wave of
// `resident` blocks (the threads stride over the rest); at least 1 for count > 0.
inline int64_t oneshot_grid(int64_t count, int64_t esize, bool vec, int64_t resident) {
  const int64_t lanes = esize >= 16 ? 1 : 16 / esize;
  const int64_t items = vec ? std::max(count / lanes, count % lanes) : count;
  const int64_t want = (items + kOneshotThreads - 1) / kOneshotThreads;
  return std::max<int64_t>(1, std::min(want, std::max<int64_t>(resident, 1)));
}

// The most blocks per rank the fused kernel can run with `nranks` ranks when the device holds
// `resident` of its blocks at once (every block must be resident: they wait for each other).
// Throws std::runtime_error when fewer than nranks fit.
inline void check_fused_nranks(int nranks) {
  if (nranks < 1 || nranks > kFusedMaxRanks) {
    throw std::invalid_argument("ringreduce: the fused all-reduce takes 1 to " +
                                std::to_string(kFusedMaxRanks) + " ranks, got nranks=" +
                                std::to_string(nranks));
  }
}

inline int fused_max_blocks_per_rank(int nranks, int64_t resident) {
  check_fused_nranks(nranks);
  if (resident < nranks) {
    throw std::runtime_error("ringreduce: the device holds " + std::to_string(resident) +
                             " blocks of the fused all-reduce at once, fewer than nranks=" +
                             std::to_string(nranks));
  }
  return int(std::min<int64_t>(resident / nranks, 1 << 20));
}

// The most blocks per rank a flag buffer of `flags_bytes` serves with `nranks` ranks (0 if it
// is too small for even one).
inline int64_t fused_flag_capacity(int nranks, int64_t flags_bytes) {
  const int64_t lines = flags_bytes / kFusedLineBytes - 1;
  return lines < nranks ? 0 : std::min<int64_t>(lines / nranks, 1 << 20);
}

// Blocks per rank a fused all-reduce call uses. `requested` > 0: that many, if the flag buffer
// holds them. 0: one block per kFusedThreads 16-byte packs of a chunk, within what the device
// holds at once (`resident` blocks of the kernel) and what the flag buffer serves, so a buffer
// sized for fewer blocks than the device could run caps the count instead of failing the call.
// Throws std::invalid_argument naming the rule when the flag buffer is too small. (Whether a
// requested count fits the device is launch_fused_all_reduce's check.)
inline int fused_blocks_per_rank(int requested, int nranks, int64_t count, int64_t esize,
                                 int64_t resident, int64_t flags_bytes) {
  check_fused_nranks(nranks);
  const int64_t capacity = fused_flag_capacity(nranks, flags_bytes);
  int blocks = requested;
  if (requested <= 0) {
    const int64_t packs = (chunk_elems(count, nranks, esize) * esize + 15) / 16;
    const int64_t want = std::max<int64_t>(1, (packs + kFusedThreads - 1) / kFusedThreads);
    blocks = int(std::max<int64_t>(
        1, std::min({want, int64_t(fused_max_blocks_per_rank(nranks, resident)), capacity})));
  }
  if (capacity < blocks) {
    throw std::invalid_argument(
        "ringreduce: flags holds " + std::to_string(flags_bytes) + " bytes; " +
        std::to_string(nranks) + " ranks x " + std::to_string(blocks) + " blocks need " +
        std::to_string(fused_flags_bytes(nranks, blocks)) + " (fused_flags_bytes)");
  }
  return blocks;
}

}  // namespace rr
