// Turning a CUDA error into an exception that names the call and what it was doing.
// Torch-free; shared by every CUDA executor.
#pragma once

#include <cuda_runtime.h>

#include <sstream>
#include <stdexcept>
#include <string>

namespace rr {
namespace cuda {

[[noreturn]] inline void fail(cudaError_t err, const char* call, const std::string& context) {
  cudaGetLastError();  // clear a non-sticky error so later calls report their own
  std::ostringstream msg;
  msg << "ringreduce: " << call << " failed: " << cudaGetErrorName(err) << " ("
      << cudaGetErrorString(err) << ") while " << context;
  throw std::runtime_error(msg.str());
}

}  // namespace cuda
}  // namespace rr

#define RR_CUDA_CHECK(call, context)                                        \
  do {                                                                      \
    cudaError_t rr_err_ = (call);                                           \
    if (rr_err_ != cudaSuccess) ::rr::cuda::fail(rr_err_, #call, (context)); \
  } while (0)

namespace rr {
namespace cuda {

// The device the caller knows to be current (its own device guard made it so), or -1 when it
// does not know.
struct CurrentDevice {
  int device = -1;
};

// Saves the caller's current device; set() switches only when needed; the destructor restores
// the caller's device only if anything was switched (restoring an untouched device could
// create a context on it).
class DeviceGuard {
 public:
  DeviceGuard() : DeviceGuard(CurrentDevice{}) {}
  // Trusts a known current device instead of asking the runtime (cudaGetDevice) for it.
  explicit DeviceGuard(CurrentDevice known) {
    if (known.device < 0) {
      RR_CUDA_CHECK(cudaGetDevice(&saved_), "saving the current device");
    } else {
      saved_ = known.device;
    }
    current_ = saved_;
  }
  explicit DeviceGuard(int device) : DeviceGuard() { set(device); }
  ~DeviceGuard() {
    if (current_ != saved_) cudaSetDevice(saved_);
  }
  void set(int device) {
    if (device == current_) return;
    RR_CUDA_CHECK(cudaSetDevice(device), "selecting cuda:" + std::to_string(device));
    current_ = device;
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int saved_ = 0;
  int current_ = 0;
};

}  // namespace cuda
}  // namespace rr
