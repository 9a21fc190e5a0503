// torch <-> ringreduce names for dtypes and operators, and the rules on them, shared by the
// bindings (torch side only).
#pragma once

#include <torch/extension.h>

#include <string>

#include "ring/types.h"

namespace rr {

constexpr const char* kSupportedDtypes =
    "float32, float64, float16, bfloat16, int32, int64, int8, uint8, bool";
constexpr const char* kOpNames = "sum, avg, max, min, prod, band, bor, bxor";

// False for a dtype no executor supports.
inline bool from_torch(at::ScalarType t, DType* out) {
  switch (t) {
    case at::kFloat: *out = DType::F32; return true;
    case at::kDouble: *out = DType::F64; return true;
    case at::kHalf: *out = DType::F16; return true;
    case at::kBFloat16: *out = DType::BF16; return true;
    case at::kInt: *out = DType::I32; return true;
    case at::kLong: *out = DType::I64; return true;
    case at::kChar: *out = DType::I8; return true;
    case at::kByte: *out = DType::U8; return true;
    case at::kBool: *out = DType::Bool; return true;
    default: return false;
  }
}

// False for a name that is not one of op_name()'s.
inline bool op_from_name(const std::string& name, Op* out) {
  for (Op op : {Op::Sum, Op::Avg, Op::Max, Op::Min, Op::Prod, Op::BAnd, Op::BOr, Op::BXor}) {
    if (name == op_name(op)) {
      *out = op;
      return true;
    }
  }
  return false;
}

// The tensor's dtype, or a TypeError naming the argument `arg`, prefixed with the pieces of
// `fn` (the message is only built when it is raised: a collective checks on every call).
template <typename... Fn>
inline DType dtype_in(const at::Tensor& t, const char* arg, const Fn&... fn) {
  DType dtype;
  TORCH_CHECK_TYPE(from_torch(t.scalar_type(), &dtype), fn..., ": dtype ", t.scalar_type(),
                   " of ", arg, " is not supported (supported: ", kSupportedDtypes, ")");
  return dtype;
}

inline DType dtype_of(const at::Tensor& t, const std::string& fn, const std::string& arg) {
  return dtype_in(t, arg.c_str(), fn);
}

// The operator named `name` if it is defined on `dtype` (types.h: op_supported); otherwise a
// ValueError (unknown name) or TypeError (wrong dtype) prefixed with the pieces of `fn`.
template <typename... Fn>
inline Op op_in(const std::string& name, DType dtype, const Fn&... fn) {
  Op op;
  TORCH_CHECK_VALUE(op_from_name(name, &op), fn..., ": op must be one of ", kOpNames, "; got '",
                    name, "'");
  TORCH_CHECK_TYPE(op_supported(op, dtype), fn..., ": op '", name, "' ", op_requirement(op),
                   "; got ", dtype_name(dtype));
  return op;
}

inline Op op_for(const std::string& name, DType dtype, const std::string& fn) {
  return op_in(name, dtype, fn);
}

}  // namespace rr
