#!/usr/bin/env bash
# Compile-only check of every torch-free CUDA source for sm_80 and sm_90 (no GPU needed).
# A kernel that does not compile fails here even on a machine without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
[ -x "$NVCC" ] || { echo "compile_cuda: nvcc not found (set NVCC=...)" >&2; exit 1; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
status=0
for src in $(find csrc -name '*.cu' | sort); do
  echo "compile_cuda: $src"
  "$NVCC" -std=c++17 -O3 -Icsrc -DRINGREDUCE_WITH_CUDA -DRINGREDUCE_ARCHS=80_90 \
    -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90,code=sm_90 \
    -Xcompiler -Wall -Werror=all-warnings -c "$src" -o "$out/$(basename "$src").o" || status=1
done
exit $status
