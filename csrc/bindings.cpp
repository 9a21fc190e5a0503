// Thin torch binding: validate every argument (naming it and the rule) before anything is
// modified, then hand raw pointers to the torch-free executors in csrc/ring/.
#include <torch/extension.h>

#include <string>
#include <vector>

#include "ring/cpu_executor.h"
#include "ring/types.h"
#include "torch_types.h"

#ifdef RINGREDUCE_WITH_CUDA
#include <ATen/cuda/PeerToPeerAccess.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "ring/cuda_executor.h"
#endif


namespace {

struct Validated {
  rr::DType dtype;
  rr::Op op;
  int64_t count;
  bool cuda;
};

Validated validate(const std::vector<at::Tensor>& tensors, const std::string& op_name) {
  TORCH_CHECK_VALUE(!tensors.empty(),
                    "ringreduce.all_reduce: tensors must hold one tensor per rank; got none");
  rr::Op op;
  TORCH_CHECK_VALUE(rr::op_from_name(op_name, &op), "ringreduce.all_reduce: op must be one of "
                    "sum, avg, max, min, prod; got '", op_name, "'");
  const at::Tensor& t0 = tensors[0];
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK_VALUE(t.defined(), "ringreduce.all_reduce: tensors[", i, "] is undefined");
    TORCH_CHECK_VALUE(t.layout() == at::kStrided, "ringreduce.all_reduce: tensors[", i,
                      "] has layout ", t.layout(), "; only dense (strided) tensors are supported");
    TORCH_CHECK_VALUE(t.device().type() == t0.device().type(), "ringreduce.all_reduce: all "
                      "tensors must be on the same device type; tensors[0] is on ", t0.device(),
                      " but tensors[", i, "] is on ", t.device());
    TORCH_CHECK_VALUE(t.is_cpu() || t.is_cuda(), "ringreduce.all_reduce: tensors[", i,
                      "] is on ", t.device(), "; only cpu and cuda tensors are supported");
    TORCH_CHECK_TYPE(t.scalar_type() == t0.scalar_type(), "ringreduce.all_reduce: all tensors "
                     "must have the same dtype; tensors[0] is ", t0.scalar_type(),
                     " but tensors[", i, "] is ", t.scalar_type());
    TORCH_CHECK_VALUE(t.sizes() == t0.sizes(), "ringreduce.all_reduce: all tensors must have the "
                      "same shape; tensors[0] has shape ", t0.sizes(), " but tensors[", i,
                      "] has shape ", t.sizes());
    TORCH_CHECK_VALUE(t.is_contiguous(), "ringreduce.all_reduce: tensors[", i,
                      "] is not contiguous; call .contiguous() on it first (the result is "
                      "written in place, so pass the tensor you will read)");
  }
  rr::DType dtype;
  TORCH_CHECK_TYPE(rr::from_torch(t0.scalar_type(), &dtype), "ringreduce.all_reduce: tensors "
                   "have dtype ", t0.scalar_type(), ", which is not supported (supported: ",
                   rr::kSupportedDtypes, ")");
  TORCH_CHECK_TYPE(op != rr::Op::Avg || rr::is_floating(dtype), "ringreduce.all_reduce: op "
                   "'avg' needs a floating-point dtype; got ", t0.scalar_type(),
                   " (use 'sum' and divide, or convert first)");
  const int64_t nbytes = t0.numel() * t0.element_size();
  for (size_t i = 0; i < tensors.size(); ++i) {
    for (size_t j = i + 1; j < tensors.size(); ++j) {
      if (tensors[i].device() != tensors[j].device() || nbytes == 0) continue;
      const auto a = reinterpret_cast<uintptr_t>(tensors[i].data_ptr());
      const auto b = reinterpret_cast<uintptr_t>(tensors[j].data_ptr());
      TORCH_CHECK_VALUE(a + nbytes <= b || b + nbytes <= a, "ringreduce.all_reduce: tensors[", i,
                        "] and tensors[", j, "] overlap in memory (the same tensor twice, or "
                        "views of one buffer); every rank needs its own buffer");
    }
  }
  const bool cuda = t0.is_cuda();
#ifdef RINGREDUCE_WITH_CUDA
  if (cuda) {
    TORCH_CHECK(tensors.size() <= size_t(rr::cuda::kMaxRanks), "ringreduce.all_reduce: at most ",
                rr::cuda::kMaxRanks, " ranks are supported on CUDA; got ", tensors.size());
    for (const at::Tensor& t : tensors) rr::cuda::check_device_supported(t.get_device());
  }
#else
  TORCH_CHECK(!cuda, "ringreduce.all_reduce: tensors are on ", t0.device(), " but this "
              "ringreduce build has no CUDA support (built CPU-only: torch without CUDA, nvcc "
              "not found, or RINGREDUCE_FORCE_CPU=1); reinstall on a machine with nvcc");
#endif
  return Validated{dtype, op, t0.numel(), cuda};
}

// The in-place write goes around autograd: tell it, as a torch in-place op would, so a tensor
// saved for backward is reported as modified instead of silently used.
void bump_versions(const std::vector<at::Tensor>& tensors) {
  for (const at::Tensor& t : tensors) {
    if (!t.is_inference()) t.unsafeGetTensorImpl()->bump_version();  // inference: no counter
  }
}

// Returns the neighbour pairs that had to be staged (no peer access); empty on CPU.
// transport: "p2p" (kernels read the neighbour's memory where peer access allows) or "copy"
// (every hop through cudaMemcpyPeerAsync, to test and measure that path on one GPU).
std::vector<std::string> all_reduce(const std::vector<at::Tensor>& tensors,
                                    const std::string& op_name, const std::string& transport) {
  TORCH_CHECK_VALUE(transport == "p2p" || transport == "copy", "ringreduce.all_reduce: "
                    "transport (RINGREDUCE_TRANSPORT) must be 'p2p' or 'copy'; got '", transport,
                    "'");
  const Validated v = validate(tensors, op_name);
  const int nranks = int(tensors.size());
  if (nranks == 1 || v.count == 0) return {};
  if (!v.cuda) {
    std::vector<void*> bufs;
    for (const at::Tensor& t : tensors) bufs.push_back(t.data_ptr());
    {
      pybind11::gil_scoped_release no_gil;
      rr::cpu::all_reduce(bufs.data(), nranks, v.count, v.dtype, v.op);
    }
    bump_versions(tensors);
    return {};
  }
#ifdef RINGREDUCE_WITH_CUDA
  // Restores the caller's device without creating a context on a device it never used.
  c10::cuda::CUDAGuard device_guard(tensors[0].device());
  for (int r = 0; r < nranks; ++r) {
    const auto rd = tensors[r].device().index();
    const auto pd = tensors[(r + nranks - 1) % nranks].device().index();
    // Through torch, so its allocator also maps expandable segments / memory pools for the
    // peer; the executor then finds access already enabled (or stages the pair).
    if (rd != pd) at::cuda::get_p2p_access(rd, pd);
  }
  std::vector<rr::cuda::RankBuffer> bufs;
  std::vector<rr::cuda::DeviceStream> streams;
  for (const at::Tensor& t : tensors) {
    const int dev = t.get_device();
    bufs.push_back(rr::cuda::RankBuffer{t.data_ptr(), dev});
    bool seen = false;
    for (const auto& s : streams) seen = seen || s.device == dev;
    if (!seen) {
      streams.push_back(rr::cuda::DeviceStream{
          dev, c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(dev)).stream()});
    }
  }
  // Each buffer is last touched on its own device's current stream (the exit barrier orders
  // every neighbour's reads before it); telling the caching allocator keeps a tensor the
  // caller drops right away from being handed out before that stream reaches this point, even
  // if the tensor was allocated on another stream.
  for (const at::Tensor& t : tensors) {
    c10::cuda::CUDACachingAllocator::recordStream(
        t.storage().data_ptr(),
        c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(t.get_device())));
  }
  auto staged = rr::cuda::all_reduce(bufs.data(), nranks, v.count, v.dtype, v.op,
                                     streams.data(), int(streams.size()), transport == "copy");
  bump_versions(tensors);
  return staged;
#else
  return {};
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
  m.doc() = "ringreduce: ring all-reduce executors (internal; use ringreduce.all_reduce)";
  m.def("all_reduce", &all_reduce, pybind11::arg("tensors"), pybind11::arg("op"),
        pybind11::arg("transport"),
        "Validated in-place ring all-reduce. Returns the neighbour pairs staged without P2P.");
  m.def("build_info", &build_info);
  m.def("peer_access", &peer_access);
}
