"""The CUDA backend's protocol on a fake CUDA runtime, so that it runs without a GPU.

csrc/multiprocess/cuda_collectives.cu is compiled by the host compiler against
tests/fake_cuda/include/cuda_runtime.h (streams are threads that run their work in order after
random delays, events and "device" memory live in shared memory, kernels are the CPU
executor's combine) and driven by tests/fake_cuda/protocol_driver.cpp in forked processes. It
checks the host handshakes, the rounds and slots, the stream and event ordering (a missing wait
shows up as a mismatch under the random delays) and teardown, byte for byte against the CPU
collectives. Its fake devices are distinct where a test says so ("distinct_devices": a device
per rank, with its own streams, events, memory and peer access). It cannot check anything
about real GPUs: tests/test_distributed_cuda.py does.
"""
import os
import re
import subprocess
import sys
import time

import pytest

from fake_cuda.build import CSRC, CXX, FAKE, build

pytestmark = pytest.mark.skipif(CXX is None or not sys.platform.startswith("linux"),
                                reason="needs a C++ compiler on Linux")


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    return build(tmp_path_factory.mktemp("fake_cuda"), "protocol_driver", [
        os.path.join(CSRC, "multiprocess", "cuda_collectives.cu"),
        os.path.join(FAKE, "fake_runtime.cpp"),
        os.path.join(FAKE, "protocol_driver.cpp"),
        os.path.join(CSRC, "multiprocess", "host_group.cpp"),
        os.path.join(CSRC, "multiprocess", "cpu_collectives.cpp"),
        os.path.join(CSRC, "ring", "cpu_executor.cpp")])


def run(driver, n, staging, mode="check", timeout=280, env=None):
    start = time.monotonic()
    # The CUDA collectives round 16-bit sums per hop; the CPU reference group is made to match
    # (by default the CPU collectives round them once).
    proc = subprocess.run([driver, str(n), str(staging), mode], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "RINGREDUCE_HALF_ROUNDING": "per_hop",
                                                **(env or {})})
    return proc, time.monotonic() - start


def rank_lines(stdout):
    """{rank: (checked, failures, teardown seconds)} from the driver's report."""
    found = re.findall(r"rank (\d+): checked (\d+) failures (\d+) teardown ([\d.]+) s", stdout)
    return {int(r): (int(c), int(f), float(t)) for r, c, f, t in found}


@pytest.mark.parametrize("n,staging", [(2, 8192), (3, 4096), (4, 8192), (4, 1 << 16)])
def test_collectives_match_the_cpu_path(driver, n, staging):
    proc, _ = run(driver, n, staging)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = rank_lines(proc.stdout)
    assert sorted(lines) == list(range(n)), proc.stdout
    for rank, (checked, failures, teardown) in lines.items():
        assert checked > 900 and failures == 0, (rank, proc.stderr)
        assert teardown < 1.0, f"rank {rank}: teardown took {teardown:.2f} s"


def check_last_rank_gone(proc, n, elapsed):
    """The last of `n` ranks exited (9); the others failed (3), their first error naming it,
    within 20 s; and the fake runtime saw no use of a gone exporter's IPC objects."""
    assert "fake CUDA:" not in proc.stderr, proc.stderr
    exits = dict(re.findall(r"rank (\d+) exit (\d+)", proc.stdout))
    assert exits.get(str(n - 1)) == "9", proc.stdout + proc.stderr
    for rank in range(n - 1):
        assert exits.get(str(rank)) == "3", proc.stdout + proc.stderr
        errors = [line for line in proc.stderr.splitlines() if line.startswith(f"rank {rank}:")]
        assert errors and f"rank {n - 1}" in errors[0], proc.stderr
    assert elapsed < 20.0, f"took {elapsed:.1f} s:\n{proc.stderr}"


def test_killed_rank_fails_the_others_and_teardown_is_bounded(driver):
    # The survivors' queued work may wait forever for the dead rank's events: teardown gives
    # it about a second once a peer is gone, then leaks instead of waiting.
    proc, elapsed = run(driver, 3, 8192, "kill")
    check_last_rank_gone(proc, 3, elapsed)


def test_teardown_leaves_an_exited_peers_ipc_imports_alone(driver):
    """The last rank exits with its GPU work done, so the others' teardown gets past its wait
    for their own work: closing the exited rank's staging area or destroying its events there
    is undefined behaviour in CUDA (the fake runtime aborts on it, naming the call)."""
    proc, elapsed = run(driver, 3, 8192, "exit_synced")
    check_last_rank_gone(proc, 3, elapsed)


def test_teardown_does_not_wait_for_an_aborted_peer(driver):
    proc, _ = run(driver, 3, 8192, "abort")
    lines = rank_lines(proc.stdout)
    assert sorted(lines) == [0, 1, 2], proc.stdout + proc.stderr
    for rank, (_, failures, teardown) in lines.items():
        assert failures == 0, proc.stderr
        assert teardown < 0.5, f"rank {rank}: teardown took {teardown:.2f} s"


def test_peers_that_give_up_on_an_aborted_rank_wait_while_it_closes_their_imports(driver):
    """Rank 0 aborts; its peers wait up to 3 s (kAbortedPeerGrace) for its release. Rank 0's
    first close of an import stalls 4 s (a rank descheduled right after it saw its peers
    alive): having seen that it began closing, they must wait for it, or the fake runtime
    aborts it for closing an import whose exporter has exited."""
    proc, _ = run(driver, 3, 8192, "abort", env={"FAKE_CUDA_SLOW_CLOSE_MS": "4000",
                                                 "PROTOCOL_SLOW_CLOSE_RANK": "0"})
    assert "fake CUDA:" not in proc.stderr, proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = rank_lines(proc.stdout)
    assert sorted(lines) == [0, 1, 2], proc.stdout + proc.stderr
    assert lines[0][2] > 3.5, f"rank 0's close did not stall: {proc.stdout}"


def test_teardown_waits_for_a_live_peer_to_release(driver):
    proc, _ = run(driver, 3, 8192, "skew")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = rank_lines(proc.stdout)
    for rank in (1, 2):
        assert 0.8 < lines[rank][2] < 3.0, lines


@pytest.mark.parametrize("n,staging", [(2, 8192), (3, 4096), (4, 1 << 16)])
def test_once_rounded_collectives_match_the_cpu_path(driver, n, staging):
    """RINGREDUCE_CUDA_HALF_ROUNDING=once beside the CPU's default (once): float16 / bfloat16
    sums and averages run the two-shot all-reduce (cuda_collectives.cu two_shot_once, in the
    ring's rounds) and the once-rounded reduce_scatter, and every result equals the CPU
    collectives' bit for bit (with per-hop CUDA sums 48-50 of ~1036 checks per rank differ). The
    other dtypes and ops keep their paths."""
    proc, _ = run(driver, n, staging, env={"RINGREDUCE_HALF_ROUNDING": "once",
                                           "RINGREDUCE_CUDA_HALF_ROUNDING": "once"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = rank_lines(proc.stdout)
    assert sorted(lines) == list(range(n)), proc.stdout
    for rank, (checked, failures, _) in lines.items():
        assert checked > 900 and failures == 0, (rank, proc.stderr)
    if n == 3:  # and with a device per rank
        proc, _ = run(driver, 3, 4096, "distinct_devices",
                      env={"RINGREDUCE_HALF_ROUNDING": "once",
                           "RINGREDUCE_CUDA_HALF_ROUNDING": "once"})
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_distinct_devices_collectives_match_the_cpu_path(driver):
    """Rank r on fake device r (its own streams, events and staging area; IPC handles opened on
    another device), with another device current in the calling thread: the collectives select
    their device for every call (a launch or an event record on another device's stream fails
    in the fake, as on a GPU)."""
    proc, _ = run(driver, 3, 4096, "distinct_devices")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = rank_lines(proc.stdout)
    assert sorted(lines) == [0, 1, 2], proc.stdout
    for rank, (checked, failures, _) in lines.items():
        assert checked > 900 and failures == 0, (rank, proc.stderr)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ddp_all_reduce_on_distinct_devices(driver, n):
    """all_reduce as the backend's asynchronous CUDA path issues it for DDP (engine.h): buckets
    written on the caller's stream (each device's legacy default stream), the collective on an
    internal stream of a progress thread, Work.wait making the caller's stream wait for its end
    event; the caller's stream then reads the result. Every third iteration runs inline
    (RINGREDUCE_ASYNC=0) on stream 0 with another device current, which the collectives must
    map to their own device's stream 0. Byte for byte against the CPU path."""
    proc, _ = run(driver, n, 8192, "ddp_distinct_devices")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = rank_lines(proc.stdout)
    assert sorted(lines) == list(range(n)), proc.stdout
    for rank, (checked, failures, _) in lines.items():
        assert checked == 60 and failures == 0, (rank, proc.stderr)


def test_ddp_distinct_devices_harness_sees_a_missing_wait_and_a_wrong_device(driver):
    """The same run with a planted bug must fail: Work.wait without the stream wait gives wrong
    bytes on the caller's stream; a progress thread that never selects its rank's device records
    the end event (made on cuda:0) on a stream of another device, which the fake refuses."""
    proc, _ = run(driver, 2, 8192, "ddp_nowait")
    assert proc.returncode != 0 and "MISMATCH ddp" in proc.stderr, proc.stdout + proc.stderr
    proc, _ = run(driver, 3, 8192, "ddp_nodevice")
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "recording the end of the collective failed: error 400" in proc.stderr, proc.stderr


def test_distinct_devices_without_peer_access_fail_setup_clearly(driver):
    """Fake devices 1 and 2 refuse peer access: ranks 1 and 2 cannot open each other's staging
    area, say so naming the devices, and every rank fails (none hangs)."""
    proc, elapsed = run(driver, 3, 8192, "ddp_distinct_devices",
                        env={"FAKE_CUDA_REFUSE_PEER": "1,2"}, timeout=120)
    exits = dict(re.findall(r"rank (\d+) exit (\d+)", proc.stdout))
    assert exits == {"0": "3", "1": "3", "2": "3"}, proc.stdout + proc.stderr
    for rank, peer in ((1, 2), (2, 1)):
        line = [x for x in proc.stderr.splitlines() if x.startswith(f"rank {rank}: error:")]
        assert line and "cuda_setup" in line[0] and "cudaErrorPeerAccessUnsupported" in line[0] \
            and f"while opening rank {peer}'s CUDA staging area" in line[0], proc.stderr
    assert elapsed < 60.0, f"took {elapsed:.1f} s:\n{proc.stderr}"


def test_a_rank_leaves_alone_the_imports_of_a_peer_that_gave_up_on_it(driver):
    """As above, where ranks 1 and 2 give up waiting for rank 0's release (it is stuck in the
    CPU reference group they never joined) and close their groups. Rank 2 then takes 0.5 s to
    exit, and rank 0's first close of an import stalls 1 s (a rank descheduled right after it
    saw its peer alive). Rank 0 must see that its peers left without it and leave their
    imports alone, or the fake runtime aborts it for closing an import whose exporter has
    exited (CI saw that once, without the delays)."""
    proc, elapsed = run(driver, 3, 8192, "ddp_distinct_devices",
                        env={"FAKE_CUDA_REFUSE_PEER": "1,2", "PROTOCOL_LATE_EXIT": "2:500",
                             "FAKE_CUDA_SLOW_CLOSE_MS": "1000"}, timeout=120)
    exits = dict(re.findall(r"rank (\d+) exit (\d+)", proc.stdout))
    assert "fake CUDA:" not in proc.stderr, proc.stdout + proc.stderr
    assert exits == {"0": "3", "1": "3", "2": "3"}, proc.stdout + proc.stderr
    assert elapsed < 60.0, f"took {elapsed:.1f} s:\n{proc.stderr}"
