// The ring's CUDA kernels and device queries. Torch-free: raw pointers, int64 counts,
// cudaStream_t. Every CUDA error is thrown as std::runtime_error naming the call and what it was
// doing.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "step.h"
#include "types.h"

namespace rr {
namespace cuda {

// The most ranks the CUDA executors take.
constexpr int kMaxRanks = 64;

// The most tasks one step kernel takes: its parameter block holds this many. Eight serve every
// lane of up to 8 simulated ranks, and a lane per GPU, in one launch of 264 bytes of parameters
// (64 took 2056 bytes for every launch, which the host copies into the launch and the GPU
// reads before the first instruction); more tasks take one launch per 8. One capacity rather
// than one kernel per size: each would add every dtype x op instantiation to the build.
constexpr int kStepTasks = 8;

using ::rr::Task;  // one piece of a ring step (step.h)

// Performs `ntasks` (<= kMaxRanks) tasks of one ring step on `stream`, which belongs to the
// current device `device` (all pointers must be reachable from it): one kernel per kStepTasks
// tasks. `reduce` selects combine vs copy; `last` marks the final reduce-scatter hop (avg
// divides by `nranks`). No runtime call but the launches once the device's occupancy of the
// kernel is known (the first launch of each kernel on each device asks for it).
void launch_step(const Task* tasks, int ntasks, DType dtype, Op op, bool reduce, bool last,
                 int nranks, cudaStream_t stream, int device);
// The same on the current device, whichever it is (asks the runtime for it).
void launch_step(const Task* tasks, int ntasks, DType dtype, Op op, bool reduce, bool last,
                 int nranks, cudaStream_t stream);

// How many blocks of kernel `fn`, launched with `threads` threads a block and no dynamic shared
// memory, `device` holds at once: SMs x the occupancy calculation's blocks per SM (at least 1).
// Cached per kernel, block size and device. A grid this size is one wave; a cooperative launch
// may not exceed it.
int64_t resident_blocks(const void* fn, int threads, int device);

// resident_blocks of one kernel at a fixed block size, per device, for a launcher to keep beside
// the kernel (a static): after the first ask on a device, one relaxed atomic load instead of
// resident_blocks' lock and map. Two threads racing on the first ask both ask and store the
// same value.
class ResidentCache {
 public:
  int64_t get(const void* fn, int threads, int device) {
    if (device < 0 || device >= kDevices) return resident_blocks(fn, threads, device);
    int64_t v = blocks_[size_t(device)].load(std::memory_order_relaxed);
    if (v == 0) {
      v = resident_blocks(fn, threads, device);
      blocks_[size_t(device)].store(v, std::memory_order_relaxed);
    }
    return v;
  }

 private:
  static constexpr int kDevices = 64;
  std::array<std::atomic<int64_t>, kDevices> blocks_{};
};

// Throws if this build has no kernel image that can run on `device`.
void check_device_supported(int device);

int device_count();
// can[i][j]: device i can read device j's memory directly.
std::vector<std::vector<int>> peer_access_matrix();
std::string device_name(int device);

}  // namespace cuda
}  // namespace rr
