"""Splitting and shrinking a ringreduce group through torch's own APIs: ProcessGroup.split_group
(what dist.split_group and DeviceMesh call) and dist.shrink_group, with a rank SIGKILLed during
DDP training on CPU while the others shrink and go on."""
import copy
import datetime
import glob
import os
import signal
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from checks import segments_of
from test_distributed import init, run_ranks, values

SEED = 2612


def _split(rank, world, store):
    init(rank, world, store)
    parent = dist.distributed_c10d._get_default_group()
    backend = parent._get_backend(torch.device("cpu"))
    flags = (backend.supports_splitting, backend.supports_shrinking, backend.supports_coalescing)
    # Every rank of the parent calls split_group; the ranks outside get None.
    evens = parent.split_group([0, 2], timeout=datetime.timedelta(seconds=20),
                               group_name="rr_split_evens")
    odds = parent.split_group([1, 3], timeout=datetime.timedelta(seconds=20),
                              group_name="rr_split_odds")
    mine = evens if rank % 2 == 0 else odds
    other = odds if rank % 2 == 0 else evens
    t = torch.full((5,), float(rank + 1))
    mine.allreduce([t]).wait()
    # The parent still works after the split, and so does the child after the parent's use.
    w = torch.full((3,), float(rank + 1))
    dist.all_reduce(w)
    u = torch.tensor([float(rank)])
    mine.allreduce([u]).wait()
    child = mine._get_backend(torch.device("cpu"))
    out = (flags, other is None, mine.rank(), mine.size(), child.name(), t.tolist(), w.tolist(),
           u.tolist())
    dist.destroy_process_group()
    return out


def test_split_group_makes_working_subgroups(tmp_path):
    results = run_ranks(_split, 4, tmp_path)
    got = values(results)
    for rank, (flags, other_none, sub_rank, sub_size, name, t, w, u) in enumerate(got):
        assert flags == (True, True, True)
        assert other_none, f"rank {rank} got a group it is not in"
        assert (sub_rank, sub_size, name) == (rank // 2, 2, "ringreduce")
        peers = [r for r in range(4) if r % 2 == rank % 2]
        assert t == [float(sum(p + 1 for p in peers))] * 5
        assert w == [10.0] * 3
        assert u == [float(sum(peers))]
    assert not segments_of(results.pids), f"left in /dev/shm: {segments_of(results.pids)}"


def _split_not_a_rank(rank, world, store):
    init(rank, world, store)
    parent = dist.distributed_c10d._get_default_group()
    try:
        parent.split_group([0, 5], group_name="rr_split_bad")
        error = None
    except ValueError as exc:
        error = str(exc)
    dist.destroy_process_group()
    return error


def test_split_with_a_rank_outside_the_parent_fails_clearly(tmp_path):
    for error in values(run_ranks(_split_not_a_rank, 2, tmp_path)):
        assert error and "rank 5 is not in the parent group (ranks 0..1)" in error


# Whether DeviceMesh makes its groups by splitting a default group bound to the CPU (torch 2.13
# and later; tested on 2.11 and 2.13).
MESH_SPLITS_ON_CPU = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)


def _dist_split_and_mesh(rank, world, store):
    # dist.split_group and DeviceMesh split only where torch.accelerator has a device (they ask
    # it which backend of the child to use) and the default group is bound to a device: on
    # this CPU-only machine both are made to say "cpu", so that torch's own code path, which a
    # GPU run takes with cuda, runs here on ringreduce's CPU backend.
    torch.accelerator.is_available = lambda: True
    torch.accelerator.current_accelerator = lambda *args, **kwargs: torch.device("cpu")
    from torch.distributed import device_mesh

    splits = []
    real_split = device_mesh.split_group

    def counted_split(*args, **kwargs):
        splits.append(kwargs.get("split_ranks"))
        return real_split(*args, **kwargs)

    device_mesh.split_group = counted_split
    init(rank, world, store)
    dist.distributed_c10d._get_default_group().bound_device_id = torch.device("cpu", 0)
    pairs = dist.split_group(split_ranks=[[0, 1], [2, 3]],
                             timeout=datetime.timedelta(seconds=20))
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t, group=pairs)
    pair_info = (dist.get_backend(pairs), pairs.size(), dist.get_rank(pairs), t.tolist())
    if not MESH_SPLITS_ON_CPU:
        # torch 2.11's DeviceMesh passes the default group's bound device to new_group, which
        # must be an accelerator there: unbound, it makes the mesh's groups with new_group.
        dist.distributed_c10d._get_default_group().bound_device_id = None
    mesh = device_mesh.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    sums = {}
    for dim in ("dp", "tp"):
        group = mesh[dim].get_group()
        u = torch.tensor([float(10 ** rank)], dtype=torch.float64)
        dist.all_reduce(u, group=group)
        sums[dim] = (dist.get_backend(group), dist.get_process_group_ranks(group), u.item())
    dist.destroy_process_group()
    return pair_info, sums, splits


def test_dist_split_group_and_device_mesh(tmp_path):
    """torch's dist.split_group (it deep-copies the parent backend's options) and a 2x2
    DeviceMesh made by splitting the default group, each checked with an all-reduce whose sum
    tells which ranks took part."""
    results = run_ranks(_dist_split_and_mesh, 4, tmp_path)
    for rank, (pair_info, sums, splits) in enumerate(values(results)):
        pair = [0, 1] if rank < 2 else [2, 3]
        assert pair_info == ("ringreduce", 2, rank % 2, [float(sum(r + 1 for r in pair))] * 4)
        assert splits == ([[[0, 2], [1, 3]], [[0, 1], [2, 3]]] if MESH_SPLITS_ON_CPU else []), splits
        dp = [rank % 2, rank % 2 + 2]
        tp = [rank // 2 * 2, rank // 2 * 2 + 1]
        assert sums == {"dp": ("ringreduce", dp, float(sum(10 ** r for r in dp))),
                        "tp": ("ringreduce", tp, float(sum(10 ** r for r in tp)))}, sums
    assert not segments_of(results.pids), f"left in /dev/shm: {segments_of(results.pids)}"


# ---------------------------------------------------------------------------------------
# Shrinking: a rank dies in DDP training, the others shrink and finish.

SHRINK_TIMEOUT = 6.0
STEPS = 6
DIES_AFTER = 2  # rank 2 dies once it has finished this many steps


def _net():
    torch.manual_seed(SEED)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _batch(step, rank, world):
    g = torch.Generator().manual_seed(SEED * 1000 + step * 16 + rank * 4 + world)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def _train_step(model, opt, step, rank, world):
    x, y = _batch(step, rank, world)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _state(model, opt):
    return copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})


def _shm_of(name):
    return glob.glob("/dev/shm" + name + "*")


def _shrink_in_training(rank, world, store, state_path, flags):
    init(rank, world, store, timeout=SHRINK_TIMEOUT)
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    model = DDP(net)
    names = [ringreduce_comm_name()]
    # What torch takes the group's backend for ("custom", as for every plugin): the shrunk
    # group must be taken for the same, not for gloo (DDP's logger then casts it to
    # ProcessGroupGloo: a SIGSEGV on torch 2.14.1).
    kinds = [dist.group.WORLD._get_backend_name()]
    saved = _state(net, opt)
    step = 0
    noticed = None
    while step < STEPS:
        if rank == 2 and step == DIES_AFTER:
            os.kill(os.getpid(), signal.SIGKILL)
        start = time.monotonic()
        try:
            _train_step(model, opt, step, rank, world)
        except RuntimeError as exc:
            noticed = (str(exc), time.monotonic() - start, step)
            # Back to the state after the last finished step, then on with the survivors.
            net.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            if rank == 0:
                torch.save(saved, state_path)
            new = dist.shrink_group([2], shrink_flags=flags)
            world = new.size()
            names.append(ringreduce_comm_name())
            kinds.append(new._get_backend_name())
            model = DDP(net, process_group=new)
            continue
        saved = _state(net, opt)
        step += 1
    out = {"noticed": noticed, "params": [p.detach().numpy().copy() for p in net.parameters()],
           "rank": dist.get_rank(), "world": dist.get_world_size(), "names": names,
           "kinds": kinds}
    dist.destroy_process_group()
    out["left"] = [f for n in names for f in _shm_of(n)]
    return out


def ringreduce_comm_name():
    from ringreduce.distributed import comm_of

    return comm_of().name


def _two_rank_reference(rank, world, store, state_path):
    init(rank, world, store)
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    saved = torch.load(state_path)
    net.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    model = DDP(net)
    for step in range(DIES_AFTER, STEPS):
        _train_step(model, opt, step, rank, world)
    params = [p.detach().numpy().copy() for p in net.parameters()]
    dist.destroy_process_group()
    return params


def _check_shrink(tmp_path, flags):
    state_path = str(tmp_path / "state.pt")
    results = run_ranks(_shrink_in_training, 3, tmp_path, state_path, flags)
    assert results[2][0] == "died", results[2]
    survivors = values({r: results[r] for r in (0, 1)})
    reference = values(run_ranks(_two_rank_reference, 2, tmp_path, state_path))
    for rank, out in enumerate(survivors):
        msg, elapsed, step = out["noticed"]
        assert step == DIES_AFTER, out["noticed"]
        assert "rank 2" in msg, msg
        assert elapsed < SHRINK_TIMEOUT + 2.0, f"noticed after {elapsed:.1f} s: {msg}"
        assert (out["rank"], out["world"]) == (rank, 2)
        for i, (got, ref) in enumerate(zip(out["params"], reference[rank])):
            assert (got == ref).all(), f"rank {rank} parameter {i} differs from a 2-rank run"
        assert not out["left"], f"left in /dev/shm: {out['left']}"
        assert len(out["names"]) == 2 and out["names"][0] != out["names"][1]
        assert out["kinds"][1] == out["kinds"][0] != "gloo", out["kinds"]
    for a, b in zip(survivors[0]["params"], survivors[1]["params"]):
        assert (a == b).all()


def test_shrink_after_a_rank_is_killed_in_ddp_training(tmp_path):
    _check_shrink(tmp_path, 0)


def test_shrink_abort_after_a_rank_is_killed_in_ddp_training(tmp_path):
    _check_shrink(tmp_path, 1)


def _excluded_calls_shrink(rank, world, store):
    init(rank, world, store)
    errors = []
    for call in (lambda: dist.shrink_group([rank]),
                 lambda: dist.distributed_c10d._get_default_group()
                 ._get_backend(torch.device("cpu")).shrink([rank], 0)):
        try:
            call()
            errors.append(None)
        except RuntimeError as exc:
            errors.append(str(exc))
    dist.barrier()
    dist.destroy_process_group()
    return errors


def test_an_excluded_rank_calling_shrink_gets_a_clear_error(tmp_path):
    for rank, errors in enumerate(values(run_ranks(_excluded_calls_shrink, 2, tmp_path))):
        for e in errors:
            assert e and f"Current rank {rank} is in the exclusion list" in e, errors
