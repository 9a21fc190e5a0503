// Coalesced collectives: a batch of tensors moves in one ring pass per (dtype, device) kind
// instead of one per tensor. The batch is packed into one flat buffer, the Transport runs one
// collective over it, and the results are unpacked into the callers' tensors. Used by
// all_reduce_coalesced, all_gather_coalesced, allgather_into_tensor_coalesced and
// reduce_scatter_tensor_coalesced (which torch's _coalescing_manager calls), on CPU and CUDA
// alike (packing is at::cat / copy_, on the current stream).
//
// Also the batch of startCoalescing()/endCoalescing(): the Works issued in between, folded into
// one Work (batch_isend_irecv uses it once the backend supports coalescing).
// Part of the "ringreduce" backend (backend.h describes the whole); only backend.cpp includes it.
#pragma once

#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/extension.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "transport.h"

namespace rr {
namespace dist {
namespace detail __attribute__((visibility("hidden"))) {

// Indices of `tensors` grouped by (dtype, device), each group in first-seen order.
inline std::vector<std::vector<size_t>> same_kind_groups(const std::vector<at::Tensor>& tensors) {
  std::vector<std::vector<size_t>> groups;
  for (size_t i = 0; i < tensors.size(); ++i) {
    auto g = groups.begin();
    for (; g != groups.end(); ++g) {
      const at::Tensor& ref = tensors[g->front()];
      if (ref.scalar_type() == tensors[i].scalar_type() && ref.device() == tensors[i].device()) {
        break;
      }
    }
    if (g == groups.end()) {
      groups.push_back({i});
    } else {
      g->push_back(i);
    }
  }
  return groups;
}

// Writes `part` (flat) into `dst`, whatever dst's strides.
inline void unpack_into(const at::Tensor& dst, const at::Tensor& part) {
  dst.copy_(part.view(dst.sizes()));
}

// All-reduces every tensor of `tensors` in place: one Transport all_reduce per kind.
inline void fused_all_reduce(Transport& tr, const std::vector<at::Tensor>& tensors,
                             const std::string& op) {
  for (const std::vector<size_t>& group : same_kind_groups(tensors)) {
    std::vector<at::Tensor> flats;
    for (size_t i : group) flats.push_back(tensors[i].reshape(-1));
    at::Tensor buf = at::cat(flats);
    tr.all_reduce(buf, op);
    int64_t at_ = 0;
    for (size_t i : group) {
      const int64_t n = tensors[i].numel();
      unpack_into(tensors[i], buf.slice(0, at_, at_ + n));
      at_ += n;
    }
  }
}

// outputs[i][r] receives rank r's inputs[i] (inputs of any shapes; outputs[i][r] holds as many
// elements as inputs[i]): one Transport all_gather per kind. Each rank's block of the gathered
// buffer is its inputs of that kind, packed in order.
inline void fused_all_gather(Transport& tr, const std::vector<std::vector<at::Tensor>>& outputs,
                             const std::vector<at::Tensor>& inputs, int size) {
  for (const std::vector<size_t>& group : same_kind_groups(inputs)) {
    std::vector<at::Tensor> flats;
    for (size_t i : group) flats.push_back(inputs[i].reshape(-1));
    const at::Tensor packed = at::cat(flats);
    const int64_t block = packed.numel();
    const at::Tensor gathered = at::empty({block * size}, packed.options());
    std::vector<at::Tensor> parts;
    for (int r = 0; r < size; ++r) parts.push_back(gathered.slice(0, r * block, (r + 1) * block));
    tr.all_gather(parts, packed);
    int64_t at_ = 0;
    for (size_t i : group) {
      const int64_t n = inputs[i].numel();
      for (int r = 0; r < size; ++r) {
        unpack_into(outputs[i][size_t(r)], parts[size_t(r)].slice(0, at_, at_ + n));
      }
      at_ += n;
    }
  }
}

// outputs[i] = the reduction over ranks of block `rank` of inputs[i] (flat, size x
// outputs[i].numel() elements): one Transport reduce_scatter per kind over a buffer whose block
// r packs block r of every input of that kind.
inline void fused_reduce_scatter(Transport& tr, const std::vector<at::Tensor>& outputs,
                                 const std::vector<at::Tensor>& flat_inputs, const std::string& op,
                                 int size) {
  for (const std::vector<size_t>& group : same_kind_groups(flat_inputs)) {
    int64_t block = 0;
    for (size_t i : group) block += outputs[i].numel();
    const at::Tensor packed = at::empty({block * size}, flat_inputs[group.front()].options());
    int64_t at_ = 0;
    for (size_t i : group) {
      const int64_t n = outputs[i].numel();
      for (int r = 0; r < size; ++r) {
        packed.slice(0, r * block + at_, r * block + at_ + n)
            .copy_(flat_inputs[i].slice(0, r * n, (r + 1) * n));
      }
      at_ += n;
    }
    const at::Tensor reduced = at::empty({block}, packed.options());
    tr.reduce_scatter(reduced, packed, op);
    at_ = 0;
    for (size_t i : group) {
      const int64_t n = outputs[i].numel();
      unpack_into(outputs[i], reduced.slice(0, at_, at_ + n));
      at_ += n;
    }
  }
}

// The Works of one startCoalescing()..endCoalescing() batch, as one Work: done when all are,
// failed with the first failure; its future holds every output in issue order.
class BatchWork final : public c10d::Work {
 public:
  BatchWork(int rank, std::vector<c10::intrusive_ptr<c10d::Work>> works)
      : c10d::Work(rank, c10d::OpType::COALESCED), works_(std::move(works)) {}

  bool isCompleted() override {
    for (auto& w : works_) {
      if (!w->isCompleted()) return false;
    }
    return true;
  }
  bool isSuccess() const override {
    for (const auto& w : works_) {
      if (w->exception()) return false;
    }
    return true;
  }
  std::exception_ptr exception() const override {
    for (const auto& w : works_) {
      if (auto e = w->exception()) return e;
    }
    return nullptr;
  }
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override {
    for (auto& w : works_) w->wait(timeout);
    return true;
  }
  void synchronize() override { wait(); }
  void abort() override {
    for (auto& w : works_) w->abort();
  }
  std::vector<at::Tensor> result() override {
    std::vector<at::Tensor> out;
    for (auto& w : works_) {
      std::vector<at::Tensor> r = w->result();
      out.insert(out.end(), r.begin(), r.end());
    }
    return out;
  }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    const std::lock_guard<std::mutex> held(mu_);
    if (future_) return future_;
    std::vector<c10::Device> devices;
    std::vector<c10::intrusive_ptr<c10::ivalue::Future>> parts;
    for (auto& w : works_) {
      parts.push_back(w->getFuture());
      for (const c10::Device& d : parts.back()->devices()) {
        if (std::find(devices.begin(), devices.end(), d) == devices.end()) devices.push_back(d);
      }
    }
    future_ = c10::make_intrusive<c10::ivalue::Future>(
        c10::ListType::create(c10::TensorType::get()), devices);
    if (parts.empty()) {
      future_->markCompleted(c10::IValue(std::vector<at::Tensor>{}));
      return future_;
    }
    auto left = std::make_shared<std::atomic<size_t>>(parts.size());
    c10::intrusive_ptr<c10::ivalue::Future> all = future_;
    for (auto& part : parts) {
      part->addCallback([left, all, parts](c10::ivalue::Future& done) {
        if (left->fetch_sub(1) != 1) return;
        std::vector<at::Tensor> tensors;
        for (const auto& p : parts) {
          if (p->hasError()) {
            all->setError(p->exception_ptr());
            return;
          }
          for (const c10::IValue& v : p->value().toList()) tensors.push_back(v.toTensor());
        }
        all->markCompleted(c10::IValue(tensors));
      });
    }
    return future_;
  }

 private:
  const std::vector<c10::intrusive_ptr<c10d::Work>> works_;
  std::mutex mu_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// The backend's coalescing state: between start() and end(), every Work issued is noted.
class CoalescingBatch {
 public:
  void start(int rank) {
    const std::lock_guard<std::mutex> held(mu_);
    TORCH_CHECK(!active_, "ringreduce: startCoalescing on rank ", rank, " while a coalescing "
                "batch is already open (torch's _coalescing_manager does not nest)");
    active_ = true;
    works_.clear();
  }
  void note(const c10::intrusive_ptr<c10d::Work>& work) {
    const std::lock_guard<std::mutex> held(mu_);
    if (active_) works_.push_back(work);
  }
  c10::intrusive_ptr<c10d::Work> end(int rank) {
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    {
      const std::lock_guard<std::mutex> held(mu_);
      TORCH_CHECK(active_, "ringreduce: endCoalescing on rank ", rank, " without "
                  "startCoalescing");
      active_ = false;
      works.swap(works_);
    }
    return c10::make_intrusive<BatchWork>(rank, std::move(works));
  }

 private:
  std::mutex mu_;
  bool active_ = false;
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
};

}  // namespace detail
}  // namespace dist
}  // namespace rr
