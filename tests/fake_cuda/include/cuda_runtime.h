// A fake of the few CUDA runtime calls that csrc/multiprocess/cuda_collectives.cu and
// csrc/ring/cuda_executor.cu make, so that they run on a machine without a GPU. Two fakes
// implement it. fake_runtime.cpp, for the multi-process protocol (tests/test_cuda_protocol.py),
// is described below; fake_lanes.cpp, for the single-process executor
// (tests/test_cuda_lanes.py), is described in fake_lanes.h.
// "Device" memory is POSIX shared memory (IPC handles carry its name), a stream is a worker
// thread that runs its queued operations in order after random delays, and an event is a set of
// per-record completion counters in shared memory, with CUDA's semantics: a wait waits for the
// event's most recent record at the time of the call, and an unrecorded event is complete.
// Kernels (launch_step) run the CPU executor's combine.
// Several devices (FAKE_CUDA_DEVICES, default 8), as the CUDA programming guide describes them
// ("Stream and Event Behavior" on multi-device systems): the current device is per host thread
// (cudaSetDevice); streams, events and cudaMalloc memory belong to the device current when they
// are made; each device has its own legacy default stream (stream 0); a kernel launched on a
// stream of another device than the current one, and an event recorded on a stream of another
// device than its own, fail with cudaErrorInvalidResourceHandle; a kernel that touches device
// memory of another device without peer access fails. Peer access is per pair of devices;
// FAKE_CUDA_REFUSE_PEER="a,b" refuses the pair a, b (cudaDeviceCanAccessPeer says no, and an
// IPC mapping of b's memory opened on a fails with cudaErrorPeerAccessUnsupported). IPC memory
// handles carry their device; a mapping opened on another device enables peer access to it
// (cudaIpcMemLazyEnablePeerAccess). Every device has its own UUID.
// What it cannot check: anything about real GPUs (IPC mappings, kernels, the driver's behaviour
// when a process dies).
#pragma once

#include <cstddef>
#include <cstdint>

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidDevice = 101,
  cudaErrorPeerAccessUnsupported = 217,
  cudaErrorInvalidResourceHandle = 400,
  cudaErrorNotReady = 600,
  cudaErrorPeerAccessAlreadyEnabled = 704,
  cudaErrorStreamCaptureUnsupported = 900,
  cudaErrorStreamCaptureImplicit = 906,
  cudaErrorUnknown = 999
};
typedef struct FakeStream* cudaStream_t;
typedef struct FakeEvent* cudaEvent_t;
struct cudaIpcEventHandle_t { char reserved[64]; };
struct cudaIpcMemHandle_t { char reserved[64]; };
struct cudaUUID_t { char bytes[16]; };
struct cudaDeviceProp {
  cudaUUID_t uuid;
  char name[256];
};
enum cudaMemcpyKind { cudaMemcpyDefault = 4 };
enum cudaStreamCaptureStatus {
  cudaStreamCaptureStatusNone = 0,
  cudaStreamCaptureStatusActive = 1,
  cudaStreamCaptureStatusInvalidated = 2
};
enum cudaStreamCaptureMode {
  cudaStreamCaptureModeGlobal = 0,
  cudaStreamCaptureModeThreadLocal = 1,
  cudaStreamCaptureModeRelaxed = 2
};
#define cudaEventDisableTiming 0x02u
#define cudaEventInterprocess 0x04u
#define cudaStreamNonBlocking 0x01u
#define cudaIpcMemLazyEnablePeerAccess 0x01u

cudaError_t cudaGetLastError();
const char* cudaGetErrorName(cudaError_t err);
const char* cudaGetErrorString(cudaError_t err);
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device);
cudaError_t cudaDeviceCanAccessPeer(int* can, int device, int peer);
cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned flags);
cudaError_t cudaMalloc(void** ptr, size_t bytes);
cudaError_t cudaFree(void* ptr);
cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t* handle, void* ptr);
cudaError_t cudaIpcOpenMemHandle(void** ptr, cudaIpcMemHandle_t handle, unsigned flags);
cudaError_t cudaIpcCloseMemHandle(void* ptr);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned flags);
cudaError_t cudaEventDestroy(cudaEvent_t event);
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream);
cudaError_t cudaEventQuery(cudaEvent_t event);
cudaError_t cudaIpcGetEventHandle(cudaIpcEventHandle_t* handle, cudaEvent_t event);
cudaError_t cudaIpcOpenEventHandle(cudaEvent_t* event, cudaIpcEventHandle_t handle);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
cudaError_t cudaStreamQuery(cudaStream_t stream);
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned flags);
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream);
cudaError_t cudaMemcpyPeerAsync(void* dst, int dst_device, const void* src, int src_device,
                                size_t bytes, cudaStream_t stream);
cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus* status);
// Only fake_capture.cpp implements it (tests/test_capture_mode.py).
cudaError_t cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureMode* mode);

// Test-only: blocks until everything queued on `stream` has run.
void fake_stream_sync(cudaStream_t stream);
