// The backend's transports.
// Part of the "ringreduce" backend (backend.h describes the whole); only backend.cpp includes it.
#pragma once

#include <torch/extension.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backend_common.h"
#include "comm.h"

namespace rr {
namespace dist {
// Hidden like the pybind11 types its classes hold (an anonymous namespace before the split).
namespace detail __attribute__((visibility("hidden"))) {

namespace py = pybind11;

// ---- transports --------------------------------------------------------------------------
// What moves a group's bytes: the native Comm (one host), or a Python object with the same
// methods (ringreduce/hierarchy.py: several hosts, composed with torch's gloo/NCCL).

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
  virtual py::object object() = 0;
};

class NativeTransport final : public Transport {
 public:
  explicit NativeTransport(std::shared_ptr<Comm> c) : c_(std::move(c)) {}
  void check(const at::Tensor& t, const std::string& op, const std::string& fn,
             const std::string& arg) override {
    c_->check(t, op, fn, arg);
  }
  void all_reduce(const at::Tensor& t, const std::string& op) override { c_->all_reduce(t, op); }
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
  py::object object() override {
    py::gil_scoped_acquire gil;
    return py::cast(c_);
  }

 private:
  std::shared_ptr<Comm> c_;
};

// Calls into Python hold the GIL only for the call. A Python exception raised by a method run
// on a worker thread becomes a std::runtime_error with its message (its Python object must not
// outlive the GIL); in the caller's thread (check) it propagates as it is.
class PyTransport final : public Transport {
 public:
  explicit PyTransport(py::object o) : o_(std::move(o)) {}
  ~PyTransport() override {
    if (!Py_IsInitialized()) {
      o_.release();  // the interpreter is gone: nothing to decrement
      return;
    }
    py::gil_scoped_acquire gil;
    o_ = py::object();
  }
  void check(const at::Tensor& t, const std::string& op, const std::string& fn,
             const std::string& arg) override {
    py::gil_scoped_acquire gil;
    o_.attr("check")(t, op, fn, arg);
  }
  template <typename... A>
  void call(const char* name, A&&... args) {
    py::gil_scoped_acquire gil;
    try {
      o_.attr(name)(std::forward<A>(args)...);
    } catch (py::error_already_set& e) {
      throw std::runtime_error(named_error(name, e.what()));
    }
  }
  void all_reduce(const at::Tensor& t, const std::string& op) override {
    call("all_reduce", t, op);
  }
  void broadcast(const at::Tensor& t, int root) override { call("broadcast", t, root); }
  void all_gather(const std::vector<at::Tensor>& outs, const at::Tensor& in) override {
    call("all_gather", outs, in);
  }
  void reduce_scatter(const at::Tensor& out, const at::Tensor& in,
                      const std::string& op) override {
    call("reduce_scatter", out, in, op);
  }
  void barrier() override { call("barrier"); }
  void gather(const std::vector<at::Tensor>& outs, const at::Tensor& in, int root) override {
    call("gather", outs, in, root);
  }
  void scatter(const at::Tensor& out, const std::vector<at::Tensor>& ins, int root) override {
    call("scatter", out, ins, root);
  }
  void all_to_all(const std::vector<at::Tensor>& outs,
                  const std::vector<at::Tensor>& ins) override {
    call("all_to_all", outs, ins);
  }
  void fail(const std::string& msg) override { call("fail", msg); }
  void abort() override { call("abort"); }
  void close() override { call("close"); }
  void set_timeout(double seconds) override { call("set_timeout", seconds); }
  py::object object() override {
    py::gil_scoped_acquire gil;
    return o_;
  }

 private:
  py::object o_;
};

}  // namespace detail
}  // namespace dist
}  // namespace rr
