"""``torch.cuda.comm`` (``torch.nn.parallel.comm``) on the ring: the collectives
``nn.DataParallel`` is built from, with the same signatures.

- ``broadcast``, ``broadcast_coalesced``: the list API's ``ringreduce.broadcast`` (a pipelined
  chain from the source).
- ``reduce_add``, ``reduce_add_coalesced``: ``ringreduce.reduce`` onto the destination rank
  (the ring's fixed summation order, so the same inputs give the same bits on every call).
- ``scatter``, ``gather``: torch's own on CUDA (the ring brings nothing to a split or a
  concatenation); chunks and ``torch.cat`` where a CPU device is involved.

Beyond ``torch.cuda.comm``: a device may appear several times in ``devices`` (simulated ranks),
and ``devices`` may be CPU devices (``[torch.device("cpu")] * 2``), so that everything runs
without a GPU. Every rank then gets its own tensors: a copy never aliases another rank's (the
rank that already holds the source keeps the source itself, as in torch). A device is an
``int`` (a CUDA index; -1 is the CPU, as torch accepts), a ``str`` or a ``torch.device``.

``CommTimer`` measures the time spent in these collectives (used by the trainer and the
benchmark to report the communication share of a step).
"""
import threading
import time

import torch
import torch.cuda.comm  # noqa: F401  (not imported by `import torch`: torch 2.11 on a GPU)

from . import core

__all__ = ["broadcast", "broadcast_coalesced", "reduce_add", "reduce_add_coalesced", "scatter",
           "gather", "CommTimer", "as_device"]

DEFAULT_BUFFER_SIZE = 10485760  # torch.cuda.comm's default coalescing buffer (10 MiB)


def as_device(device):
    """``device`` (an int CUDA index, -1 for the CPU, a str or a torch.device) as a
    torch.device with an index on CUDA."""
    if isinstance(device, torch.device):
        d = device
    elif isinstance(device, bool):
        raise TypeError(f"a device must be an int, str or torch.device; got bool {device}")
    elif isinstance(device, int):
        d = torch.device("cpu") if device == -1 else torch.device("cuda", device)
    elif isinstance(device, str):
        d = torch.device(device)
    else:
        raise TypeError(f"a device must be an int, str or torch.device; got "
                        f"{type(device).__name__}")
    if d.type not in ("cpu", "cuda"):
        raise ValueError(f"ringreduce.comm works on cpu and cuda devices; got {d}")
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


def _devices(devices):
    return [as_device(d) for d in devices]


# ---------------------------------------------------------------- timing

_active_timers = []
_timers_lock = threading.Lock()


class CommTimer:
    """While active (``with timer:``), every collective of this module adds its duration.

    CPU: wall time of the call. CUDA: events on the current stream of every device of the
    call, before and after it; the slowest device counts. ``seconds()`` waits for the events
    and returns the total since the timer was created or last read. Collectives may run in
    autograd's threads (the gradient reduction in backward): they are counted too.
    """

    def __init__(self):
        self._marks = []

    def __enter__(self):
        with _timers_lock:
            _active_timers.append(self)
        return self

    def __exit__(self, *exc):
        with _timers_lock:
            _active_timers.remove(self)

    def seconds(self):
        total = 0.0
        for start, end in self._marks:
            if isinstance(start, float):
                total += end - start
            else:
                for e in end:
                    e.synchronize()
                total += max(s.elapsed_time(e) for s, e in zip(start, end)) / 1e3
        self._marks = []
        return total


def _mark(devices):
    cuda = list(dict.fromkeys(d for d in devices if d.type == "cuda"))
    if not cuda:
        return time.perf_counter()
    marks = []
    for d in cuda:
        e = torch.cuda.Event(enable_timing=True)
        e.record(torch.cuda.current_stream(d))
        marks.append(e)
    return marks


class _timed:
    def __init__(self, devices):
        self.devices = devices

    def __enter__(self):
        with _timers_lock:
            self.timers = list(_active_timers)
        if self.timers:
            self.start = _mark(self.devices)

    def __exit__(self, *exc):
        if self.timers and exc[0] is None:
            end = _mark(self.devices)
            with _timers_lock:
                for t in self.timers:
                    t._marks.append((self.start, end))


# ---------------------------------------------------------------- helpers

def _as_bytes(t):
    """A contiguous tensor's memory as a flat uint8 tensor (a broadcast is a copy, so every
    dtype, bool and complex included, goes through the ring as bytes)."""
    return t.view(-1).view(torch.uint8)


def _ring_broadcast(ranks, root):
    if len(ranks) > 1:
        core.broadcast([_as_bytes(t) for t in ranks], root=root)


def _summable(t):
    """The tensor the ring sums for ``t``: complex numbers as (real, imag) pairs."""
    return torch.view_as_real(t) if t.is_complex() else t


def _distinct_contiguous(tensors):
    """Contiguous tensors, one per rank, no two sharing memory (the list API's rule): a tensor
    that is not contiguous, or that repeats an earlier one, is copied."""
    seen, out = set(), []
    for t in tensors:
        key = (t.device, t.data_ptr())
        if not t.is_contiguous() or (t.numel() and key in seen):
            t = t.clone(memory_format=torch.contiguous_format)
        seen.add((t.device, t.data_ptr()))
        out.append(t)
    return out


def pack_indices(indices, nbytes, cap):
    """``indices`` in order, cut into runs whose sizes (``nbytes(i)`` bytes each) add up to at
    most ``cap`` bytes; an index larger than ``cap`` gets a run of its own. The coalescing rule
    of torch.cuda.comm's buffers and of DDP's gradient buckets."""
    runs, current, size = [], [], 0
    for i in indices:
        if current and size + nbytes(i) > cap:
            runs.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes(i)
    if current:
        runs.append(current)
    return runs


def _buckets(tensors, buffer_size):
    """Index lists grouping ``tensors`` by dtype (in order of first appearance) into buckets
    of at most ``buffer_size`` bytes (a larger tensor gets a bucket of its own)."""
    by_dtype = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    buckets = []
    for indices in by_dtype.values():
        buckets += pack_indices(indices, lambda i: tensors[i].numel() * tensors[i].element_size(),
                                buffer_size)
    return buckets


def _flatten(tensors):
    return torch.cat([t.reshape(-1) for t in tensors])


def _unflatten(flat, like):
    """Views of ``flat`` shaped like ``like``, each behind ``.data``: a tensor of its own to
    autograd, with its own version counter (an in-place update of one, a BatchNorm running
    statistic say, must not invalidate another that autograd saved)."""
    out, offset = [], 0
    for t in like:
        out.append(flat[offset:offset + t.numel()].view(t.shape).data)
        offset += t.numel()
    return out


# ---------------------------------------------------------------- broadcast

def broadcast(tensor, devices=None, *, out=None):
    """Copies ``tensor`` to ``devices`` (one result per entry) or into ``out`` (exactly one of
    the two); returns a tuple. With ``devices``, the first entry equal to ``tensor``'s device
    gets ``tensor`` itself and every other entry a new tensor; ``tensor`` may live on a device
    not in ``devices`` (it is first copied to ``devices[0]``)."""
    if (devices is None) == (out is None):
        raise RuntimeError("ringreduce.comm.broadcast: exactly one of 'devices' and 'out' must "
                           f"be specified; got devices={devices} and out={out}")
    if out is not None:
        out = list(out)
        for i, o in enumerate(out):
            if o.shape != tensor.shape or o.dtype != tensor.dtype:
                raise ValueError(f"ringreduce.comm.broadcast: out[{i}] must have the source's "
                                 f"shape {tuple(tensor.shape)} and dtype {tensor.dtype}; got "
                                 f"{tuple(o.shape)} and {o.dtype}")
        ranks = _distinct_contiguous(out)
        with _timed([o.device for o in out]):
            ranks[0].copy_(tensor)
            _ring_broadcast(ranks, 0)
        for o, r in zip(out, ranks):
            if o is not r:
                o.copy_(r)
        return tuple(out)
    devices = _devices(devices)
    root = next((i for i, d in enumerate(devices) if d == tensor.device), None)
    ranks = [torch.empty(tensor.shape, dtype=tensor.dtype, device=d) for d in devices]
    if root is not None and tensor.is_contiguous():
        ranks[root] = tensor
    with _timed(devices):
        source = 0 if root is None else root
        if ranks[source] is not tensor:
            ranks[source].copy_(tensor)
        _ring_broadcast(ranks, source)
    if root is not None:
        ranks[root] = tensor
    return tuple(ranks)


def broadcast_coalesced(tensors, devices, buffer_size=DEFAULT_BUFFER_SIZE):
    """Broadcasts ``tensors`` (all on ``devices[0]``) to ``devices``, small tensors coalesced
    into buffers of at most ``buffer_size`` bytes; returns one list of tensors per device,
    the first being ``tensors`` themselves (as ``torch.cuda.comm.broadcast_coalesced``)."""
    devices = _devices(devices)
    tensors = list(tensors)
    if not devices:
        return []
    for i, t in enumerate(tensors):
        if t.device != devices[0]:
            raise ValueError(
                "ringreduce.comm.broadcast_coalesced: every tensor must be on devices[0] "
                f"({devices[0]}), which is the source; tensors[{i}] is on {t.device}")
    outputs = [tensors] + [[None] * len(tensors) for _ in devices[1:]]
    with _timed(devices):
        for bucket in _buckets(tensors, buffer_size):
            chunk = [tensors[i] for i in bucket]
            ranks = [_flatten(chunk)]
            ranks += [torch.empty(ranks[0].numel(), dtype=ranks[0].dtype, device=d)
                      for d in devices[1:]]
            _ring_broadcast(ranks, 0)
            for r in range(1, len(devices)):
                for i, view in zip(bucket, _unflatten(ranks[r], chunk)):
                    outputs[r][i] = view
    return outputs


# ---------------------------------------------------------------- reduce

def _root(fn, devices, destination):
    if destination is None:
        cuda = [d for d in devices if d.type == "cuda"]
        destination = (torch.device("cuda", torch.cuda.current_device()) if cuda
                       else torch.device("cpu"))
    destination = as_device(destination)
    for i, d in enumerate(devices):
        if d == destination:
            return i
    raise RuntimeError(f"ringreduce.comm.{fn}: the destination {destination} must be the "
                       f"device of one of the inputs (they are on {[str(d) for d in devices]})")


def _sum_in_rank_order(inputs, root):
    """Sparse tensors (which the ring cannot reduce): summed on the root in rank order."""
    result = inputs[root].clone()
    for i, t in enumerate(inputs):
        if i != root:
            result = result + t.to(result.device)
    return result


def reduce_add(inputs, destination=None):
    """The elementwise sum of ``inputs`` (one per rank, same shape and dtype) as a new tensor
    on ``destination`` (default: the current device), which must be the device of one of the
    inputs (the first such input is the ring's root). ``inputs`` are not modified."""
    inputs = list(inputs)
    if not inputs:
        raise ValueError("ringreduce.comm.reduce_add: inputs must hold at least one tensor")
    for i, t in enumerate(inputs):
        if t.shape != inputs[0].shape:
            raise ValueError(f"ringreduce.comm.reduce_add: input {i} has size "
                             f"{tuple(t.shape)}, but input 0 has {tuple(inputs[0].shape)}")
    devices = [t.device for t in inputs]
    root = _root("reduce_add", devices, destination)
    if len(inputs) == 1:
        return inputs[0]
    if any(t.is_sparse for t in inputs):
        return _sum_in_rank_order(inputs, root)
    ranks = _distinct_contiguous(inputs)
    result = torch.empty(ranks[root].shape, dtype=ranks[root].dtype, device=devices[root])
    with _timed(devices):
        core.reduce([_summable(t).reshape(-1) for t in ranks],
                    output=_summable(result).reshape(-1), root=root)
    return result


def reduce_add_coalesced(inputs, destination=None, buffer_size=DEFAULT_BUFFER_SIZE):
    """Sums ``inputs[r][i]`` over the ranks ``r`` for every ``i`` (``inputs`` holds one list of
    tensors per rank), small tensors coalesced into buffers of at most ``buffer_size`` bytes;
    returns a tuple with one sum per ``i`` on ``destination`` (see ``reduce_add``)."""
    inputs = [list(rank) for rank in inputs]
    if not inputs:
        raise ValueError("ringreduce.comm.reduce_add_coalesced: inputs must hold one list of "
                         "tensors per rank")
    count = len(inputs[0])
    for r, rank in enumerate(inputs):
        if len(rank) != count:
            raise ValueError(f"ringreduce.comm.reduce_add_coalesced: inputs[{r}] holds "
                             f"{len(rank)} tensors, inputs[0] {count}")
    if count == 0:
        return ()
    devices = [rank[0].device for rank in inputs]
    root = _root("reduce_add_coalesced", devices, destination)
    outputs = [None] * count
    dense = []
    for i in range(count):
        group = [rank[i] for rank in inputs]
        if any(t.is_sparse for t in group):
            outputs[i] = reduce_add(group, devices[root])
        else:
            dense.append(i)
    first = [inputs[0][i] for i in dense]
    with _timed(devices):
        for bucket in _buckets(first, buffer_size):
            indices = [dense[j] for j in bucket]
            flats = [_flatten([_summable(rank[i]) for i in indices]) for rank in inputs]
            if len(flats) > 1:
                core.reduce(flats, root=root)
            like = [inputs[root][i] for i in indices]
            result = flats[root]
            if like[0].is_complex():
                result = torch.view_as_complex(result.view(-1, 2))
            for i, view in zip(indices, _unflatten(result, like)):
                outputs[i] = view
    return tuple(outputs)


# ---------------------------------------------------------------- scatter and gather

def _torch_comm_scatters(devices):
    """torch.cuda.comm.scatter needs CUDA targets (the source may be on the CPU) and a CUDA
    build of torch."""
    return torch.cuda.is_available() and all(d.type == "cuda" for d in devices)


def _torch_comm_gathers(tensors):
    """torch.cuda.comm.gather needs CUDA inputs (the destination may be the CPU)."""
    return torch.cuda.is_available() and all(t.device.type == "cuda" for t in tensors)


def scatter(tensor, devices=None, chunk_sizes=None, dim=0, streams=None, *, out=None):
    """Splits ``tensor`` along ``dim`` into chunks (``torch.chunk``'s, or ``chunk_sizes``)
    placed on ``devices``, or copies them into ``out`` (exactly one of the two); returns a
    tuple. A chunk on the source's own device is a view of ``tensor``. On CUDA this is
    ``torch.cuda.comm.scatter``."""
    if (devices is None) == (out is None):
        raise RuntimeError("ringreduce.comm.scatter: exactly one of 'devices' and 'out' must be "
                           f"specified; got devices={devices} and out={out}")
    if out is not None:
        out = list(out)
        if chunk_sizes is not None:
            raise RuntimeError("ringreduce.comm.scatter: 'chunk_sizes' must not be specified "
                               "with 'out' (the sizes of 'out' give them)")
        if _torch_comm_scatters([o.device for o in out]):
            return torch.cuda.comm.scatter(tensor, dim=dim, streams=streams, out=out)
        for o, c in zip(out, tensor.split([o.size(dim) for o in out], dim)):
            o.copy_(c)
        return tuple(out)
    devices = _devices(devices)
    if _torch_comm_scatters(devices):
        return torch.cuda.comm.scatter(tensor, devices, chunk_sizes, dim, streams)
    chunks = (tensor.chunk(len(devices), dim) if chunk_sizes is None
              else tensor.split(list(chunk_sizes), dim))
    return tuple(c.to(d) for c, d in zip(chunks, devices))


def gather(tensors, dim=0, destination=None, *, out=None):
    """Concatenates ``tensors`` along ``dim`` on ``destination`` (default: the current CUDA
    device, or the CPU when the tensors are on the CPU), or into ``out``. On CUDA this is
    ``torch.cuda.comm.gather``."""
    tensors = list(tensors)
    if out is not None:
        if destination is not None:
            raise RuntimeError("ringreduce.comm.gather: 'destination' must not be specified "
                               "with 'out'")
        if _torch_comm_gathers(tensors):
            return torch.cuda.comm.gather(tensors, dim, out=out)
        return torch.cat([t.to(out.device) for t in tensors], dim, out=out)
    if destination is None:
        destination = (torch.device("cuda", torch.cuda.current_device())
                       if any(t.device.type == "cuda" for t in tensors) else torch.device("cpu"))
    destination = as_device(destination)
    if _torch_comm_gathers(tensors):
        return torch.cuda.comm.gather(tensors, dim, destination)
    return torch.cat([t.to(destination) for t in tensors], dim)
