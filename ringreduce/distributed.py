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
Ranks on several hosts: this ring runs inside each host and torch's gloo/NCCL between hosts
(ringreduce/hierarchy.py).

Every wait on another rank is bounded by the group's ``timeout``: a rank that died, failed or
never joined makes the others raise a ``RuntimeError`` naming the collective, the peer and the
step. A failed group cannot be used again (like NCCL after an error); destroy it.

Execution model (ProcessGroupNCCL's): every collective is validated in the calling thread
(bad arguments raise there, before anything is touched), then queued; one progress thread per
group runs the queue in issue order, and the call returns its ``Work`` at once. On CPU,
``Work.wait()`` blocks until the collective is done. On CUDA the collective runs on an internal
stream per group and device, ordered after the caller's current stream by an event recorded at
issue time, and ``Work.wait()`` makes the caller's current stream wait for the collective's end
event: the host waits only until the progress thread has queued the GPU work. ``async_op=False``
is ``wait()`` right away, as torch does for every backend. ``RINGREDUCE_ASYNC=0`` runs every
collective inline in the calling thread (on CUDA, on the caller's stream): the behaviour before
the engine, kept for comparison and debugging.

Point-to-point (send, recv, isend, irecv, recv from any source) runs on a second thread per
group, started by the rank's first such call (_P2PEngine, csrc/multiprocess/p2p.h): per-pair
rings in the shared segments, messages matched per (sender, tag) in send order, sends complete
once their bytes are in the ring, and no operation waits behind a collective or another
operation. gather, scatter, all-to-all and point-to-point stage CUDA tensors through host memory.
On a group that spans several hosts, gather, scatter and all-to-all run on the whole group's
gloo, and point-to-point on its send/recv (_xhost_p2p; ringreduce/hierarchy.py).

Torch (2.13 and earlier) cannot bind a backend written in Python to a single device of a
group, so with ``"cpu:gloo,cuda:ringreduce"`` the ringreduce group also serves CPU tensors
(through shared memory); gloo is not used.

Knobs (environment): ``RINGREDUCE_SHM_BYTES``, the shared-memory staging area per rank for CPU
tensors (default 4 MiB; larger tensors go in rounds); ``RINGREDUCE_CUDA_BUFFER_BYTES``, the
device staging area per rank for CUDA tensors (default 32 MiB, allocated at the first CUDA
collective; larger tensors go in rounds); ``RINGREDUCE_ASYNC`` (default 1).
"""
import collections
import datetime
import itertools
import math
import os
import queue
import secrets
import threading
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

__all__ = ["register_backend", "RingReduceProcessGroup", "RingReduceWork", "BACKEND_NAME",
           "SUPPORTED_COLLECTIVES"]

if dist.is_available():
    from torch._C._distributed_c10d import ProcessGroup as _ProcessGroup
    from torch._C._distributed_c10d import Work as _Work
else:  # pragma: no cover - torch built without distributed
    _ProcessGroup = object
    _Work = object


def register_backend():
    """Registers the ``"ringreduce"`` backend (devices cpu and cuda) with torch.distributed.

    Idempotent. Returns True when the backend is registered, False when this torch has no
    distributed support (then nothing happens); never raises for that.
    """
    if not dist.is_available():
        return False
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return True
    dist.Backend.register_backend(BACKEND_NAME, _create_process_group, devices=["cpu", "cuda"])
    return True


def _create_process_group(store, rank, world_size, timeout):
    return RingReduceProcessGroup(store, rank, world_size, timeout)


def _shm_bytes():
    raw = os.environ.get("RINGREDUCE_SHM_BYTES", "")
    if not raw.strip():
        return DEFAULT_SHM_BYTES
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"RINGREDUCE_SHM_BYTES must be a number of bytes; got {raw!r}") from None
    if value < 4096:
        raise ValueError(f"RINGREDUCE_SHM_BYTES must be at least 4096; got {value}")
    return (value + 4095) // 4096 * 4096


def _cuda_buffer_bytes():
    raw = os.environ.get("RINGREDUCE_CUDA_BUFFER_BYTES", "")
    if not raw.strip():
        return DEFAULT_CUDA_BUFFER_BYTES
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(
            f"RINGREDUCE_CUDA_BUFFER_BYTES must be a number of bytes; got {raw!r}") from None
    if value < 4096:
        raise ValueError(f"RINGREDUCE_CUDA_BUFFER_BYTES must be at least 4096; got {value}")
    return (value + 4095) // 4096 * 4096


def _seconds(timeout):
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return float(timeout)


def _host_copy(tensor):
    """A contiguous host copy (from CUDA: waits for the current stream)."""
    return torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor)


def _unsupported(name):
    def method(self, *args, **kwargs):
        raise RuntimeError(
            f"ringreduce: the '{name}' collective is not supported by the ringreduce backend "
            f"(supported: {', '.join(SUPPORTED_COLLECTIVES)}); run it on a group of another "
            "backend, e.g. dist.new_group(backend='gloo')")
    method.__name__ = name
    return method


class RingReduceWork(_Work):
    """The handle of one queued collective (what ``async_op=True`` returns).

    Completed by the group's progress thread. ``wait()`` raises the collective's error, if any;
    on CUDA it then makes the caller's current stream wait for the collective's end event.
    """

    def __init__(self, name, outputs, device, group):
        super().__init__()
        self._name = name
        self._group = group
        self._outputs = outputs
        self._device = device
        self._done = threading.Event()
        self._error = None
        self._end = None
        self._source = -1
        self._engine = self._job = None  # set while queued: wait() may run it (_Engine.help)
        self._fut = torch.futures.Future(devices=[device] if device is not None else None)

    def __repr__(self):
        state = "failed" if self._error is not None else (
            "completed" if self._done.is_set() else "pending")
        return f"RingReduceWork({self._name}, {state})"

    def _finish(self, value, error=None, end=None):
        """Called once, by the progress thread (on CUDA inside the internal stream's context,
        so the future's own events are recorded on that stream)."""
        self._error = error
        self._end = end
        self._engine = self._job = None
        if error is not None:
            self._fut.set_exception(error)
        else:
            self._fut.set_result(value)
        self._done.set()

    def is_completed(self):
        return self._done.is_set()

    def is_success(self):
        return self._done.is_set() and self._error is None

    def exception(self):
        return self._error

    def wait(self, timeout=None):
        seconds = _seconds(timeout) if timeout is not None else 0.0
        engine, job = self._engine, self._job
        if engine is not None and job is not None and not self._done.is_set():
            engine.help(job)
        if seconds > 0:
            if not self._done.wait(seconds):
                raise RuntimeError(f"ringreduce: {self._name} did not complete within the "
                                   f"{seconds:.1f} s given to Work.wait()")
        else:
            # Bounded: every collective is bounded by the group's timeout, and a failed group
            # fails the queued ones at once.
            self._done.wait()
        if self._error is not None:
            raise self._error
        if self._end is not None:
            failure = self._group._failure
            if failure is not None and not self._end.query():
                # The group failed (e.g. the GPU watchdog: a peer's GPU work never came) while
                # this collective's GPU work is unfinished: waiting on it could block the
                # caller's stream for ever.
                raise RuntimeError(f"ringreduce: {self._name} did not finish on the GPU: {failure}")
            torch.cuda.current_stream(self._device).wait_event(self._end)
        return True

    def synchronize(self):
        self.wait()

    def get_future(self):
        return self._fut

    def result(self):
        self.wait()
        return self._outputs

    def source_rank(self):
        return self._source

    def _source_rank(self):
        return self._source


class _Job:
    __slots__ = ("work", "run", "device", "ready", "stream")

    def __init__(self, work, run, device, ready, stream):
        self.work, self.run, self.device, self.ready, self.stream = work, run, device, ready, stream


class _Engine:
    """One progress thread per group: runs the group's collectives in issue order.

    The C++ collectives release the GIL, so the thread runs beside the caller (DDP's backward,
    say). Any error fails the whole group, as in NCCL: the peers then fail at once instead of
    waiting for their timeout, and the collectives queued after it fail without running. On
    CUDA the thread also watches the end events of the collectives it queued, and fails the
    group when one has not completed within the group's timeout.

    A caller that waits for a collective nobody has started yet, next in line while nothing
    runs, runs it itself (help()): it would only block anyway, and this saves the two thread
    hand-offs (about 0.1-0.4 ms each way on a loaded 2-core machine) that otherwise dominate a
    small synchronous collective. Exactly one job runs at a time (`_busy`), in issue order.
    """

    def __init__(self, pg):
        self._pg = pg
        self._cv = threading.Condition()
        self._pending = collections.deque()  # jobs not started, in issue order
        self._busy = False                   # a job is running (this thread or a helper)
        self._stopping = False
        self._streams = {}
        self._streams_lock = threading.Lock()
        self._inflight = collections.deque()  # CUDA: (work, end event, deadline)
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"ringreduce-progress-rank{pg._rank}")
        self._thread.start()

    def stream(self, device):
        with self._streams_lock:
            s = self._streams.get(device.index)
            if s is None:
                s = torch.cuda.Stream(device=device)
                self._streams[device.index] = s
            return s

    def used_cuda(self):
        with self._streams_lock:
            return bool(self._streams)

    def submit(self, job):
        with self._cv:
            self._pending.append(job)
            self._cv.notify_all()

    def help(self, job):
        """Runs `job` in the calling thread if it is next and nothing runs; True if it did."""
        with self._cv:
            if self._busy or not self._pending or self._pending[0] is not job:
                return False
            self._pending.popleft()
            self._busy = True
        self._run(job)
        return True

    def _run(self, job):
        try:
            self._execute(job)
        finally:
            with self._cv:
                self._busy = False
                self._cv.notify_all()

    def stop(self, deadline):
        """Lets the queued collectives finish until `deadline` (monotonic seconds); after it,
        fails the group so that the rest fail at once. Returns when the thread has ended."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            self._pg._fail("the process group was shut down with collectives still queued")
            self._thread.join(5.0)

    def _loop(self):
        while True:
            with self._cv:
                if self._busy or not self._pending:
                    if not self._busy:
                        self._watch()
                        if self._stopping and not self._pending:
                            return
                    self._cv.wait(0.05 if self._inflight else None)
                    continue
                job = self._pending.popleft()
                self._busy = True
            self._run(job)

    def _execute(self, job):
        work = job.work
        try:
            if self._pg._failure is not None:
                raise RuntimeError(
                    f"ringreduce: {work._name} on rank {self._pg._rank}: this process group "
                    f"failed earlier and cannot be used any more: {self._pg._failure}")
            if job.device is None:
                job.run()
                work._finish(work._outputs)
                return
            with torch.cuda.device(job.device), torch.cuda.stream(job.stream):
                job.stream.wait_event(job.ready)
                if work._name == "barrier":
                    self.drain_gpu()
                job.run()
                end = torch.cuda.Event()
                end.record(job.stream)
                work._finish(work._outputs, end=end)
            self._inflight.append((work, end, time.monotonic() + self._pg._timeout_s))
        except BaseException as exc:  # noqa: B902 - every failure fails the group
            self._pg._fail(f"ringreduce: {work._name} on rank {self._pg._rank} failed: {exc}")
            work._finish(None, error=exc)

    def drain_gpu(self):
        """Host-waits (bounded) until the GPU work of every queued collective has finished."""
        while self._inflight:
            work, end, deadline = self._inflight[0]
            while not end.query():
                if time.monotonic() > deadline:
                    self._gpu_timeout(work)
                    return
                time.sleep(0.0002)
            self._inflight.popleft()

    def _watch(self):
        while self._inflight:
            work, end, deadline = self._inflight[0]
            if end.query():
                self._inflight.popleft()
            elif time.monotonic() > deadline:
                self._gpu_timeout(work)
                return
            else:
                return

    def _gpu_timeout(self, work):
        self._inflight.clear()
        self._pg._fail(f"ringreduce: the GPU work of {work._name} on rank {self._pg._rank} did "
                       f"not finish within the process group timeout ({self._pg._timeout_s:.1f} "
                       "s); a peer's GPU work it waits for may never complete")


class _P2PJob:
    __slots__ = ("work", "send", "tensor", "peer", "tag", "ready", "host")

    def __init__(self, work, send, tensor, peer, tag, ready):
        self.work, self.send, self.tensor, self.peer, self.tag = work, send, tensor, peer, tag
        self.ready = ready
        self.host = None


class _P2PEngine:
    """The point-to-point thread of a group: sends and receives (csrc/multiprocess/p2p.h).

    They do not go through the collectives' queue: a send waiting for its receiver, or a
    receive waiting for its message, must not hold up the collectives queued behind it, nor
    wait behind a collective whose peer is itself blocked in a receive. This thread posts them
    to the C++ side, which moves all of them at once without blocking on any one, and completes
    their Works in the order they finish. Started by a rank's first point-to-point call.

    CUDA tensors are staged through host memory on an internal stream per device: a send copies
    its tensor to the host after the work queued before it on the caller's stream; a receive
    copies the message to the device when it has arrived, and its Work.wait() makes the
    caller's stream wait for that copy.
    """

    _STOP = object()

    def __init__(self, pg):
        self._pg = pg
        self._comm = pg._comm
        self._queue = queue.SimpleQueue()
        self._jobs = {}  # id -> _P2PJob, posted and not finished
        self._ids = itertools.count(1)
        self._streams = {}
        self._streams_lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"ringreduce-p2p-rank{pg._rank}")
        self._thread.start()

    def stream(self, device):
        with self._streams_lock:
            if device.index not in self._streams:
                self._streams[device.index] = torch.cuda.Stream(device=device)
            return self._streams[device.index]

    def submit(self, job):
        if not self._thread.is_alive():
            raise RuntimeError(f"ringreduce {job.work._name}: the process group was destroyed")
        self._queue.put(job)
        self._comm.p2p_interrupt()

    def stop(self, deadline):
        """Lets pending operations finish until `deadline` (monotonic seconds); after it, fails
        the group so that they fail at once. Returns when the thread has ended."""
        self._queue.put(self._STOP)
        self._comm.p2p_interrupt()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            self._pg._fail("the process group was shut down with point-to-point operations "
                           "still pending")
            self._thread.join(5.0)

    def _loop(self):
        stopping = False
        while True:
            while True:
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                if job is self._STOP:
                    stopping = True
                else:
                    self._post(job)
            if (stopping and not self._jobs) or self._comm.closed:
                self._abandon()
                return
            try:
                done = self._comm.p2p_progress(1.0)
            except BaseException as exc:  # noqa: B902 - e.g. out of memory: fails the group
                for job in self._jobs.values():
                    self._fail(job, exc)
                self._jobs.clear()
                continue
            for op_id, peer, error in done:
                self._complete(self._jobs.pop(op_id), peer, error)

    def _abandon(self):
        """On exit: fails what is still posted or queued (a submit racing with shutdown)."""
        jobs = list(self._jobs.values())
        self._jobs.clear()
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not self._STOP:
                jobs.append(job)
        for job in jobs:
            job.work._finish(None, error=RuntimeError(
                f"ringreduce: {job.work._name} on rank {self._pg._rank}: the process group was "
                "destroyed before it completed"))

    def _post(self, job):
        t = job.tensor
        try:
            if t.is_cuda:
                stream = self.stream(t.device)
                with torch.cuda.device(t.device), torch.cuda.stream(stream):
                    stream.wait_event(job.ready)
                    # The copy to pageable host memory waits for the stream, so for `ready`.
                    job.host = (_host_copy(t) if job.send
                                else torch.empty(t.shape, dtype=t.dtype))
            elif t.is_contiguous():
                job.host = t
            else:
                job.host = t.contiguous() if job.send else torch.empty(t.shape, dtype=t.dtype)
            op_id = next(self._ids)
            self._comm.p2p_post(op_id, job.send, job.host, job.peer, job.tag,
                                str(t.dtype).replace("torch.", ""))
            self._jobs[op_id] = job
        except BaseException as exc:  # noqa: B902 - every failure fails the group
            self._fail(job, exc)

    def _complete(self, job, peer, error):
        work = job.work
        if error is not None:
            work._finish(None, error=RuntimeError(error))
            return
        if not job.send:
            work._source = peer
        try:
            if job.send or job.host is job.tensor:
                work._finish(work._outputs)
            elif job.tensor.is_cuda:
                stream = self.stream(job.tensor.device)
                with torch.cuda.device(job.tensor.device), torch.cuda.stream(stream):
                    job.tensor.copy_(job.host)
                    end = torch.cuda.Event()
                    end.record(stream)
                    work._finish(work._outputs, end=end)
            else:
                job.tensor.copy_(job.host)
                work._finish(work._outputs)
        except BaseException as exc:  # noqa: B902
            self._fail(job, exc)

    def _fail(self, job, exc):
        self._pg._fail(f"ringreduce: {job.work._name} on rank {self._pg._rank} failed: {exc}")
        job.work._finish(None, error=exc)


class RingReduceProcessGroup(_ProcessGroup):
    """One rank of a ringreduce process group (created by ``init_process_group``/``new_group``)."""

    def __init__(self, store, rank, world_size, timeout):
        super().__init__(rank, world_size)
        from . import _dist_C

        self._timeout_s = _seconds(timeout)
        self._world_size = world_size
        self._rank = rank
        # The store may outlive this group (a re-created group reuses it): number the
        # incarnations so that every key this one uses is fresh.
        incarnation = (store.add("ringreduce/joined", 1) - 1) // world_size
        prefix = f"ringreduce/{incarnation}"
        # Which host every rank is on (ringreduce/hierarchy.py). Across hosts, `_comm` is a
        # HierarchicalComm: the same interface, composed of a Comm over this host's ranks and
        # torch's gloo/NCCL between hosts, so the collectives below route through it unchanged.
        layout = hierarchy.discover(store, prefix, rank, world_size, self._timeout_s)
        ring = max(map(len, layout.hosts)) if layout.hierarchical else world_size
        if ring > _dist_C.max_ranks:
            raise ValueError(f"ringreduce: at most {_dist_C.max_ranks} ranks are supported "
                             f"{'per host' if layout.hierarchical else 'on one host'}; got "
                             f"{ring} (world_size={world_size})")
        if layout.hierarchical:
            self._comm = hierarchy.HierarchicalComm(store, prefix, layout, _shm_bytes(),
                                                    self._timeout_s, _cuda_buffer_bytes())
        else:
            tag = f"{os.getpid()}-{secrets.token_hex(4)}"
            self._comm = _dist_C.Comm(rank, world_size, _shm_bytes(), self._timeout_s, tag,
                                      _cuda_buffer_bytes())
            try:
                deadline = datetime.datetime.now() + datetime.timedelta(seconds=self._timeout_s)
                store.set(f"{prefix}/name/{rank}", self._comm.name)
                names = self._gather_keys(store, f"{prefix}/name", deadline, "join")
                self._comm.attach([n.decode() for n in names])
                store.set(f"{prefix}/mapped/{rank}", "1")
                self._gather_keys(store, f"{prefix}/mapped", deadline, "map the shared memory")
            except BaseException:
                self._comm.close()
                raise
            self._comm.unlink()
            if layout.nhosts > 1:
                self._comm = hierarchy.FlatHostsComm(self._comm, layout)
        self._failure = None  # the first error the engine saw (the C++ group keeps its own)
        self._group_name = None
        self._group_desc = ""
        self._async = _env.flag("RINGREDUCE_ASYNC")
        self._engine = _Engine(self) if self._async else None
        self._shut = False

    def _gather_keys(self, store, prefix, deadline, what):
        keys = [f"{prefix}/{r}" for r in range(self._world_size)]
        left = (deadline - datetime.datetime.now()).total_seconds()
        try:
            store.wait(keys, datetime.timedelta(seconds=max(left, 0.001)))
        except Exception as exc:
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            if not missing:
                raise
            raise RuntimeError(
                f"ringreduce: rank {self._rank}: rank(s) {', '.join(map(str, missing))} did not "
                f"{what} within the process group timeout ({self._timeout_s:.1f} s)") from exc
        return [store.get(k) for k in keys]

    # ---- torch.distributed plumbing ----------------------------------------------------

    def getBackendName(self):
        return BACKEND_NAME

    def __repr__(self):
        return f"RingReduceProcessGroup(rank={self._rank}, world_size={self._world_size})"

    # torch names every group (init_process_group, new_group, DeviceMesh) through these. The
    # C++ ProcessGroup keeps the name in its per-device backends, which a ProcessGroup written
    # in Python has none of, so without these the name is lost ("ProcessGroup name not set")
    # and functional collectives, DeviceMesh, FSDP2 and DCP cannot find the group.
    def _set_group_name(self, name):
        self._group_name = name

    def _set_group_desc(self, desc):
        self._group_desc = desc

    @property
    def group_name(self):
        if self._group_name is None:
            raise RuntimeError("ringreduce: this process group has no name yet (torch names it "
                               "in init_process_group/new_group)")
        return self._group_name

    @property
    def group_desc(self):
        return self._group_desc

    def shutdown(self):
        """Lets queued collectives finish (each is bounded by the group's timeout; all together
        at most one timeout more), then closes the group. Never hangs."""
        if self._shut:
            return
        self._shut = True
        deadline = time.monotonic() + self._timeout_s
        if self._engine is not None:
            self._engine.stop(deadline)
        if self._p2p is not None:
            self._p2p.stop(deadline)
        for waiter in self._xhost_waiters:
            waiter.join(max(0.0, deadline - time.monotonic()))
        self._comm.close()

    def abort(self):
        # Safe from another thread (a watchdog) while a collective waits: it marks the group
        # failed, so the waiting call raises within ~50 ms and the queued ones fail at once;
        # shutdown() then frees the group.
        self._comm.abort()

    def _fail(self, message):
        if self._failure is None:
            self._failure = message
        self._comm.fail(message)

    def set_timeout(self, timeout):
        self._timeout_s = _seconds(timeout)
        self._comm.set_timeout(self._timeout_s)

    def _submit(self, name, run, outputs, tensors, device=None):
        """Queues run() (which performs the collective) and returns its Work. `outputs` is what
        the Work's future holds; `tensors` are every tensor the collective reads or writes, and
        their device (or `device`) says where it runs."""
        cuda = [t for t in tensors if t.is_cuda]
        if cuda:
            device = cuda[0].device
        if device is not None:
            for t in cuda:
                if t.device != device:
                    raise ValueError(f"ringreduce {name}: tensors on {device} and {t.device}; "
                                     "a rank drives one GPU")
        work = RingReduceWork(name, outputs, device, self)
        if not self._async:
            try:
                run()
            except BaseException as exc:
                self._fail(f"ringreduce: {name} on rank {self._rank} failed: {exc}")
                work._finish(None, error=exc)
                raise
            work._finish(outputs)
            return work
        stream = ready = None
        if device is not None:
            if torch.cuda.is_current_stream_capturing():
                msg = (f"ringreduce {name} on rank {self._rank}: cannot be captured in a CUDA "
                       "graph (multi-process collectives synchronise on the host)")
                self._fail(msg)
                raise RuntimeError(msg)
            stream = self._engine.stream(device)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
            # The internal stream uses these blocks until the collective ends: the caching
            # allocator must not hand them out before, even if the caller drops the tensors.
            for t in cuda:
                t.record_stream(stream)
        job = _Job(work, run, device, ready, stream)
        work._engine, work._job = self._engine, job
        self._engine.submit(job)
        return work

    def _one(self, tensors, name):
        if len(tensors) != 1:
            raise ValueError(f"ringreduce {name}: expected one tensor per process (one device per "
                             f"rank); got {len(tensors)}")
        return tensors[0]

    def _check(self, name, tensors, op="", arg="tensor"):
        """The collective's argument rules (dtype, op, device), applied in the caller's thread."""
        for i, t in enumerate(tensors):
            self._comm.check(t, op, name, arg if len(tensors) == 1 else f"{arg}[{i}]")

    def _check_like(self, name, outputs, tensor):
        """Every output matches the input in dtype, element count and device."""
        self._check_same(name, outputs, "output", tensor, "input")

    @staticmethod
    def _check_same(name, tensors, arg, ref, ref_arg):
        """Every tensor of the list `arg` matches `ref` in dtype, element count and device."""
        for i, o in enumerate(tensors):
            if o.dtype != ref.dtype or o.numel() != ref.numel() or o.device != ref.device:
                raise ValueError(f"ringreduce {name}: {arg}[{i}] is {o.numel()} elements of "
                                 f"{o.dtype} on {o.device}; the {ref_arg} is {ref.numel()} of "
                                 f"{ref.dtype} on {ref.device}")

    def _check_root(self, name, root):
        if not 0 <= root < self._world_size:
            raise ValueError(f"ringreduce {name}: root must be in [0, {self._world_size}); "
                             f"got {root}")

    @staticmethod
    def _op(reduce_op, name):
        from .core import parse_op

        try:
            return parse_op(reduce_op)
        except ValueError:
            shown = str(getattr(reduce_op, "op", reduce_op)).rsplit(".", 1)[-1]
            raise ValueError(f"ringreduce {name}: reduce op {shown} is not supported "
                             "(supported: SUM, AVG, MAX, MIN, PRODUCT, BAND, BOR, BXOR)") from None

    @staticmethod
    def _run_contiguous(tensor, fn):
        """Runs fn on a contiguous version of tensor, copying the result back if needed."""
        if tensor.is_contiguous():
            fn(tensor)
        else:
            tmp = tensor.contiguous()
            fn(tmp)
            tensor.copy_(tmp)

    # ---- collectives ---------------------------------------------------------------------
    # Each validates its arguments here, in the caller's thread, and queues the rest.

    def _reduce_op(self, opts, name):
        return self._op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, name)

    def allreduce(self, tensors, opts=None):
        tensor = self._one(tensors, "all_reduce")
        op = self._reduce_op(opts, "all_reduce")
        self._check("all_reduce", tensors, op)
        return self._submit("all_reduce", lambda: self._run_contiguous(
            tensor, lambda t: self._comm.all_reduce(t, op)), tensors, tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        op = self._reduce_op(opts, "all_reduce_coalesced")
        self._check("all_reduce_coalesced", tensors, op)

        def run():
            for tensor in tensors:
                self._run_contiguous(tensor, lambda t: self._comm.all_reduce(t, op))

        return self._submit("all_reduce_coalesced", run, tensors, tensors)

    def reduce(self, tensors, opts=None):
        tensor = self._one(tensors, "reduce")
        op = self._reduce_op(opts, "reduce")
        root = opts.rootRank if opts is not None else 0
        self._check("reduce", tensors, op)
        self._check_root("reduce", root)

        def run():
            if self._rank == root:
                self._run_contiguous(tensor, lambda t: self._comm.all_reduce(t, op))
            else:
                self._comm.all_reduce(tensor.contiguous().clone(), op)

        return self._submit("reduce", run, tensors, tensors)

    def broadcast(self, tensors, opts=None):
        tensor = self._one(tensors, "broadcast")
        root = opts.rootRank if opts is not None else 0
        self._check("broadcast", tensors)
        self._check_root("broadcast", root)
        return self._submit("broadcast", lambda: self._run_contiguous(
            tensor, lambda t: self._comm.broadcast(t, root)), tensors, tensors)

    def _all_gather_into(self, outputs, tensor):
        inp = tensor.contiguous()
        outs = [o if o.is_contiguous() else o.contiguous() for o in outputs]
        self._comm.all_gather(outs, inp)
        for o, out in zip(outputs, outs):
            if o is not out:
                o.copy_(out)

    def allgather(self, output_tensors, input_tensors, opts=None):
        tensor = self._one(input_tensors, "all_gather")
        outputs = self._one(output_tensors, "all_gather")
        self._check_list("all_gather", outputs, tensor)
        return self._submit("all_gather", lambda: self._all_gather_into(outputs, tensor),
                            output_tensors, [tensor, *outputs])

    def _check_list(self, name, outputs, tensor):
        self._check(name, [tensor], arg="input")
        if len(outputs) != self._world_size:
            raise ValueError(f"ringreduce {name}: the output list must hold one tensor per rank "
                             f"({self._world_size}); got {len(outputs)}")
        self._check(name, outputs, arg="output")
        self._check_like(name, outputs, tensor)

    def allgather_coalesced(self, output_lists, input_tensors, opts=None):
        if len(output_lists) != len(input_tensors):
            raise ValueError("ringreduce all_gather_coalesced: one output list per input tensor "
                             f"needed; got {len(output_lists)} lists for {len(input_tensors)}")
        for outputs, tensor in zip(output_lists, input_tensors):
            self._check_list("all_gather_coalesced", outputs, tensor)
        def run():
            for outputs, tensor in zip(output_lists, input_tensors):
                self._all_gather_into(outputs, tensor)

        return self._submit("all_gather_coalesced", run, output_lists,
                            [*input_tensors, *(o for outs in output_lists for o in outs)])

    def _check_gather_flat(self, output, tensor, name):
        self._check(name, [tensor], arg="input")
        self._check(name, [output], arg="output")
        if output.dtype != tensor.dtype or output.device != tensor.device:
            raise ValueError(f"ringreduce {name}: the output is {output.dtype} on "
                             f"{output.device}; the input is {tensor.dtype} on {tensor.device}")
        if output.numel() != tensor.numel() * self._world_size:
            raise ValueError(f"ringreduce {name}: the output must hold world size "
                             f"({self._world_size}) x input elements ({tensor.numel()}); "
                             f"got {output.numel()}")

    def _gather_flat(self, output, tensor):
        n = tensor.numel()

        def run(out):
            flat = out.view(-1)
            self._comm.all_gather([flat[r * n:(r + 1) * n] for r in range(self._world_size)],
                                  tensor.contiguous().view(-1))

        self._run_contiguous(output, run)

    def all_gather_single(self, output, tensor, opts=None):
        self._check_gather_flat(output, tensor, "all_gather_into_tensor")
        return self._submit("all_gather_into_tensor", lambda: self._gather_flat(output, tensor),
                            [output], [output, tensor])

    def _allgather_base(self, output, tensor, opts=None):
        return self.all_gather_single(output, tensor, opts)

    def allgather_into_tensor_coalesced(self, outputs, tensors, opts=None):
        for output, tensor in zip(outputs, tensors):
            self._check_gather_flat(output, tensor, "all_gather_into_tensor")

        def run():
            for output, tensor in zip(outputs, tensors):
                self._gather_flat(output, tensor)

        return self._submit("all_gather_into_tensor_coalesced", run, outputs,
                            [*outputs, *tensors])

    def all_gather_single_coalesced(self, outputs, tensors, opts=None):
        return self.allgather_into_tensor_coalesced(outputs, tensors, opts)

    def _check_reduce_scatter_flat(self, output, flat_input, op, name):
        self._check(name, [flat_input], op, arg="input")
        self._check(name, [output], arg="output")
        if output.dtype != flat_input.dtype or output.device != flat_input.device:
            raise ValueError(f"ringreduce {name}: the output is {output.dtype} on "
                             f"{output.device}; the input is {flat_input.dtype} on "
                             f"{flat_input.device}")
        if flat_input.numel() != output.numel() * self._world_size:
            raise ValueError(f"ringreduce {name}: the input must hold world size "
                             f"({self._world_size}) x output elements ({output.numel()}); "
                             f"got {flat_input.numel()}")

    def _reduce_scatter_flat(self, output, flat_input, op):
        self._run_contiguous(
            output, lambda o: self._comm.reduce_scatter(o.view(-1), flat_input.contiguous(), op))

    def reduce_scatter(self, output_tensors, input_lists, opts=None):
        output = self._one(output_tensors, "reduce_scatter")
        inputs = self._one(input_lists, "reduce_scatter")
        op = self._reduce_op(opts, "reduce_scatter")
        if len(inputs) != self._world_size:
            raise ValueError(f"ringreduce reduce_scatter: the input list must hold one tensor "
                             f"per rank ({self._world_size}); got {len(inputs)}")
        self._check("reduce_scatter", [output], op, arg="output")
        self._check("reduce_scatter", inputs, op, arg="input")
        for i, t in enumerate(inputs):
            if t.numel() != output.numel() or t.dtype != output.dtype or t.device != output.device:
                raise ValueError(f"ringreduce reduce_scatter: input[{i}] has {t.numel()} "
                                 f"elements of {t.dtype} on {t.device}; the output has "
                                 f"{output.numel()} of {output.dtype} on {output.device}")
        flat = torch.cat([t.reshape(-1) for t in inputs])
        return self._submit("reduce_scatter", lambda: self._reduce_scatter_flat(
            output, flat, op), output_tensors, [output, flat])

    def reduce_scatter_single(self, output, tensor, opts=None):
        op = self._reduce_op(opts, "reduce_scatter_tensor")
        flat = tensor.reshape(-1)
        self._check_reduce_scatter_flat(output, flat, op, "reduce_scatter_tensor")
        return self._submit("reduce_scatter_tensor", lambda: self._reduce_scatter_flat(
            output, flat, op), [output], [output, tensor])

    def _reduce_scatter_base(self, output, tensor, opts=None):
        return self.reduce_scatter_single(output, tensor, opts)

    def reduce_scatter_tensor_coalesced(self, outputs, tensors, opts=None):
        op = self._reduce_op(opts, "reduce_scatter_tensor")
        flats = [t.reshape(-1) for t in tensors]
        for output, flat in zip(outputs, flats):
            self._check_reduce_scatter_flat(output, flat, op, "reduce_scatter_tensor")

        def run():
            for output, flat in zip(outputs, flats):
                self._reduce_scatter_flat(output, flat, op)

        return self._submit("reduce_scatter_tensor_coalesced", run, outputs,
                            [*outputs, *tensors])

    def reduce_scatter_single_coalesced(self, outputs, tensors, opts=None):
        return self.reduce_scatter_tensor_coalesced(outputs, tensors, opts)

    def barrier(self, opts=None):
        # After every collective queued before it; on CUDA it also waits for their GPU work.
        device = None
        if self._engine is not None and self._engine.used_cuda():
            device = torch.device("cuda", torch.cuda.current_device())
        return self._submit("barrier", self._comm.barrier, [], [], device)

    # gather, scatter and all-to-all move bytes: any dtype. CUDA tensors are staged through
    # host memory inside the engine (on its internal stream: copied out, the CPU collective,
    # copied back), the simplest correct path.

    @staticmethod
    def _host_call(fn, inputs, outputs):
        """fn(host_inputs, host_outputs) with contiguous CPU tensors standing in for `inputs`
        and `outputs`: contiguous CPU tensors themselves, copies of the others. Copies from
        CUDA wait for the current stream; outputs are copied back after fn."""
        ins = [t if t.is_contiguous() and not t.is_cuda else _host_copy(t) for t in inputs]
        outs = [t if t.is_contiguous() and not t.is_cuda else
                torch.empty(t.shape, dtype=t.dtype) for t in outputs]
        fn(ins, outs)
        for t, h in zip(outputs, outs):
            if h is not t:
                t.copy_(h)

    def _root_list(self, name, lists, root, arg):
        """The root's list of one tensor per rank (torch passes [list] there, [] or [[]]
        elsewhere); [] on the other ranks, which must not pass one."""
        if self._rank != root:
            if any(len(x) for x in lists):
                raise ValueError(f"ringreduce {name}: only the root (rank {root}) passes a "
                                 f"{arg}; rank {self._rank} passed one")
            return []
        tensors = list(self._one(lists, name))
        if len(tensors) != self._world_size:
            raise ValueError(f"ringreduce {name}: the {arg} must hold one tensor per rank "
                             f"({self._world_size}); got {len(tensors)}")
        self._check(name, tensors, arg=arg)
        return tensors

    def gather(self, output_tensors, input_tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        self._check_root("gather", root)
        tensor = self._one(input_tensors, "gather")
        self._check("gather", [tensor], arg="input")
        outputs = self._root_list("gather", output_tensors, root, "gather_list")
        self._check_same("gather", outputs, "gather_list", tensor, "input")
        return self._submit("gather", lambda: self._host_call(
            lambda ins, outs: self._comm.gather(outs, ins[0], root), [tensor], outputs),
            output_tensors, [tensor, *outputs])

    def scatter(self, output_tensors, input_tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        self._check_root("scatter", root)
        output = self._one(output_tensors, "scatter")
        self._check("scatter", [output], arg="output")
        inputs = self._root_list("scatter", input_tensors, root, "scatter_list")
        self._check_same("scatter", inputs, "scatter_list", output, "output")
        return self._submit("scatter", lambda: self._host_call(
            lambda ins, outs: self._comm.scatter(outs[0], ins, root), inputs, [output]),
            output_tensors, [output, *inputs])

    def alltoall(self, output_tensors, input_tensors, opts=None):
        name = "all_to_all"
        for tensors, arg in ((output_tensors, "output_tensor_list"),
                             (input_tensors, "input_tensor_list")):
            if len(tensors) != self._world_size:
                raise ValueError(f"ringreduce {name}: the {arg} must hold one tensor per rank "
                                 f"({self._world_size}); got {len(tensors)}")
            self._check(name, tensors, arg=arg)
        ref = input_tensors[0]
        for tensors, arg in ((output_tensors, "output_tensor_list"),
                             (input_tensors, "input_tensor_list")):
            for i, t in enumerate(tensors):
                if t.dtype != ref.dtype or t.device != ref.device:
                    raise ValueError(f"ringreduce {name}: {arg}[{i}] is {t.dtype} on {t.device}; "
                                     f"input_tensor_list[0] is {ref.dtype} on {ref.device}")
        mine, theirs = input_tensors[self._rank], output_tensors[self._rank]
        if mine.numel() != theirs.numel():
            raise ValueError(f"ringreduce {name}: this rank ({self._rank}) sends itself "
                             f"{mine.numel()} elements (input_tensor_list[{self._rank}]) but "
                             f"output_tensor_list[{self._rank}] holds {theirs.numel()}")
        outputs, inputs = list(output_tensors), list(input_tensors)
        return self._submit(name, lambda: self._host_call(
            lambda ins, outs: self._comm.all_to_all(outs, ins), inputs, outputs),
            outputs, [*outputs, *inputs])

    def _splits(self, name, arg, splits, tensor, what):
        """Rows (dim 0) of `tensor` for each rank: `splits`, or equal parts when it is empty."""
        rows = tensor.shape[0]
        splits = [int(s) for s in splits]
        if not splits:
            if rows % self._world_size:
                raise ValueError(f"ringreduce {name}: without {arg}, dim 0 of the {what} "
                                 f"({rows}) must divide by the world size ({self._world_size})")
            return [rows // self._world_size] * self._world_size
        if len(splits) != self._world_size:
            raise ValueError(f"ringreduce {name}: {arg} must hold one size per rank "
                             f"({self._world_size}); got {len(splits)}")
        if min(splits) < 0 or sum(splits) != rows:
            raise ValueError(f"ringreduce {name}: {arg} {splits} must be non-negative and add "
                             f"up to dim 0 of the {what} ({rows}); they add up to {sum(splits)}")
        return splits

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes,
                          opts=None):
        name = "all_to_all_single"
        self._check(name, [input], arg="input")
        self._check(name, [output], arg="output")
        if output.dtype != input.dtype or output.device != input.device:
            raise ValueError(f"ringreduce {name}: the output is {output.dtype} on "
                             f"{output.device}; the input is {input.dtype} on {input.device}")
        if input.dim() == 0 or output.dim() == 0:
            raise ValueError(f"ringreduce {name}: input and output need a dim 0 to split; got "
                             f"shapes {tuple(input.shape)} and {tuple(output.shape)}")
        row = math.prod(input.shape[1:])
        if math.prod(output.shape[1:]) != row:
            raise ValueError(f"ringreduce {name}: a row (dims 1..) of the output has "
                             f"{math.prod(output.shape[1:])} elements and one of the input {row}")
        ins = self._splits(name, "input_split_sizes", input_split_sizes, input, "input")
        outs = self._splits(name, "output_split_sizes", output_split_sizes, output, "output")
        if ins[self._rank] != outs[self._rank]:
            raise ValueError(f"ringreduce {name}: this rank ({self._rank}) sends itself "
                             f"{ins[self._rank]} rows (input_split_sizes) but expects "
                             f"{outs[self._rank]} (output_split_sizes)")

        def body(host_in, host_out):
            self._comm.all_to_all(list(host_out[0].view(-1).split([s * row for s in outs])),
                                  list(host_in[0].view(-1).split([s * row for s in ins])))

        return self._submit(name, lambda: self._host_call(body, [input], [output]), [output],
                            [output, input])

    alltoall_base = all_to_all_single

    # ---- point-to-point ----------------------------------------------------------------
    # Validated here, then run by the group's point-to-point thread (_P2PEngine), beside the
    # collectives. Messages match per (peer, tag) in send order; a send completes once its
    # bytes are in the shared-memory ring, without waiting for the receive.

    _p2p = None
    _p2p_start = threading.Lock()
    _xhost_waiters = ()

    def _p2p_submit(self, name, send, tensors, peer, tag):
        tensor = self._one(tensors, name)
        self._check(name, [tensor])
        if not isinstance(tag, int):
            raise TypeError(f"ringreduce {name}: tag must be an int; got {type(tag).__name__}")
        if peer is not None and not 0 <= peer < self._world_size:
            raise ValueError(f"ringreduce {name}: {'dst' if send else 'src'} must be a rank in "
                             f"[0, {self._world_size}); got {peer}")
        if self._shut:
            raise RuntimeError(f"ringreduce {name}: the process group was already destroyed")
        if isinstance(self._comm, hierarchy.HierarchicalComm):
            return self._xhost_p2p(name, send, tensor, peer, tag)
        with self._p2p_start:
            if self._p2p is None:
                self._p2p = _P2PEngine(self)
        ready = None
        if tensor.is_cuda:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"ringreduce {name} on rank {self._rank}: cannot be captured "
                                   "in a CUDA graph (it synchronises on the host)")
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(tensor.device))
            tensor.record_stream(self._p2p.stream(tensor.device))
        work = RingReduceWork(name, [tensor], tensor.device if tensor.is_cuda else None, self)
        self._p2p.submit(_P2PJob(work, send, tensor, -1 if peer is None else peer, tag, ready))
        return work

    def _xhost_p2p(self, name, send, tensor, peer, tag):
        """Across hosts: gloo's own send/recv on the whole group, posted here (so in issue
        order) by HierarchicalComm.p2p_start; a thread per operation waits for it (gloo bounds
        the wait by the group's timeout). A send works on a copy of the tensor and its Work
        completes at once, as on one host (gloo's send would wait for the matching receive); a
        send that then fails fails the group. A receive's Work completes when its message is in
        the tensor. CUDA tensors go through host memory (written, never run: no GPU so far)."""
        if tag < 0:
            raise ValueError(f"ringreduce {name}: a group that spans several hosts needs tags "
                             f">= 0 (gloo's); got {tag}")
        if peer == self._rank:
            raise ValueError(f"ringreduce {name}: rank {self._rank} cannot "
                             f"{'send to' if send else 'receive from'} itself")
        ready = None
        if send:
            host = _host_copy(tensor)
        elif tensor.is_cuda:
            host = torch.empty(tensor.shape, dtype=tensor.dtype)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(tensor.device))
        else:
            host = tensor if tensor.is_contiguous() else torch.empty(tensor.shape,
                                                                      dtype=tensor.dtype)
        work = RingReduceWork(name, [tensor], None, self)
        try:
            posted = self._comm.p2p_start(send, host, peer, tag)
        except RuntimeError as exc:
            work._finish(None, error=exc)
            return work
        if send:
            work._finish(work._outputs)

        def finish():
            try:
                source = self._comm.p2p_wait(posted, send, peer, tag)
                if host is not tensor and not send:
                    if ready is None:
                        tensor.copy_(host)
                    else:
                        with torch.cuda.device(tensor.device):
                            stream = torch.cuda.current_stream()
                            stream.wait_event(ready)
                            tensor.copy_(host)
                            stream.synchronize()
            except BaseException as exc:  # noqa: B902 - every failure fails the group
                self._fail(str(exc))
                if not send:
                    work._finish(None, error=exc)
                return
            if not send:
                work._source = source
                work._finish(work._outputs)

        waiter = threading.Thread(target=finish, daemon=True,
                                  name=f"ringreduce-xhost-{name}-rank{self._rank}")
        with self._p2p_start:
            self._xhost_waiters = [t for t in self._xhost_waiters if t.is_alive()] + [waiter]
        waiter.start()
        return work

    def send(self, tensors, dstRank, tag=0):
        return self._p2p_submit("send", True, tensors, dstRank, tag)

    def recv(self, tensors, srcRank, tag=0):
        return self._p2p_submit("recv", False, tensors, srcRank, tag)

    def recv_anysource(self, tensors, tag=0):
        """A receive from whichever rank sends first with this tag; Work.source_rank() says
        which."""
        return self._p2p_submit("recv", False, tensors, None, tag)

    # torch runs monitored_barrier on gloo groups only (it raises before calling a backend).
    monitored_barrier = _unsupported("monitored_barrier")
