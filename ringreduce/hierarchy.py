"""A ringreduce process group whose ranks span several hosts: the ring inside each host,
torch.distributed's own engines (gloo for CPU tensors, NCCL for CUDA tensors) between hosts.

Host membership comes from the launch: ``RINGREDUCE_HOST_ID`` when set (tests use it to make
several "hosts" on one machine), else torchrun's ``GROUP_RANK`` (one torchrun launcher per
host), else the hostname. Every rank publishes its host through the process group's store.
Hosts are numbered in the order of their lowest rank; inside a host, ranks keep the group's
order ("local ranks" 0, 1, ...). With one host nothing here is used: the group is the
single-host ring it always was, and no inter-host group is created.

All-reduce of S bytes, H hosts, L ranks per host:

1. reduce-scatter inside each host with the ring's executor (shared memory on CPU, CUDA IPC on
   GPUs): local rank j ends with shard j (about S/L bytes) summed over its host;
2. shard j is all-reduced across hosts among the ranks with local index j, one per host, on a
   gloo (CPU) or NCCL (CUDA) group made once, lazily, from the store. Every local rank drives
   its own shard, so every host's NICs carry traffic at once. The host partials are combined
   here, in host order 0, 1, ..., H-1 (in fp32 for 16-bit floats, rounded once), so the result
   does not depend on the engine's algorithm: each member receives every partial (an all-gather,
   shards up to 64 KiB) or its 1/H piece of each (an all-to-all), folds them in host order and,
   in the all-to-all case, all-gathers the finished pieces (the bytes of a ring all-reduce).
   One exception: with two hosts, sum, avg and prod of 32/64-bit types use the engine's own
   all-reduce, whose result is the fold's bit for bit (two operands commute exactly);
3. all-gather inside the host.

The reduction order is therefore fixed by the launch alone (host numbering, local ranks, the
element count): every rank gets the same bits, and the same input gives the same bits on every
call. It is not the single-host ring's order, so results differ from a flat ring in rounding.

Uneven hosts (3 ranks on one, 1 on another): each host cuts the tensor into its own L_h shards
(the ring's 16-byte-aligned chunks). The union of all hosts' cuts splits the tensor into
segments; every segment lies in one shard per host, and its owners (one rank per host) all-reduce
it across hosts. With 3 + 1, the single rank of the small host owns every segment and meets each
of the three ranks of the big host in turn. Every rank handles its segments in increasing offset
order, so the blocking inter-host calls cannot deadlock.

``reduce_scatter`` and ``all_gather`` compose the same way when every host has the same number
of ranks (inter-host all-to-all plus fold, resp. inter-host all-gather, each among the ranks of
one local index); with uneven hosts reduce_scatter is an all-reduce of the whole input (twice
the bytes) and all_gather runs on the inter-host engine for the whole group. ``broadcast`` and
``barrier`` run on the inter-host engine for the whole group; ``reduce`` is an all-reduce.
``gather``, ``scatter`` and ``all_to_all`` (uneven sizes too) run on the whole group's gloo on
byte views (any dtype). Point-to-point runs on that gloo's own send/recv (p2p_start, p2p_wait;
distributed.py posts in the caller's thread and waits in a thread per operation), for peers on
this host too; the whole group's gloo is therefore made with the comm, while every rank is there.

Faults: every inter-host wait is bounded by the group's timeout; while it waits, a rank also
watches a failure key in the store, so a rank failing anywhere stops the others within about
0.2 s. When the engine reports a broken connection, the rank asks the peers involved to answer
through the store (1 s at most, within the timeout): the ones that do not are named, with their
host, as gone.

``RINGREDUCE_HIERARCHICAL=0`` runs one flat ring over every rank instead; that needs the
"hosts" to share /dev/shm, so it is only for comparisons on one machine (bench/ddp.py --hosts).
"""
import contextlib
import datetime
import json
import os
import secrets
import socket
import threading
import time

import torch
import torch.distributed as dist

from . import _env

ENV_HOST_ID = "RINGREDUCE_HOST_ID"
ENV_HIERARCHICAL = "RINGREDUCE_HIERARCHICAL"

# Shards up to this size go across hosts as one all-gather of every member's partial (one engine
# call instead of two; with H hosts it sends H/2 times the bytes of the two). Not tuned: no
# run has had more than two hosts.
SMALL_SHARD_BYTES = 64 << 10
# How long a rank that lost a connection waits for the peers involved to answer.
ROLL_CALL_S = 1.0
POLL_S = 0.05
STORE_POLL_S = 0.2

_HALF = (torch.float16, torch.bfloat16)

__all__ = ["Layout", "discover", "hierarchical_enabled", "host_label", "HierarchicalComm",
           "FlatHostsComm", "inter_host_bytes"]


def host_label():
    """This process's host: RINGREDUCE_HOST_ID, else torchrun's node (GROUP_RANK), else the
    hostname."""
    value = os.environ.get(ENV_HOST_ID, "").strip()
    if value:
        return value
    node = os.environ.get("GROUP_RANK", "").strip()
    if node:
        return f"node{node}@{socket.gethostname()}"
    return socket.gethostname()


def hierarchical_enabled():
    return _env.flag(ENV_HIERARCHICAL)


def _ranks_text(ranks):
    ranks = list(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


class Layout:
    """Which host every rank of a group is on. Hosts are numbered by their lowest rank."""

    def __init__(self, labels, rank, hierarchical):
        self.rank = rank
        self.world_size = len(labels)
        index = {}
        self.hosts = []   # hosts[h]: the ranks on host h, increasing
        self.labels = []  # labels[h]
        for r, label in enumerate(labels):
            if label not in index:
                index[label] = len(self.hosts)
                self.hosts.append([])
                self.labels.append(label)
            self.hosts[index[label]].append(r)
        self.host_of = [index[label] for label in labels]
        self.local_index = [self.hosts[self.host_of[r]].index(r) for r in range(len(labels))]
        self.host = self.host_of[rank]
        self.local_rank = self.local_index[rank]
        self.local_ranks = self.hosts[self.host]
        self.local_size = len(self.local_ranks)
        self.nhosts = len(self.hosts)
        self.even = len({len(h) for h in self.hosts}) == 1
        self.hierarchical = hierarchical and self.nhosts > 1

    def describe(self, h):
        return f"host '{self.labels[h]}' ({_ranks_text(self.hosts[h])})"

    def describe_ranks(self, ranks):
        """"host 'b' (rank 2)" for the hosts of `ranks`, naming only those ranks."""
        by_host = {}
        for r in sorted(ranks):
            by_host.setdefault(self.host_of[r], []).append(r)
        return ", ".join(f"host '{self.labels[h]}' ({_ranks_text(rs)})"
                         for h, rs in sorted(by_host.items()))

    def __repr__(self):
        hosts = "; ".join(self.describe(h) for h in range(self.nhosts))
        return f"Layout({hosts})"


def _torchrun_node_text(missing, world_size):
    """Under torchrun with the same number of ranks per node, node g holds ranks g*L .. g*L+L-1:
    which nodes the missing ranks are on, or '' when that cannot be told."""
    try:
        per_node = int(os.environ["LOCAL_WORLD_SIZE"])
        launched = int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        return ""
    if "GROUP_RANK" not in os.environ or launched != world_size or per_node <= 0 \
            or world_size % per_node:
        return ""
    nodes = sorted({r // per_node for r in missing})
    return "; by torchrun's layout that is " + ", ".join(
        f"node {g} (GROUP_RANK={g}, ranks {g * per_node}-{(g + 1) * per_node - 1})"
        for g in nodes)


def _wait_keys(store, keys, deadline):
    """Waits (until `deadline`, monotonic) for every key; returns the indices of those missing."""
    left = deadline - time.monotonic()
    try:
        store.wait(keys, datetime.timedelta(seconds=max(left, 0.001)))
        return []
    except Exception:  # noqa: BLE001 - the store's timeout error type varies
        missing = [i for i, k in enumerate(keys) if not store.check([k])]
        if not missing:
            raise
        return missing


def discover(store, prefix, rank, world_size, timeout_s):
    """Exchanges every rank's host through the store; returns the group's Layout. Raises a
    RuntimeError naming the ranks (and, under torchrun, the nodes) that did not join within
    the timeout."""
    mine = {"host": host_label(), "hierarchical": hierarchical_enabled()}
    store.set(f"{prefix}/host/{rank}", json.dumps(mine))
    keys = [f"{prefix}/host/{r}" for r in range(world_size)]
    missing = _wait_keys(store, keys, time.monotonic() + timeout_s)
    if missing:
        joined = [json.loads(store.get(k)) for i, k in enumerate(keys) if i not in missing]
        hosts = sorted({j["host"] for j in joined})
        raise RuntimeError(
            f"ringreduce: rank {rank}: rank(s) {', '.join(map(str, missing))} did not join "
            f"within the process group timeout ({timeout_s:.1f} s)"
            f"{_torchrun_node_text(missing, world_size)}; the hosts that joined are "
            f"{', '.join(repr(h) for h in hosts)}")
    info = [json.loads(store.get(k)) for k in keys]
    modes = {j["hierarchical"] for j in info}
    if len(modes) > 1:
        flat = [r for r, j in enumerate(info) if not j["hierarchical"]]
        raise ValueError(f"ringreduce: {ENV_HIERARCHICAL} must be the same on every rank; it is "
                         f"0 on rank(s) {', '.join(map(str, flat))} only")
    return Layout([j["host"] for j in info], rank, modes.pop())


def chunk_elems(count, nranks, esize):
    """The ring's chunk length (csrc/ring/schedule.h): ceil(count / nranks) rounded up to
    16 bytes' worth of elements."""
    align = 1 if esize >= 16 else 16 // esize
    per = -(-count // nranks)
    return -(-per // align) * align


def segments(layout, count, esize):
    """The pieces of a `count`-element tensor that are all-reduced across hosts, in increasing
    offset order: (begin, end, owners), owners[h] the rank of host h whose shard holds it."""
    per = [chunk_elems(count, len(ranks), esize) for ranks in layout.hosts]
    cuts = {0, count}
    for h, ranks in enumerate(layout.hosts):
        cuts.update(min(count, q * per[h]) for q in range(1, len(ranks)))
    cuts = sorted(cuts)
    out = []
    for lo, hi in zip(cuts, cuts[1:]):
        if hi > lo:
            out.append((lo, hi, tuple(ranks[lo // per[h]]
                                      for h, ranks in enumerate(layout.hosts))))
    return out


_BITWISE = {"band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}
# Types whose two-operand sum and product the inter-host engine computes exactly as the fold.
_ENGINE_TYPES = (torch.float32, torch.float64, torch.int32, torch.int64)


def _combine(acc, x, op):
    """acc = op(acc, x) in the arithmetic type; NaN propagates through max and min as in the
    ring (tests/reference.py). On bool, + is logical or and * logical and, as in torch."""
    if op in _BITWISE:
        return _BITWISE[op](acc, x, out=acc)
    if op in ("sum", "avg"):
        return acc.add_(x)
    if op == "prod":
        return acc.mul_(x)
    if not acc.is_floating_point():
        return torch.maximum(acc, x, out=acc) if op == "max" else torch.minimum(acc, x, out=acc)
    better = (x > acc) if op == "max" else (x < acc)
    return torch.where(torch.isnan(acc) | ~(better | torch.isnan(x)), acc, x)


def fold(rows, op, nranks, out):
    """Combines rows[0], rows[1], ... in that order into `out` (fp32 for 16-bit floats, rounded
    once at the end; avg divides the total by `nranks`)."""
    if out.dtype in _HALF:
        acc = rows[0].float()
    else:
        acc = out
        acc.copy_(rows[0])
    for row in rows[1:]:
        acc = _combine(acc, row.to(acc.dtype), op)
    if op == "avg":
        if acc.is_floating_point():
            acc.div_(nranks)
        else:  # NCCL's integer average: the wrapped sum divided toward zero
            acc.copy_(torch.div(acc, nranks, rounding_mode="trunc"))
    if acc is not out:
        out.copy_(acc)


class _Stop(RuntimeError):
    """An inter-host wait ended without the engine's error (timeout, failure elsewhere)."""


class _Unusable(RuntimeError):
    """A collective on a group that had already failed."""


class HierarchicalComm:
    """The executor of a ringreduce group (distributed.comm_of) when the group spans several hosts: the
    same methods as the single-host `_dist_C.Comm` (check, all_reduce, reduce_scatter,
    all_gather, broadcast, barrier, gather, scatter, all_to_all, fail, abort, close,
    set_timeout, closed; point-to-point through p2p_start/p2p_wait instead of the
    shared-memory p2p_post/p2p_progress), composed from a
    `Comm` over this host's ranks and torch's engines between hosts. Runs in the group's
    progress thread; abort() and fail() may come from any thread."""

    def __init__(self, store, prefix, layout, capacity, timeout_s, cuda_capacity):
        from . import _dist_C

        self.layout = layout
        self.stats = {"inter_host_bytes": 0}
        self._store = store
        self._prefix = f"{prefix}/xhost"
        self._timeout_s = timeout_s
        self._failed = None
        self._fail_lock = threading.Lock()
        self._groups = {}
        self._seq = 0
        self._ctx = ""
        self._deadline = 0.0
        h, j = layout.host, layout.local_rank
        # The host index is part of every segment name and of the store keys they go through:
        # a rank only ever learns, and so only ever opens, its own host's segments.
        tag = f"{os.getpid()}-{secrets.token_hex(4)}-h{h}"
        self._local = _dist_C.Comm(j, layout.local_size, capacity, timeout_s, tag, cuda_capacity)
        try:
            deadline = time.monotonic() + timeout_s
            hp = f"{prefix}/host{h}"
            store.set(f"{hp}/name/{j}", self._local.name)
            self._local_keys(f"{hp}/name", deadline, "join")
            names = [store.get(f"{hp}/name/{q}").decode() for q in range(layout.local_size)]
            self._local.attach(names)
            store.set(f"{hp}/mapped/{j}", "1")
            self._local_keys(f"{hp}/mapped", deadline, "map the shared memory")
        except BaseException:
            self._local.close()
            raise
        self._local.unlink()
        # The whole group's gloo is made now, while every rank is here: point-to-point uses it
        # from any thread, and a rank that only sends must not wait for the others to make it.
        self._everyone = tuple(range(layout.world_size))
        try:
            self._group(self._everyone, False)
        except BaseException:
            self.close()
            raise

    def _local_keys(self, prefix, deadline, what):
        keys = [f"{prefix}/{q}" for q in range(self.layout.local_size)]
        missing = _wait_keys(self._store, keys, deadline)
        if missing:
            ranks = [self.layout.local_ranks[q] for q in missing]
            raise RuntimeError(
                f"ringreduce: rank {self.layout.rank}: {self.layout.describe_ranks(ranks)} did "
                f"not {what} within the process group timeout ({self._timeout_s:.1f} s)")

    # ---- the Comm interface ------------------------------------------------------------

    @property
    def closed(self):
        return self._local.closed

    def check(self, tensor, op, fn, arg):
        self._local.check(tensor, op, fn, arg)

    def set_timeout(self, seconds):
        self._local.set_timeout(seconds)
        self._timeout_s = seconds
        for group in self._groups.values():
            group._set_default_timeout(datetime.timedelta(seconds=seconds))

    def fail(self, message):
        """Marks the group failed (first message wins) and tells the other hosts through the
        store, so their inter-host waits stop at once. Safe from any thread."""
        with self._fail_lock:
            first = self._failed is None
            if first:
                self._failed = message
        self._local.fail(message)
        if first:
            lay = self.layout
            try:
                self._store.set(f"{self._prefix}/failed",
                                f"rank {lay.rank} on host '{lay.labels[lay.host]}': {message}")
                self._store.set(f"{self._prefix}/answer/{lay.rank}", "1")
            except Exception:  # noqa: BLE001 - the store may be gone with its host
                pass

    def abort(self):
        self.fail(f"ringreduce: the process group was aborted on rank {self.layout.rank} "
                  "(ProcessGroup.abort)")

    def close(self):
        self._local.close()
        groups, self._groups = self._groups, {}
        for group in groups.values():
            try:
                group.shutdown()
            except RuntimeError:
                pass

    def __getattr__(self, name):
        raise AttributeError(
            f"ringreduce: '{name}' is not available on a process group that spans several "
            "hosts (all_reduce, reduce_scatter, all_gather, broadcast, reduce, barrier, gather, "
            "scatter, all_to_all and point-to-point are)")

    def all_reduce(self, tensor, op):
        with self._collective("all_reduce"):
            self._all_reduce(tensor.view(-1), op)

    def reduce_scatter(self, out, flat_in, op):
        with self._collective("reduce_scatter"):
            lay = self.layout
            m = out.numel()
            if not lay.even:
                full = flat_in.clone()
                self._all_reduce(full, op)
                out.view(-1).copy_(full[lay.rank * m:(lay.rank + 1) * m])
                return
            nh, nl = lay.nhosts, lay.local_size
            # Local rank q's part: the blocks of the ranks with local index q, in host order.
            order = [lay.hosts[h][q] for q in range(nl) for h in range(nh)]
            grouped = flat_in.view(lay.world_size, m)[order].view(-1)
            partial = torch.empty(nh * m, dtype=out.dtype, device=out.device)
            self._local_call("reduce_scatter", partial, grouped, "sum" if op == "avg" else op)
            members = tuple(ranks[lay.local_rank] for ranks in lay.hosts)
            recv = torch.empty_like(partial)
            self._xhost(members, partial, "reduce_scatter", lambda g: g.alltoall_base(
                recv, partial, [], [], dist.AllToAllOptions()))
            fold(recv.view(nh, m), op, lay.world_size, out.view(-1))

    def all_gather(self, outs, inp):
        with self._collective("all_gather"):
            lay = self.layout
            src = _bytes(inp)
            if not lay.even:
                dst = [torch.empty_like(src) for _ in range(lay.world_size)]
                self._xhost(tuple(range(lay.world_size)), src, "all_gather",
                            lambda g: g.allgather([dst], [src]))
                for o, d in zip(outs, dst):
                    _bytes(o).copy_(d)
                return
            nh, nl, b = lay.nhosts, lay.local_size, src.numel()
            members = tuple(ranks[lay.local_rank] for ranks in lay.hosts)
            across = torch.empty(nh * b, dtype=torch.uint8, device=src.device)
            self._xhost_all_gather(members, src, across, "all_gather")
            every = torch.empty(nl * nh * b, dtype=torch.uint8, device=src.device)
            parts = list(every.view(nl, nh * b))
            self._local_call("all_gather", parts, across)
            blocks = every.view(nl, nh, b)
            for q in range(nl):
                for h in range(nh):
                    _bytes(outs[lay.hosts[h][q]]).copy_(blocks[q, h])

    def broadcast(self, tensor, root):
        with self._collective("broadcast"):
            data = _bytes(tensor)
            opts = dist.BroadcastOptions()
            opts.rootRank = root
            self._xhost(tuple(range(self.layout.world_size)), data, "broadcast",
                        lambda g: g.broadcast([data], opts))

    def barrier(self):
        with self._collective("barrier"):
            self._xhost(tuple(range(self.layout.world_size)), None, "barrier",
                        lambda g: g.barrier())

    # gather, scatter and all-to-all: the whole group's gloo on byte views (any dtype); the
    # tensors are contiguous CPU tensors (distributed.py stages the others).

    def gather(self, outs, inp, root):
        with self._collective("gather"):
            src = _bytes(inp)
            dst = [_bytes(o) for o in outs]
            opts = dist.GatherOptions()
            opts.rootRank = root
            self._xhost(self._everyone, src, "gather",
                        lambda g: g.gather([dst] if dst else [], [src], opts))

    def scatter(self, out, ins, root):
        with self._collective("scatter"):
            dst = _bytes(out)
            src = [_bytes(t) for t in ins]
            opts = dist.ScatterOptions()
            opts.rootRank = root
            self._xhost(self._everyone, dst, "scatter",
                        lambda g: g.scatter([dst], [src] if src else [], opts))

    def all_to_all(self, outs, ins):
        """outs[r] receives ins[self] of rank r; sizes may differ per rank."""
        with self._collective("all_to_all"):
            send = torch.cat([_bytes(t) for t in ins])
            recv = torch.empty(sum(o.numel() * o.element_size() for o in outs),
                               dtype=torch.uint8)
            out_splits = [o.numel() * o.element_size() for o in outs]
            in_splits = [t.numel() * t.element_size() for t in ins]
            self._xhost(self._everyone, send, "all_to_all", lambda g: g.alltoall_base(
                recv, send, out_splits, in_splits, dist.AllToAllOptions()))
            for o, part in zip(outs, recv.split(out_splits)):
                _bytes(o).copy_(part)

    # Point-to-point: gloo's own send/recv on the whole group, posted by the caller's thread (so
    # messages match per (peer, tag) in issue order) and waited for by one thread per operation
    # (distributed.py). gloo bounds each wait by the group's timeout; a wait cannot be cut short
    # and resumed (gloo closes the connection), so it is not also watched through the store.

    def p2p_start(self, send, tensor, peer, tag):
        """Posts a send to `peer`, or a receive from `peer` (None: from any rank), of the
        contiguous CPU tensor's bytes with `tag`; returns gloo's Work."""
        lay = self.layout
        if self._failed is not None:
            raise _Unusable(f"ringreduce: {'send' if send else 'recv'} on rank {lay.rank}: this "
                            f"process group failed earlier and cannot be used any more: "
                            f"{self._failed}")
        group = self._group(self._everyone, False)
        data = [_bytes(tensor)]
        self.stats["inter_host_bytes"] += data[0].numel() if send else 0
        if send:
            return group.send(data, peer, tag)
        if peer is None:
            return group.recv_anysource(data, tag)
        return group.recv(data, peer, tag)

    def p2p_wait(self, work, send, peer, tag):
        """Waits for an operation of p2p_start; returns the peer (for a receive from any rank,
        the sender). Failures name the peer and its host."""
        lay = self.layout
        try:
            if not work.wait():
                raise RuntimeError("aborted")
        except RuntimeError as exc:
            detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if send:
                what = f"send to {lay.describe_ranks([peer])}"
            elif peer is None:
                what = "recvAnySource (a recv from any rank)"
            else:
                what = f"recv from {lay.describe_ranks([peer])}"
            state = (f"timed out after {self._timeout_s:.1f} s" if "Timed out" in detail
                     else "failed")
            raise RuntimeError(f"ringreduce: {what} with tag {tag} on rank {lay.rank} (host "
                               f"'{lay.labels[lay.host]}') {state}: {detail}") from exc
        return work._source_rank() if peer is None else peer

    # ---- the three phases --------------------------------------------------------------

    def _all_reduce(self, flat, op):
        lay = self.layout
        n, nl, j = flat.numel(), lay.local_size, lay.local_rank
        per = chunk_elems(n, nl, flat.element_size())
        buf = flat
        if per * nl != n:
            buf = torch.empty(per * nl, dtype=flat.dtype, device=flat.device)
            buf[:n].copy_(flat)
            buf[n:].zero_()
        mine = buf[j * per:(j + 1) * per]
        if nl > 1:
            # In place: this rank's segment of the input is the output.
            self._local_call("reduce_scatter", mine, buf, "sum" if op == "avg" else op)
        for lo, hi, owners in segments(lay, n, flat.element_size()):
            if owners[lay.host] == lay.rank:
                self._xhost_all_reduce(buf[lo:hi], op, owners)
        if nl > 1:
            self._local_call("all_gather", list(buf.view(nl, per)), mine)
        if buf is not flat:
            flat.copy_(buf[:n])

    def _xhost_all_reduce(self, x, op, members):
        nh, world = len(members), self.layout.world_size
        if nh == 2 and op in ("sum", "avg", "prod") and x.dtype in _ENGINE_TYPES:
            # Two operands commute bit for bit (IEEE and wrapping integer + and *), so the
            # engine's own all-reduce gives exactly the host-order fold's bits, in one call and
            # without a separate fold pass.
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.PRODUCT if op == "prod" else dist.ReduceOp.SUM
            self._xhost(members, x, "all_reduce", lambda g: g.allreduce([x], opts))
            if op == "avg":
                if x.is_floating_point():
                    x.div_(world)
                else:
                    x.copy_(torch.div(x, world, rounding_mode="trunc"))
            return
        if x.numel() * x.element_size() <= SMALL_SHARD_BYTES:
            rows = torch.empty(nh * x.numel(), dtype=x.dtype, device=x.device)
            self._xhost(members, x, "all_reduce", lambda g: g._allgather_base(rows, x))
            fold(rows.view(nh, x.numel()), op, world, x)
            return
        # Reduce-scatter as an all-to-all (member h gets piece h of every partial) and a fold,
        # then an all-gather of the finished pieces: the bytes of a ring all-reduce.
        p = chunk_elems(x.numel(), nh, x.element_size())
        pieces = x
        if p * nh != x.numel():
            pieces = torch.zeros(p * nh, dtype=x.dtype, device=x.device)
            pieces[:x.numel()].copy_(x)
        recv = torch.empty_like(pieces)
        self._xhost(members, pieces, "all_reduce", lambda g: g.alltoall_base(
            recv, pieces, [], [], dist.AllToAllOptions()))
        done = torch.empty(p, dtype=x.dtype, device=x.device)
        fold(recv.view(nh, p), op, world, done)
        self._xhost_all_gather(members, done, recv, "all_reduce", send=pieces)
        x.copy_(recv[:x.numel()])

    def _xhost_all_gather(self, members, src, dst, what, send=None):
        """dst = every member's src, in member order. Large ones go as an all-to-all whose every
        slot holds src (`send`: a scratch buffer of len(members) x src, else allocated): gloo's
        all-gather was 1.5-2.5x slower than its all-to-all sending the same bytes per rank
        (1-16 MiB, two ranks, bench/gloo_exchange.py on the 2-core CI VM; bench/RESULTS.md)."""
        nh = len(members)
        if src.numel() * src.element_size() <= SMALL_SHARD_BYTES:
            self._xhost(members, src, what, lambda g: g._allgather_base(dst, src))
            return
        if send is None:
            send = torch.empty_like(dst)
        send.view(nh, -1).copy_(src.view(1, -1).expand(nh, -1))
        self._xhost(members, send, what, lambda g: g.alltoall_base(
            dst, send, [], [], dist.AllToAllOptions()))

    # ---- plumbing ----------------------------------------------------------------------

    @contextlib.contextmanager
    def _collective(self, kind):
        """Numbers the collective, sets its deadline; any failure in it fails the group."""
        self._seq += 1
        lay = self.layout
        self._ctx = f"{kind} #{self._seq} on rank {lay.rank} (host '{lay.labels[lay.host]}')"
        self._deadline = time.monotonic() + self._timeout_s
        if self._failed is not None:
            raise _Unusable(f"ringreduce: {self._ctx}: this process group failed earlier and "
                            f"cannot be used any more: {self._failed}")
        try:
            yield
        except RuntimeError as exc:
            self.fail(str(exc))
            raise

    def _local_call(self, name, *args):
        """One collective of this host's ring; its messages number ranks locally, so they
        are given the group's numbering."""
        try:
            getattr(self._local, name)(*args)
        except RuntimeError as exc:
            lay = self.layout
            ranks = ", ".join(f"local rank {q} = rank {r}" for q, r in enumerate(lay.local_ranks))
            raise RuntimeError(f"ringreduce: {self._ctx}: inside the host ({ranks}): "
                               f"{exc}") from exc

    def _group(self, members, cuda):
        key = (members, cuda)
        group = self._groups.get(key)
        if group is None:
            name = ("nccl/" if cuda else "gloo/") + "-".join(map(str, members))
            store = dist.PrefixStore(f"{self._prefix}/{name}/", self._store)
            timeout = datetime.timedelta(seconds=self._timeout_s)
            idx = members.index(self.layout.rank)
            if cuda:
                # Not run here (no GPU in CI); made like torch's own new_group(backend="nccl").
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                group = dist.ProcessGroupNCCL(store, idx, len(members), opts)
            else:
                group = dist.ProcessGroupGloo(store, idx, len(members), timeout)
            self._groups[key] = group
        return group

    def _xhost(self, members, tensor, what, call):
        """Runs call(group) on the inter-host group of `members` and waits for it, bounded by
        the collective's deadline; failures name the hosts."""
        cuda = tensor is not None and tensor.is_cuda
        if tensor is not None:
            self.stats["inter_host_bytes"] += tensor.numel() * tensor.element_size()
        try:
            work = call(self._group(members, cuda))
            if cuda:
                work.wait()  # the caller's stream waits; NCCL's watchdog bounds it
                return
            done = threading.Event()
            work.get_future().add_done_callback(lambda _f: done.set())
            self._wait(done, members, what)
            work.wait()
        except _Stop:
            raise
        except RuntimeError as exc:
            raise self._peer_error(members, what, exc) from exc

    def _wait(self, done, members, what):
        next_store_check = time.monotonic() + STORE_POLL_S
        while not done.wait(POLL_S):
            if self._failed is not None:
                raise _Stop(f"ringreduce: {self._ctx} stopped waiting for the inter-host "
                                   f"{what}: this rank's process group failed: {self._failed}")
            now = time.monotonic()
            if now >= self._deadline:
                others = [r for r in members if r != self.layout.rank]
                raise _Stop(
                    f"ringreduce: {self._ctx} timed out after {self._timeout_s:.1f} s in the "
                    f"inter-host {what} with {self.layout.describe_ranks(others)}")
            if now >= next_store_check:
                next_store_check = now + STORE_POLL_S
                report = self._failure_report()
                if report is not None:
                    raise _Stop(f"ringreduce: {self._ctx} stopped waiting for the "
                                       f"inter-host {what}: {report}")

    def _failure_report(self):
        key = f"{self._prefix}/failed"
        try:
            if self._store.check([key]):
                return self._store.get(key).decode()
        except Exception:  # noqa: BLE001 - a store that is gone tells nothing
            return None
        return None

    def _peer_error(self, members, what, exc):
        """The engine failed (a broken connection, its timeout): says which peers are gone.
        The peers that are alive answer through the store as soon as they fail themselves."""
        lay = self.layout
        others = [r for r in members if r != lay.rank]
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        try:
            self._store.set(f"{self._prefix}/answer/{lay.rank}", "1")
            keys = [f"{self._prefix}/answer/{r}" for r in others]
            gone = [others[i] for i in _wait_keys(
                self._store, keys, min(time.monotonic() + ROLL_CALL_S, self._deadline))]
        except Exception:  # noqa: BLE001 - the store itself may have gone with its host
            gone = []
        if gone:
            return RuntimeError(
                f"ringreduce: {self._ctx}: {lay.describe_ranks(gone)} is gone (no answer after "
                f"the inter-host {what} broke): {detail}")
        report = self._failure_report()
        cause = f"; {report}" if report else ""
        return RuntimeError(f"ringreduce: {self._ctx}: the inter-host {what} with "
                            f"{lay.describe_ranks(others)} failed: {detail}{cause}")


def _bytes(t):
    return t.reshape(-1).view(torch.uint8)


class FlatHostsComm:
    """RINGREDUCE_HIERARCHICAL=0 on several hosts sharing memory: the flat ring over every
    rank, counting the bytes of its hops that cross a host boundary (what bench/ddp.py
    compares with the hierarchical path). Everything else is the wrapped Comm's."""

    def __init__(self, comm, layout):
        self._comm = comm
        self.layout = layout
        self.stats = {"inter_host_bytes": 0}

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def all_reduce(self, tensor, op):
        self._comm.all_reduce(tensor, op)
        lay = self.layout
        n, world = tensor.numel(), lay.world_size
        succ = (lay.rank + 1) % world
        if lay.host_of[succ] != lay.host:
            # The successor reads every chunk but its own in the reduce-scatter and every
            # chunk but the next one's in the all-gather (csrc/ring/schedule.h).
            per = chunk_elems(n, world, tensor.element_size())
            size = [max(0, min(n, (c + 1) * per) - min(n, c * per)) for c in range(world)]
            elems = 2 * n - size[succ] - size[(succ + 1) % world]
            self.stats["inter_host_bytes"] += elems * tensor.element_size()


def inter_host_bytes(group):
    """Bytes this rank has handed to the inter-host engine (hierarchical), or sent over ring
    hops that cross a host boundary (RINGREDUCE_HIERARCHICAL=0); None on one host."""
    from .distributed import comm_of

    stats = getattr(comm_of(group), "stats", None)
    return None if stats is None else stats["inter_host_bytes"]
