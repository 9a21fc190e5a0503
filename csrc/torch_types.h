// torch <-> ringreduce names for dtypes and operators, shared by the bindings (torch side only).
#pragma once

#include <torch/extension.h>

#include <string>

#include "ring/types.h"

namespace rr {

constexpr const char* kSupportedDtypes =
    "float32, float64, float16, bfloat16, int32, int64, int8, uint8";

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
    default: return false;
  }
}

// False for a name that is not one of op_name()'s.
inline bool op_from_name(const std::string& name, Op* out) {
  for (Op op : {Op::Sum, Op::Avg, Op::Max, Op::Min, Op::Prod}) {
    if (name == op_name(op)) {
      *out = op;
      return true;
    }
  }
  return false;
}

}  // namespace rr
