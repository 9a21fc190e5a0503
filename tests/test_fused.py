"""The fused ring all-reduce (one kernel, steps ordered by flags; csrc/ring/fused.h) on the CPU.

tests/fused_driver.cpp runs the kernel's body with one std::thread per simulated block, flags as
std::atomic words with acquire/release, and random yields and sleeps (one group at a time much
slower), and compares every rank's output with rr::cpu::all_reduce (the ring) byte for byte:
2..8 ranks x 1..3 blocks per rank x odd and tiny sizes, in place and out of place, pack and
element paths, every call with the next epoch on one flag buffer that is never reset. It also
checks that the waits keep each block at most N-2 steps ahead of its successor when it starts a
step (the write-after-read bound) and that the random delays reach that bound; that a group that
never starts makes the others time out (no hang) with a record naming it; that a repeated epoch
is refused; and, under ThreadSanitizer, that no buffer access is left unordered against a write.
The GPU's memory model (fences, L1) and the cooperative launch need a GPU.
"""
import os
import re
import subprocess
import sys

import pytest

from fake_cuda.build import CSRC, CXX, ROOT, compile_program

SOURCES = [os.path.join(ROOT, "tests", "fused_driver.cpp"),
           os.path.join(CSRC, "ring", "cpu_executor.cpp")]
DTYPES = ["float32", "float16", "int32", "float64", "int8"]
OPS = ["sum", "max", "avg"]

pytestmark = pytest.mark.skipif(CXX is None or not sys.platform.startswith("linux"),
                                reason="needs a C++ compiler on Linux")


def build(path, flags):
    return compile_program(path, SOURCES, flags)


def run(exe, *args, env=None, timeout=300):
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    exe = tmp_path_factory.mktemp("fused") / "fused_driver"
    proc = build(exe, ["-O2", "-Wall", "-Werror"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return str(exe)


@pytest.fixture(scope="module")
def tsan_driver(tmp_path_factory):
    exe = tmp_path_factory.mktemp("fused_tsan") / "fused_driver"
    proc = build(exe, ["-O1", "-g", "-fsanitize=thread"])
    if proc.returncode != 0:
        pytest.skip("ThreadSanitizer does not build here: " + proc.stderr[-500:])
    probe = run(str(exe), "args", env=tsan_env())
    if probe.returncode != 0:
        pytest.skip("ThreadSanitizer does not run here: " + (probe.stdout + probe.stderr)[-500:])
    return str(exe)


def tsan_env():
    return dict(os.environ, TSAN_OPTIONS="halt_on_error=1 exitcode=66")


def check_output(out, mismatches_zero=True):
    found = re.findall(r"op=(\w+) calls=(\d+) mismatches=(\d+) failures=(\d+)", out)
    assert [op for op, *_ in found] == OPS, out
    for op, calls, mismatches, failures in found:
        assert int(calls) == 7 * 3 * 12, (op, out)
        if mismatches_zero:
            assert mismatches == "0" and failures == "0", (op, out)
    return found


def check_lead(out):
    # Every N: the most steps a block started ahead of its successor equals the bound N-2, so
    # the delays did drive a group as far ahead as the waits allow (and no further: the driver
    # counts a larger lead as a failure).
    leads = re.findall(r"n(\d+)=(\d+)/(\d+)", out)
    assert len(leads) == 7, out
    for n, lead, bound in leads:
        assert int(bound) == int(n) - 2 and int(lead) == int(bound), (n, out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_body_matches_the_ring(driver, dtype):
    proc = run(driver, "check", dtype, "20240611")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    check_output(proc.stdout)
    check_lead(proc.stdout)


def test_dropped_wait_is_caught(driver):
    # The mutation every ordering test must catch: the acquire waits removed.
    proc = run(driver, "check", "float32", "7", "--no-wait")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    for op, _, mismatches, _ in check_output(proc.stdout, mismatches_zero=False):
        assert int(mismatches) > 0, (op, proc.stdout)


def test_stuck_group_times_out_and_names_it(driver):
    proc = run(driver, "stuck", "3", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    stuck = re.findall(r"stuck nranks=(\d+) .* other=0 in \d+ ms; record_ok=1: (.*)",
                       proc.stdout)
    assert len(stuck) == 3, proc.stdout
    for _, msg in stuck:
        assert "timed out before step" in msg and "not started in this call" in msg, msg
    assert proc.stdout.count("20 ms late: ok") == 3, proc.stdout
    assert proc.stdout.count("next epoch on the same buffer: ok") == 3, proc.stdout


def test_repeated_epoch_is_refused(driver):
    proc = run(driver, "stale", "3", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "stale: 8 of 8 blocks refused" in proc.stdout, proc.stdout
    assert "epochs on one flag buffer must strictly increase" in proc.stdout, proc.stdout


def test_bad_arguments_are_refused(driver):
    proc = run(driver, "args")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("refused: ringreduce:") == 6, proc.stdout


def test_no_unordered_access_under_thread_sanitizer(tsan_driver):
    for args in (("check", "float16", "5"), ("stuck", "5"), ("stale", "5")):
        proc = run(tsan_driver, *args, env=tsan_env())
        assert proc.returncode == 0 and "ThreadSanitizer" not in proc.stderr, (
            args, proc.stdout[-2000:] + proc.stderr[-4000:])


def test_thread_sanitizer_sees_a_dropped_wait(tsan_driver):
    proc = run(tsan_driver, "check", "float32", "5", "--no-wait", env=tsan_env())
    assert "ThreadSanitizer: data race" in proc.stderr, proc.stdout[-2000:] + proc.stderr[-2000:]
