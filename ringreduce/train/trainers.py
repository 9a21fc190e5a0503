"""Single-process data parallelism with a swappable gradient all-reduce.

One model replica per rank (a rank is a GPU, one of several simulated ranks sharing a GPU, or
the CPU), the minibatch split across the replicas, forward and backward on every replica, the
gradients summed across replicas by the chosen method, then the same optimizer step on every
replica. The method is the only thing that differs between runs:

- "ring":  ringreduce.all_reduce
- "nccl":  NCCL through torch.cuda.nccl (one rank per GPU), or libnccl called directly when
           several ranks share a GPU (needs NCCL >= 2.30 and NCCL_MULTI_RANK_GPU_ENABLE=1; the
           file RINGREDUCE_NCCL_LIB names when it is set, see ringreduce.train.nccl)
- "naive": sum everything on rank 0, then copy the sum back to every rank (the textbook way)

Gradients live in flat per-replica buckets (DDP's gradient_as_bucket_view): one all-reduce per
bucket of at most `bucket_mb` megabytes, or one per parameter with bucket_mb=0.

WrappedTrainer trains the d2l way instead: one model wrapped in ringreduce.DataParallel
("dataparallel") or torch.nn.DataParallel ("nn-dataparallel"), which replicate it at every
forward and sum the replicas' gradients into it in backward.
"""

import contextlib
import copy
import os
import threading
import time

import torch
import torch.nn.functional as F

from ..comm import pack_indices
from .nccl import (MULTI_RANK_MIN_VERSION, NEWER_NCCL_HINT, LibNccl, NcclLibraryError,
                   load_libnccl, requested_library, torch_nccl_library)

METHODS = ("ring", "nccl", "naive")
WRAPPERS = ("replicas", "dataparallel", "nn-dataparallel")
DEFAULT_BUCKET_MB = 25.0
# Bound on the wait for NCCL's probe all-reduce (its first call, which connects the ranks): a
# rank that never joins must become an error naming it, not a hang.
NCCL_TIMEOUT_S = 120.0


def parse_devices(device=None, ranks=None):
    """The device of every rank, from the trainer's --device and --ranks.

    device: None (CUDA if available, else CPU), "cpu", "cuda" (ranks spread round-robin over
    the visible GPUs, several per GPU when there are more ranks than GPUs), "cuda:N" (every
    rank on GPU N), or a comma-separated list with one device per rank ("cuda:0,cuda:0").
    ranks: None means 2 on CPU, one per visible GPU on "cuda", and the list's length for a list.
    """
    if ranks is not None and ranks < 1:
        raise ValueError(f"--ranks must be >= 1, got {ranks}")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    specs = [s.strip() for s in device.split(",")]
    try:
        parsed = [torch.device(s) for s in specs]
    except RuntimeError as e:
        raise ValueError(f"--device {device!r}: {e}") from e
    types = {d.type for d in parsed}
    if not types <= {"cpu", "cuda"}:
        raise ValueError(f"--device {device!r}: only cpu and cuda devices are supported")
    if len(types) > 1:
        raise ValueError(f"--device {device!r}: all ranks must be on CPU or all on CUDA")
    if "cuda" in types:
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device!r}: CUDA is not available (torch "
                             f"{torch.__version__}, built with CUDA {torch.version.cuda})")
        count = torch.cuda.device_count()
        for d in parsed:
            if d.index is not None and d.index >= count:
                raise ValueError(f"--device {device!r}: {d} does not exist ({count} GPU(s) visible)")
    if len(parsed) > 1:
        if ranks is not None and ranks != len(parsed):
            raise ValueError(f"--ranks {ranks} disagrees with --device {device!r}, "
                             f"which lists {len(parsed)} devices")
        return [_with_index(d) for d in parsed]
    d = parsed[0]
    if d.type == "cpu":
        return [torch.device("cpu")] * (2 if ranks is None else ranks)
    if d.index is not None:
        return [d] * (1 if ranks is None else ranks)
    count = torch.cuda.device_count()
    n = count if ranks is None else ranks
    return [torch.device("cuda", r % count) for r in range(n)]


def _with_index(d):
    if d.type == "cuda" and d.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return d


def naive_all_reduce(tensors):
    """Sum on rank 0 in rank order, then copy the sum back to every other rank (d2l's allreduce).

    Cross-device copies are ordered with the current streams of both devices by PyTorch.
    """
    root = tensors[0]
    for t in tensors[1:]:
        root.add_(t.to(root.device, non_blocking=True))
    for t in tensors[1:]:
        t.copy_(root, non_blocking=True)
    return tensors


def _ring_all_reduce(tensors):
    import ringreduce  # the lead's core package: imported only when the ring method is used

    ringreduce.all_reduce(tensors, op="sum")
    return tensors


class NcclUnavailable(RuntimeError):
    """NCCL cannot run on these ranks; the message says why."""


def nccl_skip_reason(devices):
    """Why the nccl method cannot run on these ranks, or None if it should (a probe still runs)."""
    if any(d.type != "cuda" for d in devices):
        return f"NCCL needs CUDA ranks, these are on {sorted({str(d) for d in devices})}"
    if not hasattr(torch._C, "_nccl_all_reduce"):
        return f"torch {torch.__version__} was built without NCCL"
    if len(set(devices)) < len(devices):
        try:
            library = load_libnccl()[1]  # what LibNccl will call
        except NcclLibraryError as e:
            return str(e)
        if library.version < MULTI_RANK_MIN_VERSION:
            hint = "" if requested_library() else f"; {NEWER_NCCL_HINT}"
            return (f"{library.describe()} refuses several ranks on one GPU "
                    f"('Duplicate GPU detected'); that needs NCCL >= "
                    f"{'.'.join(map(str, MULTI_RANK_MIN_VERSION))} "
                    f"with NCCL_MULTI_RANK_GPU_ENABLE=1{hint}")
        if os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") != "1":
            return (f"{library.describe()} runs several ranks on one GPU only with "
                    f"NCCL_MULTI_RANK_GPU_ENABLE=1 in the environment")
    return None


def nccl_route(fn):
    """(route, NcclLibrary) of a function make_all_reduce("nccl", ...) returned: libnccl called
    directly (ranks sharing a GPU) or torch.cuda.nccl, and the library that runs."""
    if isinstance(fn, LibNccl):
        return "libnccl via ctypes (ncclCommInitAll)", fn.library
    return "torch.cuda.nccl.all_reduce", torch_nccl_library()


def _nccl_unique_devices(tensors):
    torch.cuda.nccl.all_reduce(tensors)
    return tensors


def _probe_nccl(fn, devices):
    """One small all-reduce, waited for with a timeout (NCCL's first call connects the ranks
    and can block the calling thread, so it runs in a daemon thread); NcclUnavailable with the
    cause when it fails, hangs or sums wrongly."""
    n = len(devices)
    probe = [torch.full((64,), float(r + 1), device=d) for r, d in enumerate(devices)]
    streams = [torch.cuda.current_stream(d) for d in devices]
    events, errors = [], []

    def body():
        try:
            with contextlib.ExitStack() as stack:
                for s in streams:  # the caller's current streams (they are per thread)
                    stack.enter_context(torch.cuda.stream(s))
                fn(probe)
            for s in streams:
                e = torch.cuda.Event()
                e.record(s)
                events.append(e)
        except Exception as e:  # reported below as the reason NCCL is unavailable
            errors.append(e)

    where = f"{nccl_route(fn)[1].describe()} on {n} ranks {[str(d) for d in devices]}"
    thread = threading.Thread(target=body, daemon=True, name="rr-nccl-probe")
    thread.start()
    deadline = time.monotonic() + NCCL_TIMEOUT_S
    thread.join(NCCL_TIMEOUT_S)
    if thread.is_alive():
        raise NcclUnavailable(f"{where}: a 64-element probe all-reduce did not return within "
                              f"{NCCL_TIMEOUT_S:.0f} s")
    if errors:
        raise NcclUnavailable(f"{where}: a probe all-reduce failed: {errors[0]}") from errors[0]
    for rank, e in enumerate(events):
        while not e.query():
            if time.monotonic() > deadline:
                raise NcclUnavailable(f"{where}: rank {rank} did not finish a 64-element probe "
                                      f"all-reduce within {NCCL_TIMEOUT_S:.0f} s")
            time.sleep(0.001)
    expected = n * (n + 1) / 2
    for rank, t in enumerate(probe):
        if not torch.all(t == expected):
            raise NcclUnavailable(f"{where}: the probe all-reduce gave {t[0].item()} on rank "
                                  f"{rank} instead of {expected}")


def make_all_reduce(method, devices):
    """A function that sums a list of tensors (one per rank, on `devices`) in place.

    Raises NcclUnavailable, saying why, when method is "nccl" and NCCL cannot run here.
    """
    if method == "ring":
        return _ring_all_reduce
    if method == "naive":
        return naive_all_reduce
    if method != "nccl":
        raise ValueError(f"all-reduce method must be one of {', '.join(METHODS)}, got {method!r}")
    reason = nccl_skip_reason(devices)
    if reason is not None:
        raise NcclUnavailable(reason)
    try:
        fn = _nccl_unique_devices if len(set(devices)) == len(devices) else LibNccl(devices, "sum")
    except RuntimeError as e:
        raise NcclUnavailable(f"NCCL set-up failed: {e}") from e
    _probe_nccl(fn, devices)
    return fn


def bucket_indices(numels, element_size, bucket_mb):
    """Group parameter indices into buckets of at most bucket_mb megabytes (10**6 bytes).

    Reverse registration order, as DDP does (gradients become ready roughly back to front); a
    parameter larger than the cap gets a bucket of its own. bucket_mb <= 0: one per parameter.
    """
    order = list(reversed(range(len(numels))))
    if bucket_mb <= 0:
        return [[i] for i in order]
    return pack_indices(order, lambda i: numels[i] * element_size, bucket_mb * 1e6)


class _Ranks:
    """What both trainers share: ``devices``, one per rank, and ``_cuda``."""

    @property
    def num_ranks(self):
        return len(self.devices)

    def synchronize(self):
        if self._cuda:
            for d in dict.fromkeys(self.devices):
                torch.cuda.synchronize(d)


class ReplicaTrainer(_Ranks):
    """Replicas of `model` on `devices`, trained in lockstep with a swappable gradient all-reduce.

    step(x, y) splits the minibatch across the replicas, runs forward and backward on every
    replica, sums the gradients with the chosen method and takes one SGD step on every replica.
    Each replica's loss is the cross-entropy summed over its shard divided by the full batch
    size, so the summed gradient is the gradient of the mean loss over the full batch, whatever
    the shard sizes.

    BatchNorm (in training mode) normalises with each replica's own shard statistics, as
    DDP without SyncBatchNorm does; the running statistics differ between replicas until
    sync_buffers() averages them (evaluate() does so first). Because they are exponential
    moving averages, averaging them once equals averaging them every step.
    """

    def __init__(self, model, devices, all_reduce="ring", lr=0.1, momentum=0.0, weight_decay=0.0,
                 bucket_mb=DEFAULT_BUCKET_MB):
        if not devices:
            raise ValueError("devices must list at least one rank")
        self.devices = list(devices)
        self.method = all_reduce
        self._all_reduce = make_all_reduce(all_reduce, self.devices)
        self.replicas = [copy.deepcopy(model).to(d) for d in self.devices]
        params = [list(m.parameters()) for m in self.replicas]
        dtypes = {p.dtype for p in params[0]}
        if len(dtypes) != 1:
            raise ValueError(f"model parameters must share one dtype to be bucketed, got {dtypes}")
        numels = [p.numel() for p in params[0]]
        element_size = params[0][0].element_size()
        self.buckets = bucket_indices(numels, element_size, bucket_mb)
        self.grad_bytes = sum(numels) * element_size
        self.flat_grads = []  # [bucket][rank]
        self._grad_ptrs = []  # per rank: the data pointer each parameter's grad must keep
        for b in self.buckets:
            total = sum(numels[i] for i in b)
            self.flat_grads.append([torch.zeros(total, dtype=params[0][0].dtype, device=d)
                                    for d in self.devices])
        for r in range(len(self.devices)):
            for b, bucket in enumerate(self.buckets):
                offset = 0
                for i in bucket:
                    p = params[r][i]
                    p.grad = self.flat_grads[b][r][offset:offset + numels[i]].view_as(p)
                    offset += numels[i]
            self._grad_ptrs.append([p.grad.data_ptr() for p in params[r]])
        self._params = params
        self.optimizers = [torch.optim.SGD(p, lr=lr, momentum=momentum, weight_decay=weight_decay)
                           for p in params]
        self._cuda = self.devices[0].type == "cuda"
        self._streams = ([torch.cuda.Stream(device=d) for d in self.devices] if self._cuda
                         else None)
        self.time_comm = False
        self._comm_marks = []

    def train(self):
        for m in self.replicas:
            m.train()

    def eval(self):
        for m in self.replicas:
            m.eval()

    def _replica_context(self, rank):
        if self._cuda:
            return torch.cuda.stream(self._streams[rank])
        return contextlib.nullcontext()

    def _current_streams(self):
        return {d: torch.cuda.current_stream(d) for d in dict.fromkeys(self.devices)}

    @property
    def nccl(self):
        """(route, NcclLibrary) of the nccl method (see nccl_route); None for the others."""
        return nccl_route(self._all_reduce) if self.method == "nccl" else None

    def all_reduce(self, tensors):
        """Sum `tensors` (one per rank) in place with this run's method; a no-op for one rank."""
        if len(tensors) > 1:
            self._all_reduce(tensors)

    def step(self, x, y):
        """One training step on the minibatch (x, y); returns the full-batch mean loss as a
        0-d tensor on the first rank's device (not synchronised)."""
        n = self.num_ranks
        if len(y) < n:
            raise ValueError(f"a minibatch of {len(y)} samples cannot feed {n} ranks")
        if self._cuda and x.device.type == "cpu":
            x, y = x.pin_memory(), y.pin_memory()
        xs, ys = torch.tensor_split(x, n), torch.tensor_split(y, n)
        if self._cuda:
            current = self._current_streams()
            for r in range(n):
                # Parameters, grads and optimizer state were last written on the current stream.
                self._streams[r].wait_stream(current[self.devices[r]])
        losses = []
        # CUDA: each replica's work is queued on its own stream, so the replicas run
        # concurrently on the GPU(s) while this thread queues the next one. CPU: the replicas
        # run one after another (each already uses all cores through intra-op threads).
        for r in range(n):
            with self._replica_context(r):
                for flat in self.flat_grads:
                    flat[r].zero_()
                xr = xs[r].to(self.devices[r], non_blocking=True)
                yr = ys[r].to(self.devices[r], non_blocking=True)
                loss = F.cross_entropy(self.replicas[r](xr), yr, reduction="sum") / len(y)
                loss.backward()
                losses.append(loss.detach())
        self._check_grads_are_bucket_views()
        if self._cuda:
            current = self._current_streams()
            for r in range(n):
                current[self.devices[r]].wait_stream(self._streams[r])
        self._mark_comm("start")
        for flat in self.flat_grads:
            self.all_reduce(flat)
        self._mark_comm("end")
        for opt in self.optimizers:
            opt.step()
        first = self.devices[0]
        return torch.stack([l.to(first) for l in losses]).sum()

    def _check_grads_are_bucket_views(self):
        for r, params in enumerate(self._params):
            for p, ptr in zip(params, self._grad_ptrs[r]):
                if p.grad is None or p.grad.data_ptr() != ptr:
                    raise RuntimeError("a parameter's .grad no longer views its all-reduce bucket "
                                       "(was zero_grad(set_to_none=True) or a grad assignment "
                                       "used on a replica?)")

    def _mark_comm(self, which):
        if not self.time_comm:
            return
        if self._cuda:
            marks = {}
            for d, s in self._current_streams().items():
                e = torch.cuda.Event(enable_timing=True)
                e.record(s)
                marks[d] = e
        else:
            marks = time.perf_counter()
        if which == "start":
            self._comm_marks.append([marks, None])
        else:
            self._comm_marks[-1][1] = marks

    def pop_comm_seconds(self):
        """Seconds spent in the gradient all-reduce, per step since the last call (needs
        time_comm = True). CUDA: measured with events on every device's current stream, from
        the end of that device's backward passes; the slowest device counts. A rank that waits
        inside the all-reduce for a slower peer's backward counts that wait as communication."""
        out = []
        for start, end in self._comm_marks:
            if self._cuda:
                for e in end.values():
                    e.synchronize()
                out.append(max(start[d].elapsed_time(end[d]) for d in start) / 1e3)
            else:
                out.append(end - start)
        self._comm_marks = []
        return out

    def sync_buffers(self):
        """Average floating-point buffers (BatchNorm running statistics) across the replicas
        with this run's all-reduce; afterwards every replica holds bitwise the same buffers."""
        if self.num_ranks == 1:
            return
        names = [name for name, b in self.replicas[0].named_buffers() if b.is_floating_point()]
        if not names:
            return
        per_rank = [dict(m.named_buffers()) for m in self.replicas]
        flats = [torch.cat([bufs[name].reshape(-1) for name in names]) for bufs in per_rank]
        self.all_reduce(flats)
        for bufs, flat in zip(per_rank, flats):
            flat.div_(self.num_ranks)
            offset = 0
            for name in names:
                b = bufs[name]
                b.copy_(flat[offset:offset + b.numel()].view_as(b))
                offset += b.numel()

    @torch.no_grad()
    def evaluate(self, x, y, batch_size=256):
        """Accuracy of the first replica on (x, y), after sync_buffers(); restores the mode."""
        self.sync_buffers()
        model, device = self.replicas[0], self.devices[0]
        was_training = model.training
        model.eval()
        correct = torch.zeros((), dtype=torch.int64, device=device)
        for start in range(0, len(y), batch_size):
            xb = x[start:start + batch_size].to(device, non_blocking=True)
            yb = y[start:start + batch_size].to(device, non_blocking=True)
            correct += (model(xb).argmax(dim=1) == yb).sum()
        model.train(was_training)
        return correct.item() / max(1, len(y))


class WrapperUnavailable(RuntimeError):
    """The module wrapper cannot run on these ranks; the message says why."""


def nn_dataparallel_skip_reason(devices):
    """Why torch.nn.DataParallel cannot train on these ranks, or None."""
    if any(d.type != "cuda" for d in devices):
        return ("torch.nn.DataParallel replicates only on CUDA GPUs (without one it calls the "
                f"module directly); these ranks are on {sorted({str(d) for d in devices})}")
    if len(set(devices)) < len(devices):
        return ("torch.nn.DataParallel takes one replica per GPU (distinct device ids); these "
                f"ranks are {[str(d) for d in devices]} ({len(set(devices))} GPU(s))")
    return None


class WrappedTrainer(_Ranks):
    """The d2l way: ``model`` on the first rank's device, wrapped in ringreduce.DataParallel
    ("dataparallel") or torch.nn.DataParallel ("nn-dataparallel") over ``devices``, with one
    SGD optimizer over the wrapper's parameters. The interface of ReplicaTrainer above.

    step(x, y) is d2l's loop body: zero_grad, the wrapper's forward (scatter, replicate,
    parallel apply, gather), the full-batch mean cross-entropy, backward (the replicas'
    gradients summed into the model), step. BatchNorm normalises with each replica's shard
    statistics; the running statistics are those of the first replica (nn.DataParallel's
    rule), so there is nothing to synchronise before evaluation.

    time_comm = True: the time spent in ringreduce.comm's collectives (the broadcast of
    parameters and buffers, the gradient reduction) is recorded per step ("dataparallel"
    only; torch.cuda.comm is not instrumented).
    """

    def __init__(self, model, devices, wrapper="dataparallel", lr=0.1, momentum=0.0,
                 weight_decay=0.0):
        if not devices:
            raise ValueError("devices must list at least one rank")
        self.devices = list(devices)
        self.wrapper = wrapper
        if wrapper == "nn-dataparallel":
            reason = nn_dataparallel_skip_reason(self.devices)
            if reason is not None:
                raise WrapperUnavailable(reason)
        elif wrapper != "dataparallel":
            raise ValueError(f"wrapper must be dataparallel or nn-dataparallel, got {wrapper!r}")
        self.model = copy.deepcopy(model).to(self.devices[0])
        if wrapper == "dataparallel":
            import ringreduce

            self.net = ringreduce.DataParallel(self.model, device_ids=self.devices)
        else:
            self.net = torch.nn.DataParallel(self.model,
                                             device_ids=[d.index for d in self.devices])
        self.optimizer = torch.optim.SGD(self.net.parameters(), lr=lr, momentum=momentum,
                                         weight_decay=weight_decay)
        self._cuda = self.devices[0].type == "cuda"
        self.time_comm = False
        self._timers = []

    def train(self):
        self.net.train()

    def eval(self):
        self.net.eval()

    def step(self, x, y):
        """One training step on the minibatch (x, y); returns the full-batch mean loss as a
        0-d tensor on the first rank's device (not synchronised)."""
        if len(y) < self.num_ranks:
            raise ValueError(f"a minibatch of {len(y)} samples cannot feed {self.num_ranks} "
                             "ranks")
        if self._cuda and x.device.type == "cpu":
            x, y = x.pin_memory(), y.pin_memory()
        timer = None
        if self.time_comm and self.wrapper == "dataparallel":
            from ..comm import CommTimer

            timer = CommTimer()
            self._timers.append(timer)
        self.optimizer.zero_grad()
        with timer if timer is not None else contextlib.nullcontext():
            out = self.net(x)
            loss = F.cross_entropy(out, y.to(out.device, non_blocking=True))
            loss.backward()
        self.optimizer.step()
        return loss.detach()

    def pop_comm_seconds(self):
        """Seconds spent in the ring's collectives, per step since the last call (needs
        time_comm = True and the "dataparallel" wrapper)."""
        out = [t.seconds() for t in self._timers]
        self._timers = []
        return out

    @torch.no_grad()
    def evaluate(self, x, y, batch_size=256):
        """Accuracy of the wrapped model on (x, y), evaluated through the wrapper (as d2l's
        evaluate_accuracy_gpu does); restores the mode."""
        was_training = self.net.training
        self.net.eval()
        correct = torch.zeros((), dtype=torch.int64, device=self.devices[0])
        for start in range(0, len(y), batch_size):
            out = self.net(x[start:start + batch_size])
            yb = y[start:start + batch_size].to(out.device, non_blocking=True)
            correct += (out.argmax(dim=1) == yb).sum().to(correct.device)
        self.net.train(was_training)
        return correct.item() / max(1, len(y))
