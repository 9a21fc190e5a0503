"""References for the collectives' tests: independent of the extension's code.

- ``ring_model``: the ring's result computed with torch ops in the ring's reduction order
  (chunk c is combined in rank order c, c+1, ..., c+N-1, each hop rounded to the dtype, half
  types through fp32). It must match ringreduce bit for bit, on CPU and GPU alike; ``reduce``
  gives the same bits on its root.
- ``reduce_scatter_model``: the same for reduce_scatter, whose block c is combined in the order
  c+1, c+2, ..., c (NCCL's ring: the block ends on its own rank).
- ``once_rounded_model``: float16 / bfloat16 sum and avg as the CPU paths compute them by
  default (RINGREDUCE_HALF_ROUNDING=once): every element summed in fp32 in rank order 0, 1, ...,
  N-1 and rounded to the dtype once; each fp32 step computed in float64 and rounded to float32
  (exact: a float64 sum or quotient of two floats rounds to the float32 one, 53 >= 2 * 24 + 2).
  ``ring_model`` and ``reduce_scatter_model`` give it where ``half_rounding`` says so.
- ``wide_reference``: the mathematical reduction in float64 (floats) or with exact integer
  wrap-around (ints; avg is that wrapped sum divided by N, truncated toward zero, as NCCL),
  for checks that do not share the ring's reduction order. bool follows torch: sum and max
  are logical or, prod and min logical and.
"""
import functools
import math
import os

import torch

FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
INT_DTYPES = (torch.int32, torch.int64, torch.int8, torch.uint8)
ALL_DTYPES = FLOAT_DTYPES + INT_DTYPES + (torch.bool,)
ARITHMETIC_OPS = ("sum", "avg", "max", "min", "prod")
BITWISE_OPS = ("band", "bor", "bxor")
OPS = ARITHMETIC_OPS + BITWISE_OPS
# bool ops that behave as logical or / and
_ANY_OPS = ("sum", "max", "bor")
_ALL_OPS = ("prod", "min", "band")
_BITWISE = {"band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}

# Relative error bound per hop for each float dtype (unit roundoff).
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float64: 2.0**-53,
                 torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def valid_ops(dtype):
    if dtype.is_floating_point:
        return ARITHMETIC_OPS
    if dtype == torch.bool:
        return tuple(o for o in OPS if o != "avg")
    return OPS


def random_inputs(nranks, count, dtype, op, device="cpu", generator=None):
    """Random, never-zero inputs; products stay small so floats do not overflow. bool inputs
    are mostly True for and-like ops and mostly False for or-like ones, so results vary."""
    g = generator
    out = []
    for _ in range(nranks):
        if dtype == torch.bool:
            p_true = 0.9 if op in _ALL_OPS else 0.15 if op in _ANY_OPS else 0.5
            t = torch.rand(count, generator=g) < p_true
        elif dtype.is_floating_point:
            if op == "prod":
                mag = torch.rand(count, generator=g, dtype=torch.float64) * 0.5 + 0.75
            else:
                mag = torch.rand(count, generator=g, dtype=torch.float64) * 4 + 0.01
            sign = torch.randint(0, 2, (count,), generator=g) * 2 - 1
            t = (mag * sign).to(dtype)
        else:
            info = torch.iinfo(dtype)
            if op == "prod":
                lo, hi = (1, 4) if info.min == 0 else (-3, 4)
            else:
                lo, hi = max(info.min, -(2**40)), min(info.max, 2**40) + 1
            t = torch.randint(lo, hi, (count,), generator=g, dtype=torch.int64)
            t[t == 0] = 1
            t = t.to(dtype)
        out.append(t.to(device))
    return out


def adversarial_half_inputs(nranks, count, dtype, generator):
    """float16 / bfloat16 inputs for rounding checks; each element (the same on every rank) is
    one of: random values of mixed magnitude; cancellation (large values of alternating sign
    around small ones: the fp32 sum keeps what per-hop rounding loses); values near the dtype's
    max (sums that overflow to inf); subnormals; zeros of both signs (-0.0 sums stay -0.0);
    inf, -inf and NaN among ordinary values."""
    g = generator
    fi = torch.finfo(dtype)
    kind = torch.randint(0, 6, (count,), generator=g)
    out = []
    for r in range(nranks):
        u = torch.rand(count, generator=g, dtype=torch.float64)
        sign = (torch.randint(0, 2, (count,), generator=g) * 2 - 1).to(torch.float64)
        mixed = sign * torch.exp2(torch.randint(-12, 13, (count,), generator=g).double()) * (1 + u)
        cancel = (1 - 2 * (r % 2)) * 2.0**10 * (1 + u / 64) + sign * u / 8
        near_max = sign * fi.max * (0.25 + 0.75 * u)
        subnormal = sign * fi.smallest_normal * u
        zero = sign * 0.0
        pick = torch.randint(0, 10, (count,), generator=g)
        special = torch.where(pick == 0, math.inf, torch.where(pick == 1, -math.inf, torch.where(
            pick == 2, math.nan, mixed)))
        x = torch.stack([mixed, cancel, near_max, subnormal, zero, special])
        out.append(x.gather(0, kind.view(1, -1)).view(-1).to(dtype))
    return out


def chunk_bounds(count, nranks, elem_size):
    align = max(1, 16 // elem_size)
    per = -(-count // nranks)
    per = -(-per // align) * align
    return [(min(per * c, count), min(per * (c + 1), count)) for c in range(nranks)]


def _combine(op, mine, incoming, dtype, last, nranks):
    """One hop in the arithmetic type: fp32 for 16-bit floats, the dtype itself otherwise."""
    acc = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    a, b = mine.to(acc), incoming.to(acc)
    if dtype == torch.bool:
        r = (torch.logical_or(a, b) if op in _ANY_OPS else
             torch.logical_and(a, b) if op in _ALL_OPS else torch.logical_xor(a, b))
    elif op in BITWISE_OPS:
        r = _BITWISE[op](a, b)
    elif op in ("sum", "avg"):
        r = a + b
    elif op == "prod":
        r = a * b
    elif not acc.is_floating_point:
        r = torch.maximum(a, b) if op == "max" else torch.minimum(a, b)
    else:
        # NaN propagates; otherwise the incoming value replaces mine only if strictly better.
        better = (b > a) if op == "max" else (b < a)
        r = torch.where(torch.isnan(a) | ~(better | torch.isnan(b)), a, b)
    if op == "avg" and last:
        r = r / nranks if acc.is_floating_point else _int_avg(r, nranks)
    return r.to(dtype)


def _int_avg(wrapped_sum, nranks):
    """NCCL's integer average: the sum wrapped in the dtype, divided truncating toward zero."""
    return torch.div(wrapped_sum.to(torch.int64), nranks, rounding_mode="trunc")


def _ring_chunk(x, op, lo, hi, first):
    """Elements lo:hi of the flat inputs x combined in the rank order first, first+1, ..."""
    n = len(x)
    acc = x[first % n][lo:hi]
    for j in range(1, n):
        acc = _combine(op, x[(first + j) % n][lo:hi], acc, x[0].dtype, j == n - 1, n)
    return acc


HALF_DTYPES = (torch.float16, torch.bfloat16)


def half_rounding(device="cpu"):
    """How ringreduce rounds float16 / bfloat16 sums and averages on `device`: 'once' on CPU
    unless RINGREDUCE_HALF_ROUNDING=per_hop; 'per_hop' on CUDA unless
    RINGREDUCE_CUDA_HALF_ROUNDING=once."""
    if torch.device(device).type != "cpu":
        return os.environ.get("RINGREDUCE_CUDA_HALF_ROUNDING") or "per_hop"
    return os.environ.get("RINGREDUCE_HALF_ROUNDING") or "once"


def rounds_once(dtype, op, rounding):
    return rounding == "once" and dtype in HALF_DTYPES and op in ("sum", "avg")


def fp32_ordered_sum(rows, op):
    """rows (tensors of one 16-bit float dtype) summed in fp32 in list order (avg: divided by
    len(rows)) and rounded once to their dtype, every fp32 step computed in float64."""
    acc = rows[0].to(torch.float32)
    for x in rows[1:]:
        acc = (acc.to(torch.float64) + x.to(torch.float64)).to(torch.float32)
    if op == "avg":
        acc = (acc.to(torch.float64) / len(rows)).to(torch.float32)
    return acc.to(rows[0].dtype)


def once_rounded_model(inputs, op):
    """What every rank holds after a once-rounded float16 / bfloat16 sum or avg, bit for bit
    (up to NaN payloads)."""
    x = [t.detach().cpu().reshape(-1) for t in inputs]
    if len(x) == 1:
        return x[0].clone().reshape(inputs[0].shape)
    return fp32_ordered_sum(x, op).reshape(inputs[0].shape)


def ring_model(inputs, op, rounding=None):
    """The value every rank must hold after ringreduce's ring, bit for bit. rounding: 'once'
    or 'per_hop' for 16-bit float sums and averages; None: half_rounding() of the inputs'
    device (ringreduce's default there)."""
    n = len(inputs)
    if rounding is None:
        rounding = half_rounding(inputs[0].device)
    if rounds_once(inputs[0].dtype, op, rounding):
        return once_rounded_model(inputs, op)
    x = [t.detach().cpu().reshape(-1) for t in inputs]
    out = x[0].clone()
    if n == 1:
        return out.reshape(inputs[0].shape)
    for c, (lo, hi) in enumerate(chunk_bounds(x[0].numel(), n, x[0].element_size())):
        if lo < hi:
            out[lo:hi] = _ring_chunk(x, op, lo, hi, c)
    return out.reshape(inputs[0].shape)


def reduce_scatter_model(inputs, op, rounding=None):
    """What rank r's output holds after ringreduce.reduce_scatter (flat), bit for bit.
    rounding as ring_model's."""
    n = len(inputs)
    x = [t.detach().cpu().reshape(-1) for t in inputs]
    count = x[0].numel() // n
    if rounding is None:
        rounding = half_rounding(inputs[0].device)
    if n > 1 and rounds_once(inputs[0].dtype, op, rounding):
        return [fp32_ordered_sum([t[r * count:(r + 1) * count] for t in x], op)
                for r in range(n)]
    return [_ring_chunk(x, op, r * count, (r + 1) * count, r + 1).clone() for r in range(n)]


def all_gather_model(inputs):
    """What every output holds after ringreduce.all_gather (flat)."""
    return torch.cat([t.detach().cpu().reshape(-1) for t in inputs])


def wide_reference(inputs, op):
    """float64 for float dtypes; exact integer arithmetic wrapped to the dtype for ints."""
    dtype = inputs[0].dtype
    if dtype == torch.bool:
        s = torch.stack([t.detach().cpu() for t in inputs])
        if op in _ANY_OPS:
            return s.any(0)
        if op in _ALL_OPS:
            return s.all(0)
        return s.to(torch.int64).sum(0) % 2 == 1
    wide = torch.float64 if dtype.is_floating_point else torch.int64
    s = torch.stack([t.detach().cpu().to(wide) for t in inputs])
    if op in BITWISE_OPS:
        r = functools.reduce(_BITWISE[op], s.unbind(0))
    elif op == "sum":
        r = s.sum(0)
    elif op == "avg" and not dtype.is_floating_point:
        r = _int_avg(s.sum(0).to(dtype), len(inputs))
    elif op == "avg":
        r = s.mean(0)
    elif op == "max":
        r = s.amax(0)
    elif op == "min":
        r = s.amin(0)
    else:
        r = s.prod(0)
    return r


def assert_close_to_wide(result, inputs, op):
    ref = wide_reference(inputs, op)
    dtype = result.dtype
    got = result.detach().cpu()
    if not dtype.is_floating_point:
        assert torch.equal(got, ref.to(dtype)), "integer all-reduce differs from exact reference"
        return
    n = len(inputs)
    got = got.to(torch.float64)
    if op in ("max", "min"):
        assert torch.equal(got, ref), f"{op} differs from reference"
        return
    u = UNIT_ROUNDOFF[dtype]
    if op == "prod":
        tol = (2 * n + 1) * u * ref.abs()
    else:
        scale = torch.stack([t.detach().cpu().to(torch.float64).abs() for t in inputs]).sum(0)
        if op == "avg":
            scale = scale / n
        tol = (n + 1) * u * scale
    err = (got - ref).abs()
    bad = err > tol + 1e-300
    assert not bad.any(), (
        f"{int(bad.sum())} elements outside the rounding bound; worst error "
        f"{float(err.max()):.3g}")
