"""NCCL for ranks that share a GPU, called directly through ctypes (for comparisons only).

``torch.cuda.nccl.all_reduce`` rejects two tensors on one device ("inputs must be on unique
devices") whatever the NCCL version, so a single process comparing ringreduce with NCCL on
simulated ranks makes its communicators with ``ncclCommInitAll`` and the device repeated, which
NCCL >= 2.30 accepts with ``NCCL_MULTI_RANK_GPU_ENABLE=1`` in the environment.
"""
import ctypes
import os

import torch

MULTI_RANK_MIN_VERSION = (2, 30)

# ncclDataType_t and ncclRedOp_t values from nccl.h (unchanged since NCCL 2.10, which added
# bfloat16 and ncclAvg).
NCCL_TYPES = {
    torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4,
    torch.float16: 6, torch.float32: 7, torch.float64: 8, torch.bfloat16: 9,
}
NCCL_OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}


def load_libnccl():
    """(library, path): the libnccl torch itself loaded (found in /proc/self/maps), else the
    loader's libnccl.so.2."""
    candidates = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                if "libnccl.so" in os.path.basename(path) and path not in candidates:
                    candidates.append(path)
    except OSError:
        pass
    candidates += ["libnccl.so.2", "libnccl.so"]
    errors = []
    for c in candidates:
        try:
            lib = ctypes.CDLL(c)
            lib.ncclGetVersion  # noqa: B018  (raises AttributeError when the symbol is absent)
            return lib, c
        except (OSError, AttributeError) as e:
            errors.append(f"{c}: {e}")
    raise RuntimeError("cannot load libnccl: " + "; ".join(errors))


class LibNccl:
    """One communicator per rank from ncclCommInitAll (devices may repeat), one in-place
    all-reduce per rank inside a group per call.

    The ranks' kernels wait for each other, so each rank runs on a stream of its own (two
    queued on one stream, the shared device's current stream, would deadlock). The rank
    streams start after the work on the current streams, and the current streams wait for
    them, so callers see the usual current-stream ordering.
    """

    def __init__(self, devices, op="sum"):
        C = ctypes
        lib, self.path = load_libnccl()
        lib.ncclGetErrorString.restype = C.c_char_p
        lib.ncclGetErrorString.argtypes = [C.c_int]
        self._last_error = getattr(lib, "ncclGetLastError", None)
        if self._last_error is not None:
            self._last_error.restype = C.c_char_p
            self._last_error.argtypes = [C.c_void_p]
        lib.ncclGetVersion.argtypes = [C.POINTER(C.c_int)]
        lib.ncclCommInitAll.argtypes = [C.POINTER(C.c_void_p), C.c_int, C.POINTER(C.c_int)]
        lib.ncclAllReduce.argtypes = [C.c_void_p, C.c_void_p, C.c_size_t, C.c_int, C.c_int,
                                      C.c_void_p, C.c_void_p]
        lib.ncclCommDestroy.argtypes = [C.c_void_p]
        for f in (lib.ncclGetVersion, lib.ncclCommInitAll, lib.ncclAllReduce,
                  lib.ncclCommDestroy, lib.ncclGroupStart, lib.ncclGroupEnd):
            f.restype = C.c_int
        self._lib = lib
        v = C.c_int(0)
        self._check(lib.ncclGetVersion(C.byref(v)), "ncclGetVersion")
        code = v.value  # 2.9+: major*10000 + minor*100 + patch
        self.version = (code // 10000, code // 100 % 100, code % 100)
        if op not in NCCL_OPS:
            raise ValueError(f"NCCL all-reduce: op must be one of {', '.join(NCCL_OPS)}; got {op!r}")
        self._op = NCCL_OPS[op]
        self.devices = [torch.device(d).index if not isinstance(d, int) else d for d in devices]
        n = len(self.devices)
        self._comms = (C.c_void_p * n)()
        self._check(lib.ncclCommInitAll(self._comms, n, (C.c_int * n)(*self.devices)),
                    f"ncclCommInitAll(ndev={n}, devlist={self.devices})")
        self._streams = [torch.cuda.Stream(device=d) for d in self.devices]

    def _check(self, result, what):
        if result != 0:
            msg = self._lib.ncclGetErrorString(result).decode(errors="replace")
            last = self._last_error(None) if self._last_error is not None else None
            detail = f" ({last.decode(errors='replace')})" if last else ""
            raise RuntimeError(f"{what} failed: NCCL error {result}: {msg}{detail}")

    def __call__(self, tensors):
        dtype = NCCL_TYPES.get(tensors[0].dtype)
        if dtype is None:
            raise TypeError(f"NCCL all-reduce: dtype {tensors[0].dtype} is not supported")
        current = [torch.cuda.current_stream(d) for d in self.devices]
        for stream, cur in zip(self._streams, current):
            stream.wait_stream(cur)
        self._check(self._lib.ncclGroupStart(), "ncclGroupStart")
        try:
            for rank, t in enumerate(tensors):
                ptr = ctypes.c_void_p(t.data_ptr())
                self._check(self._lib.ncclAllReduce(ptr, ptr, ctypes.c_size_t(t.numel()), dtype,
                                                    self._op, self._comms[rank],
                                                    ctypes.c_void_p(self._streams[rank].cuda_stream)),
                            f"ncclAllReduce(rank {rank})")
        finally:
            ended = self._lib.ncclGroupEnd()
        self._check(ended, "ncclGroupEnd")
        for t, stream, cur in zip(tensors, self._streams, current):
            cur.wait_stream(stream)
            t.record_stream(stream)
        return tensors

    def close(self):
        for d in set(self.devices):
            torch.cuda.synchronize(d)
        for comm in self._comms:
            self._lib.ncclCommDestroy(comm)
