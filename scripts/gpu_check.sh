#!/usr/bin/env bash
# What a session with the GPU machine runs, sized to the device tool's limits: 15 minutes of
# device time in all (the machine's start, 1-2 minutes, included), at most 10 minutes a
# command, the machine gone ~30 s after a command returns. docs/GPU_SESSION.md plans it.
#   bash scripts/gpu_check.sh              the first 15 minutes: ONE command, at most 9 minutes
#   bash scripts/gpu_check.sh PHASE...     the named phases, in order
# The default is `build smoke first bench gpu`:
#   build     scripts/setup.sh on every core (MAX_JOBS from nproc), sm_90, bounded by
#             BUILD_TIMEOUT (300 s); skipped when this tree's csrc/, setup.py and
#             ringreduce/_build.py were built on this machine already (a warm machine)
#   smoke     import, build_info, all_reduce on cuda:0 against a float64 reference: ring,
#             one-shot, ring with a stream per rank, copy hops; 2 and 4 simulated ranks (90 s)
#   first     scripts/gpu_first.txt: one test of every CUDA path (list API: ring, one-shot,
#             staged copy, graph replay, 2 and 4 ranks; the backend: 2 and 3 ranks on one GPU,
#             every collective, DDP steps against gloo, a killed rank)
#   bench     bench/ring.py, 4 simulated ranks, 8 B..64 MiB, against NCCL (the carried one, below)
#   gpu       every other GPU test, as far as CALL_BUDGET lets it go
# Further phases (a later session's): core backend review clients tests ring sweep train
# resnet18 ddp (docs/GPU_SESSION.md).
# Bounds: every phase by its own limit and by what is left of CALL_BUDGET (540 s from the
# start; the tool's own limit is 600 s): a phase left under 30 s is not started and says so.
# Every test by PER_TEST_TIMEOUT (120 s; tests/conftest.py lets the command line's --timeout
# apply). No -x: every phase runs all its tests and reports every failure. Logs go to
# ./gpu-logs (one per phase) and after every phase are packed into $OUT/gpu-logs.tgz beside
# $OUT/summary.txt (one line per phase), so a command that ends early still brings back what
# finished.
# NCCL: torch 2.11's NCCL (2.28.9) refuses several ranks on one GPU; 2.30 accepts them. When
# .nccl/libnccl.so.2.30.7.xz was carried (scripts/nccl_carry.sh puts it there, git-ignored;
# the device call names `.nccl` in carry), it is unpacked to /tmp and checked against its
# SHA256, and the benchmark phases run NCCL from it (RINGREDUCE_NCCL_LIB). A RINGREDUCE_NCCL_LIB
# set by the caller wins. The tests always run torch's own NCCL.
set -uo pipefail
cd "$(dirname "$0")/.."
export out=gpu-logs
rm -rf "$out" && mkdir -p "$out"
back=${OUT:-}
[ -z "$back" ] || mkdir -p "$back"
# RINGREDUCE_REQUIRE_CUDA: the GPU tests fail instead of skipping without a GPU or a CUDA build.
export PYTHONUNBUFFERED=1 RINGREDUCE_REQUIRE_CUDA=1 \
  NCCL_MULTI_RANK_GPU_ENABLE=${NCCL_MULTI_RANK_GPU_ENABLE:-1} \
  RINGREDUCE_CUDA_ARCH_LIST=${RINGREDUCE_CUDA_ARCH_LIST:-9.0} \
  MAX_JOBS=${MAX_JOBS:-$(nproc)}
limit=${PHASE_TIMEOUT:-540}
budget=${CALL_BUDGET:-540}
build_limit=${BUILD_TIMEOUT:-300}
per_test=(--timeout="${PER_TEST_TIMEOUT:-120}")
phases=${*:-build smoke first bench gpu}
status=0
note() {  # note NAME TEXT: one line in the summary, packed at once
  echo "$1: $2" | tee -a "$out/summary.txt"
  pack
}
run() {  # run NAME LIMIT CMD...: tee the output to $out/NAME.log and remember a failure
  local name=$1 cap=$2; shift 2
  local left=$(( budget - SECONDS - 10 ))
  if [ "$left" -lt 30 ]; then
    status=1
    note "$name" "not started: ${left} s left of CALL_BUDGET=${budget} s"
    return
  fi
  [ "$cap" -le "$left" ] || cap=$left
  echo "== $name (bound ${cap} s, at ${SECONDS} s): $*" | tee "$out/$name.log"
  if declare -F "$1" > /dev/null; then  # a function of this script: timeout needs a program
    set -- bash -c "$(declare -f); \"\$@\"" "$name" "$@"
  fi
  timeout -k 10 "$cap" "$@" 2>&1 | stamp | tee -a "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "== $name exit $rc (at ${SECONDS} s)" | tee -a "$out/$name.log"
  [ "$rc" -eq 0 ] || status=1
  local why=""
  [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && why=" (stopped at its ${cap} s bound)"
  [ "$rc" -gt 128 ] && [ "$rc" -ne 137 ] && why=" (killed by signal $(( rc - 128 )))"
  symbolize
  note "$name" "exit $rc$why; $(grep -E '(passed|failed|errors?|skipped)(,| in )|smoke: ([0-9]+ passed|FAIL)|FAILED' \
    "$out/$name.log" | tail -n 1 | sed -E 's/^\[ *[0-9]+ s\] //')"
}
stamp() {  # each line prefixed with the seconds since the script started: where time goes
  local line
  while IFS= read -r line; do printf '[%3d s] %s\n' "$SECONDS" "$line"; done
}
pack() {  # everything so far into $OUT, so that a later phase's hang loses nothing
  [ -n "$back" ] || return 0
  tar czf "$back/gpu-logs.tgz" -C "$out" . && cp "$out/summary.txt" "$back/summary.txt"
}
# The carried NCCL (see the header), unpacked once per machine.
carried=.nccl/libnccl.so.2.30.7.xz
if [ -z "${RINGREDUCE_NCCL_LIB:-}" ] && [ -f "$carried" ]; then
  lib=/tmp/ringreduce-nccl/libnccl.so.2
  if [ ! -f "$lib" ]; then
    mkdir -p /tmp/ringreduce-nccl && xz -dc "$carried" > "$lib.part" && mv "$lib.part" "$lib"
  fi
  want=$(awk '$2 ~ /libnccl\.so\.2\.30\.7$/ {print $1}' .nccl/SHA256SUMS 2>/dev/null)
  if [ -n "$want" ] && [ "$(sha256sum < "$lib" | cut -c1-64)" = "$want" ]; then
    export RINGREDUCE_BENCH_NCCL_LIB=$lib
    echo "gpu_check: benchmarks run NCCL 2.30.7 from $lib (carried, SHA256 checked)" | tee "$out/nccl.log"
  else
    echo "gpu_check: $carried unpacked, but its SHA256 is not .nccl/SHA256SUMS's; not used" | tee "$out/nccl.log"
  fi
fi
bench_nccl() {  # bench_nccl CMD...: CMD with the benchmarks' NCCL
  if [ -n "${RINGREDUCE_NCCL_LIB:-}" ]; then "$@"
  elif [ -n "${RINGREDUCE_BENCH_NCCL_LIB:-}" ]; then RINGREDUCE_NCCL_LIB=$RINGREDUCE_BENCH_NCCL_LIB "$@"
  else "$@"
  fi
}
# bench/ring.py at several rank counts and settings (a later session's phase).
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
{ nvidia-smi; nvidia-smi --query-gpu=name,compute_mode,driver_version --format=csv; date -u;
  git log -1 --oneline; nproc; python3 -c "import torch, setuptools; print('torch', torch.__version__,
  'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'setuptools', setuptools.__version__)";
  nvcc --version | tail -n 2; } > "$out/machine.log" 2>&1
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
  echo "gpu_check: MAX_JOBS=$MAX_JOBS RINGREDUCE_CUDA_ARCH_LIST=$RINGREDUCE_CUDA_ARCH_LIST"
  bash scripts/setup.sh && mkdir -p build && echo "$want" > build/gpu_check.stamp
}
# Crashes: every test process (spawned ranks too) is traced: faulthandler prints its Python
# stack, scripts/segv_backtrace.c (compiled here, preloaded) its native one, into
# gpu-logs/native/ as well as stderr; after each phase scripts/symbolize_backtraces.py resolves
# them against this build (gpu-logs/native.log). pytest-xdist, where installed (the GPU
# machine has it), runs the tests in a worker process that is replaced when it crashes, so one
# crash costs one test instead of the rest of the phase.
native=$PWD/$out/native
mkdir -p "$native"
traced=(env PYTHONFAULTHANDLER=1 SEGV_BACKTRACE_DIR="$native")
if mkdir -p /tmp/ringreduce-segv &&
   cc -shared -fPIC -O1 -o /tmp/ringreduce-segv/segv_backtrace.so scripts/segv_backtrace.c; then
  traced+=(LD_PRELOAD="/tmp/ringreduce-segv/segv_backtrace.so${LD_PRELOAD:+:$LD_PRELOAD}")
else
  echo "gpu_check: scripts/segv_backtrace.c did not compile: crashes show Python stacks only"
fi
isolate=()
python3 -c "import xdist" 2>/dev/null && isolate=(-n 1)
symbolize() {  # the native stacks so far, resolved against this build
  ls "$native"/segv-*.txt > /dev/null 2>&1 || return 0
  python3 scripts/symbolize_backtraces.py "$native"/segv-*.txt > "$out/native.log" 2>&1
}
pytest_phase() {  # pytest_phase NAME ARGS...: one bounded pytest run
  local name=$1; shift
  run "$name" "$limit" "${traced[@]}" python3 -m pytest -q -rs "${per_test[@]}" \
    -p no:cacheprovider "${isolate[@]}" "$@"
}
first=()
while read -r id; do
  case $id in ''|'#'*) ;; *) first+=("$id") ;; esac
done < scripts/gpu_first.txt
# Every GPU test file; `-k` keeps the GPU tests of the files that hold CPU tests too.
GPU_FILES=(tests/test_cuda.py tests/test_cuda_review.py tests/test_distributed_cuda.py
           tests/test_backend_cuda_streams.py tests/test_distributed.py
           tests/test_distributed_surface.py tests/test_data_parallel.py tests/test_train.py
           tests/test_bench_ring.py tests/test_fused.py)
for p in $phases; do
  case $p in
    build) run build "$build_limit" build
           [ -f build/gpu_check.stamp ] || { note gpu_check "no build: later phases not run"; exit 1; } ;;
    smoke) run smoke 90 "${traced[@]}" python3 scripts/gpu_smoke.py ;;
    first) pytest_phase first "${first[@]}" ;;
    bench) run bench 150 bench_nccl python3 bench/ring.py --device cuda --ranks 4 --max-bytes 64M \
             --json "$out/bench.json" ;;
    gpu) deselect=()
         for id in "${first[@]}"; do deselect+=(--deselect "$id"); done
         pytest_phase gpu "${GPU_FILES[@]}" -k "cuda or graph or gpu" "${deselect[@]}" ;;
    core) pytest_phase core tests/test_cuda.py ;;
    backend) pytest_phase backend tests/test_distributed_cuda.py tests/test_backend_cuda_streams.py \
               tests/test_distributed.py tests/test_distributed_surface.py -k cuda ;;
    review) pytest_phase review tests/test_cuda_review.py ;;
    clients) pytest_phase clients tests/test_data_parallel.py tests/test_train.py \
               tests/test_bench_ring.py -k "cuda or graph" ;;
    tests) pytest_phase tests tests ;;
    ring) run ring "$limit" bench_nccl python3 bench/ring.py --graph --json "$out/ring.json" ;;
    sweep) run sweep "$limit" bench_nccl sweep ;;
    train) run train "$limit" train ;;
    resnet18) run resnet18 "$limit" bench_nccl python3 bench/resnet18.py --device cuda:0 --ranks 4 \
                --json "$out/resnet18.json" ;;
    ddp) run ddp "$limit" bench_nccl python3 bench/ddp.py --device cuda --ranks 4 --json "$out/ddp.json" ;;
    *) echo "gpu_check: unknown phase '$p' (build, smoke, first, bench, gpu, core, backend," \
         "review, clients, tests, ring, sweep, train, resnet18, ddp)" >&2
       exit 2 ;;
  esac
done
exit $status
