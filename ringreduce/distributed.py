"""ringreduce as a ``torch.distributed`` backend named ``"ringreduce"``.

After ``import ringreduce`` (which calls :func:`register_backend`)::

    dist.init_process_group("ringreduce", ...)                 # cpu and cuda tensors
    dist.init_process_group("cpu:gloo,cuda:ringreduce", ...)   # accepted too, see below

and ``dist.all_reduce``, ``broadcast``, ``all_gather`` (list, ``all_gather_into_tensor``),
``reduce_scatter`` (list, ``reduce_scatter_tensor``), ``reduce``, ``barrier`` and
``DistributedDataParallel`` run on it unchanged. Other collectives (send/recv, gather,
scatter, all_to_all) raise a ``RuntimeError`` that names them.

How it works: one process per rank, all on one host. Each rank creates a POSIX shared-memory
segment, the names go through the process group's store, every rank maps every peer's
segment and each rank unlinks its own as soon as all have mapped it (nothing stays in
/dev/shm). CPU tensors are staged through those segments and run the same ring schedule as
``ringreduce.all_reduce``, so results are bitwise equal to it and identical on every rank.
CUDA tensors are shared through CUDA IPC and synchronised with IPC events ordered by a
host-side handshake (see csrc/multiprocess/cuda_collectives.h); several ranks may share one GPU.

Every wait on another rank is bounded by the group's ``timeout``: a rank that died, failed or
never joined makes the others raise a ``RuntimeError`` naming the collective, the peer and the
step. A failed group cannot be used again (like NCCL after an error); destroy it.

Collectives on CPU tensors have finished when the call returns (the returned work is already
complete). Collectives on CUDA tensors are queued on the current stream, like NCCL's.

Torch (2.13 and earlier) cannot bind a backend written in Python to a single device of a
group, so with ``"cpu:gloo,cuda:ringreduce"`` the ringreduce group also serves CPU tensors
(through shared memory); gloo is not used.

Knobs (environment): ``RINGREDUCE_SHM_BYTES``, the shared-memory staging area per rank for CPU
tensors (default 4 MiB; larger tensors go in rounds).
"""
import datetime
import os
import secrets

import torch
import torch.distributed as dist

BACKEND_NAME = "ringreduce"
DEFAULT_SHM_BYTES = 4 << 20

SUPPORTED_COLLECTIVES = (
    "all_reduce", "all_reduce_coalesced", "broadcast", "all_gather", "all_gather_into_tensor",
    "all_gather_coalesced", "reduce_scatter", "reduce_scatter_tensor", "reduce", "barrier",
)

__all__ = ["register_backend", "RingReduceProcessGroup", "BACKEND_NAME",
           "SUPPORTED_COLLECTIVES"]

if dist.is_available():
    from torch._C._distributed_c10d import ProcessGroup as _ProcessGroup
    from torch._C._distributed_c10d import _create_work_from_future
else:  # pragma: no cover - torch built without distributed
    _ProcessGroup = object


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


def _seconds(timeout):
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return float(timeout)


def _unsupported(name):
    def method(self, *args, **kwargs):
        raise RuntimeError(
            f"ringreduce: the '{name}' collective is not supported by the ringreduce backend "
            f"(supported: {', '.join(SUPPORTED_COLLECTIVES)}); run it on a group of another "
            "backend, e.g. dist.new_group(backend='gloo')")
    method.__name__ = name
    return method


class RingReduceProcessGroup(_ProcessGroup):
    """One rank of a ringreduce process group (created by ``init_process_group``/``new_group``)."""

    def __init__(self, store, rank, world_size, timeout):
        super().__init__(rank, world_size)
        from . import _dist_C

        self._timeout_s = _seconds(timeout)
        self._world_size = world_size
        self._rank = rank
        if world_size > _dist_C.max_ranks:
            raise ValueError(f"ringreduce: at most {_dist_C.max_ranks} ranks are supported; "
                             f"got world_size={world_size}")
        # The store may outlive this group (a re-created group reuses it): number the
        # incarnations so that every key this one uses is fresh.
        incarnation = (store.add("ringreduce/joined", 1) - 1) // world_size
        prefix = f"ringreduce/{incarnation}"
        tag = f"{os.getpid()}-{secrets.token_hex(4)}"
        self._comm = _dist_C.Comm(rank, world_size, _shm_bytes(), self._timeout_s, tag)
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

    def shutdown(self):
        self._comm.close()

    def abort(self):
        # Safe from another thread (a watchdog) while a collective waits: it marks the group
        # failed, so the waiting call raises within ~50 ms; shutdown() then frees the group.
        self._comm.abort()

    def set_timeout(self, timeout):
        self._timeout_s = _seconds(timeout)
        self._comm.set_timeout(self._timeout_s)

    def _work(self, result, tensors):
        devices = sorted({t.device for t in tensors if t.is_cuda}, key=lambda d: d.index)
        fut = torch.futures.Future(devices=devices) if devices else torch.futures.Future()
        fut.set_result(result)
        return _create_work_from_future(fut)

    def _one(self, tensors, name):
        if len(tensors) != 1:
            raise ValueError(f"ringreduce {name}: expected one tensor per process (one device per "
                             f"rank); got {len(tensors)}")
        return tensors[0]

    @staticmethod
    def _op(reduce_op, name):
        from .core import parse_op

        try:
            return parse_op(reduce_op)
        except ValueError:
            shown = str(getattr(reduce_op, "op", reduce_op)).rsplit(".", 1)[-1]
            raise ValueError(f"ringreduce {name}: reduce op {shown} is not supported "
                             "(supported: SUM, AVG, MAX, MIN, PRODUCT)") from None

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

    def allreduce(self, tensors, opts=None):
        tensor = self._one(tensors, "all_reduce")
        op = self._op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, "all_reduce")
        self._run_contiguous(tensor, lambda t: self._comm.all_reduce(t, op))
        return self._work(tensors, tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        op = self._op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM,
                      "all_reduce_coalesced")
        for tensor in tensors:
            self._run_contiguous(tensor, lambda t: self._comm.all_reduce(t, op))
        return self._work(tensors, tensors)

    def reduce(self, tensors, opts=None):
        tensor = self._one(tensors, "reduce")
        op = self._op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, "reduce")
        root = opts.rootRank if opts is not None else 0
        if self._rank == root:
            self._run_contiguous(tensor, lambda t: self._comm.all_reduce(t, op))
        else:
            self._comm.all_reduce(tensor.contiguous().clone(), op)
        return self._work(tensors, tensors)

    def broadcast(self, tensors, opts=None):
        tensor = self._one(tensors, "broadcast")
        root = opts.rootRank if opts is not None else 0
        self._run_contiguous(tensor, lambda t: self._comm.broadcast(t, root))
        return self._work(tensors, tensors)

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
        self._all_gather_into(outputs, tensor)
        return self._work(output_tensors, [tensor])

    def allgather_coalesced(self, output_lists, input_tensors, opts=None):
        for outputs, tensor in zip(output_lists, input_tensors):
            self._all_gather_into(outputs, tensor)
        return self._work(output_lists, list(input_tensors))

    def _gather_flat(self, output, tensor, name):
        if output.numel() != tensor.numel() * self._world_size:
            raise ValueError(f"ringreduce {name}: the output must hold world size "
                             f"({self._world_size}) x input elements ({tensor.numel()}); "
                             f"got {output.numel()}")
        n = tensor.numel()

        def run(out):
            flat = out.view(-1)
            self._comm.all_gather([flat[r * n:(r + 1) * n] for r in range(self._world_size)],
                                  tensor.contiguous().view(-1))

        self._run_contiguous(output, run)

    def all_gather_single(self, output, tensor, opts=None):
        self._gather_flat(output, tensor, "all_gather_into_tensor")
        return self._work([output], [output])

    def _allgather_base(self, output, tensor, opts=None):
        return self.all_gather_single(output, tensor, opts)

    def allgather_into_tensor_coalesced(self, outputs, tensors, opts=None):
        for output, tensor in zip(outputs, tensors):
            self._gather_flat(output, tensor, "all_gather_into_tensor")
        return self._work(outputs, outputs)

    def all_gather_single_coalesced(self, outputs, tensors, opts=None):
        return self.allgather_into_tensor_coalesced(outputs, tensors, opts)

    def _reduce_scatter_flat(self, output, flat_input, op, name):
        if flat_input.numel() != output.numel() * self._world_size:
            raise ValueError(f"ringreduce {name}: the input must hold world size "
                             f"({self._world_size}) x output elements ({output.numel()}); "
                             f"got {flat_input.numel()}")
        self._run_contiguous(
            output, lambda o: self._comm.reduce_scatter(o.view(-1), flat_input.contiguous(), op))

    def reduce_scatter(self, output_tensors, input_lists, opts=None):
        output = self._one(output_tensors, "reduce_scatter")
        inputs = self._one(input_lists, "reduce_scatter")
        op = self._op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, "reduce_scatter")
        if len(inputs) != self._world_size:
            raise ValueError(f"ringreduce reduce_scatter: the input list must hold one tensor "
                             f"per rank ({self._world_size}); got {len(inputs)}")
        for i, t in enumerate(inputs):
            if t.numel() != output.numel() or t.dtype != output.dtype:
                raise ValueError(f"ringreduce reduce_scatter: input[{i}] has {t.numel()} "
                                 f"elements of {t.dtype}; the output has {output.numel()} of "
                                 f"{output.dtype}")
        flat = torch.cat([t.reshape(-1) for t in inputs])
        self._reduce_scatter_flat(output, flat, op, "reduce_scatter")
        return self._work(output_tensors, output_tensors)

    def reduce_scatter_single(self, output, tensor, opts=None):
        op = self._op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM,
                      "reduce_scatter_tensor")
        self._reduce_scatter_flat(output, tensor.reshape(-1), op, "reduce_scatter_tensor")
        return self._work([output], [output])

    def _reduce_scatter_base(self, output, tensor, opts=None):
        return self.reduce_scatter_single(output, tensor, opts)

    def reduce_scatter_tensor_coalesced(self, outputs, tensors, opts=None):
        op = self._op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM,
                      "reduce_scatter_tensor")
        for output, tensor in zip(outputs, tensors):
            self._reduce_scatter_flat(output, tensor.reshape(-1), op, "reduce_scatter_tensor")
        return self._work(outputs, outputs)

    def reduce_scatter_single_coalesced(self, outputs, tensors, opts=None):
        return self.reduce_scatter_tensor_coalesced(outputs, tensors, opts)

    def barrier(self, opts=None):
        self._comm.barrier()
        return self._work([], [])

    send = _unsupported("send")
    recv = _unsupported("recv")
    recv_anysource = _unsupported("recv_anysource")
    gather = _unsupported("gather")
    scatter = _unsupported("scatter")
    alltoall = _unsupported("all_to_all")
    alltoall_base = _unsupported("all_to_all_single")
    all_to_all_single = _unsupported("all_to_all_single")
    monitored_barrier = _unsupported("monitored_barrier")
