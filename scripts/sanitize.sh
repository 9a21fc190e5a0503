#!/usr/bin/env bash
# The backend's failure scenarios under AddressSanitizer (or ThreadSanitizer), on CPU:
#   bash scripts/sanitize.sh [address|thread] [extra pytest arguments]
# The extension is compiled at first import with RINGREDUCE_SANITIZE (ringreduce/_build.py) into
# a cache of its own, from a copy of this tree that holds no prebuilt library, and every rank
# runs with the sanitizer's runtime preloaded (spawned ranks inherit it). A report in any rank
# aborts that rank, and the test that spawned it fails. CI runs it where RINGREDUCE_CI_SANITIZE=1
# (.ci/run); a clean run is recorded in bench/RESULTS.md.
# Scenarios: a rank killed, gone through os._exit or hung; a peer aborted (also from another
# thread); an error inside the engine; queued work failed by a dead peer; teardown after each;
# the synchronous failures again through the progress thread (RINGREDUCE_CALLER_RUNS=0);
# shrinking and splitting groups.
set -euo pipefail
cd "$(dirname "$0")/.."
sanitizer=${1:-address}
shift || true
PY=${PYTHON:-python3}
CXX=${CXX:-c++}
case "$sanitizer" in
  address) runtime=libasan.so ;;
  thread) runtime=libtsan.so ;;
  *) echo "sanitize.sh: address or thread, not $sanitizer" >&2; exit 2 ;;
esac
lib=$($CXX -print-file-name=$runtime)
[ -f "$lib" ] || { echo "sanitize.sh: $CXX has no $runtime" >&2; exit 1; }

export RINGREDUCE_SANITIZE=$sanitizer
export RINGREDUCE_CACHE_DIR=${RINGREDUCE_SANITIZE_CACHE:-$HOME/.cache/ringreduce-$sanitizer}
# The copy lives beside the cache, at a fixed path (the build directory is keyed by the sources'
# paths), laid anew each run with the files' times kept, so that a rerun recompiles only what
# changed (a full sanitizer build takes ~12 minutes on 2 cores).
work=$RINGREDUCE_CACHE_DIR/tree
rm -rf "$work" && mkdir -p "$work"
git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf - | tar -xf - -C "$work"
export PYTHONPATH=$work${PYTHONPATH:+:$PYTHONPATH}
# Leaks: Python and torch keep much until exit by design; the scenarios look for memory errors.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:abort_on_error=1:print_summary=1}
export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:report_signal_unsafe=0}
# The runtime must come first in every process that loads the instrumented library, the one
# that compiles it at import included (the compilers run with it preloaded too, harmlessly).
# libstdc++ with it: Python does not link it, and the runtime's __cxa_throw interceptor finds
# nothing to forward to when it is loaded only later ("CHECK failed ... real___cxa_throw").
stdcxx=$($CXX -print-file-name=libstdc++.so.6)
export LD_PRELOAD=$lib:$stdcxx${LD_PRELOAD:+:$LD_PRELOAD}
cd "$work"
$PY -c "import ringreduce; from ringreduce import _dist_C; print('sanitize.sh: built', _dist_C.__file__)"
$PY -m pytest -q -rs -p no:cacheprovider --timeout=600 \
  "tests/test_distributed.py::test_lost_rank_fails_within_timeout" \
  "tests/test_distributed.py::test_teardown_does_not_wait_for_a_lost_peer" \
  "tests/test_distributed.py::test_abort_from_another_thread_stops_a_waiting_collective" \
  "tests/test_engine.py::test_error_in_engine_fails_the_group_and_peers_fast" \
  "tests/test_engine.py::test_abort_fails_queued_work_and_shutdown_returns" \
  "tests/test_engine.py::test_dead_peer_fails_every_queued_work_on_every_survivor" \
  "tests/test_engine.py::test_caller_runs_knob_sends_every_collective_through_the_progress_thread" \
  "tests/test_engine.py::test_completion_thread_outlives_its_group" \
  "tests/test_group_ops.py::test_shrink_after_a_rank_is_killed_in_ddp_training" \
  "tests/test_group_ops.py::test_shrink_abort_after_a_rank_is_killed_in_ddp_training" \
  "tests/test_group_ops.py::test_split_group_makes_working_subgroups" \
  "$@"
