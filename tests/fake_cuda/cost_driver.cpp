// The host's cost of one list-API collective on the CUDA executor (tests/test_cuda_host_cost.py):
// csrc/ring/cuda_executor.cu, cuda_kernels.cu and oneshot_kernel.cu compiled by the host
// compiler and run on the fake runtime of fake_lanes.h, whose cudaLaunchKernel runs the real
// kernels' host-compiled bodies. Per path, for the first call and for a later one (the steady
// state, after every cache is warm): the CUDA runtime calls by name, the kernel launches, the
// bytes of their parameters, and the heap allocations the executor made (the fake's own and
// this driver's are not counted). Every call's bytes are checked against the CPU executor.
//
//   cost_driver          one line per path and call:
//                        cost PATH call=K launches=L param_bytes=B allocations=A calls=NAME:C,...
//                        then "cost: N wrong" (exit 1 if any)
//   cost_driver PATH K   K calls on PATH only, printing nothing but the summary: for
//                        valgrind --tool=callgrind --toggle-collect (bench/RESULTS.md)
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <vector>

#include "fake_lanes.h"
#include "ring/cpu_executor.h"
#include "ring/cuda_executor.h"
#include "ring/oneshot_cuda.h"
#include "ring/plan.h"

namespace {

bool g_counting = false;
thread_local int g_driver = 0;  // > 0 inside this driver's own callbacks
long g_allocations = 0;

void* counted(size_t bytes) {
  if (g_counting && g_driver == 0 && !fake_inside()) ++g_allocations;
  void* p = std::malloc(bytes == 0 ? 1 : bytes);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}

}  // namespace

void* operator new(size_t bytes) { return counted(bytes); }
void* operator new[](size_t bytes) { return counted(bytes); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
void operator delete[](void* p, size_t) noexcept { std::free(p); }

namespace {

using rr::DType;
using rr::Op;

constexpr int kDevices = 4;
constexpr int kRanks = 4;
constexpr int kManyRanks = 12;  // more tasks on one lane than one step kernel takes (8)
constexpr int64_t kCount = 1000;  // int32 elements a rank: 4000 bytes, uneven ring chunks

struct Driver {
  explicit Driver() { ++g_driver; }
  ~Driver() { --g_driver; }
};

enum class Path { Oneshot, OneshotOnce, Ring, RingMany, RingVirtual, RingDevices, Staged,
                  CaptureOneshot, CaptureRing, Twoshot };

struct Setup {
  const char* name;
  Path path;
  std::vector<int> lane_device;  // per lane
  std::vector<int> rank_lane;    // per rank
  bool copy = false;
  bool capture = false;
};

std::vector<Setup> setups() {
  const std::vector<int> one(kRanks, 0), each = {0, 1, 2, 3}, many(kManyRanks, 0);
  return {
      {"oneshot", Path::Oneshot, {0}, one},
      {"oneshot_once", Path::OneshotOnce, {0}, one},
      {"ring", Path::Ring, {0}, one},
      {"ring_12_ranks", Path::RingMany, {0}, many},
      {"ring_virtual", Path::RingVirtual, {0, 0, 0, 0}, each},
      {"ring_devices", Path::RingDevices, {0, 1, 2, 3}, each},
      {"staged", Path::Staged, {0}, one, true},
      {"capture_oneshot", Path::CaptureOneshot, {0}, one, false, true},
      {"capture_ring", Path::CaptureRing, {0}, one, false, true},
      // The once-rounded all-reduce (run_once_rounded: the two-shot), bfloat16 sums as oneshot_once.
      {"twoshot_devices", Path::Twoshot, {0, 1, 2, 3}, each},
      {"twoshot_virtual", Path::Twoshot, {0, 0, 0, 0}, each},
      {"twoshot_staged", Path::Twoshot, {0}, one, true},
  };
}

bool bf16(Path p) { return p == Path::OneshotOnce || p == Path::Twoshot; }

bool oneshot(Path p) { return p == Path::Oneshot || p == Path::CaptureOneshot; }

void fill(std::vector<int32_t>& v, int rank, int call) {
  for (size_t i = 0; i < v.size(); ++i) v[i] = int32_t(i * 7 + size_t(rank) * 1000 + call * 13);
}

// The oneshot_once path reads each int32 as two bfloat16 values: finite ones of either sign
// between 2^-8 and 2^9 or so, whose fp32 sums round.
void fill_bf16(std::vector<int32_t>& v, int rank, int call) {
  for (size_t i = 0; i < v.size(); ++i) {
    const size_t k = size_t(rank), c = size_t(call);
    const uint32_t lo = 0x3B80u + uint32_t(i * 37 + k * 101 + c * 13) % 0x0900u;
    const uint32_t hi = 0xBB80u + uint32_t(i * 53 + k * 71 + c * 29) % 0x0900u;
    v[i] = int32_t(lo | (hi << 16));
  }
}

std::string format(const FakeCounts& c, long allocations) {
  std::string s = "launches=" + std::to_string(c.launches) +
                  " param_bytes=" + std::to_string(c.param_bytes) +
                  " allocations=" + std::to_string(allocations) + " calls=";
  bool first = true;
  for (const auto& kv : c.calls) {
    s += (first ? "" : ",") + kv.first + ":" + std::to_string(kv.second);
    first = false;
  }
  return s;
}

// Three calls on `setup`; prints the counts of the first and the third. Returns the number of
// calls whose bytes differ from the CPU executor's.
int run(const Setup& setup, int calls, bool print) {
  const int nranks = int(setup.rank_lane.size());
  std::vector<std::vector<int32_t>> dev(static_cast<size_t>(nranks),
                                        std::vector<int32_t>(static_cast<size_t>(kCount)));
  std::vector<std::vector<int32_t>> ref = dev;
  std::vector<rr::cuda::Lane> lanes;
  for (int d : setup.lane_device) {
    cudaSetDevice(d);
    lanes.push_back(rr::cuda::Lane{d, fake_stream(d)});
  }
  cudaSetDevice(setup.lane_device[0]);  // the bindings make rank 0's device current
  if (setup.capture) fake_set_capturing(lanes[0].stream, true);
  std::vector<unsigned char> stage;
  rr::cuda::RunOptions options;
  options.force_copy = setup.copy;
  options.current_device = setup.lane_device[0];
  options.alloc = [&stage](int device, cudaStream_t, size_t bytes) -> void* {
    Driver own;
    if (stage.size() < bytes + 16) stage.assign(bytes + 16, 0);
    unsigned char* p = stage.data() + (16 - reinterpret_cast<uintptr_t>(stage.data()) % 16) % 16;
    fake_note_staging(p, bytes);
    fake_note_memory(p, bytes, device);
    return p;
  };
  int wrong = 0;
  for (int call = 0; call < calls; ++call) {
    std::vector<void*> ptrs;
    std::vector<const void*> cptrs;
    for (int r = 0; r < nranks; ++r) {
      if (bf16(setup.path)) {
        fill_bf16(dev[size_t(r)], r, call);
        fill_bf16(ref[size_t(r)], r, call);
      } else {
        fill(dev[size_t(r)], r, call);
        fill(ref[size_t(r)], r, call);
      }
      ptrs.push_back(dev[size_t(r)].data());
      cptrs.push_back(dev[size_t(r)].data());
    }
    const rr::Plan plan = rr::all_reduce_plan(cptrs.data(), ptrs.data(), nranks, kCount, 4);
    fake_mark();
    g_allocations = 0;
    g_counting = true;
    if (oneshot(setup.path)) {
      rr::cuda::run_oneshot(lanes[0], cptrs.data(), ptrs.data(), nranks, kCount, DType::I32,
                            Op::Sum);
    } else if (setup.path == Path::OneshotOnce) {
      rr::cuda::run_oneshot(lanes[0], cptrs.data(), ptrs.data(), nranks, 2 * kCount,
                            DType::BF16, Op::Sum, true);
    } else if (setup.path == Path::Twoshot) {
      rr::cuda::OnceCall once;
      once.in = cptrs.data();
      once.out = ptrs.data();
      once.nranks = nranks;
      once.count = 2 * kCount;
      rr::cuda::run_once_rounded(once, setup.rank_lane.data(), lanes.data(), int(lanes.size()),
                                 DType::BF16, Op::Sum, options);
    } else {
      rr::cuda::run(plan, setup.rank_lane.data(), nranks, lanes.data(), int(lanes.size()),
                    DType::I32, Op::Sum, options);
    }
    g_counting = false;
    const FakeCounts counts = fake_counts();
    if (print && call != 1) {
      std::printf("cost %s call=%d %s\n", setup.name, call, format(counts, g_allocations).c_str());
    }
    if (!fake_drain()) ++wrong;
    std::vector<void*> refs;
    for (auto& v : ref) refs.push_back(v.data());
    if (bf16(setup.path)) {
      rr::cpu::all_reduce_once(refs.data(), refs.data(), nranks, 2 * kCount, DType::BF16,
                               Op::Sum);
    } else {
      rr::cpu::all_reduce(refs.data(), nranks, kCount, DType::I32, Op::Sum);
    }
    if (dev != ref) {
      std::printf("wrong: %s call %d\n", setup.name, call);
      ++wrong;
    }
  }
  if (setup.capture) fake_set_capturing(lanes[0].stream, false);
  fake_release_streams();
  fake_forget_memory();
  fake_forget_staging();
  return wrong;
}

}  // namespace

int main(int argc, char** argv) {
  fake_init(kDevices);
  int wrong = 0;
  for (const Setup& s : setups()) {
    if (argc == 3 && std::string(argv[1]) != s.name) continue;
    wrong += argc == 3 ? run(s, std::atoi(argv[2]), false) : run(s, 3, true);
  }
  std::printf("cost: %d wrong\n", wrong);
  return wrong == 0 ? 0 : 1;
}
