// The backend's completion threads.
// Part of the "ringreduce" backend (backend.h describes the whole); only backend.cpp includes it.
#pragma once

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "backend_common.h"

namespace rr {
namespace dist {
// Hidden like the pybind11 types its classes hold (an anonymous namespace before the split).
namespace detail __attribute__((visibility("hidden"))) {

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

inline thread_local int tls_level = 0;  // 0: not a completion thread

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

}  // namespace detail
}  // namespace dist
}  // namespace rr
