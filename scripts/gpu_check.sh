#!/usr/bin/env bash
# What a session with the GPU machine runs, sized to the device tool's limits: 15 minutes of
# device time in all (the machine's start, 1-2 minutes, included), at most 10 minutes a
# command, the machine gone ~30 s after a command returns. docs/GPU_SESSION.md plans it.
#   bash scripts/gpu_check.sh              ONE command of at most 9 minutes (CALL_BUDGET 540 s)
#   bash scripts/gpu_check.sh PHASE...     the named phases, in order
#   bash scripts/gpu_check.sh --plan       the default phases and their caps; runs nothing
# The default, in order of value (each phase capped: CAP below; the caps of all but `gpu` add
# up to 480 s with a carried build, 60 s under CALL_BUDGET; `gpu` takes what is left):
#   build     a build carried from the developer's machine (ringreduce/_C*.so, _dist_C*.so and
#             build/gpu_check.stamp in the device call's carry: docs/GPU_SESSION.md), import-
#             checked here; built here (scripts/setup.sh on every core, sm_90) only when there is
#             none for this tree or it fails to import: BUILD_TIMEOUT (150 s; 111 s seen)
#   smoke     import, build_info, all_reduce on cuda:0 against a float64 reference: ring,
#             one-shot, ring with a stream per rank, copy hops; 2 and 4 simulated ranks
#   crash     scripts/gpu_crash.txt: the tests that crashed on the last GPU run, each in a
#             pytest process of its own (a crash costs one test), native stacks resolved
#   bench     bench/ring.py, ringreduce alone: 4 simulated ranks 8 B..256 MiB, then 8 ranks
#             1 MiB..256 MiB, each with the one-shot kernel forced as a column (ringreduce-oneshot)
#   nccl      bench/ring.py, NCCL alone in runs of their own (4 ranks, then 8), its CTAs capped
#             so that every rank's kernel fits on the GPU at once, NCCL_DEBUG=INFO into
#             gpu-logs/nccl/, every wait bounded (--deadline): a hang ends the run, not the phase
#   resnet18  bench/resnet18.py: ResNet-18's gradients on 4 simulated ranks, ring and naive,
#             then ring against NCCL (its own run, so a hang there keeps the first)
#   train     python -m ringreduce.train, 4 simulated ranks, 5 steps with each all-reduce
#             (ring, naive, then nccl)
#   first     scripts/gpu_first.txt: one test of every other CUDA path (list API: ring, one-shot,
#             staged copy, graph replay, 2 and 4 ranks; the backend: 2 and 3 ranks on one GPU,
#             every collective, DDP steps against gloo; the clients)
#   gpu       every other GPU test, as far as CALL_BUDGET lets it go
# Further phases (a later session's): core backend review clients tests ring sweep ddp load half
# (docs/GPU_SESSION.md).
# Bounds: every phase by its cap and by what is left of CALL_BUDGET (540 s from the start; the
# tool's own limit is 600 s): a phase left under 30 s is not started and says so.
# Every test by PER_TEST_TIMEOUT (120 s; tests/conftest.py lets the command line's --timeout
# apply). No -x: every phase runs all its tests and reports every failure. Logs go to
# ./gpu-logs (one per phase) and after every phase are packed into $OUT/gpu-logs.tgz beside
# $OUT/summary.txt (one line per phase), so a command that ends early still brings back what
# finished; the benchmarks' JSON is rewritten after every size, so a phase stopped at its cap
# still brings back the sizes it finished, and SIGTERM makes them print their Python stacks.
# NCCL: torch 2.11's NCCL (2.28.9) refuses several ranks on one GPU; 2.30 accepts them. When
# .nccl/libnccl.so.2.30.7.xz was carried (scripts/nccl_carry.sh puts it there, git-ignored;
# the device call names `.nccl` in carry), it is unpacked to /tmp and checked against its
# SHA256, and the benchmark phases run NCCL from it (RINGREDUCE_NCCL_LIB). A RINGREDUCE_NCCL_LIB
# set by the caller wins. The tests always run torch's own NCCL.
set -uo pipefail
cd "$(dirname "$0")/.."
DEFAULT_PHASES="build smoke crash bench nccl resnet18 train first gpu"
# Each phase's cap in seconds (a named phase outside the default: PHASE_TIMEOUT). `gpu` has none
# of its own: it takes what is left of CALL_BUDGET. build: CAP_BUILD_CARRIED for the import check
# of a carried build, BUILD_TIMEOUT where it must build. SMOKE_TIMEOUT: CI's slower rehearsal.
declare -A CAP=([smoke]=${SMOKE_TIMEOUT:-40} [crash]=100 [bench]=90 [nccl]=70 [resnet18]=50
                [train]=45 [first]=55)
CAP_BUILD_CARRIED=30
build_limit=${BUILD_TIMEOUT:-150}
budget=${CALL_BUDGET:-540}
if [ "${1:-}" = --plan ]; then
  echo "budget $budget"
  echo "build $CAP_BUILD_CARRIED carried, $build_limit building"
  for p in $DEFAULT_PHASES; do
    [ "$p" = build ] || echo "$p ${CAP[$p]:-rest}"
  done
  exit 0
fi
export out=gpu-logs
rm -rf "$out" && mkdir -p "$out"
back=${OUT:-}
[ -z "$back" ] || mkdir -p "$back"
# RINGREDUCE_REQUIRE_CUDA: the GPU tests fail instead of skipping without a GPU or a CUDA build.
# PYTHONPATH: a carried build is not installed; the tree's ringreduce/ is imported from here on.
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 RINGREDUCE_REQUIRE_CUDA=1 \
  NCCL_MULTI_RANK_GPU_ENABLE=${NCCL_MULTI_RANK_GPU_ENABLE:-1} \
  RINGREDUCE_CUDA_ARCH_LIST=${RINGREDUCE_CUDA_ARCH_LIST:-9.0} \
  MAX_JOBS=${MAX_JOBS:-$(nproc)}
limit=${PHASE_TIMEOUT:-540}
per_test=(--timeout="${PER_TEST_TIMEOUT:-120}")
phases=${*:-$DEFAULT_PHASES}
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
  export PHASE_CAP=$cap  # the phase's functions share it out among their runs
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
  note "$name" "exit $rc$why; $(grep -E '(passed|failed|errors?|skipped)(,| in )|smoke: ([0-9]+ passed|FAIL)|FAILED|result: ' \
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
  python3 bench/ring.py --impls ringreduce,fused --json "$out/fused.json" || return 1
  # Four packs in flight per step-kernel thread (read once per process: a run of its own),
  # ringreduce alone, where the step is latency-bound; compare with ring-only.json's sizes.
  RINGREDUCE_ONESHOT_BYTES=0 RINGREDUCE_CUDA_STEP_UNROLL=4 python3 bench/ring.py --impls ringreduce \
    --min-bytes 256K --max-bytes 256M --json "$out/unroll4.json" || return 1
  # bfloat16 sums (issue 47): rounded per hop (the default) against rounded once (the one-shot
  # at every size on one stream; the two-shot under the copy transport), ringreduce alone.
  python3 bench/ring.py --impls ringreduce --dtype bfloat16 --min-bytes 1K \
    --json "$out/bf16-per-hop.json" || return 1
  RINGREDUCE_CUDA_HALF_ROUNDING=once python3 bench/ring.py --impls ringreduce --dtype bfloat16 \
    --min-bytes 1K --json "$out/bf16-once.json" || return 1
  RINGREDUCE_CUDA_HALF_ROUNDING=once RINGREDUCE_TRANSPORT=copy python3 bench/ring.py \
    --impls ringreduce --dtype bfloat16 --min-bytes 1K --json "$out/bf16-once-copy.json" ||
    return 1
  RINGREDUCE_TRANSPORT=copy python3 bench/ring.py --json "$out/copy.json"
}
# left: the seconds left of this phase (PHASE_CAP, exported by run; SECONDS counts from the
# phase's own shell), 10 s kept back: a run ends (timeout -k 3) before its phase's bound.
left() { echo $(( PHASE_CAP - SECONDS - 10 )); }
# bounded SECONDS CMD...: CMD within SECONDS (at least 5); a Python run stopped there prints its
# stacks (SIGTERM: faulthandler) and the phase goes on with its next run.
bounded() {
  local cap=$(( $1 > 5 ? $1 : 5 )); shift
  echo "gpu_check: (bound ${cap} s) $*"
  timeout -k 3 "$cap" "$@"
}
# ring_runs WHAT IMPLS DEADLINE: bench/ring.py at 4 ranks 8 B..256 MiB (60% of the phase), then
# 8 ranks 1 MiB..256 MiB (the rest), JSON in $out/WHAT-4.json and WHAT-8.json, rewritten after
# every size. --budget: no size is started that would end past the run's bound (12 s kept for
# Python's start); --deadline: every wait for the GPU, so that a hang ends the run at once.
ring_runs() {
  local what=$1 impls=$2 deadline=$3 cap r4 r8
  cap=$(( $(left) * 6 / 10 ))
  bounded "$cap" python3 bench/ring.py --device cuda --ranks 4 --impls "$impls" --max-bytes 256M \
    --budget $(( cap > 24 ? cap - 12 : 12 )) --deadline "$deadline" --json "$out/$what-4.json"
  r4=$?
  cap=$(left)
  bounded "$cap" python3 bench/ring.py --device cuda --ranks 8 --impls "$impls" --min-bytes 1M \
    --max-bytes 256M --budget $(( cap > 24 ? cap - 12 : 12 )) --deadline "$deadline" \
    --json "$out/$what-8.json"
  r8=$?
  echo "result: 4 ranks exit $r4, 8 ranks exit $r8 (bench/ring.py: 0 all right, 1 wrong or" \
    "failed, 3 hung, 4 budget spent; 124 stopped at its bound)"
  [ "$r4" -eq 0 ] && [ "$r8" -eq 0 ]
}
# The benchmark's phases: ringreduce alone with the one-shot kernel forced as a column; then NCCL
# alone, its CTAs capped by bench/ring.py (NCCL_MAX_CTAS: ringreduce/train/nccl.py) and its own
# log (NCCL_DEBUG=INFO) in gpu-logs/nccl/, packed with the rest.
bench_ring() { ring_runs bench ringreduce,oneshot 30; }
nccl_log() {  # nccl_log NAME: NCCL's INFO log into $out/nccl/NAME.<host>.<pid>.log
  mkdir -p "$out/nccl"
  export NCCL_DEBUG=${NCCL_DEBUG:-INFO}
  export NCCL_DEBUG_FILE=${NCCL_DEBUG_FILE:-$PWD/$out/nccl/$1.%h.%p.log}
}
bench_nccl_alone() { nccl_log bench; ring_runs nccl nccl 20; }
# ResNet-18's gradients on 4 simulated ranks: ring and naive (and ringreduce.DataParallel), then
# ring against NCCL in a run of its own, so that a hang of NCCL keeps the first table.
resnet18() {
  local r1 r2
  nccl_log resnet18
  bounded $(( $(left) / 2 )) python3 bench/resnet18.py --device cuda:0 --ranks 4 \
    --methods ring,naive --iters 10 --warmup 3 --steps 5 --step-warmup 2 \
    --json "$out/resnet18.json"
  r1=$?
  bounded "$(left)" python3 bench/resnet18.py --device cuda:0 --ranks 4 --methods ring,nccl \
    --wrappers "" --iters 10 --warmup 3 --steps 5 --step-warmup 2 --json "$out/resnet18-nccl.json"
  r2=$?
  echo "result: ring and naive exit $r1, ring and nccl exit $r2"
  [ "$r1" -eq 0 ] && [ "$r2" -eq 0 ]
}
# The backend's CUDA all-reduce beside a CPU load (issue 49): bench/load.py on 4 simulated ranks,
# one busy loop per core in the ranks' session, quiet then busy; ringreduce alone, then NCCL alone
# (a run of its own, so that a hang there keeps the first). Each may take half of the phase.
load_runs() {
  local r1 r2
  bounded $(( $(left) / 2 )) python3 bench/load.py --device cuda --ranks 4 --backends ringreduce \
    --session same --loads busy --json "$out/load.json"
  r1=$?
  nccl_log load
  bounded "$(left)" python3 bench/load.py --device cuda --ranks 4 --backends nccl \
    --session same --loads busy --json "$out/load-nccl.json"
  r2=$?
  echo "result: ringreduce exit $r1, nccl exit $r2"
  [ "$r1" -eq 0 ] && [ "$r2" -eq 0 ]
}
# The trainer, 4 simulated ranks, 5 steps of one epoch with each all-reduce; NCCL last, so that
# a hang there costs the others nothing. Each run may take half of what is left, the last all.
train() {
  local a n=2 result=""
  nccl_log train
  for a in ring naive nccl; do
    bounded $(( $(left) / n )) python3 -m ringreduce.train --device cuda:0 --ranks 4 --epochs 1 \
      --max-steps 5 --allreduce "$a" --quiet
    result+=" $a exit $?"
    n=1
  done
  echo "result:$result"
  [[ "$result" != *"exit "[1-9]* ]]
}
# The tests that crashed last time (scripts/gpu_crash.txt), each in a pytest process of its own,
# at most 45 s each; the arguments are the tracing prefix (env ... LD_PRELOAD=...).
crash() {
  local ids=() id passed=0 failed=0 failing=""
  while read -r id; do
    case $id in ''|'#'*) ;; *) ids+=("$id") ;; esac
  done < scripts/gpu_crash.txt
  for id in "${ids[@]}"; do
    if [ "$(left)" -lt 10 ]; then
      failing+=" $id (not started: the phase's time is spent)"; failed=$(( failed + 1 )); continue
    fi
    if bounded $(( $(left) < 45 ? $(left) : 45 )) "$@" python3 -m pytest -q -rs --timeout=40 \
         -p no:cacheprovider "$id"; then
      passed=$(( passed + 1 ))
    else
      failed=$(( failed + 1 )); failing+=" $id"
    fi
  done
  echo "result: $passed passed, $failed failed of ${#ids[@]}${failing:+; failed:$failing}"
  [ "$failed" -eq 0 ]
}
{ nvidia-smi; nvidia-smi --query-gpu=name,compute_mode,driver_version --format=csv; date -u;
  git log -1 --oneline; nproc; python3 -c "import torch, setuptools; print('torch', torch.__version__,
  'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'setuptools', setuptools.__version__)";
  nvcc --version | tail -n 2; } > "$out/machine.log" 2>&1
# The build, skipped when this tree's sources were built here already (the device machine
# keeps ignored build outputs between calls while it stays warm).
build() {
  local want
  want=$(cat setup.py ringreduce/_build.py $(find csrc -type f | LC_ALL=C sort) | sha1sum |
         cut -c1-40)
  if [ "$(cat build/gpu_check.stamp 2>/dev/null)" = "$want" ]; then
    # A carried build (or one made here while the machine stayed warm): imported, not rebuilt.
    if timeout -k 5 60 python3 -c "import ringreduce, sys; from ringreduce import _dist_C; \
         info = ringreduce.build_info(); print('gpu_check: build_info', info); \
         sys.exit(not info['cuda'])"; then
      echo "gpu_check: the build of this tree ($want) imports; not rebuilt"
      return 0
    fi
    echo "gpu_check: the build of this tree ($want) does not import: building here"
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
crashed=()
while read -r id; do
  case $id in ''|'#'*) ;; *) crashed+=("$id") ;; esac
done < scripts/gpu_crash.txt
# Every GPU test file; `-k` keeps the GPU tests of the files that hold CPU tests too.
GPU_FILES=(tests/test_cuda.py tests/test_cuda_review.py tests/test_distributed_cuda.py
           tests/test_backend_cuda_streams.py tests/test_distributed.py
           tests/test_distributed_surface.py tests/test_data_parallel.py tests/test_train.py
           tests/test_bench_ring.py tests/test_fused.py tests/test_bench_load.py
           tests/test_bench_half_error.py)
for p in $phases; do
  case $p in
    build) run build "$build_limit" build
           [ -f build/gpu_check.stamp ] || { note gpu_check "no build: later phases not run"; exit 1; } ;;
    smoke) run smoke "${CAP[smoke]}" "${traced[@]}" python3 scripts/gpu_smoke.py ;;
    crash) run crash "${CAP[crash]}" crash "${traced[@]}" ;;
    first) run first "${CAP[first]}" "${traced[@]}" python3 -m pytest -q -rs "${per_test[@]}" \
             -p no:cacheprovider "${isolate[@]}" "${first[@]}" ;;
    bench) run bench "${CAP[bench]}" bench_ring ;;
    nccl) run nccl "${CAP[nccl]}" bench_nccl bench_nccl_alone ;;
    resnet18) run resnet18 "${CAP[resnet18]}" bench_nccl resnet18 ;;
    train) run train "${CAP[train]}" bench_nccl train ;;
    gpu) deselect=()
         for id in "${first[@]}" "${crashed[@]}"; do deselect+=(--deselect "$id"); done
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
    ddp) run ddp "$limit" bench_nccl python3 bench/ddp.py --device cuda --ranks 4 --json "$out/ddp.json" ;;
    load) run load "$limit" bench_nccl load_runs ;;
    half) run half "$limit" bench_nccl python3 bench/half_error.py --device cuda --inputs resnet18 \
            --peers gloo,nccl ;;
    *) echo "gpu_check: unknown phase '$p' (build, smoke, crash, bench, nccl, resnet18, train," \
         "first, gpu, core, backend, review, clients, tests, ring, sweep, ddp, load, half)" >&2
       exit 2 ;;
  esac
done
exit $status
