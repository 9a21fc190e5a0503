#!/usr/bin/env bash
# Everything a session with the GPU machine should run, in one device call:
#   bash scripts/gpu_check.sh [gputests] [ring] [sweep] [train] [resnet18] [ddp] [tests]
#   (no argument: all seven; gputests is the GPU test files, tests the whole suite; each phase
#   fits one device call on its own; docs/GPU_SESSION.md plans a session)
# Logs and JSON go to ./gpu-logs; after every phase they are packed into $OUT/gpu-logs.tgz with
# a one-line-per-phase $OUT/summary.txt (the device tool brings back at most 8 files from $OUT).
set -uo pipefail
cd "$(dirname "$0")/.."
export out=gpu-logs
rm -rf "$out" && mkdir -p "$out"
back=${OUT:-}
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
phases=${*:-gputests ring sweep train resnet18 ddp tests}
status=0
run() {  # run NAME CMD...: tee the output to $out/NAME.log and remember a failure
  local name=$1; shift
  echo "== $name: $*" | tee "$out/$name.log"
  if declare -F "$1" > /dev/null; then  # a function of this script: timeout needs a program
    set -- bash -c "$(declare -f "$1"); $1"
  fi
  timeout "$limit" "$@" 2>&1 | tee -a "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "== $name exit $rc" | tee -a "$out/$name.log"
  [ "$rc" -eq 0 ] || status=1
  echo "$name: exit $rc; $(grep -E '(passed|failed|error)(,| in )|Out of bounds|FAILED' \
    "$out/$name.log" | tail -n 1)" >> "$out/summary.txt"
  pack
}
pack() {  # everything so far into $OUT, so that a later phase's hang loses nothing
  [ -n "$back" ] || return 0
  tar czf "$back/gpu-logs.tgz" -C "$out" . && cp "$out/summary.txt" "$back/summary.txt"
}
# bench/ring.py at several rank counts and settings: time per call from 8 B to 64 KiB (eager
# and replayed from a CUDA graph) for N = 2, 4, 8; the ring alone at every size
# (RINGREDUCE_ONESHOT_BYTES=0) against the copy roofline; and the copy transport.
sweep() {
  local n
  for n in 2 4 8; do
    python3 bench/ring.py --ranks "$n" --max-bytes 64K --graph --json "$out/small-$n.json" ||
      return 1
  done
  RINGREDUCE_ONESHOT_BYTES=0 python3 bench/ring.py --graph --json "$out/ring-only.json" ||
    return 1
  RINGREDUCE_TRANSPORT=copy python3 bench/ring.py --json "$out/copy.json"
}
# One epoch of the trainer with the ring and the naive all-reduce, 2 simulated ranks.
train() {
  local a
  for a in ring naive; do
    python3 -m ringreduce.train --device cuda:0 --ranks 2 --epochs 1 --allreduce "$a" || return 1
  done
}
{ nvidia-smi; nvidia-smi --query-gpu=name,compute_mode --format=csv; date -u;
  git log -1 --oneline; python3 -c "import torch; print('torch', torch.__version__,
  'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"; } > "$out/machine.log" 2>&1
bash scripts/setup.sh > "$out/setup.log" 2>&1 || { cat "$out/setup.log"; pack; exit 1; }
for p in $phases; do
  case $p in
    gputests) run gputests python3 -m pytest -q -rs "${per_test[@]}" tests/test_cuda.py \
      tests/test_cuda_review.py tests/test_distributed_cuda.py tests/test_bench_ring.py ;;
    tests) run tests python3 -m pytest -q -rs "${per_test[@]}" tests ;;
    ring) run ring python3 bench/ring.py --graph --json "$out/ring.json" --plot "$out/ring.png" ;;
    sweep) run sweep sweep ;;
    train) run train train ;;
    resnet18) run resnet18 python3 bench/resnet18.py --device cuda:0 --ranks 4 --json "$out/resnet18.json" ;;
    ddp) run ddp python3 bench/ddp.py --device cuda --ranks 4 --json "$out/ddp.json" ;;
    *) echo "gpu_check: unknown phase '$p' (gputests, ring, sweep, train, resnet18, ddp," \
         "tests)" >&2
       exit 2 ;;
  esac
done
exit $status
