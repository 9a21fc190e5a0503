// Host buffers for the C++ test drivers (oneshot_driver.cpp, fused_driver.cpp): a byte buffer
// whose data starts a chosen number of bytes past a 16-byte boundary, so that a driver can take
// a kernel body's 16-byte pack path (offset 0) or its element path (offset of one element).
#pragma once

#include <cstdint>
#include <vector>

// `bytes` bytes starting `offset` bytes past a 16-byte boundary, filled with 0xA5.
struct Buf {
  std::vector<uint8_t> storage;
  uint8_t* data;
  Buf(int64_t bytes, int64_t offset) : storage(size_t(bytes + offset + 16), 0xA5) {
    const uintptr_t base = reinterpret_cast<uintptr_t>(storage.data());
    data = storage.data() + ((16 - base % 16) % 16) + offset;
  }
};
