// Test controls of fake_lanes.cpp, a fake CUDA runtime for the single-process executor
// (csrc/ring/cuda_executor.cu) on a machine without a GPU.
//
// Nothing runs when it is queued: streams keep their operations (kernels, copies, event
// records and waits) until fake_drain(), which runs them one at a time in an order chosen by a
// policy among every order CUDA allows (stream order, and a wait blocks its stream until the
// record it refers to has run). An adversarial policy runs one lane as far ahead as it can,
// running on other lanes only what it waits for, so a missing wait shows up as wrong bytes.
// Events follow CUDA: a wait refers to the event's most recent record at the time of the call;
// an unrecorded event is complete. Kernels (launch_step) run the CPU executor's combine. It
// also injects errors into the N-th call, drops the N-th wait, pretends a stream is being
// captured, and logs every queued operation.
// Devices: cudaSetDevice selects the current device; streams and events belong to the device
// current when they were made, and each device has its own legacy default stream (stream 0:
// the current device's). A launch on a stream of another device than the current one throws,
// and an event recorded on a stream of another device fails (cudaErrorInvalidResourceHandle),
// as on a GPU. Memory noted with fake_note_memory belongs to a device: a kernel that touches
// another device's memory without peer access enabled (cudaDeviceEnablePeerAccess) is counted,
// and so is a cudaMemcpyPeerAsync whose pointers are not on the devices it names. Peer access
// is per pair of devices; fake_refuse_peer makes cudaDeviceCanAccessPeer say no for a pair.
#pragma once

#include <cuda_runtime.h>

#include <functional>
#include <map>
#include <string>

enum FakePolicy {
  kFakeOldest = 0,  // in the order the host queued the work
  kFakeNewest = 1,  // the most recently queued runnable operation first
  kFakePrefer = 2,  // `stream` as far ahead as it can: others run only what it waits for
  kFakeRandom = 3,  // uniformly among the runnable operations (seeded)
};

// Events live as long as the process (the executor keeps its own across calls).
void fake_init(int ndevices);
cudaStream_t fake_stream(int device);
// Stops scheduling the streams made so far that have nothing queued (and never uses them again).
void fake_release_streams();
int fake_stream_index(cudaStream_t stream);
// The stream that `stream` names: itself, or for stream 0 the current device's default stream.
cudaStream_t fake_resolve(cudaStream_t stream);
void fake_set_policy(FakePolicy policy, cudaStream_t prefer = nullptr, unsigned seed = 0);
// Queues host code on a stream as if it were a kernel of the user's.
void fake_enqueue(cudaStream_t stream, std::function<void()> fn);
// Runs everything queued; returns false (and says why on stderr) if the queued waits can
// never all be satisfied.
bool fake_drain();
// The n-th (0-based) call from now that can fail returns cudaErrorUnknown (launches throw);
// -1 disables.
void fake_fail_call(long n);
// The n-th (0-based) cudaStreamWaitEvent from now is accepted and ignored; -1 disables.
void fake_drop_wait(long n);
void fake_set_capturing(cudaStream_t stream, bool capturing);
// cudaStreamIsCapturing on `stream` fails with cudaErrorStreamCaptureImplicit, as it does on
// the legacy default stream while another stream of its device captures in global mode.
void fake_set_capture_implicit(cudaStream_t stream, bool implicit);
// Staging memory handed out by the caller's allocator: launches that read it at an address that
// is not 16-byte aligned are counted (such a read takes the kernels' element path).
void fake_note_staging(const void* p, size_t bytes);
void fake_forget_staging();  // the staging memory noted so far is freed
long fake_misaligned_staged_reads();
// Starts a new call: a later wait on an event whose latest record came before this mark
// counts as stale.
void fake_mark();
long fake_stale_waits();
// One letter per operation queued since fake_mark(): W wait, R record, L launch, C copy.
std::string fake_log();
long fake_failable_calls();  // calls that could fail since fake_mark()

// Memory [p, p + bytes) is on `device`, until fake_forget_memory().
void fake_note_memory(const void* p, size_t bytes, int device);
void fake_forget_memory();
// Devices a and b cannot access each other's memory.
void fake_refuse_peer(int a, int b);
// Kernel reads or writes of another device's noted memory without peer access, and
// cudaMemcpyPeerAsync calls whose pointers lie on other devices than they name; the first one
// is described in *first.
long fake_device_violations(std::string* first = nullptr);
// cudaMemcpyPeerAsync calls so far from memory of `src_device` into memory of `dst_device`.
long fake_peer_copies(int dst_device, int src_device);

// What the host asked of the runtime since fake_mark(): every CUDA runtime call by name (failed
// ones included), the kernels launched and the bytes of their parameters (typed launches).
struct FakeCounts {
  std::map<std::string, long> calls;
  long launches = 0;
  long param_bytes = 0;
};
FakeCounts fake_counts();
// Whether the calling thread is inside the fake (FakeScope): allocations made there are the
// fake's, not its caller's.
bool fake_inside();
// Devices report this many SMs and blocks of any kernel per SM (default 4 and 2).
void fake_set_capacity(int sms, int blocks_per_sm);
