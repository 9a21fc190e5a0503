// The backend's transports.
// Part of the "ringreduce" backend (backend.h describes the whole); only backend.cpp includes it.
#pragma once

#include <torch/extension.h>

#include <atomic>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "../ring/schedule.h"
#include "backend_common.h"
#include "comm.h"

namespace rr {
namespace dist {
// Hidden like the pybind11 types its classes hold (an anonymous namespace before the split).
namespace detail __attribute__((visibility("hidden"))) {

namespace py = pybind11;

// ---- transports --------------------------------------------------------------------------
// What moves a group's bytes: the native Comm (one host, or hosts sharing memory under
// RINGREDUCE_HIERARCHICAL=0), or xhost.h's XhostTransport (several hosts: this host's Comm
// composed with torch's gloo/NCCL between hosts).

class Transport {
 public:
  virtual ~Transport() = default;
  virtual void check(const at::Tensor& t, const std::string& op, const std::string& fn,
                     const std::string& arg) = 0;
  virtual void all_reduce(const at::Tensor& t, const std::string& op) = 0;
  virtual void broadcast(const at::Tensor& t, int root) = 0;
  virtual void all_gather(const std::vector<at::Tensor>& outs, const at::Tensor& in) = 0;
  virtual void reduce_scatter(const at::Tensor& out, const at::Tensor& in,
                              const std::string& op) = 0;
  virtual void barrier() = 0;
  virtual void gather(const std::vector<at::Tensor>& outs, const at::Tensor& in, int root) = 0;
  virtual void scatter(const at::Tensor& out, const std::vector<at::Tensor>& ins, int root) = 0;
  virtual void all_to_all(const std::vector<at::Tensor>& outs,
                          const std::vector<at::Tensor>& ins) = 0;
  virtual void fail(const std::string& msg) = 0;
  virtual void abort() = 0;
  virtual void close() = 0;
  virtual void set_timeout(double seconds) = 0;
  virtual Comm* native() { return nullptr; }
  // Bytes this rank has sent to other hosts (handed to the inter-host engine, or carried by
  // ring hops that cross a host boundary); none on one host.
  virtual c10::optional<int64_t> inter_host_bytes() { return c10::nullopt; }
  virtual py::object object() = 0;
};

class NativeTransport final : public Transport {
 public:
  // host_of: every rank's host where the ring spans hosts that share memory
  // (RINGREDUCE_HIERARCHICAL=0, for comparisons on one machine): the bytes of its all-reduce
  // hops that cross a host boundary are counted (what bench/ddp.py compares with the
  // hierarchical path). Empty on one host.
  explicit NativeTransport(std::shared_ptr<Comm> c, std::vector<int> host_of = {})
      : c_(std::move(c)), host_of_(std::move(host_of)) {}
  void check(const at::Tensor& t, const std::string& op, const std::string& fn,
             const std::string& arg) override {
    c_->check(t, op, fn, arg);
  }
  void all_reduce(const at::Tensor& t, const std::string& op) override {
    c_->all_reduce(t, op);
    if (!host_of_.empty()) count_crossing(t);
  }
  void broadcast(const at::Tensor& t, int root) override { c_->broadcast(t, root); }
  void all_gather(const std::vector<at::Tensor>& outs, const at::Tensor& in) override {
    c_->all_gather(outs, in);
  }
  void reduce_scatter(const at::Tensor& out, const at::Tensor& in,
                      const std::string& op) override {
    c_->reduce_scatter(out, in, op);
  }
  void barrier() override { c_->barrier(); }
  void gather(const std::vector<at::Tensor>& outs, const at::Tensor& in, int root) override {
    c_->gather(outs, in, root);
  }
  void scatter(const at::Tensor& out, const std::vector<at::Tensor>& ins, int root) override {
    c_->scatter(out, ins, root);
  }
  void all_to_all(const std::vector<at::Tensor>& outs,
                  const std::vector<at::Tensor>& ins) override {
    c_->all_to_all(outs, ins);
  }
  void fail(const std::string& msg) override { c_->fail(msg); }
  void abort() override { c_->abort(); }
  void close() override { c_->close(); }
  void set_timeout(double seconds) override { c_->set_timeout(seconds); }
  Comm* native() override { return c_.get(); }
  c10::optional<int64_t> inter_host_bytes() override {
    if (host_of_.empty()) return c10::nullopt;
    return crossing_bytes_.load();
  }
  py::object object() override {
    py::gil_scoped_acquire gil;
    return py::cast(c_);
  }

 private:
  // The successor reads every chunk but its own in the reduce-scatter and every chunk but the
  // next one's in the all-gather (csrc/ring/schedule.h).
  void count_crossing(const at::Tensor& t) {
    const int world = int(host_of_.size()), rank = c_->rank();
    const int succ = (rank + 1) % world;
    if (host_of_[size_t(succ)] == host_of_[size_t(rank)]) return;
    const int64_t n = t.numel();
    const auto size = [&](int c) { return rr::chunk_range(n, world, t.element_size(), c).count; };
    crossing_bytes_ += (2 * n - size(succ) - size((succ + 1) % world)) * int64_t(t.element_size());
  }

  std::shared_ptr<Comm> c_;
  const std::vector<int> host_of_;
  std::atomic<int64_t> crossing_bytes_{0};
};

}  // namespace detail
}  // namespace dist
}  // namespace rr
