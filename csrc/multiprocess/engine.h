// A group's shared state, its Work objects, and the engine that runs its collectives in
// issue order.
// Part of the "ringreduce" backend (backend.h describes the whole); only backend.cpp includes it.
#pragma once

#include <ATen/ThreadLocalState.h>
#include <ATen/record_function.h>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/extension.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "backend_common.h"
#include "completer.h"
#include "flight_recorder.h"
#include "transport.h"

namespace rr {
namespace dist {
// Hidden like the pybind11 types its classes hold (an anonymous namespace before the split).
namespace detail __attribute__((visibility("hidden"))) {

class Engine;

// What every thread of one group shares: the transport, the first failure, the timeout.
struct Group {
  std::shared_ptr<Transport> transport;
  int rank = 0;
  int size = 0;
  std::atomic<double> timeout_s{1800.0};
  std::mutex mu;
  std::string failure;  // the first error; the group cannot be used after it
  std::atomic<bool> failed{false};
  Completer completer;
  // Its entries in torch's flight recorder (flight_recorder.h); null when recording is off.
  std::shared_ptr<GroupRecorder> fr;

  void fail(const std::string& msg) {
    bool first = false;
    {
      const std::lock_guard<std::mutex> held(mu);
      first = failure.empty();
      if (first) failure = msg;
    }
    failed.store(true, std::memory_order_release);
    try {
      transport->fail(msg);
    } catch (const std::exception&) {
      // The transport may already be closed; the failure is recorded above.
    }
    // After the peers were told (they dump too): the recorder as the failure left it.
    if (first && fr) fr->group_failed(msg);
  }
  std::string failure_text() {
    const std::lock_guard<std::mutex> held(mu);
    return failure;
  }
};

// ---- Work ----------------------------------------------------------------------------------

class RRWork final : public c10d::Work {
 public:
  // `inputs`: what the profiler shows as the call's input shapes.
  RRWork(std::shared_ptr<Group> group, std::string name, OpType type,
         std::vector<at::Tensor> outputs, c10::optional<at::Device> device,
         c10::ArrayRef<at::Tensor> inputs)
      : c10d::Work(group->rank, type),
        group_(std::move(group)),
        name_(std::move(name)),
        outputs_(std::move(outputs)),
        device_(device),
        level_(Completer::issue_level()) {
    profile_start(inputs);
  }

  const std::string& name() const { return name_; }

  // Its flight recorder entry (Group::fr), set at issue.
  void set_trace(const FrTrace& t) { trace_ = t; }
  const FrTrace& trace() const { return trace_; }
  // Its GPU work is queued: the engine's watchdog reports the entry's completion, not finish().
  void trace_on_gpu() { trace_on_gpu_ = true; }

  bool isCompleted() override { return state_.load(std::memory_order_acquire) != kPending; }
  bool isSuccess() const override { return state_.load(std::memory_order_acquire) == kDone; }
  std::exception_ptr exception() const override {
    const std::lock_guard<std::mutex> held(mu_);
    return error_;
  }
  int sourceRank() const override { return source_.load(); }
  std::vector<at::Tensor> result() override {
    wait();
    return outputs_;
  }
  void synchronize() override { wait(); }
  void abort() override {
    group_->fail("ringreduce: " + name_ + " on rank " + std::to_string(group_->rank) +
                 " was aborted (Work.abort)");
  }

  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

  // When the collective is done (error == nullptr) or failed; later calls do nothing.
  void finish(std::exception_ptr error) noexcept;
  void set_source(int r) { source_.store(r); }
  void set_engine(std::weak_ptr<Engine> e, const void* job) {
    engine_ = std::move(e);
    job_ = job;
  }
#ifdef RINGREDUCE_WITH_CUDA
  void set_cuda(std::shared_ptr<Event> end, c10::cuda::CUDAStream stream) {
    end_ = std::move(end);
    stream_ = stream;
  }
#endif

 private:
  enum : int { kPending = 0, kDone = 1, kFailed = 2 };
  // While torch's profiler records: an event "ringreduce:<name>" with the inputs' shapes, from
  // the call (this thread) to the collective's end (finish(), any thread), as ProcessGroupGloo
  // records "gloo:<name>". Checking for callbacks first keeps the unprofiled call free of the
  // RecordFunction.
  void profile_start(c10::ArrayRef<at::Tensor> inputs) {
    c10::optional<at::StepCallbacks> callbacks =
        at::getStepCallbacksUnlessEmpty(at::RecordScope::USER_SCOPE);
    if (!callbacks) return;
    auto record = std::make_shared<at::RecordFunction>(std::move(*callbacks));
    record->_setAsync();  // it ends on another thread
    const std::vector<c10::IValue> args(inputs.begin(), inputs.end());
    record->before("ringreduce:" + name_,
                   c10::ArrayRef<const c10::IValue>(args.data(), args.size()));
    recordFunctionEndCallback_ = at::wrapPropagateTLSState([record] { record->end(); });
  }
  c10::intrusive_ptr<c10::ivalue::Future> make_future() const {
    std::vector<c10::Device> devices;
    if (device_) devices.push_back(*device_);
    return c10::make_intrusive<c10::ivalue::Future>(
        c10::ListType::create(c10::TensorType::get()), devices);
  }
  // Marks `fut` completed (or failed), with the internal stream current on CUDA so that the
  // future's own events follow the collective's work.
  void complete(const c10::intrusive_ptr<c10::ivalue::Future>& fut,
                const std::exception_ptr& error) const {
#ifdef RINGREDUCE_WITH_CUDA
    c10::optional<c10::cuda::CUDAStreamGuard> guard;
    if (stream_) {
      rr::cuda::use_thread_local_capture_mode();  // a completion thread, or the caller's
      guard.emplace(*stream_);
    }
#endif
    if (error) {
      fut->setError(error);
    } else {
      fut->markCompleted(c10::IValue(outputs_));
    }
  }

  std::shared_ptr<Group> group_;
  const std::string name_;
  const std::vector<at::Tensor> outputs_;
  const c10::optional<at::Device> device_;
  const int level_;  // the completion level of its future (Completer)
  std::atomic<int> state_{kPending};
  std::atomic<int> source_{-1};
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::exception_ptr error_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::weak_ptr<Engine> engine_;  // while queued: wait() may run the job itself
  const void* job_ = nullptr;
  bool finishing_ = false;  // finish() has been called
  FrTrace trace_;
  bool trace_on_gpu_ = false;
#ifdef RINGREDUCE_WITH_CUDA
  std::shared_ptr<Event> end_;
  c10::optional<c10::cuda::CUDAStream> stream_;
#endif
};

// Never throws, and only the first call counts: it runs in the engine's threads (a throw there
// would end the process, and a caller's catch that finished the Work again would complete its
// future twice). The recorder and the profiler are told best effort; the Work's state, its
// waiters and its future come first.
inline void RRWork::finish(std::exception_ptr error) noexcept {
  {
    const std::lock_guard<std::mutex> held(mu_);
    if (finishing_) return;
    finishing_ = true;
  }
  try {
    if (trace_.on && (error || !trace_on_gpu_)) group_->fr->finished(trace_, !error);
  } catch (...) {
  }
  try {
    if (recordFunctionEndCallback_) recordFunctionEndCallback_();
  } catch (...) {
  }
  recordFunctionEndCallback_ = nullptr;
  c10::intrusive_ptr<c10::ivalue::Future> fut;
  {
    const std::lock_guard<std::mutex> held(mu_);
    error_ = error;
    state_.store(error ? kFailed : kDone, std::memory_order_release);
    fut = future_;
    engine_.reset();
    job_ = nullptr;
  }
  cv_.notify_all();
  if (!fut) return;
  c10::intrusive_ptr<RRWork> self = c10::intrusive_ptr<RRWork>::reclaim_copy(this);
  try {
    group_->completer.post(level_, [self, fut, error] { self->complete(fut, error); });
  } catch (...) {
    // No completion thread could take it (out of memory or threads): completed here.
    try {
      complete(fut, error);
    } catch (...) {
    }
  }
}

inline c10::intrusive_ptr<c10::ivalue::Future> RRWork::getFuture() {
  c10::intrusive_ptr<c10::ivalue::Future> fut;
  std::exception_ptr error;
  {
    const std::lock_guard<std::mutex> held(mu_);
    if (future_) return future_;
    future_ = make_future();
    if (state_.load() == kPending) return future_;  // finish() completes it
    fut = future_;
    error = error_;
  }
  // Already done: completed here, in the caller's thread (no collective depends on it).
  complete(fut, error);
  return fut;
}

// ---- the engine ------------------------------------------------------------------------------

struct Job {
  c10::intrusive_ptr<RRWork> work;
  // On CUDA, what `run` captures (tensors, and copies made in the caller's thread such as a
  // reshape of a non-contiguous input) lives until the collective's GPU work has finished
  // (Engine::Inflight): no list of the tensors the internal stream reads can miss one.
  std::function<void()> run;
  bool cuda = false;
  bool drain_gpu = false;  // barrier: wait for the GPU work of every collective before it
  // `run` only reads and writes tensor memory, calling no torch op (a CPU all-reduce of a
  // contiguous tensor on one host): it needs no InferenceMode guard (execute).
  bool memory_only = false;
#ifdef RINGREDUCE_WITH_CUDA
  c10::optional<c10::cuda::CUDAStream> stream;
  std::shared_ptr<Event> ready;
#endif
};

class Engine : public std::enable_shared_from_this<Engine> {
 public:
  // `caller_runs`: a synchronous CPU collective, or Work.wait() on a queued one, may run in
  // the caller's thread (run_now, help); false: every collective runs on the progress thread,
  // the path every CUDA collective and its failures take (RINGREDUCE_CALLER_RUNS=0).
  Engine(std::shared_ptr<Group> g, bool caller_runs)
      : g_(std::move(g)), caller_runs_(caller_runs) {}

  void start() {
    thread_ = std::thread([this] { loop(); });
#ifdef RINGREDUCE_WITH_CUDA
    watchdog_ = std::thread([this] { watch(); });
#endif
  }

  void submit(std::shared_ptr<Job> job) {
    job->work->set_engine(weak_from_this(), job.get());
    {
      const std::lock_guard<std::mutex> held(mu_);
      if (!stopping_) {
        pending_.push_back(std::move(job));
        cv_.notify_all();
        return;
      }
    }
    job->work->finish(std::make_exception_ptr(std::runtime_error(
        "ringreduce: " + job->work->name() + " on rank " + std::to_string(g_->rank) +
        ": the process group was destroyed")));
  }

  // Runs `job` in the calling thread if nothing is queued or running; false otherwise.
  bool run_now(const std::shared_ptr<Job>& job) {
    if (!caller_runs_) return false;
    {
      const std::lock_guard<std::mutex> held(mu_);
      if (busy_ || !pending_.empty() || stopping_) return false;
      busy_ = true;
    }
    ran_by_callers_.fetch_add(1, std::memory_order_relaxed);
    execute(*job);
    release();
    return true;
  }

  // Work.wait() on a queued CPU job: runs it in the waiting thread if it is next and nothing
  // runs (it would only block anyway).
  void help(const void* job) {
    if (!caller_runs_) return;
    std::shared_ptr<Job> mine;
    {
      const std::lock_guard<std::mutex> held(mu_);
      if (busy_ || pending_.empty() || pending_.front().get() != job || pending_.front()->cuda) {
        return;
      }
      mine = std::move(pending_.front());
      pending_.pop_front();
      busy_ = true;
    }
    ran_by_callers_.fetch_add(1, std::memory_order_relaxed);
    execute(*mine);
    release();
  }

  // Lets queued collectives finish until `deadline`, then fails the group so that the rest
  // fail at once; returns when the threads have ended (or, past deadline + 5 s, detaches them).
  void stop(Clock::time_point deadline) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      stopping_ = true;
      cv_.notify_all();
      if (!done_cv_.wait_until(lock, deadline, [this] { return loop_done_; })) {
        lock.unlock();
        g_->fail("ringreduce: the process group was shut down with collectives still queued");
        lock.lock();
        done_cv_.wait_until(lock, Clock::now() + std::chrono::seconds(5),
                            [this] { return loop_done_; });
      }
    }
    join(thread_);
#ifdef RINGREDUCE_WITH_CUDA
    {
      const std::lock_guard<std::mutex> held(inflight_mu_);
      watch_stop_ = true;
    }
    watch_cv_.notify_all();
    join(watchdog_);
    settle_inflight(deadline);
#endif
  }

  bool used_cuda() const { return used_cuda_.load(); }
  // Collectives that ran in a caller's thread (run_now, help) rather than the progress thread.
  uint64_t ran_by_callers() const { return ran_by_callers_.load(std::memory_order_relaxed); }

#ifdef RINGREDUCE_WITH_CUDA
  // The group's own stream on `device` for collectives (not torch's pool: user code cannot be
  // handed it).
  c10::cuda::CUDAStream stream(c10::DeviceIndex device) { return own_stream(streams_, device); }
  // Point-to-point's own stream on `device`: a send or receive never waits on the GPU behind
  // the collectives queued before it (a collective may itself wait for a peer's receive).
  c10::cuda::CUDAStream p2p_stream(c10::DeviceIndex device) {
    return own_stream(p2p_streams_, device);
  }
  // The one GPU this group's collectives have run on, if there is just one.
  c10::optional<c10::DeviceIndex> sole_device() {
    const std::lock_guard<std::mutex> held(streams_mu_);
    if (streams_.size() != 1) return c10::nullopt;
    return streams_.begin()->first;
  }
#endif

 private:
  static void join(std::thread& t) {
    if (t.joinable()) t.join();
  }

#ifdef RINGREDUCE_WITH_CUDA
  c10::cuda::CUDAStream own_stream(std::map<c10::DeviceIndex, c10::cuda::CUDAStream>& streams,
                                   c10::DeviceIndex device) {
    const std::lock_guard<std::mutex> held(streams_mu_);
    auto it = streams.find(device);
    if (it != streams.end()) return it->second;
    c10::cuda::CUDAGuard guard(device);
    cudaStream_t s = nullptr;
    C10_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    auto stream = c10::cuda::getStreamFromExternal(s, device);
    // Never destroyed: a Work (its future, its end event) may refer to the stream after the
    // group is gone, and a process makes two per group and device.
    streams.emplace(device, stream);
    used_cuda_.store(true);
    return stream;
  }
#endif

  // Only the progress thread waits on cv_ for `busy_`, and only with work pending (or to stop):
  // waking it otherwise would cost a context switch per synchronous call on a core the peers
  // need.
  void release() {
    const std::lock_guard<std::mutex> held(mu_);
    busy_ = false;
    if (!pending_.empty() || stopping_) cv_.notify_all();
  }

  void loop() {
    for (;;) {
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return (!busy_ && !pending_.empty()) || (stopping_ && !busy_); });
        if (pending_.empty()) break;
        job = std::move(pending_.front());
        pending_.pop_front();
        busy_ = true;
      }
      execute(*job);
      release();
    }
    const std::lock_guard<std::mutex> held(mu_);
    loop_done_ = true;
    done_cv_.notify_all();
  }

  void execute(Job& job) {
    RRWork& work = *job.work;
    [[maybe_unused]] bool gpu_queued = false;  // CUDA: run() started, GPU work may be queued
    try {
      if (g_->failed.load(std::memory_order_acquire)) {
        throw std::runtime_error("ringreduce: " + work.name() + " on rank " +
                                 std::to_string(g_->rank) + ": this process group failed "
                                 "earlier and cannot be used any more: " + g_->failure_text());
      }
      // Worker threads do not inherit the caller's grad or inference mode; the collectives
      // only write tensor memory, and this makes any helper op (a copy back) legal for
      // inference tensors and tensors that require grad alike. A job that calls no torch op
      // goes without: entering and leaving the mode was about 600 of the 39,400 instructions of
      // an 8-byte dist.all_reduce at world size 1 (bench/RESULTS.md).
      c10::optional<c10::InferenceMode> no_autograd;
      if (job.cuda || !job.memory_only) no_autograd.emplace();
      if (!job.cuda) {
        if (work.trace().on) g_->fr->started(work.trace());
        job.run();
        work.finish(nullptr);
        return;
      }
#ifdef RINGREDUCE_WITH_CUDA
      rr::cuda::use_thread_local_capture_mode();  // a user's graph capture stays valid
      c10::cuda::CUDAStreamGuard on_internal(*job.stream);
      job.ready->block(*job.stream);
      if (job.drain_gpu) drain_gpu();
      gpu_queued = true;
      // Recorded collectives: start and end events for the recorder's states (and durations
      // under TORCH_NCCL_ENABLE_TIMING), reported when the watchdog sees them complete.
      const bool timed = work.trace().on && g_->fr->timing();
      std::shared_ptr<Event> start;
      if (work.trace().on) {
        start = std::make_shared<Event>(job.stream->device_index(), timed);
        start->record(*job.stream);
      }
      job.run();
      auto end = std::make_shared<Event>(job.stream->device_index(), timed);
      end->record(*job.stream);
      work.set_cuda(end, *job.stream);
      if (work.trace().on) work.trace_on_gpu();
      {
        const std::lock_guard<std::mutex> held(inflight_mu_);
        inflight_.push_back(
            Inflight{job.work, end, Clock::now() + timeout(), std::move(job.run), start});
      }
      watch_cv_.notify_all();
      work.finish(nullptr);
#endif
    } catch (...) {
      const std::exception_ptr error = std::current_exception();
#ifdef RINGREDUCE_WITH_CUDA
      if (gpu_queued && job.run) {
        // It may have queued GPU work before it threw: its captures are kept like those of a
        // group that failed with GPU work in flight.
        const std::lock_guard<std::mutex> held(inflight_mu_);
        abandoned_.push_back(std::move(job.run));
      }
#endif
      try {
        g_->fail("ringreduce: " + work.name() + " on rank " + std::to_string(g_->rank) +
                 " failed: " + error_text(error));
      } catch (...) {
        // Out of memory for the message: the Work still fails with its own error.
      }
      work.finish(error);
    }
  }

  Clock::duration timeout() const {
    return std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double>(g_->timeout_s.load()));
  }

#ifdef RINGREDUCE_WITH_CUDA
  struct Inflight {
    c10::intrusive_ptr<RRWork> work;
    std::shared_ptr<Event> end;
    Clock::time_point deadline;
    // The job's closure: what the GPU work may still read or write. Released once `end` has
    // completed, so the caching allocator never hands those blocks out while the internal
    // stream uses them, whichever stream allocated them.
    std::function<void()> captures;
    std::shared_ptr<Event> start;  // recorded collectives: the flight recorder's start event
  };

  // The flight recorder's view of a collective in flight: started once its start event has
  // completed; completed (with its duration when timed) once `done` is true.
  void report_gpu(const Inflight& f, bool done) {
    if (!f.work || !f.work->trace().on || !f.start) return;
    if (done) {
      // Completed and retired whether or not the duration can be read.
      std::optional<float> ms;
      try {
        if (g_->fr->timing()) ms = f.start->elapsed_ms(*f.end);
      } catch (const std::exception&) {
        ms.reset();
      }
      g_->fr->finished(f.work->trace(), true, ms);
      return;
    }
    try {
      if (f.start->query()) g_->fr->started(f.work->trace());
    } catch (const std::exception&) {
      // A CUDA error: the watchdog reports it through the end event.
    }
  }

  // Pops the front entry if it is still `end`'s; released by the caller outside the lock.
  Inflight pop_done(const std::shared_ptr<Event>& end) {
    Inflight done;
    {
      const std::lock_guard<std::mutex> held(inflight_mu_);
      if (!inflight_.empty() && inflight_.front().end == end) {
        done = std::move(inflight_.front());
        inflight_.pop_front();
      }
    }
    report_gpu(done, /*done=*/true);
    return done;
  }

  // The group failed with GPU work unfinished: that work may still run (a late peer) or never
  // will; either way its memory must not be handed out again, so it is kept (settle_inflight:
  // until the process exits). Called with inflight_mu_ held.
  void abandon_inflight() {
    for (Inflight& f : inflight_) {
      try {
        if (f.work && f.work->trace().on) g_->fr->finished(f.work->trace(), false);
      } catch (...) {
        // The recorder is told best effort; the captures must be kept regardless.
      }
      abandoned_.push_back(std::move(f.captures));
    }
    inflight_.clear();
  }

  static constexpr std::chrono::seconds kFailedSettle{1};

  // At stop, after the watchdog: waits (until `deadline`) for the GPU work still in flight and
  // releases its captures; what has not finished by then, and what abandon_inflight() kept, is
  // kept until the process exits (a leak is better than memory the GPU may still use).
  void settle_inflight(Clock::time_point deadline) {
    // A failed group's GPU work may wait for ever for a peer's (a dead or aborted rank's
    // events): it gets kFailedSettle, not the whole group timeout, before it is kept.
    if (g_->failed.load(std::memory_order_acquire))
      deadline = std::min(deadline, Clock::now() + kFailedSettle);
    std::deque<Inflight> left;
    std::vector<std::function<void()>> abandoned;
    {
      const std::lock_guard<std::mutex> held(inflight_mu_);
      left.swap(inflight_);
      abandoned.swap(abandoned_);
    }
    for (Inflight& f : left) {
      bool done = false;
      try {
        while (!(done = f.end->query()) && Clock::now() < deadline) {
          std::this_thread::sleep_for(std::chrono::microseconds(200));
        }
      } catch (const std::exception&) {
        done = false;  // a CUDA error: the work's state is unknown
      }
      report_gpu(f, done);
      if (done) {
        const c10::cuda::CUDAGuard on_device(f.end->device());
        f.captures = nullptr;
      } else {
        if (f.work && f.work->trace().on) g_->fr->finished(f.work->trace(), false);
        abandoned.push_back(std::move(f.captures));
      }
    }
    static std::mutex kept_mu;
    static auto* kept = new std::vector<std::function<void()>>();  // never destroyed
    const std::lock_guard<std::mutex> held(kept_mu);
    for (auto& c : abandoned) kept->push_back(std::move(c));
  }

  // Host-waits (bounded) until the GPU work of every collective queued so far has finished.
  void drain_gpu() {
    for (;;) {
      const Inflight first = front();
      if (!first.end) return;
      while (!first.end->query()) {
        if (Clock::now() > first.deadline) {
          gpu_timeout(first.work->name());
          throw std::runtime_error(g_->failure_text());
        }
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
      pop_done(first.end);  // its captures are released here, outside the lock
    }
  }

  // The front entry without its captures (empty when nothing is in flight).
  Inflight front() {
    const std::lock_guard<std::mutex> held(inflight_mu_);
    Inflight f;
    if (!inflight_.empty()) {
      f.work = inflight_.front().work;
      f.end = inflight_.front().end;
      f.deadline = inflight_.front().deadline;
      f.start = inflight_.front().start;
    }
    return f;
  }

  // The watchdog: fails the group when a collective's GPU work has not finished within the
  // group's timeout (a peer's GPU work it waits for may never come), or its event reports an
  // error; releases the captures of the collectives whose GPU work has finished. Never runs
  // collectives, so a stuck collective cannot stop it. Its CUDA calls run with the event's
  // device current (Event), so this thread never creates a context on another GPU.
  void watch() {
    for (;;) {
      try {
        watch_loop();
        return;
      } catch (const std::exception& e) {
        watch_failed(e.what());
      } catch (...) {
        watch_failed("an unknown exception");
      }
    }
  }

  // An exception out of the watchdog's loop (a CUDA error out of a device guard, no memory):
  // the work in flight can no longer be watched, so it is abandoned and the group fails; the
  // watchdog goes on (it must see the stop).
  void watch_failed(const char* what) noexcept {
    try {
      {
        const std::lock_guard<std::mutex> held(inflight_mu_);
        abandon_inflight();
      }
      g_->fail("ringreduce: the watchdog of rank " + std::to_string(g_->rank) + " failed: " +
               what);
    } catch (...) {
    }
  }

  void watch_loop() {
    std::unique_lock<std::mutex> lock(inflight_mu_);
    while (!watch_stop_) {
      if (inflight_.empty()) {
        watch_cv_.wait(lock, [this] { return watch_stop_ || !inflight_.empty(); });
        continue;
      }
      lock.unlock();
      const Inflight first = front();
      bool done = false;
      std::string error;
      try {
        rr::cuda::use_thread_local_capture_mode();  // its queries leave a user's capture valid
        done = first.end && first.end->query();
      } catch (const std::exception& e) {
        error = e.what();
      }
      if (done) {
        // Frees with the event's device current: no context on another GPU.
        const c10::cuda::CUDAGuard on_device(first.end->device());
        pop_done(first.end);
        lock.lock();
        continue;
      }
      lock.lock();
      if (!first.end) continue;
      if (!error.empty()) {
        abandon_inflight();
        lock.unlock();
        g_->fail("ringreduce: the GPU work of " + first.work->name() + " on rank " +
                 std::to_string(g_->rank) + " failed: " + error);
        lock.lock();
      } else if (Clock::now() > first.deadline) {
        abandon_inflight();
        lock.unlock();
        gpu_timeout(first.work->name());
        lock.lock();
      } else {
        lock.unlock();
        report_gpu(first, /*done=*/false);
        lock.lock();
        watch_cv_.wait_for(lock, std::chrono::milliseconds(50));
      }
    }
  }

  void gpu_timeout(const std::string& name) {
    g_->fail("ringreduce: the GPU work of " + name + " on rank " + std::to_string(g_->rank) +
             " did not finish within the process group timeout (" +
             std::to_string(g_->timeout_s.load()) + " s); a peer's GPU work it waits for may "
             "never complete");
  }

  std::mutex inflight_mu_;
  std::condition_variable watch_cv_;
  std::deque<Inflight> inflight_;
  std::vector<std::function<void()>> abandoned_;  // abandon_inflight()
  bool watch_stop_ = false;
  std::thread watchdog_;
  std::mutex streams_mu_;
  std::map<c10::DeviceIndex, c10::cuda::CUDAStream> streams_, p2p_streams_;
#endif

  std::shared_ptr<Group> g_;
  const bool caller_runs_;
  std::atomic<uint64_t> ran_by_callers_{0};
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  std::deque<std::shared_ptr<Job>> pending_;
  bool busy_ = false;
  bool stopping_ = false;
  bool loop_done_ = false;
  std::atomic<bool> used_cuda_{false};
  std::thread thread_;
};

inline bool RRWork::wait(std::chrono::milliseconds timeout) {
  std::shared_ptr<Engine> engine;
  const void* job = nullptr;
  {
    const std::lock_guard<std::mutex> held(mu_);
    engine = engine_.lock();
    job = job_;
  }
  if (engine && job && state_.load() == kPending) engine->help(job);
  {
    std::unique_lock<std::mutex> lock(mu_);
    auto done = [this] { return state_.load() != kPending; };
    if (timeout != kNoTimeout && timeout.count() > 0) {
      if (!cv_.wait_for(lock, timeout, done)) {
        TORCH_CHECK(false, "ringreduce: ", name_, " did not complete within the ",
                    timeout.count() / 1000.0, " s given to Work.wait()");
      }
    } else {
      // Bounded: every collective is bounded by the group's timeout, and a failed group
      // fails the queued ones at once.
      cv_.wait(lock, done);
    }
    if (error_) std::rethrow_exception(error_);
  }
#ifdef RINGREDUCE_WITH_CUDA
  if (end_) {
    if (group_->failed.load() && !end_->query()) {
      // The group failed (the watchdog: a peer's GPU work never came) while this
      // collective's GPU work is unfinished: the caller's stream must not wait on it for ever.
      TORCH_CHECK(false, "ringreduce: ", name_, " did not finish on the GPU: ",
                  group_->failure_text());
    }
    end_->block(c10::cuda::getCurrentCUDAStream(device_->index()));
  }
#endif
  return true;
}

}  // namespace detail
}  // namespace dist
}  // namespace rr
