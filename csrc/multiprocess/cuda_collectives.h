// Multi-process collectives on CUDA memory (one process per rank; several ranks may share one
// GPU). Torch-free: raw device pointers, int64 counts, cudaStream_t. Compiled only in CUDA
// builds.
//
// Data: each rank's buffer is shared with its peers through CUDA IPC: the handle of the
// allocation that holds it plus the buffer's offset, published in the rank's shared-memory
// header (whose name went through the process group's store); peers open each allocation once
// and cache the mapping. Kernels read peer memory directly (P2P between distinct GPUs, a
// second mapping of the same memory on a shared GPU).
//
// Ordering: every step ends with cudaEventRecord of an IPC event on the rank's stream and a
// host-side publish in shared memory; the reader waits for the publish on the host, then makes
// its stream wait for that event (cudaStreamWaitEvent) and launches its kernel. No kernel ever
// waits for another process's kernel: processes that share a GPU are time-sliced, and a
// spinning kernel could hold the GPU while the kernel it waits for cannot run. The host
// handshake guarantees an event is recorded before anyone waits on it, and (the start of every
// phase waits for every rank to have finished the previous one on the host) that no event is
// re-recorded before every waiter has enqueued its wait.
//
// Completion: calls are asynchronous like NCCL's. Work queued on `stream` after a call sees the
// result, and a rank's buffer is not reused on its stream before every peer's kernels have
// finished reading it (the rank's stream waits for its readers' last events).
//
// Teardown (destroy_process_group): bounded throughout. A rank waits for its own collectives'
// GPU work (events recorded at the end of each collective, not cudaDeviceSynchronize), closes
// the peers' mappings and events, announces that in shared memory and waits for every peer's
// announcement before destroying its own exported events; what cannot be released in time is
// leaked until process exit. Known limitation: a peer's cached mapping does not keep the
// exporter's allocation alive (torch.cuda.empty_cache() may cudaFree it).
//
// NOT RUN: this file was compiled with nvcc but never executed (no GPU was available while
// it was written). Its tests skip without a GPU.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

#include "../ring/types.h"
#include "host_group.h"

namespace rr {
namespace dist {
namespace cuda {

class Peers;  // IPC events and opened peer allocations of one rank

// A device buffer and the start of the allocation holding it (from the caching allocator).
struct Buffer {
  void* ptr;
  void* alloc_base;
};

// Collective: creates this rank's IPC events on `device` and opens every peer's.
void destroy(Peers* p);
struct PeersDeleter { void operator()(Peers* p) const { destroy(p); } };
using PeersPtr = std::unique_ptr<Peers, PeersDeleter>;
PeersPtr make_peers(HostGroup& g, int device);
int device_of(const Peers& p);

void all_reduce(HostGroup& g, Peers& p, Buffer buf, int64_t count, DType dtype, Op op,
                cudaStream_t stream);
void broadcast(HostGroup& g, Peers& p, Buffer buf, int64_t bytes, int root, cudaStream_t stream);
// outs[r]: device pointers of this rank, each receiving rank r's `bytes` bytes of `in`.
void all_gather(HostGroup& g, Peers& p, Buffer in, void* const* outs, int64_t bytes,
                cudaStream_t stream);
// `in` holds nranks segments of `count` elements; `out` receives the reduction of segment
// `rank` over ranks, in rank order 0..N-1.
void reduce_scatter(HostGroup& g, Peers& p, Buffer in, void* out, int64_t count, DType dtype,
                    Op op, cudaStream_t stream);

}  // namespace cuda
}  // namespace dist
}  // namespace rr
