// The multi-process executors behind one rank of a process group, for torch tensors: a
// HostGroup (the shared segments), its point-to-point channels and, on CUDA, the peers' device
// staging areas. Validates tensors, naming the argument and the rule, before anything is
// touched, then hands raw pointers to the torch-free executors. Used by the C++ backend
// (backend.h) and, through the binding, by ringreduce/hierarchy.py.
//
// Locking: collectives take mu_, point-to-point takes p2p_mu_ (never both, except close(), which
// takes mu_ first). abort() and fail() take neither: they mark the group failed, which stops a
// wait in progress in another thread within ~50 ms. Nothing here touches Python; the binding
// releases the GIL before calling a method that may wait.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../ring/types.h"
#include "../torch_types.h"
#include "cpu_collectives.h"
#include "host_group.h"
#include "p2p.h"

#ifdef RINGREDUCE_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "cuda_collectives.h"
#endif

namespace rr {
namespace dist {
namespace comm_detail {


inline rr::DType to_dtype(const at::Tensor& t, const char* fn, const char* arg) {
  return rr::dtype_in(t, arg, "ringreduce ", fn);
}

inline rr::Op to_op(const std::string& op, rr::DType dtype, const char* fn) {
  return rr::op_in(op, dtype, "ringreduce ", fn);
}

inline void check_dense(const at::Tensor& t, const char* fn, const char* arg) {
  TORCH_CHECK_VALUE(t.defined(), "ringreduce ", fn, ": ", arg, " is undefined");
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, "ringreduce ", fn, ": ", arg, " has layout ",
                    t.layout(), "; only dense (strided) tensors are supported");
  TORCH_CHECK_VALUE(t.is_cpu() || t.is_cuda(), "ringreduce ", fn, ": ", arg, " is on ",
                    t.device(), "; only cpu and cuda tensors are supported");
  TORCH_CHECK_VALUE(t.is_contiguous(), "ringreduce ", fn, ": ", arg, " must be contiguous");
}

inline int64_t nbytes(const at::Tensor& t) { return t.numel() * int64_t(t.element_size()); }

#ifndef RINGREDUCE_WITH_CUDA
[[noreturn]] inline void no_cuda(const char* fn) {
  TORCH_CHECK(false, "ringreduce ", fn, ": the tensor is on CUDA but this ringreduce build has "
              "no CUDA support (built CPU-only: torch without CUDA, nvcc not found, or "
              "RINGREDUCE_FORCE_CPU=1)");
}
#endif

inline bool overlaps(const at::Tensor& a, const at::Tensor& b) {
  if (nbytes(a) == 0 || nbytes(b) == 0) return false;
  const auto a_lo = reinterpret_cast<uintptr_t>(a.data_ptr());
  const auto b_lo = reinterpret_cast<uintptr_t>(b.data_ptr());
  return a_lo < b_lo + uintptr_t(nbytes(b)) && b_lo < a_lo + uintptr_t(nbytes(a));
}

// The byte-moving collectives (gather, scatter, all-to-all, send/recv) take host tensors: the
// backend stages CUDA tensors through host memory before and after.
inline void check_host(const at::Tensor& t, const char* fn, const std::string& arg) {
  check_dense(t, fn, arg.c_str());
  TORCH_CHECK_VALUE(t.is_cpu(), "ringreduce ", fn, ": ", arg, " is on ", t.device(), "; this "
                    "executor takes host tensors (the backend stages CUDA tensors)");
}

// `t`, or a copy of it where it overlaps one of `others` (other than being `allowed` itself):
// a later round would otherwise read bytes an earlier one overwrote.
inline at::Tensor unaliased(const at::Tensor& t, const std::vector<at::Tensor>& others,
                     const at::Tensor* allowed) {
  for (const at::Tensor& o : others) {
    const bool same = &o == allowed && o.data_ptr() == t.data_ptr() && nbytes(o) == nbytes(t);
    if (!same && overlaps(o, t)) return t.clone(at::MemoryFormat::Contiguous);
  }
  return t;
}

// Hidden: used only inside this extension (pybind11's own types are hidden).
class __attribute__((visibility("hidden"))) Comm {
 public:
  // `cuda_capacity`: bytes of the device staging area a CUDA collective allocates on first use.
  Comm(int rank, int nranks, int64_t capacity, double timeout_s, const std::string& tag,
       int64_t cuda_capacity)
      : g_(rank, nranks, capacity, timeout_s, tag), cuda_capacity_(cuda_capacity), p2p_(g_) {}

  std::string name() const { return g_.name(); }
  int rank() const { return g_.rank(); }
  int size() const { return g_.nranks(); }
  bool closed() const { return g_.closed(); }

  void attach(const std::vector<std::string>& names) {
    const std::lock_guard<std::mutex> held(mu_);
    g_.attach(names);
  }
  void unlink() {
    const std::lock_guard<std::mutex> held(mu_);
    g_.unlink();
  }
  void set_timeout(double seconds) {
    const std::lock_guard<std::mutex> held(mu_);
    g_.set_timeout(seconds);
    p2p_.set_timeout(g_.timeout());
  }
  void close() {
    const std::lock_guard<std::mutex> held(mu_);
#ifdef RINGREDUCE_WITH_CUDA
    if (peers_) {
      c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(rr::dist::cuda::device_of(*peers_)));
      peers_.reset();
    }
#endif
    p2p_.interrupt();
    const std::lock_guard<std::mutex> p2p_held(p2p_mu_);
    g_.close();
  }
  void abort() {
    g_.fail("ringreduce: the process group was aborted on rank " + std::to_string(g_.rank()) +
            " (ProcessGroup.abort)");
  }
  // Whether every rank drives a distinct GPU: 1 yes, 0 no, -1 before the first CUDA collective.
  int cuda_distinct_gpus() {
    int answer = -1;
#ifdef RINGREDUCE_WITH_CUDA
    const std::lock_guard<std::mutex> held(mu_);
    if (peers_) answer = rr::dist::cuda::distinct_gpus(*peers_) ? 1 : 0;
#endif
    return answer;
  }
  // Marks the group failed with `message` (an error outside the executors, e.g. in the
  // progress thread): peers waiting on this rank fail at once, naming it. Lock-free, like abort.
  void fail(const std::string& message) { g_.fail(message); }
  // Whether a peer's group has failed (HostGroup::aborted_peer); lock-free, like fail: any
  // thread, any time, while a collective runs.
  bool aborted_peer(int& peer, std::string& message) { return g_.aborted_peer(peer, message); }

  // The argument checks of a collective, without running it: the backend calls this in the
  // caller's thread, so that a bad argument raises there (before anything is queued or
  // touched) instead of failing the group from the progress thread. `op` empty: no reduction.
  void check(const at::Tensor& t, const std::string& op_name, const std::string& fn,
             const std::string& arg) const {
    TORCH_CHECK_VALUE(t.defined(), "ringreduce ", fn, ": ", arg, " is undefined");
    TORCH_CHECK_VALUE(t.layout() == at::kStrided, "ringreduce ", fn, ": ", arg, " has layout ",
                      t.layout(), "; only dense (strided) tensors are supported");
    TORCH_CHECK_VALUE(t.is_cpu() || t.is_cuda(), "ringreduce ", fn, ": ", arg, " is on ",
                      t.device(), "; only cpu and cuda tensors are supported");
#ifndef RINGREDUCE_WITH_CUDA
    if (t.is_cuda()) no_cuda(fn.c_str());
#endif
    if (!op_name.empty()) to_op(op_name, to_dtype(t, fn.c_str(), arg.c_str()), fn.c_str());
  }

  // The path an all_reduce of `t` with `op` would take on host memory here: "small",
  // "two_shot" or "ring" (cpu_collectives.h), the same on every rank of the group.
  std::string all_reduce_path(const at::Tensor& t, const std::string& op_name) const {
    const char* fn = "all_reduce_path";
    check(t, op_name, fn, "tensor");
    TORCH_CHECK_VALUE(t.is_cpu(), "ringreduce all_reduce_path: the paths named are those of host "
                      "memory; got a tensor on ", t.device());
    const rr::DType dtype = to_dtype(t, fn, "tensor");
    return rr::dist::cpu::path_name(
        rr::dist::cpu::all_reduce_path(g_, t.numel(), dtype, to_op(op_name, dtype, fn)));
  }

  void all_reduce(const at::Tensor& t, const std::string& op_name) {
    const char* fn = "all_reduce";
    check_dense(t, fn, "tensor");
    const rr::DType dtype = to_dtype(t, fn, "tensor");
    const rr::Op op = to_op(op_name, dtype, fn);
    const std::lock_guard<std::mutex> held(mu_);
    if (t.is_cuda()) {
#ifdef RINGREDUCE_WITH_CUDA
      c10::cuda::CUDAGuard guard(t.device());
      CudaCall c = cuda_call(t, fn);
      rr::dist::cuda::all_reduce(g_, *c.peers, t.data_ptr(), t.numel(), dtype, op, c.stream);
      return;
#else
      no_cuda(fn);
#endif
    }
    rr::dist::cpu::all_reduce(g_, t.data_ptr(), t.numel(), dtype, op);
  }

  void broadcast(const at::Tensor& t, int root) {
    const char* fn = "broadcast";
    check_dense(t, fn, "tensor");
    TORCH_CHECK_VALUE(root >= 0 && root < g_.nranks(), "ringreduce broadcast: root must be in "
                      "[0, ", g_.nranks(), "); got ", root);
    const std::lock_guard<std::mutex> held(mu_);
    if (t.is_cuda()) {
#ifdef RINGREDUCE_WITH_CUDA
      c10::cuda::CUDAGuard guard(t.device());
      CudaCall c = cuda_call(t, fn);
      rr::dist::cuda::broadcast(g_, *c.peers, t.data_ptr(), nbytes(t), root, c.stream);
      return;
#else
      no_cuda(fn);
#endif
    }
    rr::dist::cpu::broadcast(g_, t.data_ptr(), nbytes(t), root);
  }

  void all_gather(const std::vector<at::Tensor>& outs, const at::Tensor& input) {
    const char* fn = "all_gather";
    check_dense(input, fn, "input");
    TORCH_CHECK_VALUE(int(outs.size()) == g_.nranks(), "ringreduce all_gather: the output list "
                      "must hold one tensor per rank (", g_.nranks(), "); got ", outs.size());
    std::vector<void*> ptrs;
    for (size_t i = 0; i < outs.size(); ++i) {
      const std::string arg = "output[" + std::to_string(i) + "]";
      check_dense(outs[i], fn, arg.c_str());
      TORCH_CHECK_VALUE(outs[i].device() == input.device(), "ringreduce all_gather: ", arg,
                        " is on ", outs[i].device(), " but the input is on ", input.device());
      TORCH_CHECK_TYPE(outs[i].scalar_type() == input.scalar_type(), "ringreduce all_gather: ",
                       arg, " has dtype ", outs[i].scalar_type(), " but the input has ",
                       input.scalar_type());
      TORCH_CHECK_VALUE(outs[i].numel() == input.numel(), "ringreduce all_gather: ", arg,
                        " has ", outs[i].numel(), " elements but the input has ", input.numel());
      ptrs.push_back(outs[i].data_ptr());
    }
    // The input may be exactly this rank's output slot (all_gather_into_tensor in place). Any
    // other overlap with an output goes through a copy: a later round would read overwritten
    // input.
    const int me = g_.rank();
    bool clash = false;
    for (int q = 0; q < g_.nranks(); ++q) {
      const bool own_slot = q == me && outs[size_t(q)].data_ptr() == input.data_ptr();
      clash = clash || (!own_slot && overlaps(outs[size_t(q)], input));
    }
    const at::Tensor in = clash ? input.clone(at::MemoryFormat::Contiguous) : input;
    const std::lock_guard<std::mutex> held(mu_);
    if (in.is_cuda()) {
#ifdef RINGREDUCE_WITH_CUDA
      c10::cuda::CUDAGuard guard(in.device());
      CudaCall c = cuda_call(in, fn);
      for (const at::Tensor& o : outs) record(o);
      rr::dist::cuda::all_gather(g_, *c.peers, in.data_ptr(), ptrs.data(), nbytes(in), c.stream);
      return;
#else
      no_cuda(fn);
#endif
    }
    rr::dist::cpu::all_gather(g_, in.data_ptr(), ptrs.data(), nbytes(in));
  }

  void reduce_scatter(const at::Tensor& out, const at::Tensor& in, const std::string& op_name) {
    const char* fn = "reduce_scatter";
    check_dense(out, fn, "output");
    check_dense(in, fn, "input");
    const rr::DType dtype = to_dtype(in, fn, "input");
    const rr::Op op = to_op(op_name, dtype, fn);
    TORCH_CHECK_VALUE(out.device() == in.device(), "ringreduce reduce_scatter: output is on ",
                      out.device(), " but input is on ", in.device());
    TORCH_CHECK_TYPE(out.scalar_type() == in.scalar_type(), "ringreduce reduce_scatter: output "
                     "has dtype ", out.scalar_type(), " but input has ", in.scalar_type());
    TORCH_CHECK_VALUE(in.numel() == out.numel() * g_.nranks(), "ringreduce reduce_scatter: "
                      "input must hold world size (", g_.nranks(), ") x output elements (",
                      out.numel(), "); got ", in.numel());
    // Both executors stage each round's input before writing that round's output, so only
    // this rank's own segment (reduce_scatter_tensor in place) is safe; any other overlap goes
    // through a scratch output.
    const bool own_segment = static_cast<const char*>(out.data_ptr()) ==
                             static_cast<const char*>(in.data_ptr()) + g_.rank() * nbytes(out);
    const bool scratch = overlaps(out, in) && !own_segment;
    const at::Tensor dst = scratch ? at::empty_like(out) : out;
    const std::lock_guard<std::mutex> held(mu_);
    if (in.is_cuda()) {
#ifdef RINGREDUCE_WITH_CUDA
      c10::cuda::CUDAGuard guard(in.device());
      CudaCall c = cuda_call(in, fn);
      record(out);
      rr::dist::cuda::reduce_scatter(g_, *c.peers, in.data_ptr(), dst.data_ptr(), out.numel(),
                                     dtype, op, c.stream);
      if (scratch) out.copy_(dst);
      return;
#else
      no_cuda(fn);
#endif
    }
    rr::dist::cpu::reduce_scatter(g_, in.data_ptr(), dst.data_ptr(), out.numel(), dtype, op);
    if (scratch) out.copy_(dst);
  }

  void barrier() {
    const std::lock_guard<std::mutex> held(mu_);
    rr::dist::cpu::barrier(g_);
  }

  // outs: one tensor per rank on the root, empty elsewhere.
  void gather(const std::vector<at::Tensor>& outs, const at::Tensor& input, int root) {
    const char* fn = "gather";
    check_host(input, fn, "input");
    check_root(root, fn);
    const std::vector<void*> ptrs = root_list(outs, root, fn, "gather_list", input, "input");
    const at::Tensor in = outs.empty() ? input : unaliased(input, outs, &outs[size_t(root)]);
    const std::lock_guard<std::mutex> held(mu_);
    rr::dist::cpu::gather(g_, in.data_ptr(), ptrs.data(), nbytes(in), root);
  }

  // ins: one tensor per rank on the root, empty elsewhere.
  void scatter(const at::Tensor& out, const std::vector<at::Tensor>& ins, int root) {
    const char* fn = "scatter";
    check_host(out, fn, "output");
    check_root(root, fn);
    const std::vector<void*> ptrs = root_list(ins, root, fn, "scatter_list", out, "output");
    const at::Tensor dst = ins.empty() ? out : unaliased(out, ins, &ins[size_t(root)]);
    const std::lock_guard<std::mutex> held(mu_);
    rr::dist::cpu::scatter(g_, ptrs.data(), dst.data_ptr(), nbytes(out), root);
    if (!dst.is_same(out)) out.copy_(dst);
  }

  // ins[q] goes to rank q; outs[p] receives rank p's. Sizes may differ per pair.
  void all_to_all(const std::vector<at::Tensor>& outs, const std::vector<at::Tensor>& ins) {
    const char* fn = "all_to_all";
    const size_t n = size_t(g_.nranks());
    TORCH_CHECK_VALUE(outs.size() == n && ins.size() == n, "ringreduce all_to_all: the input "
                      "and output lists must hold one tensor per rank (", n, "); got ",
                      ins.size(), " inputs and ", outs.size(), " outputs");
    std::vector<at::Tensor> sources;
    std::vector<const void*> in_ptrs;
    std::vector<void*> out_ptrs;
    std::vector<int64_t> in_bytes, out_bytes;
    for (size_t q = 0; q < n; ++q) {
      check_host(ins[q], fn, "input[" + std::to_string(q) + "]");
      check_host(outs[q], fn, "output[" + std::to_string(q) + "]");
    }
    for (size_t q = 0; q < n; ++q) {
      sources.push_back(unaliased(ins[q], outs, q == size_t(g_.rank()) ? &outs[q] : nullptr));
      in_ptrs.push_back(sources.back().data_ptr());
      in_bytes.push_back(nbytes(ins[q]));
      out_ptrs.push_back(outs[q].data_ptr());
      out_bytes.push_back(nbytes(outs[q]));
    }
    const std::lock_guard<std::mutex> held(mu_);
    rr::dist::cpu::all_to_all(g_, in_ptrs.data(), in_bytes.data(), out_ptrs.data(),
                              out_bytes.data());
  }

  // Point-to-point (p2p.h). The backend's p2p thread posts and calls p2p_progress; the data
  // of `t` must stay alive until its id is reported done. peer -1: any source (receive).
  void p2p_post(uint64_t id, bool send, const at::Tensor& t, int peer, int64_t tag,
                const std::string& dtype) {
    const char* fn = send ? "send" : peer == rr::dist::kAnySource ? "recvAnySource" : "recv";
    check_host(t, fn, "tensor");
    TORCH_CHECK_VALUE((peer >= 0 && peer < g_.nranks()) || (!send && peer == rr::dist::kAnySource),
                      "ringreduce ", fn, ": peer must be in [0, ", g_.nranks(), "); got ", peer);
    const std::lock_guard<std::mutex> held(p2p_mu_);
    TORCH_CHECK(!g_.closed(), "ringreduce ", fn, ": the process group was already destroyed");
    p2p_.post(rr::dist::P2POp{id, send, peer, tag, t.data_ptr(), nbytes(t), dtype});
  }

  // The operations that completed or failed, waiting at most `max_wait_s` for one.
  std::vector<rr::dist::P2PDone> p2p_progress(double max_wait_s) {
    const std::lock_guard<std::mutex> held(p2p_mu_);
    if (g_.closed()) return {};
    return p2p_.progress(std::chrono::nanoseconds(int64_t(std::max(0.0, max_wait_s) * 1e9)));
  }

  // Lock-free: makes a running p2p_progress return (new work was queued, or shutdown).
  void p2p_interrupt() { p2p_.interrupt(); }

 private:
#ifdef RINGREDUCE_WITH_CUDA
  struct CudaCall {
    rr::dist::cuda::Peers* peers;
    cudaStream_t stream;
  };

  // Runs under mu_ without the GIL, on the tensor's device. The first CUDA collective sets up
  // this rank's staging area and IPC events on that device (a collective step of its own);
  // every later one must use that same device.
  CudaCall cuda_call(const at::Tensor& t, const char* fn) {
    const int dev = t.get_device();
    const cudaStream_t stream =
        c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(dev)).stream();
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    const cudaError_t err = cudaStreamIsCapturing(stream, &capture);
    if (err != cudaSuccess) cudaGetLastError();
    TORCH_CHECK(err == cudaSuccess, "ringreduce ", fn, ": could not query whether the current "
                "stream is being captured into a CUDA graph: ", cudaGetErrorName(err), " (",
                cudaGetErrorString(err), ")");
    TORCH_CHECK(capture == cudaStreamCaptureStatusNone, "ringreduce ", fn, ": cannot run inside "
                "CUDA graph capture (multi-process collectives synchronise on the host)");
    if (!peers_) peers_ = rr::dist::cuda::make_peers(g_, dev, cuda_capacity_);
    TORCH_CHECK_VALUE(rr::dist::cuda::device_of(*peers_) == dev, "ringreduce ", fn, ": tensor "
                      "is on cuda:", dev, " but this rank's earlier CUDA collectives used cuda:",
                      rr::dist::cuda::device_of(*peers_), "; a process group rank drives one "
                      "GPU");
    record(t);
    return CudaCall{peers_.get(), stream};
  }

  // The collective uses the tensor on `stream` (and reads it on an internal copy stream that
  // `stream` waits for): tell the caching allocator, so a tensor freed right after the call is
  // not reused before that work is done.
  static void record(const at::Tensor& t) {
    c10::cuda::CUDACachingAllocator::recordStream(
        t.storage().data_ptr(),
        c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(t.get_device())));
  }

#endif
  void check_root(int root, const char* fn) const {
    TORCH_CHECK_VALUE(root >= 0 && root < g_.nranks(), "ringreduce ", fn, ": root must be in "
                      "[0, ", g_.nranks(), "); got ", root);
  }

  // The root's list (gather, scatter): one host tensor per rank, each of `ref`'s size; empty
  // on the other ranks. Their data pointers.
  std::vector<void*> root_list(const std::vector<at::Tensor>& list, int root, const char* fn,
                               const std::string& name, const at::Tensor& ref,
                               const char* ref_name) const {
    TORCH_CHECK_VALUE(int(list.size()) == (g_.rank() == root ? g_.nranks() : 0), "ringreduce ",
                      fn, ": the ", name, " must hold one tensor per rank (", g_.nranks(), ") on "
                      "the root and be empty elsewhere; rank ", g_.rank(), " got ", list.size());
    std::vector<void*> ptrs;
    for (size_t i = 0; i < list.size(); ++i) {
      const std::string arg = name + "[" + std::to_string(i) + "]";
      check_host(list[i], fn, arg);
      TORCH_CHECK_VALUE(nbytes(list[i]) == nbytes(ref), "ringreduce ", fn, ": ", arg, " has ",
                        nbytes(list[i]), " bytes but the ", ref_name, " has ", nbytes(ref));
      ptrs.push_back(list[i].data_ptr());
    }
    return ptrs;
  }

  HostGroup g_;
  int64_t cuda_capacity_;
#ifdef RINGREDUCE_WITH_CUDA
  rr::dist::cuda::PeersPtr peers_;  // declared after g_: released before the group closes
#endif
  std::mutex mu_;
  // Point-to-point runs beside the collectives (its own thread): its own lock, never held
  // together with mu_ except by close(), which takes mu_ first.
  rr::dist::P2P p2p_;
  std::mutex p2p_mu_;
};


}  // namespace comm_detail

using Comm = comm_detail::Comm;

}  // namespace dist
}  // namespace rr
