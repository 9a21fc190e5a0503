"""bench/fr_cost.py with a tiny run: both modes' rows, the cold call and init lines, and the
check that the recorder held nothing off and every call on (the exit status). Speed is never
asserted. Bounded by checks.run_bounded."""
import json
import sys
import tempfile
from pathlib import Path

import pytest

from checks import run_bounded

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "fr_cost.py"
TIMEOUT = 240  # s; the run takes ~15 s on the 2-core CI machine


@pytest.mark.timeout(TIMEOUT + 30)
def test_tiny_run_reports_both_modes_and_checks_the_entries(tmp_path):
    out_json = tmp_path / "fr.json"
    with tempfile.TemporaryFile("w+") as err:
        code, out = run_bounded([sys.executable, str(BENCH), "--ranks", "2", "--sizes", "8", "1K",
                                 "--iters", "5", "--warmup", "2", "--trials", "1",
                                 "--json", str(out_json)], TIMEOUT, stderr=err, cwd=ROOT)
        err.seek(0)
        assert code == 0, out + err.read()
    assert "WRONG" not in out, out
    rows = json.loads(out_json.read_text())["rows"]
    assert [r["bytes"] for r in rows] == [8, 1024], rows
    assert all(r["wrong"] == 0 and r["on"] > 0 and r["off"] > 0 for r in rows), rows
    assert " off: init_process_group" in out and "  on: init_process_group" in out, out
