// Integer settings read from the environment, for every layer (the ring's executors and the
// multi-process groups above them).
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>

namespace rr {

// The value of environment variable `name`, an integer in [lo, hi] (blanks around it allowed);
// `dflt` when unset or blank; std::invalid_argument naming the variable, `meaning`, the range and
// the value otherwise.
inline int64_t env_int(const char* name, int64_t dflt, int64_t lo, int64_t hi,
                       const char* meaning) {
  const char* raw = std::getenv(name);
  if (raw == nullptr) return dflt;
  const char* p = raw;
  while (*p == ' ' || *p == '\t') ++p;
  if (*p == '\0') return dflt;
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(p, &end, 10);
  while (end != nullptr && (*end == ' ' || *end == '\t')) ++end;
  if (errno != 0 || end == p || *end != '\0' || v < lo || v > hi)
    throw std::invalid_argument(std::string("ringreduce: ") + name + " must be " + meaning +
                                " in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                                "]; got '" + raw + "'");
  return int64_t(v);
}

}  // namespace rr
