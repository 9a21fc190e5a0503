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
