"""ringreduce.all_reduce on CPU ranks: every dtype x op x rank count x awkward size."""
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import ringreduce
from checks import cpu_flags, seeded, simd_width_param
from reference import ALL_DTYPES, assert_close_to_wide, random_inputs, ring_model, valid_ops

# Sizes around every boundary: empty, fewer elements than ranks, odd, one past a 16-byte
# vector, chunk sizes that leave empty trailing chunks, and a few thousand.
SIZES = (0, 1, 2, 3, 5, 7, 9, 17, 31, 33, 100, 257, 1023, 4099)


def _cases():
    for dtype in ALL_DTYPES:
        for op in valid_ops(dtype):
            for nranks in range(1, 9):
                yield dtype, op, nranks


@pytest.mark.parametrize("dtype,op,nranks", list(_cases()),
                         ids=lambda v: str(v).replace("torch.", ""))
def test_matches_references(dtype, op, nranks):
    g = seeded("all_reduce", dtype, op, nranks)
    for count in SIZES:
        inputs = random_inputs(nranks, count, dtype, op, generator=g)
        tensors = [t.clone() for t in inputs]
        out = ringreduce.all_reduce(tensors, op=op)
        assert out is tensors
        expected = ring_model(inputs, op)
        for r, t in enumerate(tensors):
            assert t.dtype == dtype and t.shape == inputs[0].shape
            assert torch.equal(t.view(torch.uint8) if count else t,
                               expected.view(torch.uint8) if count else expected), (
                f"rank {r} differs from the ring model at count={count}")
        if count:
            assert_close_to_wide(tensors[0], inputs, op)


def test_rank_results_bitwise_equal_and_repeatable():
    g = torch.Generator().manual_seed(1)
    inputs = random_inputs(7, 12345, torch.float32, "sum", generator=g)
    first = [t.clone() for t in inputs]
    second = [t.clone() for t in inputs]
    ringreduce.all_reduce(first)
    ringreduce.all_reduce(second)
    for t in first + second:
        assert torch.equal(t, first[0])


def test_multidimensional_and_scalar_tensors():
    g = torch.Generator().manual_seed(2)
    for shape in [(3, 5, 7), (), (1, 0, 4)]:
        flat = random_inputs(3, int(torch.Size(shape).numel()), torch.float64, "sum", generator=g)
        inputs = [t.reshape(shape) for t in flat]
        tensors = [t.clone() for t in inputs]
        ringreduce.all_reduce(tensors)
        assert tensors[0].shape == torch.Size(shape)
        assert torch.equal(tensors[2], ring_model(inputs, "sum"))


def test_unaligned_views_of_distinct_storages():
    # storage offsets that break 16-byte alignment must still reduce correctly
    g = torch.Generator().manual_seed(3)
    inputs = random_inputs(4, 1001, torch.float16, "sum", generator=g)
    bases = [torch.empty(1003, dtype=torch.float16) for _ in inputs]
    tensors = [b[1 + (i % 2): 1 + (i % 2) + 1001] for i, b in enumerate(bases)]
    for t, x in zip(tensors, inputs):
        t.copy_(x)
    ringreduce.all_reduce(tensors)
    for t in tensors:
        assert torch.equal(t, ring_model(inputs, "sum"))


def test_disjoint_views_of_one_storage_are_distinct_ranks():
    g = torch.Generator().manual_seed(4)
    inputs = random_inputs(3, 10, torch.int32, "sum", generator=g)
    base = torch.cat(inputs)
    ringreduce.all_reduce(list(base.split(10)))
    assert torch.equal(base[20:], ring_model(inputs, "sum"))


@pytest.mark.parametrize("op", ["sum", "avg", "max", "min", "prod"])
def test_reduce_op_enum_equals_string(op):
    enum = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
            "min": dist.ReduceOp.MIN, "prod": dist.ReduceOp.PRODUCT}[op]
    g = torch.Generator().manual_seed(5)
    inputs = random_inputs(3, 50, torch.float32, op, generator=g)
    a = [t.clone() for t in inputs]
    b = [t.clone() for t in inputs]
    ringreduce.all_reduce(a, op)
    ringreduce.all_reduce(b, enum)
    assert torch.equal(a[0], b[0])
    assert ringreduce.parse_op(enum) == op
    assert ringreduce.parse_op(dist.ReduceOp(enum)) == op


@pytest.mark.parametrize("op", ["band", "bor", "bxor"])
def test_bitwise_reduce_op_enum_equals_string(op):
    enum = {"band": dist.ReduceOp.BAND, "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR}[op]
    g = torch.Generator().manual_seed(12)
    inputs = random_inputs(3, 50, torch.int64, op, generator=g)
    a = [t.clone() for t in inputs]
    b = [t.clone() for t in inputs]
    ringreduce.all_reduce(a, op.upper())
    ringreduce.all_reduce(b, enum)
    assert torch.equal(a[0], b[0]) and torch.equal(a[0], ring_model(inputs, op))
    assert ringreduce.parse_op(enum) == op


def test_integer_avg_wraps_then_truncates_toward_zero():
    # NCCL's integer average: the sum wraps in the dtype, then divides by N toward zero
    cases = [  # sums: int8 201 -> -55, -13, 15, 255 -> -1; int32 -5, 2**31 -> -2**31, 15, -3
        (torch.int8, [[100, -7, 7, 127]] * 2 + [[1, 1, 1, 1]], [-18, -4, 5, 0]),
        (torch.int32, [[-3, 2**31 - 1, 5, -1], [-1, 1, 5, -1], [-1, 0, 5, -1]],
         [-1, -715827882, 5, -1]),
        (torch.uint8, [[200, 1, 3, 255], [100, 1, 3, 255]], [22, 1, 3, 127]),
    ]
    for dtype, rows, expected in cases:
        tensors = [torch.tensor(r, dtype=dtype) for r in rows]
        ringreduce.all_reduce(tensors, "avg")
        for t in tensors:
            assert t.tolist() == expected, f"{dtype}: {t.tolist()} != {expected}"


def test_integer_avg_divides_by_rank_counts_beyond_the_dtype():
    # 200 ranks of int8: the divisor does not fit in int8
    tensors = [torch.tensor([1, -1, 2, 0], dtype=torch.int8) for _ in range(200)]
    ringreduce.all_reduce(tensors, "avg")
    expected = torch.tensor([200 - 256, 256 - 200, 400 - 512, 0]) // 1
    expected = torch.div(expected, 200, rounding_mode="trunc").to(torch.int8)
    assert torch.equal(tensors[7], expected)


def test_bool_results_are_canonical_bytes():
    # bytes other than 0 and 1 read as True; every result is written as exactly 0 or 1
    raw = [torch.tensor([0, 2, 255, 1, 0, 7], dtype=torch.uint8),
           torch.tensor([3, 0, 128, 1, 0, 0], dtype=torch.uint8)]
    for op, expected in (("sum", [1, 1, 1, 1, 0, 1]), ("prod", [0, 0, 1, 1, 0, 0]),
                         ("bxor", [1, 1, 0, 0, 0, 1]), ("min", [0, 0, 1, 1, 0, 0])):
        tensors = [r.clone().view(torch.bool) for r in raw]
        ringreduce.all_reduce(tensors, op)
        for t in tensors:
            assert t.view(torch.uint8).tolist() == expected, op


def test_nan_propagates_through_max_and_min():
    for op in ("max", "min"):
        tensors = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([float("nan"), 5.0, -1.0]),
                   torch.tensor([0.5, float("nan"), 7.0])]
        ringreduce.all_reduce(tensors, op)
        for t in tensors:
            assert torch.isnan(t[0]) and torch.isnan(t[1])
            assert t[2] == (7.0 if op == "max" else -1.0)


def test_integer_sum_wraps_like_torch():
    a = torch.tensor([127, -128, 100], dtype=torch.int8)
    b = torch.tensor([1, -1, 100], dtype=torch.int8)
    expected = a + b
    tensors = [a.clone(), b.clone()]
    ringreduce.all_reduce(tensors)
    assert torch.equal(tensors[0], expected) and torch.equal(tensors[1], expected)


def test_half_rounding_matches_torch_per_hop():
    # Two ranks: one hop, so the result is exactly torch's fp32 sum rounded once to half.
    g = torch.Generator().manual_seed(6)
    for dtype in (torch.float16, torch.bfloat16):
        bits = torch.randint(-(2**15), 2**15, (2, 1 << 16), generator=g, dtype=torch.int32)
        a, b = (x.to(torch.int16).view(dtype) for x in bits)
        finite = torch.isfinite(a) & torch.isfinite(b)
        a, b = a[finite], b[finite]
        tensors = [a.clone(), b.clone()]
        ringreduce.all_reduce(tensors)
        expected = (b.float() + a.float()).to(dtype)
        same = (tensors[0] == expected) | (torch.isnan(tensors[0]) & torch.isnan(expected))
        assert bool(same.all()), f"{dtype}: {int((~same).sum())} elements rounded differently"


def test_in_place_write_is_visible_to_autograd():
    g = torch.Generator().manual_seed(11)
    tensors = random_inputs(3, 64, torch.float32, "sum", generator=g)
    versions = [t._version for t in tensors]
    ringreduce.all_reduce(tensors)
    assert [t._version for t in tensors] == [v + 1 for v in versions]
    w = torch.randn(64, generator=g, requires_grad=True)
    x = tensors[0].clone()
    y = (w * x).sum()  # saves x for backward
    ringreduce.all_reduce([x, tensors[1].clone()])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_inference_tensors():
    with torch.inference_mode():
        tensors = [torch.full((5,), float(r + 1)) for r in range(3)]
    ringreduce.all_reduce(tensors)
    assert torch.equal(tensors[2], torch.full((5,), 6.0))


def test_transport_setting_is_validated(monkeypatch):
    tensors = [torch.ones(4), torch.ones(4)]
    monkeypatch.setenv("RINGREDUCE_TRANSPORT", "smoke-signals")
    with pytest.raises(ValueError, match="RINGREDUCE_TRANSPORT"):
        ringreduce.all_reduce(tensors)
    assert torch.equal(tensors[0], torch.ones(4))
    monkeypatch.setenv("RINGREDUCE_TRANSPORT", "copy")  # CPU ignores the transport
    ringreduce.all_reduce(tensors)
    assert torch.equal(tensors[0], torch.full((4,), 2.0))


# Float sums and averages take loops compiled for AVX-512, AVX2 and the baseline
# (csrc/ring/cpu_executor.cpp); RINGREDUCE_CPU_SIMD caps the width, read once per process, so
# each width runs in its own interpreter. Every width must give the ring model's bits. AVX-512
# runs only for loops of at least RINGREDUCE_CPU_AVX512_MIN_BYTES (0 here: every size).
_SIMD_SCRIPT = """
import sys, torch, ringreduce
sys.path.insert(0, sys.argv[1])
from reference import random_inputs, ring_model
checked = 0
for dtype in (torch.float32, torch.float64):
    for op in ("sum", "avg"):
        for nranks in (2, 3, 5):
            for count in (1, 7, 15, 16, 17, 33, 63, 65, 257, 1023, 4099, 70001):
                g = torch.Generator().manual_seed(checked)
                inputs = random_inputs(nranks, count, dtype, op, generator=g)
                tensors = [t.clone() for t in inputs]
                ringreduce.all_reduce(tensors, op=op)
                expected = ring_model(inputs, op)
                for t in tensors:
                    assert torch.equal(t.view(torch.uint8), expected.view(torch.uint8)), (
                        dtype, op, nranks, count)
                checked += 1
print("checked", checked)
print("ran", ringreduce._C.cpu_simd_ran())
"""


def _run_simd_script(env_value, script=_SIMD_SCRIPT, avx512_min_bytes="0"):
    env = dict(os.environ, RINGREDUCE_CPU_SIMD=env_value,
               RINGREDUCE_CPU_AVX512_MIN_BYTES=avx512_min_bytes)
    return subprocess.run([sys.executable, "-c", script, os.path.dirname(__file__)],
                          capture_output=True, text=True, env=env, timeout=240)


@pytest.mark.parametrize("width", [simd_width_param("avx512", "avx512f"),
                                   simd_width_param("avx2", "avx2"),
                                   "baseline"])
def test_every_simd_width_gives_the_ring_bits(width):
    proc = _run_simd_script(width)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "checked 144" in proc.stdout, proc.stdout
    assert f"ran {width}\n" in proc.stdout, proc.stdout  # those loops, not a narrower width's


AVX512_MIN_BYTES = 256 << 10  # cpu_executor.cpp kDefaultAvx512MinBytes


def test_the_widest_simd_width_the_cpu_has_runs():
    """Without RINGREDUCE_CPU_SIMD the float sum loops of the widest width the CPU lists run (in
    this process: the width is chosen at its first float sum; the setting can only narrow it),
    AVX-512 only for loops of at least RINGREDUCE_CPU_AVX512_MIN_BYTES (default 256 KiB)."""
    flags = cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags: nothing to say which width the CPU has")
    widths = ("baseline", "avx2", "avx512")
    widest = max(i for i, has in enumerate((True, "avx2" in flags, "avx512f" in flags)) if has)
    asked = os.environ.get("RINGREDUCE_CPU_SIMD")
    if asked in widths:
        widest = min(widest, widths.index(asked))
    min_bytes = int(os.environ.get("RINGREDUCE_CPU_AVX512_MIN_BYTES") or AVX512_MIN_BYTES)
    # 3 ranks: ring chunks of ceil(count / 3) elements (rounded up to 16 bytes), one loop each.
    for count, chunk in ((33, 12), (3 * 65540, 65540)):
        tensors = [torch.full((count,), float(r + 1)) for r in range(3)]
        ringreduce.all_reduce(tensors)
        assert torch.equal(tensors[0], torch.full((count,), 6.0))
        want = widest if chunk * 4 >= min_bytes else min(widest, 1)
        assert ringreduce._C.cpu_simd_ran() == widths[want], (
            count, ringreduce._C.cpu_simd_ran(), flags)


_THRESHOLD_SCRIPT = """
import torch, ringreduce
for dtype, count in ((torch.float32, 1024), (torch.float32, 2048), (torch.float64, 1024),
                     (torch.float32, 1024)):
    tensors = [torch.full((count,), float(r + 1), dtype=dtype) for r in range(2)]
    ringreduce.all_reduce(tensors)
    assert torch.equal(tensors[1], torch.full((count,), 3.0, dtype=dtype))
    print(dtype, count, ringreduce._C.cpu_simd_ran())
"""


@pytest.mark.skipif("avx512f" not in cpu_flags(), reason="this CPU lacks avx512f "
                    "(/proc/cpuinfo): no AVX-512 loops to switch to")
def test_avx512_runs_from_its_threshold():
    """RINGREDUCE_CPU_AVX512_MIN_BYTES=4096: 2 ranks' loops of 2 KiB run AVX2's, of 4 KiB
    (2048 float32 or 1024 float64 elements) AVX-512's, and 2 KiB after those AVX2's again."""
    proc = _run_simd_script("avx512", _THRESHOLD_SCRIPT, "4096")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.split("\n")[:4] == [
        "torch.float32 1024 avx2", "torch.float32 2048 avx512", "torch.float64 1024 avx512",
        "torch.float32 1024 avx2"], proc.stdout


@pytest.mark.parametrize("value", ["lots", "-1", "4096B"])
def test_bad_avx512_threshold_is_refused(value):
    proc = _run_simd_script("avx2", _THRESHOLD_SCRIPT, value)
    assert proc.returncode != 0
    assert "RINGREDUCE_CPU_AVX512_MIN_BYTES must be a number of bytes" in proc.stderr, proc.stderr
    assert f"got '{value}'" in proc.stderr, proc.stderr


def test_bad_simd_setting_is_refused():
    proc = _run_simd_script("sse9")
    assert proc.returncode != 0
    assert "RINGREDUCE_CPU_SIMD must be avx512, avx2 or baseline; got 'sse9'" in proc.stderr, (
        proc.stderr)
