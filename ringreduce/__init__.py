"""ringreduce: ring collectives across GPUs (or CPU ranks) as a PyTorch extension."""
__version__ = "0.1.0"

from ._build import load_extension as _load_extension

# The list API's extension: the one the install compiled, else compiled here on first import
# (once per torch version and build flags; ringreduce/_build.py).
_C = _load_extension("_C")

from .core import (OPS, SUPPORTED_DTYPES, all_gather, all_reduce, broadcast, build_info,
                   parse_op, peer_access, reduce, reduce_scatter, settings)
from . import comm
from .parallel import DataParallel, data_parallel
from .distributed import register_backend

__all__ = ["all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter", "parse_op",
           "build_info", "peer_access", "settings", "OPS", "SUPPORTED_DTYPES", "register_backend",
           "comm", "DataParallel", "data_parallel", "__version__"]

# The "ringreduce" torch.distributed backend (devices cpu and cuda). Importing
# ringreduce.distributed loads no compiled code, and registration is a no-op where
# torch.distributed is unavailable.
register_backend()


def __getattr__(name):
    """``ringreduce._dist_C`` (the backend's extension) loads, or compiles, on first use: the list
    API never pays for it."""
    if name == "_dist_C":
        return _load_extension(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
