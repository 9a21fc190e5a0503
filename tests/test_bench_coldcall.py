"""bench/coldcall.py (the cold call beside back-to-back calls) and bench/multihost.py (two
simulated hosts against gloo) on tiny sweeps: their tables, #wrong and exit codes. Speed is never
asserted here. Every run is bounded by checks.run_bounded: past the bound the bench is killed
with every rank it spawned."""
import json
import os
import signal
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from checks import alive, load_module, run_bounded

ROOT = Path(__file__).resolve().parents[1]
COLD = ROOT / "bench" / "coldcall.py"
MULTIHOST = ROOT / "bench" / "multihost.py"
TIMEOUT = 240  # s per bench run; a tiny run takes 10-30 s here

multihost = load_module("bench_multihost", MULTIHOST)
coldcall = load_module("bench_coldcall", COLD)


def run(script, args, timeout=TIMEOUT, env=None):
    """(exit status, stdout and stderr) of a bench run; the benches spawn their ranks."""
    return run_bounded([sys.executable, str(script), *args], timeout, cwd=ROOT, env=env)


def rows(text):
    """The table's rows: the lines after the header, split into cells."""
    lines = text.splitlines()
    first = max(i for i, ln in enumerate(lines) if ln.startswith("#")) + 1
    return [ln.split() for ln in lines[first:] if ln.strip()]


def test_coldcall_times_gloo_alone_after_the_others():
    """gloo's threads stay busy after its call returns: interleaved with it, every other
    configuration measured 3-5x its own time. Every configuration is timed exactly once."""
    assert coldcall.passes(list(coldcall.CONFIGS)) == [
        [c for c in coldcall.CONFIGS if c != "gloo"], ["gloo"]]
    assert coldcall.passes(["gloo"]) == [["gloo"]]
    assert coldcall.passes(["fake", "ringreduce"]) == [["fake", "ringreduce"]]


def test_coldcall_each_configuration_follows_each_other_equally_often():
    """What a call pays for the one before it is spread evenly over the configurations timed
    together."""
    configs = coldcall.passes(list(coldcall.CONFIGS))[0]
    follows = {}
    for i in range(24 * 3):
        order = coldcall.visit_order(configs, i)
        assert sorted(order) == sorted(configs)
        for before, after in zip(order, order[1:]):
            follows[(before, after)] = follows.get((before, after), 0) + 1
    assert len(follows) == len(configs) * (len(configs) - 1)
    assert len(set(follows.values())) == 1, follows


@pytest.mark.timeout(TIMEOUT + 30)
def test_coldcall_tiny_sweep(tmp_path):
    out = tmp_path / "cold.json"
    rc, text = run(COLD, ["--sizes", "8", "4K", "--iters", "3", "--warmup", "1", "--b2b-run",
                          "3", "--json", str(out)])
    assert rc == 0, text
    table = rows(text)
    assert [r[0] for r in table] == ["8", "4096"], text
    for r in table:
        # size iters, then cold b2b #wrong per configuration (fake moves nothing: "-"), then
        # ringreduce's cold time minus ringreduce-sync's and minus fake's.
        assert len(r) == 2 + 4 * 3 + 2, r
        assert [r[4], r[7], r[10], r[13]] == ["0", "0", "0", "-"], r
    data = json.loads(out.read_text())
    assert [row["size"] for row in data["rows"]] == [8, 4096]
    assert all(row[c]["cold_us"] > 0 and row[c]["b2b_us"] > 0 for row in data["rows"]
               for c in ("ringreduce", "ringreduce-sync", "gloo", "fake"))
    assert set(data["load_average"]) == {"start", "end"}


@pytest.mark.timeout(TIMEOUT + 30)
def test_multihost_tiny_sweep(tmp_path):
    why = multihost.namespaces_unavailable()
    if why:
        pytest.skip(f"bench/multihost.py cannot simulate hosts here: {why}")
    out = tmp_path / "mh.json"
    rc, text = run(MULTIHOST, ["--sizes", "8", "300K", "--iters", "2", "--warmup", "1",
                               "--json", str(out)])
    assert rc == 0, text
    # ringreduce found the hosts from their hostnames alone (no RINGREDUCE_HOST_ID).
    assert "hosts found by ringreduce: [[0, 1], [2, 3]] (hostnames ['hosta', 'hostb'])" in text
    table = rows(text)
    assert [r[0] for r in table] == ["8", "307200"], text
    assert all(r[4] == "0" and r[7] == "0" for r in table), text
    data = json.loads(out.read_text())
    for row in data["rows"]:
        assert row["ratio"] == pytest.approx(row["ringreduce"]["time_us"] /
                                             row["gloo"]["time_us"])
        # Four processes' CPU time: positive, and at most cores x time plus the slack of medians
        # taken over different iterations.
        for b in multihost.BACKENDS:
            assert 0 < row[b]["cpu_us"] < 4 * (os.cpu_count() or 1) * row[b]["time_us"], row


def _marked(marker):
    """{pid: command line} of the live processes whose environment holds `marker` (a zombie has
    exited)."""
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if marker.encode() not in f.read().split(b"\0") or not alive(int(name)):
                    continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                found[int(name)] = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone meanwhile, or not ours
    return found


COLD_BOUND_S = 10  # past the spawn of the ranks (a few seconds here), long before the sweep ends


@pytest.mark.timeout(120)
def test_coldcall_timed_out_leaves_no_rank(tmp_path):
    """A bench run past its bound (a sweep of minutes, bounded at COLD_BOUND_S) is killed with the
    ranks it spawned: none outlives run(). The processes are told apart by a marker in their
    environment, which the spawned ranks inherit; a watcher sees them while the bench runs."""
    name, value = "RINGREDUCE_TEST_COLDCALL", uuid.uuid4().hex
    marker = f"{name}={value}"
    seen, stop = {}, threading.Event()

    def watch():
        while not stop.is_set():
            seen.update(_marked(marker))
            time.sleep(0.1)

    watcher = threading.Thread(target=watch)
    watcher.start()
    start = time.monotonic()
    try:
        rc, out = run(COLD, ["--sizes", "8", "--iters", "1000000", "--warmup", "1",
                             "--configs", "ringreduce"], timeout=COLD_BOUND_S,
                      env=dict(os.environ, **{name: value}))
    except Exception as exc:  # noqa: BLE001 - what run() must not do; the ranks are checked first
        rc, out = None, f"run() raised {type(exc).__name__}: {exc}"
    finally:
        stop.set()
        watcher.join()
    took = time.monotonic() - start
    deadline = time.monotonic() + 10
    while _marked(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _marked(marker)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    ranks = [pid for pid, cmd in seen.items() if "spawn_main" in cmd]
    assert len(ranks) == 2, f"the bench's two ranks were not both seen running: {seen}\n{out}"
    assert not left, f"the bench's processes outlived run()'s bound: {left}\n{out}"
    assert rc != 0 and f"(killed after {COLD_BOUND_S} s)" in out, (rc, out)
    assert took < COLD_BOUND_S + 20, took
