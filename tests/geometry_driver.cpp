// Answers launch-geometry questions (csrc/ring/launch.h) on the host, one per line of stdin, for
// tests/test_launch_geometry.py:
//   fused REQUESTED NRANKS COUNT ESIZE RESIDENT FLAGS_BYTES -> blocks per rank, or "error: ..."
//   fused_max NRANKS RESIDENT                               -> blocks per rank, or "error: ..."
//   flags NRANKS BLOCKS                                     -> fused_flags_bytes
//   step MAX_N ESIZE NTASKS RESIDENT                        -> grid.x of a ring-step launch
//   oneshot COUNT ESIZE VEC RESIDENT                        -> blocks of a one-shot launch
//   stride MAX_HOP_BYTES                                    -> bytes between staging slots
//   threads                                                 -> step, one-shot, fused block size
#include <cstdint>
#include <exception>
#include <iostream>
#include <sstream>
#include <string>

#include "ring/launch.h"

int main() {
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string what;
    in >> what;
    try {
      if (what == "fused") {
        int64_t requested, nranks, count, esize, resident, flags;
        in >> requested >> nranks >> count >> esize >> resident >> flags;
        std::cout << rr::fused_blocks_per_rank(int(requested), int(nranks), count, esize,
                                               resident, flags) << "\n";
      } else if (what == "fused_max") {
        int64_t nranks, resident;
        in >> nranks >> resident;
        std::cout << rr::fused_max_blocks_per_rank(int(nranks), resident) << "\n";
      } else if (what == "flags") {
        int64_t nranks, blocks;
        in >> nranks >> blocks;
        std::cout << rr::fused_flags_bytes(int(nranks), int(blocks)) << "\n";
      } else if (what == "step") {
        int64_t max_n, esize, ntasks, resident;
        in >> max_n >> esize >> ntasks >> resident;
        std::cout << rr::step_grid_x(max_n, esize, int(ntasks), resident) << "\n";
      } else if (what == "oneshot") {
        int64_t count, esize, vec, resident;
        in >> count >> esize >> vec >> resident;
        std::cout << rr::oneshot_grid(count, esize, vec != 0, resident) << "\n";
      } else if (what == "stride") {
        int64_t bytes;
        in >> bytes;
        std::cout << rr::stage_slot_stride(bytes) << "\n";
      } else if (what == "threads") {
        std::cout << rr::kStepThreads << " " << rr::kOneshotThreads << " " << rr::kFusedThreads
                  << "\n";
      } else {
        std::cout << "error: unknown question '" << what << "'\n";
      }
    } catch (const std::exception& e) {
      std::cout << "error: " << e.what() << "\n";
    }
  }
  return 0;
}
