"""bench/cpushare.py (a CPU all-reduce's wall time beside its CPU time and context switches): a
tiny run per placement prints a row per rank with 0 wrong. Speed is never asserted here."""
import sys
from pathlib import Path

import pytest

from checks import run_bounded

ROOT = Path(__file__).resolve().parents[1]
CPUSHARE = ROOT / "bench" / "cpushare.py"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("extra", [[], ["--pin"], ["--load", "1", "--session", "same"]])
def test_tiny_run_reports_every_rank(extra):
    rc, text = run_bounded([sys.executable, str(CPUSHARE), "--size", "2M", "--iters", "3",
                            "--warmup", "1"] + extra, 240, cwd=ROOT)
    assert rc == 0, text
    rows = [line.split() for line in text.splitlines() if line[:1] == " " and line.split()]
    assert [int(r[0]) for r in rows] == [0, 1], text
    for r in rows:
        wall, cpu = float(r[1]), float(r[2])
        assert wall > 0 and cpu >= 0 and int(r[6]) == 0, text
    assert ("pinned to one CPU" in text) == ("--pin" in extra), text
