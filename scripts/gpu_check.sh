#!/usr/bin/env bash
# What a session with the GPU machine runs, phase by phase, sized to the device tool's limits
# (10 minutes a command, 30-45 minutes a session, the machine kept only ~30 s between calls):
#   bash scripts/gpu_check.sh PHASE...      (docs/GPU_SESSION.md plans a session)
# Phases, each small enough for one call beside the build:
#   build     scripts/setup.sh (sm_90); skipped when this tree's csrc/, setup.py and
#             ringreduce/_build.py were built already on this machine (a call made while the
#             last one's machine is still warm)
#   smoke     import, build_info, all_reduce on cuda:0 against a float64 reference: ring,
#             one-shot, staged (copy) hops; 2 and 4 simulated ranks
#   core      the list API's GPU tests (tests/test_cuda.py)
#   backend   the torch.distributed backend on CUDA (test_distributed_cuda.py,
#             test_backend_cuda_streams.py, and -k cuda of
#             test_distributed.py and test_distributed_surface.py)
#   review    tests/test_cuda_review.py
#   clients   -k "cuda or graph" of test_data_parallel.py, test_train.py, test_bench_ring.py
#   tests     the whole suite (may need more than one call: it stops at its bound)
#   ring sweep train resnet18 ddp   the benchmarks
# No argument: build smoke core. Every phase is bounded: by its own limit (build 420 s, smoke
# 120 s, others PHASE_TIMEOUT, 540 s), by 120 s per test (pytest-timeout), and by what is left
# of CALL_BUDGET (570 s from the start, under the tool's 600 s): a phase that would get less
# than 30 s is not started and says so. Logs go to ./gpu-logs (one per phase) and after every
# phase are packed into $OUT/gpu-logs.tgz with $OUT/summary.txt, one line per phase, so a
# call that ends early still brings back what finished.
set -uo pipefail
cd "$(dirname "$0")/.."
export out=gpu-logs
rm -rf "$out" && mkdir -p "$out"
back=${OUT:-}
# RINGREDUCE_REQUIRE_CUDA: the GPU tests fail instead of skipping without a GPU or a CUDA build.
# The build is for sm_90 only unless RINGREDUCE_CUDA_ARCH_LIST says otherwise.
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
budget=${CALL_BUDGET:-570}
per_test=()
python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout=120)
phases=${*:-build smoke core}
status=0
note() {  # note NAME TEXT: one line in the summary, packed at once
  echo "$1: $2" | tee -a "$out/summary.txt"
  pack
}
run() {  # run NAME LIMIT CMD...: tee the output to $out/NAME.log and remember a failure
  local name=$1 cap=$2; shift 2
  local left=$(( budget - SECONDS - 15 ))
  if [ "$left" -lt 30 ]; then
    status=1
    note "$name" "not started: ${left} s left of CALL_BUDGET=${budget} s; run it in the next call"
    return
  fi
  [ "$cap" -le "$left" ] || cap=$left
  echo "== $name (bound ${cap} s): $*" | tee "$out/$name.log"
  if declare -F "$1" > /dev/null; then  # a function of this script: timeout needs a program
    set -- bash -c "$(declare -f "$1"); $1"
  fi
  timeout -k 10 "$cap" "$@" 2>&1 | tee -a "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "== $name exit $rc" | tee -a "$out/$name.log"
  [ "$rc" -eq 0 ] || status=1
  local why=""
  [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && why=" (stopped at its ${cap} s bound)"
  note "$name" "exit $rc$why; $(grep -E '(passed|failed|error)(,| in )|Out of bounds|FAILED' \
    "$out/$name.log" | tail -n 1)"
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
# The build, skipped when this tree's sources were built here already (the device machine
# keeps ignored build outputs between calls while it stays warm).
build() {
  local want
  want=$(cat setup.py ringreduce/_build.py $(find csrc -type f | sort) | sha1sum | cut -c1-40)
  if [ "$(cat build/gpu_check.stamp 2>/dev/null)" = "$want" ] &&
     python3 -c "import ringreduce, sys; sys.exit(not ringreduce.build_info()['cuda'])"; then
    echo "gpu_check: build of $want is up to date; not rebuilt"
    return 0
  fi
  rm -f build/gpu_check.stamp
  bash scripts/setup.sh && mkdir -p build && echo "$want" > build/gpu_check.stamp
}
pytest_phase() {  # pytest_phase NAME ARGS...: one bounded pytest run
  local name=$1; shift
  run "$name" "$limit" python3 -m pytest -q -rs "${per_test[@]}" "$@"
}
for p in $phases; do
  case $p in
    build) run build 420 build
           [ -f build/gpu_check.stamp ] || { note gpu_check "no build: later phases not run"; exit 1; } ;;
    smoke) run smoke 120 python3 scripts/gpu_smoke.py ;;
    core) pytest_phase core tests/test_cuda.py ;;
    backend) pytest_phase backend tests/test_distributed_cuda.py tests/test_backend_cuda_streams.py \
               tests/test_distributed.py \
               tests/test_distributed_surface.py -k cuda ;;
    review) pytest_phase review tests/test_cuda_review.py ;;
    clients) pytest_phase clients tests/test_data_parallel.py tests/test_train.py \
               tests/test_bench_ring.py -k "cuda or graph" ;;
    tests) pytest_phase tests tests ;;
    ring) run ring "$limit" python3 bench/ring.py --graph --json "$out/ring.json" --plot "$out/ring.png" ;;
    sweep) run sweep "$limit" sweep ;;
    train) run train "$limit" train ;;
    resnet18) run resnet18 "$limit" python3 bench/resnet18.py --device cuda:0 --ranks 4 \
                --json "$out/resnet18.json" ;;
    ddp) run ddp "$limit" python3 bench/ddp.py --device cuda --ranks 4 --json "$out/ddp.json" ;;
    *) echo "gpu_check: unknown phase '$p' (build, smoke, core, backend, review, clients," \
         "tests, ring, sweep, train, resnet18, ddp)" >&2
       exit 2 ;;
  esac
done
exit $status
