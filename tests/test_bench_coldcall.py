"""bench/coldcall.py (the cold call beside back-to-back calls) and bench/multihost.py (two
simulated hosts against gloo) on tiny sweeps: their tables, #wrong and exit codes. Speed is never
asserted here. Every run is bounded by a subprocess timeout."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from checks import load_module

ROOT = Path(__file__).resolve().parents[1]
COLD = ROOT / "bench" / "coldcall.py"
MULTIHOST = ROOT / "bench" / "multihost.py"
TIMEOUT = 240  # s per bench run; a tiny run takes 10-30 s here

multihost = load_module("bench_multihost", MULTIHOST)
coldcall = load_module("bench_coldcall", COLD)


def run(script, args):
    res = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                         timeout=TIMEOUT, cwd=ROOT)
    return res.returncode, res.stdout + res.stderr


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
