// The ring's CUDA kernels and device queries. Torch-free: raw pointers, int64 counts,
// cudaStream_t. Every CUDA error is thrown as std::runtime_error naming the call and what it was
// doing.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "step.h"
#include "types.h"

namespace rr {
namespace cuda {

// The most ranks one launch serves (the kernel's parameter block holds one task per rank).
constexpr int kMaxRanks = 64;

using ::rr::Task;  // one piece of a ring step (step.h)

// Launches one kernel that performs `ntasks` (<= kMaxRanks) tasks of one ring step on
// `stream`, which belongs to the current device (all pointers must be reachable from it).
// `reduce` selects combine vs copy; `last` marks the final reduce-scatter hop (avg divides by
// `nranks`).
void launch_step(const Task* tasks, int ntasks, DType dtype, Op op, bool reduce, bool last,
                 int nranks, cudaStream_t stream);

// How many blocks of kernel `fn`, launched with `threads` threads a block and no dynamic shared
// memory, `device` holds at once: SMs x the occupancy calculation's blocks per SM (at least 1).
// Cached per kernel, block size and device. A grid this size is one wave; a cooperative launch
// may not exceed it.
int64_t resident_blocks(const void* fn, int threads, int device);

// Throws if this build has no kernel image that can run on `device`.
void check_device_supported(int device);

int device_count();
// can[i][j]: device i can read device j's memory directly.
std::vector<std::vector<int>> peer_access_matrix();
std::string device_name(int device);

}  // namespace cuda
}  // namespace rr
