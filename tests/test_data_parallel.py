"""ringreduce.comm: torch.cuda.comm's collectives on the ring, on CPU "devices" (GPU variants
skip without a GPU).

References are exact: integer-valued sums, the same tensors.
"""
import pytest
import torch

from ringreduce import comm

CPU = torch.device("cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (none in this environment)")


def integer_valued(shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-50, 50, shape, generator=g).to(dtype)


def shares_memory(a, b):
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()

# ---------------------------------------------------------------- comm

@pytest.mark.parametrize("ndev", [2, 3])
def test_comm_broadcast_gives_every_rank_its_own_copy(ndev):
    src = integer_valued((5, 7), 0)
    out = comm.broadcast(src, [CPU] * ndev)
    assert len(out) == ndev and out[0] is src  # the source rank keeps the source, as in torch
    for t in out[1:]:
        assert torch.equal(t, src) and not shares_memory(t, src)
    assert not shares_memory(out[1], out[-1]) or ndev == 2
    strided = src.t()  # not contiguous: staged for the ring, still returned as itself
    out = comm.broadcast(strided, ["cpu", "cpu"])
    assert out[0] is strided and torch.equal(out[1], strided)
    targets = [torch.zeros(5, 7), torch.zeros(7, 5).t()]
    assert comm.broadcast(src, out=targets)[1] is targets[1]
    assert all(torch.equal(t, src) for t in targets)
    with pytest.raises(RuntimeError, match="exactly one of 'devices' and 'out'"):
        comm.broadcast(src)
    with pytest.raises(ValueError, match=r"out\[0\] must have the source's shape"):
        comm.broadcast(src, out=[torch.zeros(3)])


def test_comm_broadcast_coalesced_all_dtypes_in_buckets():
    tensors = [integer_valued((3, 4), 1), torch.arange(6), torch.tensor([True, False, True]),
               torch.randn(5, dtype=torch.complex64), integer_valued((100,), 2, torch.float64),
               integer_valued((2, 2), 3)]
    # 64-byte buckets: the float64 tensor (800 bytes) and the two float32 ones go apart.
    out = comm.broadcast_coalesced(tensors, [CPU] * 3, buffer_size=64)
    assert len(out) == 3 and all(a is b for a, b in zip(out[0], tensors))
    for rank in out[1:]:
        for got, want in zip(rank, tensors):
            assert got.dtype == want.dtype and torch.equal(got, want)
            assert not shares_memory(got, want)
    # Views of one flat buffer, each with its own version counter: an in-place update of one
    # (a BatchNorm running statistic) must not invalidate another saved for backward.
    a, b = out[1][0], out[1][5]
    version = b._version
    a.add_(1)
    assert b._version == version and torch.equal(b, tensors[5])
    with pytest.raises(ValueError, match="must be on devices\\[0\\]"):
        comm.broadcast_coalesced([torch.zeros(2, device="meta")], [CPU, CPU])


@pytest.mark.parametrize("ndev", [2, 3, 4])
def test_comm_reduce_add_is_exact_and_leaves_inputs(ndev):
    inputs = [integer_valued((33, 3), 10 + r) for r in range(ndev)]
    pristine = [t.clone() for t in inputs]
    got = comm.reduce_add(inputs, destination="cpu")
    assert torch.equal(got, torch.stack(pristine).sum(0))
    assert all(torch.equal(a, b) for a, b in zip(inputs, pristine))
    assert not any(shares_memory(got, t) for t in inputs)
    z = [torch.complex(integer_valued((4,), r), integer_valued((4,), 20 + r)) for r in range(3)]
    assert torch.equal(comm.reduce_add(z, CPU), z[0] + z[1] + z[2])
    same = integer_valued((6,), 5)  # one tensor passed for two ranks: copied, not refused
    assert torch.equal(comm.reduce_add([same, same], -1), 2 * same)
    with pytest.raises(ValueError, match="input 1 has size"):
        comm.reduce_add([torch.zeros(3), torch.zeros(4)], CPU)
    with pytest.raises(RuntimeError, match="destination cuda:0 must be the device of one"):
        comm.reduce_add([torch.zeros(3), torch.zeros(3)], torch.device("cuda", 0))


def test_comm_reduce_add_coalesced_matches_per_tensor_sums():
    shapes = [(3, 4), (10,), (2, 2, 2), (1,), (40,)]
    inputs = [[integer_valued(s, 100 * r + i) for i, s in enumerate(shapes)] for r in range(3)]
    inputs[1][2] = inputs[1][2].double()  # not the same dtype on every rank: refused below
    with pytest.raises((TypeError, ValueError, RuntimeError), match="dtype"):
        comm.reduce_add_coalesced(inputs, CPU, buffer_size=32)
    inputs[1][2] = inputs[1][2].float()
    got = comm.reduce_add_coalesced(inputs, CPU, buffer_size=32)
    for i, s in enumerate(shapes):
        assert got[i].shape == s
        assert torch.equal(got[i], inputs[0][i] + inputs[1][i] + inputs[2][i])
    sparse = [torch.eye(3).to_sparse() * (r + 1) for r in range(2)]
    (total,) = comm.reduce_add_coalesced([[sparse[0]], [sparse[1]]], CPU)
    assert torch.equal(total.to_dense(), 3 * torch.eye(3))


def test_comm_scatter_and_gather_on_cpu():
    x = torch.arange(21.0).view(7, 3)
    chunks = comm.scatter(x, [CPU] * 3)
    assert [c.shape[0] for c in chunks] == [3, 3, 1]  # torch.chunk's sizes
    assert torch.equal(comm.gather(chunks, 0, CPU), x)
    parts = comm.scatter(x, [CPU] * 2, chunk_sizes=[2, 5])
    assert [p.shape[0] for p in parts] == [2, 5]
    out = [torch.zeros(4, 3), torch.zeros(3, 3)]
    comm.scatter(x, out=out)
    assert torch.equal(torch.cat(out), x)
    dest = torch.zeros(3, 7)
    comm.gather([x.t()[:, :4], x.t()[:, 4:]], dim=1, out=dest)
    assert torch.equal(dest, x.t())


def test_comm_timer_counts_the_collectives():
    with comm.CommTimer() as timer:
        comm.broadcast_coalesced([torch.randn(1000)], [CPU] * 2)
        comm.reduce_add([torch.randn(1000), torch.randn(1000)], CPU)
    comm.broadcast(torch.randn(10), [CPU] * 2)  # outside: not counted
    assert len(timer._marks) == 2 and timer.seconds() > 0
    assert timer.seconds() == 0.0  # read once

# ---------------------------------------------------------------- GPU

def simulated_gpus(n=2):
    return [torch.device("cuda", 0)] * n

@needs_cuda
def test_cuda_comm_on_simulated_ranks():
    devices = simulated_gpus(3)
    src = integer_valued((1000, 3), 8).cuda()
    out = comm.broadcast_coalesced([src, src[0].clone()], devices)
    assert out[0][0] is src
    for rank in out[1:]:
        assert torch.equal(rank[0], src) and not shares_memory(rank[0], src)
    inputs = [integer_valued((1001,), 30 + r).cuda() for r in range(3)]
    got = comm.reduce_add(inputs, devices[0])
    assert torch.equal(got.cpu(), sum(t.cpu() for t in inputs))
    x = torch.arange(12.0).view(6, 2)
    chunks = comm.scatter(x, devices)
    assert all(c.device == devices[0] for c in chunks)
    assert torch.equal(comm.gather(chunks, 0, CPU), x)
