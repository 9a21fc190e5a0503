// Multi-process collectives on CUDA memory (one process per rank; several ranks may share one
// GPU). Torch-free: raw device pointers, int64 counts, cudaStream_t. Compiled only in CUDA
// builds.
//
// Ran on an H100 on 2026-11-26 (docs/GPU_SESSION.md): every collective bitwise at 2 to 4
// processes sharing one GPU, both allocators, empty_cache in flight; a rank whose collective
// fails (a peer dead, hung or aborted) then died of SIGSEGV, somewhere above this layer (the
// fake runtime's protocol tests of the same failures pass). Its protocol (handshakes, rounds
// and slots, stream and event ordering, teardown) also runs on a fake CUDA runtime in
// tests/test_cuda_protocol.py.
//
// Data: no process ever maps another process's user tensor. At its first CUDA collective every
// rank cudaMallocs a persistent staging area (RINGREDUCE_CUDA_BUFFER_BYTES, split into two
// slots), exports it once with legacy CUDA IPC and opens every peer's once. User tensors are
// copied into this rank's slot (cudaMemcpyAsync on an internal copy stream), the ring runs
// between the slots, and results are copied out on the collective's stream. A tensor larger
// than a slot goes in rounds that alternate slots, so the copy-in of round i + 1 overlaps the
// ring of round i; the rounds have the structure of cpu_collectives.cpp (an all-reduce round
// carries one piece of every ring chunk), so the results are bitwise those of the CPU path and
// of ringreduce.all_reduce.
//
// Ordering: every step ends with cudaEventRecord of an IPC event and a host-side publish in
// shared memory; a reader waits for the publish on the host, then makes its stream wait for
// that event (cudaStreamWaitEvent). No kernel ever waits for another process's kernel:
// processes that share a GPU are time-sliced, and a spinning kernel could hold the GPU while
// the kernel it waits for cannot run. The host handshake guarantees an event is recorded before
// anyone waits on it, and (each round starts once every rank has finished enqueueing the
// previous one) that no event is re-recorded before every waiter has enqueued its wait. A slot
// is refilled only after every peer that reads it has finished reading it on the GPU.
//
// Completion: asynchronous like NCCL's. Everything runs on `stream` (the copy stream is joined
// back into it), so work queued on `stream` after a call sees the result, and the user tensors
// are not touched after the work queued so far on `stream`.
//
// Teardown (destroy_process_group): bounded throughout; see Peers::teardown.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

#include "../ring/types.h"
#include "host_group.h"

namespace rr {
namespace dist {
namespace cuda {

class Peers;  // this rank's staging area and IPC events, and the peers' ones opened here

void destroy(Peers* p);
struct PeersDeleter { void operator()(Peers* p) const { destroy(p); } };
using PeersPtr = std::unique_ptr<Peers, PeersDeleter>;
// Collective: allocates this rank's staging area (`staging_bytes`, from
// RINGREDUCE_CUDA_BUFFER_BYTES) and IPC events on `device`, exports them, and opens every peer's.
PeersPtr make_peers(HostGroup& g, int device, int64_t staging_bytes);
int device_of(const Peers& p);
// True when every rank of the group drives a distinct GPU (device UUIDs differ pairwise); false
// when any two share one. Only with distinct GPUs may a kernel wait for another rank's kernel
// (docs/DESIGN.md, "One kernel per collective"); nothing uses that path yet.
bool distinct_gpus(const Peers& p);

void all_reduce(HostGroup& g, Peers& p, void* data, int64_t count, DType dtype, Op op,
                cudaStream_t stream);
void broadcast(HostGroup& g, Peers& p, void* data, int64_t bytes, int root, cudaStream_t stream);
// outs[r]: device pointers of this rank, each receiving rank r's `bytes` bytes of `in`. `in` may
// be outs[rank] itself and must not overlap any other output.
void all_gather(HostGroup& g, Peers& p, const void* in, void* const* outs, int64_t bytes,
                cudaStream_t stream);
// `in` holds nranks segments of `count` elements; `out` receives the reduction of segment
// `rank` over ranks, in rank order 0..N-1. `out` may be segment `rank` of `in` itself and must
// not overlap any other segment.
void reduce_scatter(HostGroup& g, Peers& p, const void* in, void* out, int64_t count, DType dtype,
                    Op op, cudaStream_t stream);

}  // namespace cuda
}  // namespace dist
}  // namespace rr
