// Checks the one-shot all-reduce (csrc/ring/oneshot.h) byte for byte against the ring
// (rr::cpu::all_reduce) for one dtype, every op it supports, rank counts 1..9, 16, 64 and odd
// sizes, in place and out of place. Two one-shot paths are checked:
//   - rr::cpu::all_reduce_oneshot;
//   - the CUDA kernel's per-thread body (rr::oneshot_thread) run serially for every thread of
//     a simulated grid, on 16-byte aligned buffers (the pack path), on buffers one element
//     off (the element path) and on a mix of both (packs, lane by lane for the ranks that are
//     off), with arguments from make_oneshot_args as launch_oneshot builds them (whose per-rank
//     alignment bits are checked too). This checks the kernel's indexing and chunk choice on
//     the host; the GPU's own arithmetic is checked only on a GPU.
// Usage: oneshot_driver DTYPE SEED. Prints one line per op, "op=NAME cases=N mismatches=M
// nan_payloads=P aligned=A misaligned=B mixed=C" (the last three: kernel-body runs on each
// layout), and a line per mismatch (the first few); exits 1 on any mismatch.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "driver_buffers.h"
#include "ring/cpu_executor.h"
#include "ring/oneshot.h"

using namespace rr;

namespace {

const DType kDtypes[] = {DType::F32, DType::F64,  DType::F16, DType::BF16, DType::I32,
                         DType::I64, DType::I8,   DType::U8,  DType::Bool};
const Op kOps[] = {Op::Sum, Op::Avg, Op::Max, Op::Min, Op::Prod, Op::BAnd, Op::BOr, Op::BXor};
const int kRanks[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 64};
const int64_t kSizes[] = {0, 1, 2, 3, 7, 8, 15, 16, 17, 31, 33, 63, 64, 65, 127, 129, 1000, 4099};
const int64_t kThreads[] = {1, 7, 64, 1000};

bool is_nan_at(const uint8_t* p, DType dtype) {
  uint64_t u = 0;
  std::memcpy(&u, p, size_t(elem_size(dtype)));
  switch (dtype) {
    case DType::F32: return (u & 0x7fffffffu) > 0x7f800000u;
    case DType::F64: return (u & 0x7fffffffffffffffu) > 0x7ff0000000000000u;
    case DType::F16: return (u & 0x7fffu) > 0x7c00u;
    case DType::BF16: return (u & 0x7fffu) > 0x7f80u;
    default: return false;
  }
}

// Bytes must be equal, except that where two NaNs met in a sum, average or product the result
// may be either one's payload (max and min choose the NaN explicitly, so not there): IEEE 754 leaves the choice open, x86 takes the first operand,
// and the compiler may swap the operands of a commutative add or multiply differently in each
// inlined copy (seen with g++ -O1/-O2/-O3 between the ring's and the one-shot's loops). Both
// results are then NaN, and that is all that is required of them (the GPU returns one
// canonical NaN anyway, types.h).
struct Report {
  DType dtype;
  int64_t cases = 0;
  int64_t mismatches = 0;
  int64_t nan_payloads = 0;  // elements that are NaN in both with different bits
  int64_t layouts[3] = {0, 0, 0};  // kernel-body runs on aligned, misaligned, mixed buffers

  void check(const char* what, Op op, int n, int64_t count, int rank, const uint8_t* got,
             const uint8_t* want) {
    ++cases;
    const int64_t esize = elem_size(dtype);
    if (std::memcmp(got, want, size_t(count * esize)) == 0) return;
    const bool arithmetic = op == Op::Sum || op == Op::Avg || op == Op::Prod;
    int64_t bad = -1;
    for (int64_t i = 0; i < count; ++i) {
      const uint8_t* g = got + i * esize;
      const uint8_t* w = want + i * esize;
      if (std::memcmp(g, w, size_t(esize)) == 0) continue;
      if (arithmetic && is_nan_at(g, dtype) && is_nan_at(w, dtype)) {
        ++nan_payloads;
      } else if (bad < 0) {
        bad = i;
      }
    }
    if (bad < 0 || ++mismatches > 5) return;
    std::printf("MISMATCH %s op=%s nranks=%d count=%lld rank=%d index=%lld (chunk %d): got",
                what, op_name(op), n, (long long)count, rank, (long long)bad,
                chunk_of(bad, count, n, esize));
    for (int64_t k = 0; k < esize; ++k) std::printf(" %02x", got[bad * esize + k]);
    std::printf(", want");
    for (int64_t k = 0; k < esize; ++k) std::printf(" %02x", want[bad * esize + k]);
    std::printf("\n");
  }
};

// Every element lies in the chunk chunk_of names.
int64_t check_chunk_of(int64_t count, int n, int64_t esize) {
  int64_t bad = 0;
  for (int64_t i = 0; i < count; ++i) {
    const int c = chunk_of(i, count, n, esize);
    const Range r = c >= 0 && c < n ? chunk_range(count, n, esize, c) : Range{0, 0};
    if (i < r.offset || i >= r.offset + r.count) {
      if (++bad <= 5) {
        std::printf("MISMATCH chunk_of(%lld, count=%lld, nranks=%d, esize=%lld) = %d\n",
                    (long long)i, (long long)count, n, (long long)esize, c);
      }
    }
  }
  return bad;
}

template <typename T, Op op>
void run_threads(const OneshotArgs& a, int64_t threads) {
  for (int64_t t = 0; t < threads; ++t) oneshot_thread<T, op>(a, t, threads);
}

// The kernel body over every thread of a grid of `threads` threads.
void run_kernel_body(const OneshotArgs& a, int64_t threads, DType dtype, Op op) {
  RR_DISPATCH(dtype, op, run_threads<T, kOp>(a, threads));
}

template <typename T, Op op>
void run_once_threads(const OneshotArgs& a, int64_t threads) {
  for (int64_t t = 0; t < threads; ++t) oneshot_once_thread<T, op>(a, t, threads);
}

// The once-rounded kernel body (float16 / bfloat16 sum and avg) over a grid of `threads`.
void run_once_body(const OneshotArgs& a, int64_t threads, DType dtype, Op op) {
  const bool avg = op == Op::Avg;
  if (dtype == DType::F16) {
    avg ? run_once_threads<half_bits, Op::Avg>(a, threads)
        : run_once_threads<half_bits, Op::Sum>(a, threads);
  } else {
    avg ? run_once_threads<bf16_bits, Op::Avg>(a, threads)
        : run_once_threads<bf16_bits, Op::Sum>(a, threads);
  }
}

void run_case(DType dtype, Op op, int n, int64_t count, Values& values, Report& report,
              Report& once_report) {
  const int64_t esize = elem_size(dtype);
  const int64_t bytes = count * esize;
  std::vector<Buf> input;
  for (int r = 0; r < n; ++r) {
    input.emplace_back(bytes, 0);
    fill(input.back().data, count, dtype, values);
  }
  // offset(r): how many bytes rank r's buffer lies off 16-byte alignment.
  auto copies_at = [&](const std::vector<int64_t>& offset) {
    std::vector<Buf> c;
    for (int r = 0; r < n; ++r) {
      c.emplace_back(bytes, offset[size_t(r)]);
      std::memcpy(c.back().data, input[size_t(r)].data, size_t(bytes));
    }
    return c;
  };
  auto copies = [&](int64_t offset) { return copies_at(std::vector<int64_t>(size_t(n), offset)); };
  auto ptrs = [&](std::vector<Buf>& bufs) {
    std::vector<void*> p;
    for (Buf& b : bufs) p.push_back(b.data);
    return p;
  };
  auto check_all = [&](const char* what, std::vector<Buf>& got, std::vector<Buf>& want) {
    for (int r = 0; r < n; ++r) {
      report.check(what, op, n, count, r, got[size_t(r)].data, want[size_t(r)].data);
    }
  };

  std::vector<Buf> ring = copies(0);
  cpu::all_reduce(ptrs(ring).data(), n, count, dtype, op);

  std::vector<Buf> in_place = copies(0);
  std::vector<void*> p = ptrs(in_place);
  cpu::all_reduce_oneshot(p.data(), p.data(), n, count, dtype, op);
  check_all("cpu in place", in_place, ring);

  std::vector<Buf> in = copies(0), out = copies(0);
  for (Buf& b : out) std::memset(b.data, 0x5A, size_t(bytes));
  std::vector<void*> pin = ptrs(in), pout = ptrs(out);
  cpu::all_reduce_oneshot(pin.data(), pout.data(), n, count, dtype, op);
  check_all("cpu out of place", out, ring);
  check_all("cpu input unchanged", in, input);

  if (n > kOneshotMaxRanks) return;
  // Every rank aligned (packs), every rank off by an element (elements), or a random mix (packs,
  // lane by lane for the ranks that are off), and the grid size, drawn per case.
  const int64_t off = esize >= 16 ? 0 : esize;
  const int layout = int(values.rng() % 3);
  std::vector<int64_t> in_off(static_cast<size_t>(n)), out_off(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    in_off[size_t(r)] = layout == 0 ? 0 : layout == 1 ? off : int64_t(values.rng() % 2) * off;
    out_off[size_t(r)] = layout == 0 ? 0 : layout == 1 ? off : int64_t(values.rng() % 2) * off;
  }
  const int64_t threads = kThreads[values.rng() % 4];
  for (const bool inplace : {true, false}) {
    std::vector<Buf> kin = copies_at(in_off), kout = copies_at(out_off);
    std::vector<void*> kpin = ptrs(kin), kpout = ptrs(kout);
    const OneshotArgs a =
        make_oneshot_args(kpin.data(), inplace ? kpin.data() : kpout.data(), n, count);
    const std::vector<int64_t>& wrote = inplace ? in_off : out_off;
    bool any = false, masks = true;
    for (int r = 0; r < n; ++r) {
      masks = masks && ((a.in_packed >> r) & 1) == uint64_t(in_off[size_t(r)] == 0) &&
              ((a.out_packed >> r) & 1) == uint64_t(wrote[size_t(r)] == 0);
      any = any || in_off[size_t(r)] == 0 || wrote[size_t(r)] == 0;
    }
    if (!masks || a.vec != any) {
      std::printf("MISMATCH make_oneshot_args: vec=%d in_packed=%llx out_packed=%llx for "
                  "%s buffers\n", int(a.vec), (unsigned long long)a.in_packed,
                  (unsigned long long)a.out_packed,
                  layout == 0 ? "aligned" : layout == 1 ? "misaligned" : "mixed");
      ++report.mismatches;
    }
    ++report.layouts[layout];
    run_kernel_body(a, threads, dtype, op);
    check_all(inplace ? "kernel body in place" : "kernel body out of place",
              inplace ? kin : kout, ring);
    if (!inplace) check_all("kernel body input unchanged", kin, input);
  }

  // The once-rounded kernel body against the CPU paths' once-rounded sum (cpu_executor.cpp:
  // rr::cpu::all_reduce_once, itself checked against a float64 model in
  // tests/test_half_rounding.py), on the same layouts and grid; two ranks or more, as the
  // bindings use it (one rank is a copy).
  if (!oneshot_rounds_once(dtype, op) || n < 2 || count == 0) return;
  std::vector<Buf> once = copies(0);
  std::vector<void*> po = ptrs(once);
  cpu::all_reduce_once(po.data(), po.data(), n, count, dtype, op);
  for (const bool inplace : {true, false}) {
    std::vector<Buf> kin = copies_at(in_off), kout = copies_at(out_off);
    for (Buf& b : kout) std::memset(b.data, 0x5A, size_t(bytes));
    std::vector<void*> kpin = ptrs(kin), kpout = ptrs(kout);
    const OneshotArgs a =
        make_oneshot_args(kpin.data(), inplace ? kpin.data() : kpout.data(), n, count);
    run_once_body(a, threads, dtype, op);
    std::vector<Buf>& got = inplace ? kin : kout;
    for (int r = 0; r < n; ++r) {
      once_report.check(inplace ? "once body in place" : "once body out of place", op, n, count,
                        r, got[size_t(r)].data, once[0].data);
      if (!inplace) {
        once_report.check("once body input unchanged", op, n, count, r, kin[size_t(r)].data,
                          input[size_t(r)].data);
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s DTYPE SEED\n", argv[0]);
    return 2;
  }
  const DType* dtype = nullptr;
  for (const DType& d : kDtypes) {
    if (std::string(dtype_name(d)) == argv[1]) dtype = &d;
  }
  if (dtype == nullptr) {
    std::fprintf(stderr, "unknown dtype %s\n", argv[1]);
    return 2;
  }
  const uint64_t seed = std::stoull(argv[2]);
  int64_t chunk_errors = 0;
  for (int n : kRanks) {
    for (int64_t count : kSizes) chunk_errors += check_chunk_of(count, n, elem_size(*dtype));
  }
  std::printf("chunk_of mismatches=%lld\n", (long long)chunk_errors);
  int64_t total = chunk_errors;
  for (Op op : kOps) {
    if (!op_supported(op, *dtype)) continue;
    Report report{*dtype}, once_report{*dtype};
    int64_t case_index = 0;
    for (int n : kRanks) {
      for (int64_t count : kSizes) {
        Values values{std::mt19937_64(seed * 1000003u + uint64_t(case_index)), 0};
        values.mode = int(values.rng() % 3);
        run_case(*dtype, op, n, count, values, report, once_report);
        ++case_index;
      }
    }
    std::printf("op=%s cases=%lld mismatches=%lld nan_payloads=%lld aligned=%lld "
                "misaligned=%lld mixed=%lld\n", op_name(op), (long long)report.cases,
                (long long)report.mismatches, (long long)report.nan_payloads,
                (long long)report.layouts[0], (long long)report.layouts[1],
                (long long)report.layouts[2]);
    total += report.mismatches;
    if (oneshot_rounds_once(*dtype, op)) {
      std::printf("once op=%s cases=%lld mismatches=%lld nan_payloads=%lld\n", op_name(op),
                  (long long)once_report.cases, (long long)once_report.mismatches,
                  (long long)once_report.nan_payloads);
      total += once_report.mismatches;
    }
  }
  return total == 0 ? 0 : 1;
}
