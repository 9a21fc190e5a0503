// Single-process CUDA executor: one process owns every rank's buffer (several GPUs, or several
// buffers on one GPU as "simulated ranks"). Torch-free: raw pointers, int64 counts, cudaStream_t.
// Every CUDA error is thrown as std::runtime_error naming the call and what it was doing.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "plan.h"
#include "types.h"

namespace rr {
namespace cuda {

constexpr int kMaxRanks = 64;

struct RankBuffer {
  void* ptr;   // device pointer to the rank's `count` elements
  int device;  // CUDA ordinal the buffer lives on
};

struct DeviceStream {
  int device;
  cudaStream_t stream;  // the stream every piece of work for this device is queued on
};

// One piece of a ring step: dst = combine(own, src) or dst = src for n elements. `own` left
// null means dst itself (in place).
struct Task {
  void* dst;
  const void* src;
  int64_t n;
  const void* own = nullptr;
};

// Launches one kernel that performs `ntasks` (<= kMaxRanks) tasks of one ring step on
// `stream` (all pointers must be reachable from the stream's device). `reduce` selects
// combine vs copy; `last` marks the final reduce-scatter hop (avg divides by `nranks`).
void launch_step(const Task* tasks, int ntasks, DType dtype, Op op, bool reduce, bool last,
                 int nranks, cudaStream_t stream);

// Runs a plan (plan.h); rank r's buffers live on device rank_device[r]. `streams` names one
// stream per distinct device among them; the call is ordered after work already queued there
// and work queued there afterwards sees the result (cross-device dependencies go through
// events). Neighbours without peer access are staged through cudaMemcpyPeerAsync;
// `force_copy` stages every hop that way (for testing and measuring the copy transport on one
// GPU). Returns descriptions of the pairs staged for lack of peer access.
std::vector<std::string> run(const Plan& plan, const int* rank_device, int nranks, DType dtype,
                             Op op, const DeviceStream* streams, int nstreams, bool force_copy);

// All-reduce in place (all_reduce_plan run by run()).
std::vector<std::string> all_reduce(const RankBuffer* bufs, int nranks, int64_t count,
                                    DType dtype, Op op, const DeviceStream* streams,
                                    int nstreams, bool force_copy);

// Throws if this build has no kernel image that can run on `device`.
void check_device_supported(int device);

int device_count();
// can[i][j]: device i can read device j's memory directly.
std::vector<std::vector<int>> peer_access_matrix();
std::string device_name(int device);

}  // namespace cuda
}  // namespace rr
