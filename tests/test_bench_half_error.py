"""bench/half_error.py on ResNet-18 gradients in bfloat16 with gloo's columns, 2 and 4 ranks:
the bounds that one rounding and N-1 roundings must keep, once against per_hop, and gloo's cells
present and finite. Bounded by checks.run_bounded.

The bounds, in the bench's unit (the bfloat16 spacing at the element's largest input m): a sum of
N inputs is at most N*m, whose spacing is at most 2^ceil(log2 N) units, so one rounding to
nearest errs by at most 2^ceil(log2 N) / 2 units (1 for N = 2, 2 for N = 4; the fp32
accumulation before it adds under 0.001). The ring's and gloo's sums round at most N-1 partial
sums, each at most N*m: at most 6 units for N = 4."""
import math
import sys
from pathlib import Path

import pytest
import torch

from checks import needs_cuda, run_bounded

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "half_error.py"
TIMEOUT = 120  # s; the run took 12-18 s on the 2-core machine, under another's load
RANKS = (2, 4)
METHODS = ("per_hop", "once", "gloo")


def table(text):
    """{N: {column: value}} from the bench's markdown table; every cell a finite number."""
    lines = [ln for ln in text.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        row = dict(zip(header, (c.strip() for c in line.strip("|").split("|"))))
        assert row.pop("dtype") == "bfloat16", line
        n = int(row.pop("N"))
        rows[n] = {k: float(v.rstrip("%")) for k, v in row.items()}
        assert all(math.isfinite(v) for v in rows[n].values()), line
    return rows


@pytest.mark.timeout(TIMEOUT + 30)
def test_resnet18_gradients_once_per_hop_and_gloo():
    code, text = run_bounded(
        [sys.executable, str(BENCH), "--inputs", "resnet18", "--peers", "gloo",
         "--ranks", ",".join(map(str, RANKS)), "--dtypes", "bfloat16",
         "--batch-size", "2", "--image-size", "8"], TIMEOUT, cwd=ROOT)
    assert code == 0, text
    assert ("# inputs: ResNet-18 gradients, 11,172,810 elements a rank; model seed 0, "
            "rank r's minibatch (2 images of 1x8x8) seed 0 + 1 + r") in text, text
    rows = table(text)
    assert sorted(rows) == list(RANKS), text
    for n, row in rows.items():
        assert sorted(row) == sorted(f"{m} {s}" for m in METHODS
                                     for s in ("mean ulp", "max ulp", "exact")), text
        assert all(0 <= row[f"{m} exact"] <= 100 for m in METHODS), text

    two, four = rows[2], rows[4]
    # Two ranks: the ring's one hop rounds the same fp32 sum once.
    assert all(two[f"per_hop {s}"] == two[f"once {s}"]
               for s in ("mean ulp", "max ulp", "exact")), text
    assert two["once max ulp"] <= 1.0 and two["gloo max ulp"] <= 1.0, text
    # Four ranks: once rounds once, the ring three times.
    assert four["once max ulp"] <= 2.0, text
    assert four["per_hop max ulp"] <= 6.0 and four["gloo max ulp"] <= 6.0, text
    assert four["once mean ulp"] < four["per_hop mean ulp"], text
    assert four["once max ulp"] <= four["per_hop max ulp"], text
    assert four["once exact"] >= four["per_hop exact"], text


def test_nccl_needs_cuda_tensors():
    """--peers nccl on CPU tensors: refused with the reason before anything runs."""
    code, text = run_bounded([sys.executable, str(BENCH), "--peers", "nccl"], 60, cwd=ROOT)
    assert code == 2, text
    assert "--peers nccl needs --device cuda" in text, text


def test_cuda_without_a_gpu_says_so():
    """--device cuda where torch sees no GPU: exit status 2 and the reason."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the refusal cannot happen here")
    code, text = run_bounded([sys.executable, str(BENCH), "--device", "cuda"], 60, cwd=ROOT)
    assert code == 2, text
    assert "--device cuda, but torch" in text and "sees no CUDA device" in text, text


@needs_cuda
@pytest.mark.timeout(TIMEOUT + 30)
def test_cuda_once_is_the_cpu_once_and_nccl_beside_it():
    """--device cuda, bfloat16, 2 and 4 ranks on one GPU: the CUDA once-rounded sum has the CPU
    one's bits in every element; per hop equals once at 2 ranks; NCCL's cells are numbers within
    N-1 roundings' bound, or say why NCCL could not run."""
    code, text = run_bounded(
        [sys.executable, str(BENCH), "--device", "cuda", "--ranks", "2,4", "--dtypes",
         "bfloat16", "--peers", "nccl"], TIMEOUT, cwd=ROOT)
    assert code == 0, text
    lines = [ln for ln in text.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        row = dict(zip(header, (c.strip() for c in line.strip("|").split("|"))))
        rows[int(row["N"])] = row
    assert sorted(rows) == [2, 4], text
    for n, row in rows.items():
        assert row["once cpu!=cuda"] == "0", text
        assert float(row["once max ulp"]) <= (1.0 if n == 2 else 2.0), text
        if row["nccl max ulp"] != "n/a":
            assert float(row["nccl max ulp"]) <= (1.0 if n == 2 else 6.0), text
        else:
            assert row["nccl mean ulp"].startswith("n/a ("), text
    assert rows[2]["per_hop exact"] == rows[2]["once exact"], text
