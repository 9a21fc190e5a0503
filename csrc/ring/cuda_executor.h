// Single-process CUDA executor: one process owns every rank's buffer (several GPUs, or several
// buffers on one GPU as "simulated ranks"). Torch-free and host-only (it queues the kernels of
// cuda_kernels.h), so that tests/fake_cuda can run it on a CPU against a fake CUDA runtime.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "cuda_kernels.h"
#include "plan.h"
#include "types.h"

namespace rr {
namespace cuda {

// Where ranks run: one stream on one device. Ranks that share a lane run in one kernel per
// step. Distinct lanes (distinct devices, or distinct streams on one device: "virtual
// devices") are ordered by events exactly as distinct GPUs would be.
struct Lane {
  int device;
  cudaStream_t stream;
};

// Returns `bytes` of device memory on `device`, for use on `stream` only, valid until the
// stream has finished the work queued on it so far and the work the executor queues next (a
// stream-ordered allocation: torch's caching allocator gives exactly this).
using StageAlloc = std::function<void*(int device, cudaStream_t stream, size_t bytes)>;

// Whether kernels on `device` may read `peer`'s memory directly, enabling peer access where it
// can (the bindings: at::cuda::get_p2p_access); false stages the hop through
// cudaMemcpyPeerAsync.
using PeerAccess = std::function<bool(int device, int peer)>;

struct RunOptions {
  // Asked once per call for each pair of distinct devices that hold ring neighbours, and only
  // after the stream-capture check: enabling peer access during a global-mode capture could
  // invalidate it rather than let the call be refused cleanly. Unset: every pair may.
  PeerAccess peer_access;
  // Stage every hop, for testing and measuring the copy transport on one GPU.
  bool force_copy = false;
  // Staging buffers, asked for only when some hop is staged.
  StageAlloc alloc;
  // The device current when run() is called, if the caller knows it (its device guard set it):
  // spares a cudaGetDevice. -1: run() asks.
  int current_device = -1;
};

// Runs a plan (plan.h); rank r runs on lanes[rank_lane[r]]. In the steady state (a layout seen
// before) a call makes no heap allocation and, per lane, asks the runtime only for the capture
// check, its launches (one per step), and with several lanes its event records and waits
// (tests/test_cuda_host_cost.py pins the counts). The call is ordered after the work
// already queued on every lane, and work queued on any lane afterwards sees the result and may
// overwrite the ranks' buffers. Everything that can fail before any work is queued is checked
// first (lanes, ranks, stream capture, staging); an error while queuing makes every lane wait
// for what was queued before the exception propagates, so no later work overtakes it.
// Under CUDA-graph capture, only one lane without staging is accepted (a clear error
// otherwise, thrown before anything is queued or any peer access is enabled); so is a lane on
// the legacy default stream while another stream of its device is being captured
// (cudaErrorStreamCaptureImplicit).
void run(const Plan& plan, const int* rank_lane, int nranks, const Lane* lanes, int nlanes,
         DType dtype, Op op, const RunOptions& options);

using ::rr::OnceCall;  // a once-rounded collective (plan.h)

// A once-rounded collective on any layout: every result element is round16(in[0][i] + in[1][i]
// + ... + in[N-1][i], accumulated in fp32 in rank order; avg divided by N in fp32), the bits of
// rr::cpu::all_reduce_once / reduce_scatter_once / sum_rounded_once. Each rank on
// lanes[rank_lane[r]]:
//   the sums: rank r reads its piece of every input (all_reduce and reduce: chunk r,
//     chunk_range; reduce_scatter: block r) and writes the once-rounded sum (one kernel,
//     launch_chunk_once) to its piece of out[r] (all_reduce), to out[r] (reduce_scatter), to
//     chunk r of the root's output (reduce, the root) or of work[r] (reduce, the others);
//   the gathers: all_reduce: rank r copies chunk c of out[c] into out[r] for every other c;
//     reduce: the root copies chunk c of work[c] into its output (step kernels).
// An all-reduce (the two-shot) reads S bytes and writes S/N a rank in the first half, (N-1)S/N
// each way in the second: the ring's remote traffic in 2 kernels a rank instead of 2(N-1).
// Every rank reads every other rank's memory: pairs of devices without peer access
// (RunOptions::peer_access, asked for every such pair) and every pair under force_copy go
// through cudaMemcpyPeerAsync (a staging slot per piece read for a sum, straight into place for
// a gather). 2 <= nranks <= 64, count >= 0. Ordering, failure and capture as run(): with
// several lanes, barriers in which every lane waits for every other (entry, between the halves
// where there is a gather, exit).
void run_once_rounded(const OnceCall& call, const int* rank_lane, const Lane* lanes, int nlanes,
                      DType dtype, Op op, const RunOptions& options);

// The capture check run() starts with, for callers that launch on lanes themselves (the
// bindings' one-shot path): true if a lane's stream is being captured; throws the refusal
// ("cannot be captured") when several lanes are given and one of them is, and when a lane is
// the legacy default stream while another stream of its device is being captured
// (cudaStreamIsCapturing's cudaErrorStreamCaptureImplicit: launching there would fail and could
// invalidate that capture). `current_device` as RunOptions::current_device.
bool check_capture(const Lane* lanes, int nlanes, int current_device = -1);

}  // namespace cuda
}  // namespace rr
