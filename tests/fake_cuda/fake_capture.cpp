// CUDA's rule for "potentially unsafe" calls during stream capture, alone (for
// csrc/ring/capture_mode.h; tests/test_capture_mode.py). Each host thread has a capture mode
// (cudaThreadExchangeStreamCaptureMode; global by default). An unsafe call (here
// cudaEventQuery) is prohibited on a thread that has a capture of its own in a mode other than
// relaxed, and, on a thread whose mode is global, while any other thread has a capture begun in
// global mode; a prohibited call fails with cudaErrorStreamCaptureUnsupported and invalidates
// those captures (the CUDA runtime API reference, cudaStreamBeginCapture and
// cudaThreadExchangeStreamCaptureMode).
#include <cuda_runtime.h>

#include <mutex>
#include <thread>
#include <vector>

#include "fake_capture.h"

namespace {

struct Capture {
  cudaStream_t stream;
  cudaStreamCaptureMode mode;
  std::thread::id owner;
  cudaStreamCaptureStatus status;
};

thread_local cudaStreamCaptureMode thread_mode = cudaStreamCaptureModeGlobal;
std::mutex mu;
std::vector<Capture> captures;

cudaError_t unsafe_call() {
  const std::lock_guard<std::mutex> held(mu);
  const std::thread::id me = std::this_thread::get_id();
  bool prohibited = false;
  for (Capture& c : captures) {
    if (c.status != cudaStreamCaptureStatusActive) continue;
    const bool mine = c.owner == me && c.mode != cudaStreamCaptureModeRelaxed;
    const bool global = c.owner != me && c.mode == cudaStreamCaptureModeGlobal &&
                        thread_mode == cudaStreamCaptureModeGlobal;
    if (mine || global) {
      c.status = cudaStreamCaptureStatusInvalidated;
      prohibited = true;
    }
  }
  return prohibited ? cudaErrorStreamCaptureUnsupported : cudaSuccess;
}

}  // namespace

void fake_capture_begin(cudaStream_t stream, cudaStreamCaptureMode mode) {
  const std::lock_guard<std::mutex> held(mu);
  captures.push_back(
      Capture{stream, mode, std::this_thread::get_id(), cudaStreamCaptureStatusActive});
}

cudaStreamCaptureStatus fake_capture_status(cudaStream_t stream) {
  const std::lock_guard<std::mutex> held(mu);
  for (const Capture& c : captures) {
    if (c.stream == stream) return c.status;
  }
  return cudaStreamCaptureStatusNone;
}

cudaError_t cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureMode* mode) {
  const cudaStreamCaptureMode previous = thread_mode;
  thread_mode = *mode;
  *mode = previous;
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t) { return unsafe_call(); }
cudaError_t cudaGetLastError() { return cudaSuccess; }
const char* cudaGetErrorName(cudaError_t err) {
  return err == cudaSuccess ? "cudaSuccess" : "cudaErrorStreamCaptureUnsupported";
}
const char* cudaGetErrorString(cudaError_t err) {
  return err == cudaSuccess ? "no error" : "operation not permitted when stream is capturing";
}
