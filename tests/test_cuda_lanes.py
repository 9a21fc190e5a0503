"""The single-process CUDA executor (csrc/ring/cuda_executor.cu) on a fake CUDA runtime, so that
its ordering runs without a GPU.

The executor is compiled by the host compiler against tests/fake_cuda/include (fake_lanes.h
says how the fake works: nothing runs until a drain, which then picks among every order CUDA
allows, including one that runs a chosen lane as far ahead as its waits let it) and driven by
tests/fake_cuda/lanes_driver.cpp: ranks on distinct devices, on distinct streams of one device
("virtual devices"), mixed, and without peer access; every collective of the list API; both
transports; several calls back to back with the user's own work queued between them, checked
byte for byte against the CPU executor; and the once-rounded two-shot all-reduce of float16 and
bfloat16 sums (run_once_rounded: all_reduce, reduce, reduce_scatter) on the same layouts against
the CPU's once-rounded functions. It
cannot check the kernels or anything about real
GPUs: tests/test_cuda.py and tests/test_cuda_review.py do, on a GPU.
"""
import os
import re
import subprocess
import sys

import pytest

from fake_cuda.build import CSRC, CXX, FAKE, build

pytestmark = pytest.mark.skipif(CXX is None or not sys.platform.startswith("linux"),
                                reason="needs a C++ compiler on Linux")


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    return build(tmp_path_factory.mktemp("fake_lanes"), "lanes_driver", [
        os.path.join(CSRC, "ring", "cuda_executor.cu"),
        os.path.join(CSRC, "ring", "cpu_executor.cpp"),
        os.path.join(FAKE, "fake_lanes.cpp"),
        os.path.join(FAKE, "lanes_driver.cpp")])


def run(driver, mode):
    proc = subprocess.run([driver, mode], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    return proc.stdout


def test_every_layout_and_collective_matches_the_cpu_executor(driver):
    """Back-to-back calls under adversarial schedules: the bytes of the CPU executor, no wait on
    a record left by an earlier call, and every read of a staging slot 16-byte aligned (slots
    strided by a hop's bytes, 148 for 37 int32, put every slot after the first off the kernels'
    pack path)."""
    out = run(driver, "matrix")
    cases, wrong, stale, misaligned = map(int, re.search(
        r"matrix: (\d+) cases, (\d+) wrong, (\d+) stale waits, (\d+) misaligned staged reads",
        out).groups())
    assert cases > 2000 and wrong == 0 and stale == 0 and misaligned == 0, out


def test_an_error_partway_through_queuing_leaves_nothing_behind(driver):
    """An error injected into each CUDA call of a call in turn: the call raises, the lanes are
    joined, and the next call is right without waiting on a stale record."""
    out = run(driver, "failures")
    cases, wrong = map(int, re.search(r"failures: (\d+) cases, (\d+) wrong", out).groups())
    assert cases > 1000 and wrong == 0, out


def test_capture_refuses_several_lanes_and_staging_before_queuing(driver):
    """Refused under capture, queuing nothing: several lanes, staging, and a lane on the legacy
    default stream while another stream captures (cudaStreamIsCapturing fails with
    cudaErrorStreamCaptureImplicit: a refusal, not a CUDA error); and peer access is never asked
    for under capture (enabling it could invalidate a global-mode capture)."""
    out = run(driver, "capture")
    captured, refused, wrong = map(int, re.search(
        r"capture: (\d+) captured, (\d+) refused, (\d+) wrong", out).groups())
    assert captured > 0 and refused > 0 and wrong == 0, out


def test_every_per_step_wait_is_needed(driver):
    """Dropping any one per-step wait gives wrong bytes under some schedule: the harness can
    see a missing wait, so the matrix above would. The entry and exit barriers wait on ring
    neighbours only: with a lane per rank, 2 waits a lane at each (N-1 if every lane waited on
    every other), of which some are needed. The once-rounded two-shot (all_reduce_once) reads
    every rank's memory: its entry and exit barriers make every lane wait for every other
    (N(N-1) waits with a lane per rank), and every one of the waits between its halves (counted
    here as per-step waits; the once-rounded reduce: the root's N-1) is needed."""
    out = run(driver, "dropwait")
    lines = re.findall(r"dropwait (\S+) n=(\d) (\S+): per-step waits (\d+) caught (\d+); "
                       r"barrier waits (\d+) caught (\d+)", out)
    assert len(lines) >= 12, out
    assert sum(coll == "all_reduce_once" for _, _, coll, *_ in lines) >= 4, out
    assert sum(coll == "reduce_once" for _, _, coll, *_ in lines) >= 4, out
    for layout, n, coll, steps, caught, barrier, barrier_caught in lines:
        n = int(n)
        assert int(steps) > 0 and caught == steps, (layout, n, coll, out)
        assert int(barrier_caught) > 0, (layout, n, coll, out)
        if layout in ("devices", "virtual", "nopeer"):
            if coll in ("all_reduce_once", "reduce_once"):
                # The reduce's root alone waits between the halves.
                assert int(steps) == (n if coll == "all_reduce_once" else 1) * (n - 1), (
                    layout, n, coll, out)
                assert int(barrier) == 2 * n * (n - 1), (layout, n, coll, out)
            else:
                assert int(barrier) == 2 * n * min(2, n - 1), (layout, n, coll, out)


def test_distinct_devices_ring_p2p_and_staged(driver):
    """A rank per fake device, its memory on that device, devices 1 and 2 refusing peer access,
    peer access asked for and enabled as torch's get_p2p_access does, lanes on created streams
    and on each device's default stream: every collective, p2p and copy, matches the CPU
    executor; no kernel touches a peer's memory without access; exactly the hops between the
    refused devices are staged. Two planted bugs must be seen: a yes from peer access without
    access enabled, and lane streams of other devices (cudaErrorInvalidResourceHandle)."""
    out = run(driver, "distinct_devices")
    cases, wrong, staged, unenabled, wrong_device = map(int, re.search(
        r"distinct_devices: (\d+) cases, (\d+) wrong, (\d+) staged refused hops; planted: (\d+) "
        r"unenabled peer accesses, wrong device caught (\d)", out).groups())
    assert cases > 1500 and wrong == 0 and staged > 0, out
    assert unenabled > 0 and wrong_device == 1, out
