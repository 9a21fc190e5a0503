"""The "ringreduce" backend beyond reductions: gather, scatter, all_to_all (list and single,
equal and uneven splits), send/recv, isend/irecv, recv from any source, batch_isend_irecv, the
object collectives and torch.distributed.checkpoint, with spawned ranks.

Every rank can compute what every other rank sends (payload() is a function of sender,
receiver, size, dtype and call), so results are checked exactly, against outputs poisoned with
values no payload holds; where gloo takes the dtype, the same calls on a gloo group in the same
processes must give the same tensors. Sizes include 0, 1, 7, 1000 and more bytes than the
shared-memory staging area (RINGREDUCE_SHM_BYTES, 8 KiB here), so the collectives go in rounds
and messages stream through the point-to-point rings in pieces. GPU variants run every rank on
cuda:0 and skip without a GPU.
"""
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from checks import needs_cuda, segments_of, small_net
from test_distributed import init, run_ranks, values

SHM_BYTES = 8192
SHM_ENV = {"RINGREDUCE_SHM_BYTES": str(SHM_BYTES)}
BIG = SHM_BYTES + 5  # elements: more bytes than the staging area, whatever the dtype
SIZES = (0, 1, 7, 1000, BIG)
BYTE_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
               torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64)
# Which dtypes gloo refuses ("Invalid scalar type": int16 and complex64 in torch 2.13) differs
# between torch releases; every rank probes its gloo (_gloo_refusals), and the results are
# compared with gloo's wherever it accepts the dtype.


def payload(src, dst, count, dtype, call):
    """What rank `src` sends to rank `dst` in call number `call`: random, non-zero, and never
    equal to poison()'s value; every rank can compute it."""
    seed = (((src * 131 + dst) * 1_000_003 + count) * 97 + BYTE_DTYPES.index(dtype)) * 7919 + call
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (count,), generator=g).bool()
    if dtype.is_complex or dtype.is_floating_point:
        parts = 2 if dtype.is_complex else 1
        mag = torch.rand(count, parts, generator=g, dtype=torch.float64) * 1.5 + 0.5
        sign = torch.randint(0, 2, (count, parts), generator=g) * 2 - 1
        value = mag * sign
        if dtype.is_complex:
            return torch.complex(value[:, 0], value[:, 1]).to(dtype)
        return value[:, 0].to(dtype)
    return torch.randint(1, 100, (count,), generator=g).to(dtype)


def poison(expected):
    """A tensor like `expected` that differs from it in every element."""
    if expected.dtype == torch.bool:
        return ~expected
    if expected.dtype == torch.uint8:
        return torch.full_like(expected, 255)
    return torch.full_like(expected, -1 if not expected.is_floating_point() and
                           not expected.is_complex() else -12345)


def split(src, dst, count):
    """Uneven split sizes: rank src sends this many elements (or rows) to rank dst; zero for
    some pairs once count is small."""
    return count * (1 + (src + 2 * dst) % 3) // 2


class Checker:
    """Counts exact comparisons and names the failing one."""

    def __init__(self):
        self.count = 0

    def __call__(self, got, expected, what):
        got = got.cpu()
        assert got.dtype == expected.dtype and torch.equal(got, expected), what
        self.count += 1


def _gloo_refusals(gloo, rank, world):
    """{"gather"|"scatter"|"all_to_all": dtypes this torch's gloo refuses}, from one tiny call
    of each per dtype (gloo checks the dtype on every rank before it communicates)."""
    calls = {
        "gather": lambda t: dist.gather(t, [t.clone() for _ in range(world)] if rank == 0
                                        else None, dst=0, group=gloo),
        "scatter": lambda t: dist.scatter(t, [t.clone() for _ in range(world)] if rank == 0
                                          else None, src=0, group=gloo),
        "all_to_all": lambda t: dist.all_to_all_single(t.repeat(world), t.repeat(world),
                                                       group=gloo),
    }
    refused = {kind: set() for kind in calls}
    for kind, call in calls.items():
        for dtype in BYTE_DTYPES:
            try:
                call(torch.zeros(1, dtype=dtype))
            except RuntimeError as exc:
                if "Invalid scalar type" not in str(exc):
                    raise
                refused[kind].add(dtype)
    return refused


def _byte_collectives(rank, world, store, device):
    init(rank, world, store)
    gloo = dist.new_group(backend="gloo")
    refuses = _gloo_refusals(gloo, rank, world)
    check = Checker()
    call = 0
    for dtype in BYTE_DTYPES:
        for count in SIZES:
            call += 1
            tag = f"{dtype} n={count} world={world} rank={rank}"
            for root in range(world):
                mine = payload(rank, root, count, dtype, call)
                expect = [payload(r, root, count, dtype, call) for r in range(world)]
                sent = mine.to(device)
                gathered = [poison(e).to(device) for e in expect] if rank == root else None
                dist.gather(sent, gathered, dst=root)
                check(sent, mine, f"gather input modified {tag}")
                if rank == root:
                    for r in range(world):
                        check(gathered[r], expect[r], f"gather from {r} to root {root} {tag}")
                if dtype not in refuses["gather"] and count in (7, BIG):
                    ref = [poison(e) for e in expect] if rank == root else None
                    dist.gather(mine, ref, dst=root, group=gloo)
                    for r in range(world if rank == root else 0):
                        check(gathered[r], ref[r], f"gather differs from gloo's {tag}")

                pieces = [payload(root, r, count, dtype, call + 1000) for r in range(world)]
                out = poison(pieces[rank]).to(device)
                dist.scatter(out, [p.to(device) for p in pieces] if rank == root else None,
                             src=root)
                check(out, pieces[rank], f"scatter from root {root} {tag}")
                if dtype not in refuses["scatter"] and count in (7, BIG):
                    ref = poison(pieces[rank])
                    dist.scatter(ref, pieces if rank == root else None, src=root, group=gloo)
                    check(out, ref, f"scatter differs from gloo's {tag}")

            for uneven in (False, True):
                size = (lambda s, d: split(s, d, count)) if uneven else (lambda s, d: count)
                ins = [payload(rank, q, size(rank, q), dtype, call + 2000) for q in range(world)]
                expect = [payload(p, rank, size(p, rank), dtype, call + 2000)
                          for p in range(world)]
                out = poison(torch.cat(expect)).to(device)
                splits = {}
                if uneven:
                    splits = {"input_split_sizes": [size(rank, q) for q in range(world)],
                              "output_split_sizes": [size(p, rank) for p in range(world)]}
                dist.all_to_all_single(out, torch.cat(ins).to(device), **splits)
                check(out, torch.cat(expect), f"all_to_all_single uneven={uneven} {tag}")
                outs = [poison(e).to(device) for e in expect]
                dist.all_to_all(outs, [t.to(device) for t in ins])
                for p in range(world):
                    check(outs[p], expect[p], f"all_to_all from {p} uneven={uneven} {tag}")
                if dtype not in refuses["all_to_all"] and count in (7, BIG):
                    ref = poison(torch.cat(expect))
                    dist.all_to_all_single(ref, torch.cat(ins), **splits, group=gloo)
                    check(out, ref, f"all_to_all_single differs from gloo's {tag}")

            # Point-to-point around the ring (to itself with one rank): isend, then irecv.
            nxt, prv = (rank + 1) % world, (rank - 1) % world
            msg = payload(rank, nxt, count, dtype, call + 3000)
            expect = payload(prv, rank, count, dtype, call + 3000)
            got = poison(expect).to(device)
            send = dist.isend(msg.to(device), nxt, tag=count)
            recv = dist.irecv(got, prv, tag=count)
            send.wait()
            recv.wait()
            check(got, expect, f"isend/irecv from {prv} {tag}")
    # All-to-all of 2-D tensors with uneven rows (a row is 3 elements).
    rows = [split(rank, q, 5) for q in range(world)]
    ins = torch.cat([payload(rank, q, 3 * rows[q], torch.int64, 1).reshape(-1, 3)
                     for q in range(world)])
    expect = torch.cat([payload(p, rank, 3 * split(p, rank, 5), torch.int64, 1).reshape(-1, 3)
                        for p in range(world)])
    out = poison(expect).to(device)
    dist.all_to_all_single(out, ins.to(device), [split(p, rank, 5) for p in range(world)], rows)
    check(out, expect, "all_to_all_single with rows of 3")
    dist.destroy_process_group()
    return check.count, os.getpid(), refuses


def _expected_checks(world, gloo_refuses):
    """The comparisons _byte_collectives makes on each rank (each rank is root once)."""
    n = 1
    for dtype in BYTE_DTYPES:
        for count in SIZES:
            gloo = {k: dtype not in refused and count in (7, BIG)
                    for k, refused in gloo_refuses.items()}
            n += world * (2 + gloo["scatter"]) + world * (1 + gloo["gather"])
            n += 2 * (1 + world + gloo["all_to_all"]) + 1
    return n


@pytest.mark.parametrize("world,engine", [(1, "1"), (2, "1"), (3, "1"), (4, "1"), (3, "0")])
def test_byte_collectives_cpu(tmp_path, world, engine):
    """engine "0": RINGREDUCE_ASYNC=0, collectives inline in the caller's thread."""
    env = dict(SHM_ENV, RINGREDUCE_ASYNC=engine)
    counts, pids, refuses = zip(*values(run_ranks(_byte_collectives, world, tmp_path, "cpu",
                                                  env=env)))
    assert all(r == refuses[0] for r in refuses), f"ranks' gloo refuses differently: {refuses}"
    assert counts == (_expected_checks(world, refuses[0]),) * world
    assert not segments_of(pids), f"left in /dev/shm: {segments_of(pids)}"


@needs_cuda
@pytest.mark.parametrize("world", [2, 3])
def test_byte_collectives_cuda_shared_gpu(tmp_path, world):
    counts, _, refuses = zip(*values(run_ranks(_byte_collectives, world, tmp_path, "cuda:0",
                                               env=SHM_ENV)))
    assert counts == (_expected_checks(world, refuses[0]),) * world


# ---------------------------------------------------------------------------------------
# Point-to-point: no deadlock whatever the order, tags, any source.

def _p2p_patterns(rank, world, store, device):
    init(rank, world, store)
    check = Checker()
    peer = 1 - rank
    big = 300_003  # float64: about 2.4 MB, hundreds of rings of 4 KiB
    mine = payload(rank, peer, big, torch.float64, 1).to(device)
    theirs = payload(peer, rank, big, torch.float64, 1)

    # Both ranks isend, then irecv.
    got = poison(theirs).to(device)
    works = [dist.isend(mine, peer), dist.irecv(got, peer)]
    for w in works:
        w.wait()
    check(got, theirs, "isend then irecv on both ranks")

    # Both ranks send (blocking) before they receive: the receiver's p2p thread drains the
    # message even though no receive is posted yet.
    got = poison(theirs).to(device)
    dist.send(mine, peer)
    dist.recv(got, peer)
    check(got, theirs, "blocking send before recv on both ranks")

    # batch_isend_irecv with the sends first on both ranks.
    got = poison(theirs).to(device)
    ops = [dist.P2POp(dist.isend, mine, peer), dist.P2POp(dist.irecv, got, peer)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    check(got, theirs, "batch_isend_irecv, sends first")

    # A large send queued before a collective on one rank, received after it on the other:
    # point-to-point does not wait behind the collectives' queue.
    got = poison(theirs).to(device)
    if rank == 0:
        send = dist.isend(mine, peer)
        t = torch.full((5,), 1.0, device=device)
        dist.all_reduce(t)
        send.wait()
    else:
        t = torch.full((5,), 2.0, device=device)
        dist.all_reduce(t)
        dist.recv(got, peer)
        check(got, theirs, "send queued before a collective")
    check(t, torch.full((5,), 3.0), "all_reduce between send and recv")

    # A receive posted before a collective, its message sent after it: the receive waits on
    # its own thread, not in front of the collective.
    got = poison(theirs).to(device)
    t = torch.full((5,), float(rank + 1), device=device)
    if rank == 1:
        recv = dist.irecv(got, peer)
        dist.all_reduce(t)
        recv.wait()
        check(got, theirs, "recv queued before a collective")
    else:
        dist.all_reduce(t)
        dist.send(mine, peer)
    check(t, torch.full((5,), 3.0), "all_reduce between recv and send")

    # Tags: messages match per (peer, tag) in send order, whatever order receives come in.
    tags = [5, 9, 5, 0, 9, 5]
    sent = [payload(rank, peer, 10 + i, torch.int32, 50 + i) for i in range(len(tags))]
    works = [dist.isend(t.to(device), peer, tag=tag) for t, tag in zip(sent, tags)]
    order = [3, 1, 4, 0, 2, 5]  # receive tag 0 first, then the 9s, then the 5s
    for i in order:
        expect = payload(peer, rank, 10 + i, torch.int32, 50 + i)
        got = poison(expect).to(device)
        dist.recv(got, peer, tag=tags[i])
        check(got, expect, f"tag {tags[i]} message {i}")
    for w in works:
        w.wait()

    # Send to itself.
    expect = payload(rank, rank, 1000, torch.float32, 60)
    got = poison(expect).to(device)
    works = [dist.isend(expect.to(device), rank, tag=3), dist.irecv(got, rank, tag=3)]
    for w in works:
        w.wait()
    check(got, expect, "isend/irecv to itself")
    dist.destroy_process_group()
    return check.count


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=needs_cuda)])
def test_p2p_patterns_do_not_deadlock(tmp_path, device):
    for n in values(run_ranks(_p2p_patterns, 2, tmp_path, device, env=SHM_ENV)):
        assert n >= 12


def _noncontiguous(rank, world, store, device):
    """Transposed views as inputs and outputs: staged through contiguous copies."""
    init(rank, world, store)
    check = Checker()

    def data(src, dst, call):  # a (6, 4) transposed view and its values
        return payload(src, dst, 24, torch.float64, call).reshape(4, 6).t()

    def target(expect):  # a poisoned transposed view on the device
        return poison(expect.t().contiguous()).to(device).t()

    peer = 1 - rank
    got = target(data(peer, rank, 1))
    works = [dist.isend(data(rank, peer, 1).to(device), peer), dist.irecv(got, peer)]
    for w in works:
        w.wait()
    check(got, data(peer, rank, 1), "isend/irecv of transposed views")

    expect = [data(r, 0, 2) for r in range(world)]
    gathered = [target(e) for e in expect] if rank == 0 else None
    dist.gather(data(rank, 0, 2).to(device), gathered, dst=0)
    for r in range(world if rank == 0 else 0):
        check(gathered[r], expect[r], f"gather into a view from {r}")

    out = target(data(0, rank, 3))
    dist.scatter(out, [data(0, r, 3).to(device) for r in range(world)] if rank == 0 else None,
                 src=0)
    check(out, data(0, rank, 3), "scatter into a view")

    expect = torch.cat([data(p, rank, 4)[:3] for p in range(world)])
    out = target(expect)
    dist.all_to_all_single(out, torch.cat([data(rank, q, 4)[:3] for q in range(world)]).t()
                           .contiguous().t().to(device))
    check(out, expect, "all_to_all_single between views")
    dist.destroy_process_group()
    return check.count


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=needs_cuda)])
def test_noncontiguous_tensors(tmp_path, device):
    assert values(run_ranks(_noncontiguous, 2, tmp_path, device)) == [5, 3]


def _any_source(rank, world, store):
    init(rank, world, store)
    check = Checker()
    sources = []
    if rank == 0:
        # Rank 2 sends with tag 7, rank 1 with tag 8 then tag 7 (after a barrier): receives
        # from any source pick by tag, and Work.source_rank() names the sender.
        dist.barrier()
        for tag, expect_src in ((8, 1), (7, 2), (7, 1)):
            expect = payload(expect_src, 0, 33, torch.int64, tag)
            got = poison(expect)
            work = dist.irecv(got, tag=tag)
            work.wait()
            sources.append(work.source_rank())
            check(got, expect, f"any source, tag {tag}")
            if tag == 7 and expect_src == 2:
                dist.barrier()
        got = poison(payload(2, 0, 4, torch.int64, 9))
        sources.append(dist.recv(got, tag=9))  # blocking recv returns the sender
        check(got, payload(2, 0, 4, torch.int64, 9), "blocking any-source recv")
    elif rank == 1:
        dist.send(payload(1, 0, 33, torch.int64, 8), 0, tag=8)
        dist.barrier()
        dist.barrier()
        dist.send(payload(1, 0, 33, torch.int64, 7), 0, tag=7)
    else:
        dist.send(payload(2, 0, 33, torch.int64, 7), 0, tag=7)
        dist.barrier()
        dist.barrier()
        dist.send(payload(2, 0, 4, torch.int64, 9), 0, tag=9)
    dist.destroy_process_group()
    return sources, check.count


def test_recv_from_any_source(tmp_path):
    out = values(run_ranks(_any_source, 3, tmp_path))
    assert out[0] == ([1, 2, 1, 2], 4)


# ---------------------------------------------------------------------------------------
# Object collectives and torch.distributed.checkpoint (both use gather and scatter).

def _objects(rank, world, store):
    init(rank, world, store)
    gloo = dist.new_group(backend="gloo")

    def obj(r, what):
        # Pickles to more than the 8 KiB staging area: the collectives go in rounds.
        return {"rank": r, "what": what, "blob": bytes(range(256)) * (40 + r),
                "nested": [r, "x" * r, (r, 2.5 * r)]}

    results = {}
    for name, group in (("ringreduce", None), ("gloo", gloo)):
        got = {}
        for root in range(world):
            gathered = [None] * world if rank == root else None
            dist.gather_object(obj(rank, f"gather{root}"), gathered, dst=root, group=group)
            got[f"gather{root}"] = gathered
            out = [None]
            dist.scatter_object_list(out, [obj(r, f"scatter{root}") for r in range(world)]
                                     if rank == root else None, src=root, group=group)
            got[f"scatter{root}"] = out[0]
            objs = [obj(rank, f"bcast{root}"), rank * 11]
            dist.broadcast_object_list(objs, src=root, group=group)
            got[f"bcast{root}"] = objs
        everyone = [None] * world
        dist.all_gather_object(everyone, obj(rank, "all"), group=group)
        got["all"] = everyone
        results[name] = got
    for root in range(world):
        expect = [obj(r, f"gather{root}") for r in range(world)] if rank == root else None
        assert results["ringreduce"][f"gather{root}"] == expect
        assert results["ringreduce"][f"scatter{root}"] == obj(rank, f"scatter{root}")
        assert results["ringreduce"][f"bcast{root}"] == [obj(root, f"bcast{root}"), root * 11]
    assert results["ringreduce"]["all"] == [obj(r, "all") for r in range(world)]
    return results["ringreduce"] == results["gloo"]


@pytest.mark.parametrize("world", [2, 3])
def test_object_collectives_match_gloo(tmp_path, world):
    assert all(values(run_ranks(_objects, world, tmp_path, env=SHM_ENV)))


def _checkpoint(rank, world, store, path):
    import torch.distributed.checkpoint as dcp

    init(rank, world, store)
    torch.manual_seed(0)
    model = small_net()
    dcp.save({"model": model.state_dict()}, checkpoint_id=path)
    torch.manual_seed(100 + rank)
    fresh = small_net()
    before = [t.clone() for t in fresh.state_dict().values()]
    state = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=path)
    fresh.load_state_dict(state["model"])
    saved = list(model.state_dict().values())
    loaded = list(fresh.state_dict().values())
    changed = any(not torch.equal(a, b) for a, b in zip(before, saved))
    same = all(torch.equal(a, b) for a, b in zip(saved, loaded))
    dist.destroy_process_group()
    return changed, same


def test_checkpoint_save_and_load(tmp_path):
    path = str(tmp_path / "ckpt")
    for changed, same in values(run_ranks(_checkpoint, 2, tmp_path, path, env=SHM_ENV)):
        assert changed, "the fresh model already held the saved weights: the test cannot fail"
        assert same, "the loaded state dict differs from the saved one"
    assert os.path.exists(os.path.join(path, ".metadata"))


# ---------------------------------------------------------------------------------------
# Bad arguments raise in the caller, naming the argument, before any tensor is touched.

def _bad_arguments(rank, world, store):
    init(rank, world, store)
    pg = dist.group.WORLD
    errors = {}
    x = torch.full((4,), 7.0)
    poisoned = torch.full((4,), -1.0)

    def gather_opts(root):
        opts = dist.GatherOptions()
        opts.rootRank = root
        return opts

    def scatter_opts(root):
        opts = dist.ScatterOptions()
        opts.rootRank = root
        return opts

    # On both ranks: each raises, so neither queues anything.
    cases = {
        "send to a bad rank": lambda: pg.send([x], world, 0),
        "recv from a bad rank": lambda: pg.recv([poisoned], -1, 0),
        "tag not an int": lambda: pg.send([x], 1 - rank, "a"),
        "gather root": lambda: pg.gather([[poisoned] * world], [x], gather_opts(world)),
        "gather list on a non-root": lambda: pg.gather(
            [[poisoned] * world], [x], gather_opts(1 - rank)),
        "splits do not add up": lambda: dist.all_to_all_single(
            poisoned, x, output_split_sizes=[2, 2], input_split_sizes=[1, 2]),
        "splits length": lambda: dist.all_to_all_single(
            poisoned, x, output_split_sizes=[2, 2], input_split_sizes=[4]),
        "no splits, dim 0 not divisible": lambda: dist.all_to_all_single(
            torch.full((3,), -1.0), torch.full((3,), 7.0)),
        # ProcessGroup.all_to_all_single came with torch 2.13; alltoall_base before it.
        "all_to_all_single dtype": lambda: getattr(pg, "all_to_all_single", pg.alltoall_base)(
            poisoned, x.long(), [], [], dist.AllToAllOptions()),
        "all_to_all list length": lambda: dist.all_to_all([poisoned], [x, x]),
        "all_to_all dtype": lambda: pg.alltoall(
            [poisoned, poisoned], [x, x.double()], dist.AllToAllOptions()),
        "all_reduce dtype": lambda: dist.all_reduce(torch.ones(3, dtype=torch.int16)),
        "all_reduce op on the dtype": lambda: dist.all_reduce(x, op=dist.ReduceOp.BAND),
        "reduce_scatter_tensor dtype": lambda: dist.reduce_scatter_tensor(
            torch.zeros(2, dtype=torch.int16), torch.ones(2 * world, dtype=torch.int16)),
    }
    if rank == 0:  # errors of the root's arguments: the other rank makes no call
        cases.update({
            "gather list length": lambda: pg.gather([[poisoned] * (world + 1)], [x],
                                                    gather_opts(0)),
            "gather element size": lambda: pg.gather([[poisoned, torch.zeros(5)]], [x],
                                                     gather_opts(0)),
            "scatter list length": lambda: pg.scatter([poisoned], [[x]], scatter_opts(0)),
            "scatter dtype": lambda: pg.scatter([poisoned], [[x, x.int()]], scatter_opts(0)),
        })
    for name, call in cases.items():
        try:
            call()
            errors[name] = None
        except (RuntimeError, ValueError, TypeError) as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
    untouched = torch.equal(poisoned, torch.full((4,), -1.0)) and torch.equal(x,
                                                                              torch.full((4,), 7.0))
    # Nothing was queued or half-done: the group still works, collectives and messages alike.
    gathered = [torch.zeros(4) for _ in range(world)] if rank == 0 else None
    dist.gather(torch.full((4,), float(rank)), gathered, dst=0)
    ok = rank != 0 or all(torch.equal(g, torch.full((4,), float(r)))
                          for r, g in enumerate(gathered))
    got = torch.zeros(2)
    works = [dist.isend(torch.full((2,), float(rank)), 1 - rank), dist.irecv(got, 1 - rank)]
    for w in works:
        w.wait()
    dist.destroy_process_group()
    return errors, untouched, ok and torch.equal(got, torch.full((2,), float(1 - rank)))


def test_bad_arguments_raise_before_anything_is_touched(tmp_path):
    expected = {  # the words each message must contain: the argument and the rule
        "send to a bad rank": ("ValueError", "dst", "[0, 2)"),
        "recv from a bad rank": ("ValueError", "src", "[0, 2)"),
        "tag not an int": ("TypeError", "tag"),
        "gather root": ("ValueError", "root", "[0, 2)"),
        "gather list on a non-root": ("ValueError", "gather_list", "only the root"),
        "splits do not add up": ("ValueError", "input_split_sizes", "add up"),
        "splits length": ("ValueError", "input_split_sizes", "one size per rank"),
        "no splits, dim 0 not divisible": ("ValueError", "world size"),
        "all_to_all_single dtype": ("ValueError", "output", "torch.float32", "torch.int64"),
        "all_to_all list length": ("ValueError", "output_tensor_list", "one tensor per rank"),
        "all_to_all dtype": ("ValueError", "input_tensor_list[1]", "torch.float64"),
        # The reductions' messages are built only when they are raised (torch_types.h): the
        # whole prefix, the dtype and the argument must still be there.
        "all_reduce dtype": ("TypeError", "ringreduce all_reduce: dtype Short of tensor is not "
                             "supported (supported: float32,"),
        "all_reduce op on the dtype": ("TypeError", "ringreduce all_reduce: op 'band' ",
                                       "; got float32"),
        "reduce_scatter_tensor dtype": ("TypeError", "ringreduce reduce_scatter_tensor: dtype "
                                        "Short of input is not supported"),
    }
    root_only = {  # raised on the root (rank 0) only: elsewhere the call is fine
        "gather list length": ("ValueError", "gather_list", "one tensor per rank (2); got 3"),
        "gather element size": ("ValueError", "gather_list[1]", "5 elements"),
        "scatter list length": ("ValueError", "scatter_list", "one tensor per rank (2); got 1"),
        "scatter dtype": ("ValueError", "scatter_list[1]", "torch.int32"),
    }
    for rank, (errors, untouched, ok) in enumerate(values(run_ranks(_bad_arguments, 2,
                                                                    tmp_path))):
        for name, words in list(expected.items()) + (list(root_only.items()) if rank == 0
                                                     else []):
            msg = errors[name]
            assert msg is not None, f"rank {rank}: {name} did not raise"
            for w in words:
                assert w in msg, f"rank {rank}: {name}: {w!r} not in {msg!r}"
        assert untouched, "a bad call modified a tensor"
        assert ok, "the group did not work after the bad calls"


# ---------------------------------------------------------------------------------------
# Faults: a dead peer makes the survivors raise within the liveness period, naming the
# operation and the peer; a silent one, within the timeout.

FAULT_TIMEOUT = 20.0  # long: a dead peer must be noticed well before it
HANG_TIMEOUT = 3.0


def _dead_peer(rank, world, store, where):
    init(rank, world, store, timeout=FAULT_TIMEOUT)
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    victim = world - 1
    if rank == victim:
        time.sleep(0.5)  # the others are waiting by then
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        if where == "recv":
            dist.recv(torch.zeros(100), victim)
        else:
            dist.all_to_all_single(torch.zeros(2 * world), torch.ones(2 * world))
        return ("no error", 0.0, pids)
    except RuntimeError as exc:
        return (str(exc), time.monotonic() - start, pids)


@pytest.mark.parametrize("where,world", [("recv", 2), ("all_to_all", 3)])
def test_dead_peer_fails_fast(tmp_path, where, world):
    results = run_ranks(_dead_peer, world, tmp_path, where)
    assert results[world - 1][0] == "died"
    for rank in range(world - 1):
        status, value = results[rank]
        assert status == "ok", value
        msg, elapsed, pids = value
        assert where in msg and f"rank {world - 1}" in msg and "exited" in msg, msg
        assert elapsed < 3.0, f"took {elapsed:.1f} s (timeout {FAULT_TIMEOUT} s): {msg}"
        assert not segments_of(pids), f"left in /dev/shm: {segments_of(pids)}"


def _silent_peer(rank, world, store):
    init(rank, world, store, timeout=HANG_TIMEOUT)
    if rank == 1:
        dist.send(torch.ones(3), 0, tag=4)  # a message with another tag: no match
        time.sleep(HANG_TIMEOUT + 2)
        return None
    start = time.monotonic()
    try:
        dist.recv(torch.zeros(3), 1, tag=5)
        return ("no error", 0.0)
    except RuntimeError as exc:
        return (str(exc), time.monotonic() - start)


def test_recv_times_out_naming_peer_and_tag(tmp_path):
    msg, elapsed = values(run_ranks(_silent_peer, 2, tmp_path))[0]
    assert "recv" in msg and "rank 1" in msg and "tag 5" in msg and "timed out" in msg, msg
    assert "tag 4 from rank 1" in msg, msg  # the unmatched message is named
    assert HANG_TIMEOUT - 0.5 < elapsed < HANG_TIMEOUT + 2.0, elapsed


def _size_mismatch(rank, world, store):
    init(rank, world, store, timeout=HANG_TIMEOUT * 3)
    try:
        if rank == 0:
            dist.send(torch.ones(6), 1)
            dist.barrier()
        else:
            dist.recv(torch.zeros(5), 0)
        return "no error"
    except RuntimeError as exc:
        return str(exc)


def test_recv_of_another_size_fails_clearly(tmp_path):
    msgs = values(run_ranks(_size_mismatch, 2, tmp_path))
    assert "24 bytes of float32" in msgs[1] and "20 bytes of float32" in msgs[1], msgs[1]
    assert "rank 1" in msgs[0] and "failed" in msgs[0], msgs[0]  # the group fails on both
