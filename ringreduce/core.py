"""The public single-process API: ``all_reduce(tensors, op)`` over one tensor per rank."""
import os
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

__all__ = ["all_reduce", "parse_op", "build_info", "peer_access", "OPS", "SUPPORTED_DTYPES"]

OPS = ("sum", "avg", "max", "min", "prod")

SUPPORTED_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int32, torch.int64, torch.int8, torch.uint8,
)

_REDUCE_OP_NAMES = {"SUM": "sum", "AVG": "avg", "MAX": "max", "MIN": "min", "PRODUCT": "prod"}

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
        f"torch.distributed.ReduceOp (SUM, AVG, MAX, MIN, PRODUCT); got {op!r}")


def all_reduce(tensors, op="sum"):
    """All-reduces ``tensors`` (one per rank) in place with a ring; returns ``tensors``.

    Every tensor must have the same shape and dtype, be contiguous, and live on the CPU (all of
    them) or on CUDA devices (several on one device are distinct ranks). On CUDA the call is
    asynchronous: it is queued on each device's current stream after the work already there,
    and work queued there afterwards sees the result. Every rank ends with bitwise identical
    values. Bad arguments raise before any tensor is modified.

    ``RINGREDUCE_TRANSPORT=copy`` in the environment moves every CUDA hop with
    ``cudaMemcpyPeerAsync`` instead of kernels reading the neighbour's memory (the path used
    anyway between GPUs without peer access); the default is ``p2p``.
    """
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(
            "ringreduce.all_reduce: tensors must be a list of torch.Tensor, one per rank; "
            f"got {type(tensors).__name__}")
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"ringreduce.all_reduce: tensors[{i}] must be a torch.Tensor; got {type(t).__name__}")
    staged = _C.all_reduce(list(tensors), parse_op(op),
                           os.environ.get("RINGREDUCE_TRANSPORT", "p2p"))
    for pair in staged:
        if pair not in _warned_staged:
            _warned_staged.add(pair)
            warnings.warn(
                f"ringreduce: no peer-to-peer access for {pair}; that hop is staged through "
                "cudaMemcpyPeerAsync and is slower", RuntimeWarning, stacklevel=2)
    return tensors


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
