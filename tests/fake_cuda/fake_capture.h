// Test controls of fake_capture.cpp (CUDA's capture-mode rule for unsafe calls, alone).
#pragma once

#include <cuda_runtime.h>

// The calling thread begins capturing `stream` in `mode` (cudaStreamBeginCapture).
void fake_capture_begin(cudaStream_t stream, cudaStreamCaptureMode mode);
// Active, or Invalidated once a prohibited unsafe call has been made; None if never begun.
cudaStreamCaptureStatus fake_capture_status(cudaStream_t stream);
