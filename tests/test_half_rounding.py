"""float16 and bfloat16 sums and averages rounded once on the CPU paths (issue 47): every
element summed in fp32 in rank order 0, 1, ..., N-1 and rounded to the 16-bit type at the end,
against reference.fp32_ordered_sum (float64 steps rounded to float32: exact), through the list
API. The backend's CPU collectives are checked in test_distributed.py (_half_rounding_checks,
inside its spawned sweeps). RINGREDUCE_HALF_ROUNDING=per_hop keeps the ring's bits."""
import pytest
import torch

import ringreduce
from checks import assert_same_bits, assert_same_bits_but_nan_payload, seeded
from reference import (adversarial_half_inputs, fp32_ordered_sum, random_inputs,
                       reduce_scatter_model, ring_model)

HALF_DTYPES = (torch.bfloat16, torch.float16)
# Odd counts; 3001 spans several of the CPU loop's 1024-element blocks.
COUNTS = (1, 7, 1031, 3001)


def half_inputs(kind, nranks, count, dtype, op):
    g = seeded("half rounding", kind, nranks, count, dtype, op)
    if kind == "random":
        return random_inputs(nranks, count, dtype, op, generator=g)
    return adversarial_half_inputs(nranks, count, dtype, g)


@pytest.mark.parametrize("nranks", range(2, 9))
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_list_api_rounds_once(dtype, nranks):
    n = nranks
    for op in ("sum", "avg"):
        for kind in ("random", "adversarial"):
            for count in COUNTS:
                case = f"{dtype} {op} {kind} n={n} count={count}"
                inputs = half_inputs(kind, n, count, dtype, op)
                want = fp32_ordered_sum(inputs, op)
                outs = [torch.full_like(x, 7) for x in inputs]
                ringreduce.all_reduce([x.clone() for x in inputs], op, outputs=outs)
                for r, out in enumerate(outs):
                    assert_same_bits_but_nan_payload(out, want, f"all_reduce outputs[{r}] {case}")
                tensors = [x.clone() for x in inputs]
                ringreduce.all_reduce(tensors, op)
                for r, t in enumerate(tensors):
                    assert_same_bits_but_nan_payload(t, want, f"all_reduce in place [{r}] {case}")
                tensors = [x.clone() for x in inputs]
                ringreduce.reduce(tensors, root=n - 1, op=op)
                assert_same_bits_but_nan_payload(tensors[n - 1], want, f"reduce {case}")
                for r in range(n - 1):
                    assert_same_bits(tensors[r], inputs[r], f"reduce left inputs[{r}] {case}")

                blocks = half_inputs(kind, n, n * count, dtype, op)
                want = [fp32_ordered_sum([x[b * count:(b + 1) * count] for x in blocks], op)
                        for b in range(n)]
                outs = [torch.full((count,), 7, dtype=dtype) for _ in range(n)]
                ringreduce.reduce_scatter([x.clone() for x in blocks], outs, op=op)
                for r, out in enumerate(outs):
                    assert_same_bits_but_nan_payload(out, want[r],
                                                     f"reduce_scatter outputs[{r}] {case}")
                tensors = [x.clone() for x in blocks]
                in_place = [t[r * count:(r + 1) * count] for r, t in enumerate(tensors)]
                ringreduce.reduce_scatter(tensors, in_place, op=op)
                for r, out in enumerate(in_place):
                    assert_same_bits_but_nan_payload(out, want[r],
                                                     f"reduce_scatter in place [{r}] {case}")


def test_per_hop_knob_keeps_the_ring_bits(monkeypatch):
    """RINGREDUCE_HALF_ROUNDING=per_hop: the ring's bits (rounded on every reduce-scatter hop),
    which differ from the once-rounded sum on these inputs."""
    monkeypatch.setenv("RINGREDUCE_HALF_ROUNDING", "per_hop")
    assert ringreduce.settings()["half_rounding"] == "per_hop"
    differs = 0
    for dtype in HALF_DTYPES:
        for n in (4, 7):
            for op in ("sum", "avg"):
                count = 1031
                inputs = half_inputs("random", n, count, dtype, op)
                tensors = [x.clone() for x in inputs]
                ringreduce.all_reduce(tensors, op)
                want = ring_model(inputs, op, "per_hop")
                for r, t in enumerate(tensors):
                    assert_same_bits(t, want, f"per_hop all_reduce [{r}] {dtype} {op} n={n}")
                differs += not torch.equal(want, fp32_ordered_sum(inputs, op))
                out = torch.empty_like(inputs[0])
                ringreduce.reduce([x.clone() for x in inputs], out, root=1, op=op)
                assert_same_bits(out, want, f"per_hop reduce {dtype} {op} n={n}")
                blocks = half_inputs("random", n, n * count, dtype, op)
                outs = [torch.empty(count, dtype=dtype) for _ in range(n)]
                ringreduce.reduce_scatter(blocks, outs, op=op)
                for r, (o, w) in enumerate(zip(outs, reduce_scatter_model(blocks, op,
                                                                          "per_hop"))):
                    assert_same_bits(o, w, f"per_hop reduce_scatter [{r}] {dtype} {op} n={n}")
    assert differs == 2 * 2 * 2, "per-hop and once-rounded sums agree: the check shows nothing"


def test_half_rounding_setting(monkeypatch):
    monkeypatch.delenv("RINGREDUCE_HALF_ROUNDING", raising=False)
    assert ringreduce.settings()["half_rounding"] == "once"
    monkeypatch.setenv("RINGREDUCE_HALF_ROUNDING", "twice")
    tensors = [torch.ones(3, dtype=torch.bfloat16) for _ in range(2)]
    with pytest.raises(ValueError, match="RINGREDUCE_HALF_ROUNDING must be 'once'.*'twice'"):
        ringreduce.all_reduce(tensors)
    assert torch.equal(tensors[0], torch.ones(3, dtype=torch.bfloat16)), "modified on error"
    # fp32 does not read it: no other dtype changes.
    ringreduce.all_reduce([torch.ones(3) for _ in range(2)])
