"""The one-shot all-reduce gives the ring's bits (csrc/ring/oneshot.h).

tests/oneshot_driver.cpp is compiled with the host compiler against the torch-free sources and
checks, for one dtype per run, every supported op x 1..9, 16, 64 ranks x odd sizes, in place
and out of place: rr::cpu::all_reduce_oneshot and the CUDA kernel's per-thread body (run on the
host for every thread of a simulated grid: every rank 16-byte aligned (packs), every rank off
(elements), and a mix, where the aligned ranks keep their 16-byte packs and only the others go
lane by lane) against rr::cpu::all_reduce byte for byte. Only NaN payloads may differ, and only
where two NaNs met in a sum, average or product (see the driver). For float16 and bfloat16 sum
and avg the once-rounded body (oneshot_once_thread) runs on the same layouts against
rr::cpu::all_reduce_once. The GPU's own arithmetic needs a GPU.
"""
import os
import re
import subprocess
import sys

import pytest

from fake_cuda.build import CSRC, CXX, ROOT, compile_program

pytestmark = pytest.mark.skipif(CXX is None or not sys.platform.startswith("linux"),
                                reason="needs a C++ compiler on Linux")

FLOAT_OPS = ["sum", "avg", "max", "min", "prod"]
INT_OPS = FLOAT_OPS + ["band", "bor", "bxor"]
OPS = {"float32": FLOAT_OPS, "float64": FLOAT_OPS, "float16": FLOAT_OPS,
       "bfloat16": FLOAT_OPS, "int32": INT_OPS, "int64": INT_OPS, "int8": INT_OPS,
       "uint8": INT_OPS, "bool": [op for op in INT_OPS if op != "avg"]}


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    exe = tmp_path_factory.mktemp("oneshot") / "oneshot_driver"
    sources = [os.path.join(ROOT, "tests", "oneshot_driver.cpp"),
               os.path.join(CSRC, "ring", "oneshot_cpu.cpp"),
               os.path.join(CSRC, "ring", "cpu_executor.cpp")]
    proc = compile_program(exe, sources, ["-O2", "-Wall", "-Werror"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return str(exe)


@pytest.mark.parametrize("dtype", sorted(OPS))
def test_oneshot_matches_the_ring(driver, dtype):
    proc = subprocess.run([driver, dtype, "20240611"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "chunk_of mismatches=0" in proc.stdout, proc.stdout
    found = re.findall(r"op=(\w+) cases=(\d+) mismatches=(\d+) nan_payloads=\d+ "
                       r"aligned=(\d+) misaligned=(\d+) mixed=(\d+)", proc.stdout)
    assert [op for op, *_ in found] == OPS[dtype], proc.stdout
    for op, cases, mismatches, *layouts in found:
        assert int(cases) > 10000 and mismatches == "0", (op, proc.stdout)
        assert all(int(k) > 0 for k in layouts), (op, "a buffer layout never ran", proc.stdout)
    # float16 / bfloat16 sum and avg: the once-rounded body against rr::cpu::all_reduce_once.
    once = re.findall(r"once op=(\w+) cases=(\d+) mismatches=(\d+)", proc.stdout)
    assert [op for op, *_ in once] == (["sum", "avg"] if dtype in ("float16", "bfloat16")
                                       else []), proc.stdout
    for op, cases, mismatches in once:
        assert int(cases) > 5000 and mismatches == "0", (op, proc.stdout)
