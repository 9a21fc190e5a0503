// The "ringreduce" c10d::Backend (see backend.h for the execution model).
#include "backend.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/version.h>
#include <pybind11/chrono.h>

#include <algorithm>
#include <cctype>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "backend_common.h"
#include "coalesce.h"
#include "comm.h"
#include "completer.h"
#include "engine.h"
#include "p2p_engine.h"
#include "transport.h"
#include "xhost.h"

#ifdef RINGREDUCE_WITH_CUDA
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#endif

namespace py = pybind11;

namespace rr {
namespace dist {
namespace {

using namespace detail;

// torch 2.13 added OpType::REDUCE_SCATTER_TENSOR_COALESCED; torch 2.11 (the GPU machine's) has
// none, and its ProcessGroupNCCL types a coalesced reduce-scatter as COALESCED.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13)
constexpr c10d::OpType kReduceScatterTensorCoalescedOp =
    c10d::OpType::REDUCE_SCATTER_TENSOR_COALESCED;
#else
constexpr c10d::OpType kReduceScatterTensorCoalescedOp = c10d::OpType::COALESCED;
#endif

// ---- the backend ---------------------------------------------------------------------------

class RingReduceBackend;
std::mutex g_live_mu;
std::set<RingReduceBackend*>& live_backends() {
  static std::set<RingReduceBackend*> live;
  return live;
}

std::string shape_text(const at::Tensor& t) {
  std::string s = "(";
  for (int64_t i = 0; i < t.dim(); ++i) {
    if (i) s += ", ";
    s += std::to_string(t.size(i));
  }
  if (t.dim() == 1) s += ",";
  return s + ")";
}

std::string dtype_text(const at::Tensor& t) {
  return "torch." + torch_dtype_name(t.scalar_type());
}

std::string device_text(const at::Device& d) { return d.str(); }

// Elements in one row (dims 1..) of `t`.
int64_t row_elems(const at::Tensor& t) {
  int64_t n = 1;
  for (int64_t i = 1; i < t.dim(); ++i) n *= t.size(i);
  return n;
}

// Drops the GIL for the scope if this thread holds it (a destructor or shutdown reached from
// Python), so that threads being joined can take it.
class GilReleasedIfHeld {
 public:
  GilReleasedIfHeld() {
    if (Py_IsInitialized() && PyGILState_Check()) release_.emplace();
  }

 private:
  c10::optional<py::gil_scoped_release> release_;
};

// The caller's current stream may be capturing a CUDA graph: multi-process collectives
// synchronise on the host, so they refuse (and fail the group, whose peers are mid-call).
class RingReduceBackend final : public c10d::Backend {
 public:
  // `global_ranks`: the members' global ranks (empty: 0 .. size-1), for the flight recorder.
  RingReduceBackend(std::shared_ptr<Transport> transport, int rank, int size, double timeout_s,
                    bool async, c10::intrusive_ptr<c10d::Store> store,
                    std::vector<uint64_t> global_ranks = {}, bool caller_runs = true)
      : c10d::Backend(rank, size), async_(async), store_(std::move(store)),
        global_ranks_(std::move(global_ranks)) {
    if (global_ranks_.empty()) {
      for (int r = 0; r < size; ++r) global_ranks_.push_back(uint64_t(r));
    }
    TORCH_CHECK_VALUE(int(global_ranks_.size()) == size, "ringreduce: ", global_ranks_.size(),
                      " global ranks given for a group of ", size);
    g_ = std::make_shared<Group>();
    g_->transport = std::move(transport);
    g_->rank = rank;
    g_->size = size;
    g_->timeout_s.store(timeout_s);
    start_recording();
    engine_ = std::make_shared<Engine>(g_, caller_runs);
    engine_->start();
    const std::lock_guard<std::mutex> held(g_live_mu);
    live_backends().insert(this);
  }

  ~RingReduceBackend() override {
    {
      const std::lock_guard<std::mutex> held(g_live_mu);
      live_backends().erase(this);
    }
    shutdown_within(std::chrono::seconds(5));
  }

  const std::string getBackendName() const override { return "ringreduce"; }

  // Sequence numbers (what TORCH_DISTRIBUTED_DEBUG=DETAIL's collective checks compare across
  // ranks): the number of collectives this rank has issued on the group, as NCCL counts them.
  // Every rank starts at 0 when the group is made, so setting them needs no exchange.
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return seq_collective_.load(); }

  // Coalescing (coalesce.h): the *_coalesced collectives run one ring pass per batch, and
  // startCoalescing()..endCoalescing() folds the Works issued in between into one.
  bool supportsCoalescing() const override { return true; }
  void startCoalescing() override { batch_.start(rank_); }
  c10::intrusive_ptr<c10d::Work> endCoalescing() override { return batch_.end(rank_); }

  // Splitting and shrinking: the new group is a ringreduce group of its own (fresh segments,
  // its own threads), made by ringreduce/distributed.py over a store (split: the one torch
  // passes; shrink: the parent's, under a prefix numbered per shrink), with no
  // init_process_group and no other ranks than the new group's.
  bool supportsSplitting() const override { return true; }
  bool supportsShrinking() const override { return true; }

  c10::intrusive_ptr<Options> getBackendOptions() override {
    return c10::make_intrusive<Options>(
        "ringreduce", std::chrono::milliseconds(int64_t(g_->timeout_s.load() * 1000.0)));
  }

  // Called by every rank of the parent (ProcessGroup.split_group): nullptr where this rank is
  // not in `ranks` (parent group ranks).
  c10::intrusive_ptr<c10d::Backend> split(const c10::intrusive_ptr<c10d::Store>& store,
                                          const std::vector<int>& ranks,
                                          const c10::intrusive_ptr<Options>& opts) override {
    for (int r : ranks) {
      TORCH_CHECK_VALUE(r >= 0 && r < size_, "ringreduce split: rank ", r, " is not in the "
                        "parent group (ranks 0..", size_ - 1, ")");
    }
    return derive("_split_backend", store, ranks, timeout_of(opts));
  }

  // The group without `excluded` (parent group ranks), over the survivors only. SHRINK_ABORT
  // (flag 1) first aborts the parent: collectives still waiting on it fail at once.
  c10::intrusive_ptr<c10d::Backend> shrink(const std::vector<int64_t>& excluded, int flags,
                                           const c10::intrusive_ptr<Options>& opts) override {
    for (int64_t r : excluded) {
      TORCH_CHECK_VALUE(r >= 0 && r < size_, "ringreduce shrink: rank ", r, " at "
                        "ranks_to_exclude is out of bounds for group size ", size_);
      TORCH_CHECK(r != rank_, "ringreduce shrink: Current rank ", rank_, " is in the exclusion "
                  "list and should not call shrink_group(); only the ranks that stay do");
    }
    TORCH_CHECK(store_, "ringreduce shrink: this group was made without a store to meet the "
                "survivors on");
    if (flags & 1) abort();
    const int count = shrinks_.fetch_add(1);
    return derive("_shrink_backend", store_, excluded, timeout_of(opts), count);
  }

  py::object comm() { return g_->transport->object(); }
  c10::optional<int64_t> inter_host_bytes() const { return g_->transport->inter_host_bytes(); }
  bool is_failed() const { return g_->failed.load(); }
  uint64_t ran_by_callers() const { return engine_->ran_by_callers(); }
  std::string failure() const { return g_->failure_text(); }

  void setTimeout(std::chrono::milliseconds timeout) override {
    g_->timeout_s.store(timeout.count() / 1000.0);
    g_->transport->set_timeout(timeout.count() / 1000.0);
  }

  void abort() override {
    g_->fail("ringreduce: the process group was aborted on rank " + std::to_string(rank_) +
             " (ProcessGroup.abort)");
    g_->transport->abort();
  }

  // Lets queued collectives finish (each is bounded by the group's timeout; all together at
  // most one timeout more), then closes the group. Never hangs.
  void shutdown() override {
    shutdown_within(std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double>(g_->timeout_s.load())));
  }

  void shutdown_within(Clock::duration grace) {
    GilReleasedIfHeld no_gil;
    {
      const std::lock_guard<std::mutex> held(shut_mu_);
      if (shut_) return;
      shut_ = true;
    }
    const Clock::time_point deadline = Clock::now() + grace;
    engine_->stop(deadline);
    std::unique_ptr<P2PEngine> p2p;
    std::vector<XhostWaiter> waiters;
    {
      const std::lock_guard<std::mutex> held(p2p_mu_);
      p2p = std::move(p2p_);
      waiters.swap(xhost_waiters_);
    }
    if (p2p) p2p->stop(deadline);
    for (auto& w : waiters) w.thread.join();  // each is bounded by gloo's timeout
    if (g_->fr) g_->fr->stop();  // its monitor reads the peers' headers: before they unmap
    try {
      g_->transport->close();
    } catch (const std::exception&) {
      // Closing is best effort: the group is unusable either way.
    }
    g_->completer.stop(Clock::now() + std::chrono::seconds(2));
  }

  // ---- collectives -------------------------------------------------------------------------

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    const char* name = "all_reduce";
    at::Tensor t = one(tensors, name);
    const std::string op = op_name(opts.reduceOp, name);
    if (t.layout() == at::kSparse) return sparse_allreduce(tensors, t, op, opts.asyncOp);
    check(name, {t}, op, "tensor");
    auto tr = g_->transport;
    if (t.is_contiguous() && !t.is_cuda() && tr->native() != nullptr) {
      // A contiguous CPU tensor on one host (NativeTransport): the host collective writes its
      // memory and calls no torch op, so the job goes without the InferenceMode guard
      // (Job::memory_only). Should the tensor stop being contiguous before an asynchronous job
      // runs, Comm::all_reduce refuses it rather than copy it.
      return submit(name, OpType::ALLREDUCE, [tr, t, op] { tr->all_reduce(t, op); }, tensors,
                    {t}, {t}, opts.asyncOp, c10::nullopt, false, /*memory_only=*/true);
    }
    return submit(name, OpType::ALLREDUCE, [tr, t, op] {
      contiguous_do(t, [&](const at::Tensor& c) { tr->all_reduce(c, op); });
    }, tensors, {t}, {t}, opts.asyncOp);
  }

  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override {
    const char* name = "all_reduce_coalesced";
    const std::string op = op_name(opts.reduceOp, name);
    check(name, tensors, op, "tensor");
    auto tr = g_->transport;
    std::vector<at::Tensor> ts = tensors;
    return submit(name, OpType::ALLREDUCE_COALESCED, [tr, ts, op] {
      fused_all_reduce(*tr, ts, op);
    }, tensors, ts, ts, opts.asyncOp);
  }

  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override {
    const char* name = "reduce";
    at::Tensor t = one(tensors, name);
    const std::string op = op_name(opts.reduceOp, name);
    const int root = int(opts.rootRank);
    check(name, {t}, op, "tensor");
    check_root(name, root);
    auto tr = g_->transport;
    const bool is_root = rank_ == root;
    return submit(name, OpType::REDUCE, [tr, t, op, is_root] {
      if (is_root) {
        contiguous_do(t, [&](const at::Tensor& c) { tr->all_reduce(c, op); });
      } else {
        tr->all_reduce(t.clone(at::MemoryFormat::Contiguous), op);
      }
    }, tensors, {t}, {t}, opts.asyncOp);
  }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    const char* name = "broadcast";
    at::Tensor t = one(tensors, name);
    const int root = int(opts.rootRank);
    check(name, {t}, "", "tensor");
    check_root(name, root);
    auto tr = g_->transport;
    return submit(name, OpType::BROADCAST, [tr, t, root] {
      contiguous_do(t, [&](const at::Tensor& c) { tr->broadcast(c, root); });
    }, tensors, {t}, {t}, opts.asyncOp);
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& output_tensors,
                                           std::vector<at::Tensor>& input_tensors,
                                           const c10d::AllgatherOptions& opts) override {
    const char* name = "all_gather";
    at::Tensor t = one(input_tensors, name);
    std::vector<at::Tensor> outs = one_list(output_tensors, name);
    check_list(name, outs, t);
    auto tr = g_->transport;
    std::vector<at::Tensor> touched = outs;
    touched.push_back(t);
    return submit(name, OpType::ALLGATHER, [tr, outs, t] { gather_into(*tr, outs, t); },
                  flat(output_tensors), touched, {t}, opts.asyncOp);
  }

  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& output_lists, std::vector<at::Tensor>& input_tensors,
      const c10d::AllgatherOptions& opts) override {
    // torch's layout: output_lists[r][i] receives rank r's input_tensors[i].
    const char* name = "all_gather_coalesced";
    TORCH_CHECK_VALUE(int(output_lists.size()) == size_, "ringreduce ", name, ": "
                      "output_tensor_lists must hold one list per rank (", size_, "); got ",
                      output_lists.size());
    check(name, input_tensors, "", "input_tensor_list");
    for (size_t r = 0; r < output_lists.size(); ++r) {
      TORCH_CHECK_VALUE(output_lists[r].size() == input_tensors.size(), "ringreduce ", name,
                        ": output_tensor_lists[", r, "] must hold one tensor per input (",
                        input_tensors.size(), "); got ", output_lists[r].size());
      const std::string arg = "output_tensor_lists[" + std::to_string(r) + "]";
      check(name, output_lists[r], "", arg);
      for (size_t i = 0; i < input_tensors.size(); ++i) {
        check_same(name, {output_lists[r][i]}, (arg + "[" + std::to_string(i) + "]").c_str(),
                   input_tensors[i], ("input_tensor_list[" + std::to_string(i) + "]").c_str());
      }
    }
    auto tr = g_->transport;
    const int n = size_;
    std::vector<at::Tensor> ins = input_tensors;
    std::vector<std::vector<at::Tensor>> per_input(ins.size());
    for (size_t i = 0; i < ins.size(); ++i) {
      for (const auto& list : output_lists) per_input[i].push_back(list[i]);
    }
    std::vector<at::Tensor> touched = flat(output_lists);
    touched.insert(touched.end(), ins.begin(), ins.end());
    return submit(name, OpType::ALLGATHER_COALESCED, [tr, per_input, ins, n] {
      fused_all_gather(*tr, per_input, ins, n);
    }, flat(output_lists), touched, ins, opts.asyncOp);
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override {
    const char* name = "all_gather_into_tensor";
    check_gather_flat(output, input, name);
    auto tr = g_->transport;
    const int n = size_;
    at::Tensor out = output, in = input;
    return submit(name, OpType::_ALLGATHER_BASE, [tr, out, in, n] {
      gather_flat(*tr, out, in, n);
    }, {output}, {output, input}, {input}, opts.asyncOp);
  }

  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    const char* name = "all_gather_into_tensor";
    TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "ringreduce ", name, ": ",
                      outputs.size(), " outputs for ", inputs.size(), " inputs");
    for (size_t i = 0; i < outputs.size(); ++i) check_gather_flat(outputs[i], inputs[i], name);
    auto tr = g_->transport;
    const int n = size_;
    std::vector<at::Tensor> outs = outputs, ins = inputs, touched = outputs;
    touched.insert(touched.end(), inputs.begin(), inputs.end());
    return submit("all_gather_into_tensor_coalesced", OpType::COALESCED, [tr, outs, ins, n] {
      // Each output as one block per rank, written in place where it is contiguous.
      std::vector<at::Tensor> dense;
      std::vector<std::vector<at::Tensor>> blocks;
      for (size_t i = 0; i < outs.size(); ++i) {
        dense.push_back(outs[i].is_contiguous() ? outs[i] : outs[i].contiguous());
        blocks.push_back(split_rows(dense.back(), std::vector<int64_t>(size_t(n), 1),
                                    ins[i].numel()));
      }
      fused_all_gather(*tr, blocks, ins, n);
      for (size_t i = 0; i < outs.size(); ++i) {
        if (!dense[i].is_same(outs[i])) outs[i].copy_(dense[i]);
      }
    }, outputs, touched, inputs, opts.asyncOp);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& output_tensors,
                                                std::vector<std::vector<at::Tensor>>& input_lists,
                                                const c10d::ReduceScatterOptions& opts) override {
    const char* name = "reduce_scatter";
    at::Tensor output = one(output_tensors, name);
    std::vector<at::Tensor> inputs = one_list(input_lists, name);
    const std::string op = op_name(opts.reduceOp, name);
    TORCH_CHECK_VALUE(int(inputs.size()) == size_, "ringreduce reduce_scatter: the input list "
                      "must hold one tensor per rank (", size_, "); got ", inputs.size());
    check(name, {output}, op, "output");
    check(name, inputs, op, "input");
    for (size_t i = 0; i < inputs.size(); ++i) {
      const at::Tensor& t = inputs[i];
      TORCH_CHECK_VALUE(t.numel() == output.numel() && t.scalar_type() == output.scalar_type() &&
                        t.device() == output.device(), "ringreduce reduce_scatter: input[", i,
                        "] has ", t.numel(), " elements of ", dtype_text(t), " on ",
                        device_text(t.device()), "; the output has ", output.numel(), " of ",
                        dtype_text(output), " on ", device_text(output.device()));
    }
    std::vector<at::Tensor> rows;
    for (const at::Tensor& t : inputs) rows.push_back(t.reshape(-1));
    at::Tensor flat_in = at::cat(rows);
    auto tr = g_->transport;
    return submit(name, OpType::REDUCE_SCATTER, [tr, output, flat_in, op] {
      reduce_scatter_flat(*tr, output, flat_in, op);
    }, output_tensors, {output, flat_in}, inputs, opts.asyncOp);
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override {
    const char* name = "reduce_scatter_tensor";
    const std::string op = op_name(opts.reduceOp, name);
    at::Tensor flat_in = input.reshape(-1);
    check_reduce_scatter_flat(output, flat_in, op, name);
    auto tr = g_->transport;
    at::Tensor out = output;
    return submit(name, OpType::_REDUCE_SCATTER_BASE, [tr, out, flat_in, op] {
      reduce_scatter_flat(*tr, out, flat_in, op);
    }, {output}, {output, input}, {input}, opts.asyncOp);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override {
    const char* name = "reduce_scatter_tensor";
    const std::string op = op_name(opts.reduceOp, name);
    TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "ringreduce ", name, ": ",
                      outputs.size(), " outputs for ", inputs.size(), " inputs");
    std::vector<at::Tensor> flats;
    for (size_t i = 0; i < inputs.size(); ++i) {
      flats.push_back(inputs[i].reshape(-1));
      check_reduce_scatter_flat(outputs[i], flats.back(), op, name);
    }
    auto tr = g_->transport;
    std::vector<at::Tensor> outs = outputs, touched = outputs;
    touched.insert(touched.end(), inputs.begin(), inputs.end());
    const int n = size_;
    return submit("reduce_scatter_tensor_coalesced", kReduceScatterTensorCoalescedOp,
                  [tr, outs, flats, op, n] { fused_reduce_scatter(*tr, outs, flats, op, n); },
                  outputs, touched, inputs, opts.asyncOp);
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    // After every collective queued before it; on CUDA it also waits for their GPU work.
    c10::optional<at::Device> device;
#ifdef RINGREDUCE_WITH_CUDA
    if (engine_->used_cuda()) device = barrier_device(opts);
#endif
    auto tr = g_->transport;
    return submit("barrier", OpType::BARRIER, [tr] { tr->barrier(); }, {}, {}, {},
                  opts.asyncOp, device, /*drain_gpu=*/true);
  }

#ifdef RINGREDUCE_WITH_CUDA
  // The GPU a barrier orders against, as torch's barrier() chooses it: the device in the
  // options (device_ids[0] when given), else the one bound to the group
  // (init_process_group(device_id=...)), else the one GPU the group's collectives ran on, else
  // the current device. A script that never called set_device would otherwise order on GPU 0
  // (and create a context there).
  at::Device barrier_device(const c10d::BarrierOptions& opts) const {
    if (opts.device && opts.device->is_cuda() && opts.device->has_index()) return *opts.device;
    if (!opts.device_ids.empty()) {
      const int64_t id = opts.device_ids[0];
      TORCH_CHECK_VALUE(id >= 0 && id < c10::cuda::device_count(), "ringreduce barrier: "
                        "device_ids[0] must be a CUDA device index in [0, ",
                        int(c10::cuda::device_count()), "); got ", id);
      return at::Device(at::kCUDA, c10::DeviceIndex(id));
    }
    const c10::optional<at::Device> bound = getBoundDeviceId();
    if (bound && bound->is_cuda() && bound->has_index()) return *bound;
    if (const auto used = engine_->sole_device()) return at::Device(at::kCUDA, *used);
    return at::Device(at::kCUDA, c10::cuda::current_device());
  }
#endif

  // gather, scatter and all-to-all move bytes: any dtype. CUDA tensors are staged through host
  // memory by the progress thread (on the internal stream), the simplest correct path.

  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& output_tensors,
                                        std::vector<at::Tensor>& input_tensors,
                                        const c10d::GatherOptions& opts) override {
    const char* name = "gather";
    const int root = int(opts.rootRank);
    check_root(name, root);
    at::Tensor t = one(input_tensors, name);
    check(name, {t}, "", "input");
    std::vector<at::Tensor> outs = root_list(name, output_tensors, root, "gather_list");
    check_same(name, outs, "gather_list", t, "input");
    auto tr = g_->transport;
    std::vector<at::Tensor> touched = outs;
    touched.push_back(t);
    return submit(name, OpType::GATHER, [tr, t, outs, root] {
      host_call([&](const std::vector<at::Tensor>& ins, const std::vector<at::Tensor>& o) {
        tr->gather(o, ins[0], root);
      }, {t}, outs);
    }, flat(output_tensors), touched, {t}, opts.asyncOp);
  }

  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& output_tensors,
                                         std::vector<std::vector<at::Tensor>>& input_tensors,
                                         const c10d::ScatterOptions& opts) override {
    const char* name = "scatter";
    const int root = int(opts.rootRank);
    check_root(name, root);
    at::Tensor out = one(output_tensors, name);
    check(name, {out}, "", "output");
    std::vector<at::Tensor> ins = root_list(name, input_tensors, root, "scatter_list");
    check_same(name, ins, "scatter_list", out, "output");
    auto tr = g_->transport;
    std::vector<at::Tensor> touched = ins;
    touched.push_back(out);
    return submit(name, OpType::SCATTER, [tr, out, ins, root] {
      host_call([&](const std::vector<at::Tensor>& i, const std::vector<at::Tensor>& o) {
        tr->scatter(o[0], i, root);
      }, ins, {out});
    }, output_tensors, touched, ins, opts.asyncOp);
  }

  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& output_tensors,
                                          std::vector<at::Tensor>& input_tensors,
                                          const c10d::AllToAllOptions& opts) override {
    const char* name = "all_to_all";
    for (auto* list : {&output_tensors, &input_tensors}) {
      const char* arg = list == &output_tensors ? "output_tensor_list" : "input_tensor_list";
      TORCH_CHECK_VALUE(int(list->size()) == size_, "ringreduce ", name, ": the ", arg,
                        " must hold one tensor per rank (", size_, "); got ", list->size());
      check(name, *list, "", arg);
    }
    const at::Tensor& ref = input_tensors[0];
    for (auto* list : {&output_tensors, &input_tensors}) {
      const char* arg = list == &output_tensors ? "output_tensor_list" : "input_tensor_list";
      for (size_t i = 0; i < list->size(); ++i) {
        const at::Tensor& t = (*list)[i];
        TORCH_CHECK_VALUE(t.scalar_type() == ref.scalar_type() && t.device() == ref.device(),
                          "ringreduce ", name, ": ", arg, "[", i, "] is ", dtype_text(t), " on ",
                          device_text(t.device()), "; input_tensor_list[0] is ", dtype_text(ref),
                          " on ", device_text(ref.device()));
      }
    }
    const at::Tensor& mine = input_tensors[size_t(rank_)];
    const at::Tensor& theirs = output_tensors[size_t(rank_)];
    TORCH_CHECK_VALUE(mine.numel() == theirs.numel(), "ringreduce ", name, ": this rank (",
                      rank_, ") sends itself ", mine.numel(), " elements (input_tensor_list[",
                      rank_, "]) but output_tensor_list[", rank_, "] holds ", theirs.numel());
    auto tr = g_->transport;
    std::vector<at::Tensor> outs = output_tensors, ins = input_tensors, touched = outs;
    touched.insert(touched.end(), ins.begin(), ins.end());
    return submit(name, OpType::ALLTOALL, [tr, outs, ins] {
      host_call([&](const std::vector<at::Tensor>& i, const std::vector<at::Tensor>& o) {
        tr->all_to_all(o, i);
      }, ins, outs);
    }, outs, touched, ins, opts.asyncOp);
  }

  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_split_sizes,
                                               std::vector<int64_t>& input_split_sizes,
                                               const c10d::AllToAllOptions& opts) override {
    const char* name = "all_to_all_single";
    check(name, {input}, "", "input");
    check(name, {output}, "", "output");
    TORCH_CHECK_VALUE(output.scalar_type() == input.scalar_type() &&
                      output.device() == input.device(), "ringreduce ", name, ": the output is ",
                      dtype_text(output), " on ", device_text(output.device()), "; the input is ",
                      dtype_text(input), " on ", device_text(input.device()));
    TORCH_CHECK_VALUE(input.dim() > 0 && output.dim() > 0, "ringreduce ", name, ": input and "
                      "output need a dim 0 to split; got shapes ", shape_text(input), " and ",
                      shape_text(output));
    const int64_t row = row_elems(input);
    const int64_t out_row = row_elems(output);
    TORCH_CHECK_VALUE(out_row == row, "ringreduce ", name, ": a row (dims 1..) of the output "
                      "has ", out_row, " elements and one of the input ", row);
    const std::vector<int64_t> ins =
        splits(name, "input_split_sizes", input_split_sizes, input, "input");
    const std::vector<int64_t> outs =
        splits(name, "output_split_sizes", output_split_sizes, output, "output");
    TORCH_CHECK_VALUE(ins[size_t(rank_)] == outs[size_t(rank_)], "ringreduce ", name,
                      ": this rank (", rank_, ") sends itself ", ins[size_t(rank_)],
                      " rows (input_split_sizes) but expects ", outs[size_t(rank_)],
                      " (output_split_sizes)");
    auto tr = g_->transport;
    at::Tensor in = input, out = output;
    return submit(name, OpType::ALLTOALL_BASE, [tr, in, out, ins, outs, row] {
      host_call([&](const std::vector<at::Tensor>& hi, const std::vector<at::Tensor>& ho) {
        tr->all_to_all(split_rows(ho[0], outs, row), split_rows(hi[0], ins, row));
      }, {in}, {out});
    }, {output}, {output, input}, {input}, opts.asyncOp);
  }

  // ---- point-to-point ----------------------------------------------------------------------

  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst,
                                      int tag) override {
    return p2p("send", true, tensors, dst, tag, false);
  }
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src,
                                      int tag) override {
    return p2p("recv", false, tensors, src, tag, false);
  }
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors,
                                               int tag) override {
    return p2p("recvAnySource", false, tensors, kAnySource, tag, true);
  }

  // monitored_barrier is gloo's only: torch refuses it on other backends before calling here.

  // A sparse (COO) all-reduce, as gloo does it: every rank's indices and values are gathered,
  // then summed by coalescing; `t` becomes the result. Sum only (gloo refuses the others too),
  // CPU only (a CUDA sparse tensor would need a path no test here can run).
  c10::intrusive_ptr<c10d::Work> sparse_allreduce(std::vector<at::Tensor>& tensors,
                                                  const at::Tensor& t, const std::string& op,
                                                  bool async_op) {
    const char* name = "all_reduce";
    TORCH_CHECK_VALUE(op == "sum", "ringreduce ", name, ": unsupported reduction operation for "
                      "a sparse tensor (allreduce of sparse tensors only works with "
                      "ReduceOp.SUM); got ", op);
    TORCH_CHECK_VALUE(t.is_cpu(), "ringreduce ", name, ": a sparse tensor must be on the cpu; "
                      "got one on ", device_text(t.device()));
    TORCH_CHECK_VALUE(t.dim() <= kMaxSparseDims, "ringreduce ", name, ": a sparse tensor may "
                      "have at most ", kMaxSparseDims, " dims; got ", t.dim());
    check(name, {t._values().contiguous()}, op, "tensor (its values)");
    auto tr = g_->transport;
    const int n = size_;
    return submit(name, OpType::ALLREDUCE, [tr, t, n] { sparse_sum(*tr, t, n); }, tensors, {t},
                  {t}, async_op);
  }

 private:
  // ---- argument rules (the caller's thread) ------------------------------------------------

  at::Tensor one(const std::vector<at::Tensor>& tensors, const char* name) const {
    TORCH_CHECK_VALUE(tensors.size() == 1, "ringreduce ", name, ": expected one tensor per "
                      "process (one device per rank); got ", tensors.size());
    return tensors[0];
  }
  std::vector<at::Tensor> one_list(const std::vector<std::vector<at::Tensor>>& lists,
                                   const char* name) const {
    TORCH_CHECK_VALUE(lists.size() == 1, "ringreduce ", name, ": expected one tensor per "
                      "process (one device per rank); got ", lists.size());
    return lists[0];
  }
  static std::vector<at::Tensor> flat(const std::vector<std::vector<at::Tensor>>& lists) {
    std::vector<at::Tensor> out;
    for (const auto& l : lists) out.insert(out.end(), l.begin(), l.end());
    return out;
  }

  // One tensor (check(name, {t}, ...) lands here: no list built on every call).
  void check(const char* name, const at::Tensor& t, const std::string& op,
             const std::string& arg) const {
    g_->transport->check(t, op, name, arg);
  }
  void check(const char* name, const std::vector<at::Tensor>& tensors, const std::string& op,
             const std::string& arg) const {
    for (size_t i = 0; i < tensors.size(); ++i) {
      check(name, tensors[i], op, tensors.size() == 1 ? arg : arg + "[" + std::to_string(i) + "]");
    }
  }

  static std::string op_name(const c10d::ReduceOp& op, const char* name) {
    switch (op.op_) {
      case c10d::ReduceOp::SUM: return "sum";
      case c10d::ReduceOp::AVG: return "avg";
      case c10d::ReduceOp::MAX: return "max";
      case c10d::ReduceOp::MIN: return "min";
      case c10d::ReduceOp::PRODUCT: return "prod";
      case c10d::ReduceOp::BAND: return "band";
      case c10d::ReduceOp::BOR: return "bor";
      case c10d::ReduceOp::BXOR: return "bxor";
      default: break;
    }
    std::string shown = op.op_ == c10d::ReduceOp::PREMUL_SUM ? "PREMUL_SUM" : "UNUSED";
    TORCH_CHECK_VALUE(false, "ringreduce ", name, ": reduce op ", shown, " is not supported "
                      "(supported: SUM, AVG, MAX, MIN, PRODUCT, BAND, BOR, BXOR)");
    return shown;  // not reached: the check above throws
  }

  void check_root(const char* name, int root) const {
    TORCH_CHECK_VALUE(root >= 0 && root < size_, "ringreduce ", name, ": root must be in [0, ",
                      size_, "); got ", root);
  }

  static void check_same(const char* name, const std::vector<at::Tensor>& tensors,
                         const char* arg, const at::Tensor& ref, const char* ref_arg) {
    for (size_t i = 0; i < tensors.size(); ++i) {
      const at::Tensor& o = tensors[i];
      TORCH_CHECK_VALUE(o.scalar_type() == ref.scalar_type() && o.numel() == ref.numel() &&
                        o.device() == ref.device(), "ringreduce ", name, ": ", arg, "[", i,
                        "] is ", o.numel(), " elements of ", dtype_text(o), " on ",
                        device_text(o.device()), "; the ", ref_arg, " is ", ref.numel(), " of ",
                        dtype_text(ref), " on ", device_text(ref.device()));
    }
  }

  void check_list(const char* name, const std::vector<at::Tensor>& outputs,
                  const at::Tensor& t) const {
    check(name, {t}, "", "input");
    TORCH_CHECK_VALUE(int(outputs.size()) == size_, "ringreduce ", name, ": the output list "
                      "must hold one tensor per rank (", size_, "); got ", outputs.size());
    check(name, outputs, "", "output");
    check_same(name, outputs, "output", t, "input");
  }

  void check_gather_flat(const at::Tensor& output, const at::Tensor& input,
                         const char* name) const {
    check(name, {input}, "", "input");
    check(name, {output}, "", "output");
    TORCH_CHECK_VALUE(output.scalar_type() == input.scalar_type() &&
                      output.device() == input.device(), "ringreduce ", name, ": the output is ",
                      dtype_text(output), " on ", device_text(output.device()), "; the input is ",
                      dtype_text(input), " on ", device_text(input.device()));
    TORCH_CHECK_VALUE(output.numel() == input.numel() * size_, "ringreduce ", name, ": the "
                      "output must hold world size (", size_, ") x input elements (",
                      input.numel(), "); got ", output.numel());
  }

  void check_reduce_scatter_flat(const at::Tensor& output, const at::Tensor& flat_in,
                                 const std::string& op, const char* name) const {
    check(name, {flat_in}, op, "input");
    check(name, {output}, "", "output");
    TORCH_CHECK_VALUE(output.scalar_type() == flat_in.scalar_type() &&
                      output.device() == flat_in.device(), "ringreduce ", name, ": the output "
                      "is ", dtype_text(output), " on ", device_text(output.device()),
                      "; the input is ", dtype_text(flat_in), " on ",
                      device_text(flat_in.device()));
    TORCH_CHECK_VALUE(flat_in.numel() == output.numel() * size_, "ringreduce ", name, ": the "
                      "input must hold world size (", size_, ") x output elements (",
                      output.numel(), "); got ", flat_in.numel());
  }

  // The root's list of one tensor per rank (torch passes [list] there, [] or [[]] elsewhere);
  // empty on the other ranks, which must not pass one.
  std::vector<at::Tensor> root_list(const char* name,
                                    const std::vector<std::vector<at::Tensor>>& lists, int root,
                                    const char* arg) const {
    if (rank_ != root) {
      for (const auto& l : lists) {
        TORCH_CHECK_VALUE(l.empty(), "ringreduce ", name, ": only the root (rank ", root,
                          ") passes a ", arg, "; rank ", rank_, " passed one");
      }
      return {};
    }
    std::vector<at::Tensor> tensors = one_list(lists, name);
    TORCH_CHECK_VALUE(int(tensors.size()) == size_, "ringreduce ", name, ": the ", arg,
                      " must hold one tensor per rank (", size_, "); got ", tensors.size());
    check(name, tensors, "", arg);
    return tensors;
  }

  std::vector<int64_t> splits(const char* name, const char* arg,
                              const std::vector<int64_t>& given, const at::Tensor& t,
                              const char* what) const {
    const int64_t rows = t.size(0);
    if (given.empty()) {
      TORCH_CHECK_VALUE(rows % size_ == 0, "ringreduce ", name, ": without ", arg, ", dim 0 of "
                        "the ", what, " (", rows, ") must divide by the world size (", size_,
                        ")");
      return std::vector<int64_t>(size_t(size_), rows / size_);
    }
    TORCH_CHECK_VALUE(int(given.size()) == size_, "ringreduce ", name, ": ", arg, " must hold "
                      "one size per rank (", size_, "); got ", given.size());
    const int64_t sum = std::accumulate(given.begin(), given.end(), int64_t(0));
    const int64_t low = *std::min_element(given.begin(), given.end());
    if (low < 0 || sum != rows) {
      std::string shown = "[";
      for (size_t i = 0; i < given.size(); ++i) {
        shown += (i ? ", " : "") + std::to_string(given[i]);
      }
      TORCH_CHECK_VALUE(false, "ringreduce ", name, ": ", arg, " ", shown, "] must be "
                        "non-negative and add up to dim 0 of the ", what, " (", rows, "); they "
                        "add up to ", sum);
    }
    return given;
  }

  // ---- helpers run by the worker ----------------------------------------------------------

  static constexpr int64_t kMaxSparseDims = 32;

  // Every rank's sparse `t` summed into `t`: first what each rank has (its layout, dtype, shape
  // and nnz, checked equal where they must be), then indices and values, each padded to the
  // largest nnz so that one all-gather moves them. Every rank builds the sum from the same
  // gathered bytes in rank order, so the results are identical.
  static void sparse_sum(Transport& tr, const at::Tensor& t, int n) {
    const char* name = "all_reduce";
    // `t` takes the new indices and values themselves: made under inference mode (the worker's)
    // they would be inference tensors, which the caller could not use with autograd.
    c10::InferenceMode normal_tensors(false);
    const at::Tensor c = t.coalesce();
    const int64_t header = 5;
    at::Tensor meta = at::zeros({header + kMaxSparseDims}, at::kLong);
    int64_t* m = meta.data_ptr<int64_t>();
    m[0] = c.dim();
    m[1] = c.sparse_dim();
    m[2] = c.dense_dim();
    m[3] = c._nnz();
    m[4] = int64_t(c.scalar_type());
    for (int64_t d = 0; d < c.dim(); ++d) m[header + d] = c.size(d);
    std::vector<at::Tensor> metas;
    for (int r = 0; r < n; ++r) metas.push_back(at::empty_like(meta));
    tr.all_gather(metas, meta);
    int64_t max_nnz = 0;
    for (int r = 0; r < n; ++r) {
      const int64_t* o = metas[size_t(r)].data_ptr<int64_t>();
      max_nnz = std::max(max_nnz, o[3]);
      const bool same_shape = std::equal(o + header, o + header + kMaxSparseDims, m + header);
      TORCH_CHECK_VALUE(o[0] == m[0] && o[1] == m[1] && o[2] == m[2] && same_shape,
                        "ringreduce ", name, ": rank ", r, "'s sparse tensor has another shape "
                        "or sparse/dense split than this rank's ", shape_text(c), " (",
                        c.sparse_dim(), " sparse dims); sparse all-reduce needs the same on "
                        "every rank");
      TORCH_CHECK_VALUE(o[4] == m[4], "ringreduce ", name, ": rank ", r, "'s sparse tensor is ",
                        "torch.", torch_dtype_name(at::ScalarType(o[4])), "; this rank's is ",
                        dtype_text(c));
    }
    at::Tensor indices = at::zeros({c.sparse_dim(), max_nnz}, at::kLong);
    std::vector<int64_t> value_shape = c._values().sizes().vec();
    value_shape[0] = max_nnz;
    at::Tensor values = at::zeros(value_shape, c._values().options());
    indices.narrow(1, 0, c._nnz()).copy_(c._indices());
    values.narrow(0, 0, c._nnz()).copy_(c._values());
    std::vector<at::Tensor> all_indices, all_values;
    for (int r = 0; r < n; ++r) {
      all_indices.push_back(at::empty_like(indices));
      all_values.push_back(at::empty_like(values));
    }
    tr.all_gather(all_indices, indices);
    tr.all_gather(all_values, values);
    std::vector<at::Tensor> idx, val;
    for (int r = 0; r < n; ++r) {
      const int64_t nnz = metas[size_t(r)].data_ptr<int64_t>()[3];
      idx.push_back(all_indices[size_t(r)].narrow(1, 0, nnz));
      val.push_back(all_values[size_t(r)].narrow(0, 0, nnz));
    }
    const at::Tensor sum =
        at::sparse_coo_tensor(at::cat(idx, 1), at::cat(val, 0), c.sizes()).coalesce();
    t.copy_(sum);
  }

  // Runs fn on a contiguous version of t, copying the result back if needed.
  template <typename F>
  static void contiguous_do(const at::Tensor& t, F&& fn) {
    if (t.is_contiguous()) {
      fn(t);
      return;
    }
    at::Tensor tmp = t.contiguous();
    fn(tmp);
    t.copy_(tmp);
  }

  static void gather_into(Transport& tr, const std::vector<at::Tensor>& outputs,
                          const at::Tensor& t) {
    const at::Tensor in = t.contiguous();
    std::vector<at::Tensor> outs;
    for (const at::Tensor& o : outputs) outs.push_back(o.is_contiguous() ? o : o.contiguous());
    tr.all_gather(outs, in);
    for (size_t i = 0; i < outs.size(); ++i) {
      if (!outs[i].is_same(outputs[i])) outputs[i].copy_(outs[i]);
    }
  }

  static void gather_flat(Transport& tr, const at::Tensor& output, const at::Tensor& t, int n) {
    const int64_t count = t.numel();
    contiguous_do(output, [&](const at::Tensor& out) {
      const at::Tensor f = out.view(-1);
      std::vector<at::Tensor> parts;
      for (int r = 0; r < n; ++r) parts.push_back(f.slice(0, r * count, (r + 1) * count));
      tr.all_gather(parts, t.contiguous().view(-1));
    });
  }

  static void reduce_scatter_flat(Transport& tr, const at::Tensor& output,
                                  const at::Tensor& flat_in, const std::string& op) {
    contiguous_do(output, [&](const at::Tensor& o) {
      tr.reduce_scatter(o.view(-1), flat_in.contiguous(), op);
    });
  }

  static std::vector<at::Tensor> split_rows(const at::Tensor& t, const std::vector<int64_t>& rows,
                                            int64_t row) {
    std::vector<at::Tensor> parts;
    const at::Tensor f = t.view(-1);
    int64_t at_ = 0;
    for (int64_t r : rows) {
      parts.push_back(f.slice(0, at_ * row, (at_ + r) * row));
      at_ += r;
    }
    return parts;
  }

  // fn(host_inputs, host_outputs) with contiguous CPU tensors standing in for `inputs` and
  // `outputs`: the tensors themselves where they are contiguous CPU tensors, copies of the
  // others. On CUDA the copies run on the internal stream (current here) through pinned memory,
  // synchronised before the host reads them; outputs are copied back after fn.
  template <typename F>
  static void host_call(F&& fn, const std::vector<at::Tensor>& inputs,
                        const std::vector<at::Tensor>& outputs) {
    auto host = [](const at::Tensor& t) {
      return at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(t.is_cuda()));
    };
    std::vector<at::Tensor> ins, outs;
    bool synced = true;
    for (const at::Tensor& t : inputs) {
      if (t.is_cpu() && t.is_contiguous()) {
        ins.push_back(t);
      } else {
        ins.push_back(host(t));
        ins.back().copy_(t, /*non_blocking=*/t.is_cuda());
        synced = synced && !t.is_cuda();
      }
    }
#ifdef RINGREDUCE_WITH_CUDA
    if (!synced) C10_CUDA_CHECK(cudaStreamSynchronize(c10::cuda::getCurrentCUDAStream().stream()));
#endif
    for (const at::Tensor& t : outputs) {
      outs.push_back(t.is_cpu() && t.is_contiguous() ? t : host(t));
    }
    fn(ins, outs);
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (!outs[i].is_same(outputs[i])) outputs[i].copy_(outs[i]);
    }
  }

  // ---- queueing ----------------------------------------------------------------------------

  // outputs: the Work's result; tensors: every tensor it touches; inputs: what the profiler
  // shows as its input shapes.
  c10::intrusive_ptr<c10d::Work> submit(const char* name, OpType type, std::function<void()> run,
                                        const std::vector<at::Tensor>& outputs,
                                        c10::ArrayRef<at::Tensor> tensors,
                                        c10::ArrayRef<at::Tensor> inputs, bool async_op,
                                        c10::optional<at::Device> device = c10::nullopt,
                                        bool drain_gpu = false, bool memory_only = false) {
    for (const at::Tensor& t : tensors) {
      if (!t.is_cuda()) continue;
      if (!device || device->is_cpu()) {
        device = t.device();
      } else {
        TORCH_CHECK_VALUE(t.device() == *device, "ringreduce ", name, ": tensors on ",
                          device_text(*device), " and ", device_text(t.device()),
                          "; a rank drives one GPU");
      }
    }
    {
      const std::lock_guard<std::mutex> held(shut_mu_);
      TORCH_CHECK(!shut_, "ringreduce ", name, ": the process group was already destroyed");
    }
#ifdef RINGREDUCE_WITH_CUDA
    if (device && device->is_cuda()) refuse_capture(name, device->index());
#endif
    const uint64_t seq = seq_collective_.fetch_add(1) + 1;
    auto work = c10::make_intrusive<RRWork>(g_, name, type, outputs, device, inputs);
    if (g_->fr) work->set_trace(g_->fr->collective(*this, name, seq, inputs, outputs, timeout()));
    batch_.note(work);
    auto job = std::make_shared<Job>();
    job->work = work;
    job->run = std::move(run);
    job->drain_gpu = drain_gpu;
    job->memory_only = memory_only;
    if (!async_) {
      // RINGREDUCE_ASYNC=0: inline in the caller's thread (on CUDA on the caller's stream).
      try {
        c10::optional<c10::InferenceMode> no_autograd;  // as in Engine::execute
        if (!memory_only) no_autograd.emplace();
        if (work->trace().on) g_->fr->started(work->trace());
        job->run();
      } catch (...) {
        const std::exception_ptr error = std::current_exception();
        g_->fail("ringreduce: " + std::string(name) + " on rank " + std::to_string(rank_) +
                 " failed: " + error_text(error));
        work->finish(error);
        throw;
      }
      work->finish(nullptr);
      return work;
    }
    if (device && device->is_cuda()) {
#ifdef RINGREDUCE_WITH_CUDA
      const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(device->index());
      job->cuda = true;
      job->stream = engine_->stream(device->index());
      job->ready = std::make_shared<Event>(device->index());
      job->ready->record(current);
      // No recordStream here: the job's closure, and so every tensor the internal stream
      // touches, lives until the collective's GPU work has finished (Job::run).
#else
      TORCH_CHECK(false, "ringreduce ", name, ": the tensor is on CUDA but this ringreduce build "
                  "has no CUDA support");
#endif
    }
    // A synchronous call whose job is next runs here: the caller would only block in wait().
    if (!job->cuda && !async_op && engine_->run_now(job)) return work;
    engine_->submit(std::move(job));
    return work;
  }

#ifdef RINGREDUCE_WITH_CUDA
  // A collective issued while the caller's stream captures a CUDA graph is refused here, in
  // the caller's thread, before anything is queued or counted: it never started on this rank,
  // so the group stays usable, and the peers' matching collective waits for this rank's next
  // one (issued outside the capture), or times out naming this rank. NCCL's collectives are
  // recorded into the graph; these synchronise on the host and cannot be.
  void refuse_capture(const char* name, c10::DeviceIndex device) const {
    std::string refusal;
    try {
      refusal = capture_refusal(c10::cuda::getCurrentCUDAStream(device));
    } catch (...) {
      refusal = "checking whether the caller's stream is capturing a CUDA graph failed: " +
                error_text(std::current_exception());
    }
    TORCH_CHECK(refusal.empty(), "ringreduce ", name, " on rank ", rank_, ": ", refusal,
                " (nothing was queued; this process group is still usable)");
  }
#endif

  // any_source: a receive from whichever rank sends first (`peer` is kAnySource).
  c10::intrusive_ptr<c10d::Work> p2p(const char* name, bool is_send,
                                     std::vector<at::Tensor>& tensors, int peer, int tag,
                                     bool any_source) {
    at::Tensor t = one(tensors, name);
    check(name, {t}, "", "tensor");
    TORCH_CHECK_VALUE(any_source || (peer >= 0 && peer < size_), "ringreduce ", name,
                      ": ", is_send ? "dst" : "src", " must be a rank in [0, ", size_,
                      "); got ", peer);
    {
      const std::lock_guard<std::mutex> held(shut_mu_);
      TORCH_CHECK(!shut_, "ringreduce ", name, ": the process group was already destroyed");
    }
    if (!g_->transport->native()) {
      c10::intrusive_ptr<c10d::Work> work = xhost_p2p(name, is_send, t, peer, tag);
      batch_.note(work);
      return work;
    }
    c10::optional<at::Device> device;
    if (t.is_cuda()) device = t.device();
    auto work = c10::make_intrusive<RRWork>(g_, name, is_send ? OpType::SEND : OpType::RECV,
                                            std::vector<at::Tensor>{t}, device,
                                            c10::ArrayRef<at::Tensor>(t));
    trace_p2p(*work, is_send, any_source ? -1 : peer, t);
    batch_.note(work);
    auto job = std::make_shared<P2PJob>();
    job->work = work;
    job->send = is_send;
    job->tensor = t;
    job->peer = peer;
    job->tag = tag;
    if (t.is_cuda()) {
#ifdef RINGREDUCE_WITH_CUDA
      job->staging = stage_issue(t, engine_->p2p_stream(t.device().index()), name, rank_);
#else
      TORCH_CHECK(false, "ringreduce ", name, ": the tensor is on CUDA but this ringreduce build "
                  "has no CUDA support");
#endif
    }
    {
      const std::lock_guard<std::mutex> held(p2p_mu_);
      if (!p2p_) p2p_ = std::make_unique<P2PEngine>(g_);
    }
    p2p_->submit(std::move(job));
    return work;
  }

  // Across hosts: gloo's own send/recv on the whole group, posted here (so in issue order) by
  // XhostTransport::p2p_start; a thread per operation waits for it (gloo bounds the wait by
  // the group's timeout). A send works on a copy of the tensor and its Work completes at once,
  // as on one host (gloo's send would wait for the matching receive); a send that then fails
  // fails the group. A receive's Work completes when its message is in the tensor. CUDA
  // tensors are staged through pinned host memory as on one host (stage_issue, stage_out,
  // stage_in): a send's copy is made here, so the caller's thread waits for the work queued
  // before it on its stream; a receive copies in on point-to-point's internal stream, which
  // Work.wait() puts the caller's stream behind.
  c10::intrusive_ptr<c10d::Work> xhost_p2p(const char* name, bool is_send, const at::Tensor& t,
                                           int peer, int tag) {
    TORCH_CHECK_VALUE(tag >= 0, "ringreduce ", name, ": a group that spans several hosts needs "
                      "tags >= 0 (gloo's); got ", tag);
    TORCH_CHECK_VALUE(peer != rank_, "ringreduce ", name, ": rank ", rank_, " cannot ",
                      is_send ? "send to" : "receive from", " itself");
    at::Tensor host;
    c10::optional<CudaStaging> staging;
    c10::optional<at::Device> device;
    if (t.is_cuda()) {
#ifdef RINGREDUCE_WITH_CUDA
      staging = stage_issue(t, engine_->p2p_stream(t.device().index()), name, rank_);
      host = stage_out(t, *staging, is_send);
      device = t.device();
#else
      TORCH_CHECK(false, "ringreduce ", name, ": the tensor is on CUDA but this ringreduce build "
                  "has no CUDA support");
#endif
    } else if (is_send) {
      host = t.clone(at::MemoryFormat::Contiguous);
    } else {
      host = t.is_contiguous() ? t : at::empty(t.sizes(), t.options());
    }
    auto work = c10::make_intrusive<RRWork>(g_, name, is_send ? OpType::SEND : OpType::RECV,
                                            std::vector<at::Tensor>{t}, device,
                                            c10::ArrayRef<at::Tensor>(t));
    trace_p2p(*work, is_send, peer == kAnySource ? -1 : peer, t);
    std::shared_ptr<XhostTransport> xt = std::dynamic_pointer_cast<XhostTransport>(g_->transport);
    TORCH_INTERNAL_ASSERT(xt, "ringreduce ", name, ": a transport that is neither one host's "
                          "nor several hosts'");
    c10::intrusive_ptr<c10d::Work> posted;
    try {
      posted = xt->p2p_start(is_send, host, peer, tag);
      if (work->trace().on) g_->fr->started(work->trace());
    } catch (const std::exception&) {
      work->finish(std::make_exception_ptr(
          std::runtime_error(named_error(name, error_text(std::current_exception())))));
      return work;
    }
    if (is_send) work->finish(nullptr);
    auto g = g_;
    auto done = std::make_shared<std::atomic<bool>>(false);
    std::thread waiter([g, xt, work, posted, name, is_send, peer, tag, host, t, staging, done] {
      const Finally mark_done([&] { done->store(true, std::memory_order_release); });
      int source = peer;
      std::string error;
      try {
        source = xt->p2p_wait(posted, is_send, peer, tag);
      } catch (const std::exception&) {
        error = named_error(name, error_text(std::current_exception()));
      }
      if (error.empty() && !is_send && !host.is_same(t)) {
        try {
          c10::InferenceMode no_autograd;
          if (staging) {
#ifdef RINGREDUCE_WITH_CUDA
            stage_in(t, host, *staging, *work);
#endif
          } else {
            t.copy_(host);
          }
        } catch (...) {
          error = "ringreduce: recv on rank " + std::to_string(g->rank) + " failed copying its "
                  "message into the tensor: " + error_text(std::current_exception());
        }
      }
      if (!error.empty()) {
        g->fail(error);
        if (!is_send) work->finish(std::make_exception_ptr(std::runtime_error(error)));
        return;
      }
      if (!is_send) {
        work->set_source(source);
        work->finish(nullptr);
      }
    });
    const std::lock_guard<std::mutex> held(p2p_mu_);
    // Joins the waiters that have finished, so that a long run of messages keeps few threads.
    auto finished = std::remove_if(xhost_waiters_.begin(), xhost_waiters_.end(),
                                   [](XhostWaiter& w) {
                                     if (!w.done->load(std::memory_order_acquire)) return false;
                                     w.thread.join();
                                     return true;
                                   });
    xhost_waiters_.erase(finished, xhost_waiters_.end());
    xhost_waiters_.push_back(XhostWaiter{std::move(waiter), done});
    return work;
  }

  // ---- the flight recorder (flight_recorder.h) ------------------------------------------------

  // Records this group's operations in torch's flight recorder where TORCH_FR_BUFFER_SIZE asks
  // for it (decided once per process); says once why not where it cannot.
  void start_recording() {
    const FrSettings& fr = fr_settings();
    if (fr.fr == nullptr) {
      if (!fr.why_off.empty()) {
        TORCH_WARN_ONCE("ringreduce: TORCH_FR_BUFFER_SIZE is set, but ringreduce's operations "
                        "are not recorded in torch's flight recorder: ", fr.why_off);
      }
      return;
    }
    std::shared_ptr<Transport> tr = g_->transport;
    std::function<bool(int&, std::string&)> aborted_peer;
    if (tr->native() != nullptr) {
      aborted_peer = [tr](int& peer, std::string& message) {
        return tr->native()->aborted_peer(peer, message);
      };
    }
    g_->fr = std::make_shared<GroupRecorder>(fr, global_ranks_, rank_, std::move(aborted_peer));
  }

  std::chrono::milliseconds timeout() const {
    return std::chrono::milliseconds(int64_t(g_->timeout_s.load() * 1000.0));
  }

  // A send or receive's entry (`peer` < 0: from any source).
  void trace_p2p(RRWork& work, bool is_send, int peer, const at::Tensor& t) {
    if (!g_->fr) return;
    work.set_trace(g_->fr->p2p(*this, is_send, peer, t, seq_collective_.load(), timeout()));
  }

  double timeout_of(const c10::intrusive_ptr<Options>& opts) const {
    return opts ? opts->timeout.count() / 1000.0 : g_->timeout_s.load();
  }

  // ringreduce.distributed.<fn>(*args, rank=, size=): a new Backend, or None (nullptr).
  template <typename... A>
  c10::intrusive_ptr<c10d::Backend> derive(const char* fn, const A&... args) {
    py::gil_scoped_acquire gil;
    py::object made = py::module_::import("ringreduce.distributed").attr(fn)(
        args..., py::arg("rank") = rank_, py::arg("size") = size_,
        py::arg("global_ranks") = global_ranks_);
    if (made.is_none()) return nullptr;
    return made.cast<c10::intrusive_ptr<RingReduceBackend>>();
  }

  const bool async_;
  const c10::intrusive_ptr<c10d::Store> store_;  // the one the group was made with, or null
  std::atomic<int> shrinks_{0};
  std::shared_ptr<Group> g_;
  std::shared_ptr<Engine> engine_;
  std::mutex p2p_mu_;
  std::unique_ptr<P2PEngine> p2p_;
  struct XhostWaiter {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;  // set as the thread's last act
  };
  std::vector<XhostWaiter> xhost_waiters_;
  std::mutex shut_mu_;
  bool shut_ = false;
  std::atomic<uint64_t> seq_collective_{0};  // collectives issued (sequence numbers)
  std::vector<uint64_t> global_ranks_;       // the members' global ranks
  CoalescingBatch batch_;
};

// At interpreter exit: every group still alive ends its threads, with a short grace for work
// in flight (the process is leaving: nothing will wait for it).
void shutdown_all(double grace_s) {
  // Under the lock: a group destroyed meanwhile waits here rather than vanish mid-call.
  const std::lock_guard<std::mutex> held(g_live_mu);
  for (RingReduceBackend* b : live_backends()) {
    b->shutdown_within(std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double>(grace_s)));
  }
}

}  // namespace

void bind_backend(py::module& m) {
  py::class_<RingReduceBackend, c10d::Backend, c10::intrusive_ptr<RingReduceBackend>>(
      m, "Backend", "One rank of a ringreduce process group (torch.distributed backend).")
      .def(py::init([](py::object comm, int rank, int size, double timeout_s, bool async,
                       py::object store, std::vector<uint64_t> global_ranks,
                       std::vector<int> hosts, bool caller_runs) {
             std::shared_ptr<Transport> t;
             if (py::isinstance<XhostTransport>(comm)) {
               t = comm.cast<std::shared_ptr<XhostTransport>>();
             } else {
               t = std::make_shared<NativeTransport>(comm.cast<std::shared_ptr<Comm>>(),
                                                     std::move(hosts));
             }
             c10::intrusive_ptr<c10d::Store> st;
             if (!store.is_none()) st = store.cast<c10::intrusive_ptr<c10d::Store>>();
             return c10::make_intrusive<RingReduceBackend>(t, rank, size, timeout_s, async,
                                                           std::move(st),
                                                           std::move(global_ranks),
                                                           caller_runs);
           }),
           py::arg("comm"), py::arg("rank"), py::arg("size"), py::arg("timeout"),
           py::arg("async_engine") = true, py::arg("store") = py::none(),
           py::arg("global_ranks") = std::vector<uint64_t>{},
           py::arg("hosts") = std::vector<int>{}, py::arg("caller_runs") = true,
           "comm: a Comm (one host; with `hosts`, every rank's host, when its ring spans hosts "
           "that share memory) or a HierarchicalComm (several hosts).")
      .def_property_readonly("comm", &RingReduceBackend::comm,
                             "The executor object (a Comm, or a HierarchicalComm across hosts).")
      .def_property_readonly("inter_host_bytes", &RingReduceBackend::inter_host_bytes,
                             "Bytes this rank has sent to other hosts (None on one host).")
      .def_property_readonly(
          "timeout",
          [](RingReduceBackend& b) { return b.getBackendOptions()->timeout; },
          "The group's timeout (a timedelta); ringreduce.distributed builds the backend's "
          "options (what dist.split_group copies) from it.")
      .def_property_readonly("failed", &RingReduceBackend::is_failed)
      .def_property_readonly("ran_by_callers", &RingReduceBackend::ran_by_callers,
                             "Collectives run in a caller's thread rather than the progress "
                             "thread (none with RINGREDUCE_CALLER_RUNS=0).")
      .def_property_readonly("failure", &RingReduceBackend::failure);
  bind_xhost(m);
  m.def("shutdown_all", &shutdown_all, py::arg("grace"),
        py::call_guard<py::gil_scoped_release>(),
        "Shuts down every live ringreduce group (interpreter exit).");
}

}  // namespace dist
}  // namespace rr
