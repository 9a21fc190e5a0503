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
// The state of the Completer whose completion thread this is (nullptr: none). Only compared.
inline thread_local const void* tls_state = nullptr;

class Completer {
 public:
  static constexpr int kMaxLevel = 16;
  static constexpr int kMaxThreadsPerLevel = 8;
  static constexpr auto kStuck = std::chrono::milliseconds(500);

  ~Completer() { stop(Clock::now() + std::chrono::seconds(5)); }

  // The level a collective issued by this thread completes on.
  static int issue_level() { return std::min(tls_level + 1, kMaxLevel); }

  void post(int level, std::function<void()> task) {
    std::unique_lock<std::mutex> lock(s_->mu);
    if (s_->stopping) {
      // The group is gone: no collective needs progress any more, so run it here.
      lock.unlock();
      task();
      return;
    }
    Level& l = s_->levels[size_t(level - 1)];
    l.q.push_back(std::move(task));
    if (l.threads == 0) {
      start(s_, level);
    } else {
      l.cv.notify_one();
    }
    if (!supervisor_.joinable()) supervisor_ = std::thread([s = s_] { supervise(s); });
  }

  // Runs what is queued, then ends the threads; a thread still inside a callback at `deadline`
  // is left to finish on its own (detached): a user callback may block for ever. A detached
  // thread holds the state it uses (a shared_ptr), so the group that owns this Completer may
  // be destroyed before the thread leaves the callback. Called from one of this Completer's
  // own threads (a callback dropped the last reference to the group), it does not wait for
  // or join that thread.
  void stop(Clock::time_point deadline) {
    std::vector<std::thread> threads;
    std::thread supervisor;
    const int me = tls_state == s_.get() ? 1 : 0;
    {
      std::unique_lock<std::mutex> lock(s_->mu);
      s_->stopping = true;
      for (Level& l : s_->levels) l.cv.notify_all();
      s_->sup_cv.notify_all();
      s_->done_cv.wait_until(lock, deadline, [&] { return s_->alive == me; });
      threads.swap(s_->threads);
      supervisor.swap(supervisor_);
    }
    if (supervisor.joinable()) supervisor.join();
    std::unique_lock<std::mutex> lock(s_->mu);
    const bool all_out = s_->alive == me;
    lock.unlock();
    for (auto& t : threads) {
      if (all_out && t.get_id() != std::this_thread::get_id()) {
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

  // Everything the threads touch: shared by the Completer and each of its threads.
  struct State {
    std::mutex mu;
    std::condition_variable done_cv, sup_cv;
    Level levels[kMaxLevel];
    std::vector<std::thread> threads;
    int alive = 0;
    bool stopping = false;
  };

  // Called with s->mu held.
  static void start(const std::shared_ptr<State>& s, int level) {
    Level& l = s->levels[size_t(level - 1)];
    ++l.threads;
    ++s->alive;
    s->threads.emplace_back([s, level] { loop(*s, level); });
  }

  static void loop(State& s, int level) {
    tls_level = level;
    tls_state = &s;
    Level& l = s.levels[size_t(level - 1)];
    std::unique_lock<std::mutex> lock(s.mu);
    for (;;) {
      if (l.q.empty()) {
        if (s.stopping) break;
        ++l.idle;
        l.cv.wait(lock, [&] { return !l.q.empty() || s.stopping; });
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
    --s.alive;
    s.done_cv.notify_all();
  }

  // Starts another thread for a level whose threads are all busy and have taken nothing for
  // kStuck while completions wait. Holds the state through the thread's own shared_ptr.
  static void supervise(const std::shared_ptr<State>& self) {
    State& s = *self;
    std::unique_lock<std::mutex> lock(s.mu);
    while (!s.stopping) {
      s.sup_cv.wait_for(lock, kStuck / 5);
      const Clock::time_point now = Clock::now();
      for (int level = 1; level <= kMaxLevel; ++level) {
        Level& l = s.levels[size_t(level - 1)];
        if (!s.stopping && !l.q.empty() && l.idle == 0 && l.threads > 0 &&
            l.threads < kMaxThreadsPerLevel && now - l.progress > kStuck) {
          l.progress = now;
          start(self, level);
        }
      }
    }
  }

  std::shared_ptr<State> s_ = std::make_shared<State>();
  std::thread supervisor_;
};

}  // namespace detail
}  // namespace dist
}  // namespace rr
