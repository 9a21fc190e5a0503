"""The "ringreduce" backend across several simulated hosts on one machine.

Hosts come from RINGREDUCE_HOST_ID (spawned ranks) or from torchrun's GROUP_RANK (two torchrun
launchers); the hosts share no shared-memory segment and meet only through gloo over TCP. Each
spawned launch runs many checks inside its ranks (starting a rank costs a torch import).
"""
import ctypes
import datetime
import hashlib
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from reference import (ALL_DTYPES, _combine, _int_avg, assert_close_to_wide, chunk_bounds,
                       fp32_ordered_sum, half_rounding, random_inputs, ring_model, rounds_once,
                       valid_ops)
from ringreduce import hierarchy
from ringreduce.distributed import comm_of, inter_host_bytes
from checks import communicate_bounded, ddp_steps, free_port, seeded
from test_distributed import init, run_ranks, values

HERE = os.path.dirname(os.path.abspath(__file__))
REDUCE_OPS = {"sum": "SUM", "avg": "AVG", "max": "MAX", "min": "MIN", "prod": "PRODUCT",
              "band": "BAND", "bor": "BOR", "bxor": "BXOR"}
SIZES = (0, 1, 7, 33, 1000, 4099)
_SEGMENT = re.compile(r"/dev/shm/ringreduce-(\d+)-[0-9a-f]+-h(\d+)-r(\d+)")


def hierarchical_model(inputs, op, hosts):
    """The value every rank must hold, bit for bit: each host reduces its ranks' inputs in local
    order (the shared-memory reduce-scatter's hops, avg as sum; 16-bit float sums in fp32,
    rounded once, unless RINGREDUCE_HALF_ROUNDING=per_hop), then the host partials are
    combined in host order in fp32 for 16-bit floats, rounded once (avg divides there).
    Computed here from reference.py's one-hop combine, independently of ringreduce.hierarchy."""
    dtype = inputs[0].dtype
    partials = []
    for ranks in hosts:
        if len(ranks) > 1 and rounds_once(dtype, "sum" if op == "avg" else op, half_rounding()):
            partials.append(fp32_ordered_sum([inputs[r] for r in ranks], "sum"))
            continue
        acc = inputs[ranks[0]].clone()
        for r in ranks[1:]:
            acc = _combine("sum" if op == "avg" else op, acc, inputs[r], dtype, False, len(ranks))
        partials.append(acc)
    wide = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    acc = partials[0].to(wide)
    for part in partials[1:]:
        acc = _combine("sum" if op == "avg" else op, acc, part.to(wide), wide, False, len(inputs))
    if op == "avg":
        acc = acc / len(inputs) if wide.is_floating_point else _int_avg(acc, len(inputs))
    return acc.to(dtype)


def _reduce_op(op):
    return getattr(dist.ReduceOp, REDUCE_OPS[op])


def _mapped_segments():
    """(creator pid, host index) of every ringreduce segment this process has mapped."""
    with open("/proc/self/maps") as f:
        return sorted({(int(m.group(1)), int(m.group(2))) for m in _SEGMENT.finditer(f.read())})


def _all_reduce_sweep(rank, world, hosts, dtypes, sizes, seed, extra=(), group=None):
    """All-reduce of every dtype x op x size, then of each (dtype, op, size) in `extra`, on
    `group` (the default group if None): (problems, sha256 of every result)."""
    problems, digest = [], hashlib.sha256()
    cases = [(d, o, c) for d in dtypes for o in valid_ops(d) for c in sizes] + list(extra)
    for case, (dtype, op, count) in enumerate(cases):
        g = torch.Generator().manual_seed(seed + case)
        inputs = random_inputs(world, count, dtype, op, generator=g)
        first, second = inputs[rank].clone(), inputs[rank].clone()
        dist.all_reduce(first, op=_reduce_op(op), group=group)
        dist.all_reduce(second, op=_reduce_op(op), group=group)
        name = f"{dtype} {op} n={count}"
        if not torch.equal(first.view(torch.uint8), second.view(torch.uint8)):
            problems.append(f"{name}: two identical calls differ")
        if not torch.equal(first.view(torch.uint8),
                           hierarchical_model(inputs, op, hosts).view(torch.uint8)):
            problems.append(f"{name}: differs from the hierarchical model")
        if count:
            try:
                assert_close_to_wide(first, inputs, op)
            except AssertionError as exc:
                problems.append(f"{name}: {exc}")
        digest.update(first.view(torch.uint8).numpy().tobytes())
    # NaN propagates through max and min across hosts too (gloo's own MAX would drop it).
    for op in ("max", "min"):
        t = torch.arange(8, dtype=torch.float32)
        t[rank] = float("nan")
        dist.all_reduce(t, op=_reduce_op(op), group=group)
        if not bool(torch.isnan(t[:world]).all()) or bool(torch.isnan(t[world:]).any()):
            problems.append(f"{op}: NaN did not propagate exactly: {t.tolist()}")
    return problems, digest.hexdigest()


def _ddp(rank, group, steps=4):
    return [p.detach().clone() for p in ddp_steps(rank, group, steps=steps).parameters()]


class _CountingGloo(dist.ProcessGroupGloo):
    """torch's gloo group, logging every collective called on it through Python. Installed as
    dist.ProcessGroupGloo in a rank's process before init, so that the inter-host groups
    hierarchy.group_factory makes are these. The backend calls them from C++ (xhost.h), through
    c10d::Backend, so a collective across hosts leaves this log empty: no Python on the way."""

    log = []
    made = 0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _CountingGloo.made += 1

    def __getattribute__(self, name):
        if name in ("allreduce", "_allgather_base", "alltoall_base", "broadcast", "gather",
                    "scatter", "send", "recv", "recv_anysource", "barrier", "allgather",
                    "reduce_scatter", "_reduce_scatter_base"):
            _CountingGloo.log.append(name)
        return object.__getattribute__(self, name)


def _written():
    """Bytes each TCP socket open in this process has sent, by socket inode (the kernel's count:
    tcp_info's tcpi_bytes_sent, for gloo's pairs and the store's, whatever system call wrote
    them; no file or pipe write counts). Shared memory sends none."""
    total = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
            if not link.startswith("socket:"):
                continue
            fd = os.dup(int(name))
        except OSError:
            continue  # closed meanwhile
        try:
            s = socket.socket(fileno=fd)
        except OSError:
            os.close(fd)  # a socket Python cannot wrap: not one of TCP's
            continue
        with s:
            if s.family not in (socket.AF_INET, socket.AF_INET6) or s.type != socket.SOCK_STREAM:
                continue
            info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
            assert len(info) >= 208, "tcp_info has no tcpi_bytes_sent (Linux < 4.19)"
            total[link] = struct.unpack_from("Q", info, 200)[0]  # tcpi_bytes_sent
    return total


def _written_since(before, now=None):
    """Bytes sent since `before` (_written) by the sockets open `now` (_written; default: at
    this call). A socket closed in between is left out: its whole total would otherwise subtract
    from the others' (CI saw -12 MB once, 2026-11-28: a socket that had sent 12 MB closed during
    the call). The all-reduce's own sockets stay open across it, so what it sends is all
    counted."""
    total = 0
    for link, sent in (_written() if now is None else now).items():
        was = before.get(link, 0)
        # An inode reused by a socket opened in between: its count starts from 0.
        total += sent - was if sent >= was else sent
    return total


def _file_store_barrier(key, world, deadline_s=60.0):
    """Returns once all `world` ranks have called it with `key`, through the default group's
    store (a file: nothing crosses a socket)."""
    store = dist.distributed_c10d._get_default_store()
    store.add(key, 1)
    end = time.monotonic() + deadline_s
    while store.add(key, 0) < world:
        assert time.monotonic() < end, f"not every rank reached the barrier {key!r}"
        time.sleep(0.001)


# ---------------------------------------------------------------------------------------
# Two hosts of two ranks: one launch, checked by the tests below.

def _two_hosts(rank, world, store, hosts):
    os.environ["RINGREDUCE_HOST_ID"] = "ab"[rank // 2]
    dist.ProcessGroupGloo = _CountingGloo  # this rank's process only (spawned)
    init(rank, world, store)
    pg = dist.group.WORLD
    out = {"pid": os.getpid(), "segments": _mapped_segments(), "layout": comm_of(pg).layout.hosts,
           "host": comm_of(pg).layout.host}
    # Two hosts exchange CPU partials up to 1 MiB (an all-to-all with nothing to itself);
    # larger ones go through the engine's all-reduce (32/64-bit sum) or all-to-all (max). Up to
    # RINGREDUCE_XHOST_LEADER_BYTES (1 MiB) only the hosts' first ranks cross, with the whole
    # partial; above it every local rank crosses with its shard. The two other groups force one
    # schedule at every size; all three must give the same bits.
    # Over 1 MiB every local rank crosses with a shard over 1 MiB: gloo's all-reduce for sum,
    # avg (divided once, after it) and prod (its PRODUCT, not SUM).
    large = [(torch.float32, "sum", 100000), (torch.float32, "max", 100000),
             (torch.bfloat16, "avg", 100000), (torch.int8, "prod", 300000),
             (torch.float32, "sum", 600000), (torch.float64, "max", 300000),
             (torch.float32, "avg", 600000), (torch.int32, "prod", 600000)]
    out["problems"], out["digest"] = _all_reduce_sweep(rank, world, hosts, ALL_DTYPES, SIZES, 0,
                                                       large)
    problems = out["problems"]
    # max and min keep host 0's operand where the two compare equal: +0.0 (host a) against
    # -0.0 (host b) gives +0.0 on every rank, through the leaders (1,000) and the shards (600,000).
    for count in (1000, 600000):
        for op in (dist.ReduceOp.MAX, dist.ReduceOp.MIN):
            t = torch.full((count,), 0.0 if rank < 2 else -0.0)
            dist.all_reduce(t, op=op)
            if torch.signbit(t).any() or not torch.equal(t, torch.zeros(count)):
                problems.append(f"{op} of +0.0 (host a) and -0.0 (host b), n={count}: "
                                f"{int(torch.signbit(t).sum())} results are not host a's +0.0")
    paths = {}
    for name, limit in (("shards", "0"), ("leaders", str(1 << 40))):
        os.environ["RINGREDUCE_XHOST_LEADER_BYTES"] = limit  # read when the group is made
        paths[name] = dist.new_group(backend="ringreduce")
    del os.environ["RINGREDUCE_XHOST_LEADER_BYTES"]
    for name, group in paths.items():
        found, out[f"digest_{name}"] = _all_reduce_sweep(rank, world, hosts, ALL_DTYPES, SIZES,
                                                         0, large, group=group)
        problems += [f"{name}: {p}" for p in found]

    _CountingGloo.log.clear()
    for name, group in (("leader", None), ("shards", paths["shards"])):
        # Two calls, each counted by the code and by the kernel (sockets seen before and after
        # kept for the message). Counted once every rank has returned: a rank's all-reduce can
        # end while what it sent still waits in its kernel's send queue, and the kernel counts
        # bytes as it transmits them; a peer that returned has received them (through the file
        # store: no socket). CI saw 0 of 131,072 bytes once (2026-11-29), which this did not
        # reproduce; the test takes either call.
        for attempt in range(2):
            before, written = inter_host_bytes(group), _written()
            dist.all_reduce(torch.ones(1 << 16), group=group)
            _file_store_barrier(f"sent-{name}-{attempt}", world)
            after = _written()
            out.setdefault(f"written_{name}", []).append(_written_since(written, after))
            out.setdefault(f"bytes_{name}", []).append(inter_host_bytes(group) - before)
            out.setdefault(f"sockets_{name}", []).append((len(written), len(after)))
    out["crossed"] = list(_CountingGloo.log)
    out["gloo_made"] = _CountingGloo.made
    for group in paths.values():
        dist.destroy_process_group(group)

    m = 1031
    for dtype, op in ((torch.float64, "sum"), (torch.int32, "prod"), (torch.float32, "avg"),
                      (torch.float32, "max")):
        g = torch.Generator().manual_seed(7)
        full = [t.reshape(world, m) for t in random_inputs(world, world * m, dtype, op,
                                                           generator=g)]
        expect = hierarchical_model([f[rank] for f in full], op, hosts)
        got = torch.full((m,), 7, dtype=dtype)
        dist.reduce_scatter_tensor(got, full[rank].reshape(-1), op=_reduce_op(op))
        got_list = torch.full((m,), 7, dtype=dtype)
        dist.reduce_scatter(got_list, list(full[rank]), op=_reduce_op(op))
        if not (torch.equal(got, expect) and torch.equal(got_list, expect)):
            problems.append(f"reduce_scatter {dtype} {op} differs from the hierarchical model")
    # The hosts' partials are folded in host order in reduce_scatter too: host a's +0.0 against
    # host b's -0.0 stays +0.0 under max and min.
    for op in (dist.ReduceOp.MAX, dist.ReduceOp.MIN):
        full = torch.full((world * m,), 0.0 if rank < 2 else -0.0)
        got = torch.full((m,), 7.0)
        dist.reduce_scatter_tensor(got, full, op=op)
        got_list = torch.full((m,), 7.0)
        dist.reduce_scatter(got_list, list(full.view(world, m)), op=op)
        for name, t in (("reduce_scatter_tensor", got), ("reduce_scatter", got_list)):
            if torch.signbit(t).any() or not torch.equal(t, torch.zeros(m)):
                problems.append(f"{name} {op} of +0.0 (host a) and -0.0 (host b): "
                                f"{int(torch.signbit(t).sum())} results are not host a's +0.0")
    for count in (0, 3, 4099, 20000):
        mine = torch.arange(count, dtype=torch.int64) + 1000 * rank
        outs = [torch.full((count,), -1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(outs, mine)
        flat = torch.full((world * count,), -1, dtype=torch.int64)
        dist.all_gather_into_tensor(flat, mine)
        want = [torch.arange(count) + 1000 * r for r in range(world)]
        if not all(torch.equal(o, w) for o, w in zip(outs, want)) or \
                not torch.equal(flat, torch.cat(want)):
            problems.append(f"all_gather n={count} wrong")
    for root in range(world):
        t = torch.full((5,), float(rank))
        dist.broadcast(t, src=root)
        if not torch.equal(t, torch.full((5,), float(root))):
            problems.append(f"broadcast from {root} wrong")
    t = torch.full((3,), float(rank + 1))
    dist.reduce(t, dst=3)
    if rank == 3 and not torch.equal(t, torch.full((3,), 10.0)):
        problems.append("reduce wrong")
    dist.barrier()
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank})
    if objs != [{"rank": r} for r in range(world)]:
        problems.append("all_gather_object wrong")
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    out["pids"] = pids

    gloo = dist.new_group(backend="gloo")
    ring, ref = _ddp(rank, None), _ddp(rank, gloo)
    out["ddp_close"] = all(torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-6)
                           for a, b in zip(ring, ref))
    out["ddp_digest"] = hashlib.sha256(b"".join(
        p.view(torch.uint8).numpy().tobytes() for p in ring)).hexdigest()
    dist.barrier()
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    hosts = [[0, 1], [2, 3]]
    return values(run_ranks(_two_hosts, 4, tmp_path_factory.mktemp("two_hosts"), hosts,
                            env={"RINGREDUCE_SHM_BYTES": "8192"}))


def test_two_hosts_all_reduce_every_dtype_and_op(two_hosts):
    for rank, out in enumerate(two_hosts):
        assert out["layout"] == [[0, 1], [2, 3]]
        assert not out["problems"], f"rank {rank}:\n" + "\n".join(out["problems"])


def test_two_hosts_bitwise_identical_on_every_rank(two_hosts):
    assert len({out["digest"] for out in two_hosts}) == 1
    for name in ("shards", "leaders"):
        assert [out[f"digest_{name}"] for out in two_hosts] == [out["digest"] for out in two_hosts], \
            f"the {name} schedule gives other bits than the default"
    assert len({out["ddp_digest"] for out in two_hosts}) == 1, "DDP replicas diverged"


def test_two_hosts_ddp_close_to_gloo(two_hosts):
    assert all(out["ddp_close"] for out in two_hosts)


def test_inter_host_bytes_per_rank(two_hosts):
    """2 hosts of 2 ranks, a float32 all-reduce of S = 256 KiB. Every local rank driving its
    shard (RINGREDUCE_XHOST_LEADER_BYTES=0): each rank hands half the tensor to the inter-host
    engine once, the model's 2*S*(H-1)/(H*L) = S/2. By default (S is under 1 MiB) the hosts'
    first ranks hand the whole S, the others nothing. (xhost.h's own count: the inter-host
    groups are called from C++, where a Python subclass cannot count.)"""
    whole = 4 * (1 << 16)
    for rank, out in enumerate(two_hosts):
        first = out["layout"][out["host"]][0] == rank
        for name, sent in (("shards", whole // 2), ("leader", whole if first else 0)):
            assert out[f"bytes_{name}"] == [sent, sent], (rank, name, out[f"bytes_{name}"])
            # What crossed, counted by the kernel, not by the code: the exchange writes what is
            # sent once plus headers (a few hundred bytes; the store's failure watch adds a
            # few more). A rank sending the whole tensor where it should send half (or
            # nothing) writes S/2 more in both calls; one call that counts short (see the
            # worker) is let pass when the other counts right.
            written = out[f"written_{name}"]
            detail = (rank, name, written, "sockets before/after", out[f"sockets_{name}"])
            assert all(w <= sent + 16384 for w in written), detail
            assert any(sent <= w for w in written), detail


def test_inter_host_groups_are_called_from_cpp(two_hosts):
    for rank, out in enumerate(two_hosts):
        assert out["gloo_made"] >= 1, f"rank {rank} made no inter-host gloo group: nothing seen"
        assert out["crossed"] == [], (rank, out["crossed"])


def test_no_rank_maps_another_hosts_segment(two_hosts):
    pids = two_hosts[0]["pids"]
    for rank, out in enumerate(two_hosts):
        own_host = [pids[r] for r in out["layout"][out["host"]]]
        assert out["segments"], f"rank {rank} maps no segment (the test cannot see them)"
        assert sorted(p for p, _ in out["segments"]) == sorted(own_host), out["segments"]
        assert {h for _, h in out["segments"]} == {out["host"]}


# ---------------------------------------------------------------------------------------
# Uneven hosts, three hosts, a killed host, a host that never joins.

def test_segments_map_shards_across_uneven_hosts():
    lay = hierarchy.Layout(["a", "a", "a", "b"], 0, True)
    assert lay.hierarchical and not lay.even and lay.hosts == [[0, 1, 2], [3]]
    # 4-byte elements: host a cuts 100 elements at 36 and 72, host b not at all.
    assert hierarchy.segments(lay, 100, 4) == [(0, 36, (0, 3)), (36, 72, (1, 3)),
                                               (72, 100, (2, 3))]
    lay = hierarchy.Layout(["a", "a", "a", "b", "b"], 4, True)
    assert hierarchy.segments(lay, 100, 4) == [(0, 36, (0, 3)), (36, 52, (1, 3)),
                                               (52, 72, (1, 4)), (72, 100, (2, 4))]
    assert hierarchy.segments(lay, 0, 4) == []
    assert not hierarchy.Layout(["x", "x"], 1, True).hierarchical


def _uneven(rank, world, store, hosts, labels):
    os.environ["RINGREDUCE_HOST_ID"] = labels[rank]
    init(rank, world, store)
    dtypes = (torch.float32, torch.bfloat16, torch.int64, torch.uint8)
    problems, digest = _all_reduce_sweep(rank, world, hosts, dtypes, SIZES, 100)
    m = 77
    full = torch.arange(world * m, dtype=torch.float64).reshape(world, m) * (rank + 1)
    got = torch.zeros(m)
    dist.reduce_scatter_tensor(got, full.reshape(-1).float())
    if not torch.equal(got, full[rank].float() / (rank + 1) * (world * (world + 1) // 2)):
        problems.append("reduce_scatter wrong")
    outs = [torch.zeros(5, dtype=torch.int32) for _ in range(world)]
    dist.all_gather(outs, torch.full((5,), rank, dtype=torch.int32))
    if [int(o[0]) for o in outs] != list(range(world)):
        problems.append("all_gather wrong")
    dist.barrier()
    dist.destroy_process_group()
    return problems, digest


def test_uneven_hosts_3_and_1(tmp_path):
    labels = "aaab"
    out = values(run_ranks(_uneven, len(labels), tmp_path, [[0, 1, 2], [3]], labels))
    for rank, (problems, _) in enumerate(out):
        assert not problems, f"rank {rank}:\n" + "\n".join(problems)
    assert len({d for _, d in out}) == 1


# ---------------------------------------------------------------------------------------
# RINGREDUCE_HIERARCHICAL=0: one flat ring over both hosts (they share /dev/shm here), and the
# check that every rank agrees on the switch.

FLAT_CASES = [(torch.float32, "sum", 4099), (torch.float32, "avg", 1000),
              (torch.bfloat16, "sum", 33), (torch.float64, "max", 7), (torch.int8, "prod", 257)]
FLAT_COUNTS = (0, 1, 5, 33, 1000, 4099, 1 << 16)


def _ring_hop_bytes(count, esize, world, rank):
    """Bytes rank's successor reads from it in one flat all_reduce, step by step as DESIGN.md
    describes the ring: at reduce-scatter step s rank r + 1 receives chunk (r - s) mod N, at
    all-gather step t chunk (r + 1 - t) mod N (reference.chunk_bounds for the chunks)."""
    bounds = chunk_bounds(count, world, esize)

    def size(c):
        lo, hi = bounds[c % world]
        return hi - lo

    steps = [rank - s for s in range(world - 1)] + [rank + 1 - t for t in range(world - 1)]
    return esize * sum(size(c) for c in steps)


def _flat_hosts(rank, world, store):
    os.environ.update(RINGREDUCE_HOST_ID="ab"[rank // 2], RINGREDUCE_HIERARCHICAL="0")
    init(rank, world, store)
    pg = dist.group.WORLD
    executor = type(comm_of(pg)).__name__  # Comm: one ring; HierarchicalComm: per host
    # The hosts RINGREDUCE_HOST_ID makes; the backend's own view of them shows in the hops whose
    # bytes inter_host_bytes counts (checked by the test).
    hosts = [[0, 1], [2, 3]]
    problems, differs = [], 0
    for case, (dtype, op, count) in enumerate(FLAT_CASES):
        inputs = random_inputs(world, count, dtype, op, generator=seeded("flat", dtype, op, count))
        t = inputs[rank].clone()
        dist.all_reduce(t, op=_reduce_op(op))
        if not torch.equal(t.view(torch.uint8), ring_model(inputs, op).view(torch.uint8)):
            problems.append(f"{dtype} {op} n={count}: differs from the flat ring's model")
        differs += not torch.equal(t.view(torch.uint8),
                                   hierarchical_model(inputs, op, hosts).view(torch.uint8))
    crossed = []
    for count in FLAT_COUNTS:
        before = inter_host_bytes(pg)
        dist.all_reduce(torch.ones(count))
        crossed.append(inter_host_bytes(pg) - before)
    dist.destroy_process_group()
    return executor, problems, differs, crossed


def test_flat_ring_across_hosts_when_hierarchical_is_off(tmp_path):
    """RINGREDUCE_HIERARCHICAL=0 on two hosts: every result is the flat 4-rank ring's, bit for
    bit (and at least one differs from the hierarchical path's, so the switch changed the
    path), and inter_host_bytes counts the bytes of the ring hops that cross a host boundary:
    rank 1 -> 2 and rank 3 -> 0."""
    world = 4
    for rank, (executor, problems, differs, crossed) in enumerate(
            values(run_ranks(_flat_hosts, world, tmp_path))):
        assert executor == "Comm", executor
        assert not problems, f"rank {rank}:\n" + "\n".join(problems)
        assert differs, "no case tells the flat ring from the hierarchical path: add one"
        crosses = rank in (1, 3)
        want = [_ring_hop_bytes(c, 4, world, rank) if crosses else 0 for c in FLAT_COUNTS]
        assert crossed == want, (rank, crossed, want)


def _disagree(rank, world, store):
    os.environ["RINGREDUCE_HOST_ID"] = "ab"[rank // 2]
    if rank == 2:
        os.environ["RINGREDUCE_HIERARCHICAL"] = "0"
    try:
        init(rank, world, store, timeout=20.0)
        return "joined"
    except Exception as exc:  # noqa: BLE001 - whatever torch wraps it in, the text is ours
        return f"{type(exc).__name__}: {exc}"


def test_ranks_that_disagree_on_hierarchical_all_fail(tmp_path):
    for rank, msg in enumerate(values(run_ranks(_disagree, 4, tmp_path))):
        assert "RINGREDUCE_HIERARCHICAL must be the same on every rank; it is 0 on rank(s) 2 " \
               "only" in msg, f"rank {rank}: {msg}"


# ---------------------------------------------------------------------------------------
# gather, scatter, all-to-all and point-to-point across two hosts of two ranks (whole-group gloo).

def _surface(rank, world, store):
    os.environ["RINGREDUCE_HOST_ID"] = "ab"[rank // 2]
    init(rank, world, store)
    problems = []

    def check(got, want, what):
        if not (got.dtype == want.dtype and torch.equal(got, want)):
            problems.append(f"{what}: got {got.tolist()}, want {want.tolist()}")

    def data(r, n, dtype, salt=0):
        return (torch.arange(n, dtype=torch.int64) * 3 + 100 * r + salt).to(dtype)

    for dtype in (torch.float32, torch.bfloat16, torch.int8, torch.bool, torch.complex64):
        for root in (0, 3):
            mine = data(rank, 5, dtype)
            outs = [torch.zeros(5, dtype=dtype) for _ in range(world)] if rank == root else None
            dist.gather(mine, outs, dst=root)
            if rank == root:
                for r in range(world):
                    check(outs[r], data(r, 5, dtype), f"gather {dtype} root {root} from {r}")
            got = torch.zeros(5, dtype=dtype)
            ins = [data(r, 5, dtype, root) for r in range(world)] if rank == root else None
            dist.scatter(got, ins, src=root)
            check(got, data(rank, 5, dtype, root), f"scatter {dtype} root {root}")

    # Uneven splits: rank r sends (r + q) % 3 rows of 2 to rank q (none at all sometimes).
    rows = [[(r + q) % 3 for q in range(world)] for r in range(world)]
    for dtype in (torch.float64, torch.int16):
        send = torch.cat([data(rank, rows[rank][q] * 2, dtype, 10 * q) for q in range(world)])
        out = torch.full((sum(rows[r][rank] for r in range(world)), 2), -1).to(dtype)
        dist.all_to_all_single(out, send.view(-1, 2), output_split_sizes=[rows[r][rank] for r in
                                                                          range(world)],
                               input_split_sizes=rows[rank])
        want = torch.cat([data(r, rows[r][rank] * 2, dtype, 10 * rank) for r in range(world)])
        check(out.view(-1), want, f"all_to_all_single uneven {dtype}")
    outs = [torch.zeros(3, dtype=torch.int32) for _ in range(world)]
    dist.all_to_all(outs, [data(rank, 3, torch.int32, q) for q in range(world)])
    for r in range(world):
        check(outs[r], data(r, 3, torch.int32, rank), f"all_to_all from {r}")

    # send/recv with tags, across (0 <-> 2) and within (0 <-> 1) hosts: the receiver asks for
    # the tags in the other order than they were sent.
    for a, b in ((0, 2), (0, 1), (3, 1)):
        if rank == a:
            dist.send(data(a, 4, torch.float16, 1), dst=b, tag=1)
            dist.send(data(a, 6, torch.int64, 2), dst=b, tag=2)
        elif rank == b:
            second = torch.zeros(6, dtype=torch.int64)
            first = torch.zeros(4, dtype=torch.float16)
            dist.recv(second, src=a, tag=2)
            dist.recv(first, src=a, tag=1)
            check(first, data(a, 4, torch.float16, 1), f"recv tag 1 from {a}")
            check(second, data(a, 6, torch.int64, 2), f"recv tag 2 from {a}")
    # Both ranks of a pair isend first, then irecv: across hosts (0-3, 1-2).
    peer = world - 1 - rank
    got = torch.zeros(7)
    sent = dist.isend(data(rank, 7, torch.float32, 5), dst=peer, tag=7)
    recvd = dist.irecv(got, src=peer, tag=7)
    sent.wait()
    recvd.wait()
    check(got, data(peer, 7, torch.float32, 5), "isend then irecv")
    # batch_isend_irecv around the ring (crosses hosts at 1->2 and 3->0), non-contiguous recv.
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    buf = torch.zeros(4, 2, dtype=torch.int32)
    ops = [dist.P2POp(dist.isend, data(rank, 4, torch.int32, 9), nxt, tag=3),
           dist.P2POp(dist.irecv, buf[:, 0], prv, tag=3)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    check(buf[:, 0], data(prv, 4, torch.int32, 9), "batch_isend_irecv")
    # recv from any source: rank 0 hears from 1, 2 and 3, each with its own size.
    if rank == 0:
        heard = {}
        for _ in range(world - 1):
            t = torch.zeros(8, dtype=torch.int64)
            w = dist.irecv(t, tag=11)
            w.wait()
            heard[w._source_rank()] = t
        for r in range(1, world):
            check(heard.get(r, torch.zeros(0, dtype=torch.int64)), data(r, 8, torch.int64),
                  f"recv from any source, rank {r}")
    else:
        dist.send(data(rank, 8, torch.int64), dst=0, tag=11)
    dist.all_reduce(torch.ones(3))  # the group still works after all that

    # A receive that never gets its message fails within the (short) timeout, naming the peer.
    short = dist.new_group(backend="ringreduce", timeout=datetime.timedelta(seconds=2))
    timed_out = ""
    if rank == 0:
        start = time.monotonic()
        try:
            dist.recv(torch.zeros(2), src=2, tag=99, group=short)
            timed_out = "no error"
        except RuntimeError as exc:
            timed_out = f"{exc} [{time.monotonic() - start:.1f} s]"
    dist.barrier()
    dist.destroy_process_group()
    return problems, timed_out


def test_two_hosts_gather_scatter_all_to_all_and_p2p(tmp_path):
    out = values(run_ranks(_surface, 4, tmp_path))
    for rank, (problems, _) in enumerate(out):
        assert not problems, f"rank {rank}:\n" + "\n".join(problems)
    msg = out[0][1]
    assert "recv from host 'b' (rank 2) with tag 99" in msg and "timed out" in msg, msg
    print(msg)


GIL_HELD_S = 5.0


def _gil_held(rank, world, store):
    """Rank 0 queues an all-reduce on each of two groups, then a thread of its own holds the GIL
    for GIL_HELD_S (a C call through ctypes.PyDLL, which keeps it); the other ranks join the
    all-reduces a little later, so rank 0's parts of them run while the GIL is held. They need no
    Python there, so the ranks of the other host finish long before the GIL is free again. The
    default group takes 1,000 elements through the hosts' first ranks; the other one
    (RINGREDUCE_XHOST_LEADER_BYTES=0) through every local rank's shard."""
    os.environ["RINGREDUCE_HOST_ID"] = "ab"[rank // 2]
    init(rank, world, store)
    os.environ["RINGREDUCE_XHOST_LEADER_BYTES"] = "0"  # read when the group is made
    shards = dist.new_group(backend="ringreduce")
    del os.environ["RINGREDUCE_XHOST_LEADER_BYTES"]
    groups = (None, shards)
    tensors = [torch.full((1000,), float(rank + 1)) for _ in groups]
    for t, group in zip(tensors, groups):
        dist.all_reduce(t, group=group)  # the inter-host groups are made by now
    dist.barrier()
    start = time.monotonic()
    if rank == 0:
        works = [dist.all_reduce(t, group=group, async_op=True)
                 for t, group in zip(tensors, groups)]
        holder = threading.Thread(target=ctypes.PyDLL(None).usleep,
                                  args=(int(GIL_HELD_S * 1e6),))
        holder.start()
        for work in works:
            work.wait()
        holder.join()
    else:
        time.sleep(0.5)  # rank 0's collectives start first
        for t, group in zip(tensors, groups):
            dist.all_reduce(t, group=group)
    elapsed = time.monotonic() - start
    right = all(torch.equal(t, torch.full((1000,), 4.0 * 10)) for t in tensors)
    dist.barrier()
    dist.destroy_process_group(shards)
    dist.destroy_process_group()
    return elapsed, right


@pytest.mark.timeout(300)
def test_collectives_across_hosts_need_no_python(tmp_path):
    out = values(run_ranks(_gil_held, 4, tmp_path))
    assert all(right for _, right in out), out
    assert out[0][0] >= GIL_HELD_S  # the GIL was held
    for rank in (2, 3):
        assert out[rank][0] < GIL_HELD_S / 2, (
            f"rank {rank} waited {out[rank][0]:.1f} s for rank 0, whose GIL another thread held "
            f"for {GIL_HELD_S} s: a collective needed Python there (through the hosts' first "
            f"ranks or through the shards)")


FAULT_TIMEOUT = 8.0


def _killed_host(rank, world, store):
    # Three hosts, 'c' with two ranks: the shards are large enough for the all-to-all path.
    os.environ["RINGREDUCE_HOST_ID"] = "abcc"[rank]
    init(rank, world, store, timeout=FAULT_TIMEOUT)
    g = torch.Generator().manual_seed(5)
    inputs = random_inputs(world, 120000, torch.float32, "max", generator=g)
    t = inputs[rank].clone()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    exact = torch.equal(t, hierarchical_model(inputs, "max", [[0], [1], [2, 3]]))
    # Partials up to 64 KiB cross three hosts as one all-gather, folded in host order (a, b, c):
    # float sums tell the order.
    for dtype, op in ((torch.float32, "sum"), (torch.bfloat16, "avg")):
        inputs = random_inputs(world, 1000, dtype, op, generator=seeded("three hosts", dtype, op))
        t = inputs[rank].clone()
        dist.all_reduce(t, op=_reduce_op(op))
        exact = exact and torch.equal(t.view(torch.uint8), hierarchical_model(
            inputs, op, [[0], [1], [2, 3]]).view(torch.uint8))
    t = torch.ones(1000)
    if rank >= 2:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)
    start = time.monotonic()
    try:
        dist.all_reduce(t)
        return (exact, "no error", 0.0)
    except RuntimeError as exc:
        return (exact, str(exc), time.monotonic() - start)


def test_killed_host_fails_the_others_naming_it(tmp_path):
    results = run_ranks(_killed_host, 4, tmp_path)
    assert results[2][0] == results[3][0] == "died"
    for rank in (0, 1):
        status, value = results[rank]
        assert status == "ok", value
        exact, msg, elapsed = value
        assert exact, "three hosts (max at 120,000; float32 sum, bfloat16 avg at 1,000): " \
                      "differs from the hierarchical model"
        assert "host 'c'" in msg and "all_reduce" in msg, msg
        assert elapsed < FAULT_TIMEOUT, f"took {elapsed:.1f} s: {msg}"
        print(f"rank {rank} after {elapsed:.2f} s: {msg}")


def _absent_node(rank, world, store):
    os.environ.update(GROUP_RANK=str(rank // 2), LOCAL_WORLD_SIZE="2", WORLD_SIZE=str(world))
    start = time.monotonic()
    try:
        init(rank, world, store, timeout=3.0)
        return ("joined", 0.0)
    except RuntimeError as exc:
        return (str(exc), time.monotonic() - start)


def test_node_that_never_joins_is_named(tmp_path):
    for msg, elapsed in values(run_ranks(_absent_node, 4, tmp_path, start=[0, 1])):
        assert "rank(s) 2, 3 did not join" in msg and "node 1 (GROUP_RANK=1" in msg, msg
        assert elapsed < 3.0 + 5.0


# ---------------------------------------------------------------------------------------
# Two torchrun launchers (--nnodes 2 --nproc_per_node 2), rendezvous on 127.0.0.1.

def test_two_torchrun_launchers(tmp_path):
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [os.path.dirname(HERE), HERE, os.environ.get("PYTHONPATH", "")]))
    env.pop("RINGREDUCE_HOST_ID", None)
    launchers = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2",
         "--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", str(port),
         os.path.join(HERE, "multihost_worker.py"), str(tmp_path)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
        for node in (0, 1)]
    logs = [communicate_bounded(p, 150) for p in launchers]
    assert all(p.returncode == 0 for p in launchers), "\n".join(logs)[-6000:]
    reports = sorted(f.read_text() for f in tmp_path.glob("rank*.txt"))
    assert len(reports) == 4, reports
    assert len(set(reports)) == 1, reports
    assert "problems []\n" in reports[0], reports[0]
