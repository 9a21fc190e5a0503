// Runs rr::dist::cuda's collectives (csrc/multiprocess/cuda_collectives.cu, built against the
// fake runtime) in NRANKS forked processes and compares every result, byte for byte, with
// rr::dist::cpu's on the same inputs.
//
//   protocol_driver NRANKS STAGING_BYTES [MODE]
//     check (default): every dtype, op and awkward size; broadcast from every root; all_gather
//         and reduce_scatter out of place and in place; inputs written on the stream just
//         before each call, the all_gather input overwritten on it right after; up to a dozen
//         collectives queued (on two alternating streams) before the host checks them.
//     kill:  then the last rank exits without synchronising; the others must fail, naming it.
//     exit_synced: the same, but the last rank exits right after a check point with all its
//         GPU work done: the others' teardown must not touch the IPC memory and events it
//         exported (the fake runtime aborts on any use of an import whose exporter is gone).
//     abort: then rank 0 marks its group failed; the others fail; nobody's teardown waits.
//     skew:  then rank 0 tears down a second after the others, who wait for its release.
//     distinct_devices: as check, with rank r on device r (its streams and staging area made
//         there) and another device current in the calling thread during the collectives.
//     ddp_distinct_devices: rank r on device r, all_reduce as the backend's asynchronous CUDA
//         path issues it for DDP (csrc/multiprocess/engine.h, backend.cpp): gradient buckets
//         written on the caller's stream (device r's legacy default stream), an event recorded
//         there, the collective run by a progress thread on an internal stream that waits for
//         it, an end event recorded on the internal stream, and Work.wait making the caller's
//         stream wait for that event; then the caller's stream reads the result and writes the
//         next gradients. Every third iteration runs the collectives inline instead
//         (RINGREDUCE_ASYNC=0) on stream 0 with another device current. ddp_nowait and
//         ddp_nodevice are the same with a planted bug (no stream wait in Work.wait; a progress
//         thread that never selects the rank's device): they must fail.
// PROTOCOL_LATE_EXIT="R:MS" makes rank R wait MS milliseconds between its teardown and its exit;
// PROTOCOL_SLOW_CLOSE_RANK=R keeps FAKE_CUDA_SLOW_CLOSE_MS (fake_runtime.cpp) for rank R only.
// Prints "rank R: checked C failures F teardown T s" per rank; exits non-zero on any failure.
#include <cuda_runtime.h>
#include <dirent.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <new>
#include <random>
#include <string>
#include <vector>

#include "multiprocess/cpu_collectives.h"
#include "multiprocess/cuda_collectives.h"

namespace {

using Bytes = std::vector<char>;
using rr::DType;
using rr::Op;
namespace dist = rr::dist;

struct Barriers {
  std::atomic<int> count[4];
};
Barriers* g_barriers = nullptr;  // shared by the forked ranks

void barrier(int i, int n) {
  g_barriers->count[i]++;
  while (g_barriers->count[i].load() < n) usleep(100);
}

std::shared_ptr<Bytes> random_bytes(uint64_t seed, int64_t n) {
  std::mt19937_64 rng(seed);
  auto v = std::make_shared<Bytes>(size_t(n));
  for (char& c : *v) c = char(rng());
  return v;
}

std::shared_ptr<Bytes> filled(int64_t n, char value) {
  return std::make_shared<Bytes>(size_t(n), value);
}

struct Check {
  std::string what;
  std::function<bool()> ok;
};

class Rank {
 public:
  // `device`: this rank's device; `calling_device`: the device current in the calling thread
  // during the collectives (the collectives must select `device` themselves).
  Rank(int rank, int n, int64_t staging, const std::string& tag, int device, int calling_device)
      : rank_(rank), n_(n), device_(device), g_(rank, n, 16384, 20.0, tag),
        ref_(rank, n, 8192, 20.0, tag + "c") {
    barrier(0, n);
    std::vector<std::string> names, ref_names;
    for (int r = 0; r < n; ++r) {
      names.push_back("/ringreduce-" + tag + "-r" + std::to_string(r));
      ref_names.push_back("/ringreduce-" + tag + "c-r" + std::to_string(r));
    }
    g_.attach(names);
    ref_.attach(ref_names);
    barrier(1, n);
    g_.unlink();
    ref_.unlink();
    must(cudaSetDevice(device), "selecting this rank's device");
    peers_ = dist::cuda::make_peers(g_, device, staging);
    // Distinct devices have distinct UUIDs: the setup must tell them from a shared GPU (the
    // distinct-device modes, and only they, call from another device than the rank's).
    if (dist::cuda::distinct_gpus(*peers_) != (device != calling_device))
      throw std::runtime_error("distinct_gpus() is " +
                               std::to_string(dist::cuda::distinct_gpus(*peers_)));
    must(cudaStreamCreateWithFlags(&streams_[0], 0), "creating a stream");
    must(cudaStreamCreateWithFlags(&streams_[1], 0), "creating a stream");
    must(cudaSetDevice(calling_device), "selecting the calling thread's device");
  }

  static void must(cudaError_t err, const char* what) {
    if (err != cudaSuccess)
      throw std::runtime_error(std::string("driver: ") + what + " failed: error " +
                               std::to_string(int(err)));
  }

  // The backend's asynchronous CUDA all_reduce (engine.h) under DDP, with `plant` ("" or a
  // planted bug: "nowait", "nodevice").
  void ddp(const std::string& plant) {
    must(cudaSetDevice(device_), "selecting this rank's device");
    cudaStream_t internal = nullptr;  // the group's own stream (Engine::stream)
    must(cudaStreamCreateWithFlags(&internal, cudaStreamNonBlocking),
         "creating the internal stream");
    const int64_t counts[] = {20011, 4099, 1000, 33, 1};  // float32 buckets, last layer first
    std::vector<void*> buckets;
    for (int64_t c : counts) {
      void* p = nullptr;
      must(cudaMalloc(&p, size_t(c) * 4), "allocating a gradient bucket");
      buckets.push_back(p);
    }
    // The progress thread: runs queued collectives in issue order on the internal stream.
    struct Job {
      std::function<void()> run;
      bool done = false;
      std::string error;
      cudaEvent_t end = nullptr;
    };
    std::mutex mu;
    std::condition_variable cv;
    std::deque<std::shared_ptr<Job>> queue;
    bool stop = false;
    std::thread progress([&] {
      // Engine::execute's CUDAStreamGuard on the internal stream selects its device.
      if (plant != "nodevice") cudaSetDevice(device_);
      for (;;) {
        std::shared_ptr<Job> job;
        {
          std::unique_lock<std::mutex> lock(mu);
          cv.wait(lock, [&] { return stop || !queue.empty(); });
          if (queue.empty()) return;
          job = queue.front();
          queue.pop_front();
        }
        std::string error;
        try {
          job->run();
        } catch (const std::exception& e) {
          error = e.what();
        }
        std::lock_guard<std::mutex> lock(mu);
        job->error = error;
        job->done = true;
        cv.notify_all();
      }
    });
    std::string failure;
    // The main thread may fail too (the CPU reference, once a peer has failed): the progress
    // thread is stopped and joined either way.
    try {
      for (int iter = 0; iter < 12 && failure.empty(); ++iter) {
        std::vector<std::shared_ptr<Job>> jobs;
        std::vector<std::shared_ptr<Bytes>> grads, refs;
        for (size_t b = 0; b < buckets.size(); ++b) {
          const int64_t bytes = counts[b] * 4;
          // Backward writes bucket b's gradient on the caller's stream, then DDP all-reduces it.
          grads.push_back(random_bytes(uint64_t(iter) * 7919 + b * 31 + uint64_t(rank_), bytes));
          must(cudaMemcpyAsync(buckets[b], grads.back()->data(), size_t(bytes), cudaMemcpyDefault,
                               nullptr), "writing a gradient");
          auto job = std::make_shared<Job>();
          void* data = buckets[b];
          const int64_t count = counts[b];
          if (iter % 3 == 2) {
            // RINGREDUCE_ASYNC=0: in the caller's thread on its stream (stream 0), here with
            // another device current: the collective must take its own device's stream 0.
            must(cudaSetDevice((device_ + 1) % n_), "selecting another device");
            dist::cuda::all_reduce(g_, *peers_, data, count, DType::F32, Op::Sum, nullptr);
            must(cudaSetDevice(device_), "selecting this rank's device");
            job->done = true;
          } else {
            cudaEvent_t ready = nullptr;  // Job::ready, recorded on the caller's current stream
            must(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "creating an event");
            must(cudaEventRecord(ready, nullptr), "recording the caller's stream");
            Job* j = job.get();
            job->run = [this, j, ready, internal, data, count] {
              must(cudaStreamWaitEvent(internal, ready, 0), "ordering after the caller's stream");
              dist::cuda::all_reduce(g_, *peers_, data, count, DType::F32, Op::Sum, internal);
              must(cudaEventCreateWithFlags(&j->end, cudaEventDisableTiming),
                   "creating the end event");
              must(cudaEventRecord(j->end, internal), "recording the end of the collective");
            };
            {
              std::lock_guard<std::mutex> lock(mu);
              queue.push_back(job);
            }
            cv.notify_all();
          }
          jobs.push_back(job);
          refs.push_back(std::make_shared<Bytes>(*grads.back()));
          dist::cpu::all_reduce(ref_, refs.back()->data(), count, DType::F32, Op::Sum);
        }
        // The optimizer step: Work.wait() per bucket, then the caller's stream reads the result.
        std::vector<std::shared_ptr<Bytes>> seen;
        for (size_t b = 0; b < jobs.size(); ++b) {
          {
            std::unique_lock<std::mutex> lock(mu);
            if (!cv.wait_for(lock, std::chrono::seconds(60), [&] { return jobs[b]->done; })) {
              failure = "a collective did not complete within 60 s";
              break;
            }
          }
          if (!jobs[b]->error.empty()) {
            failure = jobs[b]->error;
            break;
          }
          if (plant != "nowait" && jobs[b]->end != nullptr)
            must(cudaStreamWaitEvent(nullptr, jobs[b]->end, 0),
                 "Work.wait on the caller's stream");
          seen.push_back(filled(counts[b] * 4, 0));
          must(cudaMemcpyAsync(seen.back()->data(), buckets[b], size_t(counts[b] * 4),
                               cudaMemcpyDefault, nullptr), "reading the result");
        }
        fake_stream_sync(nullptr);
        for (size_t b = 0; b < seen.size(); ++b) {
          ++checked_;
          if (*seen[b] == *refs[b]) continue;
          if (++failures_ <= 10)
            std::fprintf(stderr, "rank %d: MISMATCH ddp iteration %d bucket %zu\n", rank_, iter,
                         b);
        }
      }
    } catch (const std::exception& e) {
      failure = e.what();
    }
    {
      std::lock_guard<std::mutex> lock(mu);
      stop = true;
    }
    cv.notify_all();
    progress.join();
    if (!failure.empty()) throw std::runtime_error(failure);
  }

  // Every collective on the fake GPU, then the CPU reference (its own shared-memory group, so
  // its rounds differ: the results must not depend on the staging size).
  void sweep(const std::string& mode) {
    const int64_t counts[] = {0, 1, 7, 33, 1000, 4099, 20011};
    uint64_t c = 0;
    int cases_since_flush = 1;
    for (int d = 0; d < 8; ++d) {
      const DType dtype = DType(d);
      for (int o = 0; o < 5; ++o) {
        const Op op = Op(o);
        if (op == Op::Avg && !rr::is_floating(dtype)) continue;
        for (int64_t count : counts) {
          ++c;
          const std::string what = std::string(rr::dtype_name(dtype)) + " " + rr::op_name(op) +
                                   " n=" + std::to_string(count);
          all_reduce(c, dtype, op, count, what);
          reduce_scatter(c, dtype, op, count, what);
          if (op == Op::Sum) {
            broadcast(c, count * rr::elem_size(dtype));
            all_gather(c, count * rr::elem_size(dtype) + 3);
          }
          // The last rank dies with one case queued after a check point, not synchronised: the
          // others then fail on the host in the next case, before they synchronise again
          // (their queued work may wait forever for the dead rank's events).
          if (mode == "kill" && rank_ == n_ - 1 && c > 40 && cases_since_flush == 0) {
            std::fprintf(stderr, "rank %d: exiting without synchronising\n", rank_);
            std::fflush(stderr);
            _exit(9);
          }
          ++cases_since_flush;
          if (checks_.size() > 12) {
            flush();
            cases_since_flush = 0;
            // The last rank exits with all its GPU work done: the others' queued work then
            // completes, so their teardown reaches the IPC objects this rank exported.
            if (mode == "exit_synced" && rank_ == n_ - 1 && c > 40) {
              for (cudaStream_t s : streams_) fake_stream_sync(s);
              std::fprintf(stderr, "rank %d: exiting after synchronising\n", rank_);
              std::fflush(stderr);
              _exit(9);
            }
          }
        }
      }
    }
    flush();
  }

  void finish(const std::string& mode) {
    if (mode == "abort") {
      if (rank_ == 0) {
        g_.fail("ringreduce: rank 0 aborts (test)");
      } else {
        Bytes x(64);
        try {
          dist::cuda::all_reduce(g_, *peers_, x.data(), 16, DType::F32, Op::Sum, streams_[0]);
          ++failures_;
          std::fprintf(stderr, "rank %d: no error after rank 0 aborted\n", rank_);
        } catch (const std::exception&) {
        }
      }
    }
    if (mode == "skew" && rank_ == 0) sleep(1);
    const auto start = std::chrono::steady_clock::now();
    peers_.reset();
    const double teardown =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    g_.close();
    ref_.close();
    std::printf("rank %d: checked %d failures %d teardown %.3f s\n", rank_, checked_, failures_,
                teardown);
  }

  int failures() const { return failures_; }

 private:
  cudaStream_t stream(uint64_t c) const { return streams_[c % 2]; }

  void expect(const std::string& what, std::function<bool()> ok) {
    checks_.push_back(Check{what, std::move(ok)});
  }

  void flush() {
    fake_stream_sync(streams_[0]);
    fake_stream_sync(streams_[1]);
    for (const Check& check : checks_) {
      ++checked_;
      if (check.ok()) continue;
      if (++failures_ <= 10) std::fprintf(stderr, "rank %d: MISMATCH %s\n", rank_, check.what.c_str());
    }
    checks_.clear();
  }

  void all_reduce(uint64_t c, DType dtype, Op op, int64_t count, const std::string& what) {
    const int64_t bytes = count * rr::elem_size(dtype);
    auto input = random_bytes(c * 131 + uint64_t(rank_), bytes);
    auto mine = filled(bytes, 0x55);
    // Written on the stream just before the call: the copy-in must come after it.
    cudaMemcpyAsync(mine->data(), input->data(), size_t(bytes), cudaMemcpyDefault, stream(c));
    dist::cuda::all_reduce(g_, *peers_, mine->data(), count, dtype, op, stream(c));
    auto ref = std::make_shared<Bytes>(*input);
    dist::cpu::all_reduce(ref_, ref->data(), count, dtype, op);
    expect("all_reduce " + what, [input, mine, ref] { return *mine == *ref; });
  }

  void reduce_scatter(uint64_t c, DType dtype, Op op, int64_t count, const std::string& what) {
    const int64_t bytes = count * rr::elem_size(dtype);
    auto in = random_bytes(c * 977 + uint64_t(rank_), n_ * bytes);
    auto out = filled(bytes, 5);
    auto ref = filled(bytes, 6);
    dist::cuda::reduce_scatter(g_, *peers_, in->data(), out->data(), count, dtype, op, stream(c));
    dist::cpu::reduce_scatter(ref_, in->data(), ref->data(), count, dtype, op);
    expect("reduce_scatter " + what, [in, out, ref] { return *out == *ref; });
    // In place: the output is this rank's own segment of the input.
    auto inout = std::make_shared<Bytes>(*in);
    char* own = inout->data() + rank_ * bytes;
    dist::cuda::reduce_scatter(g_, *peers_, inout->data(), own, count, dtype, op, stream(c));
    expect("reduce_scatter in place " + what, [inout, own, ref, bytes] {
      return std::memcmp(own, ref->data(), size_t(bytes)) == 0;
    });
  }

  void broadcast(uint64_t c, int64_t base_bytes) {
    for (int root = 0; root < n_; ++root) {
      const int64_t bytes = base_bytes + root;
      auto mine = random_bytes(c * 31 + uint64_t(rank_ * 7 + root), bytes);
      auto ref = std::make_shared<Bytes>(*mine);
      dist::cuda::broadcast(g_, *peers_, mine->data(), bytes, root, stream(c));
      dist::cpu::broadcast(ref_, ref->data(), bytes, root);
      expect("broadcast root=" + std::to_string(root) + " bytes=" + std::to_string(bytes),
             [mine, ref] { return *mine == *ref; });
    }
  }

  void all_gather(uint64_t c, int64_t bytes) {
    auto input = random_bytes(c * 17 + uint64_t(rank_), bytes);
    auto in = std::make_shared<Bytes>(*input);
    auto out = filled(n_ * bytes, 9);
    auto ref = filled(n_ * bytes, 8);
    std::vector<void*> outs, ref_outs;
    for (int r = 0; r < n_; ++r) {
      outs.push_back(out->data() + r * bytes);
      ref_outs.push_back(ref->data() + r * bytes);
    }
    dist::cuda::all_gather(g_, *peers_, in->data(), outs.data(), bytes, stream(c));
    // Overwritten on the stream right after the call: the copy-in must come before it.
    auto junk = filled(bytes, 0x77);
    cudaMemcpyAsync(in->data(), junk->data(), size_t(bytes), cudaMemcpyDefault, stream(c));
    dist::cpu::all_gather(ref_, input->data(), ref_outs.data(), bytes);
    const std::string what = "bytes=" + std::to_string(bytes);
    expect("all_gather " + what, [in, junk, out, ref] { return *out == *ref; });
    // In place: the input is this rank's own slot of the output.
    auto flat = filled(n_ * bytes, 1);
    std::memcpy(flat->data() + rank_ * bytes, input->data(), size_t(bytes));
    std::vector<void*> slots;
    for (int r = 0; r < n_; ++r) slots.push_back(flat->data() + r * bytes);
    dist::cuda::all_gather(g_, *peers_, slots[size_t(rank_)], slots.data(), bytes, stream(c));
    expect("all_gather in place " + what, [flat, ref] { return *flat == *ref; });
  }

  int rank_;
  int n_;
  int device_;
  dist::HostGroup g_;
  dist::HostGroup ref_;
  dist::cuda::PeersPtr peers_;
  cudaStream_t streams_[2];
  std::vector<Check> checks_;
  int checked_ = 0;
  int failures_ = 0;
};

// The fake runtime's shared-memory names of a process that did not clean up (killed, or
// leaking by design after a failure).
void remove_leftovers(pid_t pid) {
  const std::string prefix = "fkcuda-" + std::to_string(pid) + "-";
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return;
  while (dirent* e = readdir(dir)) {
    if (std::strncmp(e->d_name, prefix.c_str(), prefix.size()) == 0)
      shm_unlink(("/" + std::string(e->d_name)).c_str());
  }
  closedir(dir);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s NRANKS STAGING_BYTES [check|kill|exit_synced|abort|skew|"
                 "distinct_devices|ddp_distinct_devices|ddp_nowait|ddp_nodevice]\n", argv[0]);
    return 2;
  }
  const int n = std::atoi(argv[1]);
  const int64_t staging = std::atoll(argv[2]);
  const std::string mode = argc > 3 ? argv[3] : "check";
  void* shared = mmap(nullptr, sizeof(Barriers), PROT_READ | PROT_WRITE,
                      MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  g_barriers = new (shared) Barriers();
  const std::string tag = "fkcuda" + std::to_string(getpid());
  std::vector<pid_t> ranks;
  for (int r = 0; r < n; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      alarm(300);
      const char* slow = std::getenv("PROTOCOL_SLOW_CLOSE_RANK");
      if (slow != nullptr && std::atoi(slow) != r) unsetenv("FAKE_CUDA_SLOW_CLOSE_MS");
      int rc = 1;
      try {
        const bool distinct = mode == "distinct_devices" || mode.rfind("ddp", 0) == 0;
        Rank rank(r, n, staging, tag, distinct ? r : 0, distinct ? (r + 1) % n : 0);
        if (mode.rfind("ddp", 0) == 0) {
          rank.ddp(mode == "ddp_distinct_devices" ? "" : mode.substr(4));
        } else {
          rank.sweep(mode);
        }
        rank.finish(mode);
        rc = rank.failures() == 0 ? 0 : 1;
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: error: %s\n", r, e.what());
        rc = 3;
      }
      std::fflush(stdout);
      std::fflush(stderr);
      const char* late = std::getenv("PROTOCOL_LATE_EXIT");
      int late_rank = -1, ms = 0;
      if (late != nullptr && std::sscanf(late, "%d:%d", &late_rank, &ms) == 2 && late_rank == r)
        std::this_thread::sleep_for(std::chrono::milliseconds(ms));
      _exit(rc);
    }
    ranks.push_back(pid);
  }
  int status = 0;
  for (int r = 0; r < n; ++r) {
    int st = 0;
    waitpid(ranks[size_t(r)], &st, 0);
    const int code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    std::printf("rank %d exit %d\n", r, code);
    if (code != 0) status = 1;
    remove_leftovers(ranks[size_t(r)]);
  }
  return status;
}
