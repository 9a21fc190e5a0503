// The "ringreduce" torch.distributed backend: a c10d::Backend whose collectives run on the
// multi-process executors (comm.h) without Python or the GIL between `dist.all_reduce` and the
// bytes. The shape is ProcessGroupGloo's and ProcessGroupNCCL's:
//
// - Every collective is validated in the caller's thread (a bad argument raises there, before
//   anything is queued or touched), then becomes a Job on the group's queue and returns a Work.
// - One progress thread per group runs the queue in issue order. A synchronous call
//   (async_op=False) whose job would be next anyway runs in the caller's thread instead: the
//   caller would only block in wait(), and two thread hand-offs cost more than an 8-byte
//   all-reduce. So does Work.wait() on a CPU job that is next while nothing runs.
// - A Work completes a c10::ivalue::Future (made on demand by getFuture()) with its outputs.
//   Futures are completed, and so user callbacks run, on completion threads that never have to
//   make progress on collectives; a callback that issues a collective and waits for its future
//   finds another completion thread free (the pool grows while every thread is busy), so
//   torch's PowerSGD hook and any callback that waits on a nested collective complete.
// - CUDA collectives run on an internal stream per device (the backend's own, not torch's
//   pool), ordered after the caller's current stream by an event recorded at issue; Work.wait()
//   makes the caller's current stream wait on the collective's end event (no host block). A
//   watchdog thread, not the one doing the work, fails the group when GPU work has not finished
//   within the group's timeout.
// - Point-to-point runs on a thread of its own (p2p.h): a send waiting for ring space or a
//   receive waiting for its message never holds up a collective, nor waits behind one.
// - Any error fails the group (as NCCL does): peers fail at once, later collectives fail
//   without running. Worker threads run under c10::InferenceMode (but for jobs that call no
//   torch op) and write tensor memory directly, so the caller's grad or inference mode does not
//   matter.
// - shutdown() (destroy_process_group), abort() and interpreter exit (ringreduce registers an
//   atexit hook) end every thread within bounded time.
//
// The parts, each in its own file (all in namespace rr::dist::detail, included by backend.cpp
// alone, so the whole backend is still one translation unit):
//   backend_common.h  error text, dtype names, a checked CUDA event, a scope guard
//   transport.h       what moves a group's bytes: the native Comm or a Python object
//   completer.h       completion threads: futures completed off the progress thread
//   engine.h          Work, the group's shared state, the engine (issue order, watchdog)
//   p2p_engine.h      point-to-point sends and receives on a thread of their own
//   coalesce.h        coalesced collectives (one ring pass per batch), coalescing batches
//   backend.cpp       the c10d::Backend: argument checks, one Job per collective, bindings
#pragma once

#include <torch/extension.h>

namespace rr {
namespace dist {

// Adds the Backend class and its helpers to the extension module.
void bind_backend(pybind11::module& m);

}  // namespace dist
}  // namespace rr
