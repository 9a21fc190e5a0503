"""``ringreduce.DataParallel``: ``torch.nn.DataParallel`` with its collectives on the ring.

The shape of ``torch.nn.parallel`` (``data_parallel.py``, ``replicate.py``, ``_functions.py``,
``scatter_gather.py``, ``parallel_apply.py``) is kept: at every forward the input is scattered
along ``dim``, the module replicated (``Broadcast``, an autograd Function over
``ringreduce.comm.broadcast_coalesced``), the replicas applied in threads, and the outputs
gathered on ``output_device``. In backward, ``Broadcast``'s gradient is ``ReduceAddCoalesced``,
which sums every replica's gradients onto the source device with ``ringreduce.reduce``.

What differs from torch:
- ``device_ids`` may repeat a GPU (simulated ranks) or list CPU devices
  (``[torch.device("cpu")] * 2``); every replica then still gets its own parameter and buffer
  tensors (the ring needs one buffer per rank), except the source replica, which uses the
  module's own (so in-place buffer updates such as BatchNorm's running statistics are kept,
  as in torch). ``device_ids`` is kept as a list of ``torch.device``.
- Gradients are summed in the ring's fixed order: results equal nn.DataParallel's up to
  that order, and are bitwise the same from run to run as long as the replicas' own
  computations are. (They are not always on a process's first forward: two threads making
  the process's first call of torch's CPU float64 tanh at once sometimes get a result one ulp
  off later calls; tests/test_data_parallel.py.)
- Without ``device_ids`` on a machine without a GPU, the module is called directly (as
  nn.DataParallel does without an accelerator).
"""
import threading
import warnings
from itertools import chain

import torch
from torch import nn
from torch.autograd import Function

from . import comm

__all__ = ["DataParallel", "data_parallel", "replicate", "scatter", "scatter_kwargs", "gather",
           "parallel_apply", "Broadcast", "ReduceAddCoalesced", "Scatter", "Gather"]


def _device_list(devices):
    devices = [comm.as_device(d) for d in devices]
    if len({d.type for d in devices}) > 1:
        raise ValueError(f"ringreduce.DataParallel: device_ids must all be CPU devices or all "
                         f"CUDA devices; got {[str(d) for d in devices]}")
    return devices


# ---------------------------------------------------------------- autograd functions

class Broadcast(Function):
    """Copies of ``inputs`` (all on ``devices[0]``) on every device; its gradient sums the
    copies' gradients onto the source (``ReduceAddCoalesced``)."""

    @staticmethod
    def forward(ctx, devices, *inputs):
        ctx.devices = devices
        if not inputs:
            return ()
        ctx.num_inputs = len(inputs)
        ctx.input_device = inputs[0].device
        outputs = comm.broadcast_coalesced(inputs, devices)
        non_differentiable = []
        for idx, needs_grad in enumerate(ctx.needs_input_grad[1:]):
            if not needs_grad:
                non_differentiable.extend(rank[idx] for rank in outputs)
        ctx.mark_non_differentiable(*non_differentiable)
        return tuple(chain.from_iterable(outputs))

    @staticmethod
    def backward(ctx, *grad_outputs):
        return (None,) + ReduceAddCoalesced.apply(ctx.input_device, ctx.num_inputs,
                                                  *grad_outputs)


class ReduceAddCoalesced(Function):
    """Sums ``grads`` (``num_inputs`` tensors per rank, rank after rank) onto ``destination``;
    its gradient broadcasts back to the ranks' devices."""

    @staticmethod
    def forward(ctx, destination, num_inputs, *grads):
        ctx.devices = [grads[i].device for i in range(0, len(grads), num_inputs)]
        per_rank = [grads[i:i + num_inputs] for i in range(0, len(grads), num_inputs)]
        return comm.reduce_add_coalesced(per_rank, destination)

    @staticmethod
    def backward(ctx, *grad_outputs):
        return (None, None) + Broadcast.apply(ctx.devices, *grad_outputs)


class Scatter(Function):
    """Chunks of ``input`` along ``dim`` on ``devices``; the gradient gathers them back."""

    @staticmethod
    def forward(ctx, devices, chunk_sizes, dim, input):
        ctx.dim = dim
        ctx.input_device = input.device
        return comm.scatter(input, devices, chunk_sizes, dim)

    @staticmethod
    def backward(ctx, *grad_outputs):
        return None, None, None, Gather.apply(ctx.input_device, ctx.dim, *grad_outputs)


class Gather(Function):
    """``inputs`` concatenated along ``dim`` on ``target_device`` (0-d inputs become a vector,
    with torch's warning); the gradient scatters back."""

    @staticmethod
    def forward(ctx, target_device, dim, *inputs):
        ctx.dim = dim
        ctx.input_devices = [t.device for t in inputs]
        ctx.unsqueezed_scalar = dim == 0 and all(t.dim() == 0 for t in inputs)
        if ctx.unsqueezed_scalar:
            warnings.warn("Was asked to gather along dimension 0, but all input tensors were "
                          "scalars; will instead unsqueeze and return a vector.", stacklevel=2)
            inputs = tuple(t.view(1) for t in inputs)
        ctx.input_sizes = [t.size(dim) for t in inputs]
        return comm.gather(inputs, dim, target_device)

    @staticmethod
    def backward(ctx, grad_output):
        grads = Scatter.apply(ctx.input_devices, ctx.input_sizes, ctx.dim, grad_output)
        if ctx.unsqueezed_scalar:
            grads = tuple(g[0] for g in grads)
        return (None, None) + tuple(grads)


# ---------------------------------------------------------------- scatter and gather

def _is_namedtuple(obj):
    return isinstance(obj, tuple) and hasattr(obj, "_asdict") and hasattr(obj, "_fields")


def scatter(inputs, devices, dim=0):
    """One object per device: tensors split along ``dim`` (``torch.chunk``'s sizes, so fewer
    objects than devices when a tensor has fewer slices), tuples, lists, named tuples and dicts
    split element-wise, anything else shared."""
    def scatter_map(obj):
        if isinstance(obj, torch.Tensor):
            return Scatter.apply(devices, None, dim, obj)
        if _is_namedtuple(obj):
            return [type(obj)(*args) for args in zip(*map(scatter_map, obj))]
        if isinstance(obj, tuple) and obj:
            return list(zip(*map(scatter_map, obj)))
        if isinstance(obj, list) and obj:
            return [list(i) for i in zip(*map(scatter_map, obj))]
        if isinstance(obj, dict) and obj:
            return [type(obj)(i) for i in zip(*map(scatter_map, obj.items()))]
        return [obj for _ in devices]

    return scatter_map(inputs)


def scatter_kwargs(inputs, kwargs, devices, dim=0):
    """``scatter`` of the positional and keyword arguments, padded to the same length."""
    scattered_inputs = scatter(inputs, devices, dim) if inputs else []
    scattered_kwargs = scatter(kwargs, devices, dim) if kwargs else []
    if len(scattered_inputs) < len(scattered_kwargs):
        scattered_inputs.extend(() for _ in range(len(scattered_kwargs) - len(scattered_inputs)))
    elif len(scattered_kwargs) < len(scattered_inputs):
        scattered_kwargs.extend({} for _ in range(len(scattered_inputs) - len(scattered_kwargs)))
    return tuple(scattered_inputs), tuple(scattered_kwargs)


def gather(outputs, target_device, dim=0):
    """The replicas' outputs (one object per replica) combined on ``target_device``: tensors
    concatenated along ``dim``, containers gathered element-wise."""
    def gather_map(outputs):
        out = outputs[0]
        if isinstance(out, torch.Tensor):
            return Gather.apply(target_device, dim, *outputs)
        if out is None:
            return None
        if isinstance(out, dict):
            if not all(len(out) == len(d) for d in outputs):
                raise ValueError("All dicts must have the same number of keys")
            return type(out)((k, gather_map([d[k] for d in outputs])) for k in out)
        if _is_namedtuple(out):
            return type(out)._make(map(gather_map, zip(*outputs)))
        return type(out)(map(gather_map, zip(*outputs)))

    return gather_map(outputs)


# ---------------------------------------------------------------- replicate

def _broadcast_coalesced_reshape(tensors, devices, detach):
    if not tensors:
        return [[] for _ in devices]
    if detach:
        return comm.broadcast_coalesced(tensors, devices)
    copies = Broadcast.apply(devices, *tensors)
    n = len(tensors)
    return [list(copies[i:i + n]) for i in range(0, len(copies), n)]


def replicate(network, devices, detach=False):
    """One replica of ``network`` per entry of ``devices`` (the first is where ``network``
    lives): modules shallow-copied, parameters and buffers broadcast over the ring. The first
    replica uses ``network``'s own tensors; the others get copies of their own even on a
    device shared with another replica. With ``detach`` the parameter copies are cut from the
    autograd graph (as torch does under ``no_grad``)."""
    devices = _device_list(devices)
    if not devices:
        return []
    for m in network.modules():
        if isinstance(m, torch.jit.ScriptModule):
            raise TypeError("ringreduce.replicate cannot copy TorchScript modules "
                            f"({type(m).__name__})")
    params = list(network.parameters())
    param_index = {p: i for i, p in enumerate(params)}
    param_copies = _broadcast_coalesced_reshape(params, devices, detach)

    buffers = list(network.buffers())
    with_grad = [b for b in buffers if b.requires_grad and not detach]
    without_grad = [b for b in buffers if not (b.requires_grad and not detach)]
    buffer_index = {}
    for i, b in enumerate(with_grad):
        buffer_index[b] = (True, i)
    for i, b in enumerate(without_grad):
        buffer_index[b] = (False, i)
    buffer_copies = {True: _broadcast_coalesced_reshape(with_grad, devices, detach),
                     False: _broadcast_coalesced_reshape(without_grad, devices, True)}

    modules = list(network.modules())
    module_index = {m: i for i, m in enumerate(modules)}
    copies = [[] for _ in devices]
    for module in modules:
        for j in range(len(devices)):
            replica = module._replicate_for_data_parallel()
            # Parameters become plain attributes of a replica (module.parameters() of a replica
            # is empty); torch records them here for DDP's sake, and so do we.
            replica._former_parameters = {}
            copies[j].append(replica)
    for i, module in enumerate(modules):
        for j in range(len(devices)):
            replica = copies[j][i]
            for key, child in module._modules.items():
                if child is None:
                    replica._modules[key] = None
                else:
                    setattr(replica, key, copies[j][module_index[child]])
            for key, param in module._parameters.items():
                if param is None:
                    replica._parameters[key] = None
                else:
                    copy = param_copies[j][param_index[param]]
                    setattr(replica, key, copy)
                    replica._former_parameters[key] = copy
            for key, buf in module._buffers.items():
                if buf is None:
                    replica._buffers[key] = None
                else:
                    requires_grad, idx = buffer_index[buf]
                    setattr(replica, key, buffer_copies[requires_grad][j][idx])
    return [copies[j][0] for j in range(len(devices))]


# ---------------------------------------------------------------- parallel_apply

def parallel_apply(modules, inputs, kwargs_tup=None, devices=None):
    """``modules[i](*inputs[i], **kwargs_tup[i])`` for every i, in one thread per replica (each
    with the caller's grad mode and autocast state, and on CUDA the caller's current stream of
    its device); returns the outputs in order and re-raises the first replica's error, with a
    note naming the replica."""
    n = len(modules)
    if len(inputs) != n:
        raise ValueError(f"parallel_apply: {n} modules but {len(inputs)} inputs")
    if kwargs_tup is None:
        kwargs_tup = ({},) * n
    elif len(kwargs_tup) != n:
        raise ValueError(f"parallel_apply: {n} modules but {len(kwargs_tup)} kwargs")
    if devices is None:
        devices = [_first_tensor_device(i) for i in inputs]
    devices = _device_list(devices)
    if len(devices) != n:
        raise ValueError(f"parallel_apply: {n} modules but {len(devices)} devices")
    streams = [torch.cuda.current_stream(d) if d.type == "cuda" else None for d in devices]
    grad_enabled = torch.is_grad_enabled()
    autocast = {t: (torch.is_autocast_enabled(t), torch.get_autocast_dtype(t))
                for t in {d.type for d in devices}}
    results = [None] * n
    errors = [None] * n

    def worker(i):
        device, stream = devices[i], streams[i]
        enabled, dtype = autocast[device.type]
        try:
            with torch.set_grad_enabled(grad_enabled), \
                    torch.autocast(device.type, dtype=dtype, enabled=enabled):
                args = inputs[i] if isinstance(inputs[i], (list, tuple)) else (inputs[i],)
                if stream is None:
                    results[i] = modules[i](*args, **kwargs_tup[i])
                else:
                    with torch.cuda.device(device), torch.cuda.stream(stream):
                        results[i] = modules[i](*args, **kwargs_tup[i])
        except Exception as e:  # re-raised in the caller's thread below
            e.add_note(f"in replica {i} on device {device}")
            errors[i] = e

    if n > 1:
        threads = [threading.Thread(target=worker, args=(i,), name=f"ringreduce-replica{i}")
                   for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    elif n == 1:
        worker(0)
    for e in errors:
        if e is not None:
            raise e
    return results


def _first_tensor_device(obj):
    if isinstance(obj, torch.Tensor):
        return obj.device
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    for item in items:
        d = _first_tensor_device(item)
        if d is not None:
            return d
    return None


# ---------------------------------------------------------------- the module

def _check_on_source(module, source):
    for t in chain(module.parameters(), module.buffers()):
        if t.device != source:
            raise RuntimeError("module must have its parameters and buffers on device "
                               f"{source} (device_ids[0]) but found one of them on device: "
                               f"{t.device}")


class DataParallel(nn.Module):
    """``torch.nn.DataParallel`` with its broadcast and gradient reduction on the ring.

    ``DataParallel(module, device_ids=None, output_device=None, dim=0)``: inputs are scattered
    along ``dim`` over ``device_ids`` (default: every visible GPU), ``module`` (which must live
    on ``device_ids[0]``) is replicated at every forward, the replicas run in parallel, and
    their outputs are gathered on ``output_device`` (default ``device_ids[0]``). Gradients
    of every replica are summed into ``module``'s parameters. ``device_ids`` may repeat a GPU
    or list CPU devices; without a GPU and without ``device_ids`` the module is called
    directly. ``state_dict`` keys carry the ``module.`` prefix, as nn.DataParallel's.
    """

    def __init__(self, module, device_ids=None, output_device=None, dim=0):
        super().__init__()
        self.module = module
        if device_ids is None:
            if not torch.cuda.is_available():
                self.device_ids = []
                return
            device_ids = list(range(torch.cuda.device_count()))
        if len(device_ids) == 0:
            raise ValueError("ringreduce.DataParallel: device_ids must list at least one device")
        self.dim = dim
        self.device_ids = _device_list(device_ids)
        if self.device_ids[0].type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"ringreduce.DataParallel: device_ids {self.device_ids} are CUDA "
                             "devices but CUDA is not available")
        self.output_device = comm.as_device(
            self.device_ids[0] if output_device is None else output_device)
        self.src_device_obj = self.device_ids[0]
        if len(self.device_ids) == 1:
            self.module.to(self.src_device_obj)

    def forward(self, *inputs, **kwargs):
        with torch.autograd.profiler.record_function("ringreduce.DataParallel.forward"):
            if not self.device_ids:
                return self.module(*inputs, **kwargs)
            _check_on_source(self.module, self.src_device_obj)
            inputs, module_kwargs = self.scatter(inputs, kwargs, self.device_ids)
            if not inputs and not module_kwargs:
                inputs, module_kwargs = ((),), ({},)
            if len(self.device_ids) == 1:
                return self.module(*inputs[0], **module_kwargs[0])
            replicas = self.replicate(self.module, self.device_ids[:len(inputs)])
            outputs = self.parallel_apply(replicas, inputs, module_kwargs)
            return self.gather(outputs, self.output_device)

    def replicate(self, module, device_ids):
        return replicate(module, device_ids, not torch.is_grad_enabled())

    def scatter(self, inputs, kwargs, device_ids):
        return scatter_kwargs(inputs, kwargs, device_ids, dim=self.dim)

    def parallel_apply(self, replicas, inputs, kwargs):
        return parallel_apply(replicas, inputs, kwargs, self.device_ids[:len(replicas)])

    def gather(self, outputs, output_device):
        return gather(outputs, output_device, dim=self.dim)


def data_parallel(module, inputs, device_ids=None, output_device=None, dim=0,
                  module_kwargs=None):
    """The functional form: ``module(*inputs)`` evaluated in parallel over ``device_ids``, the
    output on ``output_device`` (``torch.nn.parallel.data_parallel``'s signature)."""
    if not isinstance(inputs, tuple):
        inputs = (inputs,) if inputs is not None else ()
    if device_ids is None:
        if not torch.cuda.is_available():
            raise RuntimeError("ringreduce.data_parallel: no GPU; pass device_ids (CPU devices "
                               "work)")
        device_ids = list(range(torch.cuda.device_count()))
    device_ids = _device_list(device_ids)
    output_device = comm.as_device(device_ids[0] if output_device is None else output_device)
    _check_on_source(module, device_ids[0])
    inputs, module_kwargs = scatter_kwargs(inputs, module_kwargs, device_ids, dim)
    if not inputs and not module_kwargs:
        inputs, module_kwargs = ((),), ({},)
    if len(device_ids) == 1:
        return module(*inputs[0], **module_kwargs[0])
    used = device_ids[:len(inputs)]
    replicas = replicate(module, used)
    outputs = parallel_apply(replicas, inputs, module_kwargs, used)
    return gather(outputs, output_device, dim)
