// The one-shot all-reduce (oneshot.h) as one CUDA kernel. Torch-free.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_executor.h"
#include "types.h"

namespace rr {
namespace cuda {

// out[r] = the all-reduce of in[0..nranks) (count elements each, 1 <= nranks <=
// kOneshotMaxRanks), bit for bit what the ring gives, in one kernel queued on `stream`, which
// must belong to the current device. out[r] == in[r] is in place; otherwise out[r] overlaps no
// other buffer. Every pointer must be readable (in) and writable (out) from the current device:
// simulated ranks on that device, or buffers on other devices with peer access enabled. The
// kernel orders nothing across devices: the caller makes `stream` wait for the writes of every
// input and for earlier reads of every output, and makes later users of out[r] on other devices
// wait for this kernel. `device` is the current device. Throws std::invalid_argument for bad
// arguments and std::runtime_error naming the dtype, op and device when the launch fails. One
// runtime call, the launch, once the device's occupancy of the kernel is known.
// `once`: float16 and bfloat16 sum and avg rounded once (oneshot_once_thread, oneshot.h: the CPU
// paths' bits, not the ring's); other dtypes and ops throw std::invalid_argument.
void launch_oneshot(const void* const* in, void* const* out, int nranks, int64_t count,
                    DType dtype, Op op, cudaStream_t stream, int device, bool once = false);

// One rank's piece of a once-rounded collective (cuda_executor.h run_once_rounded): out = the
// once-rounded sum of in[0], ..., in[nranks-1] (count elements each, 1 <= nranks <=
// kOneshotMaxRanks; avg divides by nranks), oneshot_once_thread's arithmetic with one output.
// float16 and bfloat16 sum and avg only (std::invalid_argument otherwise). out may be one of
// the in[] (in place); otherwise it overlaps none. Ordering and reachability as
// launch_oneshot. One runtime call, the launch, once the kernel's occupancy is known.
void launch_chunk_once(const void* const* in, void* out, int nranks, int64_t count, DType dtype,
                       Op op, cudaStream_t stream, int device);

// The list API's one-shot all-reduce on one lane (every rank on one stream of lane.device, which
// is current): check_capture (cuda_executor.h: a refusal on the legacy default stream while
// another stream captures), then launch_oneshot. Two runtime calls: the capture check and the
// launch. Inline: the backend's extension links the kernels (oneshot_kernel.cu) without the
// executor (cuda_executor.cu), and never calls this.
inline void run_oneshot(const Lane& lane, const void* const* in, void* const* out, int nranks,
                        int64_t count, DType dtype, Op op, bool once = false) {
  check_capture(&lane, 1, lane.device);
  launch_oneshot(in, out, nranks, count, dtype, op, lane.stream, lane.device, once);
}

}  // namespace cuda
}  // namespace rr
