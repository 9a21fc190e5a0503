#!/usr/bin/env bash
# Host instructions (callgrind Ir) per steady-state call of the list API's CUDA executor on the
# fake runtime of tests/fake_cuda (tests/fake_cuda/cost_driver.cpp, built here at -O2):
# (Ir of 41 calls - Ir of 1 call) / 40, collected inside rr::cuda::run and rr::cuda::run_oneshot,
# the fake runtime's calls included (they stand in for the CUDA runtime's; the same fake before
# and after a change, so the difference is the executor's). Needs g++ and valgrind.
#   bash bench/host_cost.sh [PATH...]   (default: every path of the cost driver)
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
flags=(-std=c++17 -O2 -g -pthread -I tests/fake_cuda/include -I csrc)
for src in csrc/ring/cuda_executor.cu csrc/ring/cuda_kernels.cu csrc/ring/oneshot_kernel.cu; do
  g++ "${flags[@]}" -x c++ -c "$src" -o "$out/$(basename "$src").o" &
done
for src in csrc/ring/cpu_executor.cpp tests/fake_cuda/fake_lanes.cpp tests/fake_cuda/cost_driver.cpp; do
  g++ "${flags[@]}" -c "$src" -o "$out/$(basename "$src").o" &
done
wait
g++ -pthread "$out"/*.o -lrt -o "$out/cost_driver"
ir() {  # path calls
  valgrind --tool=callgrind --callgrind-out-file="$out/cg" --toggle-collect='rr::cuda::run(*' \
    --toggle-collect='rr::cuda::run_oneshot(*' "$out/cost_driver" "$1" "$2" >/dev/null 2>&1
  callgrind_annotate "$out/cg" | sed -n 's/^ *\([0-9,]*\) .*PROGRAM TOTALS.*/\1/p' | tr -d ,
}
paths=("$@")
[ ${#paths[@]} -gt 0 ] || paths=(oneshot ring ring_12_ranks ring_virtual ring_devices staged
                                  capture_oneshot capture_ring)
echo "| path | Ir per call |"
echo "|---|---|"
for p in "${paths[@]}"; do
  one=$(ir "$p" 1)
  many=$(ir "$p" 41)
  echo "| $p | $(( (many - one) / 40 )) |"
done
