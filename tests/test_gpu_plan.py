"""The tools of a GPU session (scripts/gpu_check.sh), checked where there is no GPU: the `first`
selection names tests that exist, and a crash in a test process leaves a native stack that
resolves to the crashing function.

A GPU session is 15 minutes once in a while: a test id that no longer exists (pytest then
errors out of the whole phase) or a crash report that says nothing would waste it.
"""
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIRST = os.path.join(ROOT, "scripts", "gpu_first.txt")
CC = shutil.which("cc") or shutil.which("gcc")


CRASH = os.path.join(ROOT, "scripts", "gpu_crash.txt")
GPU_CHECK = os.path.join(ROOT, "scripts", "gpu_check.sh")


def ids_in(path):
    with open(path) as f:
        return [line.strip() for line in f if line.strip() and not line.startswith("#")]


def first_ids():
    return ids_in(FIRST)


def test_first_selection_names_existing_tests():
    """Both selections (`first`, and `crash`: the tests that crashed last time) name tests that
    exist, each once: none in both (phase `gpu` deselects both)."""
    ids = first_ids() + ids_in(CRASH)
    assert len(ids) == len(set(ids)), "an id is listed twice"
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "-p", "no:cacheprovider", *ids],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    collected = {line.strip() for line in proc.stdout.splitlines() if "::" in line}
    assert collected == set(ids), f"not collected: {sorted(set(ids) - collected)}"


CRASHER = r"""
#include <stdlib.h>
__attribute__((noinline)) void ringreduce_plan_crash_here(volatile int *p) { *p = 1; }
__attribute__((visibility("default"))) void ringreduce_plan_crash(void) {
  ringreduce_plan_crash_here((volatile int *)0);
}
__attribute__((noinline)) void ringreduce_plan_abort_here(volatile int *p) {
  if (*p == 0) abort();
}
__attribute__((visibility("default"))) void ringreduce_plan_abort(void) {
  volatile int zero = 0;
  ringreduce_plan_abort_here(&zero);
}
"""
# What each crash is: the function called (which calls <it>_here), the signal, faulthandler's
# words for it.
CRASHES = {"segv": ("ringreduce_plan_crash", 11, "Segmentation fault"),
           "abort": ("ringreduce_plan_abort", 6, "Aborted")}


@pytest.mark.skipif(CC is None or not sys.platform.startswith("linux"),
                    reason="needs a C compiler on Linux")
@pytest.mark.parametrize("faulthandler", ["on", "off"])
@pytest.mark.parametrize("kind", sorted(CRASHES))
def test_a_crash_leaves_a_native_stack_that_resolves(tmp_path, faulthandler, kind):
    """The preloaded handler reports the crash - a SIGSEGV, or an abort (std::terminate, or
    malloc finding its heap corrupted) - also after faulthandler, which runs first and
    re-raises, into SEGV_BACKTRACE_DIR as well as stderr; the process still dies of the
    signal; the symbolizer names the crashing function, hidden from the dynamic symbols as the
    extension's are."""
    entry, signum, words = CRASHES[kind]
    handler = tmp_path / "segv_backtrace.so"
    subprocess.run([CC, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-o", str(handler),
                    os.path.join(ROOT, "scripts", "segv_backtrace.c")], check=True, timeout=120)
    (tmp_path / "crash.c").write_text(CRASHER)
    crasher = tmp_path / "crash.so"
    subprocess.run([CC, "-shared", "-fPIC", "-g", "-O0", "-fvisibility=hidden", "-o",
                    str(crasher), str(tmp_path / "crash.c")], check=True, timeout=120)
    reports = tmp_path / "native"
    reports.mkdir()
    env = {**os.environ, "LD_PRELOAD": str(handler), "SEGV_BACKTRACE_DIR": str(reports)}
    env.pop("PYTHONFAULTHANDLER", None)
    if faulthandler == "on":
        env["PYTHONFAULTHANDLER"] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", f"import ctypes; ctypes.CDLL({str(crasher)!r}).{entry}()"],
        capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == -signum, (proc.returncode, proc.stderr[-2000:])
    assert f"segv_backtrace: signal {signum} " in proc.stderr, proc.stderr[-2000:]
    if faulthandler == "on":
        assert f"Fatal Python error: {words}" in proc.stderr
    files = sorted(reports.glob("segv-*.txt"))
    assert len(files) == 1, files
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "symbolize_backtraces.py"),
                          str(files[0])], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    if shutil.which("addr2line") is None:
        pytest.skip("addr2line is not installed: frames stay offsets")
    assert re.search(rf"{entry}_here at .*crash\.c:\d+", out.stdout), out.stdout


def test_symbolizer_leaves_a_log_without_crashes_alone(tmp_path):
    log = tmp_path / "quiet.log"
    log.write_text("== core\n42 passed in 3.0s\n")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "symbolize_backtraces.py"),
                          str(log)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == "", out.stdout + out.stderr


def plan():
    out = subprocess.run(["bash", GPU_CHECK, "--plan"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    lines = [line.split(maxsplit=1) for line in out.stdout.splitlines()]
    return {name: rest for name, rest in lines}, [name for name, _ in lines[1:]]


def test_default_command_fits_nine_minutes_in_order_of_value():
    """The default command's phases in the order the issue asks (build, smoke, the crashes, the
    benchmark without NCCL, NCCL on its own, ResNet-18 and the trainer, the rest of `first`, then
    every GPU test), each with a cap; with a carried build the caps add up to a minute under
    CALL_BUDGET, itself at most 9 minutes, a minute under the device tool's 10."""
    caps, order = plan()
    assert order == ["build", "smoke", "crash", "bench", "nccl", "resnet18", "train", "first",
                     "gpu"]
    budget = int(caps["budget"])
    assert budget <= 540
    carried, building = re.fullmatch(r"(\d+) carried, (\d+) building", caps["build"]).groups()
    assert caps["gpu"] == "rest"
    fixed = int(carried) + sum(int(caps[p]) for p in order if p not in ("build", "gpu"))
    assert fixed + 60 <= budget, f"the caps add up to {fixed} s of {budget} s"
    assert int(building) <= budget // 3  # a build made there still leaves room for the rest
    assert all(int(caps[p]) >= 30 for p in order if p not in ("build", "gpu"))


def test_default_phases_run_each_piece_bounded(tmp_path):
    """The default command rehearsed with a stand-in python3 that records its calls: each crash
    test in a pytest process of its own under the tracing preload; ringreduce's benchmark (4 ranks
    to 256 MiB, 8 ranks from 1 MiB, the one-shot column) before NCCL's, which runs alone with
    NCCL's log to a file; both ResNet-18 runs; the trainer with each all-reduce; every run with a
    bound and a budget inside its phase's cap; a summary line for every phase."""
    work = tmp_path / "tree"
    (work / "scripts").mkdir(parents=True)
    for name in ("gpu_check.sh", "gpu_first.txt", "gpu_crash.txt", "segv_backtrace.c"):
        shutil.copy(os.path.join(ROOT, "scripts", name), work / "scripts" / name)
    calls = tmp_path / "calls.log"
    stub = tmp_path / "bin" / "python3"
    stub.parent.mkdir()
    stub.write_text("#!/bin/sh\n"
                    f'echo "$* NCCL_DEBUG_FILE=$NCCL_DEBUG_FILE LD_PRELOAD=$LD_PRELOAD" >> {calls}\n'
                    'case "$*" in *test_65_ranks*) exit 1 ;; esac\nexit 0\n')
    stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{stub.parent}:{os.environ['PATH']}", "OUT": str(tmp_path / "out")}
    for name in ("RINGREDUCE_NCCL_LIB", "NCCL_DEBUG", "NCCL_DEBUG_FILE", "CALL_BUDGET"):
        env.pop(name, None)
    proc = subprocess.run(["bash", str(work / "scripts" / "gpu_check.sh"), "smoke", "crash",
                           "bench", "nccl", "resnet18", "train"],
                          capture_output=True, text=True, timeout=300, cwd=work, env=env)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]  # the failing crash test
    log = calls.read_text().splitlines()
    crash = [ln for ln in log if "-m pytest" in ln]
    assert [ln.split()[-3] for ln in crash] == ids_in(CRASH)
    assert all("segv_backtrace.so" in ln for ln in crash)
    benches = [ln for ln in log if ln.startswith("bench/ring.py")]
    assert [(b.split("--impls ")[1].split()[0], b.split("--ranks ")[1].split()[0])
            for b in benches] == [("ringreduce,oneshot", "4"), ("ringreduce,oneshot", "8"),
                                  ("nccl", "4"), ("nccl", "8")]
    for b in benches:
        assert "--max-bytes 256M" in b and "--budget" in b and "--deadline" in b
        assert ("--min-bytes 1M" in b) == ("--ranks 8" in b)
    for b in benches[:2]:
        assert "NCCL_DEBUG_FILE= " in b  # ringreduce's runs: no NCCL at all
    for b in benches[2:]:
        assert f"NCCL_DEBUG_FILE={work}/gpu-logs/nccl/bench.%h.%p.log" in b
    resnet = [ln for ln in log if ln.startswith("bench/resnet18.py")]
    assert len(resnet) == 2 and "--methods ring,nccl" in resnet[1]
    trains = [ln.split("--allreduce ")[1].split()[0] for ln in log if "ringreduce.train" in ln]
    assert trains == ["ring", "naive", "nccl"]
    caps, _ = plan()
    bounds = re.findall(r"== (\w+) \(bound (\d+) s", proc.stdout)
    inner = [(int(b), ln) for b, ln in re.findall(r"\(bound (\d+) s\) (.*)", proc.stdout)]
    assert {name for name, _ in bounds} == {"smoke", "crash", "bench", "nccl", "resnet18", "train"}
    for name, bound in bounds:
        assert int(bound) <= int(caps[name])
    assert inner and all(0 < b <= 100 for b, _ in inner)
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "crash: exit 1; result: 8 passed, 1 failed of 9" in summary, summary
    for name in ("bench", "nccl", "resnet18", "train"):
        assert re.search(rf"^{name}: exit 0; result: ", summary, re.M), summary


def test_build_phase_imports_a_carried_build_and_builds_only_without_one(tmp_path):
    """`build` builds (scripts/setup.sh) and stamps the tree's hash where there is no build; a
    tree with a stamp of its own sources (a build carried from here, or made on a warm machine)
    is import-checked and not rebuilt; one whose import fails is built again; a changed source
    makes the stamp stale. Rehearsed with stand-ins for python3 and setup.sh."""
    work = tmp_path / "tree"
    for d in ("scripts", "csrc/ring", "ringreduce"):
        (work / d).mkdir(parents=True)
    shutil.copy(GPU_CHECK, work / "scripts" / "gpu_check.sh")
    for name in ("gpu_first.txt", "gpu_crash.txt", "segv_backtrace.c"):
        shutil.copy(os.path.join(ROOT, "scripts", name), work / "scripts" / name)
    for f in ("setup.py", "ringreduce/_build.py", "csrc/bindings.cpp", "csrc/ring/plan.h"):
        (work / f).write_text(f"// {f}\n")
    calls = tmp_path / "calls.log"
    (work / "scripts" / "setup.sh").write_text(f'echo "setup.sh" >> {calls}\n')
    stub = tmp_path / "bin" / "python3"
    stub.parent.mkdir()
    stub.write_text("#!/bin/sh\n"
                    f'echo "python3 $*" >> {calls}\n'
                    'case "$*" in *build_info*) exit "${STUB_IMPORT_RC:-0}" ;; esac\nexit 0\n')
    stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{stub.parent}:{os.environ['PATH']}"}
    for name in ("OUT", "CALL_BUDGET", "BUILD_TIMEOUT"):
        env.pop(name, None)

    def build(**extra):
        calls.write_text("")
        proc = subprocess.run(["bash", str(work / "scripts" / "gpu_check.sh"), "build"],
                              capture_output=True, text=True, timeout=300, cwd=work,
                              env={**env, **extra})
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return calls.read_text().splitlines(), proc.stdout

    ran, _ = build()
    assert "setup.sh" in ran  # nothing built yet
    stamp = (work / "build" / "gpu_check.stamp").read_text()
    ran, out = build()
    assert "setup.sh" not in ran and "imports; not rebuilt" in out
    assert any("from ringreduce import _dist_C" in line for line in ran)
    ran, out = build(STUB_IMPORT_RC="1")
    assert "setup.sh" in ran and "does not import: building here" in out
    (work / "csrc" / "ring" / "plan.h").write_text("// changed\n")
    ran, _ = build()
    assert "setup.sh" in ran
    assert (work / "build" / "gpu_check.stamp").read_text() != stamp
