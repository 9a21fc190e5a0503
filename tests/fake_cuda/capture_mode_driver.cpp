// Drives csrc/ring/capture_mode.h on fake_capture.cpp (tests/test_capture_mode.py): the main
// thread begins a capture in global mode (torch.cuda.graph's default), then a second thread
// queries an event the way the backend's watchdog does, after use_thread_local_capture_mode()
// ("ours") or without it ("default"); prints the query's result and the capture's status.
#include <cstdio>
#include <cstring>
#include <thread>

#include "fake_capture.h"
#include "ring/capture_mode.h"

int main(int argc, char** argv) {
  if (argc != 2 || (std::strcmp(argv[1], "ours") != 0 && std::strcmp(argv[1], "default") != 0)) {
    std::fprintf(stderr, "usage: capture_mode_driver ours|default\n");
    return 2;
  }
  const bool ours = std::strcmp(argv[1], "ours") == 0;
  cudaStream_t user = reinterpret_cast<cudaStream_t>(0x1);
  cudaEvent_t end = reinterpret_cast<cudaEvent_t>(0x2);
  fake_capture_begin(user, cudaStreamCaptureModeGlobal);
  cudaError_t queried = cudaSuccess;
  std::thread watchdog([&] {
    if (ours) {
      rr::cuda::use_thread_local_capture_mode();
      rr::cuda::use_thread_local_capture_mode();  // a second call changes nothing
    }
    queried = cudaEventQuery(end);
  });
  watchdog.join();
  std::printf("query %d capture %d\n", int(queried), int(fake_capture_status(user)));
  return 0;
}
