"""The host's cost of a list-API collective on the CUDA executor, pinned (issue 46).

tests/fake_cuda/cost_driver.cpp runs csrc/ring/cuda_executor.cu, cuda_kernels.cu and
oneshot_kernel.cu, compiled by the host compiler, on the fake runtime of fake_lanes.h (whose
cudaLaunchKernel runs the real kernels' bodies, checked against the CPU executor), and counts
per call: the CUDA runtime calls by name, the kernel launches, the bytes of their parameters and
the executor's heap allocations. Four int32 ranks of 1000 elements, sum; one lane (simulated
ranks on one stream; also 12 ranks, more than one step kernel takes), a stream per rank on one
device, a device per rank, every hop staged, the once-rounded two-shot of bfloat16 sums (a
device per rank, a stream per rank, staged), and one lane under stream capture (a CUDA graph's replay runs what the capture recorded: one
cudaGraphLaunch, none of this host code). The steady state is a later call, after every cache
is warm; the first call also pays what is made once (events, occupancy).

The counts are pinned exactly: a call the host code gains shows here, and one it loses is
recorded by updating PINNED (bench/RESULTS.md keeps the history). The bindings' own work (torch's
device guard, recordStream, argument checks) is outside: it needs torch.
"""
import os
import re
import subprocess
import sys

import pytest

from fake_cuda.build import CSRC, CXX, FAKE, build

pytestmark = pytest.mark.skipif(CXX is None or not sys.platform.startswith("linux"),
                                reason="needs a C++ compiler on Linux")

# path -> counts of a steady-state call (call=2) and of the first call (call=0).
PINNED = {
    "oneshot": {
        2: dict(launches=1, param_bytes=1064, allocations=0,
                cudaLaunchKernel=1, cudaStreamIsCapturing=1),
        0: dict(launches=1, param_bytes=1064, allocations=1,
                cudaDeviceGetAttribute=1, cudaLaunchKernel=1,
                cudaOccupancyMaxActiveBlocksPerMultiprocessor=1, cudaStreamIsCapturing=1),
    },
    # RINGREDUCE_CUDA_HALF_ROUNDING=once: the once-rounded kernel, bfloat16 sums; its bytes are
    # checked against rr::cpu::all_reduce_once. Its first call asks for its own kernel's
    # occupancy; the device's SM count is known from the oneshot path's.
    "oneshot_once": {
        2: dict(launches=1, param_bytes=1064, allocations=0,
                cudaLaunchKernel=1, cudaStreamIsCapturing=1),
        0: dict(launches=1, param_bytes=1064, allocations=1, cudaLaunchKernel=1,
                cudaOccupancyMaxActiveBlocksPerMultiprocessor=1, cudaStreamIsCapturing=1),
    },
    "ring": {
        2: dict(launches=6, param_bytes=1584, allocations=0,
                cudaLaunchKernel=6, cudaStreamIsCapturing=1),
        0: dict(launches=6, param_bytes=1584, allocations=12,
                cudaLaunchKernel=6, cudaOccupancyMaxActiveBlocksPerMultiprocessor=3,
                cudaStreamIsCapturing=1),
    },
    "ring_12_ranks": {
        2: dict(launches=44, param_bytes=11616, allocations=0,
                cudaLaunchKernel=44, cudaStreamIsCapturing=1),
        0: dict(launches=44, param_bytes=11616, allocations=3,
                cudaLaunchKernel=44, cudaStreamIsCapturing=1),
    },
    "ring_virtual": {
        2: dict(launches=24, param_bytes=6336, allocations=0,
                cudaEventRecord=32, cudaLaunchKernel=24, cudaStreamIsCapturing=4,
                cudaStreamWaitEvent=36),
        0: dict(launches=24, param_bytes=6336, allocations=34,
                cudaEventCreateWithFlags=32, cudaEventRecord=32, cudaLaunchKernel=24,
                cudaStreamIsCapturing=4, cudaStreamWaitEvent=36),
    },
    "ring_devices": {
        2: dict(launches=24, param_bytes=6336, allocations=0,
                cudaEventRecord=32, cudaLaunchKernel=24, cudaSetDevice=44,
                cudaStreamIsCapturing=4, cudaStreamWaitEvent=36),
        0: dict(launches=24, param_bytes=6336, allocations=30,
                cudaDeviceGetAttribute=3, cudaEventCreateWithFlags=24, cudaEventRecord=32,
                cudaLaunchKernel=24, cudaOccupancyMaxActiveBlocksPerMultiprocessor=9,
                cudaSetDevice=47, cudaStreamIsCapturing=4, cudaStreamWaitEvent=36),
    },
    "staged": {
        2: dict(launches=3, param_bytes=792, allocations=0,
                cudaLaunchKernel=3, cudaMemcpyPeerAsync=24, cudaStreamIsCapturing=1),
        0: dict(launches=3, param_bytes=792, allocations=0,
                cudaLaunchKernel=3, cudaMemcpyPeerAsync=24, cudaStreamIsCapturing=1),
    },
    # RINGREDUCE_CUDA_HALF_ROUNDING=once on several lanes, or with staging: the once-rounded
    # two-shot (run_once_rounded), bfloat16 sums checked against rr::cpu::all_reduce_once. Per
    # rank one chunk kernel (the one-shot's 1064-byte parameters) and one all-gather step
    # kernel of 3 copies (264 bytes) where peers are read directly; staged, 3 copies in and 3
    # out per rank. Three barriers in which every lane waits for the other 3 (36 waits). Its
    # events are the ring's (made by ring_devices and ring_virtual, which run first).
    "twoshot_devices": {
        2: dict(launches=8, param_bytes=5312, allocations=0,
                cudaEventRecord=12, cudaLaunchKernel=8, cudaSetDevice=36,
                cudaStreamIsCapturing=4, cudaStreamWaitEvent=36),
        0: dict(launches=8, param_bytes=5312, allocations=9,
                cudaEventRecord=12, cudaLaunchKernel=8,
                cudaOccupancyMaxActiveBlocksPerMultiprocessor=7, cudaSetDevice=36,
                cudaStreamIsCapturing=4, cudaStreamWaitEvent=36),
    },
    "twoshot_virtual": {
        2: dict(launches=8, param_bytes=5312, allocations=0,
                cudaEventRecord=12, cudaLaunchKernel=8, cudaStreamIsCapturing=4,
                cudaStreamWaitEvent=36),
        0: dict(launches=8, param_bytes=5312, allocations=0,
                cudaEventRecord=12, cudaLaunchKernel=8, cudaStreamIsCapturing=4,
                cudaStreamWaitEvent=36),
    },
    "twoshot_staged": {
        2: dict(launches=4, param_bytes=4256, allocations=0,
                cudaLaunchKernel=4, cudaMemcpyPeerAsync=24, cudaStreamIsCapturing=1),
        0: dict(launches=4, param_bytes=4256, allocations=0,
                cudaLaunchKernel=4, cudaMemcpyPeerAsync=24, cudaStreamIsCapturing=1),
    },
    "capture_oneshot": {
        2: dict(launches=1, param_bytes=1064, allocations=0,
                cudaLaunchKernel=1, cudaStreamIsCapturing=1),
        0: dict(launches=1, param_bytes=1064, allocations=0,
                cudaLaunchKernel=1, cudaStreamIsCapturing=1),
    },
    "capture_ring": {
        2: dict(launches=6, param_bytes=1584, allocations=0,
                cudaLaunchKernel=6, cudaStreamIsCapturing=1),
        0: dict(launches=6, param_bytes=1584, allocations=0,
                cudaLaunchKernel=6, cudaStreamIsCapturing=1),
    },
}

LINE = re.compile(r"cost (\w+) call=(\d+) launches=(\d+) param_bytes=(\d+) allocations=(\d+) "
                  r"calls=(\S*)")


def parse(out):
    """{path: {call: counts}} from the driver's lines."""
    found = {}
    for path, call, launches, param_bytes, allocations, calls in LINE.findall(out):
        counts = dict(launches=int(launches), param_bytes=int(param_bytes),
                      allocations=int(allocations))
        for item in filter(None, calls.split(",")):
            name, n = item.split(":")
            counts[name] = int(n)
        found.setdefault(path, {})[int(call)] = counts
    return found


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    return build(tmp_path_factory.mktemp("host_cost"), "cost_driver", [
        os.path.join(CSRC, "ring", "cuda_executor.cu"),
        os.path.join(CSRC, "ring", "cuda_kernels.cu"),
        os.path.join(CSRC, "ring", "oneshot_kernel.cu"),
        os.path.join(CSRC, "ring", "cpu_executor.cpp"),
        os.path.join(FAKE, "fake_lanes.cpp"),
        os.path.join(FAKE, "cost_driver.cpp")])


def run_driver(exe, **env):
    return subprocess.run([exe], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, **env))


@pytest.fixture(scope="module")
def counts(driver):
    proc = run_driver(driver)
    assert proc.returncode == 0 and "cost: 0 wrong" in proc.stdout, proc.stdout + proc.stderr
    return parse(proc.stdout)


@pytest.mark.parametrize("path", sorted(PINNED))
def test_host_cost_per_call_is_pinned(counts, path):
    """Every path's runtime calls, launches, parameter bytes and allocations, exactly."""
    assert counts.get(path) == PINNED[path], (path, counts.get(path))


def test_step_unroll_costs_the_same_and_gives_the_same_bytes(driver):
    """RINGREDUCE_CUDA_STEP_UNROLL=4 (four packs in flight per thread of a step kernel; step.h's
    body is checked pack by pack in tests/test_step_kernel.py): every path's bytes are still the
    CPU executor's, and the host pays exactly what it pays with one pack (the same launches,
    parameter bytes and calls: only the kernel instantiation differs). A value other than 1 or 4
    fails at the first launch, naming the variable."""
    proc = run_driver(driver, RINGREDUCE_CUDA_STEP_UNROLL="4")
    assert proc.returncode == 0 and "cost: 0 wrong" in proc.stdout, proc.stdout + proc.stderr
    assert parse(proc.stdout) == PINNED
    proc = run_driver(driver, RINGREDUCE_CUDA_STEP_UNROLL="3")
    assert proc.returncode != 0, proc.stdout
    assert "RINGREDUCE_CUDA_STEP_UNROLL must be 1 (the default) or 4; got '3'" in proc.stderr, (
        proc.stdout + proc.stderr)


def test_parse_sees_every_field():
    """The parser reads what the driver prints (a line it misread would pin nothing)."""
    line = ("cost x call=2 launches=3 param_bytes=4 allocations=5 "
            "calls=cudaGetDevice:6,cudaLaunchKernel:3\n")
    assert parse(line) == {"x": {2: dict(launches=3, param_bytes=4, allocations=5,
                                         cudaGetDevice=6, cudaLaunchKernel=3)}}
