"""bench/ring.py, the bandwidth benchmark: its whole code path on CPU with tiny sizes (table
columns, #wrong, JSON and CSV content, exit codes, plot), its NCCL decisions without a GPU, and
a short CUDA run where a GPU exists. Speed itself is never asserted here."""
import csv
import importlib.util
import io
import json
import math
import os
import subprocess
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import ringreduce

from checks import load_module, needs_cuda

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "ring.py"


def _load_bench():
    return load_module("bench_ring", BENCH)


ring = _load_bench()
common = ring.common

TINY = ["--device", "cpu", "--iters", "2", "--warmup", "1"]
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def run_main(args):
    out = io.StringIO()
    rc = ring.main(args, out=out)
    return rc, out.getvalue()


def data_rows(text):
    return [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]


def assert_bandwidth_arithmetic(size, result, nranks):
    t = result["time_us"] * 1e-6
    assert t > 0
    assert math.isclose(result["algbw_gbps"], size / t / 1e9, rel_tol=1e-9)
    assert math.isclose(result["busbw_gbps"], result["algbw_gbps"] * 2 * (nranks - 1) / nranks,
                        rel_tol=1e-9)


def test_cli_cpu_sweep_table_json_csv(tmp_path):
    """The script as a user runs it: sizes rounded to whole elements, nccl-tests columns that
    line up, #wrong 0, and JSON and CSV that agree with the table and with size / time."""
    jpath, cpath = tmp_path / "r.json", tmp_path / "r.csv"
    res = subprocess.run(
        [sys.executable, str(BENCH), *TINY, "--ranks", "3", "--min-bytes", "1",
         "--max-bytes", "4K", "--json", str(jpath), "--csv", str(cpath)],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    text = res.stdout
    sizes = [4 << k for k in range(11)]  # 1 and 2 B round up to one float32; 4 B is kept once

    names = next(ln for ln in text.splitlines() if ln.split()[:2] == ["#", "size"])
    assert names.split()[1:] == (["size", "count", "type", "redop"]
                                 + ["time", "algbw", "busbw", "#wrong"] * 2)
    titles = next(ln for ln in text.splitlines()
                  if ln.startswith("#") and "ringreduce" in ln and "reference" in ln
                  and "time" not in ln)
    assert titles.index("ringreduce") < titles.index("reference")
    rows = data_rows(text)
    assert len(rows) == len(sizes)

    def right_edges(line):
        edges, i = [], 0
        for tok in line.split():
            i = line.index(tok, i) + len(tok)
            edges.append(i)
        return edges

    name_edges = right_edges(names)[1:]
    for row, size in zip(rows, sizes):
        f = row.split()
        assert right_edges(row) == name_edges, (names, row)
        assert (int(f[0]), int(f[1]), f[2], f[3]) == (size, size // 4, "float32", "sum")
        assert f[7] == "0" and f[11] == "0"
    assert "Out of bounds values : 0 OK" in text
    assert "nccl: not run: CPU run" in text

    data = json.loads(jpath.read_text())
    cfg = data["config"]
    assert data["ok"] is True and data["failures"] == []
    assert (cfg["device"], cfg["ranks"], cfg["dtype"], cfg["op"]) == ("cpu", 3, "float32", "sum")
    assert cfg["sizes"] == sizes
    assert set(cfg["implementations"]) == {"ringreduce", "reference"}
    assert "CPU run" in cfg["unavailable"]["nccl"]
    assert cfg["ringreduce"]["version"] == ringreduce.build_info()["version"]
    assert [r["size"] for r in data["rows"]] == sizes
    for jrow, trow in zip(data["rows"], rows):
        f = trow.split()
        assert jrow["count"] == jrow["size"] // 4
        for k, name in enumerate(("ringreduce", "reference")):
            r = jrow["results"][name]
            assert r["wrong"] == 0
            assert_bandwidth_arithmetic(jrow["size"], r, 3)
            assert float(f[4 + 4 * k]) == pytest.approx(r["time_us"], abs=0.0051)

    with open(cpath, newline="") as fh:
        crows = list(csv.DictReader(fh))
    assert [int(r["size"]) for r in crows] == sizes
    for crow, jrow in zip(crows, data["rows"]):
        for name in ("ringreduce", "reference"):
            assert int(crow[f"{name}_wrong"]) == 0
            assert crow[f"{name}_error"] == ""
            r = {k: float(crow[f"{name}_{k}"]) for k in ("time_us", "algbw_gbps", "busbw_gbps")}
            assert r["time_us"] == pytest.approx(jrow["results"][name]["time_us"])
            assert_bandwidth_arithmetic(int(crow["size"]), r, int(crow["ranks"]))


@pytest.mark.parametrize("dtype,op,nranks", [
    ("float16", "sum", 4), ("bfloat16", "avg", 5), ("float64", "min", 4), ("float32", "prod", 6),
    ("int8", "prod", 3), ("uint8", "max", 2), ("int64", "sum", 7), ("int32", "sum", 4),
])
def test_dtypes_and_ops_check_clean(tmp_path, dtype, op, nranks):
    """The reference and its tolerance accept the real ringreduce (and the torch reference)
    for every kind of element and operator, at odd sizes and rank counts."""
    jpath = tmp_path / "r.json"
    rc, text = run_main([*TINY, "--dtype", dtype, "--op", op, "--ranks", str(nranks),
                         "--min-bytes", "3", "--max-bytes", "3K", "--json", str(jpath)])
    data = json.loads(jpath.read_text())
    assert rc == 0, text
    assert data["rows"]
    for row in data["rows"]:
        assert row["type"] == dtype and row["redop"] == op
        for name in ("ringreduce", "reference"):
            assert row["results"][name]["wrong"] == 0


@pytest.mark.parametrize("dtype,op", [("float32", "sum"), ("bfloat16", "avg"), ("int32", "max")])
def test_one_wrong_element_fails_the_run(tmp_path, monkeypatch, dtype, op):
    """Corrupt one element of one rank after the real ringreduce call: every size reports
    exactly one wrong element, the reference none, and the exit status is 1."""
    real = ring.run_ringreduce

    def corrupting(tensors, op_name):
        real(tensors, op_name)
        flat = tensors[-1].view(-1)
        flat[flat.numel() // 2] += 1

    monkeypatch.setattr(ring, "run_ringreduce", corrupting)
    jpath, cpath = tmp_path / "r.json", tmp_path / "r.csv"
    rc, text = run_main([*TINY, "--dtype", dtype, "--op", op, "--max-bytes", "1K",
                         "--json", str(jpath), "--csv", str(cpath)])
    assert rc == 1
    assert "FAILED" in text
    data = json.loads(jpath.read_text())
    assert data["ok"] is False
    assert len(data["failures"]) == len(data["rows"])
    for row in data["rows"]:
        assert row["results"]["ringreduce"]["wrong"] == 1
        assert row["results"]["reference"]["wrong"] == 0
    with open(cpath, newline="") as fh:
        assert all(r["ringreduce_wrong"] == "1" for r in csv.DictReader(fh))


def test_failing_call_fails_the_run(tmp_path, monkeypatch):
    def broken(tensors, op_name):
        raise RuntimeError("ring broke")

    monkeypatch.setattr(ring, "run_ringreduce", broken)
    jpath = tmp_path / "r.json"
    rc, text = run_main([*TINY, "--max-bytes", "64", "--json", str(jpath)])
    assert rc == 1
    rows = data_rows(text)
    assert rows and all("error: RuntimeError: ring broke" in r for r in rows)
    data = json.loads(jpath.read_text())
    assert all(r["results"]["ringreduce"] == {"error": "RuntimeError: ring broke"}
               for r in data["rows"])
    assert all(r["results"]["reference"]["wrong"] == 0 for r in data["rows"])


def test_tolerance_catches_a_missing_rank():
    """The float tolerance is far below one rank's contribution, even in bfloat16 with 8 ranks;
    and the real ringreduce sits well inside it."""
    parser, args = ring.parse_args(["--device", "cpu", "--dtype", "bfloat16", "--ranks", "8"])
    cfg = ring.make_config(parser, args)
    inputs = ring.make_inputs(cfg, 4099, seed=1)
    ref = ring.make_reference(cfg, inputs)
    good = [x.clone() for x in inputs]
    ringreduce.all_reduce(good, "sum")
    assert ring.count_wrong(good, ref) == 0
    err = max(((g.double() - ref.value).abs() / ref.tol).max().item() for g in good)
    assert err < 0.5
    missing = [x.clone() for x in inputs[:-1]]
    ringreduce.all_reduce(missing, "sum")
    assert ring.count_wrong(missing, ref) > 0.5 * 7 * 4099


def test_reference_does_not_alias_its_inputs():
    """float64 and int64 inputs are already the wide type: the reference must still copy."""
    for dtype in ("float64", "int64"):
        parser, args = ring.parse_args(["--device", "cpu", "--dtype", dtype, "--ranks", "3"])
        cfg = ring.make_config(parser, args)
        inputs = ring.make_inputs(cfg, 100, seed=2)
        before = [x.clone() for x in inputs]
        ref = ring.make_reference(cfg, inputs)
        assert all(torch.equal(a, b) for a, b in zip(inputs, before))
        ring.count_wrong(inputs, ref)
        assert all(torch.equal(a, b) for a, b in zip(inputs, before))
        assert all(x.abs().sum() > 0 for x in inputs)


def test_cpu_run_never_touches_cuda(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("a --device cpu run called into torch.cuda")

    for name in ("is_available", "device_count", "synchronize", "current_stream", "Event",
                 "Stream", "get_device_properties", "device"):
        monkeypatch.setattr(torch.cuda, name, forbidden)
    rc, text = run_main([*TINY, "--max-bytes", "256"])
    assert rc == 0, text


def test_sizes_and_bad_arguments(capsys):
    assert [common.parse_size(s) for s in ("8", "64K", "64KiB", "1m", "1G", "2kb")] == [
        8, 64 << 10, 64 << 10, 1 << 20, 1 << 30, 2 << 10]
    assert common.doubling_sizes(1, 16, 4) == [4, 8, 16]
    assert common.doubling_sizes(3, 100, 8) == [8, 24, 48, 96]
    assert common.doubling_sizes(8, 8, 2) == [8]
    for bad in (["--ranks", "1"], ["--op", "avg", "--dtype", "int32"], ["--min-bytes", "0"],
                ["--min-bytes", "1K", "--max-bytes", "512"], ["--min-bytes", "1X"],
                ["--iters", "0"]):
        with pytest.raises(SystemExit) as e:
            run_main(["--device", "cpu", *bad])
        assert e.value.code == 2
        assert "error:" in capsys.readouterr().err


def test_rotation_sets():
    assert common.rotation_sets(set_bytes=1 << 30, cache_bytes=50 << 20, max_sets=25) == 1
    assert common.rotation_sets(set_bytes=10 << 20, cache_bytes=50 << 20, max_sets=25) == 10
    assert common.rotation_sets(set_bytes=32, cache_bytes=50 << 20, max_sets=25) == 25


def test_plot_without_matplotlib_says_so_before_running(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    jpath = tmp_path / "r.json"
    rc, text = run_main([*TINY, "--max-bytes", "64", "--plot", str(tmp_path / "p.png"),
                         "--json", str(jpath)])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--plot needs matplotlib" in err and "pip install matplotlib" in err
    assert not jpath.exists() and text == ""


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib is not installed")
def test_plot_writes_png(tmp_path):
    ppath = tmp_path / "p.png"
    rc, _ = run_main([*TINY, "--max-bytes", "1K", "--plot", str(ppath)])
    assert rc == 0
    assert ppath.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _shared_gpu_config():
    return ring.Config(device="cuda", rank_devices=[torch.device("cuda", 0)] * 4,
                       dtype_name="float32", op="sum", sizes=[8], iters=1, warmup=0, seed=0,
                       layout="4 simulated ranks on one GPU")


@pytest.fixture
def fake_nccl_torch(monkeypatch):
    """Pretend torch has NCCL, so setup_nccl's decisions can be checked without a GPU."""
    monkeypatch.setattr(torch._C, "_nccl_all_reduce", object(), raising=False)
    monkeypatch.setattr(ring, "torch_nccl_accepts", lambda cfg: False)
    # setenv first: delenv of an unset variable records nothing, and setup_nccl sets
    # NCCL_MULTI_RANK_GPU_ENABLE and the CTA bounds, which must not outlive the test.
    for name in ("NCCL_MULTI_RANK_GPU_ENABLE", "RINGREDUCE_NCCL_LIB", *ring.CTA_ENV):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: SimpleNamespace(multi_processor_count=132))  # an H100's


def test_old_nccl_on_one_gpu_is_named_in_its_column(monkeypatch, fake_nccl_torch):
    monkeypatch.setattr(ring, "nccl_version_tuple", lambda: (2, 27, 3))
    impl, why, info = ring.setup_nccl(_shared_gpu_config())
    assert impl is None
    assert "2.27.3" in why.short and "Duplicate GPU detected" in why.detail
    assert os.environ["NCCL_MULTI_RANK_GPU_ENABLE"] == "1"
    assert info["version"] == "2.27.3"
    assert "RINGREDUCE_NCCL_LIB" in why.detail  # the way to a newer one
    assert info["library"].startswith("NCCL 2.27.3 torch's bundled (")
    table = common.Table(ring.KEY_COLUMNS, [("ringreduce", ring.IMPL_COLUMNS),
                                            ("nccl", ring.IMPL_COLUMNS)])
    row = {"size": 8, "count": 2, "type": "float32", "redop": "sum",
           "results": {"ringreduce": {"time_us": 5.0, "algbw_gbps": 1.6e-3,
                                      "busbw_gbps": 2.4e-3, "wrong": 0}}}
    keys, cells = ring.table_cells(row, ["ringreduce", "nccl"], {"nccl": why}, roofline=False)
    line = table.row(keys, cells)
    assert line.rstrip().endswith(why.short)
    assert len(line) == len(table.header()[1])


def test_nccl_that_fails_its_trial_is_not_used(monkeypatch, fake_nccl_torch):
    monkeypatch.setattr(ring, "nccl_version_tuple", lambda: (2, 30, 1))
    monkeypatch.setattr(ring, "_probe_nccl_in_child", lambda cfg: "a trial all-reduce hung")
    impl, why, info = ring.setup_nccl(_shared_gpu_config())
    assert impl is None
    assert "hung" in why.detail and "NCCL_MULTI_RANK_GPU_ENABLE=1" in why.detail


def test_nccl_on_a_shared_gpu_runs_with_its_ctas_capped(monkeypatch, fake_nccl_torch):
    """Four ranks' NCCL kernels on one GPU spin on each other and must all be resident: the CTA
    bounds are in the environment before the probe's child starts (and so before any
    communicator), named in the JSON's NCCL entry; a caller's own value wins."""
    monkeypatch.setattr(ring, "nccl_version_tuple", lambda: (2, 30, 7))
    seen = {}

    def probe(cfg):
        seen.update({k: os.environ.get(k) for k in ring.CTA_ENV})
        return "stopped here: the test needs no communicator"

    monkeypatch.setattr(ring, "_probe_nccl_in_child", probe)
    impl, why, info = ring.setup_nccl(_shared_gpu_config())
    assert impl is None and "stopped here" in why.detail
    assert seen == {"NCCL_MIN_CTAS": "1", "NCCL_MAX_CTAS": "16"}
    assert info["NCCL_MAX_CTAS"] == "16"
    monkeypatch.setenv("NCCL_MAX_CTAS", "4")
    ring.setup_nccl(_shared_gpu_config())
    assert seen["NCCL_MAX_CTAS"] == "4"


def test_cta_cap_leaves_room_for_every_rank():
    from ringreduce.train import nccl
    assert nccl.shared_gpu_cta_cap(4, 132) == 16
    assert nccl.shared_gpu_cta_cap(8, 132) == 8
    assert nccl.shared_gpu_cta_cap(2, 132) == nccl.MAX_CTAS_SHARED
    assert nccl.shared_gpu_cta_cap(64, 132) == 1
    for ranks in range(2, 65):
        cap = nccl.shared_gpu_cta_cap(ranks, 132)
        assert cap * ranks <= 132 // 2 or cap == 1
    env = {}
    assert nccl.cap_shared_gpu_ctas([0, 1, 2, 3], env) == {} and env == {}


def test_nccl_probe_covers_the_sizes_of_the_run(monkeypatch):
    """The probe tries more than the 4,099 elements of the first GPU run (which then hung at
    1 MiB): an odd count, just over 1 MiB, and the run's largest size, passed to the child."""
    cfg = _shared_gpu_config()
    cfg.sizes = common.doubling_sizes(8, 256 * common.MiB, 4)
    counts = ring.probe_counts(cfg)
    assert counts[0] == 4099 and (1 << 18) < counts[1] < (1 << 19)
    assert counts[-1] == 64 * common.MiB
    commands = []

    def fake_run(cmd, **kwargs):
        commands.append(cmd)
        return SimpleNamespace(returncode=0, stdout="NCCL_PROBE_OK\n", stderr="")

    monkeypatch.setattr(ring.subprocess, "run", fake_run)
    assert ring._probe_nccl_in_child(cfg) is None
    cmd = commands[0]
    assert cmd[cmd.index("--max-bytes") + 1] == str(256 * common.MiB)
    assert float(cmd[cmd.index("--deadline") + 1]) <= ring.NCCL_PROBE_TIMEOUT_S / 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the probe's failure report")
def test_nccl_probe_child_reports_why():
    """The trial runs in a child process; whatever stops it comes back as a reason."""
    reason = ring._probe_nccl_in_child(_shared_gpu_config())
    assert reason is not None and "no CUDA device" in reason


@needs_cuda
def test_cuda_simulated_ranks_tiny(tmp_path):
    """On one GPU (CUDA_VISIBLE_DEVICES=0): 4 simulated ranks, #wrong 0, the roofline present,
    and NCCL either measured and right or unavailable with a reason."""
    jpath = tmp_path / "r.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0")
               .split(",")[0])
    res = subprocess.run(
        [sys.executable, str(BENCH), "--device", "cuda", "--min-bytes", "8", "--max-bytes",
         "256K", "--iters", "3", "--warmup", "1", "--graph", "--json", str(jpath)],
        capture_output=True, text=True, timeout=400, cwd=ROOT, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads(jpath.read_text())
    cfg = data["config"]
    assert cfg["ranks"] == 4 and cfg["copy_bandwidth_gbps"] > 0
    nccl_ok = "nccl" in cfg["implementations"]
    assert nccl_ok or cfg["unavailable"]["nccl"]
    paths = set()
    for row in data["rows"]:
        assert row["results"]["ringreduce"]["wrong"] == 0
        assert row["results"]["ringreduce-graph"]["wrong"] == 0
        assert_bandwidth_arithmetic(row["size"], row["results"]["ringreduce"], 4)
        assert row["roofline"]["ringreduce_pct_of_ideal"] > 0
        paths.add(row["path"])
        if nccl_ok:
            assert row["results"]["nccl"]["wrong"] == 0
    assert paths == {"oneshot", "ring"}, "the sweep crosses the one-shot threshold (64 KiB)"


def test_graph_and_path_on_cpu(tmp_path):
    """--graph names why it cannot run on CPU; every CPU row ran the ring."""
    jpath = tmp_path / "r.json"
    rc, text = run_main([*TINY, "--max-bytes", "256", "--graph", "--json", str(jpath)])
    assert rc == 0, text
    assert "ringreduce-graph: --graph: capture needs every rank on one GPU" in text
    data = json.loads(jpath.read_text())
    assert {row["path"] for row in data["rows"]} == {"ring"}
    assert "ringreduce-graph" in data["config"]["unavailable"]


class _FakeGraphs:
    """torch.cuda's stream and graph API on the CPU, enough for GraphedRingreduce: a capture
    records ringreduce's call with its tensors (their pointers and element counts are baked
    in, as in a real graph) and a replay runs that call again on the CPU ring."""

    def __init__(self, monkeypatch):
        self.captures = 0
        self.recording = None
        real = ring.run_ringreduce

        def run(tensors, op):
            if self.recording is not None:
                self.recording.calls.append((list(tensors), op))
            else:
                real(tensors, op)

        fake = self

        class Graph:
            def __init__(self):
                self.calls = []

            def replay(self):
                for tensors, op in self.calls:
                    real(tensors, op)

        class Capture:
            def __init__(self, graph):
                self.graph = graph

            def __enter__(self):
                fake.recording = self.graph

            def __exit__(self, *exc):
                fake.recording = None
                fake.captures += 1

        class Stream:
            def wait_stream(self, other):
                pass

        class OnStream:
            def __init__(self, stream):
                pass

            def __enter__(self):
                pass

            def __exit__(self, *exc):
                pass

        monkeypatch.setattr(ring, "run_ringreduce", run)
        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(torch.cuda, "graph", Capture)
        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "stream", OnStream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())


def _sum_of(sets):
    return torch.stack([t.double() for t in sets]).sum(0)


def test_graph_cache_keys_on_count_not_pointers_alone(monkeypatch):
    """The caching allocator hands the next size the same blocks: a set with the same
    pointers and fewer elements must get its own graph, not replay the old count."""
    _FakeGraphs(monkeypatch)
    g = torch.Generator().manual_seed(27)
    print("seed 27")
    storage = [torch.rand(8, generator=g) + 0.5 for _ in range(2)]
    small = [s[:4] for s in storage]  # same data_ptr as storage, 4 elements
    want_small = _sum_of(small)
    graphed = ring.GraphedRingreduce("sum")
    graphed.prepare([storage, small])
    for t in storage:
        t[4:] = -1.0  # poison: a replay with the big count would overwrite it
    graphed(small)
    for t in storage:
        torch.testing.assert_close(t[:4].double(), want_small, rtol=1e-6, atol=0)
        assert torch.equal(t[4:], torch.full((4,), -1.0)), "replayed with the old count"


def test_graph_prepare_drops_earlier_graphs(monkeypatch):
    """Graphs of an earlier size point into freed buffers: prepare keeps only its own sets."""
    _FakeGraphs(monkeypatch)
    old = [torch.ones(8) for _ in range(2)]
    new = [torch.ones(4) for _ in range(2)]
    graphed = ring.GraphedRingreduce("sum")
    graphed.prepare([old])
    graphed.prepare([new])
    graphed(new)
    with pytest.raises(RuntimeError, match="not captured by prepare"):
        graphed(old)


def test_graph_column_times_replays_not_captures(monkeypatch, tmp_path):
    """Every buffer set is captured before the timed loop starts; the loop only replays, and
    the checked result is a replay's."""
    fake = _FakeGraphs(monkeypatch)
    real_time = common.time_iterations
    seen = {}

    def timed(fn, iters, warmup, devices=None, deadline=common.SYNC_DEADLINE_S):
        seen["before"] = fake.captures
        out = real_time(fn, iters, warmup, devices, deadline)
        seen["after"] = fake.captures
        return out

    monkeypatch.setattr(common, "time_iterations", timed)
    cfg = ring.Config(device="cpu", rank_devices=[torch.device("cpu")] * 3,
                      dtype_name="float32", op="sum", sizes=[256], iters=3, warmup=2,
                      seed=27, layout="3 ranks on the CPU")
    graphed = ring.GraphedRingreduce(cfg.op)
    impl = ring.Impl("ringreduce-graph", "graphed", graphed, prepare=graphed.prepare)
    row = ring.measure_size(cfg, [impl], 256, cache_bytes=1 << 30, copy_bw=None,
                            outcome=ring.Outcome(), log=print)
    nsets = row["buffer_sets"]
    assert nsets == cfg.iters + cfg.warmup
    assert row["results"]["ringreduce-graph"]["wrong"] == 0, row
    assert seen == {"before": nsets, "after": nsets}, f"captures in the timed loop: {seen}"


# ---------------------------------------------------------------------------------------------
# A run that NCCL (or anything else) cannot cost: columns chosen per run, rows in the JSON as
# they finish, a hang or a spent budget ending the run with what finished, stacks on SIGTERM.

def test_impls_choose_the_columns(tmp_path, capsys):
    rc, text = run_main([*TINY, "--max-bytes", "64", "--impls", "ringreduce"])
    assert rc == 0
    names = next(ln for ln in text.splitlines() if ln.split()[:2] == ["#", "size"])
    assert names.split().count("#wrong") == 2  # ringreduce and the CPU reference
    with pytest.raises(SystemExit):
        ring.main([*TINY, "--impls", "ringreduce,bogus"])
    assert "bogus" in capsys.readouterr().err
    # NCCL alone on CPU: nothing can run, and the run says so instead of printing an empty table
    jpath = tmp_path / "r.json"
    rc, text = run_main([*TINY, "--max-bytes", "64", "--impls", "nccl", "--json", str(jpath)])
    assert rc == 1 and data_rows(text) == []
    assert "nothing to measure" in capsys.readouterr().err
    data = json.loads(jpath.read_text())
    assert data["rows"] == [] and data["ok"] is False and "nccl" in data["config"]["unavailable"]


def test_forced_oneshot_column_on_one_gpu():
    """The one-shot kernel forced through RINGREDUCE_ONESHOT_BYTES above every size, only at the
    sizes where ringreduce's own choice is the ring; unavailable where ranks are not on one GPU."""
    cfg = _shared_gpu_config()
    cfg.sizes = common.doubling_sizes(8, 256 * common.MiB, 4)
    impl = ring.forced_oneshot(cfg, "p2p")
    assert impl.name == "ringreduce-oneshot"
    assert impl.environ == {"RINGREDUCE_ONESHOT_BYTES": str(256 * common.MiB)}
    assert impl.min_size == ringreduce.settings()["oneshot_max_bytes"] + 1
    assert isinstance(ring.forced_oneshot(cfg, "copy"), ring.Unavailable)
    cpu = ring.make_config(*_parsed([*TINY]))
    assert isinstance(ring.forced_oneshot(cpu, "p2p"), ring.Unavailable)


def test_fused_column_on_one_gpu():
    """RINGREDUCE_FUSED=1 only while the column runs, only at the sizes where ringreduce's own
    choice is the ring; unavailable where ranks are not on one GPU or the transport is copy."""
    cfg = _shared_gpu_config()
    cfg.sizes = common.doubling_sizes(8, 256 * common.MiB, 4)
    impl = ring.forced_fused(cfg, "p2p")
    assert impl.name == "ringreduce-fused" and impl.name in ring.OPTIONAL_IMPLS
    assert impl.environ == {"RINGREDUCE_FUSED": "1"}
    assert impl.min_size == ringreduce.settings()["oneshot_max_bytes"] + 1
    assert isinstance(ring.forced_fused(cfg, "copy"), ring.Unavailable)
    cpu = ring.make_config(*_parsed([*TINY]))
    assert isinstance(ring.forced_fused(cpu, "p2p"), ring.Unavailable)
    _, args = _parsed([*TINY, "--impls", "fused,ringreduce"])
    assert args.impls == ["ringreduce", "fused"]


def _parsed(argv):
    parser, args = ring.parse_args(argv)
    return parser, args


def test_an_implementation_runs_with_its_environment_and_from_its_size(monkeypatch):
    """measure_size sets an implementation's variables around its calls only, restores them,
    and marks the sizes below its first as skipped with the reason (no timing, no failure)."""
    monkeypatch.setenv("RINGREDUCE_ONESHOT_BYTES", "123")
    cfg = ring.make_config(*_parsed([*TINY, "--max-bytes", "64"]))
    seen = []

    def run(ts):
        seen.append(os.environ.get("RINGREDUCE_ONESHOT_BYTES"))
        ring.run_ringreduce(ts, "sum")

    impls = [ring.Impl("forced", "test", run, environ={"RINGREDUCE_ONESHOT_BYTES": "999"},
                       min_size=32, below_min="one-shot by default")]
    outcome = ring.Outcome()
    rows = [ring.measure_size(cfg, impls, size, 1 << 20, None, outcome, lambda line: None)
            for size in (16, 32)]
    assert rows[0]["results"]["forced"] == {"skipped": "one-shot by default"}
    assert rows[1]["results"]["forced"]["wrong"] == 0
    assert seen and set(seen) == {"999"}
    assert os.environ["RINGREDUCE_ONESHOT_BYTES"] == "123" and outcome.ok
    keys, cells = ring.table_cells(rows[0], ["forced"], {}, roofline=False)
    assert cells == ["one-shot by default"]


def test_a_hang_ends_the_run_with_the_rows_that_finished(tmp_path, monkeypatch):
    """A wait past --deadline (common.SyncTimeout) at one size: that row says 'hung', the JSON
    holds it and every row before it, the sizes after it are listed as not run, exit 3."""
    real = ring.run_ringreduce

    def hangs_from_64(ts, op):
        if ts[0].numel() * ts[0].element_size() >= 64:
            raise common.SyncTimeout("ringreduce's call on cuda:0 had not finished after 1 s")
        real(ts, op)

    monkeypatch.setattr(ring, "run_ringreduce", hangs_from_64)
    jpath = tmp_path / "r.json"
    rc, text = run_main([*TINY, "--max-bytes", "1K", "--json", str(jpath)])
    assert rc == ring.EXIT_HUNG
    data = json.loads(jpath.read_text())
    assert [r["size"] for r in data["rows"]] == [8, 16, 32, 64]
    assert data["rows"][-1]["results"]["ringreduce"]["error"].startswith("hung: ")
    assert data["not_run"] == [128, 256, 512, 1024]
    assert data["complete"] is False and data["ok"] is False and "hung" in data["stopped"]
    assert "Sizes run            : 4 of 8 (stopped: hung" in text


def test_budget_stops_starting_sizes(tmp_path, monkeypatch):
    """--budget: a size is not started when the time spent plus twice the last size's would pass
    it; the sizes not run are listed, and the exit status is 4 (all that ran was right)."""
    clock = [1000.0]
    monkeypatch.setattr(ring, "_now", lambda: clock[0])
    real = ring.measure_size

    def one_second_each(*args, **kwargs):
        clock[0] += 1.0
        return real(*args, **kwargs)

    monkeypatch.setattr(ring, "measure_size", one_second_each)
    jpath = tmp_path / "r.json"
    rc, text = run_main([*TINY, "--max-bytes", "1K", "--budget", "5.5", "--json", str(jpath)])
    assert rc == ring.EXIT_BUDGET
    data = json.loads(jpath.read_text())
    # starts at 0, 1, 2 and 3 s (3 + 2 * 1 <= 5.5); not at 4 s (4 + 2 > 5.5)
    assert [r["size"] for r in data["rows"]] == [8, 16, 32, 64]
    assert data["not_run"] == [128, 256, 512, 1024] and data["ok"] is True
    assert "--budget 5.5 s" in data["stopped"] and data["complete"] is False


def test_killed_run_leaves_the_sizes_it_finished_and_its_stacks(tmp_path):
    """The JSON is rewritten after every size, so a run killed mid-sweep (SIGTERM, as `timeout`
    sends) leaves the finished rows; faulthandler prints every thread's stack on stderr and the
    process still dies of the signal."""
    jpath = tmp_path / "r.json"
    proc = subprocess.Popen(
        [sys.executable, str(BENCH), "--device", "cpu", "--iters", "20", "--warmup", "2",
         "--max-bytes", "256M", "--json", str(jpath)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        rows = []
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                rows = json.loads(jpath.read_text())["rows"]
            except (OSError, ValueError):
                rows = []
            if len(rows) >= 3:
                break
            time.sleep(0.05)
        assert len(rows) >= 3 and proc.poll() is None, "the run ended or wrote no rows"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, err[-2000:])
    assert "most recent call first" in err and "ring.py" in err, err[-2000:]
    data = json.loads(jpath.read_text())
    assert data["complete"] is False and len(data["rows"]) >= 3
    sizes = [r["size"] for r in data["rows"]]
    assert sizes == [8 << k for k in range(len(sizes))]
    for r in data["rows"]:
        assert r["results"]["ringreduce"]["wrong"] == 0 and r["seconds"] >= 0
    printed = [int(ln.split()[0]) for ln in data_rows(out)]
    assert printed[:len(sizes)] == sizes


def test_bounded_sync_gives_up_at_its_deadline(monkeypatch):
    """common.bounded_sync polls an event on each device's current stream: it returns once the
    events complete, and raises SyncTimeout naming the device where one never does."""
    class FakeEvent:
        done_after = 3

        def __init__(self):
            self.queries = 0

        def record(self, stream):
            self.stream = stream

        def query(self):
            self.queries += 1
            return self.queries > self.done_after

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d: f"stream {d}")
    common.bounded_sync([0, 1], 5.0, "the test's work")
    FakeEvent.done_after = 10 ** 9
    start = time.monotonic()
    with pytest.raises(common.SyncTimeout, match=r"the test's work on cuda:0 .* after 0.2 s"):
        common.bounded_sync([0], 0.2, "the test's work")
    assert time.monotonic() - start < 5
