// Queues a plan's ring steps on the ranks' lanes (see cuda_executor.h). Host code only: the
// kernels live in cuda_kernels.cu, and tests/test_cuda_lanes.py compiles this file with a host
// compiler against a fake CUDA runtime whose streams run in adversarial orders.
#include "cuda_executor.h"

#include <algorithm>
#include <array>
#include <deque>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>

#include "cuda_check.h"
#include "launch.h"
#include "oneshot.h"
#include "oneshot_cuda.h"

namespace rr {
namespace cuda {

namespace {

// Events are kept per device and reused across calls: the j-th lane of a call on a device uses
// g_events[device][j], laid out as [0] entry, [1 + k] after step k, [1 + steps] exit. Reuse
// is safe because a wait refers to the record queued most recently before it (CUDA's
// semantics) and every wait of a call is queued, on the host, after the record of the same
// call it needs: no call waits on a record left by an earlier one, even one that failed
// partway. A deque, so that growing it keeps the references of the call's earlier lanes.
std::mutex g_mutex;
std::map<int, std::deque<std::vector<cudaEvent_t>>> g_events;

cudaEvent_t new_event(int device) {
  cudaEvent_t ev;
  RR_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming),
                "creating an event on cuda:" + std::to_string(device));
  return ev;
}

std::vector<cudaEvent_t>& lane_events(DeviceGuard& guard, int device, size_t ordinal,
                                      size_t nevents) {
  auto& per_lane = g_events[device];
  if (per_lane.size() <= ordinal) per_lane.resize(ordinal + 1);
  std::vector<cudaEvent_t>& events = per_lane[ordinal];
  if (events.size() < nevents) {
    guard.set(device);
    while (events.size() < nevents) events.push_back(new_event(device));
  }
  return events;
}

std::string describe(const Lane& lane, int index, bool several_per_device) {
  std::string s = "cuda:" + std::to_string(lane.device);
  if (several_per_device) s += " (lane " + std::to_string(index) + ")";
  return s;
}

// The lanes a call runs on: used[i] for i < nused, or lanes 0..nused-1 when used is null.
struct LaneList {
  const int* used;
  int nused;
  int operator[](int i) const { return used != nullptr ? used[i] : i; }
};

bool shares_device(const Lane* lanes, LaneList used) {
  for (int i = 0; i < used.nused; ++i) {
    for (int j = i + 1; j < used.nused; ++j) {
      if (lanes[used[i]].device == lanes[used[j]].device) return true;
    }
  }
  return false;
}

// check_capture over `used` lanes (cuda_executor.h). A CUDA graph can hold a call only as
// kernels on the capturing stream: events between lanes would join other streams (or devices)
// into the capture. Asking is the first thing a call does on a lane, before peer access is
// enabled (which could invalidate a global-mode capture), so a refusal leaves the caller's
// capture and later eager calls unaffected.
bool capture_check(const Lane* lanes, LaneList used, DeviceGuard& guard) {
  auto name = [&](int l) { return describe(lanes[l], l, shares_device(lanes, used)); };
  bool capturing = false;
  for (int i = 0; i < used.nused; ++i) {
    const int l = used[i];
    guard.set(lanes[l].device);
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    const cudaError_t err = cudaStreamIsCapturing(lanes[l].stream, &status);
    if (err == cudaErrorStreamCaptureImplicit) {
      cudaGetLastError();
      throw std::runtime_error(
          "ringreduce: this call cannot be captured in a CUDA graph: the stream of " + name(l) +
          " is the legacy default stream, which cannot be used while another stream of cuda:" +
          std::to_string(lanes[l].device) + " is being captured; run the call on the capturing "
          "stream (or pass streams=)");
    }
    RR_CUDA_CHECK(err, "asking whether the stream of " + name(l) + " is being captured");
    if (status == cudaStreamCaptureStatusNone) continue;
    capturing = true;
    if (used.nused > 1) {
      throw std::runtime_error(
          "ringreduce: this call cannot be captured in a CUDA graph: its ranks run on " +
          std::to_string(used.nused) + " lanes (distinct devices or streams), which are "
          "ordered by events between them; capture needs every rank on one device and one "
          "stream");
    }
  }
  return capturing;
}

// What run() works with, kept between calls (under g_mutex) and only cleared, so that a call
// whose layout was seen before allocates nothing. Per lane unless said otherwise.
struct Scratch {
  std::vector<int> used;  // the lanes that hold ranks, in lane order
  std::vector<int> slot;  // per rank: its staging slot, -1 when it reads its predecessor directly
  std::vector<int> slots_on;
  std::vector<char*> stage;
  std::vector<std::vector<cudaEvent_t>*> events;
  // The lanes of the lane's ranks' predecessors (whose memory it reads) and successors (which
  // read its memory).
  std::vector<std::vector<int>> neighbours;
  std::vector<std::array<int, 3>> peer;  // (device, peer device, direct) as asked
  std::vector<Task> tasks;
  std::vector<int> waited;
  // The once-rounded collectives (run_once_rounded): per (rank r, rank q) pair, r * nranks + q,
  // r's staging slot for q's piece, -1 when r reads it directly; the sources of one sum.
  std::vector<int> pair_slot;
  std::vector<const void*> sources;
};
Scratch g_scratch;

// The lanes that hold ranks, in lane order, into x.used.
LaneList collect_lanes(Scratch& x, const int* rank_lane, int nranks, int nlanes) {
  x.used.clear();
  for (int r = 0; r < nranks; ++r) {
    const int l = rank_lane[r];
    if (l < 0 || l >= nlanes) {
      throw std::logic_error("ringreduce internal error: rank " + std::to_string(r) +
                             " has lane " + std::to_string(l) + " of " + std::to_string(nlanes));
    }
    if (std::find(x.used.begin(), x.used.end(), l) == x.used.end()) x.used.push_back(l);
  }
  std::sort(x.used.begin(), x.used.end());
  return LaneList{x.used.data(), int(x.used.size())};
}

// Makes every used lane (only lane `only`, if >= 0) wait for what its ring neighbours
// (x.neighbours; every other used lane with `all`) queued up to their event `e` (x.events): a
// record on every lane, then the waits.
template <typename Name>
void queue_barrier(const Lane* lanes, LaneList used, const Scratch& x, size_t e,
                   const char* what, bool all, DeviceGuard& guard, const Name& name,
                   int only = -1) {
  for (int i = 0; i < used.nused; ++i) {
    const int l = used[i];
    if (l == only) continue;
    guard.set(lanes[l].device);
    RR_CUDA_CHECK(cudaEventRecord((*x.events[size_t(l)])[e], lanes[l].stream),
                  std::string(what) + " on " + name(l));
  }
  for (int i = 0; i < used.nused; ++i) {
    const int l = used[i];
    if (only >= 0 && l != only) continue;
    guard.set(lanes[l].device);
    const std::vector<int>& others = all ? x.used : x.neighbours[size_t(l)];
    for (int o : others) {
      if (o == l) continue;
      RR_CUDA_CHECK(cudaStreamWaitEvent(lanes[l].stream, (*x.events[size_t(o)])[e], 0),
                    std::string(what) + ": ordering " + name(l) + " after " + name(o));
    }
  }
}

// Whether kernels on `device` may read `peer`'s memory: the same device, no peer_access
// callback, or its answer, asked once per call for each pair (x.peer, cleared by the caller).
bool reads_directly(Scratch& x, const RunOptions& options, int device, int peer) {
  if (device == peer || !options.peer_access) return true;
  for (const auto& p : x.peer) {
    if (p[0] == device && p[1] == peer) return p[2] != 0;
  }
  const bool ok = options.peer_access(device, peer);
  x.peer.push_back({device, peer, ok ? 1 : 0});
  return ok;
}

// x.events[l] (x.events sized to the lanes by the caller) for every used lane: `nevents` events
// of the lane's place among the call's lanes on its device.
void assign_events(Scratch& x, const Lane* lanes, LaneList used, int nlanes, size_t nevents,
                   DeviceGuard& guard) {
  for (int i = 0; i < used.nused; ++i) {
    const int l = used[i];
    size_t ordinal = 0;
    for (int j = 0; j < i; ++j) ordinal += lanes[used[j]].device == lanes[l].device;
    x.events[size_t(l)] = &lane_events(guard, lanes[l].device, ordinal, nevents);
  }
}

}  // namespace

bool check_capture(const Lane* lanes, int nlanes, int current_device) {
  DeviceGuard guard(CurrentDevice{current_device});
  return capture_check(lanes, LaneList{nullptr, nlanes}, guard);
}

void run(const Plan& plan, const int* rank_lane, int nranks, const Lane* lanes, int nlanes,
         DType dtype, Op op, const RunOptions& options) {
  if (plan.empty()) return;
  if (nranks > kMaxRanks) {
    throw std::runtime_error("ringreduce: at most " + std::to_string(kMaxRanks) +
                             " ranks are supported on CUDA, got " + std::to_string(nranks));
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  Scratch& x = g_scratch;
  const LaneList used = collect_lanes(x, rank_lane, nranks, nlanes);
  const bool multi = used.nused > 1;
  auto name = [&](int l) { return describe(lanes[l], l, shares_device(lanes, used)); };

  DeviceGuard guard(CurrentDevice{options.current_device});
  const int64_t steps = int64_t(plan.size());
  const int64_t esize = elem_size(dtype);

  // Refused under capture before anything is queued and before peer access is enabled.
  const bool capturing = capture_check(lanes, used, guard);

  // Which ranks read their predecessor through copies (into a staging slot for combine hops,
  // straight into place for copy hops), the slot of each, and the stride of the slots (the
  // largest combine hop, rounded up to keep every slot 16-byte aligned).
  x.peer.clear();
  auto direct = [&](int r) {
    return reads_directly(x, options, lanes[rank_lane[r]].device,
                          lanes[rank_lane[(r + nranks - 1) % nranks]].device);
  };
  x.slot.assign(size_t(nranks), -1);
  x.slots_on.assign(size_t(nlanes), 0);
  for (int r = 0; r < nranks && nranks > 1; ++r) {
    if (options.force_copy || !direct(r)) x.slot[size_t(r)] = x.slots_on[size_t(rank_lane[r])]++;
  }
  int64_t slot_bytes = 0;
  bool staged = false;
  for (const PlanStep& step : plan) {
    for (const Move& m : step.moves) {
      if (m.src_rank == m.rank || x.slot[size_t(m.rank)] < 0) continue;
      staged = true;
      if (step.reduce) slot_bytes = std::max(slot_bytes, m.n * esize);
    }
  }
  slot_bytes = stage_slot_stride(slot_bytes);
  // Staging needs copies and scratch memory whose lifetime the graph would own.
  if (capturing && staged) {
    throw std::runtime_error(
        "ringreduce: this call cannot be captured in a CUDA graph: its hops are staged "
        "through cudaMemcpyPeerAsync and a scratch buffer (RINGREDUCE_TRANSPORT=copy, or no "
        "peer access between neighbours); capture needs the default transport (p2p)");
  }

  x.stage.assign(size_t(nlanes), nullptr);
  if (slot_bytes > 0) {
    if (!options.alloc) throw std::logic_error("ringreduce internal error: no staging allocator");
    for (int i = 0; i < used.nused; ++i) {
      const int l = used[i];
      if (x.slots_on[size_t(l)] == 0) continue;
      const Lane& lane = lanes[l];
      const size_t bytes = size_t(x.slots_on[size_t(l)]) * size_t(slot_bytes);
      void* p = options.alloc(lane.device, lane.stream, bytes);
      if (p == nullptr) {
        throw std::runtime_error("ringreduce: could not allocate a " + std::to_string(bytes) +
                                 "-byte staging buffer on " + name(l));
      }
      x.stage[size_t(l)] = static_cast<char*>(p);
    }
  }

  x.events.assign(size_t(nlanes), nullptr);
  if (multi) assign_events(x, lanes, used, nlanes, size_t(steps + 2), guard);
  if (x.neighbours.size() < size_t(nlanes)) x.neighbours.resize(size_t(nlanes));
  for (int i = 0; i < used.nused && multi; ++i) x.neighbours[size_t(used[i])].clear();
  for (int r = 0; r < nranks && multi; ++r) {
    const int l = rank_lane[r];
    for (int o : {rank_lane[(r + nranks - 1) % nranks], rank_lane[(r + 1) % nranks]}) {
      std::vector<int>& n = x.neighbours[size_t(l)];
      if (o != l && std::find(n.begin(), n.end(), o) == n.end()) n.push_back(o);
    }
  }
  // Makes every lane wait for what its ring neighbours (every other lane, with `all`) queued up
  // to their event `e`: 2 waits a lane instead of N-1.
  auto barrier = [&](size_t e, const char* what, bool all) {
    queue_barrier(lanes, used, x, e, what, all, guard, name);
  };
  // Error text, built only when a call fails.
  auto at_step = [&](int64_t k, int l) { return "ring step " + std::to_string(k) + " on " + name(l); };

  try {
    // Entry: no lane reads its predecessor's buffers before that lane's earlier work (the
    // inputs) is done. (Its own buffers' readers in the previous call, its successors, are
    // ordered before it by that call's exit; the wait on them costs one call and keeps the
    // barrier symmetric.)
    if (multi) barrier(0, "entering the ring", false);
    for (int64_t k = 0; k < steps; ++k) {
      const PlanStep& step = plan[size_t(k)];
      for (int i = 0; i < used.nused; ++i) {
        const int l = used[i];
        const Lane& lane = lanes[l];
        guard.set(lane.device);
        x.tasks.clear();
        x.waited.clear();
        for (const Move& m : step.moves) {
          if (rank_lane[m.rank] != l) continue;
          const int pl = rank_lane[m.src_rank];
          // A move at step k reads what its predecessor wrote at step k-1 (entry covers k = 0).
          if (pl != l && k > 0 &&
              std::find(x.waited.begin(), x.waited.end(), pl) == x.waited.end()) {
            RR_CUDA_CHECK(
                cudaStreamWaitEvent(lane.stream, (*x.events[size_t(pl)])[size_t(k)], 0),
                at_step(k, l) + " waiting for " + name(pl));
            x.waited.push_back(pl);
          }
          const void* src = m.src;
          if (m.src_rank != m.rank && x.slot[size_t(m.rank)] >= 0) {
            const size_t bytes = size_t(m.n * esize);
            const int pd = lanes[pl].device;
            if (!step.reduce) {
              RR_CUDA_CHECK(cudaMemcpyPeerAsync(m.dst, lane.device, src, pd, bytes, lane.stream),
                            "copying " + at_step(k, l));
              continue;
            }
            char* tmp = x.stage[size_t(l)] + int64_t(x.slot[size_t(m.rank)]) * slot_bytes;
            RR_CUDA_CHECK(cudaMemcpyPeerAsync(tmp, lane.device, src, pd, bytes, lane.stream),
                          "staging " + at_step(k, l));
            src = tmp;
          }
          x.tasks.push_back(Task{m.dst, src, m.n, m.own});
        }
        launch_step(x.tasks.data(), int(x.tasks.size()), dtype, op, step.reduce, step.last,
                    nranks, lane.stream, lane.device);
        if (multi) {
          RR_CUDA_CHECK(cudaEventRecord((*x.events[size_t(l)])[size_t(1 + k)], lane.stream),
                        at_step(k, l));
        }
      }
    }
    // Exit: a lane's later work may overwrite its buffers only after its successors have
    // finished reading them. Only neighbours touch a lane's memory (every move reads the
    // predecessor; staging buffers live on the lane that copies into them).
    if (multi) barrier(size_t(1 + steps), "leaving the ring", false);
  } catch (...) {
    // Part of the call is queued. Join the lanes anyway (best effort: a sticky error fails
    // these too), so that no lane's later work overtakes what the others still run.
    if (multi) {
      try {
        barrier(size_t(1 + steps), "joining the lanes after an error", true);
      } catch (const std::exception&) {
        cudaGetLastError();
      }
    }
    throw;
  }
}

void run_once_rounded(const OnceCall& call, const int* rank_lane, const Lane* lanes, int nlanes,
                      DType dtype, Op op, const RunOptions& options) {
  const int nranks = call.nranks;
  const int64_t count = call.count;
  if (!oneshot_rounds_once(dtype, op)) {
    throw std::invalid_argument(std::string("ringreduce: the once-rounded collectives take "
                                            "float16 and bfloat16 sum and avg; got ") +
                                dtype_name(dtype) + " " + op_name(op));
  }
  if (nranks < 2 || nranks > kMaxRanks || nranks > kOneshotMaxRanks) {
    throw std::invalid_argument("ringreduce: the once-rounded collectives take 2 to " +
                                std::to_string(std::min(kMaxRanks, kOneshotMaxRanks)) +
                                " ranks, got " + std::to_string(nranks));
  }
  if (count < 0) {
    throw std::invalid_argument("ringreduce: count must be >= 0, got " + std::to_string(count));
  }
  const bool reduce = call.kind == OnceCall::Reduce;
  if (reduce && (call.root < 0 || call.root >= nranks)) {
    throw std::invalid_argument("ringreduce: root " + std::to_string(call.root) +
                                " is not a rank of " + std::to_string(nranks));
  }
  if (count == 0) return;
  std::lock_guard<std::mutex> lock(g_mutex);
  Scratch& x = g_scratch;
  const LaneList used = collect_lanes(x, rank_lane, nranks, nlanes);
  const bool multi = used.nused > 1;
  auto name = [&](int l) { return describe(lanes[l], l, shares_device(lanes, used)); };
  DeviceGuard guard(CurrentDevice{options.current_device});
  const int64_t esize = elem_size(dtype);
  auto device_of = [&](int r) { return lanes[rank_lane[r]].device; };
  auto at = [&](const void* base, int64_t elems) {
    return const_cast<char*>(static_cast<const char*>(base)) + elems * esize;
  };
  // Rank r's piece: the elements of every input it sums (from `offset`, `n` of them) and where
  // the rounded sum goes.
  struct Piece {
    int64_t offset, n;
    void* dst;
  };
  auto piece = [&](int r) -> Piece {
    if (call.kind == OnceCall::ReduceScatter) return Piece{int64_t(r) * count, count, call.out[r]};
    const Range c = chunk_range(count, nranks, esize, r);
    if (call.kind == OnceCall::AllReduce) return Piece{c.offset, c.count, at(call.out[r], c.offset)};
    void* dst = r == call.root ? at(call.out[0], c.offset) : at(call.work[r], c.offset);
    return Piece{c.offset, c.count, dst};
  };

  // Refused under capture before anything is queued and before peer access is enabled.
  const bool capturing = capture_check(lanes, used, guard);

  // Which reads are staged: rank r reads its piece of every input, and then (all_reduce) every
  // other rank's finished piece, or (reduce, the root) every other rank's piece of its
  // workspace. A pair of devices without peer access (or the copy transport: every pair) goes
  // through cudaMemcpyPeerAsync, into a staging slot for the sums and straight into place for
  // the gathers.
  x.peer.clear();
  auto direct = [&](int r, int q) {
    return !options.force_copy && reads_directly(x, options, device_of(r), device_of(q));
  };
  x.pair_slot.assign(size_t(nranks) * size_t(nranks), -1);
  x.slots_on.assign(size_t(nlanes), 0);
  bool staged = false;
  int64_t largest = 0;
  for (int r = 0; r < nranks; ++r) {
    const int64_t n = piece(r).n;
    largest = std::max(largest, n);
    for (int q = 0; q < nranks; ++q) {
      if (q == r || direct(r, q)) continue;
      staged = true;
      if (n > 0) x.pair_slot[size_t(r * nranks + q)] = x.slots_on[size_t(rank_lane[r])]++;
    }
  }
  if (capturing && staged) {
    throw std::runtime_error(
        "ringreduce: this call cannot be captured in a CUDA graph: its reads are staged "
        "through cudaMemcpyPeerAsync and a scratch buffer (RINGREDUCE_TRANSPORT=copy, or no "
        "peer access between two ranks' devices); capture needs the default transport (p2p)");
  }
  const int64_t slot_bytes = stage_slot_stride(largest * esize);
  x.stage.assign(size_t(nlanes), nullptr);
  for (int i = 0; i < used.nused; ++i) {
    const int l = used[i];
    if (x.slots_on[size_t(l)] == 0) continue;
    if (!options.alloc) throw std::logic_error("ringreduce internal error: no staging allocator");
    const size_t bytes = size_t(x.slots_on[size_t(l)]) * size_t(slot_bytes);
    void* p = options.alloc(lanes[l].device, lanes[l].stream, bytes);
    if (p == nullptr) {
      throw std::runtime_error("ringreduce: could not allocate a " + std::to_string(bytes) +
                               "-byte staging buffer on " + name(l));
    }
    x.stage[size_t(l)] = static_cast<char*>(p);
  }
  // Events [0] entry, [1] between the halves, [2] exit. Every lane reads every other lane's
  // memory, so each barrier orders every lane after all the others.
  x.events.assign(size_t(nlanes), nullptr);
  if (multi) assign_events(x, lanes, used, nlanes, 3, guard);
  auto barrier = [&](size_t e, const char* what, int only = -1) {
    queue_barrier(lanes, used, x, e, what, true, guard, name, only);
  };
  // The gathers: (rank r, rank c) copies c's finished piece.
  const bool gather = call.kind != OnceCall::ReduceScatter;
  auto gathers = [&](int r) {
    return call.kind == OnceCall::AllReduce || (reduce && r == call.root);
  };

  try {
    // Entry: no lane reads another rank's input before that rank's earlier work is done.
    if (multi) barrier(0, "entering a once-rounded collective");
    // The sums: rank r's piece of every input, added in fp32 in rank order and rounded once,
    // into its destination. Nothing else reads or writes that destination in this half, so in
    // place is safe.
    for (int i = 0; i < used.nused; ++i) {
      const int l = used[i];
      const Lane& lane = lanes[l];
      guard.set(lane.device);
      for (int r = 0; r < nranks; ++r) {
        if (rank_lane[r] != l) continue;
        const Piece p = piece(r);
        if (p.n == 0) continue;
        x.sources.assign(size_t(nranks), nullptr);
        for (int q = 0; q < nranks; ++q) {
          const void* src = at(call.in[q], p.offset);
          const int slot = x.pair_slot[size_t(r * nranks + q)];
          if (slot >= 0) {
            char* tmp = x.stage[size_t(l)] + int64_t(slot) * slot_bytes;
            RR_CUDA_CHECK(cudaMemcpyPeerAsync(tmp, lane.device, src, device_of(q),
                                              size_t(p.n * esize), lane.stream),
                          "staging rank " + std::to_string(q) + "'s piece for rank " +
                              std::to_string(r) + " on " + name(l));
            src = tmp;
          }
          x.sources[size_t(q)] = src;
        }
        launch_chunk_once(x.sources.data(), p.dst, nranks, p.n, dtype, op, lane.stream,
                          lane.device);
      }
    }
    // Every piece is final before any lane copies it, and every input has been read before any
    // lane overwrites its other pieces.
    // (reduce: only the root's lane gathers, so only it waits.)
    if (multi && gather) {
      barrier(1, "between a once-rounded collective's halves", reduce ? rank_lane[call.root] : -1);
    }
    for (int i = 0; i < used.nused && gather; ++i) {
      const int l = used[i];
      const Lane& lane = lanes[l];
      guard.set(lane.device);
      x.tasks.clear();
      for (int r = 0; r < nranks; ++r) {
        if (rank_lane[r] != l || !gathers(r)) continue;
        for (int c = 0; c < nranks; ++c) {
          const Piece k = piece(c);
          if (c == r || k.n == 0) continue;
          void* dst = at(call.out[reduce ? 0 : r], k.offset);
          if (direct(r, c)) {
            x.tasks.push_back(Task{dst, k.dst, k.n, nullptr});
            continue;
          }
          RR_CUDA_CHECK(cudaMemcpyPeerAsync(dst, lane.device, k.dst, device_of(c),
                                            size_t(k.n * esize), lane.stream),
                        "copying rank " + std::to_string(c) + "'s piece to rank " +
                            std::to_string(r) + " on " + name(l));
        }
      }
      for (size_t t = 0; t < x.tasks.size(); t += size_t(kMaxRanks)) {
        const int n = int(std::min(x.tasks.size() - t, size_t(kMaxRanks)));
        launch_step(x.tasks.data() + t, n, dtype, op, false, false, nranks, lane.stream,
                    lane.device);
      }
    }
    // Exit: a lane's later work may overwrite its buffers only after every lane has read them.
    if (multi) barrier(2, "leaving a once-rounded collective");
  } catch (...) {
    if (multi) {
      try {
        barrier(2, "joining the lanes after an error");
      } catch (const std::exception&) {
        cudaGetLastError();
      }
    }
    throw;
  }
}

}  // namespace cuda
}  // namespace rr
