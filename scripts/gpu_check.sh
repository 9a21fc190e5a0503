#!/usr/bin/env bash
# Everything a session with the GPU machine should run, in one device call:
#   bash scripts/gpu_check.sh [tests] [ring] [resnet18] [ddp]     (no argument: all four)
# Logs and JSON go to $OUT (the device tool's output folder) or ./gpu-logs.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-logs}
mkdir -p "$out"
# RINGREDUCE_REQUIRE_CUDA: the GPU tests fail instead of skipping without a GPU or a CUDA build.
# Every phase is bounded (PHASE_TIMEOUT seconds, and 120 s per test where pytest-timeout is
# installed, as on the GPU machine), so a hang costs one phase, not the device call. The build
# is for sm_90 only unless RINGREDUCE_CUDA_ARCH_LIST says otherwise (one device call builds).
# Another NCCL than torch's (which may be older than the 2.30 simulated ranks need): get the
# nvidia-nccl-cu13 wheel's libnccl.so.2 into /tmp/nccl with scripts/nccl_wheel.sh (fetch here,
# then one device call per piece to append it and one to unpack, while the machine is warm),
# then RINGREDUCE_NCCL_LIB=/tmp/nccl/nvidia/nccl/lib/libnccl.so.2 bash scripts/gpu_check.sh:
# every phase runs against it (the benchmarks restart with it in LD_PRELOAD), and nccl.log and
# the headers say which NCCL ran. A libnccl found in /tmp/nccl is only pointed out, never used
# unasked.
wheel_nccl=/tmp/nccl/nvidia/nccl/lib/libnccl.so.2
if [ -n "${RINGREDUCE_NCCL_LIB:-}" ]; then
  export RINGREDUCE_NCCL_LIB
  echo "gpu_check: RINGREDUCE_NCCL_LIB=$RINGREDUCE_NCCL_LIB" | tee "$out/nccl.log"
elif [ -f "$wheel_nccl" ]; then
  echo "gpu_check: $wheel_nccl is here but unused; to compare against it:" \
    "RINGREDUCE_NCCL_LIB=$wheel_nccl bash scripts/gpu_check.sh $*" | tee "$out/nccl.log"
fi
export PYTHONUNBUFFERED=1 RINGREDUCE_REQUIRE_CUDA=1 \
  NCCL_MULTI_RANK_GPU_ENABLE=${NCCL_MULTI_RANK_GPU_ENABLE:-1} \
  RINGREDUCE_CUDA_ARCH_LIST=${RINGREDUCE_CUDA_ARCH_LIST:-9.0}
limit=${PHASE_TIMEOUT:-540}
per_test=()
python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout=120)
phases=${*:-tests ring resnet18 ddp}
status=0
run() {  # run NAME CMD...: tee the output to $out/NAME.log and remember a failure
  local name=$1; shift
  echo "== $name: $*" | tee "$out/$name.log"
  timeout "$limit" "$@" 2>&1 | tee -a "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "== $name exit $rc" | tee -a "$out/$name.log"
  [ "$rc" -eq 0 ] || status=1
}
{ nvidia-smi; nvidia-smi --query-gpu=name,compute_mode --format=csv; date -u;
  git log -1 --oneline; } > "$out/machine.log" 2>&1
bash scripts/setup.sh > "$out/setup.log" 2>&1 || { cat "$out/setup.log"; exit 1; }
for p in $phases; do
  case $p in
    tests) run tests python3 -m pytest -q -rs "${per_test[@]}" tests ;;
    ring) run ring python3 bench/ring.py --json "$out/ring.json" --plot "$out/ring.png" ;;
    resnet18) run resnet18 python3 bench/resnet18.py --device cuda:0 --ranks 4 --json "$out/resnet18.json" ;;
    ddp) run ddp python3 bench/ddp.py --device cuda --ranks 4 --json "$out/ddp.json" ;;
    *) echo "gpu_check: unknown phase '$p' (tests, ring, resnet18, ddp)" >&2; exit 2 ;;
  esac
done
exit $status
