"""ringreduce: ring collectives across GPUs (or CPU ranks) as a PyTorch extension."""
__version__ = "0.1.0"

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
