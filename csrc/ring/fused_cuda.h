// The ring all-reduce as one cooperative CUDA kernel whose blocks order the ring's steps with
// flags (fused.h). Torch-free. A path of ringreduce.all_reduce behind RINGREDUCE_FUSED=1
// (bindings.cpp run_fused), off by default; measured on no GPU so far.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "fused.h"
#include "types.h"

namespace rr {
namespace cuda {

// A bound on every wait inside the kernel. A healthy wait lasts microseconds; the bound only
// has to outlast a time slice of another context sharing the GPU (the whole grid stops and
// resumes together, but the timer runs on).
constexpr uint64_t kFusedDefaultTimeoutNs = 10ull * 1000 * 1000 * 1000;

// Zeroes a flag buffer before its first use (cudaMemsetAsync on `stream`). `bytes` is the whole
// allocation. After this the buffer's epochs start at 1.
void init_fused_flags(void* flags, int64_t bytes, cudaStream_t stream);

// Blocks of the fused kernel for this dtype and op the current device holds at once (SMs x the
// occupancy calculation). Throws if the device cannot launch cooperative kernels.
int64_t fused_resident_blocks(DType dtype, Op op);

// The most blocks per rank that launch_fused_all_reduce accepts for `nranks` ranks on the
// current device: every one of the nranks * G blocks must be resident at once
// (rr::fused_max_blocks_per_rank of fused_resident_blocks). Throws if the device cannot launch
// cooperative kernels or holds fewer than nranks blocks.
int fused_max_blocks_per_rank(int nranks, DType dtype, Op op);

// The blocks per rank a call with `requested` blocks (0: the suggested count) and a flag buffer
// of `flags_bytes` uses on the current device: rr::fused_blocks_per_rank (launch.h) with this
// device's capacity. Throws std::invalid_argument when the flag buffer is too small.
int fused_blocks_per_rank(int requested, int nranks, int64_t count, DType dtype, Op op,
                          int64_t flags_bytes);

// out[r] = the all-reduce of in[0..nranks) (count elements each), bit for bit what the ring
// (rr::cpu::all_reduce, launch_step) and the one-shot give, in ONE cooperative kernel queued on
// `stream`: nranks * blocks_per_rank blocks, group r doing rank r's 2(N-1) ring steps.
// Preconditions (the caller's):
//   - `stream` belongs to the current device; every in[r] is readable and every out[r] writable
//     from it (ranks simulated on that device, or peers' memory with peer access enabled in
//     this process). out[r] == in[r] is in place; otherwise no out[] overlaps another buffer.
//   - All ranks are in this process: the kernel's blocks wait only for blocks of the same grid,
//     which the cooperative launch makes co-resident. Never use it to wait on another
//     process's kernel (time-sliced GPU: docs/DESIGN.md).
//   - 1 <= blocks_per_rank <= fused_max_blocks_per_rank(nranks, dtype, op), else
//     std::invalid_argument before anything is queued.
//   - `flags`: device memory of at least fused_flags_bytes(nranks, blocks_per_rank) bytes
//     (`flags_bytes` says how many), 8-byte aligned (128 keeps each flag on a line of its own),
//     zeroed once by init_fused_flags, used by one call at a time (calls on it ordered on the
//     device, e.g. all on `stream`) and by nothing else. Its size may serve calls with other
//     nranks and blocks_per_rank.
//   - `epoch` in [1, 2^56 - 1], strictly greater than every epoch used before on `flags`
//     (1, 2, 3, ... per buffer). A reused or lower epoch is detected by the kernel and reported
//     by check_fused_all_reduce.
//   - The stream waits for the writes of every input and the earlier reads of every output;
//     later users of out[r] on other devices wait for this kernel (nothing across devices is
//     ordered here).
// A wait inside the kernel that exceeds `timeout_ns` ends the call with the failure recorded in
// `flags`; the outputs are then undefined. Throws std::runtime_error naming the dtype, op, grid
// and device when the launch fails (cudaErrorCooperativeLaunchTooLarge included).
void launch_fused_all_reduce(const void* const* in, void* const* out, int nranks, int64_t count,
                             DType dtype, Op op, int blocks_per_rank, void* flags,
                             int64_t flags_bytes, uint64_t epoch, cudaStream_t stream,
                             uint64_t timeout_ns = kFusedDefaultTimeoutNs);

// Synchronises `stream` and throws std::runtime_error if a call with epoch >= first_epoch on
// `flags` failed inside the kernel (a wait timed out, or a stale epoch); the message names the
// epoch, rank, block and step (fused_error_message). Check after each call, or once after a
// batch with the batch's first epoch: the record keeps the latest failing call.
void check_fused_all_reduce(const void* flags, uint64_t first_epoch, cudaStream_t stream);

}  // namespace cuda
}  // namespace rr
