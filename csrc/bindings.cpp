// Thin torch binding: validate every argument (naming it and the rule) before anything is
// modified, then hand raw pointers to the torch-free plans and executors in csrc/ring/.
#include <torch/extension.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "ring/cpu_executor.h"
#include "ring/fused.h"
#include "ring/oneshot.h"
#include "ring/plan.h"
#include "ring/types.h"
#include "torch_types.h"

#ifdef RINGREDUCE_WITH_CUDA
#include <ATen/cuda/PeerToPeerAccess.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "ring/cuda_executor.h"
#include "ring/fused_cuda.h"
#include "ring/oneshot_cuda.h"
#include "ring/peer_memo.h"
#endif


namespace {

using Streams = std::vector<std::optional<c10::Stream>>;

std::string item(const std::string& list, size_t i) {
  return list + "[" + std::to_string(i) + "]";
}

void check_dense(const std::string& fn, const std::string& name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.defined(), fn, ": ", name, " is undefined");
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, fn, ": ", name, " has layout ", t.layout(),
                    "; only dense (strided) tensors are supported");
}

// `written`: the call writes the tensor, so a contiguous copy would not be the one read after.
void check_contiguous(const std::string& fn, const std::string& name, const at::Tensor& t,
                      bool written) {
  TORCH_CHECK_VALUE(t.is_contiguous(), fn, ": ", name, " is not contiguous; call "
                    ".contiguous() on it first",
                    written ? " (the result is written in place, so pass the tensor you will "
                              "read)" : "");
}

// One tensor per rank: same shape, dtype and device type, dense and contiguous, cpu or cuda.
void check_ranks(const std::string& fn, const std::string& list,
                 const std::vector<at::Tensor>& tensors, bool written) {
  TORCH_CHECK_VALUE(!tensors.empty(), fn, ": ", list, " must hold one tensor per rank; got none");
  const at::Tensor& t0 = tensors[0];
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    check_dense(fn, item(list, i), t);
    TORCH_CHECK_VALUE(t.device().type() == t0.device().type(), fn, ": all ", list, " must be "
                      "on the same device type; ", list, "[0] is on ", t0.device(), " but ",
                      item(list, i), " is on ", t.device());
    TORCH_CHECK_VALUE(t.is_cpu() || t.is_cuda(), fn, ": ", item(list, i), " is on ",
                      t.device(), "; only cpu and cuda tensors are supported");
    TORCH_CHECK_TYPE(t.scalar_type() == t0.scalar_type(), fn, ": all ", list, " must have the "
                     "same dtype; ", list, "[0] is ", t0.scalar_type(), " but ", item(list, i),
                     " is ", t.scalar_type());
    TORCH_CHECK_VALUE(t.sizes() == t0.sizes(), fn, ": all ", list, " must have the same shape; ",
                      list, "[0] has shape ", t0.sizes(), " but ", item(list, i), " has shape ",
                      t.sizes());
    check_contiguous(fn, item(list, i), t, written);
  }
}

// `out` receives rank data of `in` (the rank's tensor in the list): same device and dtype,
// dense, contiguous, `numel` elements (any shape, as torch.cuda.nccl).
void check_output(const std::string& fn, const std::string& name, const at::Tensor& out,
                  const std::string& in_name, const at::Tensor& in, int64_t numel) {
  check_dense(fn, name, out);
  TORCH_CHECK_VALUE(out.device() == in.device(), fn, ": ", name, " must be on the device of ",
                    in_name, " (", in.device(), "); got ", out.device());
  TORCH_CHECK_TYPE(out.scalar_type() == in.scalar_type(), fn, ": ", name, " must have the "
                   "dtype of ", in_name, " (", in.scalar_type(), "); got ", out.scalar_type());
  TORCH_CHECK_VALUE(out.numel() == numel, fn, ": ", name, " must have ", numel, " elements; "
                    "got ", out.numel(), " (shape ", out.sizes(), ")");
  check_contiguous(fn, name, out, true);
}

void check_outputs(const std::string& fn, const std::vector<at::Tensor>& outputs,
                   const std::string& in_list, const std::vector<at::Tensor>& inputs,
                   int64_t numel) {
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), fn, ": outputs must hold one tensor per "
                    "rank, as many as ", in_list, " (", inputs.size(), "); got ", outputs.size());
  for (size_t i = 0; i < outputs.size(); ++i) {
    check_output(fn, item("outputs", i), outputs[i], item(in_list, i), inputs[i], numel);
  }
}

int check_root(const std::string& fn, int64_t root, size_t nranks) {
  TORCH_CHECK_VALUE(root >= 0 && root < int64_t(nranks), fn, ": root must be a rank in [0, ",
                    nranks, "); got ", root);
  return int(root);
}

// A buffer the call reads or writes, for the overlap check.
struct Region {
  std::string name;
  at::Device device;
  uintptr_t lo, hi;
};

Region region(const std::string& name, const at::Tensor& t) {
  const auto lo = reinterpret_cast<uintptr_t>(t.data_ptr());
  return Region{name, t.device(), lo, lo + uintptr_t(t.numel() * t.element_size())};
}

// Region `a` may coincide exactly with the part of region `b` that starts at `b_lo` (in place).
struct Alias {
  size_t a, b;
  uintptr_t b_lo;
};

void check_disjoint(const std::string& fn, const std::vector<Region>& regions,
                    const std::vector<Alias>& aliases, const char* in_place_hint) {
  for (size_t i = 0; i < regions.size(); ++i) {
    for (size_t j = i + 1; j < regions.size(); ++j) {
      const Region& a = regions[i];
      const Region& b = regions[j];
      if (a.device != b.device || a.lo == a.hi || b.lo == b.hi) continue;
      if (a.hi <= b.lo || b.hi <= a.lo) continue;
      bool allowed = false;
      for (const Alias& al : aliases) {
        if ((al.a == i && al.b == j) || (al.a == j && al.b == i)) {
          allowed = allowed || regions[al.a].lo == al.b_lo;
        }
      }
      TORCH_CHECK_VALUE(allowed, fn, ": ", a.name, " and ", b.name, " overlap in memory (the "
                        "same tensor twice, or views of one buffer); every rank needs its own "
                        "buffer", in_place_hint);
    }
  }
}

void check_device_support(const std::string& fn, const std::vector<at::Tensor>& tensors) {
  const bool cuda = tensors[0].is_cuda();
#ifdef RINGREDUCE_WITH_CUDA
  if (cuda) {
    TORCH_CHECK(tensors.size() <= size_t(rr::cuda::kMaxRanks), fn, ": at most ",
                rr::cuda::kMaxRanks, " ranks are supported on CUDA; got ", tensors.size());
    for (const at::Tensor& t : tensors) rr::cuda::check_device_supported(t.get_device());
  }
#else
  TORCH_CHECK(!cuda, fn, ": tensors are on ", tensors[0].device(), " but this ringreduce build "
              "has no CUDA support (built CPU-only: torch without CUDA, nvcc not found, or "
              "RINGREDUCE_FORCE_CPU=1); reinstall on a machine with nvcc");
#endif
}

// streams: empty (each device's current stream), or one per rank, each None (the current
// stream of the rank's device) or a CUDA stream on the rank's device. Ranks that resolve to one
// stream run in one kernel per step; distinct streams on one device are separate lanes.
void check_streams(const std::string& fn, const Streams& streams,
                   const std::vector<at::Tensor>& ranks, const std::string& list) {
  if (streams.empty()) return;
  TORCH_CHECK_VALUE(streams.size() == ranks.size(), fn, ": streams must hold one stream (or "
                    "None) per rank, as many as ", list, " (", ranks.size(), "); got ",
                    streams.size());
  for (size_t i = 0; i < streams.size(); ++i) {
    if (!streams[i]) continue;
    TORCH_CHECK_VALUE(ranks[i].is_cuda(), fn, ": ", item("streams", i), " is given but ",
                      item(list, i), " is on ", ranks[i].device(), "; streams apply to CUDA "
                      "tensors only (pass None)");
    TORCH_CHECK_VALUE(streams[i]->device() == ranks[i].device(), fn, ": ", item("streams", i),
                      " is on ", streams[i]->device(), " but ", item(list, i), " is on ",
                      ranks[i].device());
  }
}

// The in-place writes go around autograd: tell it, as a torch in-place op would, so a tensor
// saved for backward is reported as modified instead of silently used.
void bump_versions(const std::vector<at::Tensor>& tensors) {
  for (const at::Tensor& t : tensors) {
    if (!t.is_inference()) t.unsafeGetTensorImpl()->bump_version();  // inference: no counter
  }
}

std::vector<void*> pointers(const std::vector<at::Tensor>& tensors) {
  std::vector<void*> out;
  for (const at::Tensor& t : tensors) out.push_back(t.data_ptr());
  return out;
}

#ifdef RINGREDUCE_WITH_CUDA
// The stream rank r runs on: streams[r] if given, else its device's current stream.
c10::cuda::CUDAStream rank_stream(const std::vector<at::Tensor>& ranks, const Streams& streams,
                                  size_t r) {
  if (!streams.empty() && streams[r]) return c10::cuda::CUDAStream(*streams[r]);
  return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(ranks[r].get_device()));
}
#endif

// Scratch buffers for the partial results of ranks whose inputs must stay unchanged. On CUDA
// each comes from the caching allocator on the stream of the rank that writes it (as staging
// does): allocated on the current stream, a block freed there while that stream's queued work
// still reads it could be handed out, and a rank on another stream (streams=) would write it
// before that work is done.
std::vector<at::Tensor> workspaces(const std::vector<at::Tensor>& inputs, int skip,
                                   const Streams& streams) {
  std::vector<at::Tensor> work;
  for (size_t r = 0; r < inputs.size(); ++r) {
    if (int(r) == skip) {
      work.emplace_back();
      continue;
    }
#ifdef RINGREDUCE_WITH_CUDA
    if (inputs[r].is_cuda()) {
      c10::cuda::CUDAStreamGuard on(rank_stream(inputs, streams, r));
      work.push_back(at::empty_like(inputs[r]));
      continue;
    }
#endif
    work.push_back(at::empty_like(inputs[r]));
  }
  return work;
}

// The environment's settings, read at every call with getenv (os.environ keeps the process
// environment up to date, and reading it in Python costs microseconds a call).
//   RINGREDUCE_TRANSPORT: "p2p" (kernels read the neighbour's memory where peer access allows;
//     the default) or "copy" (every hop through cudaMemcpyPeerAsync, to test and measure that
//     path on one GPU).
//   RINGREDUCE_ONESHOT_BYTES: the largest tensor (bytes per rank) the one-shot kernel
//     all-reduces when every rank runs on one CUDA stream; 0 turns it off.
constexpr int64_t kOneshotDefaultBytes = 64 * 1024;

const char* setting(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : nullptr;
}

std::string transport_setting(const std::string& fn) {
  const char* v = setting("RINGREDUCE_TRANSPORT");
  const std::string transport = v != nullptr ? v : "p2p";
  TORCH_CHECK_VALUE(transport == "p2p" || transport == "copy", fn, ": transport "
                    "(RINGREDUCE_TRANSPORT) must be 'p2p' or 'copy'; got '", transport, "'");
  return transport;
}

int64_t oneshot_setting(const std::string& fn) {
  const char* v = setting("RINGREDUCE_ONESHOT_BYTES");
  if (v == nullptr) return kOneshotDefaultBytes;
  char* end = nullptr;
  errno = 0;
  const long long bytes = std::strtoll(v, &end, 10);
  TORCH_CHECK_VALUE(errno == 0 && end != v && *end == '\0' && bytes >= 0, fn,
                    ": RINGREDUCE_ONESHOT_BYTES must be a whole number of bytes >= 0 (0 turns "
                    "the one-shot path off); got '", v, "'");
  return bytes;
}

// A two-valued setting: unset, blank or `off` is false, `on` true; anything else raises a
// ValueError saying "NAME must be CHOICES".
bool switch_setting(const std::string& fn, const char* name, const char* off, const char* on,
                    const char* choices) {
  const char* v = setting(name);
  if (v == nullptr) return false;
  const std::string value = v;
  TORCH_CHECK_VALUE(value == off || value == on, fn, ": ", name, " must be ", choices, "; got '",
                    value, "'");
  return value == on;
}

//   RINGREDUCE_FUSED: "1" runs an all-reduce that every rank runs on one stream of one GPU, with
//     the p2p transport, above the one-shot's size and outside stream capture, as the fused ring
//     kernel (fused_cuda.h: one cooperative launch instead of 2(N-1) step kernels, the ring's
//     bits), synchronously: the call waits for the kernel and raises if it reported a failure.
//     "0" or unset: the ring. Not the default until a GPU run shows it right and faster.
bool fused_setting(const std::string& fn) {
  return switch_setting(fn, "RINGREDUCE_FUSED", "0", "1",
                        "0 (the ring) or 1 (the fused ring kernel, synchronous)");
}

//   RINGREDUCE_CUDA_HALF_ROUNDING: "per_hop" (the default, the ring's bits) or "once": the list
//     API's float16 and bfloat16 sums and averages over two ranks or more on CUDA tensors are
//     rounded once, with the CPU paths' bits: an all_reduce with every rank on one stream of
//     one GPU and the p2p transport runs the once-rounded one-shot kernel at every size; every
//     other all_reduce, and reduce and reduce_scatter, run cuda_executor.h run_once_rounded.
//     Not the default until a GPU run shows it right.
bool cuda_half_once_setting(const std::string& fn) {
  return switch_setting(fn, "RINGREDUCE_CUDA_HALF_ROUNDING", "per_hop", "once",
                        "'per_hop' (the default) or 'once'");
}

// RINGREDUCE_HALF_ROUNDING (rr::cpu::half_rounding_setting): how CPU float16 and bfloat16
// sums and averages round. The CUDA paths round on every hop whatever it says, until a GPU run
// checks a once-rounded kernel.
rr::cpu::HalfRounding half_rounding_setting(const std::string& fn) {
  try {
    return rr::cpu::half_rounding_setting();
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, fn, ": ", e.what());
  }
  return rr::cpu::HalfRounding::Once;
}

// CPU float16 / bfloat16 sums and averages over two ranks or more, rounded once
// (cpu_executor.h): `run` gets the GIL released, then the written tensors' versions are bumped.
template <typename Run>
bool ran_once_rounded(const std::string& fn, const std::vector<at::Tensor>& ranks, rr::DType dtype,
                      rr::Op op, const std::vector<at::Tensor>& written, Run run) {
  // Only 16-bit float sums read the setting: no other call pays for it or fails on it.
  if (ranks[0].is_cuda() || ranks.size() < 2 || ranks[0].numel() == 0 ||
      !rr::cpu::rounds_once(dtype, op, rr::cpu::HalfRounding::Once) ||
      half_rounding_setting(fn) != rr::cpu::HalfRounding::Once) {
    return false;
  }
  {
    pybind11::gil_scoped_release no_gil;
    run();
  }
  bump_versions(written);
  return true;
}

// Runs a validated plan. `ranks` holds a tensor per rank (its device is the rank's device),
// `touched` every tensor the plan reads or writes, `written` those whose values change.
// Returns the neighbour pairs that had to be staged (no peer access); empty on CPU.
// transport: "p2p" (kernels read the neighbour's memory where peer access allows) or "copy"
// (every hop through cudaMemcpyPeerAsync, to test and measure that path on one GPU).
// An all-reduce the one-shot kernel may run instead of the plan (oneshot_cuda.h): when every
// rank runs on one stream of one device, with the p2p transport, and a rank's tensor holds at
// most `max_bytes`.
// `fused` (RINGREDUCE_FUSED): a larger one on that layout runs the fused ring kernel. `once`
// (RINGREDUCE_CUDA_HALF_ROUNDING=once, float16 / bfloat16 sum or avg, two ranks or more): the
// once-rounded one-shot runs at every size on that layout, and the once-rounded two-shot
// (cuda_executor.h run_once_rounded) on every other (several lanes, or the copy transport).
struct OneShot {
  std::vector<void*> in, out;
  int64_t count, bytes, max_bytes;
  bool fused = false;
  bool once = false;
};

// All-reduces the fused path has run in this process (_C.fused_calls, for tests: a check that
// the path ran, not the ring beside it).
std::atomic<int64_t> g_fused_calls{0};

#ifdef RINGREDUCE_WITH_CUDA
// The fused path (RINGREDUCE_FUSED): one flag buffer per device, used by one call at a time
// (the mutex is held from the launch to the end of the synchronous check, so no call's kernel
// is still running when the next one starts; any stream may then use the buffer). It only
// grows: a larger one replaces it (the old one is idle, and freed through torch's allocator).
// Its epochs count up from 1 (fused_cuda.h).
void run_fused(const rr::cuda::Lane& lane, const OneShot& a, int nranks, rr::DType dtype,
               rr::Op op, const std::string& fn) {
  struct Flags {
    at::Tensor buffer;
    uint64_t epoch = 0;
  };
  static std::mutex mu;
  // Never destroyed: freeing CUDA memory from a static destructor at exit would race the
  // CUDA runtime's own teardown.
  static auto* by_device = new std::map<int, Flags>();
  std::lock_guard<std::mutex> lock(mu);
  Flags& flags = (*by_device)[lane.device];
  try {
    const int64_t need = rr::fused_flags_bytes(
        nranks, rr::cuda::fused_max_blocks_per_rank(nranks, dtype, op));
    if (!flags.buffer.defined() || flags.buffer.numel() < need) {
      const auto dev = static_cast<c10::DeviceIndex>(lane.device);
      c10::cuda::CUDAStreamGuard on(c10::cuda::getStreamFromExternal(lane.stream, dev));
      flags.buffer = at::Tensor();
      flags.buffer = at::empty({need}, at::TensorOptions().dtype(at::kByte).device(at::kCUDA, dev));
      rr::cuda::init_fused_flags(flags.buffer.data_ptr(), need, lane.stream);
      flags.epoch = 0;
    }
    const int blocks = rr::cuda::fused_blocks_per_rank(0, nranks, a.count, dtype, op,
                                                       flags.buffer.numel());
    const uint64_t epoch = ++flags.epoch;
    std::vector<const void*> in(a.in.begin(), a.in.end());
    rr::cuda::launch_fused_all_reduce(in.data(), a.out.data(), nranks, a.count, dtype, op,
                                      blocks, flags.buffer.data_ptr(), flags.buffer.numel(),
                                      epoch, lane.stream);
    rr::cuda::check_fused_all_reduce(flags.buffer.data_ptr(), epoch, lane.stream);
    g_fused_calls.fetch_add(1, std::memory_order_relaxed);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, fn, " (RINGREDUCE_FUSED=1): ", e.what());
  } catch (const std::exception& e) {
    TORCH_CHECK(false, fn, " (RINGREDUCE_FUSED=1): ", e.what());
  }
}
#endif

// `once`: on CUDA, the once-rounded collective it describes runs instead of the plan (after the
// one-shot, which takes an all-reduce on one lane first).
std::vector<std::string> execute(const rr::Plan& plan, rr::DType dtype, rr::Op op,
                                 const std::vector<at::Tensor>& ranks,
                                 const std::vector<at::Tensor>& touched,
                                 const std::vector<at::Tensor>& written, const Streams& streams,
                                 const std::string& transport,
                                 const OneShot* oneshot = nullptr,
                                 const rr::OnceCall* once = nullptr) {
  const int nranks = int(ranks.size());
  if (plan.empty()) return {};
  if (!ranks[0].is_cuda()) {
    {
      pybind11::gil_scoped_release no_gil;
      rr::cpu::run(plan, dtype, op, nranks);
    }
    bump_versions(written);
    return {};
  }
#ifdef RINGREDUCE_WITH_CUDA
  // Like the CPU branch: nothing below touches Python objects, and other Python threads (a
  // data loader, another stream's collective) must run while this one launches and waits.
  pybind11::gil_scoped_release no_gil;
  // Restores the caller's device without creating a context on a device it never used.
  c10::cuda::CUDAGuard device_guard(ranks[0].device());
  // Lanes: the distinct (device, stream) pairs; ranks on one device with distinct streams are
  // "virtual devices", ordered by events like distinct GPUs.
  std::vector<rr::cuda::Lane> lanes;
  std::vector<c10::cuda::CUDAStream> lane_stream;
  std::vector<int> rank_lane;
  for (int r = 0; r < nranks; ++r) {
    const c10::cuda::CUDAStream s = rank_stream(ranks, streams, size_t(r));
    size_t l = 0;
    while (l < lane_stream.size() && lane_stream[l] != s) ++l;
    if (l == lane_stream.size()) {
      lanes.push_back(rr::cuda::Lane{int(s.device_index()), s.stream()});
      lane_stream.push_back(s);
    }
    rank_lane.push_back(int(l));
  }
  // Direct reads of the predecessor need peer access, enabled through torch so that its
  // allocator also maps expandable segments / memory pools for the peer. The executor asks for
  // it per pair of devices only after refusing a capture (cuda_executor.h). A pair whose access
  // cannot be enabled (get_p2p_access says no, or raises) is staged, and reported; a pair whose
  // enabling raised once stays staged (peer_memo.h: torch would answer "allowed" next time).
  std::vector<std::string> staged;
  const bool twoshot = once != nullptr;
  static rr::PeerAccessMemo peer_memo;
  const auto peer_access = [&](int device, int peer) {
    std::string why;
    const bool ok = peer_memo.get(device, peer, [](int d, int p) {
      return at::cuda::get_p2p_access(static_cast<c10::DeviceIndex>(d),
                                      static_cast<c10::DeviceIndex>(p));
    }, &why);
    if (!why.empty()) why = ": " + why;
    if (!ok) {
      for (int r = 0; r < nranks; ++r) {
        for (int p = 0; p < nranks; ++p) {
          // The ring reads a rank's predecessor; the two-shot every other rank.
          if (p == r || (!twoshot && p != (r + nranks - 1) % nranks)) continue;
          if (ranks[r].get_device() != device || ranks[p].get_device() != peer) continue;
          staged.push_back("rank " + std::to_string(r) + " (cuda:" + std::to_string(device) +
                           ") <- rank " + std::to_string(p) + " (cuda:" +
                           std::to_string(peer) + ")" + why);
        }
      }
    }
    return ok;
  };
  // A rank's buffers are touched by its own lane and its successor's (which reads them; the
  // two-shot: every lane); the exit barrier orders the own lane after those. Telling the caching allocator about
  // every lane on the tensor's device (the own lane among them) keeps a tensor the caller drops
  // right away (and the workspaces, dropped on return) from being handed out before those
  // lanes reach this point, even if it was allocated on another stream.
  for (const at::Tensor& t : touched) {
    for (size_t l = 0; l < lanes.size(); ++l) {
      if (lanes[l].device == t.get_device()) {
        c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), lane_stream[l]);
      }
    }
  }
  if (oneshot != nullptr && lanes.size() == 1 && transport == "p2p" &&
      (oneshot->once || oneshot->bytes <= oneshot->max_bytes)) {
    // One kernel instead of 2(N-1) ring steps, with the ring's bits (or, `once`, the CPU
    // paths' once-rounded bits); capturable, except on the legacy default stream while another
    // stream captures, which check_capture refuses.
    rr::cuda::run_oneshot(lanes[0], oneshot->in.data(), oneshot->out.data(), nranks,
                          oneshot->count, dtype, op, oneshot->once);
    bump_versions(written);
    return staged;
  }
  if (oneshot != nullptr && oneshot->fused && lanes.size() == 1 && transport == "p2p" &&
      !rr::cuda::check_capture(lanes.data(), 1, ranks[0].get_device())) {
    run_fused(lanes[0], *oneshot, nranks, dtype, op, "ringreduce.all_reduce");
    bump_versions(written);
    return staged;
  }
  // Staging buffers come from torch's caching allocator on the lane's own stream, the only
  // stream that touches them: released on return, they are reused only in that stream's order
  // (no host synchronisation, no growing raw allocation).
  std::vector<at::Tensor> stage_buffers;
  rr::cuda::RunOptions options;
  options.peer_access = peer_access;
  options.force_copy = transport == "copy";
  options.current_device = ranks[0].get_device();  // device_guard made it current
  options.alloc = [&](int device, cudaStream_t stream, size_t bytes) -> void* {
    const auto dev = static_cast<c10::DeviceIndex>(device);
    c10::cuda::CUDAStreamGuard on(c10::cuda::getStreamFromExternal(stream, dev));
    stage_buffers.push_back(at::empty({int64_t(bytes)},
                                      at::TensorOptions().dtype(at::kByte).device(at::kCUDA, dev)));
    return stage_buffers.back().data_ptr();
  };
  if (twoshot) {
    // The once-rounded sums in two halves (an all-reduce here: several lanes, or the copy
    // transport), with the CPU paths' bits.
    rr::cuda::run_once_rounded(*once, rank_lane.data(), lanes.data(), int(lanes.size()), dtype,
                               op, options);
    bump_versions(written);
    return staged;
  }
  rr::cuda::run(plan, rank_lane.data(), nranks, lanes.data(), int(lanes.size()), dtype, op,
                options);
  bump_versions(written);
  return staged;
#else
  return {};
#endif
}

std::vector<at::Tensor> defined(std::vector<at::Tensor> tensors) {
  std::vector<at::Tensor> out;
  for (at::Tensor& t : tensors) {
    if (t.defined()) out.push_back(std::move(t));
  }
  return out;
}

std::vector<at::Tensor> concat(std::vector<at::Tensor> a, const std::vector<at::Tensor>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return defined(std::move(a));
}

// No outputs: in place. Otherwise outputs[r] may be tensors[r] itself (in place for that
// rank) and must not overlap anything else.
std::vector<std::string> all_reduce(const std::vector<at::Tensor>& tensors,
                                    const std::optional<std::vector<at::Tensor>>& outputs_arg,
                                    const std::string& op_name, const Streams& streams) {
  const std::string fn = "ringreduce.all_reduce";
  const bool in_place = !outputs_arg;
  const std::vector<at::Tensor> outputs = in_place ? std::vector<at::Tensor>() : *outputs_arg;
  const std::string transport = transport_setting(fn);
  const int64_t oneshot_max_bytes = oneshot_setting(fn);
  const bool fused = fused_setting(fn);
  const bool cuda_half_once = cuda_half_once_setting(fn);
  check_ranks(fn, "tensors", tensors, in_place);
  const rr::DType dtype = rr::dtype_of(tensors[0], fn, "tensors");
  const rr::Op op = rr::op_for(op_name, dtype, fn);
  if (!in_place) check_outputs(fn, outputs, "tensors", tensors, tensors[0].numel());
  std::vector<Region> regions;
  std::vector<Alias> aliases;
  for (size_t i = 0; i < tensors.size(); ++i) {
    regions.push_back(region(item("tensors", i), tensors[i]));
  }
  for (size_t i = 0; i < outputs.size(); ++i) {
    regions.push_back(region(item("outputs", i), outputs[i]));
    aliases.push_back(Alias{tensors.size() + i, i, regions[i].lo});
  }
  check_disjoint(fn, regions, aliases, in_place ? "" : " (outputs[i] may be tensors[i] itself)");
  check_device_support(fn, tensors);
  check_streams(fn, streams, tensors, "tensors");

  const std::vector<at::Tensor>& out = in_place ? tensors : outputs;
  const std::vector<void*> in_ptrs = pointers(tensors), out_ptrs = pointers(out);
  if (ran_once_rounded(fn, tensors, dtype, op, out, [&] {
        rr::cpu::all_reduce_once(in_ptrs.data(), out_ptrs.data(), int(tensors.size()),
                                 tensors[0].numel(), dtype, op);
      })) {
    return {};
  }
  const rr::Plan plan = rr::all_reduce_plan(in_ptrs.data(), out_ptrs.data(), int(tensors.size()),
                                            tensors[0].numel(), tensors[0].element_size());
  const bool once = cuda_half_once && tensors.size() >= 2 && rr::oneshot_rounds_once(dtype, op);
  const OneShot oneshot{in_ptrs, out_ptrs, tensors[0].numel(),
                        tensors[0].numel() * tensors[0].element_size(), oneshot_max_bytes, fused,
                        once};
  rr::OnceCall call;
  if (once) {
    call.kind = rr::OnceCall::AllReduce;
    call.in = in_ptrs.data();
    call.out = out_ptrs.data();
    call.nranks = int(tensors.size());
    call.count = tensors[0].numel();
  }
  return execute(plan, dtype, op, tensors, concat(tensors, outputs), out, streams, transport,
                 &oneshot, once ? &call : nullptr);
}

std::vector<std::string> reduce(const std::vector<at::Tensor>& inputs,
                                const std::optional<at::Tensor>& output_arg, int64_t root_arg,
                                const std::string& op_name, const Streams& streams) {
  const std::string fn = "ringreduce.reduce";
  const std::string transport = transport_setting(fn);
  const bool cuda_half_once = cuda_half_once_setting(fn);
  check_ranks(fn, "inputs", inputs, false);
  const int root = check_root(fn, root_arg, inputs.size());
  const rr::DType dtype = rr::dtype_of(inputs[0], fn, "inputs");
  const rr::Op op = rr::op_for(op_name, dtype, fn);
  const at::Tensor output = output_arg ? *output_arg : inputs[size_t(root)];
  check_output(fn, "output", output, item("inputs", size_t(root)), inputs[size_t(root)],
               inputs[0].numel());
  std::vector<Region> regions;
  for (size_t i = 0; i < inputs.size(); ++i) {
    regions.push_back(region(item("inputs", i), inputs[i]));
  }
  regions.push_back(region("output", output));
  check_disjoint(fn, regions, {Alias{inputs.size(), size_t(root), regions[size_t(root)].lo}},
                 " (output may be inputs[root] itself)");
  check_device_support(fn, inputs);
  check_streams(fn, streams, inputs, "inputs");

  const std::vector<void*> in_ptrs = pointers(inputs);
  // output may be inputs[root] itself: the same elements, which sum_rounded_once allows.
  if (ran_once_rounded(fn, inputs, dtype, op, {output}, [&] {
        rr::cpu::sum_rounded_once(dtype, op, output.data_ptr(), in_ptrs.data(),
                                  int(inputs.size()), inputs[0].numel());
      })) {
    return {};
  }
  const std::vector<at::Tensor> work = workspaces(inputs, root, streams);
  std::vector<void*> work_ptrs;
  for (const at::Tensor& w : work) work_ptrs.push_back(w.defined() ? w.data_ptr() : nullptr);
  const rr::Plan plan = rr::reduce_plan(in_ptrs.data(), output.data_ptr(), work_ptrs.data(), root,
                                        int(inputs.size()), inputs[0].numel(),
                                        inputs[0].element_size());
  // RINGREDUCE_CUDA_HALF_ROUNDING=once: every rank sums its chunk of every input once-rounded
  // (the root into its output, the others into their workspaces), then the root gathers.
  const bool once = cuda_half_once && inputs.size() >= 2 && rr::oneshot_rounds_once(dtype, op);
  void* const once_out[1] = {output.data_ptr()};
  rr::OnceCall call;
  if (once) {
    call.kind = rr::OnceCall::Reduce;
    call.in = in_ptrs.data();
    call.out = once_out;
    call.work = work_ptrs.data();
    call.nranks = int(inputs.size());
    call.count = inputs[0].numel();
    call.root = root;
  }
  return execute(plan, dtype, op, inputs, concat(concat(inputs, {output}), work), {output},
                 streams, transport, nullptr, once ? &call : nullptr);
}

std::vector<std::string> broadcast(const std::vector<at::Tensor>& tensors, int64_t root_arg,
                                   const Streams& streams) {
  const std::string fn = "ringreduce.broadcast";
  const std::string transport = transport_setting(fn);
  check_ranks(fn, "inputs", tensors, true);
  const int root = check_root(fn, root_arg, tensors.size());
  const rr::DType dtype = rr::dtype_of(tensors[0], fn, "inputs");
  std::vector<Region> regions;
  for (size_t i = 0; i < tensors.size(); ++i) {
    regions.push_back(region(item("inputs", i), tensors[i]));
  }
  check_disjoint(fn, regions, {}, "");
  check_device_support(fn, tensors);
  check_streams(fn, streams, tensors, "inputs");

  std::vector<at::Tensor> written;
  for (size_t r = 0; r < tensors.size(); ++r) {
    if (int(r) != root) written.push_back(tensors[r]);
  }
  const std::vector<void*> ptrs = pointers(tensors);
  const rr::Plan plan = rr::broadcast_plan(ptrs.data(), root, int(tensors.size()),
                                           tensors[0].numel(), tensors[0].element_size());
  return execute(plan, dtype, rr::Op::Sum, tensors, tensors, written, streams, transport);
}

// Regions of inputs then outputs; inputs[r] may be block r of outputs[r] (in place, as NCCL).
void check_block_disjoint(const std::string& fn, const std::vector<at::Tensor>& inputs,
                          const std::vector<at::Tensor>& outputs, int64_t block_bytes,
                          bool input_is_block) {
  std::vector<Region> regions;
  std::vector<Alias> aliases;
  const size_t n = inputs.size();
  for (size_t i = 0; i < n; ++i) regions.push_back(region(item("inputs", i), inputs[i]));
  for (size_t i = 0; i < n; ++i) regions.push_back(region(item("outputs", i), outputs[i]));
  for (size_t i = 0; i < n; ++i) {
    // all_gather: inputs[i] may be block i of outputs[i]; reduce_scatter: the other way round.
    const size_t block = input_is_block ? i : n + i, whole = input_is_block ? n + i : i;
    aliases.push_back(Alias{block, whole, regions[whole].lo + uintptr_t(int64_t(i) * block_bytes)});
  }
  check_disjoint(fn, regions, aliases, input_is_block
                     ? " (inputs[i] may be block i of outputs[i] itself)"
                     : " (outputs[i] may be block i of inputs[i] itself)");
}

std::vector<std::string> all_gather(const std::vector<at::Tensor>& inputs,
                                    const std::vector<at::Tensor>& outputs,
                                    const Streams& streams) {
  const std::string fn = "ringreduce.all_gather";
  const std::string transport = transport_setting(fn);
  check_ranks(fn, "inputs", inputs, false);
  const rr::DType dtype = rr::dtype_of(inputs[0], fn, "inputs");
  const int64_t count = inputs[0].numel();
  const int nranks = int(inputs.size());
  check_outputs(fn, outputs, "inputs", inputs, count * nranks);
  check_block_disjoint(fn, inputs, outputs, count * inputs[0].element_size(), true);
  check_device_support(fn, inputs);
  check_streams(fn, streams, inputs, "inputs");

  const std::vector<void*> in_ptrs = pointers(inputs), out_ptrs = pointers(outputs);
  const rr::Plan plan = rr::all_gather_plan(in_ptrs.data(), out_ptrs.data(), nranks, count,
                                            inputs[0].element_size());
  return execute(plan, dtype, rr::Op::Sum, inputs, concat(inputs, outputs), outputs, streams,
                 transport);
}

std::vector<std::string> reduce_scatter(const std::vector<at::Tensor>& inputs,
                                        const std::vector<at::Tensor>& outputs,
                                        const std::string& op_name, const Streams& streams) {
  const std::string fn = "ringreduce.reduce_scatter";
  const std::string transport = transport_setting(fn);
  const bool cuda_half_once = cuda_half_once_setting(fn);
  check_ranks(fn, "inputs", inputs, false);
  const rr::DType dtype = rr::dtype_of(inputs[0], fn, "inputs");
  const rr::Op op = rr::op_for(op_name, dtype, fn);
  const int nranks = int(inputs.size());
  const int64_t count = inputs[0].numel() / nranks;
  TORCH_CHECK_VALUE(inputs[0].numel() % nranks == 0, fn, ": every input must hold one block "
                    "per rank (a multiple of ", nranks, " elements); inputs[0] has ",
                    inputs[0].numel());
  check_outputs(fn, outputs, "inputs", inputs, count);
  check_block_disjoint(fn, inputs, outputs, count * inputs[0].element_size(), false);
  check_device_support(fn, inputs);
  check_streams(fn, streams, inputs, "inputs");

  const std::vector<void*> in_ptrs = pointers(inputs), out_ptrs = pointers(outputs);
  if (ran_once_rounded(fn, inputs, dtype, op, outputs, [&] {
        rr::cpu::reduce_scatter_once(in_ptrs.data(), out_ptrs.data(), nranks, count, dtype, op);
      })) {
    return {};
  }
  const std::vector<at::Tensor> work = workspaces(inputs, nranks == 1 ? 0 : -1, streams);
  std::vector<void*> work_ptrs;
  for (const at::Tensor& w : work) work_ptrs.push_back(w.defined() ? w.data_ptr() : nullptr);
  const rr::Plan plan = rr::reduce_scatter_plan(in_ptrs.data(), out_ptrs.data(), work_ptrs.data(),
                                                nranks, count, inputs[0].element_size());
  // RINGREDUCE_CUDA_HALF_ROUNDING=once: every rank sums its block of every input once-rounded.
  const bool once = cuda_half_once && nranks >= 2 && rr::oneshot_rounds_once(dtype, op);
  rr::OnceCall call;
  if (once) {
    call.kind = rr::OnceCall::ReduceScatter;
    call.in = in_ptrs.data();
    call.out = out_ptrs.data();
    call.nranks = nranks;
    call.count = count;
  }
  return execute(plan, dtype, op, inputs, concat(concat(inputs, outputs), work), outputs,
                 streams, transport, nullptr, once ? &call : nullptr);
}

// Test and measurement hook for the fused ring kernel (fused_cuda.h), beside the path of
// all_reduce that RINGREDUCE_FUSED=1 selects: in-place all-reduce of `tensors` (one CUDA
// device, contiguous, same dtype and size) on the device's current stream with
// `blocks_per_rank` blocks a rank (0: the suggested count, capped by what `flags` holds:
// rr::fused_blocks_per_rank in launch.h), the caller's zeroed
// uint8 `flags` tensor on that device and an `epoch` greater than every earlier one on it.
// Synchronises and raises if the kernel reported a failure. Returns the blocks per rank it used.
int64_t fused_all_reduce(const std::vector<at::Tensor>& tensors, const std::string& op_name,
                         int64_t blocks_per_rank, const at::Tensor& flags, int64_t epoch,
                         double timeout_s) {
  const std::string fn = "ringreduce._C.fused_all_reduce";
  check_ranks(fn, "tensors", tensors, true);
  const rr::DType dtype = rr::dtype_of(tensors[0], fn, "tensors");
  [[maybe_unused]] const rr::Op op = rr::op_for(op_name, dtype, fn);  // checked on every build
  TORCH_CHECK_VALUE(tensors[0].is_cuda(), fn, ": needs CUDA tensors");
  for (const at::Tensor& t : tensors) {
    TORCH_CHECK_VALUE(t.device() == tensors[0].device(), fn, ": every tensor must be on ",
                      tensors[0].device(), " (ranks on one GPU); got ", t.device());
  }
  TORCH_CHECK_VALUE(flags.device() == tensors[0].device() && flags.scalar_type() == at::kByte &&
                    flags.is_contiguous(), fn, ": flags must be a contiguous uint8 tensor on ",
                    tensors[0].device());
  TORCH_CHECK_VALUE(epoch >= 1, fn, ": epoch must be >= 1; got ", epoch);
  TORCH_CHECK_VALUE(timeout_s > 0, fn, ": timeout_s must be > 0; got ", timeout_s);
#ifdef RINGREDUCE_WITH_CUDA
  c10::cuda::CUDAGuard guard(tensors[0].device());
  const int nranks = int(tensors.size());
  const int64_t count = tensors[0].numel();
  int blocks = 0;
  try {
    blocks = rr::cuda::fused_blocks_per_rank(int(std::min<int64_t>(blocks_per_rank, 1 << 30)),
                                             nranks, count, dtype, op, flags.numel());
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, fn, ": ", e.what());
  }
  const std::vector<void*> ptrs = pointers(tensors);
  std::vector<const void*> in(ptrs.begin(), ptrs.end());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  try {
    rr::cuda::launch_fused_all_reduce(in.data(), ptrs.data(), nranks, count, dtype, op, blocks,
                                      flags.data_ptr(), flags.numel(), uint64_t(epoch), stream,
                                      uint64_t(timeout_s * 1e9));
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, fn, ": ", e.what());
  }
  rr::cuda::check_fused_all_reduce(flags.data_ptr(), uint64_t(epoch), stream);
  bump_versions(tensors);
  return blocks;
#else
  TORCH_CHECK(false, fn, ": this build has no CUDA support");
  return 0;
#endif
}

pybind11::dict build_info() {
  pybind11::dict info;
#ifdef RINGREDUCE_WITH_CUDA
  info["cuda"] = true;
  info["cuda_compiled_version"] = std::to_string(CUDART_VERSION / 1000) + "." +
                                  std::to_string((CUDART_VERSION % 1000) / 10);
#else
  info["cuda"] = false;
  info["cuda_compiled_version"] = pybind11::none();
#endif
  info["arch_list"] = std::string(RINGREDUCE_ARCH_LIST);
#ifdef RINGREDUCE_DEBUG
  info["debug"] = true;
#else
  info["debug"] = false;
#endif
  return info;
}

pybind11::dict peer_access() {
  pybind11::dict report;
#ifdef RINGREDUCE_WITH_CUDA
  const int n = rr::cuda::device_count();
  pybind11::list names;
  for (int i = 0; i < n; ++i) names.append(rr::cuda::device_name(i));
  report["devices"] = names;
  report["can_access_peer"] = rr::cuda::peer_access_matrix();
#else
  report["devices"] = pybind11::list();
  report["can_access_peer"] = pybind11::list();
#endif
  return report;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ringreduce: ring collectives over one tensor per rank (internal; use ringreduce.*)";
  // Each validates every argument before anything is modified and returns the neighbour pairs
  // staged without P2P.
  m.def("all_reduce", &all_reduce, pybind11::arg("tensors"), pybind11::arg("outputs"),
        pybind11::arg("op"), pybind11::arg("streams"));
  m.def("reduce", &reduce, pybind11::arg("inputs"), pybind11::arg("output"),
        pybind11::arg("root"), pybind11::arg("op"), pybind11::arg("streams"));
  m.def("broadcast", &broadcast, pybind11::arg("inputs"), pybind11::arg("root"),
        pybind11::arg("streams"));
  m.def("all_gather", &all_gather, pybind11::arg("inputs"), pybind11::arg("outputs"),
        pybind11::arg("streams"));
  m.def("reduce_scatter", &reduce_scatter, pybind11::arg("inputs"), pybind11::arg("outputs"),
        pybind11::arg("op"), pybind11::arg("streams"));
  // The environment's settings as the next call would read them (raises on bad values).
  m.def("settings", [] {
    pybind11::dict d;
    d["transport"] = transport_setting("ringreduce.settings");
    d["oneshot_max_bytes"] = oneshot_setting("ringreduce.settings");
    d["fused"] = fused_setting("ringreduce.settings");
    d["cuda_half_rounding"] = cuda_half_once_setting("ringreduce.settings") ? "once" : "per_hop";
    d["half_rounding"] = rr::cpu::half_rounding_name(half_rounding_setting("ringreduce.settings"));
    return d;
  });
  m.attr("ONESHOT_DEFAULT_BYTES") = kOneshotDefaultBytes;
  m.def("fused_all_reduce", &fused_all_reduce, pybind11::arg("tensors"), pybind11::arg("op"),
        pybind11::arg("blocks_per_rank"), pybind11::arg("flags"), pybind11::arg("epoch"),
        pybind11::arg("timeout_s") = 10.0);
  m.def("fused_flags_bytes", &rr::fused_flags_bytes);
  m.def("fused_calls", [] { return g_fused_calls.load(std::memory_order_relaxed); },
        "All-reduces the fused path (RINGREDUCE_FUSED=1) has run in this process.");
  m.def("build_info", &build_info);
  // For tests: the float sum loops that ran last in this process (cpu_executor.h).
  m.def("cpu_simd_ran", []() -> pybind11::object {
    static const char* const kNames[] = {"baseline", "avx2", "avx512"};
    const int width = rr::cpu::simd_width_ran();
    if (width < 0) return pybind11::none();
    return pybind11::str(kNames[width]);
  });
  m.def("peer_access", &peer_access);
}
