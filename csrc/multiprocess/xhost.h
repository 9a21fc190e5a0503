// The transport of a group whose ranks span several hosts: this host's ring (a Comm over its
// ranks, shared memory or CUDA IPC) composed with the inter-host backends torch makes
// (ProcessGroupGloo for CPU tensors, ProcessGroupNCCL for CUDA tensors), all called from C++.
// Part of the "ringreduce" backend (backend.h describes the whole); only backend.cpp includes it.
//
// All-reduce of S bytes, H hosts, L ranks per host (Horovod's hierarchical all-reduce):
// 1. reduce-scatter inside each host: local rank j ends with shard j (about S/L bytes) summed
//    over its host (in the ring's order);
// 2. shard j is all-reduced across hosts among the ranks of local index j, one per host, on an
//    inter-host group of those ranks. Every local rank drives its own shard, so every host's
//    NICs carry traffic at once. The host partials are combined here, in host order 0, 1, ...,
//    H-1 (fp32 for 16-bit floats, rounded once), so the result does not depend on the engine's
//    algorithm: each member receives every partial (an all-gather, shards up to 64 KiB) or its
//    1/H piece of each (an all-to-all), folds them in host order and, in the all-to-all case,
//    all-gathers the finished pieces (the bytes of a ring all-reduce). Two hosts' CPU partials up
//    to 1 MiB are exchanged (one all-to-all, nothing to itself) and both fold them; otherwise,
//    with two hosts, sum, avg and prod of 32/64-bit types use the engine's all-reduce, whose
//    result is the fold's bit for bit (two operands commute exactly);
// 3. all-gather inside the host.
// CPU tensors up to RINGREDUCE_XHOST_LEADER_BYTES take a shortcut after step 1: the host
// all-gathers its partial, its first rank does step 2 on the whole of it with the other hosts'
// first ranks, then broadcasts the result inside the host. The same partials folded in the same
// order, so the same bits; one inter-host exchange per host instead of one per local rank.
// Uneven hosts (3 ranks on one, 1 on another): each host cuts the tensor into its own L_h ring
// chunks; the union of the cuts gives segments, each all-reduced among the one rank per host
// whose shard holds it (segments()), in increasing offset order on every rank.
// reduce_scatter and all_gather compose the same way when every host has as many ranks;
// otherwise reduce_scatter is an all-reduce of the whole input and all_gather runs on the whole
// group's engine, as do broadcast, barrier, gather, scatter, all_to_all (on byte views) and
// point-to-point (the whole group's gloo send/recv).
//
// The inter-host groups are made by ringreduce/hierarchy.py's factory (torch's own Python
// constructors): the whole group's gloo and, with even hosts, the gloo of this rank's local
// index when the group is made; others (uneven hosts' pairings, NCCL) once, on first use.
// Nothing else here enters Python or takes the GIL.
//
// Faults: every inter-host wait is bounded by the group's timeout; while it waits, a rank also
// watches a failure key in the store, so a rank failing anywhere stops the others within about
// 0.2 s. When an engine call fails, the rank asks the peers involved to answer through the
// store (1 s at most, within the timeout): those that do not are named, with their host, as gone.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "../ring/schedule.h"
#include "backend_common.h"
#include "comm.h"
#include "p2p.h"
#include "transport.h"

namespace rr {
namespace dist {
// Hidden like the pybind11 types its classes hold (an anonymous namespace before the split).
namespace detail __attribute__((visibility("hidden"))) {

// One piece of a tensor that is all-reduced across hosts: elements [begin, end), and owners[h],
// the rank of host h whose shard (ring chunk of its host) holds it.
struct Segment {
  int64_t begin;
  int64_t end;
  std::vector<int> owners;
};

// The pieces of a `count`-element tensor all-reduced across hosts, in increasing offset order.
// hosts[h]: the ranks of host h in local order.
inline std::vector<Segment> xhost_segments(const std::vector<std::vector<int>>& hosts,
                                           int64_t count, int64_t elem_size) {
  std::vector<int64_t> per;
  std::set<int64_t> cuts{0, count};
  for (const auto& ranks : hosts) {
    per.push_back(rr::chunk_elems(count, int(ranks.size()), elem_size));
    for (size_t q = 1; q < ranks.size(); ++q) cuts.insert(std::min(count, int64_t(q) * per.back()));
  }
  std::vector<Segment> out;
  const std::vector<int64_t> at(cuts.begin(), cuts.end());
  for (size_t i = 0; i + 1 < at.size(); ++i) {
    if (at[i + 1] <= at[i]) continue;
    Segment s{at[i], at[i + 1], {}};
    for (size_t h = 0; h < hosts.size(); ++h) s.owners.push_back(hosts[h][size_t(at[i] / per[h])]);
    out.push_back(std::move(s));
  }
  return out;
}

// acc = op(acc, x) in acc's type (returns the result, which may be a new tensor); NaN propagates
// through max and min as in the ring. On bool, + is logical or and * logical and, as in torch.
inline at::Tensor xhost_combine(at::Tensor acc, const at::Tensor& x, const std::string& op) {
  if (op == "band") return at::bitwise_and_out(acc, acc, x);
  if (op == "bor") return at::bitwise_or_out(acc, acc, x);
  if (op == "bxor") return at::bitwise_xor_out(acc, acc, x);
  if (op == "sum" || op == "avg") return acc.add_(x);
  if (op == "prod") return acc.mul_(x);
  if (!acc.is_floating_point()) {
    return op == "max" ? at::maximum_out(acc, acc, x) : at::minimum_out(acc, acc, x);
  }
  const at::Tensor better = op == "max" ? x.gt(acc) : x.lt(acc);
  return at::where(acc.isnan().logical_or(better.logical_or(x.isnan()).logical_not()), acc, x);
}

// avg's last step on a total: divided by `nranks` (integers toward zero, as NCCL's average).
inline void xhost_divide(const at::Tensor& total, int64_t nranks) {
  if (total.is_floating_point()) {
    total.div_(nranks);
  } else {
    total.copy_(at::div(total, nranks, "trunc"));
  }
}

// Combines rows[0], rows[1], ... (dim 0 of `rows`) in that order into `out`: fp32 for 16-bit
// floats, rounded once at the end; avg divides the total by `nranks` (integers toward zero, as
// NCCL's integer average).
inline void xhost_fold(const at::Tensor& rows, const std::string& op, int64_t nranks,
                       const at::Tensor& out) {
  const bool half = out.scalar_type() == at::kHalf || out.scalar_type() == at::kBFloat16;
  at::Tensor acc = out;
  if (half) {
    acc = rows[0].to(at::kFloat);
  } else {
    acc.copy_(rows[0]);
  }
  for (int64_t i = 1; i < rows.size(0); ++i) {
    acc = xhost_combine(acc, rows[i].to(acc.scalar_type()), op);
  }
  if (op == "avg") xhost_divide(acc, nranks);
  if (!acc.is_same(out)) out.copy_(acc);
}

// Makes the inter-host group of `members` (group ranks, one per host, in host order) for CPU
// (gloo) or CUDA (NCCL) tensors. Called by this rank's members of the group alike.
using GroupFactory =
    std::function<c10::intrusive_ptr<c10d::Backend>(const std::vector<int>& members, bool cuda)>;

class XhostTransport final : public Transport,
                             public std::enable_shared_from_this<XhostTransport> {
 public:
  // Shards up to this size go across hosts as one all-gather of every member's partial (one
  // engine call instead of two; with H hosts it sends H/2 times the bytes of the two). Not
  // tuned: no run has had more than two hosts.
  static constexpr int64_t kSmallShardBytes = 64 << 10;
  // RINGREDUCE_XHOST_LEADER_BYTES's default: CPU all-reduces up to this size cross hosts once,
  // between the hosts' first ranks (all_reduce_flat). Two simulated hosts x 2 ranks on the
  // 2-core CI VM (bench/multihost.py, bench/RESULTS.md): 1.6-3x faster than every local rank
  // driving its shard at 64 KiB, 1.2-1.4x at 1 MiB, slower from 4 MiB.
  static constexpr int64_t kDefaultLeaderBytes = 1 << 20;
  // Two hosts' CPU partials up to this size cross as one exchange (xhost_all_reduce); larger
  // ones through gloo's all-reduce (32/64-bit sum, avg, prod) or all-to-all, whose pipelined
  // steps catch up from there (2 ranks, bench/gloo_exchange.py, medians: the exchange 1.7x
  // faster than the all-reduce at 64 KiB and 512 KiB, 2.2-2.6x at 1-2 MiB, 1.05x slower at 8 MiB).
  // With the exchange adding in place, 4 MiB instead gained nothing consistent at 2-16 MiB in
  // bench/multihost.py (two runs each, bench/RESULTS.md).
  static constexpr int64_t kExchangeBytes = 1 << 20;
  static constexpr auto kRollCall = std::chrono::seconds(1);  // a broken engine call's roll call
  static constexpr auto kPoll = std::chrono::milliseconds(50);
  static constexpr auto kStorePoll = std::chrono::milliseconds(200);

  // hosts[h]: the ranks of host h (numbered by their lowest rank), labels[h] its name; `local`:
  // this host's ring, made and attached; `prefix`: this group's keys in `store`.
  XhostTransport(std::shared_ptr<Comm> local, std::vector<std::vector<int>> hosts,
                 std::vector<std::string> labels, int rank, c10::intrusive_ptr<c10d::Store> store,
                 std::string prefix, double timeout_s, GroupFactory make_group)
      : local_(std::move(local)),
        hosts_(std::move(hosts)),
        labels_(std::move(labels)),
        rank_(rank),
        store_(std::move(store)),
        prefix_(std::move(prefix)),
        timeout_s_(timeout_s),
        make_group_(std::move(make_group)),
        leader_bytes_(env_int("RINGREDUCE_XHOST_LEADER_BYTES", kDefaultLeaderBytes, 0,
                              int64_t(1) << 50, "a number of bytes (CPU all-reduces up to this "
                              "size cross hosts between the hosts' first ranks only)")) {
    for (size_t h = 0; h < hosts_.size(); ++h) {
      for (size_t q = 0; q < hosts_[h].size(); ++q) {
        const int r = hosts_[h][q];
        if (int(host_of_.size()) <= r) host_of_.resize(size_t(r) + 1, -1);
        host_of_[size_t(r)] = int(h);
        if (r == rank_) {
          host_ = int(h);
          local_rank_ = int(q);
        }
      }
      if (hosts_[h].size() != hosts_[0].size()) even_ = false;
    }
    world_ = int(host_of_.size());
    for (int r = 0; r < world_; ++r) everyone_.push_back(r);
    for (const auto& ranks : hosts_) {
      if (size_t(local_rank_) < ranks.size()) index_group_.push_back(ranks[size_t(local_rank_)]);
      leaders_.push_back(ranks[0]);
    }
  }

  // The groups every collective of an even layout needs, made now, while every rank is here:
  // point-to-point uses the whole group's from any thread, and a rank that only sends must not
  // wait for the others to make it.
  void make_groups() {
    group(everyone_, false);
    if (even_) group(index_group_, false);
  }

  // ---- what Python sees (ringreduce.distributed.comm_of) ----------------------------------
  const std::vector<std::vector<int>>& hosts() const { return hosts_; }
  const std::vector<std::string>& labels() const { return labels_; }
  int rank() const { return rank_; }
  bool closed() const { return local_->closed(); }
  std::shared_ptr<Comm> local() const { return local_; }
  std::vector<std::string> rank_labels() const {
    std::vector<std::string> out;
    for (int r = 0; r < world_; ++r) out.push_back(labels_[size_t(host_of_[size_t(r)])]);
    return out;
  }

  // ---- Transport ---------------------------------------------------------------------------

  void check(const at::Tensor& t, const std::string& op, const std::string& fn,
             const std::string& arg) override {
    local_->check(t, op, fn, arg);
  }

  void all_reduce(const at::Tensor& t, const std::string& op) override {
    collective("all_reduce", [&] { all_reduce_flat(t.view(-1), op); });
  }

  void reduce_scatter(const at::Tensor& out, const at::Tensor& flat_in,
                      const std::string& op) override {
    collective("reduce_scatter", [&] {
      const int64_t m = out.numel();
      if (!even_) {
        const at::Tensor full = flat_in.clone();
        all_reduce_flat(full, op);
        out.view(-1).copy_(full.narrow(0, rank_ * m, m));
        return;
      }
      const int64_t nh = int64_t(hosts_.size()), nl = int64_t(hosts_[0].size());
      // Local rank q's part: the blocks of the ranks with local index q, in host order.
      std::vector<int64_t> order;
      for (int64_t q = 0; q < nl; ++q) {
        for (int64_t h = 0; h < nh; ++h) order.push_back(hosts_[size_t(h)][size_t(q)]);
      }
      const at::Tensor grouped =
          flat_in.view({world_, m}).index_select(0, at::tensor(order, at::kLong).to(
              flat_in.device())).view(-1);
      const at::Tensor partial = at::empty({nh * m}, out.options());
      local_call([&] { local_->reduce_scatter(partial, grouped, local_op(op)); });
      const at::Tensor recv = at::empty_like(partial);
      xhost(index_group_, &partial, "reduce_scatter", [&](c10d::Backend& g) {
        std::vector<int64_t> none;
        at::Tensor r = recv, p = partial;
        return g.alltoall_base(r, p, none, none, c10d::AllToAllOptions());
      });
      xhost_fold(recv.view({nh, m}), op, world_, out.view(-1));
    });
  }

  void all_gather(const std::vector<at::Tensor>& outs, const at::Tensor& in) override {
    collective("all_gather", [&] {
      const at::Tensor src = bytes(in);
      if (!even_) {
        std::vector<std::vector<at::Tensor>> dst(1);
        for (int r = 0; r < world_; ++r) dst[0].push_back(at::empty_like(src));
        std::vector<at::Tensor> srcs{src};
        xhost(everyone_, &src, "all_gather",
              [&](c10d::Backend& g) { return g.allgather(dst, srcs, c10d::AllgatherOptions()); });
        for (int r = 0; r < world_; ++r) bytes(outs[size_t(r)]).copy_(dst[0][size_t(r)]);
        return;
      }
      const int64_t nh = int64_t(hosts_.size()), nl = int64_t(hosts_[0].size());
      const int64_t b = src.numel();
      const at::Tensor across = at::empty({nh * b}, src.options());
      xhost_all_gather(index_group_, src, across, "all_gather");
      const at::Tensor every = at::empty({nl * nh * b}, src.options());
      const std::vector<at::Tensor> parts = every.view({nl, nh * b}).unbind(0);
      local_call([&] { local_->all_gather(parts, across); });
      const at::Tensor blocks = every.view({nl, nh, b});
      for (int64_t q = 0; q < nl; ++q) {
        for (int64_t h = 0; h < nh; ++h) {
          bytes(outs[size_t(hosts_[size_t(h)][size_t(q)])]).copy_(blocks[q][h]);
        }
      }
    });
  }

  void broadcast(const at::Tensor& t, int root) override {
    collective("broadcast", [&] {
      std::vector<at::Tensor> data{bytes(t)};
      c10d::BroadcastOptions opts;
      opts.rootRank = root;
      xhost(everyone_, &data[0], "broadcast", [&](c10d::Backend& g) { return g.broadcast(data, opts); });
    });
  }

  void barrier() override {
    collective("barrier", [&] {
      xhost(everyone_, nullptr, "barrier",
            [&](c10d::Backend& g) { return g.barrier(c10d::BarrierOptions()); });
    });
  }

  // gather, scatter and all-to-all: the whole group's gloo on byte views (any dtype); the
  // tensors are contiguous CPU tensors (the backend stages the others).

  void gather(const std::vector<at::Tensor>& outs, const at::Tensor& in, int root) override {
    collective("gather", [&] {
      std::vector<at::Tensor> src{bytes(in)};
      std::vector<std::vector<at::Tensor>> dst;
      if (!outs.empty()) dst.emplace_back();
      for (const at::Tensor& o : outs) dst[0].push_back(bytes(o));
      c10d::GatherOptions opts;
      opts.rootRank = root;
      xhost(everyone_, &src[0], "gather", [&](c10d::Backend& g) { return g.gather(dst, src, opts); });
    });
  }

  void scatter(const at::Tensor& out, const std::vector<at::Tensor>& ins, int root) override {
    collective("scatter", [&] {
      std::vector<at::Tensor> dst{bytes(out)};
      std::vector<std::vector<at::Tensor>> src;
      if (!ins.empty()) src.emplace_back();
      for (const at::Tensor& t : ins) src[0].push_back(bytes(t));
      c10d::ScatterOptions opts;
      opts.rootRank = root;
      xhost(everyone_, &dst[0], "scatter", [&](c10d::Backend& g) { return g.scatter(dst, src, opts); });
    });
  }

  // outs[r] receives ins[this rank] of rank r; sizes may differ per rank.
  void all_to_all(const std::vector<at::Tensor>& outs, const std::vector<at::Tensor>& ins) override {
    collective("all_to_all", [&] {
      std::vector<at::Tensor> parts;
      std::vector<int64_t> in_splits, out_splits;
      int64_t total = 0;
      for (const at::Tensor& t : ins) {
        parts.push_back(bytes(t));
        in_splits.push_back(parts.back().numel());
      }
      for (const at::Tensor& o : outs) {
        out_splits.push_back(o.numel() * o.element_size());
        total += out_splits.back();
      }
      at::Tensor send = at::cat(parts);
      at::Tensor recv = at::empty({total}, send.options());
      xhost(everyone_, &send, "all_to_all", [&](c10d::Backend& g) {
        // Copies: gloo moves the split vectors out of the arguments.
        std::vector<int64_t> outs_split = out_splits, ins_split = in_splits;
        return g.alltoall_base(recv, send, outs_split, ins_split, c10d::AllToAllOptions());
      });
      int64_t at_ = 0;
      for (size_t r = 0; r < outs.size(); ++r) {
        bytes(outs[r]).copy_(recv.narrow(0, at_, out_splits[r]));
        at_ += out_splits[r];
      }
    });
  }

  // Marks the group failed (first message wins) and tells the other hosts through the store,
  // so their inter-host waits stop at once. Safe from any thread.
  void fail(const std::string& message) override {
    bool first = false;
    {
      const std::lock_guard<std::mutex> held(mu_);
      first = failure_.empty();
      if (first) {
        failure_ = message;
        failed_.store(true, std::memory_order_release);
      }
    }
    local_->fail(message);
    if (!first) return;
    try {
      store_set(prefix_ + "/failed", "rank " + std::to_string(rank_) + " on host '" +
                                         labels_[size_t(host_)] + "': " + message);
      store_set(prefix_ + "/answer/" + std::to_string(rank_), "1");
    } catch (const std::exception&) {
      // The store may be gone with its host; this rank's own failure is recorded above.
    }
  }

  void abort() override {
    fail("ringreduce: the process group was aborted on rank " + std::to_string(rank_) +
         " (ProcessGroup.abort)");
  }

  void close() override {
    local_->close();
    std::map<std::pair<std::vector<int>, bool>, c10::intrusive_ptr<c10d::Backend>> groups;
    {
      const std::lock_guard<std::mutex> held(groups_mu_);
      groups.swap(groups_);
    }
    for (auto& kv : groups) {
      try {
        kv.second->shutdown();
      } catch (const std::exception&) {
        // A group whose peers are gone may fail to shut down; it is dropped either way.
      }
    }
  }

  void set_timeout(double seconds) override {
    local_->set_timeout(seconds);
    timeout_s_.store(seconds);
    const auto ms = std::chrono::milliseconds(int64_t(seconds * 1000.0));
    const std::lock_guard<std::mutex> held(groups_mu_);
    for (auto& kv : groups_) kv.second->setTimeout(ms);
  }

  c10::optional<int64_t> inter_host_bytes() override { return stats_bytes_.load(); }

  py::object object() override {
    py::gil_scoped_acquire gil;
    return py::cast(shared_from_this());
  }

  // ---- point-to-point ----------------------------------------------------------------------
  // gloo's own send/recv on the whole group, posted by the caller's thread (so messages match
  // per (peer, tag) in issue order) and waited for by a thread per operation (the backend's
  // xhost_p2p). gloo bounds each wait by the group's timeout; a wait cannot be cut short and
  // resumed (gloo closes the connection), so it is not also watched through the store.

  // Posts a send to `peer`, or a receive from `peer` (kAnySource: any rank), of the contiguous
  // CPU tensor's bytes with `tag`; returns gloo's Work.
  c10::intrusive_ptr<c10d::Work> p2p_start(bool send, const at::Tensor& t, int peer, int tag) {
    if (failed_.load(std::memory_order_acquire)) {
      throw std::runtime_error(std::string("ringreduce: ") + (send ? "send" : "recv") +
                               " on rank " + std::to_string(rank_) + ": this process group "
                               "failed earlier and cannot be used any more: " + failure());
    }
    std::vector<at::Tensor> data{bytes(t)};
    const c10::intrusive_ptr<c10d::Backend> g = group(everyone_, false);
    if (send) {
      stats_bytes_ += data[0].numel();
      return g->send(data, peer, tag);
    }
    if (peer == kAnySource) return g->recvAnysource(data, tag);
    return g->recv(data, peer, tag);
  }

  // Waits for an operation of p2p_start; returns the peer (for a receive from any rank, the
  // sender). Failures name the peer and its host.
  int p2p_wait(const c10::intrusive_ptr<c10d::Work>& work, bool send, int peer, int tag) {
    try {
      if (!work->wait()) throw std::runtime_error("aborted");
    } catch (const std::exception&) {
      const std::string detail = first_line(error_text(std::current_exception()));
      std::string what;
      if (send) {
        what = "send to " + describe_ranks({peer});
      } else if (peer == kAnySource) {
        what = "recvAnySource (a recv from any rank)";
      } else {
        what = "recv from " + describe_ranks({peer});
      }
      const std::string state = detail.find("Timed out") != std::string::npos
                                    ? "timed out after " + seconds_text(timeout_s_.load()) + " s"
                                    : "failed";
      throw std::runtime_error("ringreduce: " + what + " with tag " + std::to_string(tag) +
                               " on rank " + std::to_string(rank_) + " (host '" +
                               labels_[size_t(host_)] + "') " + state + ": " + detail);
    }
    return peer == kAnySource ? work->sourceRank() : peer;
  }

  // "host 'b' (rank 2)" for the hosts of `ranks`, naming only those ranks.
  std::string describe_ranks(std::vector<int> ranks) const {
    std::sort(ranks.begin(), ranks.end());
    std::map<int, std::vector<int>> by_host;
    for (int r : ranks) by_host[host_of_[size_t(r)]].push_back(r);
    std::string s;
    for (const auto& kv : by_host) {
      if (!s.empty()) s += ", ";
      s += "host '" + labels_[size_t(kv.first)] + "' (" + ranks_text(kv.second) + ")";
    }
    return s;
  }

 private:
  // An inter-host wait that ended without the engine's error (timeout, failure elsewhere).
  class Stop : public std::runtime_error {
   public:
    using std::runtime_error::runtime_error;
  };

  // Set by the engine's future (any thread), waited for by the collective's thread.
  struct Done {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    void set() {
      {
        const std::lock_guard<std::mutex> held(mu);
        done = true;
      }
      cv.notify_all();
    }
    bool wait_for(Clock::duration d) {
      std::unique_lock<std::mutex> lock(mu);
      return cv.wait_for(lock, d, [this] { return done; });
    }
  };

  static std::string ranks_text(const std::vector<int>& ranks) {
    std::string s = ranks.size() == 1 ? "rank " : "ranks ";
    for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
    return s;
  }
  static std::string seconds_text(double s) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%.1f", s);
    return buf;
  }
  static std::string first_line(const std::string& text) {
    const std::string line = text.substr(0, text.find('\n'));
    return line.empty() ? "unknown error" : line;
  }
  // A tensor's bytes (a view of a contiguous tensor).
  static at::Tensor bytes(const at::Tensor& t) { return t.reshape(-1).view(at::kByte); }
  static std::string local_op(const std::string& op) { return op == "avg" ? "sum" : op; }

  std::string failure() {
    const std::lock_guard<std::mutex> held(mu_);
    return failure_;
  }
  Clock::duration timeout() const {
    return std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double>(timeout_s_.load()));
  }

  void store_set(const std::string& key, const std::string& value) {
    store_->set(key, std::vector<uint8_t>(value.begin(), value.end()));
  }

  // Waits (until `deadline`) for every key; returns the indices of those missing.
  std::vector<size_t> wait_keys(const std::vector<std::string>& keys, Clock::time_point deadline) {
    const auto left = std::max<Clock::duration>(deadline - Clock::now(),
                                                std::chrono::milliseconds(1));
    try {
      store_->wait(keys, std::chrono::duration_cast<std::chrono::milliseconds>(left));
      return {};
    } catch (const std::exception&) {
      std::vector<size_t> missing;
      for (size_t i = 0; i < keys.size(); ++i) {
        if (!store_->check({keys[i]})) missing.push_back(i);
      }
      if (missing.empty()) throw;
      return missing;
    }
  }

  // What a rank that failed elsewhere wrote in the store, or "".
  std::string failure_report() {
    const std::string key = prefix_ + "/failed";
    try {
      if (!store_->check({key})) return "";
      const std::vector<uint8_t> v = store_->get(key);
      return std::string(v.begin(), v.end());
    } catch (const std::exception&) {
      return "";  // a store that is gone tells nothing
    }
  }

  // Numbers the collective and sets its deadline; any failure in it fails the group.
  template <typename F>
  void collective(const char* kind, F&& body) {
    ++seq_;
    ctx_ = std::string(kind) + " #" + std::to_string(seq_) + " on rank " + std::to_string(rank_) +
           " (host '" + labels_[size_t(host_)] + "')";
    deadline_ = Clock::now() + timeout();
    if (failed_.load(std::memory_order_acquire)) {
      throw std::runtime_error("ringreduce: " + ctx_ + ": this process group failed earlier "
                               "and cannot be used any more: " + failure());
    }
    try {
      body();
    } catch (const std::exception&) {
      fail(error_text(std::current_exception()));
      throw;
    }
  }

  // One collective of this host's ring; its messages number ranks locally, so they are given
  // the group's numbering.
  template <typename F>
  void local_call(F&& call) {
    try {
      call();
    } catch (const std::exception&) {
      std::string ranks;
      const auto& mine = hosts_[size_t(host_)];
      for (size_t q = 0; q < mine.size(); ++q) {
        ranks += (q ? ", " : "") + std::string("local rank ") + std::to_string(q) + " = rank " +
                 std::to_string(mine[q]);
      }
      throw std::runtime_error("ringreduce: " + ctx_ + ": inside the host (" + ranks + "): " +
                               error_text(std::current_exception()));
    }
  }

  c10::intrusive_ptr<c10d::Backend> group(const std::vector<int>& members, bool cuda) {
    const auto key = std::make_pair(members, cuda);
    {
      const std::lock_guard<std::mutex> held(groups_mu_);
      auto it = groups_.find(key);
      if (it != groups_.end()) return it->second;
    }
    // Made outside the lock (it waits for the other members): only this group's progress
    // thread makes groups after construction.
    c10::intrusive_ptr<c10d::Backend> made = make_group_(members, cuda);
    TORCH_CHECK(made, "ringreduce: the inter-host group of ", ranks_text(members), " could not "
                "be made");
    made->setTimeout(std::chrono::milliseconds(int64_t(timeout_s_.load() * 1000.0)));
    const std::lock_guard<std::mutex> held(groups_mu_);
    return groups_.emplace(key, made).first->second;
  }

  // Runs call(group) on the inter-host group of `members` and waits for it, bounded by the
  // collective's deadline; failures name the hosts.
  template <typename F>
  void xhost(const std::vector<int>& members, const at::Tensor* tensor, const char* what,
             F&& call) {
    const bool cuda = tensor != nullptr && tensor->is_cuda();
    if (tensor) stats_bytes_ += tensor->numel() * int64_t(tensor->element_size());
    try {
      const c10::intrusive_ptr<c10d::Backend> g = group(members, cuda);
      const c10::intrusive_ptr<c10d::Work> work = call(*g);
      if (cuda) {
        work->wait();  // the caller's stream waits; NCCL's watchdog bounds it
        return;
      }
      auto done = std::make_shared<Done>();
      work->getFuture()->addCallback([done](c10::ivalue::Future&) { done->set(); });
      wait_done(*done, members, what);
      work->wait();
    } catch (const Stop&) {
      throw;
    } catch (const std::exception&) {
      throw peer_error(members, what, first_line(error_text(std::current_exception())));
    }
  }

  void wait_done(Done& done, const std::vector<int>& members, const char* what) {
    Clock::time_point next_store_check = Clock::now() + kStorePoll;
    const std::string where = std::string(" the inter-host ") + what;
    while (!done.wait_for(kPoll)) {
      if (failed_.load(std::memory_order_acquire)) {
        throw Stop("ringreduce: " + ctx_ + " stopped waiting for" + where + ": this rank's "
                   "process group failed: " + failure());
      }
      const Clock::time_point now = Clock::now();
      if (now >= deadline_) {
        throw Stop("ringreduce: " + ctx_ + " timed out after " + seconds_text(timeout_s_.load()) +
                   " s in" + where + " with " + describe_ranks(others(members)));
      }
      if (now >= next_store_check) {
        next_store_check = now + kStorePoll;
        const std::string report = failure_report();
        if (!report.empty()) {
          throw Stop("ringreduce: " + ctx_ + " stopped waiting for" + where + ": " + report);
        }
      }
    }
  }

  std::vector<int> others(const std::vector<int>& members) const {
    std::vector<int> out;
    for (int r : members) {
      if (r != rank_) out.push_back(r);
    }
    return out;
  }

  // The engine failed (a broken connection, its timeout): says which peers are gone. The peers
  // that are alive answer through the store as soon as they fail themselves.
  std::runtime_error peer_error(const std::vector<int>& members, const char* what,
                                const std::string& detail) {
    const std::vector<int> peers = others(members);
    std::vector<int> gone;
    try {
      store_set(prefix_ + "/answer/" + std::to_string(rank_), "1");
      std::vector<std::string> keys;
      for (int r : peers) keys.push_back(prefix_ + "/answer/" + std::to_string(r));
      for (size_t i : wait_keys(keys, std::min(Clock::now() + kRollCall, deadline_))) {
        gone.push_back(peers[i]);
      }
    } catch (const std::exception&) {
      gone.clear();  // the store itself may have gone with its host
    }
    if (!gone.empty()) {
      return std::runtime_error("ringreduce: " + ctx_ + ": " + describe_ranks(gone) + " is gone "
                                "(no answer after the inter-host " + what + " broke): " + detail);
    }
    const std::string report = failure_report();
    return std::runtime_error("ringreduce: " + ctx_ + ": the inter-host " + std::string(what) +
                              " with " + describe_ranks(peers) + " failed: " + detail +
                              (report.empty() ? "" : "; " + report));
  }

  // ---- the three phases --------------------------------------------------------------------

  void all_reduce_flat(const at::Tensor& flat, const std::string& op) {
    const int64_t n = flat.numel();
    const int nl = int(hosts_[size_t(host_)].size());
    const int64_t per = rr::chunk_elems(n, nl, flat.element_size());
    at::Tensor buf = flat;
    if (per * nl != n) {
      buf = at::empty({per * nl}, flat.options());
      buf.narrow(0, 0, n).copy_(flat);
      buf.narrow(0, n, per * nl - n).zero_();
    }
    const at::Tensor mine = buf.narrow(0, local_rank_ * per, per);
    if (nl > 1) {
      // In place: this rank's segment of the input is the output.
      local_call([&] { local_->reduce_scatter(mine, buf, local_op(op)); });
    }
    if (!flat.is_cuda() && n * int64_t(flat.element_size()) <= leader_bytes_) {
      // Up to RINGREDUCE_XHOST_LEADER_BYTES, the host's partial crosses whole, once, between
      // the hosts' first ranks, and comes back to the others by broadcast: one inter-host
      // exchange instead of one per local rank (on a busy host each costs wake-ups of several
      // threads). The same partials folded in the same host order: the same bits as below.
      if (nl > 1) local_call([&] { local_->all_gather(buf.view({nl, per}).unbind(0), mine); });
      const at::Tensor whole = buf.narrow(0, 0, n);
      if (local_rank_ == 0 && n > 0) xhost_all_reduce(whole, op, leaders_);
      if (nl > 1 && n > 0) local_call([&] { local_->broadcast(whole, 0); });
    } else {
      for (const Segment& s : xhost_segments(hosts_, n, flat.element_size())) {
        if (s.owners[size_t(host_)] == rank_) {
          xhost_all_reduce(buf.narrow(0, s.begin, s.end - s.begin), op, s.owners);
        }
      }
      if (nl > 1) {
        local_call([&] { local_->all_gather(buf.view({nl, per}).unbind(0), mine); });
      }
    }
    if (!buf.is_same(flat)) flat.copy_(buf.narrow(0, 0, n));
  }

  void xhost_all_reduce(const at::Tensor& x, const std::string& op,
                        const std::vector<int>& members) {
    const int64_t nh = int64_t(members.size());
    const at::ScalarType dt = x.scalar_type();
    const bool engine_type =
        dt == at::kFloat || dt == at::kDouble || dt == at::kInt || dt == at::kLong;
    // Two operands commute bit for bit (IEEE and wrapping integer + and *), so for these an
    // unordered combination gives exactly the host-order fold's bits.
    const bool commutes = (op == "sum" || op == "avg" || op == "prod") && engine_type;
    if (nh == 2 && !x.is_cuda() && x.numel() * int64_t(x.element_size()) <= kExchangeBytes) {
      // Two hosts, CPU: an exchange. Each member sends its partial to the other (gloo's
      // all-to-all with nothing for itself: one message each way, where gloo's all-reduce
      // takes two steps), then both combine the two: in place where they commute, else
      // folded in host order, so both get the same bits.
      const int64_t m = x.numel() * int64_t(x.element_size());
      const int64_t me = members[0] == rank_ ? 0 : 1;
      const at::Tensor rows = commutes ? at::Tensor() : at::empty({2, x.numel()}, x.options());
      const at::Tensor other = commutes ? at::empty_like(x) : rows[1 - me];
      if (!commutes) rows[me].copy_(x);
      at::Tensor in = bytes(x), out = bytes(other);
      const std::vector<int64_t> splits = me == 0 ? std::vector<int64_t>{0, m}
                                                  : std::vector<int64_t>{m, 0};
      xhost(members, &x, "all_reduce", [&](c10d::Backend& g) {
        // Copies: gloo moves the split vectors out of the arguments.
        std::vector<int64_t> out_splits = splits, in_splits = splits;
        return g.alltoall_base(out, in, out_splits, in_splits, c10d::AllToAllOptions());
      });
      if (!commutes) {
        xhost_fold(rows, op, world_, x);
        return;
      }
      xhost_combine(x, other, op);  // in place: + or *
      if (op == "avg") xhost_divide(x, world_);
      return;
    }
    if (nh == 2 && commutes) {
      // The engine's own all-reduce: the host-order fold's bits in one call, without a
      // separate fold pass.
      c10d::AllreduceOptions opts;
      opts.reduceOp = op == "prod" ? c10d::ReduceOp::PRODUCT : c10d::ReduceOp::SUM;
      std::vector<at::Tensor> data{x};
      xhost(members, &x, "all_reduce", [&](c10d::Backend& g) { return g.allreduce(data, opts); });
      if (op == "avg") xhost_divide(x, world_);
      return;
    }
    if (x.numel() * int64_t(x.element_size()) <= kSmallShardBytes) {
      at::Tensor rows = at::empty({nh * x.numel()}, x.options());
      at::Tensor in = x;
      xhost(members, &x, "all_reduce",
            [&](c10d::Backend& g) { return g._allgather_base(rows, in, c10d::AllgatherOptions()); });
      xhost_fold(rows.view({nh, x.numel()}), op, world_, x);
      return;
    }
    // Reduce-scatter as an all-to-all (member h gets piece h of every partial) and a fold, then
    // an all-gather of the finished pieces: the bytes of a ring all-reduce.
    const int64_t p = rr::chunk_elems(x.numel(), int(nh), x.element_size());
    at::Tensor pieces = x;
    if (p * nh != x.numel()) {
      pieces = at::zeros({p * nh}, x.options());
      pieces.narrow(0, 0, x.numel()).copy_(x);
    }
    at::Tensor recv = at::empty_like(pieces);
    xhost(members, &pieces, "all_reduce", [&](c10d::Backend& g) {
      std::vector<int64_t> none;
      return g.alltoall_base(recv, pieces, none, none, c10d::AllToAllOptions());
    });
    const at::Tensor done = at::empty({p}, x.options());
    xhost_fold(recv.view({nh, p}), op, world_, done);
    xhost_all_gather(members, done, recv, "all_reduce", pieces);
    x.copy_(recv.narrow(0, 0, x.numel()));
  }

  // dst = every member's src, in member order. Large ones go as an all-to-all whose every slot
  // holds src (`send`: a scratch buffer of members x src, else allocated): gloo's all-gather was
  // 1.5-2.5x slower than its all-to-all sending the same bytes per rank (1-16 MiB, two ranks,
  // bench/gloo_exchange.py on the 2-core CI VM; bench/RESULTS.md).
  void xhost_all_gather(const std::vector<int>& members, const at::Tensor& src,
                        const at::Tensor& dst, const char* what, at::Tensor send = at::Tensor()) {
    const int64_t nh = int64_t(members.size());
    at::Tensor in = src, out = dst;
    if (src.numel() * int64_t(src.element_size()) <= kSmallShardBytes) {
      xhost(members, &src, what,
            [&](c10d::Backend& g) { return g._allgather_base(out, in, c10d::AllgatherOptions()); });
      return;
    }
    if (!send.defined()) send = at::empty_like(dst);
    send.view({nh, -1}).copy_(src.view({1, -1}).expand({nh, src.numel()}));
    xhost(members, &send, what, [&](c10d::Backend& g) {
      std::vector<int64_t> none;
      return g.alltoall_base(out, send, none, none, c10d::AllToAllOptions());
    });
  }

  const std::shared_ptr<Comm> local_;
  const std::vector<std::vector<int>> hosts_;
  const std::vector<std::string> labels_;
  const int rank_;
  const c10::intrusive_ptr<c10d::Store> store_;
  const std::string prefix_;
  std::atomic<double> timeout_s_;
  const GroupFactory make_group_;
  const int64_t leader_bytes_;  // RINGREDUCE_XHOST_LEADER_BYTES
  std::vector<int> host_of_;
  int world_ = 0;
  int host_ = 0;
  int local_rank_ = 0;
  bool even_ = true;
  std::vector<int> everyone_;
  std::vector<int> index_group_;  // the ranks of this rank's local index, one per host
  std::vector<int> leaders_;      // each host's first rank, in host order

  std::mutex groups_mu_;
  std::map<std::pair<std::vector<int>, bool>, c10::intrusive_ptr<c10d::Backend>> groups_;
  std::atomic<int64_t> stats_bytes_{0};  // bytes handed to the inter-host engines
  std::mutex mu_;
  std::string failure_;
  std::atomic<bool> failed_{false};
  // The collective in progress (one at a time: the group's engine runs them in issue order).
  uint64_t seq_ = 0;
  std::string ctx_;
  Clock::time_point deadline_;
};

// ringreduce._dist_C.HierarchicalComm (made by ringreduce/distributed.py, the executor that
// distributed.comm_of returns across hosts) and xhost_segments (hierarchy.segments).
inline void bind_xhost(py::module& m) {
  py::class_<XhostTransport, std::shared_ptr<XhostTransport>>(
      m, "HierarchicalComm", "The executor of a ringreduce group that spans several hosts: this "
      "host's ring composed with torch's gloo/NCCL between hosts (csrc/multiprocess/xhost.h).")
      .def(py::init([](std::shared_ptr<Comm> local, std::vector<std::vector<int>> hosts,
                       std::vector<std::string> labels, int rank, py::object store,
                       std::string prefix, double timeout_s, py::function make_group) {
             // The factory is a Python callable: held, called and released under the GIL.
             std::shared_ptr<py::function> fn(new py::function(std::move(make_group)),
                                              [](py::function* f) {
                                                if (!Py_IsInitialized()) {
                                                  f->release();  // nothing to decrement
                                                  delete f;
                                                  return;
                                                }
                                                py::gil_scoped_acquire gil;
                                                delete f;
                                              });
             GroupFactory factory = [fn](const std::vector<int>& members, bool cuda) {
               py::gil_scoped_acquire gil;
               try {
                 py::object made = (*fn)(py::tuple(py::cast(members)), cuda);
                 return made.cast<c10::intrusive_ptr<c10d::Backend>>();
               } catch (py::error_already_set& e) {
                 throw std::runtime_error(e.what());  // its Python objects stay under the GIL
               }
             };
             auto x = std::make_shared<XhostTransport>(
                 std::move(local), std::move(hosts), std::move(labels), rank,
                 store.cast<c10::intrusive_ptr<c10d::Store>>(), std::move(prefix), timeout_s,
                 std::move(factory));
             x->make_groups();
             return x;
           }),
           py::arg("local"), py::arg("hosts"), py::arg("labels"), py::arg("rank"),
           py::arg("store"), py::arg("prefix"), py::arg("timeout"), py::arg("make_group"))
      .def_property_readonly("hosts", &XhostTransport::hosts,
                             "The ranks of every host (hosts numbered by their lowest rank).")
      .def_property_readonly("labels", &XhostTransport::labels, "Every host's name.")
      .def_property_readonly("rank_labels", &XhostTransport::rank_labels,
                             "Every rank's host name.")
      .def_property_readonly("rank", &XhostTransport::rank)
      .def_property_readonly("local", &XhostTransport::local, "This host's ring (a Comm).")
      .def_property_readonly("closed", &XhostTransport::closed)
      .def_property_readonly("inter_host_bytes", &XhostTransport::inter_host_bytes,
                             "Bytes this rank has handed to the inter-host engines.");
  m.def("xhost_segments", [](const std::vector<std::vector<int>>& hosts, int64_t count,
                             int64_t elem_size) {
    py::list out;
    for (const Segment& s : xhost_segments(hosts, count, elem_size)) {
      out.append(py::make_tuple(s.begin, s.end, py::tuple(py::cast(s.owners))));
    }
    return out;
  }, py::arg("hosts"), py::arg("count"), py::arg("elem_size"),
        "The pieces (begin, end, owners) of a `count`-element tensor that a group over `hosts` "
        "all-reduces across hosts, owners[h] the rank of host h whose shard holds it.");
}

}  // namespace detail
}  // namespace dist
}  // namespace rr
