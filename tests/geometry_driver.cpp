// Answers launch-geometry questions (csrc/ring/launch.h) on the host, one per line of stdin, for
// tests/test_launch_geometry.py:
//   fused REQUESTED NRANKS COUNT ESIZE RESIDENT FLAGS_BYTES -> blocks per rank, or "error: ..."
//   fused_max NRANKS RESIDENT                               -> blocks per rank, or "error: ..."
//   flags NRANKS BLOCKS                                     -> fused_flags_bytes
//   step MAX_N ESIZE NTASKS RESIDENT                        -> grid.x of a ring-step launch
//   oneshot COUNT ESIZE VEC RESIDENT                        -> blocks of a one-shot launch
//   stride MAX_HOP_BYTES                                    -> bytes between staging slots
//   threads                                                 -> step, one-shot, fused block size
//   chunks COUNT NRANKS ESIZE        -> the ring's chunks (schedule.h), "offset:count" each
//   pieces COUNT NRANKS ESIZE PIECE  -> per chunk, the staged rounds' pieces "begin:count"
//                                       separated by ",", chunks separated by " "
#include <cstdint>
#include <exception>
#include <iostream>
#include <sstream>
#include <string>

#include "ring/launch.h"
#include "ring/schedule.h"

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
      } else if (what == "chunks") {
        int64_t count, nranks, esize;
        in >> count >> nranks >> esize;
        for (int c = 0; c < int(nranks); ++c) {
          const rr::Range r = rr::chunk_range(count, int(nranks), esize, c);
          std::cout << (c ? " " : "") << r.offset << ":" << r.count;
        }
        std::cout << "\n";
      } else if (what == "pieces") {
        int64_t count, nranks, esize, piece;
        in >> count >> nranks >> esize >> piece;
        for (int c = 0; c < int(nranks); ++c) {
          std::cout << (c ? " " : "");
          // Rounds until this chunk's piece is empty (at most count / piece + 2 of them).
          for (int64_t round = 0; round <= count / piece + 1; ++round) {
            int64_t begin = 0;
            const int64_t n = rr::chunk_piece(count, int(nranks), esize, c, piece, round, &begin);
            if (n == 0) break;
            std::cout << (round ? "," : "") << begin << ":" << n;
          }
        }
        std::cout << "\n";
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
