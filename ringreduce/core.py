"""The public single-process API: collectives over a list with one tensor per rank, with the
signatures of ``torch.cuda.nccl`` (``all_reduce``, ``reduce``, ``broadcast``, ``all_gather``,
``reduce_scatter``)."""
import operator
import warnings

import torch
import torch.distributed

try:
    from . import _C
except ImportError as exc:  # pragma: no cover - only without a build
    raise ImportError(
        "ringreduce's compiled extension is missing; install the package with "
        "`pip install --no-build-isolation --use-pep517 -e .` from the repository root"
    ) from exc

__all__ = ["all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter", "parse_op",
           "build_info", "peer_access", "settings", "OPS", "SUPPORTED_DTYPES"]

OPS = ("sum", "avg", "max", "min", "prod", "band", "bor", "bxor")

SUPPORTED_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int32, torch.int64, torch.int8, torch.uint8, torch.bool,
)

_REDUCE_OP_NAMES = {"SUM": "sum", "AVG": "avg", "MAX": "max", "MIN": "min", "PRODUCT": "prod",
                    "BAND": "band", "BOR": "bor", "BXOR": "bxor"}

_warned_staged = set()


def parse_op(op):
    """Normalises ``op`` (a name, or a ``torch.distributed.ReduceOp``) to one of ``OPS``."""
    if isinstance(op, str):
        name = op.lower()
        if name in OPS:
            return name
        raise ValueError(f"ringreduce: op must be one of {', '.join(OPS)}; got {op!r}")
    if torch.distributed.is_available():
        reduce_op = torch.distributed.ReduceOp
        if isinstance(op, (reduce_op, reduce_op.RedOpType)):
            for member, name in _REDUCE_OP_NAMES.items():
                if op == getattr(reduce_op, member):
                    return name
    raise ValueError(
        f"ringreduce: op must be one of {', '.join(OPS)} or the matching "
        f"torch.distributed.ReduceOp ({', '.join(_REDUCE_OP_NAMES)}); got {op!r}")


def _tensor_list(fn, name, value):
    if isinstance(value, torch.Tensor) or not isinstance(value, (list, tuple)):
        raise TypeError(
            f"ringreduce.{fn}: {name} must be a list of torch.Tensor, one per rank; "
            f"got {type(value).__name__}")
    for i, t in enumerate(value):
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"ringreduce.{fn}: {name}[{i}] must be a torch.Tensor; got {type(t).__name__}")
    return list(value)


def _streams(fn, streams):
    """``None`` or one ``torch.cuda.Stream`` (or ``None``) per rank, as torch.cuda.nccl takes."""
    if streams is None:
        return []
    if isinstance(streams, torch.Stream) or not isinstance(streams, (list, tuple)):
        raise TypeError(f"ringreduce.{fn}: streams must be None or a list with one stream (or "
                        f"None) per rank; got {type(streams).__name__}")
    for i, s in enumerate(streams):
        if s is not None and not isinstance(s, (torch.Stream, torch.cuda.Stream)):
            raise TypeError(f"ringreduce.{fn}: streams[{i}] must be a torch.cuda.Stream or None; "
                            f"got {type(s).__name__}")
    return list(streams)


def _no_comms(fn, comms):
    if comms is not None:
        raise ValueError(
            f"ringreduce.{fn}: comms (NCCL communicators) do not apply to ringreduce, which needs "
            "none; pass None")


def _root(fn, root):
    if isinstance(root, bool):
        raise TypeError(f"ringreduce.{fn}: root must be an int rank; got bool")
    try:
        return operator.index(root)
    except TypeError:
        raise TypeError(
            f"ringreduce.{fn}: root must be an int rank; got {type(root).__name__}") from None


# Predicted, not yet measured: on one stream of one GPU the one-shot kernel moves fewer bytes
# than the ring (2*N*S against 5*S*(N-1)) in one launch instead of 2(N-1), so it should win at
# every size; it is kept to small messages until bench/ring.py on a GPU says where it wins.
ONESHOT_DEFAULT_BYTES = _C.ONESHOT_DEFAULT_BYTES


def settings():
    """The environment's settings as the next call reads them: ``transport``
    (``RINGREDUCE_TRANSPORT``, default ``p2p``), ``oneshot_max_bytes``
    (``RINGREDUCE_ONESHOT_BYTES``, default 65536), ``half_rounding``
    (``RINGREDUCE_HALF_ROUNDING``, default ``once``: CPU float16 / bfloat16 sums rounded once;
    ``per_hop``: on every ring hop), ``fused`` (``RINGREDUCE_FUSED=1``: the fused ring kernel,
    experimental; default off) and ``cuda_half_rounding`` (``RINGREDUCE_CUDA_HALF_ROUNDING``,
    default ``per_hop``; ``once``, experimental: CUDA float16 / bfloat16 sums on one stream of
    one GPU rounded once, as on CPU). Raises ValueError on a bad value."""
    return dict(_C.settings())


def _warn_staged(staged):
    for pair in staged:
        if pair not in _warned_staged:
            _warned_staged.add(pair)
            warnings.warn(
                f"ringreduce: no peer-to-peer access for {pair}; that hop is staged through "
                "cudaMemcpyPeerAsync and is slower", RuntimeWarning, stacklevel=3)


def all_reduce(tensors, op="sum", *, outputs=None, streams=None, comms=None):
    """All-reduces ``tensors`` (one per rank) with a ring; returns ``tensors`` (or ``outputs``).

    Every tensor must have the same shape and dtype, be contiguous, and live on the CPU (all of
    them) or on CUDA devices (several on one device are distinct ranks). Without ``outputs``
    the result replaces each tensor (in place); with ``outputs`` (one per rank, same dtype and
    number of elements, on the rank's device) the inputs stay unchanged, and ``outputs[i]`` may
    be ``tensors[i]`` itself. On CUDA the call is asynchronous: it is queued on each device's
    current stream (or ``streams[i]``) after the work already there, and work queued there
    afterwards sees the result. Every rank ends with bitwise identical values. Bad arguments
    raise before any tensor is modified.

    Like ``torch.cuda.nccl.all_reduce`` except that ``op`` stays the second positional argument
    (as it always was here); ``outputs``, ``streams`` and ``comms`` are keyword-only. ``comms``
    must be None.

    ``RINGREDUCE_TRANSPORT=copy`` in the environment moves every CUDA hop with
    ``cudaMemcpyPeerAsync`` instead of kernels reading the neighbour's memory (the path used
    anyway between GPUs without peer access); the default is ``p2p``.

    When every rank runs on one stream of one GPU (simulated ranks) and a tensor holds at most
    ``RINGREDUCE_ONESHOT_BYTES`` (default 65536; 0 turns it off), one kernel reduces every
    element over all ranks in the ring's order instead of 2(N-1) ring steps: the same bits.
    Above that size ``RINGREDUCE_FUSED=1`` (experimental, off by default) runs the ring as one
    cooperative kernel instead of 2(N-1) step kernels, with the ring's bits; that call is
    synchronous (it waits for the kernel and raises if the kernel reported a failure) and is
    not taken under CUDA-graph capture (the ring is).
    """
    if isinstance(op, (list, tuple)):
        raise TypeError(
            "ringreduce.all_reduce: op is the second positional argument; pass the output "
            "tensors as outputs=[...] (torch.cuda.nccl.all_reduce takes them positionally)")
    tensors_list = _tensor_list("all_reduce", "tensors", tensors)
    outputs_list = None if outputs is None else _tensor_list("all_reduce", "outputs", outputs)
    _no_comms("all_reduce", comms)
    _warn_staged(_C.all_reduce(tensors_list, outputs_list, parse_op(op),
                               _streams("all_reduce", streams)))
    return tensors if outputs is None else outputs


def reduce(inputs, output=None, root=0, op="sum", streams=None, comms=None):
    """Reduces ``inputs`` (one per rank) into ``output`` on rank ``root``; returns ``output``.

    ``output`` defaults to ``inputs[root]`` (in place there); otherwise it must live on the
    root's device with the inputs' dtype and number of elements. No other tensor changes. The
    result has the bits ``all_reduce`` would give. Signature of ``torch.cuda.nccl.reduce``
    (``output`` is one tensor; its deprecated list forms are not accepted).
    """
    inputs_list = _tensor_list("reduce", "inputs", inputs)
    if output is not None and not isinstance(output, torch.Tensor):
        raise TypeError(
            "ringreduce.reduce: output must be one torch.Tensor (the root's result) or None; "
            f"got {type(output).__name__}")
    root = _root("reduce", root)
    _no_comms("reduce", comms)
    _warn_staged(_C.reduce(inputs_list, output, root, parse_op(op),
                           _streams("reduce", streams)))
    return inputs_list[root] if output is None else output


def broadcast(inputs, root=0, streams=None, comms=None):
    """Copies ``inputs[root]`` into every other tensor of ``inputs`` (one per rank, same shape
    and dtype); returns ``inputs``. Signature of ``torch.cuda.nccl.broadcast``."""
    inputs_list = _tensor_list("broadcast", "inputs", inputs)
    root = _root("broadcast", root)
    _no_comms("broadcast", comms)
    _warn_staged(_C.broadcast(inputs_list, root, _streams("broadcast", streams)))
    return inputs


def all_gather(inputs, outputs, streams=None, comms=None):
    """``outputs[i]`` = the concatenation of every input along dim 0 (flattened: each output
    holds ``len(inputs) * inputs[0].numel()`` elements, any shape); returns ``outputs``.
    ``inputs[i]`` may be block ``i`` of ``outputs[i]`` (in place). Signature of
    ``torch.cuda.nccl.all_gather``."""
    inputs_list = _tensor_list("all_gather", "inputs", inputs)
    outputs_list = _tensor_list("all_gather", "outputs", outputs)
    _no_comms("all_gather", comms)
    _warn_staged(_C.all_gather(inputs_list, outputs_list, _streams("all_gather", streams)))
    return outputs


def reduce_scatter(inputs, outputs, op="sum", streams=None, comms=None):
    """``outputs[i]`` = the reduction of block ``i`` of every input (each input holds
    ``len(inputs)`` blocks of ``outputs[i].numel()`` elements, flattened); returns ``outputs``.
    The inputs stay unchanged; ``outputs[i]`` may be block ``i`` of ``inputs[i]`` (in place).
    Signature of ``torch.cuda.nccl.reduce_scatter``."""
    inputs_list = _tensor_list("reduce_scatter", "inputs", inputs)
    outputs_list = _tensor_list("reduce_scatter", "outputs", outputs)
    _no_comms("reduce_scatter", comms)
    _warn_staged(_C.reduce_scatter(inputs_list, outputs_list, parse_op(op),
                                   _streams("reduce_scatter", streams)))
    return outputs


def build_info():
    """How this installation was built, with the versions it runs against."""
    info = dict(_C.build_info())
    archs = info.pop("arch_list")
    info["arch_list"] = [f"{a[:-1]}.{a[-1]}" if a.isdigit() else a for a in archs.split("_") if a]
    from . import __version__

    info["version"] = __version__
    info["torch_version"] = torch.__version__
    info["cuda_version"] = torch.version.cuda
    return info


def peer_access():
    """Device names and the matrix of ``cudaDeviceCanAccessPeer`` for the visible GPUs."""
    return dict(_C.peer_access())
