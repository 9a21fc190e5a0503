// The capture mode of ringreduce's own threads (the backend's progress, completion and
// watchdog threads). Torch-free.
//
// CUDA forbids "potentially unsafe" calls (cudaEventQuery, cudaStreamQuery, cudaMalloc, ...)
// while a CUDA graph is being captured in cudaStreamCaptureModeGlobal, torch's default: not
// only on the capturing thread, but on every thread whose own mode is global (the default). Such
// a call from a thread of ours, say the watchdog polling a collective's end event while the
// user captures a graph on another thread, fails and invalidates the user's capture. A thread
// in cudaStreamCaptureModeThreadLocal is held to the rule only for captures it began itself,
// and ours begin none. (ProcessGroupNCCL's watchdog does the same.)
#pragma once

#include <cuda_runtime.h>

#include "cuda_check.h"

namespace rr {
namespace cuda {

// Puts the calling thread in cudaStreamCaptureModeThreadLocal, once per thread; call it before
// the thread's first CUDA call. Throws (naming the call) if CUDA refuses.
inline void use_thread_local_capture_mode() {
  thread_local bool done = false;
  if (done) return;
  cudaStreamCaptureMode mode = cudaStreamCaptureModeThreadLocal;
  RR_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode),
                "putting one of ringreduce's threads in thread-local capture mode");
  done = true;
}

}  // namespace cuda
}  // namespace rr
