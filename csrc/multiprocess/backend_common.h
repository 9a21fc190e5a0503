// What the backend's parts share: error text, dtype names, a checked CUDA event, a scope
// guard.
// Part of the "ringreduce" backend (backend.h describes the whole); only backend.cpp includes it.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <exception>
#include <functional>
#include <string>

#ifdef RINGREDUCE_WITH_CUDA
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include "../ring/capture_mode.h"
#endif

namespace rr {
namespace dist {
// Hidden like the pybind11 types its classes hold (an anonymous namespace before the split).
namespace detail __attribute__((visibility("hidden"))) {

using Clock = std::chrono::steady_clock;
using c10d::OpType;

inline std::string error_text(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const c10::Error& err) {
    return err.what_without_backtrace();
  } catch (const std::exception& err) {
    return err.what();
  } catch (...) {
    return "unknown error";
  }
}

// `text` as an error of ringreduce's `name`: as it is where it names ringreduce already (the
// Python layers' errors do), else prefixed "ringreduce <name>: " (gloo's, across hosts).
inline std::string named_error(const std::string& name, const std::string& text) {
  if (text.find("ringreduce") != std::string::npos) return text;
  return "ringreduce " + name + ": " + text;
}

// torch's Python name of a dtype ("float32" for Float), as the Python engine reported it.
inline std::string torch_dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kByte: return "uint8";
    case at::kChar: return "int8";
    case at::kShort: return "int16";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    case at::kHalf: return "float16";
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kComplexHalf: return "complex32";
    case at::kComplexFloat: return "complex64";
    case at::kComplexDouble: return "complex128";
    case at::kBool: return "bool";
    case at::kBFloat16: return "bfloat16";
    case at::kUInt16: return "uint16";
    case at::kUInt32: return "uint32";
    case at::kUInt64: return "uint64";
    default: break;
  }
  std::string name = c10::toString(t);
  std::transform(name.begin(), name.end(), name.begin(),
                 [](unsigned char c) { return char(std::tolower(c)); });
  return name;
}

#ifdef RINGREDUCE_WITH_CUDA
// A CUDA event without timing (c10 only: ATen's CUDAEvent drags in the math libraries'
// headers). Every call is checked.
class Event {
 public:
  // `timed`: it keeps a timestamp (elapsed_ms), which costs a little on every record.
  explicit Event(c10::DeviceIndex device, bool timed = false) : device_(device) {
    c10::cuda::CUDAGuard guard(device_);
    C10_CUDA_CHECK(
        cudaEventCreateWithFlags(&e_, timed ? cudaEventDefault : cudaEventDisableTiming));
  }
  // Every call runs with the event's device current: on a thread that never set a device (the
  // watchdog, a completion thread) a CUDA call would otherwise create a context on GPU 0.
  ~Event() {
    if (e_ == nullptr) return;
    try {
      c10::cuda::CUDAGuard guard(device_);
      cudaEventDestroy(e_);  // no error to report from a destructor
    } catch (const std::exception&) {
      // The device could not be made current (a broken context): the event is left behind.
    }
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  void record(const c10::cuda::CUDAStream& s) {
    c10::cuda::CUDAGuard guard(device_);
    C10_CUDA_CHECK(cudaEventRecord(e_, s.stream()));
  }
  // `s` waits (on the GPU) for the work recorded before this event.
  void block(const c10::cuda::CUDAStream& s) const {
    c10::cuda::CUDAGuard guard(s.device_index());
    C10_CUDA_CHECK(cudaStreamWaitEvent(s.stream(), e_, 0));
  }
  // True when the recorded work is done; throws on a CUDA error.
  bool query() const {
    c10::cuda::CUDAGuard guard(device_);
    const cudaError_t err = cudaEventQuery(e_);
    if (err == cudaErrorNotReady) {
      cudaGetLastError();  // not an error: clear it
      return false;
    }
    C10_CUDA_CHECK(err);
    return true;
  }
  c10::DeviceIndex device() const { return device_; }
  // Milliseconds from this event to `end`, both timed and completed.
  float elapsed_ms(const Event& end) const {
    c10::cuda::CUDAGuard guard(device_);
    float ms = 0;
    C10_CUDA_CHECK(cudaEventElapsedTime(&ms, e_, end.e_));
    return ms;
  }

 private:
  c10::DeviceIndex device_;
  cudaEvent_t e_ = nullptr;
};

// Why no work may be queued after the caller's `stream` now, or "" when it may. The
// multi-process paths synchronise on the host, so a stream that is capturing a CUDA graph is
// refused. cudaStreamIsCapturing on the legacy default stream (torch's default current stream)
// fails with cudaErrorStreamCaptureImplicit while a blocking stream of the device is capturing,
// typically another thread's capture: then this call is not being captured, but CUDA forbids
// work on the legacy stream until that capture ends. Any other CUDA error throws.
inline std::string capture_refusal(const c10::cuda::CUDAStream& stream) {
  c10::cuda::CUDAGuard guard(stream.device_index());
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t err = cudaStreamIsCapturing(stream.stream(), &status);
  if (err == cudaErrorStreamCaptureImplicit) {
    (void)cudaGetLastError();  // not sticky: clear it
    return "the caller's current stream is the legacy default stream, and a CUDA graph is "
           "being captured on another stream of this device (typically by another thread): CUDA forbids work on the legacy "
           "stream until that capture ends (cudaErrorStreamCaptureImplicit); issue the call on "
           "another stream (with torch.cuda.stream(...)) or after the capture";
  }
  C10_CUDA_CHECK(err);
  if (status == cudaStreamCaptureStatusActive) {
    return "the caller's current stream is capturing a CUDA graph, and multi-process "
           "collectives cannot be captured (they synchronise on the host)";
  }
  if (status == cudaStreamCaptureStatusInvalidated) {
    return "the caller's current stream is in a CUDA graph capture that was invalidated (end "
           "it with cudaStreamEndCapture); multi-process collectives cannot be captured";
  }
  return "";
}
#endif

// Runs `fn` when the scope ends, however it ends.
class Finally {
 public:
  explicit Finally(std::function<void()> fn) : fn_(std::move(fn)) {}
  ~Finally() { fn_(); }
  Finally(const Finally&) = delete;
  Finally& operator=(const Finally&) = delete;

 private:
  std::function<void()> fn_;
};

}  // namespace detail
}  // namespace dist
}  // namespace rr
