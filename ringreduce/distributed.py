"""ringreduce as a ``torch.distributed`` backend named ``"ringreduce"``.

After ``import ringreduce`` (which calls :func:`register_backend`)::

    dist.init_process_group("ringreduce", ...)                 # cpu and cuda tensors
    dist.init_process_group("cpu:gloo,cuda:ringreduce", ...)   # accepted too, see below

and ``dist.all_reduce``, ``broadcast``, ``all_gather`` (list, ``all_gather_into_tensor``),
``reduce_scatter`` (list, ``reduce_scatter_tensor``), ``reduce``, ``barrier``, ``gather``,
``scatter``, ``all_to_all``, ``all_to_all_single`` (equal or uneven splits), ``send``/``recv``,
``isend``/``irecv``, ``recv`` from any source, ``batch_isend_irecv``, the object collectives,
``torch.distributed.checkpoint`` and ``DistributedDataParallel`` run on it unchanged
(``monitored_barrier`` is gloo's only: torch refuses it on other backends).

How it works: one process per rank, all on one host. Each rank creates a POSIX shared-memory
segment, the names go through the process group's store, every rank maps every peer's
segment and each rank unlinks its own as soon as all have mapped it (nothing stays in
/dev/shm). CPU tensors are staged through those segments and run the same ring schedule as
``ringreduce.all_reduce``, so results are bitwise equal to it and identical on every rank.
CUDA tensors are copied through a persistent device staging area per rank, shared once through
CUDA IPC, and synchronised with IPC events ordered by a host-side handshake (see
csrc/multiprocess/cuda_collectives.h); several ranks may share one GPU.
Ranks on several hosts: this ring runs inside each host and torch's gloo/NCCL between hosts,
composed in C++ (csrc/multiprocess/xhost.h; ringreduce/hierarchy.py finds the hosts).

Every wait on another rank is bounded by the group's ``timeout``: a rank that died, failed or
never joined makes the others raise a ``RuntimeError`` naming the collective, the peer and the
step. A failed group cannot be used again (like NCCL after an error); destroy it.

Execution model (ProcessGroupNCCL's; csrc/multiprocess/backend.h): the backend is a C++
``c10d::Backend``, so nothing between ``dist.all_reduce`` and the bytes runs Python or takes
the GIL. Every collective is validated in the calling thread (bad arguments raise there, before
anything is touched), then queued; one C++ progress thread per group runs the queue in issue
order, and the call returns its ``Work`` at once. A synchronous call (``async_op=False``)
whose collective is next anyway runs in the calling thread. On CPU, ``Work.wait()`` blocks
until the collective is done. On CUDA the collective runs on an internal stream per group and
device, ordered after the caller's current stream by an event recorded at issue time, and
``Work.wait()`` makes the caller's current stream wait for the collective's end event.
Futures (``Work.get_future()``) are completed on threads that never run collectives, so a
callback may issue a collective and wait for it (torch's PowerSGD hook does).
``RINGREDUCE_ASYNC=0`` runs every collective inline in the calling thread (on CUDA, on the
caller's stream): the behaviour before the engine, kept for comparison and debugging.

Point-to-point (send, recv, isend, irecv, recv from any source) runs on a second C++ thread per
group, started by the rank's first such call (csrc/multiprocess/p2p.h): per-pair rings in the
shared segments, messages matched per (sender, tag) in send order, sends complete once their
bytes are in the ring, and no operation waits behind a collective or another operation.
gather, scatter, all-to-all and point-to-point stage CUDA tensors through host memory.
On a group that spans several hosts, the same C++ engine runs the hierarchical schedule
(csrc/multiprocess/xhost.h: this ring inside each host, torch's gloo/NCCL between hosts, called
from C++); gather, scatter and all-to-all run on the whole group's gloo, and point-to-point on
its send/recv.

``destroy_process_group`` and ``abort()`` end the group's threads within bounded time, and so
does the interpreter's exit for groups the program never destroyed (an atexit hook).

With ``"cpu:gloo,cuda:ringreduce"`` torch binds ringreduce to CUDA tensors and gloo to CPU
tensors, as with any C++ backend.

Knobs (environment): ``RINGREDUCE_SHM_BYTES``, the shared-memory staging area per rank for CPU
tensors (default 4 MiB; larger tensors go in rounds); ``RINGREDUCE_CUDA_BUFFER_BYTES``, the
device staging area per rank for CUDA tensors (default 32 MiB, allocated at the first CUDA
collective; larger tensors go in rounds); ``RINGREDUCE_ASYNC`` (default 1);
``RINGREDUCE_CALLER_RUNS`` (default 1; 0: synchronous CPU collectives run on the progress
thread too, as CUDA collectives always do).
"""
import atexit
import datetime
import os
import secrets
import sys
import time

import torch
import torch.distributed as dist

from . import _env, hierarchy

BACKEND_NAME = "ringreduce"
DEFAULT_SHM_BYTES = 4 << 20
DEFAULT_CUDA_BUFFER_BYTES = 32 << 20

SUPPORTED_COLLECTIVES = (
    "all_reduce", "all_reduce_coalesced", "broadcast", "all_gather", "all_gather_into_tensor",
    "all_gather_coalesced", "reduce_scatter", "reduce_scatter_tensor", "reduce", "barrier",
    "gather", "scatter", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv",
    "recv_anysource", "batch_isend_irecv",
)

__all__ = ["register_backend", "backend_of", "comm_of", "inter_host_bytes", "BACKEND_NAME",
           "SUPPORTED_COLLECTIVES"]

# Seconds a group left alive at interpreter exit gives its queued work before its threads end.
EXIT_GRACE_S = 2.0


def register_backend():
    """Registers the ``"ringreduce"`` backend (devices cpu and cuda) with torch.distributed.

    Idempotent. Returns True when the backend is registered, False when this torch has no
    distributed support (then nothing happens); never raises for that.
    """
    if not dist.is_available():
        return False
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return True
    dist.Backend.register_backend(BACKEND_NAME, _create_backend_from_options, extended_api=True,
                                  devices=["cpu", "cuda"])
    _keep_shrunk_backend_type()
    atexit.register(_shutdown_at_exit)
    return True


def _keep_shrunk_backend_type():
    """dist.shrink_group registers the shrunk group's backend as torch's NCCL (bound to a CUDA
    device) or GLOO (otherwise), whatever backend it is. torch then treats a ringreduce
    backend as ProcessGroupGloo: DDP's logger casts it so and crashes (SIGSEGV, torch 2.14.1).
    Registered as CUSTOM, the type torch gives every plugin backend, it is ringreduce's again."""
    c10d = dist.distributed_c10d
    create = getattr(c10d, "_create_shrunk_process_group", None)
    if create is None or getattr(create, "_ringreduce", False):
        return

    def create_shrunk_process_group(new_backend, *args, **kwargs):
        pg = create(new_backend, *args, **kwargs)
        if new_backend.name() == BACKEND_NAME:
            custom = dist.ProcessGroup.BackendType.CUSTOM
            device = pg.bound_device_id or torch.device("cpu")
            pg._register_backend(device, custom, new_backend)
            pg._set_default_backend(custom)
        return pg

    create_shrunk_process_group._ringreduce = True
    c10d._create_shrunk_process_group = create_shrunk_process_group


def _shutdown_at_exit():
    # Only where the backend's extension was loaded: at exit, nothing is compiled or loaded.
    _dist_C = sys.modules.get(__package__ + "._dist_C")
    if _dist_C is not None:
        _dist_C.shutdown_all(EXIT_GRACE_S)


def backend_of(group=None):
    """The ringreduce ``Backend`` (C++) of `group` (default: the world): its ``comm`` is the
    executor object, ``failed``/``failure`` its state."""
    group = dist.group.WORLD if group is None else group
    for device in ("cpu", "cuda"):
        try:
            backend = group._get_backend(torch.device(device))
        except RuntimeError:
            continue
        if backend.name() == BACKEND_NAME:
            return backend
    raise ValueError(f"ringreduce: {group!r} has no ringreduce backend")


def comm_of(group=None):
    """The executor behind `group`'s ringreduce backend: a ``_dist_C.Comm`` on one host (or one
    ring over hosts that share memory, RINGREDUCE_HIERARCHICAL=0), a
    ``_dist_C.HierarchicalComm`` across hosts."""
    return backend_of(group).comm


def inter_host_bytes(group=None):
    """Bytes this rank has handed to the inter-host engines (several hosts), or sent over ring
    hops that cross a host boundary (RINGREDUCE_HIERARCHICAL=0); None on one host."""
    return backend_of(group).inter_host_bytes


def _shm_bytes():
    return _bytes_knob("RINGREDUCE_SHM_BYTES", DEFAULT_SHM_BYTES)


def _cuda_buffer_bytes():
    return _bytes_knob("RINGREDUCE_CUDA_BUFFER_BYTES", DEFAULT_CUDA_BUFFER_BYTES)


def _bytes_knob(name, default):
    raw = os.environ.get(name, "")
    if not raw.strip():
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number of bytes; got {raw!r}") from None
    if value < 4096:
        raise ValueError(f"{name} must be at least 4096; got {value}")
    return (value + 4095) // 4096 * 4096


def _seconds(timeout):
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return float(timeout)


class _Options(torch._C._distributed_c10d.Backend.Options):
    """A ringreduce group's options (backend name, timeout) as torch's Backend.Options, which
    dist.split_group deep-copies from the parent backend (torch's own Options cannot be
    copied: it does not pickle)."""

    def __deepcopy__(self, memo):
        return _Options(self.backend, self._timeout)


def _backend_options(backend):
    return _Options(BACKEND_NAME, backend.timeout)


def _extend(ext):
    """What Python reads off the extension's classes besides their C++ interface: a backend's
    ``options`` (torch: dist.split_group copies it for the child group) and a HierarchicalComm's
    ``layout`` (tests, benchmarks). Idempotent."""
    if not isinstance(getattr(ext.Backend, "options", None), property):
        ext.Backend.options = property(_backend_options, doc=(
            "The group's torch Backend.Options (backend name and timeout)."))
    if not isinstance(getattr(ext.HierarchicalComm, "layout", None), property):
        ext.HierarchicalComm.layout = property(
            lambda comm: hierarchy.Layout(comm.rank_labels, comm.rank, True),
            doc="Which host every rank of the group is on (hierarchy.Layout).")


def _create_backend_from_options(opts, backend_options=None):
    """torch's call of a plugin registered with extended_api: the group's global ranks come
    along (the flight recorder names them; the default group's list is empty: all ranks)."""
    return _create_backend(opts.store, opts.group_rank, opts.group_size, opts.timeout,
                           global_ranks=list(opts.global_ranks_in_group))


def _create_backend(store, rank, world_size, timeout, global_ranks=None):
    """The rendezvous (in Python: it runs once), then the C++ backend over its executor.
    `global_ranks`: the members' global ranks (None or empty: 0 .. world_size - 1)."""
    from . import _dist_C

    _extend(_dist_C)

    timeout_s = _seconds(timeout)
    # The store may outlive this group (a re-created group reuses it): number the
    # incarnations so that every key this one uses is fresh.
    incarnation = (store.add("ringreduce/joined", 1) - 1) // world_size
    prefix = f"ringreduce/{incarnation}"
    # Which host every rank is on (ringreduce/hierarchy.py). Across hosts the executor is a
    # HierarchicalComm (C++, csrc/multiprocess/xhost.h): a Comm over this host's ranks composed
    # with torch's gloo/NCCL between hosts.
    layout = hierarchy.discover(store, prefix, rank, world_size, timeout_s)
    ring = max(map(len, layout.hosts)) if layout.hierarchical else world_size
    if ring > _dist_C.max_ranks:
        raise ValueError(f"ringreduce: at most {_dist_C.max_ranks} ranks are supported "
                         f"{'per host' if layout.hierarchical else 'on one host'}; got "
                         f"{ring} (world_size={world_size})")
    hosts = []
    if layout.hierarchical:
        h = layout.host
        local = _join_comm(store, f"{prefix}/host{h}", layout.local_rank, layout.local_size,
                           f"-h{h}", timeout_s,
                           lambda missing: layout.describe_ranks(
                               [layout.local_ranks[q] for q in missing]), rank)
        try:
            comm = _dist_C.HierarchicalComm(
                local, layout.hosts, layout.labels, rank, store, f"{prefix}/xhost", timeout_s,
                hierarchy.group_factory(store, f"{prefix}/xhost", layout, timeout_s))
        except BaseException:
            local.close()
            raise
    else:
        comm = _join_comm(store, prefix, rank, world_size, "", timeout_s,
                          lambda missing: f"rank(s) {', '.join(map(str, missing))}", rank)
        if layout.nhosts > 1:
            hosts = layout.host_of  # one ring over hosts sharing memory: count what crosses
    return _dist_C.Backend(comm, rank, world_size, timeout_s,
                           async_engine=_env.flag("RINGREDUCE_ASYNC"), store=store,
                           caller_runs=_env.flag("RINGREDUCE_CALLER_RUNS"),
                           global_ranks=list(global_ranks or range(world_size)), hosts=hosts)


def _join_comm(store, prefix, rank, size, suffix, timeout_s, name_missing, group_rank):
    """The Comm of rank `rank` of `size` ranks sharing memory: each creates its segment, the
    names go through the store under `prefix`, every rank maps every peer's segment, then each
    unlinks its own (nothing stays in /dev/shm). `suffix` ends the segment names' tag;
    name_missing(indices) names the ranks that did not come, in errors."""
    from . import _dist_C

    tag = f"{os.getpid()}-{secrets.token_hex(4)}{suffix}"
    comm = _dist_C.Comm(rank, size, _shm_bytes(), timeout_s, tag, _cuda_buffer_bytes())
    try:
        deadline = time.monotonic() + timeout_s
        store.set(f"{prefix}/name/{rank}", comm.name)
        names = _gather_keys(store, f"{prefix}/name", deadline, "join", size, timeout_s,
                             name_missing, group_rank)
        comm.attach([n.decode() for n in names])
        store.set(f"{prefix}/mapped/{rank}", "1")
        _gather_keys(store, f"{prefix}/mapped", deadline, "map the shared memory", size,
                     timeout_s, name_missing, group_rank)
    except BaseException:
        comm.close()
        raise
    comm.unlink()
    return comm


def _split_backend(store, ranks, timeout_s, rank, size, global_ranks=None):
    """Backend.split (ProcessGroup.split_group, dist.split_group): the group of the parent's
    `ranks`, made over `store` (torch's prefix store of the new group) by its members alone;
    None on the other ranks. `global_ranks`: the parent's members' global ranks."""
    members = sorted(ranks)
    if rank not in members:
        return None
    return _create_backend(store, members.index(rank), len(members), timeout_s,
                           global_ranks=_members_global(members, global_ranks))


def _shrink_backend(store, excluded, timeout_s, count, rank, size, global_ranks=None):
    """Backend.shrink (dist.shrink_group): the parent's group without `excluded`, made over the
    parent's store under a prefix numbered per shrink of that parent (`count`), which every
    survivor derives alike; the excluded ranks take no part."""
    survivors = [r for r in range(size) if r not in set(excluded)]
    shrunk = dist.PrefixStore(f"ringreduce/shrink/{count}/", store)
    return _create_backend(shrunk, survivors.index(rank), len(survivors), timeout_s,
                           global_ranks=_members_global(survivors, global_ranks))


def _members_global(members, parent_global):
    """The global ranks of the parent's group ranks `members`."""
    return [parent_global[m] for m in members] if parent_global else list(members)


def _gather_keys(store, prefix, deadline, what, size, timeout_s, name_missing, rank):
    keys = [f"{prefix}/{r}" for r in range(size)]
    missing = hierarchy.wait_keys(store, keys, deadline)
    if missing:
        raise RuntimeError(
            f"ringreduce: rank {rank}: {name_missing(missing)} did not {what} within the process "
            f"group timeout ({timeout_s:.1f} s)")
    return [store.get(k) for k in keys]
