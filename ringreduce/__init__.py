"""ringreduce: ring all-reduce across GPUs (or CPU ranks) as a PyTorch extension."""
__version__ = "0.1.0"

from .core import OPS, SUPPORTED_DTYPES, all_reduce, build_info, parse_op, peer_access

__all__ = ["all_reduce", "parse_op", "build_info", "peer_access", "OPS", "SUPPORTED_DTYPES",
           "__version__"]
