// Element types and reduction operators shared by every executor (CPU, CUDA, multi-process).
// Torch-free: compiles with a plain C++17 compiler and with nvcc.
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

#if defined(__CUDACC__)
#define RR_HD __host__ __device__ __forceinline__
#else
#define RR_HD inline
#endif

// Compute capabilities this build targets, as a string like "80_90" (set by setup.py).
#define RR_STRINGIFY_(x) #x
#define RR_STRINGIFY(x) RR_STRINGIFY_(x)
#ifdef RINGREDUCE_ARCHS
#define RINGREDUCE_ARCH_LIST RR_STRINGIFY(RINGREDUCE_ARCHS)
#else
#define RINGREDUCE_ARCH_LIST ""
#endif

namespace rr {

enum class DType : int { F32 = 0, F64, F16, BF16, I32, I64, I8, U8, Bool };
enum class Op : int { Sum = 0, Avg, Max, Min, Prod, BAnd, BOr, BXor };

inline int64_t elem_size(DType t) {
  switch (t) {
    case DType::F64:
    case DType::I64: return 8;
    case DType::F32:
    case DType::I32: return 4;
    case DType::F16:
    case DType::BF16: return 2;
    case DType::I8:
    case DType::U8:
    case DType::Bool: return 1;
  }
  return 0;
}

inline bool is_floating(DType t) {
  return t == DType::F32 || t == DType::F64 || t == DType::F16 || t == DType::BF16;
}

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "float32";
    case DType::F64: return "float64";
    case DType::F16: return "float16";
    case DType::BF16: return "bfloat16";
    case DType::I32: return "int32";
    case DType::I64: return "int64";
    case DType::I8: return "int8";
    case DType::U8: return "uint8";
    case DType::Bool: return "bool";
  }
  return "?";
}

inline const char* op_name(Op op) {
  switch (op) {
    case Op::Sum: return "sum";
    case Op::Avg: return "avg";
    case Op::Max: return "max";
    case Op::Min: return "min";
    case Op::Prod: return "prod";
    case Op::BAnd: return "band";
    case Op::BOr: return "bor";
    case Op::BXor: return "bxor";
  }
  return "?";
}

inline bool is_bitwise(Op op) { return op == Op::BAnd || op == Op::BOr || op == Op::BXor; }

// Which (op, dtype) pairs exist: bitwise operators need integers or bool; avg needs numbers
// (on integers it divides the wrapped sum by the rank count, truncating toward zero, as NCCL).
// The bindings reject every other pair before dispatch, and RR_DISPATCH instantiates only
// these.
inline bool op_supported(Op op, DType t) {
  if (is_bitwise(op)) return !is_floating(t);
  if (op == Op::Avg) return t != DType::Bool;
  return true;
}

// What op_supported requires of the dtype, for error messages.
inline const char* op_requirement(Op op) {
  return is_bitwise(op) ? "needs an integer or bool dtype" : "needs a numeric dtype, not bool";
}

// Reached only if a caller skipped op_supported: an internal error, never a user's.
[[noreturn]] inline void unsupported_pair(DType t, Op op) {
  throw std::logic_error(std::string("ringreduce internal error: op '") + op_name(op) +
                         "' on " + dtype_name(t) + " reached dispatch (op_supported rejects it)");
}

// 16-bit floats are carried as raw bits so that host and device code share one definition.
// Arithmetic on them happens in fp32 (see Reducer): each ring hop converts both operands to
// fp32, applies the operator once and rounds the result back to nearest-even. A value that
// crosses N ranks is therefore rounded N-1 times (once per reduce-scatter hop); all-gather
// copies bits and adds no rounding. On the CPU paths, sums and averages are instead summed in
// fp32 over all ranks and rounded once, unless RINGREDUCE_HALF_ROUNDING=per_hop
// (cpu_executor.h, sum_rounded_once).
struct half_bits { uint16_t x; };
struct bf16_bits { uint16_t x; };
// torch's bool is one byte holding 0 or 1. Carried as that byte and read as "not zero", so a
// result is always written as exactly 0 or 1.
struct bool_bits { uint8_t x; };

RR_HD uint32_t f32_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
RR_HD float bits_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

RR_HD float to_float(bf16_bits v) { return bits_f32(uint32_t(v.x) << 16); }

RR_HD bf16_bits bf16_from_float(float f) {
#if defined(__CUDA_ARCH__)
  return bf16_bits{__bfloat16_as_ushort(__float2bfloat16_rn(f))};
#else
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16_bits{uint16_t((u >> 16) | 0x40u)};  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return bf16_bits{uint16_t(u >> 16)};
#endif
}

// IEEE binary16 <-> binary32. The host path is integer arithmetic that rounds exactly like the
// device intrinsics used on the GPU (round to nearest, ties to even; overflow to infinity), so
// CPU and GPU results agree bit for bit, except for the bit patterns of NaNs (the device
// returns one canonical NaN; the host keeps sign and payload): NaN-ness always agrees.
RR_HD float to_float(half_bits v) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(v.x));
#else
  uint32_t sign = uint32_t(v.x & 0x8000u) << 16;
  uint32_t exp = (v.x >> 10) & 0x1fu;
  uint32_t man = v.x & 0x3ffu;
  if (exp == 0x1fu) return bits_f32(sign | 0x7f800000u | (man << 13));  // inf / NaN
  if (exp == 0) {
    if (man == 0) return bits_f32(sign);
    // subnormal: value = man * 2^-24, exact in fp32
    float f = float(man) * 5.9604644775390625e-08f;
    return sign ? -f : f;
  }
  return bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
#endif
}

RR_HD half_bits half_from_float(float f) {
#if defined(__CUDA_ARCH__)
  return half_bits{__half_as_ushort(__float2half_rn(f))};
#else
  uint32_t u = f32_bits(f);
  uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return half_bits{uint16_t(sign | 0x7e00u | ((a >> 13) & 0x3ffu))};  // NaN
  if (a >= 0x477ff000u) return half_bits{uint16_t(sign | 0x7c00u)};  // rounds to >= 65520: inf
  if (a < 0x38800000u) {
    // result is subnormal or zero: shift the full significand into place, round half to even
    if (a < 0x33000000u) return half_bits{sign};  // below half the smallest subnormal
    uint32_t e = a >> 23;
    uint32_t m = (a & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126u - e;  // 14..24
    uint32_t q = m >> shift;
    uint32_t rem = m & ((1u << shift) - 1u);
    uint32_t halfway = 1u << (shift - 1u);
    if (rem > halfway || (rem == halfway && (q & 1u))) ++q;
    return half_bits{uint16_t(sign | q)};
  }
  uint32_t r = a - 0x38000000u;  // rebias exponent 127 -> 15 (shifted by 13 below)
  r += 0xfffu + ((r >> 13) & 1u);
  return half_bits{uint16_t(sign | (r >> 13))};
#endif
}

// The arithmetic type of each storage type: half types compute in fp32.
template <typename T> struct Acc { using type = T; };
template <> struct Acc<half_bits> { using type = float; };
template <> struct Acc<bf16_bits> { using type = float; };
template <> struct Acc<bool_bits> { using type = bool; };

template <typename T> RR_HD typename Acc<T>::type load_acc(T v) { return v; }
RR_HD float load_acc(half_bits v) { return to_float(v); }
RR_HD float load_acc(bf16_bits v) { return to_float(v); }
RR_HD bool load_acc(bool_bits v) { return v.x != 0; }

template <typename T> RR_HD T store_acc(typename Acc<T>::type v) { return v; }
template <> RR_HD half_bits store_acc<half_bits>(float v) { return half_from_float(v); }
template <> RR_HD bf16_bits store_acc<bf16_bits>(float v) { return bf16_from_float(v); }
template <> RR_HD bool_bits store_acc<bool_bits>(bool v) { return bool_bits{uint8_t(v ? 1 : 0)}; }

// 16 bytes of elements, loaded and stored as one vector by the kernels (one-shot and ring
// steps). Ring chunk boundaries are multiples of 16 bytes, so the lanes of one pack always
// belong to the same chunk.
template <typename T>
struct alignas(16) Pack {
  static constexpr int kLanes = 16 / int(sizeof(T));
  T lane[kLanes];
};

// Integer sum and product wrap modulo 2^bits like torch's integer arithmetic; they go through
// the unsigned type because signed overflow is undefined behaviour in C++.
template <typename A> struct Wrap { static RR_HD A add(A a, A b) { return a + b; }
                                     static RR_HD A mul(A a, A b) { return a * b; } };
#define RR_WRAP_INT(S, U)                                                                  \
  template <> struct Wrap<S> {                                                            \
    static RR_HD S add(S a, S b) { return S(U(U(a) + U(b))); }                             \
    static RR_HD S mul(S a, S b) { return S(U(U(a) * U(b))); }                             \
  };
RR_WRAP_INT(int8_t, uint32_t)
RR_WRAP_INT(int32_t, uint32_t)
RR_WRAP_INT(int64_t, uint64_t)
RR_WRAP_INT(uint8_t, uint32_t)
#undef RR_WRAP_INT

template <typename A> RR_HD bool is_nan(A a) { return a != a; }

// combine(mine, incoming). The operand order is fixed (the rank's own partial first) so the
// result of a reduction depends only on the ring order, never on timing. Max and min
// propagate NaN like torch.maximum / torch.minimum.
template <typename A, Op op> struct Combine;
template <typename A> struct Combine<A, Op::Sum> {
  static RR_HD A apply(A a, A b) { return Wrap<A>::add(a, b); } };
template <typename A> struct Combine<A, Op::Avg> {
  static RR_HD A apply(A a, A b) { return Wrap<A>::add(a, b); } };
template <typename A> struct Combine<A, Op::Prod> {
  static RR_HD A apply(A a, A b) { return Wrap<A>::mul(a, b); } };
template <typename A> struct Combine<A, Op::Max> {
  static RR_HD A apply(A a, A b) { return is_nan(a) ? a : (is_nan(b) ? b : (b > a ? b : a)); } };
template <typename A> struct Combine<A, Op::Min> {
  static RR_HD A apply(A a, A b) { return is_nan(a) ? a : (is_nan(b) ? b : (b < a ? b : a)); } };
template <typename A> struct Combine<A, Op::BAnd> {
  static RR_HD A apply(A a, A b) { return A(a & b); } };
template <typename A> struct Combine<A, Op::BOr> {
  static RR_HD A apply(A a, A b) { return A(a | b); } };
template <typename A> struct Combine<A, Op::BXor> {
  static RR_HD A apply(A a, A b) { return A(a ^ b); } };
// bool as torch defines its reductions: sum and max are logical or, prod and min logical and.
struct LogicalOr { static RR_HD bool apply(bool a, bool b) { return a || b; } };
struct LogicalAnd { static RR_HD bool apply(bool a, bool b) { return a && b; } };
template <> struct Combine<bool, Op::Sum> : LogicalOr {};
template <> struct Combine<bool, Op::Max> : LogicalOr {};
template <> struct Combine<bool, Op::BOr> : LogicalOr {};
template <> struct Combine<bool, Op::Prod> : LogicalAnd {};
template <> struct Combine<bool, Op::Min> : LogicalAnd {};
template <> struct Combine<bool, Op::BAnd> : LogicalAnd {};
template <> struct Combine<bool, Op::BXor> {
  static RR_HD bool apply(bool a, bool b) { return a != b; } };

// One element of one reduce-scatter hop: dst = combine(dst, src), and on the last hop of an
// average the division by the rank count happens before the single rounding to T. Floats
// divide in their arithmetic type; integers divide the sum (wrapped in T) by the rank count as
// int64, truncating toward zero (NCCL's integer average; int64 so that any rank count fits).
template <typename T, Op op> struct Reducer {
  using A = typename Acc<T>::type;
  using D = std::conditional_t<std::is_floating_point<A>::value, A, int64_t>;  // divisor
  static RR_HD T step(T mine, T incoming) {
    return store_acc<T>(Combine<A, op>::apply(load_acc(mine), load_acc(incoming)));
  }
  static RR_HD T last_step(T mine, T incoming, D divisor) {
    A r = Combine<A, op>::apply(load_acc(mine), load_acc(incoming));
    if constexpr (op == Op::Avg) r = A(r / divisor);
    return store_acc<T>(r);
  }
};

}  // namespace rr

// Runs the statement with T and kOp bound to the runtime (dtype, op) pair. Only the pairs
// op_supported allows are instantiated (bitwise operators on floats do not compile); any other
// pair reaching here is an internal error, since the bindings reject it first.
#define RR_OP_CASE(NAME, ...)                                                              \
  case ::rr::Op::NAME: { constexpr ::rr::Op kOp = ::rr::Op::NAME; __VA_ARGS__; } break;

#define RR_DISPATCH_OPS_FLOAT(DT, OP, ...)                                                  \
  switch (OP) {                                                                             \
    RR_OP_CASE(Sum, __VA_ARGS__) RR_OP_CASE(Avg, __VA_ARGS__) RR_OP_CASE(Max, __VA_ARGS__)  \
    RR_OP_CASE(Min, __VA_ARGS__) RR_OP_CASE(Prod, __VA_ARGS__)                              \
    default: ::rr::unsupported_pair(DT, OP);                                                \
  }

#define RR_DISPATCH_OPS_INT(DT, OP, ...)                                                    \
  switch (OP) {                                                                             \
    RR_OP_CASE(Sum, __VA_ARGS__) RR_OP_CASE(Avg, __VA_ARGS__) RR_OP_CASE(Max, __VA_ARGS__)  \
    RR_OP_CASE(Min, __VA_ARGS__) RR_OP_CASE(Prod, __VA_ARGS__) RR_OP_CASE(BAnd, __VA_ARGS__) \
    RR_OP_CASE(BOr, __VA_ARGS__) RR_OP_CASE(BXor, __VA_ARGS__)                              \
  }

#define RR_DISPATCH_OPS_BOOL(DT, OP, ...)                                                   \
  switch (OP) {                                                                             \
    RR_OP_CASE(Sum, __VA_ARGS__) RR_OP_CASE(Max, __VA_ARGS__) RR_OP_CASE(Min, __VA_ARGS__)  \
    RR_OP_CASE(Prod, __VA_ARGS__) RR_OP_CASE(BAnd, __VA_ARGS__) RR_OP_CASE(BOr, __VA_ARGS__) \
    RR_OP_CASE(BXor, __VA_ARGS__)                                                           \
    default: ::rr::unsupported_pair(DT, OP);                                                \
  }

#define RR_DISPATCH_TYPE(KIND, DT, TYPE, OP, ...)                                           \
  case ::rr::DType::DT: {                                                                   \
    using T = TYPE;                                                                         \
    RR_DISPATCH_OPS_##KIND(::rr::DType::DT, OP, __VA_ARGS__)                                \
  } break;

#define RR_DISPATCH(DT, OP, ...)                                                           \
  switch (DT) {                                                                             \
    RR_DISPATCH_TYPE(FLOAT, F32, float, OP, __VA_ARGS__)                                    \
    RR_DISPATCH_TYPE(FLOAT, F64, double, OP, __VA_ARGS__)                                   \
    RR_DISPATCH_TYPE(FLOAT, F16, ::rr::half_bits, OP, __VA_ARGS__)                          \
    RR_DISPATCH_TYPE(FLOAT, BF16, ::rr::bf16_bits, OP, __VA_ARGS__)                         \
    RR_DISPATCH_TYPE(INT, I32, int32_t, OP, __VA_ARGS__)                                    \
    RR_DISPATCH_TYPE(INT, I64, int64_t, OP, __VA_ARGS__)                                    \
    RR_DISPATCH_TYPE(INT, I8, int8_t, OP, __VA_ARGS__)                                      \
    RR_DISPATCH_TYPE(INT, U8, uint8_t, OP, __VA_ARGS__)                                     \
    RR_DISPATCH_TYPE(BOOL, Bool, ::rr::bool_bits, OP, __VA_ARGS__)                          \
  }
