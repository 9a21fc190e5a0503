// The "ringreduce" c10d::Backend (see backend.h for the execution model).
#include "backend.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

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

#include "comm.h"

#ifdef RINGREDUCE_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#endif

namespace py = pybind11;

namespace rr {
namespace dist {
namespace {

using Clock = std::chrono::steady_clock;
using c10d::OpType;

std::string error_text(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const c10::Error& err) {
    return err.what_without_backtrace();
  } catch (const std::exception& err) {
    return err.what();
  } catch (...) {
    return "unknown error";
  }
}

// torch's Python name of a dtype ("float32" for Float), as the Python engine reported it.
std::string torch_dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kByte: return "uint8";
    case at::kChar: return "int8";
    case at::kShort: return "int16";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    case at::kHalf: return "float16";
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kComplexHalf: return "complex32";
    case at::kComplexFloat: return "complex64";
    case at::kComplexDouble: return "complex128";
    case at::kBool: return "bool";
    case at::kBFloat16: return "bfloat16";
    case at::kUInt16: return "uint16";
    case at::kUInt32: return "uint32";
    case at::kUInt64: return "uint64";
    default: break;
  }
  std::string name = c10::toString(t);
  std::transform(name.begin(), name.end(), name.begin(),
                 [](unsigned char c) { return char(std::tolower(c)); });
  return name;
}

#ifdef RINGREDUCE_WITH_CUDA
// A CUDA event without timing (c10 only: ATen's CUDAEvent drags in the math libraries'
// headers). Every call is checked.
class Event {
 public:
  explicit Event(c10::DeviceIndex device) : device_(device) {
    c10::cuda::CUDAGuard guard(device_);
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&e_, cudaEventDisableTiming));
  }
  ~Event() {
    if (e_ != nullptr) cudaEventDestroy(e_);  // no error to report from a destructor
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  void record(const c10::cuda::CUDAStream& s) {
    c10::cuda::CUDAGuard guard(device_);
    C10_CUDA_CHECK(cudaEventRecord(e_, s.stream()));
  }
  // `s` waits (on the GPU) for the work recorded before this event.
  void block(const c10::cuda::CUDAStream& s) const {
    c10::cuda::CUDAGuard guard(s.device_index());
    C10_CUDA_CHECK(cudaStreamWaitEvent(s.stream(), e_, 0));
  }
  // True when the recorded work is done; throws on a CUDA error.
  bool query() const {
    const cudaError_t err = cudaEventQuery(e_);
    if (err == cudaErrorNotReady) {
      cudaGetLastError();  // not an error: clear it
      return false;
    }
    C10_CUDA_CHECK(err);
    return true;
  }

 private:
  c10::DeviceIndex device_;
  cudaEvent_t e_ = nullptr;
};
#endif

// Runs `fn` when the scope ends, however it ends.
class Finally {
 public:
  explicit Finally(std::function<void()> fn) : fn_(std::move(fn)) {}
  ~Finally() { fn_(); }
  Finally(const Finally&) = delete;
  Finally& operator=(const Finally&) = delete;

 private:
  std::function<void()> fn_;
};

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
      throw std::runtime_error(e.what());
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

// ---- completion threads ------------------------------------------------------------------
// Futures are completed here, so user callbacks never run on a thread that must make progress
// on collectives. Callbacks may issue collectives (torch's PowerSGD hook does, and waits for
// them), and every rank must issue them in the same order, so completions run in order on one
// thread per *level*: a collective issued by a user thread completes on level 1, one issued by
// a callback running on level k completes on level k + 1. A callback that waits on the future
// of a collective it issued therefore finds that future's thread free, and the order in which
// callbacks issue collectives is the order in which their collectives were issued: the same
// on every rank. A callback that waits on a future of its own level (issued by the same kind
// of thread, queued behind it) would wait for ever; when a level's threads have all been busy
// for kStuck with completions queued, a further thread starts for that level (then the order
// between those callbacks is no longer fixed: a rank that disagrees fails with a message).

thread_local int tls_level = 0;  // 0: not a completion thread

class Completer {
 public:
  static constexpr int kMaxLevel = 16;
  static constexpr int kMaxThreadsPerLevel = 8;
  static constexpr auto kStuck = std::chrono::milliseconds(500);

  ~Completer() { stop(Clock::now() + std::chrono::seconds(5)); }

  // The level a collective issued by this thread completes on.
  static int issue_level() { return std::min(tls_level + 1, kMaxLevel); }

  void post(int level, std::function<void()> task) {
    std::unique_lock<std::mutex> lock(mu_);
    if (stopping_) {
      // The group is gone: no collective needs progress any more, so run it here.
      lock.unlock();
      task();
      return;
    }
    Level& l = levels_[size_t(level - 1)];
    l.q.push_back(std::move(task));
    if (l.threads == 0) {
      start(level);
    } else {
      l.cv.notify_one();
    }
    if (!supervisor_.joinable()) supervisor_ = std::thread([this] { supervise(); });
  }

  // Runs what is queued, then ends the threads; a thread still inside a callback at `deadline`
  // is left to finish on its own (detached): a user callback may block for ever.
  void stop(Clock::time_point deadline) {
    std::vector<std::thread> threads;
    std::thread supervisor;
    {
      std::unique_lock<std::mutex> lock(mu_);
      stopping_ = true;
      for (Level& l : levels_) l.cv.notify_all();
      sup_cv_.notify_all();
      done_cv_.wait_until(lock, deadline, [this] { return alive_ == 0; });
      threads.swap(threads_);
      supervisor.swap(supervisor_);
    }
    if (supervisor.joinable()) supervisor.join();
    std::unique_lock<std::mutex> lock(mu_);
    const bool all_out = alive_ == 0;
    lock.unlock();
    for (auto& t : threads) {
      if (all_out) {
        t.join();
      } else {
        t.detach();
      }
    }
  }

 private:
  struct Level {
    std::deque<std::function<void()>> q;
    std::condition_variable cv;
    int threads = 0;
    int idle = 0;
    Clock::time_point progress;  // when a thread of this level last took a task
  };

  void start(int level) {
    Level& l = levels_[size_t(level - 1)];
    ++l.threads;
    ++alive_;
    threads_.emplace_back([this, level] { loop(level); });
  }

  void loop(int level) {
    tls_level = level;
    Level& l = levels_[size_t(level - 1)];
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      if (l.q.empty()) {
        if (stopping_) break;
        ++l.idle;
        l.cv.wait(lock, [&] { return !l.q.empty() || stopping_; });
        --l.idle;
        continue;
      }
      std::function<void()> task = std::move(l.q.front());
      l.q.pop_front();
      l.progress = Clock::now();
      lock.unlock();
      task();
      task = nullptr;  // whatever it held is released outside the lock
      lock.lock();
    }
    --alive_;
    done_cv_.notify_all();
  }

  // Starts another thread for a level whose threads are all busy and have taken nothing for
  // kStuck while completions wait.
  void supervise() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stopping_) {
      sup_cv_.wait_for(lock, kStuck / 5);
      const Clock::time_point now = Clock::now();
      for (int level = 1; level <= kMaxLevel; ++level) {
        Level& l = levels_[size_t(level - 1)];
        if (!stopping_ && !l.q.empty() && l.idle == 0 && l.threads > 0 &&
            l.threads < kMaxThreadsPerLevel && now - l.progress > kStuck) {
          l.progress = now;
          start(level);
        }
      }
    }
  }

  std::mutex mu_;
  std::condition_variable done_cv_, sup_cv_;
  Level levels_[kMaxLevel];
  std::vector<std::thread> threads_;
  std::thread supervisor_;
  int alive_ = 0;
  bool stopping_ = false;
};

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

  void fail(const std::string& msg) {
    {
      const std::lock_guard<std::mutex> held(mu);
      if (failure.empty()) failure = msg;
    }
    failed.store(true, std::memory_order_release);
    try {
      transport->fail(msg);
    } catch (const std::exception&) {
      // The transport may already be closed; the failure is recorded above.
    }
  }
  std::string failure_text() {
    const std::lock_guard<std::mutex> held(mu);
    return failure;
  }
};

// ---- Work ----------------------------------------------------------------------------------

class RRWork final : public c10d::Work {
 public:
  RRWork(std::shared_ptr<Group> group, std::string name, OpType type,
         std::vector<at::Tensor> outputs, c10::optional<at::Device> device)
      : c10d::Work(group->rank, type),
        group_(std::move(group)),
        name_(std::move(name)),
        outputs_(std::move(outputs)),
        device_(device),
        level_(Completer::issue_level()) {}

  const std::string& name() const { return name_; }

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

  // Called once, when the collective is done (error == nullptr) or failed.
  void finish(std::exception_ptr error);
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
    if (stream_) guard.emplace(*stream_);
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
#ifdef RINGREDUCE_WITH_CUDA
  std::shared_ptr<Event> end_;
  c10::optional<c10::cuda::CUDAStream> stream_;
#endif
};

void RRWork::finish(std::exception_ptr error) {
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
  if (fut) {
    c10::intrusive_ptr<RRWork> self = c10::intrusive_ptr<RRWork>::reclaim_copy(this);
    group_->completer.post(level_, [self, fut, error] { self->complete(fut, error); });
  }
}

c10::intrusive_ptr<c10::ivalue::Future> RRWork::getFuture() {
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
  std::function<void()> run;
  bool cuda = false;
  bool drain_gpu = false;  // barrier: wait for the GPU work of every collective before it
#ifdef RINGREDUCE_WITH_CUDA
  c10::optional<c10::cuda::CUDAStream> stream;
  std::shared_ptr<Event> ready;
#endif
};

class Engine : public std::enable_shared_from_this<Engine> {
 public:
  explicit Engine(std::shared_ptr<Group> g) : g_(std::move(g)) {}

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
    {
      const std::lock_guard<std::mutex> held(mu_);
      if (busy_ || !pending_.empty() || stopping_) return false;
      busy_ = true;
    }
    execute(*job);
    release();
    return true;
  }

  // Work.wait() on a queued CPU job: runs it in the waiting thread if it is next and nothing
  // runs (it would only block anyway).
  void help(const void* job) {
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
#endif
  }

  bool used_cuda() const { return used_cuda_.load(); }

#ifdef RINGREDUCE_WITH_CUDA
  // The group's own stream on `device` (not torch's pool: user code cannot be handed it).
  c10::cuda::CUDAStream stream(c10::DeviceIndex device) {
    const std::lock_guard<std::mutex> held(streams_mu_);
    auto it = streams_.find(device);
    if (it != streams_.end()) return it->second;
    c10::cuda::CUDAGuard guard(device);
    cudaStream_t s = nullptr;
    C10_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    auto stream = c10::cuda::getStreamFromExternal(s, device);
    // Never destroyed: a Work (its future, its end event) may refer to the stream after the
    // group is gone, and a process makes one per group and device.
    streams_.emplace(device, stream);
    used_cuda_.store(true);
    return stream;
  }
#endif

 private:
  static void join(std::thread& t) {
    if (t.joinable()) t.join();
  }

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
    try {
      if (g_->failed.load(std::memory_order_acquire)) {
        throw std::runtime_error("ringreduce: " + work.name() + " on rank " +
                                 std::to_string(g_->rank) + ": this process group failed "
                                 "earlier and cannot be used any more: " + g_->failure_text());
      }
      // Worker threads do not inherit the caller's grad or inference mode; the collectives
      // only write tensor memory, and this makes any helper op (a copy back) legal for
      // inference tensors and tensors that require grad alike.
      c10::InferenceMode no_autograd;
      if (!job.cuda) {
        job.run();
        work.finish(nullptr);
        return;
      }
#ifdef RINGREDUCE_WITH_CUDA
      c10::cuda::CUDAStreamGuard on_internal(*job.stream);
      job.ready->block(*job.stream);
      if (job.drain_gpu) drain_gpu();
      job.run();
      auto end = std::make_shared<Event>(job.stream->device_index());
      end->record(*job.stream);
      work.set_cuda(end, *job.stream);
      {
        const std::lock_guard<std::mutex> held(inflight_mu_);
        inflight_.push_back(Inflight{job.work, end, Clock::now() + timeout()});
      }
      watch_cv_.notify_all();
      work.finish(nullptr);
#endif
    } catch (...) {
      const std::exception_ptr error = std::current_exception();
      g_->fail("ringreduce: " + work.name() + " on rank " + std::to_string(g_->rank) +
               " failed: " + error_text(error));
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
  };

  // Host-waits (bounded) until the GPU work of every collective queued so far has finished.
  void drain_gpu() {
    for (;;) {
      Inflight first;
      {
        const std::lock_guard<std::mutex> held(inflight_mu_);
        if (inflight_.empty()) return;
        first = inflight_.front();
      }
      while (!first.end->query()) {
        if (Clock::now() > first.deadline) {
          gpu_timeout(first.work->name());
          throw std::runtime_error(g_->failure_text());
        }
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
      const std::lock_guard<std::mutex> held(inflight_mu_);
      if (!inflight_.empty() && inflight_.front().end == first.end) inflight_.pop_front();
    }
  }

  // The watchdog: fails the group when a collective's GPU work has not finished within the
  // group's timeout (a peer's GPU work it waits for may never come), or its event reports an
  // error. Never runs collectives, so a stuck collective cannot stop it.
  void watch() {
    std::unique_lock<std::mutex> lock(inflight_mu_);
    while (!watch_stop_) {
      if (inflight_.empty()) {
        watch_cv_.wait(lock, [this] { return watch_stop_ || !inflight_.empty(); });
        continue;
      }
      Inflight first = inflight_.front();
      lock.unlock();
      bool done = false;
      std::string error;
      try {
        done = first.end->query();
      } catch (const std::exception& e) {
        error = e.what();
      }
      lock.lock();
      if (!error.empty()) {
        inflight_.clear();
        lock.unlock();
        g_->fail("ringreduce: the GPU work of " + first.work->name() + " on rank " +
                 std::to_string(g_->rank) + " failed: " + error);
        lock.lock();
      } else if (done) {
        if (!inflight_.empty() && inflight_.front().end == first.end) inflight_.pop_front();
      } else if (Clock::now() > first.deadline) {
        inflight_.clear();
        lock.unlock();
        gpu_timeout(first.work->name());
        lock.lock();
      } else {
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
  bool watch_stop_ = false;
  std::thread watchdog_;
  std::mutex streams_mu_;
  std::map<c10::DeviceIndex, c10::cuda::CUDAStream> streams_;
#endif

  std::shared_ptr<Group> g_;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  std::deque<std::shared_ptr<Job>> pending_;
  bool busy_ = false;
  bool stopping_ = false;
  bool loop_done_ = false;
  std::atomic<bool> used_cuda_{false};
  std::thread thread_;
};

bool RRWork::wait(std::chrono::milliseconds timeout) {
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

// ---- point-to-point ----------------------------------------------------------------------
// One thread per group posts sends and receives to the native channels (p2p.h) and completes
// their Works in the order they finish. CUDA tensors go through pinned host memory on an
// internal stream: a send copies its tensor out after the work queued before it on the
// caller's stream; a receive copies the message in when it has arrived.

struct P2PJob {
  c10::intrusive_ptr<RRWork> work;
  bool send = false;
  at::Tensor tensor;
  int peer = kAnySource;
  int64_t tag = 0;
  at::Tensor host;
#ifdef RINGREDUCE_WITH_CUDA
  std::shared_ptr<Event> ready;
#endif
};

class P2PEngine {
 public:
  P2PEngine(std::shared_ptr<Group> g, Engine* engine) : g_(std::move(g)), engine_(engine) {
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
        const c10::cuda::CUDAStream s = engine_->stream(t.device().index());
        c10::cuda::CUDAStreamGuard on_internal(s);
        job->ready->block(s);
        job->host = at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(true));
        if (job->send) {
          job->host.copy_(t, /*non_blocking=*/true);
          C10_CUDA_CHECK(cudaStreamSynchronize(s.stream()));
        }
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
        const c10::cuda::CUDAStream s = engine_->stream(job.tensor.device().index());
        c10::cuda::CUDAStreamGuard on_internal(s);
        job.tensor.copy_(job.host, /*non_blocking=*/true);
        auto end = std::make_shared<Event>(s.device_index());
        end->record(s);
        // The pinned buffer is freed with the job: the copy must have read it by then.
        C10_CUDA_CHECK(cudaStreamSynchronize(s.stream()));
        work.set_cuda(end, s);
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
  Engine* engine_;
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
  RingReduceBackend(std::shared_ptr<Transport> transport, int rank, int size, double timeout_s,
                    bool async)
      : c10d::Backend(rank, size), async_(async) {
    g_ = std::make_shared<Group>();
    g_->transport = std::move(transport);
    g_->rank = rank;
    g_->size = size;
    g_->timeout_s.store(timeout_s);
    engine_ = std::make_shared<Engine>(g_);
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

  py::object comm() { return g_->transport->object(); }
  bool is_failed() const { return g_->failed.load(); }
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
    check(name, {t}, op, "tensor");
    auto tr = g_->transport;
    return submit(name, OpType::ALLREDUCE, [tr, t, op] {
      contiguous_do(t, [&](const at::Tensor& c) { tr->all_reduce(c, op); });
    }, tensors, {t}, opts.asyncOp);
  }

  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override {
    const char* name = "all_reduce_coalesced";
    const std::string op = op_name(opts.reduceOp, name);
    check(name, tensors, op, "tensor");
    auto tr = g_->transport;
    std::vector<at::Tensor> ts = tensors;
    return submit(name, OpType::ALLREDUCE_COALESCED, [tr, ts, op] {
      for (const at::Tensor& t : ts) {
        contiguous_do(t, [&](const at::Tensor& c) { tr->all_reduce(c, op); });
      }
    }, tensors, ts, opts.asyncOp);
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
    }, tensors, {t}, opts.asyncOp);
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
    }, tensors, {t}, opts.asyncOp);
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
                  flat(output_tensors), touched, opts.asyncOp);
  }

  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& output_lists, std::vector<at::Tensor>& input_tensors,
      const c10d::AllgatherOptions& opts) override {
    const char* name = "all_gather_coalesced";
    TORCH_CHECK_VALUE(output_lists.size() == input_tensors.size(), "ringreduce ", name,
                      ": one output list per input tensor needed; got ", output_lists.size(),
                      " lists for ", input_tensors.size());
    for (size_t i = 0; i < input_tensors.size(); ++i) {
      check_list(name, output_lists[i], input_tensors[i]);
    }
    auto tr = g_->transport;
    std::vector<std::vector<at::Tensor>> lists = output_lists;
    std::vector<at::Tensor> ins = input_tensors;
    std::vector<at::Tensor> touched = flat(output_lists);
    touched.insert(touched.end(), ins.begin(), ins.end());
    return submit(name, OpType::ALLGATHER_COALESCED, [tr, lists, ins] {
      for (size_t i = 0; i < ins.size(); ++i) gather_into(*tr, lists[i], ins[i]);
    }, flat(output_lists), touched, opts.asyncOp);
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
    }, {output}, {output, input}, opts.asyncOp);
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
      for (size_t i = 0; i < outs.size(); ++i) gather_flat(*tr, outs[i], ins[i], n);
    }, outputs, touched, opts.asyncOp);
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
    }, output_tensors, {output, flat_in}, opts.asyncOp);
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
    }, {output}, {output, input}, opts.asyncOp);
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
    return submit("reduce_scatter_tensor_coalesced", OpType::REDUCE_SCATTER_TENSOR_COALESCED,
                  [tr, outs, flats, op] {
      for (size_t i = 0; i < outs.size(); ++i) reduce_scatter_flat(*tr, outs[i], flats[i], op);
    }, outputs, touched, opts.asyncOp);
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    // After every collective queued before it; on CUDA it also waits for their GPU work.
    c10::optional<at::Device> device;
#ifdef RINGREDUCE_WITH_CUDA
    if (engine_->used_cuda()) device = at::Device(at::kCUDA, c10::cuda::current_device());
#endif
    auto tr = g_->transport;
    return submit("barrier", OpType::BARRIER, [tr] { tr->barrier(); }, {}, {}, opts.asyncOp,
                  device, /*drain_gpu=*/true);
  }

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
    }, flat(output_tensors), touched, opts.asyncOp);
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
    }, output_tensors, touched, opts.asyncOp);
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
    }, outs, touched, opts.asyncOp);
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
    }, {output}, {output, input}, opts.asyncOp);
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
    return p2p("recv", false, tensors, kAnySource, tag, true);
  }

  // monitored_barrier is gloo's only: torch refuses it on other backends before calling here.

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

  void check(const char* name, const std::vector<at::Tensor>& tensors, const std::string& op,
             const std::string& arg) const {
    for (size_t i = 0; i < tensors.size(); ++i) {
      g_->transport->check(tensors[i], op, name,
                           tensors.size() == 1 ? arg : arg + "[" + std::to_string(i) + "]");
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

  c10::intrusive_ptr<c10d::Work> submit(const char* name, OpType type, std::function<void()> run,
                                        const std::vector<at::Tensor>& outputs,
                                        const std::vector<at::Tensor>& tensors, bool async_op,
                                        c10::optional<at::Device> device = c10::nullopt,
                                        bool drain_gpu = false) {
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
    auto work = c10::make_intrusive<RRWork>(g_, name, type, outputs, device);
    auto job = std::make_shared<Job>();
    job->work = work;
    job->run = std::move(run);
    job->drain_gpu = drain_gpu;
    if (!async_) {
      // RINGREDUCE_ASYNC=0: inline in the caller's thread (on CUDA on the caller's stream).
      try {
        c10::InferenceMode no_autograd;
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
      cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
      const cudaError_t err = cudaStreamIsCapturing(current.stream(), &capture);
      if (err != cudaSuccess) cudaGetLastError();
      if (err != cudaSuccess || capture != cudaStreamCaptureStatusNone) {
        const std::string msg = "ringreduce " + std::string(name) + " on rank " +
                                std::to_string(rank_) + ": cannot be captured in a CUDA graph "
                                "(multi-process collectives synchronise on the host)";
        g_->fail(msg);
        TORCH_CHECK(false, msg);
      }
      job->cuda = true;
      job->stream = engine_->stream(device->index());
      job->ready = std::make_shared<Event>(device->index());
      job->ready->record(current);
      // The internal stream uses these blocks until the collective ends: the caching allocator
      // must not hand them out before, even if the caller drops the tensors.
      for (const at::Tensor& t : tensors) {
        if (t.is_cuda()) {
          c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), *job->stream);
        }
      }
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
    if (!g_->transport->native()) return xhost_p2p(name, is_send, t, peer, tag);
    c10::optional<at::Device> device;
    if (t.is_cuda()) device = t.device();
    auto work = c10::make_intrusive<RRWork>(g_, name, is_send ? OpType::SEND : OpType::RECV,
                                            std::vector<at::Tensor>{t}, device);
    auto job = std::make_shared<P2PJob>();
    job->work = work;
    job->send = is_send;
    job->tensor = t;
    job->peer = peer;
    job->tag = tag;
    if (t.is_cuda()) {
#ifdef RINGREDUCE_WITH_CUDA
      const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(t.device().index());
      cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
      const cudaError_t err = cudaStreamIsCapturing(current.stream(), &capture);
      if (err != cudaSuccess) cudaGetLastError();
      TORCH_CHECK(err == cudaSuccess && capture == cudaStreamCaptureStatusNone, "ringreduce ",
                  name, " on rank ", rank_, ": cannot be captured in a CUDA graph (it "
                  "synchronises on the host)");
      job->ready = std::make_shared<Event>(t.device().index());
      job->ready->record(current);
      c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(),
                                                    engine_->stream(t.device().index()));
#else
      TORCH_CHECK(false, "ringreduce ", name, ": the tensor is on CUDA but this ringreduce build "
                  "has no CUDA support");
#endif
    }
    {
      const std::lock_guard<std::mutex> held(p2p_mu_);
      if (!p2p_) p2p_ = std::make_unique<P2PEngine>(g_, engine_.get());
    }
    p2p_->submit(std::move(job));
    return work;
  }

  // Across hosts: gloo's own send/recv on the whole group, posted here (so in issue order) by
  // HierarchicalComm.p2p_start; a thread per operation waits for it (gloo bounds the wait by
  // the group's timeout). A send works on a copy of the tensor and its Work completes at once,
  // as on one host (gloo's send would wait for the matching receive); a send that then fails
  // fails the group. A receive's Work completes when its message is in the tensor.
  c10::intrusive_ptr<c10d::Work> xhost_p2p(const char* name, bool is_send, const at::Tensor& t,
                                           int peer, int tag) {
    TORCH_CHECK_VALUE(tag >= 0, "ringreduce ", name, ": a group that spans several hosts needs "
                      "tags >= 0 (gloo's); got ", tag);
    TORCH_CHECK_VALUE(peer != rank_, "ringreduce ", name, ": rank ", rank_, " cannot ",
                      is_send ? "send to" : "receive from", " itself");
    TORCH_CHECK(!t.is_cuda(), "ringreduce ", name, ": CUDA tensors between hosts are not "
                "supported by this build's point-to-point");
    at::Tensor host;
    if (is_send) {
      host = t.clone(at::MemoryFormat::Contiguous);
    } else {
      host = t.is_contiguous() ? t : at::empty(t.sizes(), t.options());
    }
    auto work = c10::make_intrusive<RRWork>(g_, name, is_send ? OpType::SEND : OpType::RECV,
                                            std::vector<at::Tensor>{t}, c10::nullopt);
    // Python objects shared with the waiter thread: created and released under the GIL.
    auto py_deleter = [](py::object* o) {
      if (!Py_IsInitialized()) return;
      py::gil_scoped_acquire g;
      delete o;
    };
    std::shared_ptr<py::object> transport, posted;
    {
      py::gil_scoped_acquire gil;
      transport.reset(new py::object(g_->transport->object()), py_deleter);
      try {
        py::object p = peer == kAnySource ? py::object(py::none()) : py::object(py::int_(peer));
        posted.reset(new py::object(transport->attr("p2p_start")(is_send, host, p, tag)),
                     py_deleter);
      } catch (py::error_already_set& e) {
        work->finish(std::make_exception_ptr(std::runtime_error(e.what())));
        return work;
      }
    }
    if (is_send) work->finish(nullptr);
    auto g = g_;
    auto done = std::make_shared<std::atomic<bool>>(false);
    std::thread waiter([g, work, transport, posted, is_send, peer, tag, host, t, done] {
      const Finally mark_done([&] { done->store(true, std::memory_order_release); });
      int source = peer;
      std::string error;
      {
        py::gil_scoped_acquire gil;
        try {
          py::object p = peer == kAnySource ? py::object(py::none()) : py::object(py::int_(peer));
          source = transport->attr("p2p_wait")(*posted, is_send, p, tag).cast<int>();
        } catch (py::error_already_set& e) {
          error = e.what();
        }
      }
      if (error.empty() && !is_send && !host.is_same(t)) {
        c10::InferenceMode no_autograd;
        t.copy_(host);
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

  const bool async_;
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
      .def(py::init([](py::object comm, int rank, int size, double timeout_s, bool async) {
             std::shared_ptr<Transport> t;
             if (py::isinstance<Comm>(comm)) {
               t = std::make_shared<NativeTransport>(comm.cast<std::shared_ptr<Comm>>());
             } else {
               t = std::make_shared<PyTransport>(comm);
             }
             return c10::make_intrusive<RingReduceBackend>(t, rank, size, timeout_s, async);
           }),
           py::arg("comm"), py::arg("rank"), py::arg("size"), py::arg("timeout"),
           py::arg("async_engine") = true)
      .def_property_readonly("comm", &RingReduceBackend::comm,
                             "The executor object (a Comm, or a HierarchicalComm across hosts).")
      .def_property_readonly("failed", &RingReduceBackend::is_failed)
      .def_property_readonly("failure", &RingReduceBackend::failure);
  m.def("shutdown_all", &shutdown_all, py::arg("grace"),
        py::call_guard<py::gil_scoped_release>(),
        "Shuts down every live ringreduce group (interpreter exit).");
}

}  // namespace dist
}  // namespace rr
