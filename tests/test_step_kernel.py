"""The ring-step kernel's per-thread body (csrc/ring/step.h: 16-byte packs when dst, own and src
are aligned, elements otherwise and for the tail) run on the host for every thread of simulated
grids, byte for byte against the CPU executor's combine (tests/step_driver.cpp). It checks the
kernel's indexing and its choice of path on CPU; the GPU's own arithmetic and memory need a GPU
(tests/test_cuda.py)."""
import os
import re
import subprocess
import sys

import pytest
import torch

from fake_cuda.build import CSRC, CXX, build
from reference import valid_ops

pytestmark = pytest.mark.skipif(CXX is None or not sys.platform.startswith("linux"),
                                reason="needs a C++ compiler on Linux")

DTYPES = ["float32", "float64", "float16", "bfloat16", "int32", "int64", "int8", "uint8", "bool"]


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    root = os.path.dirname(CSRC)
    return build(tmp_path_factory.mktemp("step"), "step_driver", [
        os.path.join(root, "tests", "step_driver.cpp"),
        os.path.join(CSRC, "ring", "cpu_executor.cpp")])


@pytest.mark.parametrize("dtype", DTYPES)
def test_step_body_matches_the_cpu_combine(driver, dtype):
    proc = subprocess.run([driver, dtype], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = re.findall(r"op=(\w+) cases=(\d+) mismatches=(\d+)", proc.stdout)
    # Every op the dtype takes (reference.valid_ops: bitwise ones on integers and bool), once.
    expected = sorted(valid_ops(getattr(torch, dtype)))
    assert sorted(op for op, _, _ in found) == expected, (expected, proc.stdout)
    for op, cases, bad in found:
        assert int(cases) > 1000 and bad == "0", (op, proc.stdout)
