// Runs the ring-step kernel's per-thread body (csrc/ring/step.h) on the host for every thread of
// simulated grids, against the CPU executor's combine (tests/test_step_kernel.py). For one dtype
// per run: every supported op x reduce/last/copy x in place or not x each of dst/own/src 16-byte
// aligned or one element off x sizes around the 16-byte packs x grids of 1, 3, 64, 1000 threads x
// 1 or 4 packs in flight per thread (RINGREDUCE_CUDA_STEP_UNROLL).
// Prints "op=NAME cases=N mismatches=M" per op; exits 1 on any mismatch.
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "ring/cpu_executor.h"
#include "ring/step.h"

namespace {

using rr::DType;
using rr::Op;

template <typename T, Op op, int U>
void run_grid_unrolled(const rr::Task& t, bool reduce, bool last, int nranks, int64_t threads) {
  for (int64_t i = 0; i < threads; ++i) {
    if (!reduce) rr::step_thread<T, op, false, false, U>(t, nranks, i, threads);
    else if (last) rr::step_thread<T, op, true, true, U>(t, nranks, i, threads);
    else rr::step_thread<T, op, true, false, U>(t, nranks, i, threads);
  }
}

// Every thread of the grid, with `unroll` packs in flight per thread (the kernels' 1 and 4).
template <typename T, Op op>
void run_grid(const rr::Task& t, bool reduce, bool last, int nranks, int64_t threads,
              int unroll) {
  if (unroll == 4) run_grid_unrolled<T, op, 4>(t, reduce, last, nranks, threads);
  else run_grid_unrolled<T, op, 1>(t, reduce, last, nranks, threads);
}

// Whether element i of two buffers of `dtype` are both NaN (a sum, average or product of two
// NaNs may carry either one's payload, depending on how the compiler ordered the operands).
bool both_nan(DType dtype, const unsigned char* a, const unsigned char* b) {
  auto nan = [dtype](const unsigned char* p) {
    switch (dtype) {
      case DType::F32: { float f; std::memcpy(&f, p, 4); return f != f; }
      case DType::F64: { double f; std::memcpy(&f, p, 8); return f != f; }
      case DType::F16: { rr::half_bits h; std::memcpy(&h, p, 2); float f = rr::to_float(h); return f != f; }
      case DType::BF16: { rr::bf16_bits h; std::memcpy(&h, p, 2); float f = rr::to_float(h); return f != f; }
      default: return false;
    }
  };
  return nan(a) && nan(b);
}

struct Buffer {
  std::vector<unsigned char> bytes;
  unsigned char* at(int64_t offset_elems, int64_t esize) {
    // 16-byte aligned base inside the vector, then the offset.
    uintptr_t p = reinterpret_cast<uintptr_t>(bytes.data());
    p = (p + 15) & ~uintptr_t(15);
    return reinterpret_cast<unsigned char*>(p) + offset_elems * esize;
  }
};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: step_driver DTYPE\n");
    return 2;
  }
  const std::string name = argv[1];
  DType dtype = DType::F32;
  bool found = false;
  for (int d = 0; d <= int(DType::Bool); ++d) {
    if (name == rr::dtype_name(DType(d))) {
      dtype = DType(d);
      found = true;
    }
  }
  if (!found) {
    std::fprintf(stderr, "unknown dtype %s\n", name.c_str());
    return 2;
  }
  const int64_t esize = rr::elem_size(dtype);
  std::mt19937_64 rng(12345);
  long total_bad = 0;
  for (int o = 0; o <= int(Op::BXor); ++o) {
    const Op op = Op(o);
    if (!rr::op_supported(op, dtype)) continue;
    long cases = 0, bad = 0;
    for (int unroll : {1, 4}) {
      for (int64_t n : {0, 1, 2, 3, 7, 8, 15, 16, 17, 31, 33, 64, 100, 257, 1000, 4099}) {
        for (int kind = 0; kind < 3; ++kind) {  // copy, reduce, last reduce
          const bool reduce = kind > 0, last = kind == 2;
          for (int in_place = 0; in_place < 2; ++in_place) {
            for (int offsets = 0; offsets < 8; ++offsets) {
              for (int64_t threads : {1, 3, 64, 1000}) {
                Buffer dst, own, src;
                for (Buffer* b : {&dst, &own, &src}) {
                  b->bytes.resize(size_t((n + 8) * esize + 32));
                  for (auto& c : b->bytes) c = static_cast<unsigned char>(rng());
                  if (dtype == DType::Bool) {
                    for (auto& c : b->bytes) c &= 1;
                  }
                }
                const int64_t od = offsets & 1, oo = (offsets >> 1) & 1, os = (offsets >> 2) & 1;
                unsigned char* d = dst.at(od, esize);
                unsigned char* w = in_place ? d : own.at(oo, esize);
                const unsigned char* s = src.at(os, esize);
                // The expected bytes of dst's whole buffer.
                std::vector<unsigned char> want = dst.bytes;
                unsigned char* wd = want.data() + (d - dst.bytes.data());
                const unsigned char* ww = in_place ? wd : w;
                if (n > 0) {
                  if (reduce) {
                    rr::cpu::combine(dtype, op, wd, ww, s, n, last, 5);
                  } else {
                    std::memcpy(wd, s, size_t(n * esize));
                  }
                }
                rr::Task t{d, s, n, in_place ? nullptr : w};
                RR_DISPATCH(dtype, op, run_grid<T, kOp>(t, reduce, last, 5, threads, unroll));
                ++cases;
                // Outside the n elements nothing may change; inside, NaN payloads may differ.
                const size_t lo = size_t(d - dst.bytes.data()), hi = lo + size_t(n * esize);
                bool same = std::memcmp(want.data(), dst.bytes.data(), lo) == 0 &&
                            std::memcmp(&want[hi], &dst.bytes[hi], want.size() - hi) == 0;
                for (size_t i = lo; i < hi; i += size_t(esize)) {
                  if (std::memcmp(&want[i], &dst.bytes[i], size_t(esize)) != 0 &&
                      !(op != Op::Max && op != Op::Min && both_nan(dtype, &want[i], &dst.bytes[i])))
                    same = false;
                }
                if (!same) {
                  ++bad;
                  if (bad <= 3) {
                    std::printf("MISMATCH op=%s unroll=%d n=%lld kind=%d in_place=%d offsets=%d "
                                "threads=%lld\n", rr::op_name(op), unroll, (long long)n, kind,
                                in_place, offsets, (long long)threads);
                  }
                }
              }
            }
          }
        }
      }
    }
    std::printf("op=%s cases=%ld mismatches=%ld\n", rr::op_name(op), cases, bad);
    total_bad += bad;
  }
  return total_bad == 0 ? 0 : 1;
}
