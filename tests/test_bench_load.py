"""bench/load.py (the CPU collectives beside a CPU load): its targets' arithmetic, its load
processes (started, then gone), and a tiny run's tables, JSON and exit status. Speed is never
asserted here. Every run is bounded by checks.run_bounded."""
import json
import os
import sys
import time
from pathlib import Path

import pytest

from checks import alive, load_module, needs_cuda, run_bounded

ROOT = Path(__file__).resolve().parents[1]
LOAD = ROOT / "bench" / "load.py"
load = load_module("bench_load", LOAD)


def test_targets_follow_the_issue():
    """Up to 64 KiB: at most 1.5x the best peer plus the 3 us dispatch floor; from 1 MiB: also
    at most 3x ringreduce's own quiet time."""
    assert load.target_text(8, 7.5, 5.0, 3.0) == "met"  # 1.5 * 3 + 3
    assert load.target_text(8, 7.6, 5.0, 3.0) == "NOT met"
    assert load.target_text(64 << 10, 33.0, 1.0, 20.0) == "met"
    assert load.target_text(128 << 10, 33.0, 1.0, 20.0) == "NOT met"  # no floor above 64 KiB
    assert load.target_text(1 << 20, 300.0, 100.0, 400.0) == "met"
    assert load.target_text(1 << 20, 301.0, 100.0, 400.0) == "NOT met"  # 3x its quiet time
    assert load.target_text(1 << 20, 601.0, 1000.0, 400.0) == "NOT met"  # 1.5x the best peer
    assert load.target_text(1 << 20, 250.0, 100.0, None) == "met"  # no peer ran
    assert load.target_text(8, 9.0, 5.0, None) == "-"
    # A floor measured beside the same load replaces the 3 us, up to 64 KiB only.
    assert load.target_text(8, 14.5, 5.0, 3.0, floor=10.0) == "met"  # 1.5 * 3 + 10
    assert load.target_text(8, 14.6, 5.0, 3.0, floor=10.0) == "NOT met"
    assert load.target_text(8, 5.0, 5.0, 3.0, floor=0.4) == "NOT met"  # 1.5 * 3 + 0.4
    assert load.target_text(128 << 10, 33.0, 1.0, 20.0, floor=50.0) == "NOT met"
    # A paired floor (ringreduce's time over the floor timed after each call) is checked in
    # place of the time and the floor, up to 64 KiB only.
    assert load.target_text(8, 50.0, 5.0, 3.0, floor=0.4, over_floor=4.5) == "met"  # 1.5 * 3
    assert load.target_text(8, 5.0, 5.0, 3.0, floor=10.0, over_floor=4.6) == "NOT met"
    assert load.target_text(64 << 10, 99.0, 1.0, 20.0, over_floor=30.0) == "met"
    assert load.target_text(128 << 10, 33.0, 1.0, 20.0, over_floor=1.0) == "NOT met"


def test_arguments():
    args = load.parse_args(["--loads", "numpy,busy,numpy", "--load-procs", "3"])
    assert args.loads == ["none", "numpy", "busy"] and args.load_procs == 3
    assert load.parse_args([]).load_procs == len(os.sched_getaffinity(0))
    assert load.parse_args([]).session == "own"
    assert load.parse_args(["--session", "same"]).session == "same"
    with pytest.raises(SystemExit):
        load.parse_args(["--session", "other"])
    with pytest.raises(SystemExit):
        load.parse_args(["--loads", "idle"])
    with pytest.raises(SystemExit):
        load.parse_args(["--ranks", "1"])


def test_device_picks_the_backends_and_reaches_the_sweep():
    """--device: cpu by default with MPICH and DeepSpeed's op as peers; cuda with NCCL; the
    sweep that bench/ddp.py runs gets the device; NCCL counts as a peer in the ratio."""
    cpu = load.parse_args([])
    assert cpu.device == "cpu"
    assert cpu.backends == ["ringreduce", "mpich", "deepspeed", "floor"]
    cuda = load.parse_args(["--device", "cuda"])
    assert cuda.backends == ["ringreduce", "nccl"]
    assert load.parse_args(["--device", "cuda", "--backends", "nccl"]).backends == ["nccl"]
    argv = load.sweep_argv(cuda, "ringreduce")
    assert argv[argv.index("--device") + 1] == "cuda", argv
    assert load.sweep_args(cpu, "ringreduce").device == "cpu"
    # ringreduce's sweep times the floor after its calls up to 64 KiB; the others' do not.
    assert load.sweep_args(cpu, "ringreduce").paired_floor_up_to == 64 << 10
    assert all(load.sweep_args(cpu, b).paired_floor_up_to == 0 for b in ("floor", "mpich"))
    assert set(load.PEERS) == {"mpich", "deepspeed", "nccl"}
    with pytest.raises(SystemExit):
        load.parse_args(["--device", "xpu"])


@pytest.mark.parametrize("kind,own_session", [("busy", True), ("numpy", True),
                                               ("busy", False)])
def test_load_processes_run_and_stop(kind, own_session):
    procs = load.Load(kind, 2, own_session)
    procs.start()
    try:
        pids = [p.pid for p in procs.running]
        assert len(pids) == 2 and all(alive(pid) for pid in pids)
        # Each in a session of its own, or in this one (where stop() must not kill this group).
        sessions = {os.getsid(pid) for pid in pids}
        assert sessions == (set(pids) if own_session else {os.getsid(0)}), sessions
        # They burn CPU: each process's CPU time grows.
        before = [_cpu_ticks(pid) for pid in pids]
        time.sleep(0.5)
        assert all(_cpu_ticks(pid) > b for pid, b in zip(pids, before))
    finally:
        procs.stop()
    assert procs.running == [] and not any(alive(pid) for pid in pids)
    quiet = load.Load("none", 2)
    quiet.start()
    assert quiet.running == []


def _cpu_ticks(pid):
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


@pytest.mark.timeout(300)
def test_tiny_run_tables_json_and_exit(tmp_path):
    out = tmp_path / "load.json"
    rc, text = run_bounded([sys.executable, str(LOAD), "--backends", "ringreduce,floor",
                            "--sizes", "8,64K", "--iters", "3", "--warmup", "1",
                            "--loads", "busy", "--load-procs", "1", "--json", str(out)],
                           240, cwd=ROOT)
    assert rc == 0, text
    assert "# load none (quiet): median us per call" in text, text
    assert "# load busy: 1 processes of `while True: pass`" in text, text
    data = json.loads(out.read_text())
    assert data["ranks"] == 2 and set(data["loads"]) == {"none", "busy"}
    rows = {(r["load"], r["size"]): r for r in data["summary"]}
    assert set(rows) == {(ld, s) for ld in ("none", "busy") for s in (8, 64 << 10)}
    for (ld, s), r in rows.items():
        assert r["ringreduce"] > 0 and r["floor"] > 0, r
        # The paired floor: ringreduce's own cost above torch's, less than its whole time.
        assert r["ringreduce_over_floor"] < r["ringreduce"], r
        if ld == "busy":
            assert r["ringreduce_slowdown"] == pytest.approx(
                r["ringreduce"] / rows[("none", s)]["ringreduce"]), r
            assert r["target"] == "-", r  # no peer ran, and no size from 1 MiB
    assert all(row["wrong"] == 0 for run in data["raw"] for row in run["rows"])
    assert {(run["load"], run["backend"]) for run in data["raw"]} == {
        (ld, b) for ld in ("none", "busy") for b in ("ringreduce", "floor")}
    for run in data["raw"]:
        for row in run["rows"]:
            assert ("over_floor_us" in row) == (run["backend"] == "ringreduce"), run
    assert "rr over floor" in text, text


@needs_cuda
@pytest.mark.timeout(300)
def test_cuda_run_beside_a_busy_loop(tmp_path):
    """--device cuda: the backend's CUDA all-reduce on 2 simulated ranks sharing the GPU, quiet
    and beside a busy loop: both tables, every element right."""
    out = tmp_path / "load-cuda.json"
    rc, text = run_bounded([sys.executable, str(LOAD), "--device", "cuda", "--backends",
                            "ringreduce", "--sizes", "8,1M", "--iters", "3", "--warmup", "1",
                            "--loads", "busy", "--load-procs", "2", "--json", str(out)],
                           240, cwd=ROOT)
    assert rc == 0, text
    assert "# device: " in text and "(the ranks share it)" in text, text
    data = json.loads(out.read_text())
    rows = {(r["load"], r["size"]): r for r in data["summary"]}
    assert set(rows) == {(ld, s) for ld in ("none", "busy") for s in (8, 1 << 20)}
    assert all(r["ringreduce"] > 0 for r in rows.values()), rows
    assert all(row["wrong"] == 0 for run in data["raw"] for row in run["rows"])


def test_cuda_without_a_gpu_says_so():
    """--device cuda where torch sees no GPU: exit status 2 and the reason, nothing run."""
    if load.torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the refusal cannot happen here")
    rc, text = run_bounded([sys.executable, str(LOAD), "--device", "cuda", "--sizes", "8"],
                           120, cwd=ROOT)
    assert rc == 2, text
    assert "--device cuda, but torch" in text and "sees no CUDA device" in text, text
