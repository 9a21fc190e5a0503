// The backend's point-to-point engine.
// Part of the "ringreduce" backend (backend.h describes the whole); only backend.cpp includes it.
#pragma once

#include <torch/extension.h>

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "backend_common.h"
#include "comm.h"
#include "engine.h"

#ifdef RINGREDUCE_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace rr {
namespace dist {
// Hidden like the pybind11 types its classes hold (an anonymous namespace before the split).
namespace detail __attribute__((visibility("hidden"))) {

// ---- host staging of CUDA tensors for point-to-point ------------------------------------
// Shared by the one-host engine below and the cross-host path (backend.cpp's xhost_p2p).
// CUDA tensors go through pinned host memory on point-to-point's internal stream of their
// device (Engine::p2p_stream): a send copies its tensor out after the work queued before it on
// the caller's stream; a receive copies the message in when it has arrived, and its Work's
// wait() makes the caller's stream wait for that copy.

#ifdef RINGREDUCE_WITH_CUDA
struct CudaStaging {
  c10::cuda::CUDAStream stream;  // point-to-point's internal stream on the tensor's device
  std::shared_ptr<Event> ready;  // the caller's stream at issue time
};

// The caller's thread, before anything is posted: refuses a capturing stream, marks the work
// queued so far on the caller's stream, and tells the caching allocator that `stream` uses t.
inline CudaStaging stage_issue(const at::Tensor& t, const c10::cuda::CUDAStream& stream,
                               const char* name, int rank) {
  const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(t.device().index());
  const std::string refusal = capture_refusal(current);
  TORCH_CHECK(refusal.empty(), "ringreduce ", name, " on rank ", rank, ": ", refusal);
  auto ready = std::make_shared<Event>(t.device().index());
  ready->record(current);
  c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream);
  return CudaStaging{stream, std::move(ready)};
}

// Pinned host memory standing in for t, after the caller's work before `ready`; for a send it
// holds t's bytes (the host waits for that copy, on the internal stream only).
inline at::Tensor stage_out(const at::Tensor& t, const CudaStaging& s, bool send) {
  rr::cuda::use_thread_local_capture_mode();  // a user's graph capture stays valid
  c10::cuda::CUDAStreamGuard on_internal(s.stream);
  s.ready->block(s.stream);
  at::Tensor host = at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(true));
  if (send) {
    host.copy_(t, /*non_blocking=*/true);
    C10_CUDA_CHECK(cudaStreamSynchronize(s.stream.stream()));
  }
  return host;
}

// A receive whose message is in `host`: copies it into t on the internal stream and gives
// `work` the end event its wait() puts on the caller's stream.
inline void stage_in(const at::Tensor& t, const at::Tensor& host, const CudaStaging& s,
                     RRWork& work) {
  rr::cuda::use_thread_local_capture_mode();
  c10::cuda::CUDAStreamGuard on_internal(s.stream);
  t.copy_(host, /*non_blocking=*/true);
  auto end = std::make_shared<Event>(s.stream.device_index());
  end->record(s.stream);
  // The pinned buffer is freed with the job: the copy must have read it by then.
  C10_CUDA_CHECK(cudaStreamSynchronize(s.stream.stream()));
  work.set_cuda(end, s.stream);
}
#else
struct CudaStaging {};  // a build without CUDA stages nothing
#endif

// ---- point-to-point ----------------------------------------------------------------------
// One thread per group posts sends and receives to the native channels (p2p.h) and completes
// their Works in the order they finish; CUDA tensors are staged as above.

struct P2PJob {
  c10::intrusive_ptr<RRWork> work;
  bool send = false;
  at::Tensor tensor;
  int peer = kAnySource;
  int64_t tag = 0;
  at::Tensor host;
  c10::optional<CudaStaging> staging;  // CUDA tensors
};

class P2PEngine {
 public:
  explicit P2PEngine(std::shared_ptr<Group> g) : g_(std::move(g)) {
    comm_ = g_->transport->native();
    thread_ = std::thread([this] { loop(); });
  }
  ~P2PEngine() { stop(Clock::now()); }

  void submit(std::shared_ptr<P2PJob> job) {
    {
      const std::lock_guard<std::mutex> held(mu_);
      if (!stopping_) {
        queue_.push_back(std::move(job));
        comm_->p2p_interrupt();
        return;
      }
    }
    job->work->finish(std::make_exception_ptr(std::runtime_error(
        "ringreduce " + job->work->name() + ": the process group was destroyed")));
  }

  void stop(Clock::time_point deadline) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      stopping_ = true;
      comm_->p2p_interrupt();
      if (!done_cv_.wait_until(lock, deadline, [this] { return done_; })) {
        lock.unlock();
        g_->fail("ringreduce: the process group was shut down with point-to-point operations "
                 "still pending");
        comm_->p2p_interrupt();
        lock.lock();
        done_cv_.wait_until(lock, Clock::now() + std::chrono::seconds(5), [this] { return done_; });
      }
    }
    if (thread_.joinable()) thread_.join();
  }

 private:
  void loop() {
    c10::InferenceMode no_autograd;
    bool stopping = false;
    for (;;) {
      std::deque<std::shared_ptr<P2PJob>> fresh;
      {
        const std::lock_guard<std::mutex> held(mu_);
        fresh.swap(queue_);
        stopping = stopping_;
      }
      for (auto& job : fresh) post(job);
      if ((stopping && jobs_.empty()) || comm_->closed()) break;
      std::vector<P2PDone> done;
      try {
        done = comm_->p2p_progress(1.0);
      } catch (...) {
        const std::exception_ptr error = std::current_exception();
        for (auto& kv : jobs_) fail(*kv.second, error);
        jobs_.clear();
        continue;
      }
      for (const P2PDone& d : done) {
        auto it = jobs_.find(d.id);
        if (it == jobs_.end()) continue;
        std::shared_ptr<P2PJob> job = std::move(it->second);
        jobs_.erase(it);
        complete(*job, d);
      }
    }
    abandon();
    const std::lock_guard<std::mutex> held(mu_);
    done_ = true;
    done_cv_.notify_all();
  }

  // On exit: fails what is still posted or queued (a submit racing with shutdown).
  void abandon() {
    std::vector<std::shared_ptr<P2PJob>> left;
    for (auto& kv : jobs_) left.push_back(kv.second);
    jobs_.clear();
    {
      const std::lock_guard<std::mutex> held(mu_);
      for (auto& j : queue_) left.push_back(j);
      queue_.clear();
    }
    for (auto& job : left) {
      job->work->finish(std::make_exception_ptr(std::runtime_error(
          "ringreduce: " + job->work->name() + " on rank " + std::to_string(g_->rank) +
          ": the process group was destroyed before it completed")));
    }
  }

  void post(const std::shared_ptr<P2PJob>& job) {
    try {
      const at::Tensor& t = job->tensor;
      if (t.is_cuda()) {
#ifdef RINGREDUCE_WITH_CUDA
        job->host = stage_out(t, *job->staging, job->send);
#else
        TORCH_CHECK(false, "ringreduce: CUDA tensor in a build without CUDA");
#endif
      } else if (t.is_contiguous()) {
        job->host = t;
      } else {
        job->host = job->send ? t.contiguous() : at::empty(t.sizes(), t.options());
      }
      const uint64_t id = next_id_++;
      // torch's name ("float32"), which messages about a mismatched receive show.
      comm_->p2p_post(id, job->send, job->host, job->peer, job->tag,
                      torch_dtype_name(t.scalar_type()));
      jobs_.emplace(id, job);
      if (job->work->trace().on) g_->fr->started(job->work->trace());
    } catch (...) {
      fail(*job, std::current_exception());
    }
  }

  void complete(P2PJob& job, const P2PDone& d) {
    RRWork& work = *job.work;
    if (!d.error.empty()) {
      work.finish(std::make_exception_ptr(std::runtime_error(d.error)));
      return;
    }
    if (!job.send) work.set_source(d.peer);
    try {
      if (job.send || job.host.is_same(job.tensor)) {
        work.finish(nullptr);
      } else if (job.tensor.is_cuda()) {
#ifdef RINGREDUCE_WITH_CUDA
        stage_in(job.tensor, job.host, *job.staging, work);
        work.finish(nullptr);
#endif
      } else {
        job.tensor.copy_(job.host);
        work.finish(nullptr);
      }
    } catch (...) {
      fail(job, std::current_exception());
    }
  }

  void fail(P2PJob& job, const std::exception_ptr& error) {
    g_->fail("ringreduce: " + job.work->name() + " on rank " + std::to_string(g_->rank) +
             " failed: " + error_text(error));
    job.work->finish(error);
  }

  std::shared_ptr<Group> g_;
  Comm* comm_;
  std::mutex mu_;
  std::condition_variable done_cv_;
  std::deque<std::shared_ptr<P2PJob>> queue_;
  std::unordered_map<uint64_t, std::shared_ptr<P2PJob>> jobs_;  // posted, not finished
  uint64_t next_id_ = 1;
  bool stopping_ = false;
  bool done_ = false;
  std::thread thread_;
};

}  // namespace detail
}  // namespace dist
}  // namespace rr
