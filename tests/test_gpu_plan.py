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


def first_ids():
    with open(FIRST) as f:
        return [line.strip() for line in f if line.strip() and not line.startswith("#")]


def test_first_selection_names_existing_tests():
    ids = first_ids()
    assert len(ids) == len(set(ids)), "an id is listed twice"
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "-p", "no:cacheprovider", *ids],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    collected = {line.strip() for line in proc.stdout.splitlines() if "::" in line}
    assert collected == set(ids), f"not collected: {sorted(set(ids) - collected)}"


CRASHER = r"""
__attribute__((noinline)) void ringreduce_plan_crash_here(volatile int *p) { *p = 1; }
__attribute__((visibility("default"))) void ringreduce_plan_crash(void) {
  ringreduce_plan_crash_here((volatile int *)0);
}
"""


@pytest.mark.skipif(CC is None or not sys.platform.startswith("linux"),
                    reason="needs a C compiler on Linux")
@pytest.mark.parametrize("faulthandler", ["on", "off"])
def test_a_crash_leaves_a_native_stack_that_resolves(tmp_path, faulthandler):
    """The preloaded handler reports the crash (also after faulthandler, which runs first and
    re-raises), into SEGV_BACKTRACE_DIR as well as stderr; the process still dies of the
    signal; the symbolizer names the crashing function, hidden from the dynamic symbols as the
    extension's are."""
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
        [sys.executable, "-c", f"import ctypes; ctypes.CDLL({str(crasher)!r}).ringreduce_plan_crash()"],
        capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == -11, (proc.returncode, proc.stderr[-2000:])
    assert "segv_backtrace: signal 11" in proc.stderr, proc.stderr[-2000:]
    if faulthandler == "on":
        assert "Fatal Python error: Segmentation fault" in proc.stderr
    files = sorted(reports.glob("segv-*.txt"))
    assert len(files) == 1, files
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "symbolize_backtraces.py"),
                          str(files[0])], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    if shutil.which("addr2line") is None:
        pytest.skip("addr2line is not installed: frames stay offsets")
    assert re.search(r"ringreduce_plan_crash_here at .*crash\.c:\d+", out.stdout), out.stdout


def test_symbolizer_leaves_a_log_without_crashes_alone(tmp_path):
    log = tmp_path / "quiet.log"
    log.write_text("== core\n42 passed in 3.0s\n")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "symbolize_backtraces.py"),
                          str(log)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == "", out.stdout + out.stderr
