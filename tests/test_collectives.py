"""The list API's other collectives on CPU ranks (reduce, broadcast, all_gather, reduce_scatter,
and all_reduce with outputs=): every dtype x op x rank count x awkward size, in place and out of
place, against the ring model bit for bit. tests/test_cuda.py runs the same checks on a GPU."""
import pytest
import torch

import ringreduce
from checks import (check_copying_collectives, check_reducing_collectives, poison_like,
                    seeded)
from reference import ALL_DTYPES, random_inputs, reduce_scatter_model, ring_model, valid_ops

SIZES = (0, 1, 7, 33, 1000, 4099)
RANKS = (1, 2, 3, 4, 5, 8)
IDS = lambda v: str(v).replace("torch.", "")  # noqa: E731


def _reducing_cases():
    for dtype in ALL_DTYPES:
        for op in valid_ops(dtype):
            for nranks in RANKS:
                yield dtype, op, nranks


@pytest.mark.parametrize("dtype,op,nranks", list(_reducing_cases()), ids=IDS)
def test_reducing_collectives(dtype, op, nranks):
    g = seeded("reducing", dtype, op, nranks)
    check_reducing_collectives(dtype, op, ["cpu"] * nranks, g, SIZES)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=IDS)
@pytest.mark.parametrize("nranks", RANKS)
def test_copying_collectives(dtype, nranks):
    g = seeded("copying", dtype, nranks)
    check_copying_collectives(dtype, ["cpu"] * nranks, g, SIZES)


def test_reduce_gives_all_reduce_bits_on_every_root():
    g = torch.Generator().manual_seed(20)
    inputs = random_inputs(5, 4099, torch.bfloat16, "sum", generator=g)
    reduced = [t.clone() for t in inputs]
    ringreduce.all_reduce(reduced)
    for root in range(5):
        out = torch.empty(4099, dtype=torch.bfloat16)
        ringreduce.reduce([t.clone() for t in inputs], out, root=root)
        assert torch.equal(out.view(torch.int16), reduced[0].view(torch.int16))


def test_all_reduce_outputs_may_be_the_inputs():
    g = torch.Generator().manual_seed(21)
    inputs = random_inputs(4, 1000, torch.float16, "sum", generator=g)
    in_place = [t.clone() for t in inputs]
    ringreduce.all_reduce(in_place)
    same = [t.clone() for t in inputs]
    assert ringreduce.all_reduce(same, outputs=same) is same
    mixed = [t.clone() for t in inputs]
    outputs = [mixed[0], poison_like(mixed[1]), mixed[2], poison_like(mixed[3])]
    ringreduce.all_reduce(mixed, outputs=outputs)
    for t in same + outputs:
        assert torch.equal(t.view(torch.int16), in_place[0].view(torch.int16))
    assert torch.equal(mixed[1], inputs[1]) and torch.equal(mixed[3], inputs[3])


def test_shapes_follow_torch_cuda_nccl():
    # all_gather concatenates along dim 0; reduce_scatter splits the flattened input in blocks;
    # outputs need the right number of elements, not a particular shape
    g = torch.Generator().manual_seed(22)
    inputs = [x.reshape(2, 3, 5) for x in random_inputs(3, 30, torch.float64, "sum", generator=g)]
    outputs = [torch.empty(6, 3, 5, dtype=torch.float64) for _ in range(3)]
    ringreduce.all_gather(inputs, outputs)
    for out in outputs:
        assert torch.equal(out, torch.cat(inputs, dim=0))
    scattered = [torch.empty(10, dtype=torch.float64) for _ in range(3)]
    ringreduce.reduce_scatter(inputs, scattered)
    for out, expected in zip(scattered, reduce_scatter_model(inputs, "sum")):
        assert torch.equal(out, expected)
    flat_out = torch.empty(30, dtype=torch.float64)
    assert ringreduce.reduce(inputs, flat_out, root=2) is flat_out
    assert torch.equal(flat_out, ring_model(inputs, "sum").reshape(-1))


def test_streams_and_comms_arguments():
    g = torch.Generator().manual_seed(23)
    inputs = random_inputs(3, 10, torch.float32, "sum", generator=g)
    expected = ring_model(inputs, "sum")
    t = [x.clone() for x in inputs]
    ringreduce.all_reduce(t, "sum", streams=[None, None, None], comms=None)
    assert torch.equal(t[1], expected)
    out = ringreduce.reduce([x.clone() for x in inputs], None, 0, "sum", None, None)
    assert torch.equal(out, expected)


def test_outputs_are_visible_to_autograd_and_inputs_are_not_bumped():
    g = torch.Generator().manual_seed(24)
    inputs = random_inputs(3, 64, torch.float32, "sum", generator=g)
    outputs = [torch.empty(64) for _ in range(3)]
    before_in = [t._version for t in inputs]
    before_out = [t._version for t in outputs]
    ringreduce.all_reduce(inputs, outputs=outputs)
    assert [t._version for t in inputs] == before_in
    assert [t._version for t in outputs] == [v + 1 for v in before_out]
    gathered = [torch.empty(192) for _ in range(3)]
    ringreduce.all_gather(inputs, gathered)
    assert [t._version for t in inputs] == before_in
    assert all(t._version == 1 for t in gathered)
    ringreduce.broadcast(inputs, root=1)
    assert [t._version for t in inputs] == [before_in[0] + 1, before_in[1], before_in[2] + 1]
