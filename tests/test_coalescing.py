"""Coalescing on the ringreduce backend: torch's _coalescing_manager, all_reduce_coalesced and
all_gather_coalesced (torch's layouts), each batch one ring pass per dtype.

Fusion is checked bit for bit: a fused float all-reduce rounds like the ring over the packed
buffer (ring_model of the concatenation), which differs from the ring over each tensor alone;
every case asserts that the two models differ, so the check would catch per-tensor execution.
"""
import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _coalescing_manager

from checks import assert_same_bits, bits, poison_like
from reference import all_gather_model, assert_close_to_wide, random_inputs, ring_model
from test_distributed import init, run_ranks, values

SEED = 2611
WORLD = 3
# (shape, dtype) of one batch: several float32 tensors (fused together), a float64 and an
# int32 one (fused per dtype), an empty one.
BATCH = (((5,), torch.float32), ((3, 4), torch.float32), ((0,), torch.float32),
         ((7,), torch.float64), ((2, 3), torch.int32), ((11,), torch.float32))
# all_reduce_coalesced and all_gather_coalesced take one dtype (torch checks).
ONE_DTYPE = (((5,), torch.float32), ((3, 4), torch.float32), ((0,), torch.float32),
             ((2, 2, 2), torch.float32))


def batch_inputs(case, world, batch=BATCH, scale=1):
    """[rank][i]: rank's i-th tensor of the batch (shape[0] times `scale`), seeded by case."""
    g = torch.Generator().manual_seed(SEED + case)
    per_tensor = []
    for shape, dtype in batch:
        shape = (shape[0] * scale,) + tuple(shape[1:])
        count = 1
        for s in shape:
            count *= s
        per_tensor.append([t.reshape(shape) for t in random_inputs(world, count, dtype, "sum",
                                                                   generator=g)])
    return [[per_tensor[i][r] for i in range(len(batch))] for r in range(world)]


def _coalesced_ranks(rank, world, store):
    init(rank, world, store)
    out = {}
    mine = [t.clone() for t in batch_inputs(1, world)[rank]]
    with _coalescing_manager():
        for t in mine:
            dist.all_reduce(t)
    out["manager_all_reduce"] = mine

    mine = [t.clone() for t in batch_inputs(2, world)[rank]]
    with _coalescing_manager(async_ops=True) as cm:
        for t in mine:
            dist.all_reduce(t, async_op=True)
    cm.wait()
    out["manager_all_reduce_async"] = mine

    mine = [t.clone() for t in batch_inputs(3, world, ONE_DTYPE)[rank]]
    work = dist.all_reduce_coalesced(mine, async_op=True)
    work.wait()
    out["all_reduce_coalesced"] = mine

    # With a device: startCoalescing/endCoalescing, one Work for the batch.
    mine = [t.clone() for t in batch_inputs(4, world)[rank]]
    with _coalescing_manager(device=torch.device("cpu"), async_ops=True) as cm:
        for t in mine:
            dist.all_reduce(t, async_op=True)
    out["device_batch_works"] = len(cm.works)
    fut = cm.works[0].get_future()
    cm.wait()
    fut.wait()
    out["device_batch"] = mine

    ins = batch_inputs(5, world)[rank]
    outs = [poison_like(t, (world * t.shape[0],) + tuple(t.shape[1:])) for t in ins]
    with _coalescing_manager():
        for o, i in zip(outs, ins):
            dist.all_gather_into_tensor(o, i)
    out["manager_all_gather"] = outs

    ins = batch_inputs(6, world, scale=world)[rank]
    outs = [poison_like(t, (t.shape[0] // world,) + tuple(t.shape[1:])) for t in ins]
    with _coalescing_manager():
        for o, i in zip(outs, ins):
            dist.reduce_scatter_tensor(o, i)
    out["manager_reduce_scatter"] = outs

    # torch's layout: lists[r][i] receives rank r's inputs[i]; inputs of different shapes.
    ins = batch_inputs(7, world, ONE_DTYPE)[rank]
    lists = [[poison_like(t) for t in ins] for _ in range(world)]
    dist.all_gather_coalesced(lists, ins)
    out["all_gather_coalesced"] = lists

    # batch_isend_irecv goes through startCoalescing/endCoalescing once coalescing is supported.
    send = torch.arange(4, dtype=torch.float32) + 10 * rank
    recv = poison_like(send)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, (rank + 1) % world),
                                   dist.P2POp(dist.irecv, recv, (rank - 1) % world)])
    for r in reqs:
        r.wait()
    out["p2p_works"] = len(reqs)
    out["p2p"] = recv
    dist.destroy_process_group()
    return _plain(out)


def _plain(x):
    """Tensors as numpy arrays: through the result queue without torch's shared-memory
    handoff (which can stall once the sending rank has exited)."""
    if isinstance(x, torch.Tensor):
        return x.numpy()
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_plain(v) for v in x)
    return x


def _tensors(x):
    if isinstance(x, dict):
        return {k: _tensors(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_tensors(v) for v in x)
    return x if isinstance(x, int) else torch.from_numpy(x)


def _fused_model(per_rank, idx, model):
    """model() over the packed batch of the tensors `idx`, split back into their shapes."""
    packed = [torch.cat([per_rank[r][i].reshape(-1) for i in idx]) for r in range(len(per_rank))]
    flat = model(packed)
    out, at = [], 0
    for i in idx:
        n = per_rank[0][i].numel()
        out.append(flat[at:at + n].reshape(per_rank[0][i].shape))
        at += n
    return out


def _kinds(batch):
    kinds = {}
    for i, (_, dtype) in enumerate(batch):
        kinds.setdefault(dtype, []).append(i)
    return list(kinds.values())


def _expect_all_reduce(case, world, batch=BATCH):
    per_rank = batch_inputs(case, world, batch)
    expected = [None] * len(batch)
    discriminates = False
    for idx in _kinds(batch):
        fused = _fused_model(per_rank, idx, lambda xs: ring_model(xs, "sum"))
        for i, f in zip(idx, fused):
            expected[i] = f
            alone = ring_model([per_rank[r][i] for r in range(world)], "sum")
            discriminates = discriminates or not torch.equal(bits(alone), bits(f))
    # Two ranks add once per element, in any order alike: nothing to tell apart there.
    assert discriminates or world == 2, f"case {case}: per-tensor and fused rings agree"
    return expected


def test_coalesced_collectives_are_fused(tmp_path):
    print(f"seed {SEED}, world {WORLD}")
    got = _tensors(values(run_ranks(_coalesced_ranks, WORLD, tmp_path)))
    for key, case, batch in (("manager_all_reduce", 1, BATCH),
                             ("manager_all_reduce_async", 2, BATCH),
                             ("all_reduce_coalesced", 3, ONE_DTYPE), ("device_batch", 4, BATCH)):
        expected = _expect_all_reduce(case, WORLD, batch)
        for rank, out in enumerate(got):
            for i, (g, e) in enumerate(zip(out[key], expected)):
                assert_same_bits(g, e, f"{key}[{i}] on rank {rank}")
    for out in got:
        assert out["device_batch_works"] == 1
        assert out["p2p_works"] == 1

    per_rank = batch_inputs(5, WORLD)
    for rank, out in enumerate(got):
        for i, g in enumerate(out["manager_all_gather"]):
            e = all_gather_model([per_rank[r][i] for r in range(WORLD)])
            assert torch.equal(g.reshape(-1), e), f"all_gather[{i}] on rank {rank}"

    per_rank = batch_inputs(6, WORLD, scale=WORLD)
    for rank, out in enumerate(got):
        for i, g in enumerate(out["manager_reduce_scatter"]):
            n = g.numel()
            blocks = [per_rank[r][i].reshape(-1)[rank * n:(rank + 1) * n] for r in range(WORLD)]
            assert_close_to_wide(g.reshape(-1), blocks, "sum")

    per_rank = batch_inputs(7, WORLD, ONE_DTYPE)
    for rank, out in enumerate(got):
        lists = out["all_gather_coalesced"]
        assert len(lists) == WORLD
        for r in range(WORLD):
            for i in range(len(ONE_DTYPE)):
                assert torch.equal(lists[r][i], per_rank[r][i]), f"lists[{r}][{i}] on {rank}"
        assert torch.equal(out["p2p"], torch.arange(4.0) + 10 * ((rank - 1) % WORLD))


def _bad_lists(rank, world, store):
    init(rank, world, store)
    errors = []
    ins = [torch.ones(2), torch.ones(3, 3)]
    cases = [
        [[torch.empty(2), torch.empty(3, 3)]],                       # one list, world ranks
        [[torch.empty(2)] for _ in range(world)],                     # one tensor short
        [[torch.empty(2), torch.empty(4)] for _ in range(world)],     # wrong size
        [[torch.empty(2), torch.empty(9, dtype=torch.float16)] for _ in range(world)],
    ]
    for lists in cases:
        try:
            dist.all_gather_coalesced(lists, ins)
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    try:
        with _coalescing_manager():
            dist.all_gather_into_tensor(torch.empty(5), torch.ones(2))
        errors.append(None)
    except ValueError as e:
        errors.append(str(e))
    # The group still works: nothing was queued by the refused calls.
    t = torch.ones(3)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return errors, t.tolist()


def test_mismatched_coalesced_lists_fail_clearly(tmp_path):
    for errors, t in values(run_ranks(_bad_lists, 2, tmp_path)):
        assert errors[0] and "output_tensor_lists must hold one list per rank (2); got 1" \
            in errors[0]
        assert errors[1] and "output_tensor_lists[0] must hold one tensor per input (2); got 1" \
            in errors[1]
        assert errors[2] and "output_tensor_lists[0][1]" in errors[2] and "9" in errors[2]
        assert errors[3] and "torch.float16" in errors[3]
        assert errors[4] and "world size (2) x input elements (2); got 5" in errors[4]
        assert t == [2.0, 2.0, 2.0]


@pytest.mark.parametrize("world", [2, 4])
def test_coalesced_all_reduce_other_world_sizes(tmp_path, world):
    def check(got):
        expected = _expect_all_reduce(3, world, ONE_DTYPE)
        for rank, out in enumerate(got):
            for i, (g, e) in enumerate(zip(out, expected)):
                assert_same_bits(g, e, f"[{i}] on rank {rank}")
    check(_tensors(values(run_ranks(_all_reduce_coalesced_only, world, tmp_path))))


def _all_reduce_coalesced_only(rank, world, store):
    init(rank, world, store)
    mine = [t.clone() for t in batch_inputs(3, world, ONE_DTYPE)[rank]]
    dist.all_reduce_coalesced(mine)
    dist.destroy_process_group()
    return _plain(mine)
