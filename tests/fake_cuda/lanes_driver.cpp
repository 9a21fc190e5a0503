// Drives csrc/ring/cuda_executor.cu on the fake runtime of fake_lanes.h (tests/test_cuda_lanes.py).
//
//   lanes_driver matrix     every layout x collective x transport x schedule, several calls
//                           back to back with the user's work between them, byte for byte
//                           against the CPU executor
//   lanes_driver failures   an error injected into each call of a run in turn: the run throws,
//                           the lanes are joined, no later call waits on a stale record, and
//                           the next call is right
//   lanes_driver capture    what is refused under stream capture, and that it queues nothing
//   lanes_driver dropwait   each wait the executor queues dropped in turn: every per-step wait
//                           is needed (some schedule then gives wrong bytes)
//   lanes_driver distinct_devices
//                           a rank per device, its memory on that device, devices 1 and 2
//                           refusing peer access, peer access asked for as torch's
//                           get_p2p_access does, lanes on created streams or on each device's
//                           default stream: every collective, p2p and copy, against the CPU
//                           executor, no kernel touching a peer's memory without access, and
//                           only the refused pair staged; then two planted bugs that must be
//                           caught (a peer-access answer that says yes without enabling access,
//                           and a lane whose stream belongs to another device)
// Prints one line per finding and a summary; exits 1 if anything is wrong.
#include <cstdio>
#include <cstring>
#include <exception>
#include <map>
#include <string>
#include <vector>

#include "fake_lanes.h"
#include "ring/cpu_executor.h"
#include "ring/cuda_check.h"
#include "ring/cuda_executor.h"
#include "ring/plan.h"

namespace {

using rr::DType;
using rr::Op;
using Bytes = std::vector<unsigned char>;

constexpr int kDevices = 8;
constexpr int64_t kCapacity = 4099;  // elements per rank block

struct Layout {
  std::string name;
  std::vector<int> lane_device;  // per lane
  std::vector<int> rank_lane;    // per rank
  std::vector<uint8_t> direct;   // per rank
};

// single: one lane; devices: a GPU per rank; virtual: a stream per rank on one GPU;
// mixed: three lanes (two share a GPU), ranks dealt round-robin; nopeer: a GPU per rank and
// rank 1 cannot read rank 0's memory directly.
std::vector<Layout> layouts(int n) {
  std::vector<Layout> out;
  Layout single{"single", {0}, std::vector<int>(size_t(n), 0), {}};
  Layout devices{"devices", {}, {}, {}}, virt{"virtual", {}, {}, {}};
  for (int r = 0; r < n; ++r) {
    devices.lane_device.push_back(r);
    devices.rank_lane.push_back(r);
    virt.lane_device.push_back(0);
    virt.rank_lane.push_back(r);
  }
  Layout mixed{"mixed", n >= 3 ? std::vector<int>{0, 0, 1} : std::vector<int>{0, 1}, {}, {}};
  for (int r = 0; r < n; ++r) mixed.rank_lane.push_back(r % int(mixed.lane_device.size()));
  Layout nopeer = devices;
  nopeer.name = "nopeer";
  nopeer.direct.assign(size_t(n), 1);
  nopeer.direct[1] = 0;
  out = {single, devices, virt, mixed, nopeer};
  return out;
}

// ...Once: the once-rounded collectives (run_once_rounded), float16 and bfloat16 sum and avg,
// against rr::cpu::all_reduce_once, reduce_scatter_once and sum_rounded_once.
enum class Coll { AllReduce, AllReduceOut, Reduce, Broadcast, AllGather, ReduceScatter,
                  AllReduceOnce, AllReduceOnceOut, ReduceOnce, ReduceScatterOnce };
const char* coll_name(Coll c) {
  switch (c) {
    case Coll::AllReduce: return "all_reduce";
    case Coll::AllReduceOut: return "all_reduce(outputs)";
    case Coll::Reduce: return "reduce";
    case Coll::Broadcast: return "broadcast";
    case Coll::AllGather: return "all_gather";
    case Coll::ReduceScatter: return "reduce_scatter";
    case Coll::AllReduceOnce: return "all_reduce_once";
    case Coll::AllReduceOnceOut: return "all_reduce_once(outputs)";
    case Coll::ReduceOnce: return "reduce_once";
    case Coll::ReduceScatterOnce: return "reduce_scatter_once";
  }
  return "?";
}
const Coll kColls[] = {Coll::AllReduce, Coll::AllReduceOut, Coll::Reduce, Coll::Broadcast,
                       Coll::AllGather, Coll::ReduceScatter, Coll::AllReduceOnce,
                       Coll::AllReduceOnceOut, Coll::ReduceOnce, Coll::ReduceScatterOnce};
bool once(Coll c) {
  return c == Coll::AllReduceOnce || c == Coll::AllReduceOnceOut || c == Coll::ReduceOnce ||
         c == Coll::ReduceScatterOnce;
}

// One rank's memory: an input, an output and a workspace, each big enough for N blocks.
struct Rank {
  Bytes in, out, work;
};

uint32_t mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  return uint32_t(x ^ (x >> 33));
}

// Fresh values for a rank's input: full-range int32, or finite float16 of moderate size.
void fill(Bytes& b, DType dtype, uint64_t seed) {
  const size_t n = b.size() / size_t(rr::elem_size(dtype));
  for (size_t i = 0; i < n; ++i) {
    const uint32_t v = mix(seed * 1000003u + i);
    if (dtype == DType::I32) {
      std::memcpy(&b[i * 4], &v, 4);
    } else {
      const uint16_t h = uint16_t((v & 0x83ffu) | (0x3400u + ((v >> 16) % 5u) * 0x400u));
      std::memcpy(&b[i * 2], &h, 2);
    }
  }
}

// The plan of one call over `ranks`' memory (inputs of `count` elements, or N blocks of it).
rr::Plan make_plan(Coll c, std::vector<Rank>& ranks, int64_t count, int root, int64_t esize) {
  const int n = int(ranks.size());
  std::vector<void*> in, out, work;
  for (Rank& r : ranks) {
    in.push_back(r.in.data());
    out.push_back(r.out.data());
    work.push_back(r.work.data());
  }
  std::vector<const void*> cin(in.begin(), in.end());
  switch (c) {
    case Coll::AllReduce: return rr::all_reduce_plan(cin.data(), in.data(), n, count, esize);
    case Coll::AllReduceOut: return rr::all_reduce_plan(cin.data(), out.data(), n, count, esize);
    case Coll::Reduce:
      return rr::reduce_plan(cin.data(), out[size_t(root)], work.data(), root, n, count, esize);
    case Coll::Broadcast: return rr::broadcast_plan(in.data(), root, n, count, esize);
    case Coll::AllGather: return rr::all_gather_plan(cin.data(), out.data(), n, count, esize);
    case Coll::ReduceScatter:
      return rr::reduce_scatter_plan(cin.data(), out.data(), work.data(), n, count, esize);
    default:
      break;
  }
  return {};
}

// A once-rounded collective over `ranks`' memory, in the aliasing each allows: all_reduce in
// place (out[r] = in[r]) or into out; reduce into the root's out, or in place at even roots;
// reduce_scatter into out, or in place (block r of in[r]) on even calls.
struct OnceBuffers {
  std::vector<const void*> in;
  std::vector<void*> out, work;
  rr::cuda::OnceCall call;
};
void once_call(Coll c, std::vector<Rank>& ranks, int64_t count, int root, int call,
               OnceBuffers* b) {
  const int n = int(ranks.size());
  const int64_t esize = 2;
  for (Rank& r : ranks) {
    b->in.push_back(r.in.data());
    b->work.push_back(r.work.data());
  }
  b->call.in = b->in.data();
  b->call.nranks = n;
  b->call.count = count;
  b->call.root = root;
  b->call.work = b->work.data();
  switch (c) {
    case Coll::AllReduceOnce:
    case Coll::AllReduceOnceOut:
      for (Rank& r : ranks) b->out.push_back(c == Coll::AllReduceOnce ? r.in.data() : r.out.data());
      b->call.kind = rr::cuda::OnceCall::AllReduce;
      break;
    case Coll::ReduceOnce:
      b->out.push_back(call % 2 == 0 ? ranks[size_t(root)].in.data()
                                     : ranks[size_t(root)].out.data());
      b->call.kind = rr::cuda::OnceCall::Reduce;
      break;
    default:
      for (int r = 0; r < n; ++r) {
        b->out.push_back(call % 2 == 0 ? ranks[size_t(r)].in.data() + r * count * esize
                                       : ranks[size_t(r)].out.data());
      }
      b->call.kind = rr::cuda::OnceCall::ReduceScatter;
      break;
  }
  b->call.out = b->out.data();
}

// The CPU's once-rounded bits of the same call.
void once_reference(std::vector<Rank>& ranks, int64_t count, int root, int call, Coll c,
                    DType dtype, Op op) {
  OnceBuffers b;
  once_call(c, ranks, count, root, call, &b);
  const int n = int(ranks.size());
  switch (b.call.kind) {
    case rr::cuda::OnceCall::AllReduce:
      rr::cpu::all_reduce_once(b.in.data(), b.out.data(), n, count, dtype, op);
      break;
    case rr::cuda::OnceCall::Reduce:
      rr::cpu::sum_rounded_once(dtype, op, b.out[0], b.in.data(), n, count);
      break;
    case rr::cuda::OnceCall::ReduceScatter:
      rr::cpu::reduce_scatter_once(b.in.data(), b.out.data(), n, count, dtype, op);
      break;
  }
}

// A staging allocator like a stream-ordered caching allocator: a lane's buffer is reused by
// the next call on that lane without any synchronisation, and replaced when too small. Buffers
// are 16-byte aligned, as the caching allocator's are, and noted with the fake, which counts
// staged reads the kernels could not take as 16-byte packs.
struct Stager {
  std::map<std::pair<int, cudaStream_t>, Bytes*> current;  // (device, stream): stream 0 is
                                                           // each device's own
  std::vector<Bytes*> all;
  ~Stager() {
    fake_forget_staging();
    for (Bytes* b : all) delete b;
  }
  static unsigned char* aligned(Bytes* b) {
    const uintptr_t p = reinterpret_cast<uintptr_t>(b->data());
    return b->data() + (16 - p % 16) % 16;
  }
  rr::cuda::StageAlloc alloc() {
    return [this](int device, cudaStream_t s, size_t bytes) -> void* {
      Bytes*& b = current[{device, s}];
      if (b == nullptr || b->size() < bytes + 16) {
        all.push_back(new Bytes(bytes + 16, 0xAB));
        b = all.back();
      }
      fake_note_staging(aligned(b), bytes);
      fake_note_memory(aligned(b), bytes, device);
      return aligned(b);
    };
  }
};

long g_peer_calls = 0;  // calls of the executor's peer_access callback

// The layout's peer access as the executor asks for it: a pair of devices is direct unless a
// rank on the first device has its predecessor on the second and is marked not direct.
rr::cuda::PeerAccess peer_access_of(const Layout& layout) {
  if (layout.direct.empty()) return {};
  return [layout](int device, int peer) {
    ++g_peer_calls;
    const int n = int(layout.rank_lane.size());
    for (int r = 0; r < n; ++r) {
      const int p = (r + n - 1) % n;
      if (layout.lane_device[size_t(layout.rank_lane[size_t(r)])] == device &&
          layout.lane_device[size_t(layout.rank_lane[size_t(p)])] == peer &&
          layout.direct[size_t(r)] == 0) {
        return false;
      }
    }
    return true;
  };
}

// Peer access as the bindings ask torch for it (at::cuda::get_p2p_access): yes when the pair
// can, after enabling it on the reading device. `liar`: a planted bug, yes for every pair (as a
// cached "allowed" whose enabling failed would say).
rr::cuda::PeerAccess torch_peer_access(bool liar) {
  return [liar](int device, int peer) {
    ++g_peer_calls;
    int can = 0;
    if (cudaDeviceCanAccessPeer(&can, device, peer) != cudaSuccess) return false;
    if (can) {
      rr::cuda::DeviceGuard guard(device);
      const cudaError_t err = cudaDeviceEnablePeerAccess(peer, 0);
      if (err != cudaSuccess && err != cudaErrorPeerAccessAlreadyEnabled) return false;
    }
    return can != 0 || liar;
  };
}

struct Scenario {
  Layout layout;
  int n = 2;
  Coll coll = Coll::AllReduce;
  bool copy = false;
  DType dtype = DType::I32;
  int calls = 4;
  FakePolicy policy = kFakeOldest;
  int prefer_lane = -1;
  unsigned seed = 0;
  long drop_wait = -1;
  // distinct_devices: each rank's memory noted as its device's; lanes on each device's default
  // stream (`default_streams`); peer access from torch_peer_access.
  bool device_memory = false;
  bool default_streams = false;
  bool liar = false;
  bool wrong_device = false;  // a planted bug: each lane's stream made on the next device
};

std::string describe(const Scenario& s) {
  static const char* policies[] = {"oldest", "newest", "prefer", "random"};
  std::string d = s.layout.name + " n=" + std::to_string(s.n) + " " + coll_name(s.coll) +
                  (s.copy ? " copy" : " p2p") + " " + rr::dtype_name(s.dtype) + " " +
                  policies[s.policy];
  if (s.policy == kFakePrefer) d += " lane " + std::to_string(s.prefer_lane);
  if (s.policy == kFakeRandom) d += " seed " + std::to_string(s.seed);
  if (s.drop_wait >= 0) d += " drop wait " + std::to_string(s.drop_wait);
  return d;
}

Op op_of(DType dtype, int call, Coll c) {
  if (once(c)) return call % 2 == 0 ? Op::Sum : Op::Avg;
  static const Op ints[] = {Op::Sum, Op::Max, Op::BXor, Op::Avg, Op::Min, Op::Prod};
  static const Op floats[] = {Op::Sum, Op::Max, Op::Avg, Op::Min};
  return dtype == DType::I32 ? ints[call % 6] : floats[call % 4];
}

int64_t count_of(int call) {
  static const int64_t counts[] = {kCapacity, 37, 1000, 1, 4096};
  return counts[call % 5];
}

// The user's own work on a rank's lane: before even calls, fresh inputs (so the ring must wait
// for them before reading); after every call, a change to the rank's input (so every
// neighbour must have finished reading it): fresh values where the call left it as a pure
// input, and a bit-exact change of the result where the call wrote it in place (the next call
// then starts from that).
void user_before(Rank& r, const Scenario& s, int call, int rank) {
  if (call % 2 == 0) fill(r.in, s.dtype, uint64_t(call) * 131 + uint64_t(rank) + 7);
}
void user_after(Rank& r, const Scenario& s, int call, int rank) {
  const bool in_place = s.coll == Coll::AllReduce || s.coll == Coll::Broadcast ||
                        s.coll == Coll::AllReduceOnce ||
                        ((s.coll == Coll::ReduceOnce || s.coll == Coll::ReduceScatterOnce) &&
                         call % 2 == 0);  // once_call's in-place calls
  if (!in_place) {
    fill(r.in, s.dtype, uint64_t(call) * 977 + uint64_t(rank) + 3);
    return;
  }
  const int64_t esize = rr::elem_size(s.dtype);
  for (size_t i = 0; i + size_t(esize) <= r.in.size(); i += size_t(esize)) {
    r.in[i + size_t(esize) - 1] ^= 0x80;  // the sign bit (little-endian)
  }
}

struct Outcome {
  bool ok = true;       // ran without an exception and drained
  bool match = true;    // bytes equal to the CPU executor's
  std::string error;
  std::string log;      // the fake's log of the last call
  std::string failed_log;  // the fake's log of the call that failed
  long failable = 0;    // failable calls of the last call
};

// Runs a scenario on the fake and on the CPU executor. `fail_call`: inject an error into that
// failable call of call number `fail_at` (which must then throw; the reference skips it).
Outcome run(const Scenario& s, long fail_call = -1, int fail_at = -1) {
  Outcome o;
  const int64_t esize = rr::elem_size(s.dtype);
  const size_t block = size_t(kCapacity * esize) * size_t(s.n);
  std::vector<Rank> dev(size_t(s.n)), ref(size_t(s.n));
  for (int r = 0; r < s.n; ++r) {
    for (std::vector<Rank>* side : {&dev, &ref}) {
      Rank& k = (*side)[size_t(r)];
      k.in.assign(block, 0);
      k.out.assign(block, 0);
      k.work.assign(block, 0);
      fill(k.in, s.dtype, uint64_t(r) + 1);
      fill(k.out, s.dtype, uint64_t(r) + 100);
      fill(k.work, s.dtype, uint64_t(r) + 200);
    }
  }
  std::vector<rr::cuda::Lane> lanes;
  std::vector<cudaStream_t> lane_stream;  // what fake_enqueue and the policy take
  for (int d : s.layout.lane_device) {
    lanes.push_back(rr::cuda::Lane{
        d, s.default_streams ? nullptr : fake_stream(s.wrong_device ? (d + 1) % kDevices : d)});
    rr::cuda::DeviceGuard on(d);
    lane_stream.push_back(fake_resolve(lanes.back().stream));
  }
  if (s.device_memory) {
    for (int r = 0; r < s.n; ++r) {
      const int d = s.layout.lane_device[size_t(s.layout.rank_lane[size_t(r)])];
      for (Bytes* b : {&dev[size_t(r)].in, &dev[size_t(r)].out, &dev[size_t(r)].work}) {
        fake_note_memory(b->data(), b->size(), d);
      }
    }
  }
  fake_set_policy(s.policy, s.prefer_lane >= 0 ? lane_stream[size_t(s.prefer_lane)] : nullptr,
                  s.seed);
  Stager stager;
  rr::cuda::RunOptions options;
  options.peer_access = s.device_memory ? torch_peer_access(s.liar) : peer_access_of(s.layout);
  options.force_copy = s.copy;
  options.alloc = stager.alloc();
  for (int call = 0; call < s.calls; ++call) {
    const int64_t count = count_of(call);
    const Op op = op_of(s.dtype, call, s.coll);
    const int root = call % s.n;
    for (int r = 0; r < s.n; ++r) {
      Rank* d = &dev[size_t(r)];
      fake_enqueue(lane_stream[size_t(s.layout.rank_lane[size_t(r)])],
                   [d, &s, call, r] { user_before(*d, s, call, r); });
      user_before(ref[size_t(r)], s, call, r);
    }
    fake_mark();
    const bool failing = call == fail_at;
    if (failing) fake_fail_call(fail_call);
    if (s.drop_wait >= 0) fake_drop_wait(s.drop_wait);
    try {
      if (once(s.coll)) {
        OnceBuffers b;
        once_call(s.coll, dev, count, root, call, &b);
        rr::cuda::run_once_rounded(b.call, s.layout.rank_lane.data(), lanes.data(),
                                   int(lanes.size()), s.dtype, op, options);
      } else {
        rr::cuda::run(make_plan(s.coll, dev, count, root, esize), s.layout.rank_lane.data(),
                      s.n, lanes.data(), int(lanes.size()), s.dtype, op, options);
      }
      if (failing) {
        o.ok = false;
        o.error = "no exception from an injected error";
      }
    } catch (const std::exception& e) {
      if (!failing) {
        o.ok = false;
        o.error = e.what();
      } else if (std::string(e.what()).find("ringreduce") == std::string::npos) {
        o.ok = false;
        o.error = std::string("an error that does not name ringreduce: ") + e.what();
      }
    }
    fake_fail_call(-1);
    fake_drop_wait(-1);
    o.log = fake_log();
    if (failing) o.failed_log = o.log;
    o.failable = fake_failable_calls();
    if (!o.ok) break;
    if (!failing && once(s.coll)) {
      once_reference(ref, count, root, call, s.coll, s.dtype, op);
    } else if (!failing) {
      rr::cpu::run(make_plan(s.coll, ref, count, root, esize), s.dtype, op, s.n);
    }
    for (int r = 0; r < s.n; ++r) {
      Rank* d = &dev[size_t(r)];
      fake_enqueue(lane_stream[size_t(s.layout.rank_lane[size_t(r)])],
                   [d, &s, call, r] { user_after(*d, s, call, r); });
      user_after(ref[size_t(r)], s, call, r);
    }
    if (failing) {
      // The failed call left partial results: start again from fresh data everywhere.
      for (int r = 0; r < s.n; ++r) {
        Rank* d = &dev[size_t(r)];
        fake_enqueue(lane_stream[size_t(s.layout.rank_lane[size_t(r)])], [d, &s, r] {
          fill(d->in, s.dtype, uint64_t(r) + 50);
          fill(d->out, s.dtype, uint64_t(r) + 60);
        });
        fill(ref[size_t(r)].in, s.dtype, uint64_t(r) + 50);
        fill(ref[size_t(r)].out, s.dtype, uint64_t(r) + 60);
      }
    }
  }
  if (!fake_drain()) {
    o.ok = false;
    o.error = "the queued work deadlocks";
  }
  fake_release_streams();
  fake_forget_memory();
  if (!o.ok) return o;
  for (int r = 0; r < s.n; ++r) {
    o.match = o.match && dev[size_t(r)].in == ref[size_t(r)].in &&
              dev[size_t(r)].out == ref[size_t(r)].out;
  }
  return o;
}

std::vector<Scenario> schedules(const Scenario& base) {
  std::vector<Scenario> out;
  for (FakePolicy p : {kFakeOldest, kFakeNewest}) {
    Scenario s = base;
    s.policy = p;
    out.push_back(s);
  }
  for (int l = 0; l < int(base.layout.lane_device.size()); ++l) {
    Scenario s = base;
    s.policy = kFakePrefer;
    s.prefer_lane = l;
    out.push_back(s);
  }
  for (unsigned seed = 1; seed <= 2; ++seed) {
    Scenario s = base;
    s.policy = kFakeRandom;
    s.seed = seed;
    out.push_back(s);
  }
  return out;
}

// Five calls of every collective, transport and dtype (float16 where it reduces) on `layout`.
std::vector<Scenario> collectives(const Layout& layout, int n) {
  std::vector<Scenario> out;
  for (Coll c : kColls) {
    for (bool copy : {false, true}) {
      for (DType dtype : {DType::I32, DType::F16, DType::BF16}) {
        // The once-rounded all-reduce: 16-bit floats only; the others: int32, and float16
        // where they reduce.
        const bool takes = once(c) ? dtype != DType::I32
                                   : dtype == DType::I32 ||
                                         (dtype == DType::F16 && c != Coll::Broadcast &&
                                          c != Coll::AllGather);
        if (!takes) continue;
        Scenario base;
        base.layout = layout;
        base.n = n;
        base.coll = c;
        base.copy = copy;
        base.dtype = dtype;
        base.calls = 5;
        out.push_back(base);
      }
    }
  }
  return out;
}

int matrix() {
  long cases = 0, bad = 0;
  for (int n : {2, 3, 4, 5}) {
    for (const Layout& layout : layouts(n)) {
      for (const Scenario& base : collectives(layout, n)) {
        for (const Scenario& s : schedules(base)) {
          const Outcome o = run(s);
          ++cases;
          if (!o.ok || !o.match) {
            ++bad;
            std::printf("FAIL %s: %s\n", describe(s).c_str(),
                        o.ok ? "bytes differ from the CPU executor" : o.error.c_str());
          }
        }
      }
    }
  }
  const long stale = fake_stale_waits();
  const long misaligned = fake_misaligned_staged_reads();
  std::printf("matrix: %ld cases, %ld wrong, %ld stale waits, %ld misaligned staged reads\n",
              cases, bad, stale, misaligned);
  return bad == 0 && stale == 0 && misaligned == 0 && cases > 0 ? 0 : 1;
}

// Whether a failed call queued nothing, or ended by joining its lanes: a record on every lane,
// then each lane's waits on the others.
bool joined(const std::string& log, int nlanes) {
  if (log.empty()) return true;
  const std::string join =
      std::string(size_t(nlanes), 'R') + std::string(size_t(nlanes * (nlanes - 1)), 'W');
  return log.size() >= join.size() &&
         log.compare(log.size() - join.size(), std::string::npos, join) == 0;
}

int failures() {
  long cases = 0, bad = 0;
  for (int n : {2, 3, 4}) {
    for (const Layout& layout : layouts(n)) {
      for (Coll c : {Coll::AllReduce, Coll::ReduceScatter, Coll::Reduce, Coll::AllReduceOnce,
                     Coll::ReduceOnce, Coll::ReduceScatterOnce}) {
        for (bool copy : {false, true}) {
          Scenario s;
          s.layout = layout;
          s.n = n;
          s.coll = c;
          s.dtype = once(c) ? DType::F16 : DType::I32;
          s.copy = copy;
          s.calls = 3;
          // How many failable calls the middle call makes.
          const Outcome clean = run(s);
          if (!clean.ok || !clean.match) {
            std::printf("FAIL %s: the run without errors is wrong\n", describe(s).c_str());
            ++bad;
            continue;
          }
          Scenario probe = s;
          probe.calls = 2;
          const long total = run(probe).failable;
          const int nlanes = int(layout.lane_device.size());
          for (long k = 0; k < total; ++k) {
            for (FakePolicy p : {kFakeOldest, kFakeNewest}) {
              Scenario f = s;
              f.policy = p;
              const long stale_before = fake_stale_waits();
              const Outcome o = run(f, k, 1);
              ++cases;
              std::string why;
              if (!o.ok) why = o.error;
              else if (!o.match) why = "the calls after the failed one are wrong";
              else if (fake_stale_waits() != stale_before) why = "a wait on a stale record";
              else if (nlanes > 1 && !joined(o.failed_log, nlanes))
                why = "the lanes were not joined after the error (log " + o.failed_log + ")";
              if (!why.empty()) {
                ++bad;
                std::printf("FAIL %s, error in failable call %ld of %ld: %s\n",
                            describe(f).c_str(), k, total, why.c_str());
              }
            }
          }
        }
      }
    }
  }
  std::printf("failures: %ld cases, %ld wrong\n", cases, bad);
  return bad == 0 && cases > 0 ? 0 : 1;
}

// Leaves every lane's stream neither capturing nor failing the capture query.
void stop_capture(const std::vector<rr::cuda::Lane>& lanes) {
  for (const auto& l : lanes) {
    fake_set_capturing(l.stream, false);
    fake_set_capture_implicit(l.stream, false);
  }
}

// Runs one all-reduce on `layout` with every lane capturing (or, `implicit`, with lane 0's
// stream failing the capture query as the legacy stream does while another stream captures);
// returns the exception's message and, in *log and *peer_calls, what it queued and how often it
// asked for peer access.
// `twoshot`: the once-rounded all-reduce of bfloat16 values instead of the ring.
std::string captured_call(const Layout& layout, int n, bool copy, bool implicit, std::string* log,
                          long* peer_calls, bool twoshot) {
  std::vector<Rank> dev(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    dev[size_t(r)].in.assign(size_t(kCapacity) * 4, 0);
    fill(dev[size_t(r)].in, twoshot ? DType::BF16 : DType::I32, uint64_t(r));
  }
  std::vector<rr::cuda::Lane> lanes;
  for (int d : layout.lane_device) lanes.push_back(rr::cuda::Lane{d, fake_stream(d)});
  for (const auto& l : lanes) fake_set_capturing(l.stream, !implicit);
  if (implicit) fake_set_capture_implicit(lanes[0].stream, true);
  Stager stager;
  rr::cuda::RunOptions options;
  options.peer_access = peer_access_of(layout);
  options.force_copy = copy;
  options.alloc = stager.alloc();
  fake_mark();
  const long peer_before = g_peer_calls;
  std::string error;
  try {
    if (twoshot) {
      OnceBuffers b;
      once_call(Coll::AllReduceOnce, dev, kCapacity, 0, 0, &b);
      rr::cuda::run_once_rounded(b.call, layout.rank_lane.data(), lanes.data(),
                                 int(lanes.size()), DType::BF16, Op::Sum, options);
    } else {
      rr::cuda::run(make_plan(Coll::AllReduce, dev, kCapacity, 0, 4), layout.rank_lane.data(),
                    n, lanes.data(), int(lanes.size()), DType::I32, Op::Sum, options);
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  *log = fake_log();
  *peer_calls = g_peer_calls - peer_before;
  stop_capture(lanes);
  fake_drain();
  fake_release_streams();
  return error;
}

int capture() {
  long refused = 0, captured = 0, bad = 0;
  for (int n : {2, 3, 4}) {
    for (Layout layout : layouts(n)) {
      // Every layout with a pair of devices without peer access, so that a peer-access query
      // made under capture would be seen.
      if (layout.lane_device.size() > 1 && layout.direct.empty()) {
        layout.direct.assign(size_t(n), 1);
        layout.direct[0] = 0;
      }
      for (int variant = 0; variant < 4; ++variant) {
        const bool copy = variant & 1, implicit = variant & 2;
        for (bool twoshot : {false, true}) {
          const bool ok_to_capture = !implicit && layout.lane_device.size() == 1 && !copy;
          std::string log;
          long peer_calls = 0;
          const std::string error =
              captured_call(layout, n, copy, implicit, &log, &peer_calls, twoshot);
          const bool said = error.find("cannot be captured") != std::string::npos &&
                            (!implicit || error.find("legacy default stream") != std::string::npos);
          const std::string mode =
              std::string(implicit ? "implicit" : "capturing") + (twoshot ? " twoshot" : "");
          if (peer_calls != 0) {
            ++bad;
            std::printf("FAIL %s n=%d %s %s: peer access asked for %ld times under capture\n",
                        layout.name.c_str(), n, copy ? "copy" : "p2p", mode.c_str(), peer_calls);
          }
          if (ok_to_capture) {
            if (!error.empty() || log.find_first_not_of('L') != std::string::npos) {
              ++bad;
              std::printf("FAIL capture of %s n=%d%s: error '%s', log %s\n",
                          layout.name.c_str(), n, twoshot ? " twoshot" : "", error.c_str(),
                          log.c_str());
            }
            ++captured;
          } else {
            if (!said || !log.empty()) {
              ++bad;
              std::printf("FAIL %s n=%d %s %s: error '%s', queued '%s'\n", layout.name.c_str(),
                          n, copy ? "copy" : "p2p", mode.c_str(), error.c_str(), log.c_str());
            }
            ++refused;
          }
          // Eager calls afterwards are unaffected.
          Scenario s;
          s.layout = layout;
          s.n = n;
          s.copy = copy;
          s.calls = 2;
          if (twoshot) {
            s.coll = Coll::AllReduceOnce;
            s.dtype = DType::BF16;
          }
          const Outcome o = run(s);
          if (!o.ok || !o.match) {
            ++bad;
            std::printf("FAIL %s: eager calls after a refused capture\n", describe(s).c_str());
          }
        }
      }
    }
  }
  // check_capture, which the bindings' one-shot path calls before launching on its one lane.
  for (int nlanes : {1, 2}) {
    for (int mode = 0; mode < 3; ++mode) {  // not capturing, capturing, implicit (lane 0)
      std::vector<rr::cuda::Lane> lanes;
      for (int l = 0; l < nlanes; ++l) lanes.push_back(rr::cuda::Lane{0, fake_stream(0)});
      for (const auto& l : lanes) fake_set_capturing(l.stream, mode == 1);
      if (mode == 2) fake_set_capture_implicit(lanes[0].stream, true);
      std::string error;
      bool capturing = false;
      try {
        capturing = rr::cuda::check_capture(lanes.data(), nlanes);
      } catch (const std::exception& e) {
        error = e.what();
      }
      stop_capture(lanes);
      fake_release_streams();
      const bool refuse = mode == 2 || (mode == 1 && nlanes > 1);
      const bool ok = refuse ? error.find("cannot be captured") != std::string::npos
                             : error.empty() && capturing == (mode == 1);
      if (!ok) {
        ++bad;
        std::printf("FAIL check_capture on %d lanes, mode %d: capturing=%d error '%s'\n",
                    nlanes, mode, int(capturing), error.c_str());
      }
    }
  }
  std::printf("capture: %ld captured, %ld refused, %ld wrong\n", captured, refused, bad);
  return bad == 0 && refused > 0 && captured > 0 ? 0 : 1;
}

int dropwait() {
  long bad = 0;
  for (int n : {3, 4}) {
    for (const Layout& layout : layouts(n)) {
      if (layout.lane_device.size() < 2) continue;
      for (Coll c : {Coll::AllReduce, Coll::AllGather, Coll::AllReduceOnce, Coll::ReduceOnce}) {
        Scenario s;
        s.layout = layout;
        s.n = n;
        s.coll = c;
        s.dtype = once(c) ? DType::BF16 : DType::I32;
        s.calls = 1;
        const Outcome clean = run(s);
        const std::string& log = clean.log;
        const size_t first_l = log.find('L'), last_l = log.rfind('L');
        long step_waits = 0, step_caught = 0, other_waits = 0, other_caught = 0, index = 0;
        for (size_t pos = 0; pos < log.size(); ++pos) {
          if (log[pos] != 'W') continue;
          const bool step = pos > first_l && pos < last_l;
          bool caught = false;
          Scenario d = s;
          d.drop_wait = index++;
          for (const Scenario& v : schedules(d)) {
            const Outcome o = run(v);
            caught = caught || !o.ok || !o.match;
          }
          (step ? step_waits : other_waits) += 1;
          (step ? step_caught : other_caught) += caught ? 1 : 0;
          if (step && !caught) {
            ++bad;
            std::printf("FAIL %s: dropping per-step wait %ld changes nothing\n",
                        describe(s).c_str(), index - 1);
          }
        }
        std::printf("dropwait %s n=%d %s: per-step waits %ld caught %ld; barrier waits %ld "
                    "caught %ld\n", layout.name.c_str(), n, coll_name(c), step_waits,
                    step_caught, other_waits, other_caught);
        // Most barrier waits are implied by others; those between ring neighbours are not.
        if (other_caught == 0) {
          ++bad;
          std::printf("FAIL %s: no barrier wait is needed?\n", describe(s).c_str());
        }
        if (step_waits == 0) {
          ++bad;
          std::printf("FAIL %s: no per-step waits found in log %s\n", describe(s).c_str(),
                      log.c_str());
        }
      }
    }
  }
  std::printf("dropwait: %ld wrong\n", bad);
  return bad == 0 ? 0 : 1;
}

// Devices 1 and 2 refuse peer access (set up by main before this runs).
constexpr int kRefusedA = 1, kRefusedB = 2;

Layout distinct_layout(int n, bool reversed) {
  Layout l{reversed ? "distinct_devices reversed" : "distinct_devices", {}, {}, {}};
  for (int r = 0; r < n; ++r) {
    l.lane_device.push_back(reversed ? n - 1 - r : r);
    l.rank_lane.push_back(r);
  }
  return l;
}

bool refused_pair(int a, int b) {
  return (a == kRefusedA && b == kRefusedB) || (a == kRefusedB && b == kRefusedA);
}

int distinct_devices() {
  long cases = 0, bad = 0, staged_refused = 0;
  for (int n : {2, 3, 4, 5}) {
    for (bool reversed : {false, true}) {
      const Layout layout = distinct_layout(n, reversed);
      for (Scenario base : collectives(layout, n)) {
        for (bool default_streams : {false, true}) {
          if (default_streams && base.dtype == DType::F16) continue;
          base.device_memory = true;
          base.default_streams = default_streams;
          for (const Scenario& sc : schedules(base)) {
            std::map<std::pair<int, int>, long> before;
            for (int a = 0; a < n; ++a)
              for (int b = 0; b < n; ++b) before[{a, b}] = fake_peer_copies(a, b);
            const long violations = fake_device_violations();
            const Outcome o = run(sc);
            ++cases;
            std::string why;
            if (!o.ok) why = o.error;
            else if (!o.match) why = "bytes differ from the CPU executor";
            std::string first;
            if (fake_device_violations(&first) != violations) why = first;
            // p2p: exactly the hops between the refused devices are staged.
            for (int r = 0; r < n && why.empty() && !sc.copy; ++r) {
              const int d = layout.lane_device[size_t(r)];
              const int pd = layout.lane_device[size_t((r + n - 1) % n)];
              const long copies = fake_peer_copies(d, pd) - before[{d, pd}];
              if (refused_pair(d, pd) != (copies > 0)) {
                why = "rank " + std::to_string(r) + " (cuda:" + std::to_string(d) + ") <- cuda:" +
                      std::to_string(pd) + ": " + std::to_string(copies) + " staged copies";
              }
              staged_refused += refused_pair(d, pd) ? copies : 0;
            }
            if (!why.empty()) {
              ++bad;
              std::printf("FAIL %s%s: %s\n", describe(sc).c_str(),
                          default_streams ? " default streams" : "", why.c_str());
            }
          }
        }
      }
    }
  }
  // Planted bugs, which must be seen: a peer-access answer of yes without access enabled (the
  // refused pair's reads are then counted), and lanes whose streams belong to other devices.
  Scenario liar;
  liar.layout = distinct_layout(3, false);
  liar.n = 3;
  liar.calls = 2;
  liar.device_memory = true;
  liar.liar = true;
  const long violations = fake_device_violations();
  run(liar);
  const long liar_reads = fake_device_violations() - violations;
  Scenario wrong = liar;
  wrong.liar = false;
  wrong.wrong_device = true;
  const Outcome w = run(wrong);
  const bool wrong_caught = !w.ok && w.error.find("cudaErrorInvalidResourceHandle") !=
                                         std::string::npos;
  std::printf("wrong device: %s\n", w.error.c_str());
  std::printf("distinct_devices: %ld cases, %ld wrong, %ld staged refused hops; planted: %ld "
              "unenabled peer accesses, wrong device caught %d\n", cases, bad, staged_refused,
              liar_reads, int(wrong_caught));
  return bad == 0 && cases > 0 && staged_refused > 0 && liar_reads > 0 && wrong_caught ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  fake_init(kDevices);
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "matrix") return matrix();
  if (mode == "failures") return failures();
  if (mode == "capture") return capture();
  if (mode == "dropwait") return dropwait();
  if (mode == "distinct_devices") {
    fake_refuse_peer(kRefusedA, kRefusedB);
    return distinct_devices();
  }
  std::fprintf(stderr, "usage: lanes_driver matrix|failures|capture|dropwait|distinct_devices\n");
  return 2;
}
