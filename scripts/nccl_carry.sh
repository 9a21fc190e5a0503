#!/usr/bin/env bash
# Puts the small NCCL 2.30.7 build (sm_90 only, 4.2 MB as .xz; its README says how it was built
# and what it lacks) into .nccl/, a git-ignored folder, so that one device call carries it with
# the tree (`carry: [".nccl"]`) and scripts/gpu_check.sh unpacks it there and runs the
# benchmarks against it. torch 2.11's own NCCL (2.28.9) refuses several ranks on one GPU.
#   bash scripts/nccl_carry.sh [FOLDER]     FOLDER: where the build lies (default ../shared/nccl)
set -euo pipefail
cd "$(dirname "$0")/.."
src=${1:-../shared/nccl}
for f in libnccl.so.2.30.7.xz SHA256SUMS README.md LICENSE.txt; do
  [ -f "$src/$f" ] || { echo "nccl_carry: $src/$f is missing" >&2; exit 1; }
done
mkdir -p .nccl
cp "$src/libnccl.so.2.30.7.xz" "$src/SHA256SUMS" "$src/README.md" "$src/LICENSE.txt" .nccl/
# The .xz's own hash, checked here; the library's is checked on the GPU machine after unpacking.
want=$(awk '$2 ~ /libnccl\.so\.2\.30\.7\.xz$/ {print $1}' .nccl/SHA256SUMS)
got=$(sha256sum < .nccl/libnccl.so.2.30.7.xz | cut -c1-64)
[ -n "$want" ] && [ "$got" = "$want" ] || { echo "nccl_carry: SHA256 of the .xz is $got, SHA256SUMS says '$want'" >&2; exit 1; }
echo "nccl_carry: .nccl/ ready ($(du -sh .nccl | cut -f1)); name .nccl in the device call's carry"
