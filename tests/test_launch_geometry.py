"""The CUDA kernels' launch geometry (csrc/ring/launch.h) on the CPU, for the capacities of real
GPUs, and the ring's chunking (csrc/ring/schedule.h), which every executor uses.

The launchers ask the device only how many blocks of a kernel it holds at once (SMs x the
occupancy calculation, which depends on each kernel's registers: docs/PTXAS.md); every number
derived from that is a host function in launch.h, compiled here by the host compiler into
tests/geometry_driver.cpp. Until issue 21 this code was compiled only by nvcc, and
tests/test_cuda.py's fused-kernel test sized its flag buffer for 64 blocks per rank while the
suggested count reached 65..129 on an H100 (2 blocks of 512 threads per SM at 64 registers,
132 SMs): a ValueError on the GPU that no CPU test could see.
"""
import os
import subprocess
import sys

import pytest
import torch

from fake_cuda.build import CSRC, CXX, build
from reference import chunk_bounds

pytestmark = pytest.mark.skipif(CXX is None or not sys.platform.startswith("linux"),
                                reason="needs a C++ compiler on Linux")

# SMs of an A100, an H100 / H200 SXM, an H100 PCIe; resident blocks per SM of a 512-thread kernel
# range over 1..4 (2048 threads per SM), of a 256-thread one up to 8.
SMS = (108, 132, 114)
RESIDENT = sorted({sms * per_sm for sms in SMS for per_sm in (1, 2, 3, 4, 8)})
LINE = 128  # bytes per flag line (fused.h)


@pytest.fixture(scope="module")
def ask(tmp_path_factory):
    exe = build(tmp_path_factory.mktemp("geometry"), "geometry_driver",
                [os.path.join(os.path.dirname(CSRC), "tests", "geometry_driver.cpp")])

    def ask(questions):
        proc = subprocess.run([exe], input="\n".join(questions) + "\n", capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        answers = proc.stdout.splitlines()
        assert len(answers) == len(questions), proc.stdout
        return answers

    return ask


def _esize(dtype):
    return torch.empty(0, dtype=dtype).element_size()


def test_fused_test_flag_buffer_fits_what_the_binding_uses(ask):
    """Every parametrisation of tests/test_cuda.py's fused-kernel test, on every device
    capacity: the blocks per rank _C.fused_all_reduce uses (rr::fused_blocks_per_rank) fit the
    flag buffer the test allocates and the device (so neither the flag check nor the launch
    raises), and the suggested count is capped by the buffer, not refused."""
    import test_cuda as t

    cases, questions = [], []
    for dtype, _ in t.FUSED_CASES:
        for nranks in t.FUSED_NRANKS:
            flags = LINE * (1 + nranks * t.FUSED_FLAG_BLOCKS)
            for count in t.FUSED_COUNTS:
                for blocks in t.FUSED_BLOCKS:
                    for resident in RESIDENT:
                        cases.append((dtype, nranks, count, blocks, resident))
                        questions.append(f"fused {blocks} {nranks} {count} {_esize(dtype)} "
                                         f"{resident} {flags}")
    capped = 0
    for case, answer in zip(cases, ask(questions)):
        dtype, nranks, count, blocks, resident = case
        assert not answer.startswith("error"), (case, answer)
        used = int(answer)
        assert 1 <= used <= t.FUSED_FLAG_BLOCKS, (case, used)
        assert nranks * used <= resident, (case, used)
        assert blocks == 0 or used == blocks, (case, used)
        capped += blocks == 0 and used == t.FUSED_FLAG_BLOCKS
    assert capped > 0, "no case reached the flag buffer's cap: the test checks nothing new"


def test_fused_blocks_per_rank_rules(ask):
    flags_64 = LINE * (1 + 2 * 64)
    answers = ask([
        # H100, 2 ranks, (1 << 18) + 5 float32: 32769 packs a chunk -> 65 blocks wanted
        f"fused 0 2 {(1 << 18) + 5} 4 264 {LINE * (1 + 2 * 200)}",
        f"fused 0 2 {(1 << 18) + 5} 4 264 {flags_64}",   # capped by the flags
        f"fused 0 2 {1 << 26} 4 264 {LINE * (1 + 2 * 1000)}",  # capped by the device: 132
        "fused 0 2 1 4 264 1000000",                       # tiny: one block
        f"fused 65 2 100 4 264 {flags_64}",                # explicit, flags too small
        f"fused 0 2 100 4 264 {LINE * 2}",                 # flags too small for one block
        "fused 0 8 100 4 7 1000000",                       # fewer resident blocks than ranks
        "fused 0 65 100 4 1000 1000000",                   # too many ranks
        "fused_max 3 264",
        "flags 2 64",
    ])
    assert answers[:4] == ["65", "64", "132", "1"], answers
    assert "flags holds" in answers[4] and "fused_flags_bytes" in answers[4], answers[4]
    assert "flags holds" in answers[5], answers[5]
    assert "fewer than nranks=8" in answers[6], answers[6]
    assert "1 to 64 ranks" in answers[7], answers[7]
    assert answers[8] == "88" and answers[9] == str(flags_64), answers


def test_step_grid(ask):
    """grid.x of a ring step: at least one block, one thread per 16-byte pack of the longest
    task, and never more than one wave of resident blocks shared by the launch's tasks."""
    step_threads = int(ask(["threads"])[0].split()[0])
    cases, questions = [], []
    for esize in (1, 2, 4, 8):
        for max_n in (1, 7, 1023, 4099, (1 << 18) + 5, (1 << 31) + 33):
            for ntasks in (1, 3, 8, 64):
                for resident in (132, 264, 528):
                    cases.append((esize, max_n, ntasks, resident))
                    questions.append(f"step {max_n} {esize} {ntasks} {resident}")
    for (esize, max_n, ntasks, resident), answer in zip(cases, ask(questions)):
        grid = int(answer)
        cap = max(1, resident // ntasks)
        packs = max_n // (16 // esize)
        assert 1 <= grid <= cap, (esize, max_n, ntasks, resident, grid)
        assert grid == cap or grid * step_threads > packs, (esize, max_n, ntasks, grid)


def test_oneshot_grid(ask):
    oneshot_threads = int(ask(["threads"])[0].split()[1])
    cases, questions = [], []
    for esize in (1, 2, 4, 8):
        for count in (1, 3, 17, 4099, 16384, (1 << 20) + 3):
            for vec in (0, 1):
                cases.append((esize, count, vec))
                questions.append(f"oneshot {count} {esize} {vec} 1056")
    for (esize, count, vec), answer in zip(cases, ask(questions)):
        lanes = 16 // esize
        items = max(count // lanes, count % lanes) if vec else count
        want = -(-items // oneshot_threads)
        assert int(answer) == max(1, min(want, 1056)), (esize, count, vec, answer)


def test_staging_slots_are_16_byte_aligned(ask):
    sizes = [0, 1, 4, 16, 132, 148, 4096, 4100, (1 << 20) + 12]
    for b, answer in zip(sizes, ask([f"stride {b}" for b in sizes])):
        stride = int(answer)
        assert stride % 16 == 0 and b <= stride < b + 16, (b, stride)


def _ranges(text, sep):
    """"offset:count" items separated by `sep` -> [(lo, hi)]."""
    return [(int(a), int(a) + int(b)) for a, b in (item.split(":") for item in text.split(sep)
                                                   if item)]


def test_ring_chunks_cover_every_element_once(ask):
    """The code's chunks (rr::chunk_range): one per rank, consecutive from 0 to count, every
    non-empty one starting on a 16-byte boundary, and the bounds of reference.chunk_bounds, which
    the tests' ring model reduces by. The staged executors' rounds (rr::chunk_piece) cut each
    chunk into consecutive pieces of at most `piece` elements, in order, covering it once."""
    cases = [(count, n, esize) for count in (0, 1, 5, 15, 16, 17, 1000, 4097, (1 << 31) + 33)
             for n in range(1, 9) for esize in (1, 2, 4, 8)]
    chunks = ask([f"chunks {c} {n} {e}" for c, n, e in cases])
    for case, answer in zip(cases, chunks):
        count, n, esize = case
        bounds = _ranges(answer, " ")
        assert len(bounds) == n, (case, answer)
        assert bounds[0][0] == 0 and bounds[-1][1] == count, (case, answer)
        assert all(b[1] == c[0] for b, c in zip(bounds, bounds[1:])), (case, answer)
        assert all((lo * esize) % 16 == 0 for lo, hi in bounds if hi > lo), (case, answer)
        assert bounds == chunk_bounds(count, n, esize), (case, answer)
    staged = [(count, n, esize, piece) for count, n, esize in cases if count < 1 << 20
              for piece in (1, 3, 64)]
    pieces = ask([f"pieces {c} {n} {e} {p}" for c, n, e, p in staged])
    for case, answer in zip(staged, pieces):
        count, n, esize, piece = case
        per_chunk = answer.split(" ")
        assert len(per_chunk) == n, (case, answer)
        for (lo, hi), text in zip(chunk_bounds(count, n, esize), per_chunk):
            parts = _ranges(text, ",")
            covered = [i for a, b in parts for i in range(a, b)]
            assert covered == list(range(lo, hi)), (case, lo, hi, text)
            assert all(b - a <= piece for a, b in parts), (case, text)
