// Host buffers for the C++ test drivers (oneshot_driver.cpp, fused_driver.cpp): a byte buffer
// whose data starts a chosen number of bytes past a 16-byte boundary, so that a driver can take
// a kernel body's 16-byte pack path (offset 0) or its element path (offset of one element);
// and the random values both fill their inputs with.
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "ring/types.h"

// `bytes` bytes starting `offset` bytes past a 16-byte boundary, filled with 0xA5.
struct Buf {
  std::vector<uint8_t> storage;
  uint8_t* data;
  Buf(int64_t bytes, int64_t offset) : storage(size_t(bytes + offset + 16), 0xA5) {
    const uintptr_t base = reinterpret_cast<uintptr_t>(storage.data());
    data = storage.data() + ((16 - base % 16) % 16) + offset;
  }
};

// Random inputs: mode 0 ordinary numbers (small integers for integer types); 1 with NaN, inf,
// -0.0 and subnormals; 2 random bits.
struct Values {
  std::mt19937_64 rng;
  int mode;  // 0: ordinary numbers; 1: with NaN, inf, -0.0, subnormals; 2: random bits

  double ordinary() { return std::uniform_real_distribution<double>(-4.0, 4.0)(rng); }
  double special() {
    const double s[] = {std::numeric_limits<double>::quiet_NaN(),
                        -std::numeric_limits<double>::quiet_NaN(),
                        std::numeric_limits<double>::infinity(),
                        -std::numeric_limits<double>::infinity(),
                        -0.0, 0.0, 1e-40, -1e-310, 6e-8, 65504.0, 3.4e38};
    return s[rng() % (sizeof(s) / sizeof(s[0]))];
  }
  double number() { return mode == 1 && rng() % 8 == 0 ? special() : ordinary(); }
  uint64_t bits() { return rng(); }
  bool random_bits() { return mode == 2; }
};

inline void fill(uint8_t* p, int64_t count, rr::DType dtype, Values& v) {
  for (int64_t i = 0; i < count; ++i) {
    const uint64_t b = v.bits();
    switch (dtype) {
      case rr::DType::F32: {
        const float f = float(v.number());
        std::memcpy(p + 4 * i, v.random_bits() ? static_cast<const void*>(&b) : &f, 4);
        break;
      }
      case rr::DType::F64: {
        const double d = v.number();
        std::memcpy(p + 8 * i, v.random_bits() ? static_cast<const void*>(&b) : &d, 8);
        break;
      }
      case rr::DType::F16: {
        const uint16_t h = v.random_bits() ? uint16_t(b) : rr::half_from_float(float(v.number())).x;
        std::memcpy(p + 2 * i, &h, 2);
        break;
      }
      case rr::DType::BF16: {
        const uint16_t h = v.random_bits() ? uint16_t(b) : rr::bf16_from_float(float(v.number())).x;
        std::memcpy(p + 2 * i, &h, 2);
        break;
      }
      case rr::DType::I32:
      case rr::DType::I64:
      case rr::DType::I8:
      case rr::DType::U8: {
        // Small values keep sums and products meaningful; full-range bits wrap.
        const uint64_t x = v.mode == 0 ? uint64_t(int64_t(b % 7) - 3) : b;
        std::memcpy(p + rr::elem_size(dtype) * i, &x, size_t(rr::elem_size(dtype)));
        break;
      }
      case rr::DType::Bool:
        p[i] = v.random_bits() ? uint8_t(b) : uint8_t(b & 1);
        break;
    }
  }
}
