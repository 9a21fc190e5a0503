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
#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInsufficientDriver = 35,
  cudaErrorInvalidDeviceFunction = 98,
  cudaErrorNoDevice = 100,
  cudaErrorInvalidDevice = 101,
  cudaErrorNoKernelImageForDevice = 209,
  cudaErrorPeerAccessUnsupported = 217,
  cudaErrorInvalidResourceHandle = 400,
  cudaErrorNotReady = 600,
  cudaErrorPeerAccessAlreadyEnabled = 704,
  cudaErrorCooperativeLaunchTooLarge = 720,
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
enum cudaDeviceAttr {
  cudaDevAttrMultiProcessorCount = 16,
  cudaDevAttrComputeCapabilityMajor = 75,
  cudaDevAttrComputeCapabilityMinor = 76,
  cudaDevAttrCooperativeLaunch = 95
};
struct cudaFuncAttributes { int numRegs; int maxThreadsPerBlock; };
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

// Only fake_lanes.cpp implements these (tests/test_cuda_host_cost.py): the device queries and
// kernel launches of csrc/ring/cuda_kernels.cu and oneshot_kernel.cu compiled by the host
// compiler. A kernel is then a host function run for every (block, thread) of its grid with the
// built-in index variables below set; a launch through the typed overload (the kernel's own
// pointer, as real CUDA's template overload takes it) copies its parameters when it is called,
// as CUDA does, and counts their bytes.
struct uint3 { unsigned x, y, z; };
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
extern thread_local uint3 blockIdx, threadIdx;
extern thread_local dim3 blockDim, gridDim;
#define __global__
#define __launch_bounds__(...)
#define __grid_constant__
cudaError_t cudaGetDeviceCount(int* count);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device);
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, const void* fn, int threads,
                                                          size_t shared);
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attr, const void* fn);
// An untyped launch: counted, and refused (the fake cannot run a kernel it knows only by address).
cudaError_t cudaLaunchKernel(const void* fn, dim3 grid, dim3 block, void** args, size_t shared,
                             cudaStream_t stream);
// Marks the fake's own work (its allocations are not the caller's: fake_lanes.h's counts).
struct FakeScope {
  FakeScope();
  ~FakeScope();
};
// What the typed overload hands the fake: the kernel run for one thread (indices set).
cudaError_t fake_launch_kernel(const void* fn, dim3 grid, dim3 block,
                               size_t param_bytes, cudaStream_t stream,
                               std::function<void()> thread);
// Out of line, so that callgrind counts the fake's work in its own function (bench/RESULTS.md
// subtracts it from the executor's).
template <typename... P, size_t... I>
__attribute__((noinline)) cudaError_t fake_launch_typed(void (*fn)(P...), dim3 grid, dim3 block,
                              void** args, cudaStream_t stream, std::index_sequence<I...>) {
  FakeScope fake;
  std::tuple<std::decay_t<P>...> params{*static_cast<std::decay_t<P>*>(args[I])...};
  return fake_launch_kernel(reinterpret_cast<const void*>(fn), grid, block,
                            (size_t(0) + ... + sizeof(std::decay_t<P>)), stream,
                            [fn, params] { fn(std::get<I>(params)...); });
}
template <typename... P>
inline __attribute__((always_inline)) cudaError_t cudaLaunchKernel(void (*fn)(P...), dim3 grid, dim3 block, void** args,
                             size_t shared = 0, cudaStream_t stream = nullptr) {
  return shared != 0 ? cudaErrorInvalidValue
                     : fake_launch_typed(fn, grid, block, args, stream,
                                         std::index_sequence_for<P...>());
}

// Test-only: blocks until everything queued on `stream` has run.
void fake_stream_sync(cudaStream_t stream);
