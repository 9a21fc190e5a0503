"""Several hosts: which rank is on which host, and how the inter-host groups are made. The
schedule itself (the ring inside each host, torch's gloo/NCCL between hosts, the fold in host
order, faults) is C++: csrc/multiprocess/xhost.h, run by the backend with no Python in between.

Host membership comes from the launch: ``RINGREDUCE_HOST_ID`` when set (tests use it to make
several "hosts" on one machine), else torchrun's ``GROUP_RANK`` (one torchrun launcher per
host), else the hostname. Every rank publishes its host through the process group's store.
Hosts are numbered in the order of their lowest rank; inside a host, ranks keep the group's
order ("local ranks" 0, 1, ...). With one host nothing here is used beyond discovery: the group
is the single-host ring it always was, and no inter-host group is created.

The inter-host groups are torch's own ProcessGroupGloo (CPU tensors) and ProcessGroupNCCL (CUDA
tensors), made from the group's store by :func:`group_factory`: the whole group's gloo and (when
every host has as many ranks) the gloo of each rank's local index when the group is made; the
others (uneven hosts' pairings, NCCL) once, on first use. The collectives call them from C++.

``RINGREDUCE_HIERARCHICAL=0`` runs one flat ring over every rank instead; that needs the
"hosts" to share /dev/shm, so it is only for comparisons on one machine (bench/ddp.py --hosts).
"""
import datetime
import json
import os
import socket
import time

import torch.distributed as dist

from . import _env

ENV_HOST_ID = "RINGREDUCE_HOST_ID"
ENV_HIERARCHICAL = "RINGREDUCE_HIERARCHICAL"

__all__ = ["Layout", "discover", "hierarchical_enabled", "host_label", "segments",
           "group_factory"]


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


def wait_keys(store, keys, deadline):
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
    missing = wait_keys(store, keys, time.monotonic() + timeout_s)
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


def segments(layout, count, esize):
    """The pieces of a `count`-element tensor (elements of `esize` bytes) that the group
    all-reduces across hosts, in increasing offset order: (begin, end, owners), owners[h] the
    rank of host h whose shard (its host's ring chunk) holds it. Every host cuts the tensor into
    its own ring chunks; the union of the cuts gives the segments (the C++ schedule's own
    function, xhost.h)."""
    from . import _dist_C

    return _dist_C.xhost_segments(layout.hosts, count, esize)


def group_factory(store, prefix, layout, timeout_s):
    """What makes the inter-host group of `members` (a tuple of group ranks, one per host) for
    CPU (torch's ProcessGroupGloo) or CUDA (ProcessGroupNCCL) tensors, over its own prefix of
    the group's store, as torch's new_group makes them. The C++ transport calls it once per
    members and device type."""

    def make(members, cuda):
        name = ("nccl/" if cuda else "gloo/") + "-".join(map(str, members))
        sub = dist.PrefixStore(f"{prefix}/{name}/", store)
        timeout = datetime.timedelta(seconds=timeout_s)
        idx = members.index(layout.rank)
        if cuda:
            # Not run here (no GPU in CI); made like torch's own new_group(backend="nccl").
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            return dist.ProcessGroupNCCL(sub, idx, len(members), opts)
        return dist.ProcessGroupGloo(sub, idx, len(members), timeout)

    return make
