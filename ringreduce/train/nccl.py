"""NCCL for ranks that share a GPU, called directly through ctypes (for comparisons only).

``torch.cuda.nccl.all_reduce`` rejects two tensors on one device ("inputs must be on unique
devices") whatever the NCCL version, so a single process comparing ringreduce with NCCL on
simulated ranks makes its communicators with ``ncclCommInitAll`` and the device repeated, which
NCCL >= 2.30 accepts with ``NCCL_MULTI_RANK_GPU_ENABLE=1`` in the environment.

``RINGREDUCE_NCCL_LIB=/path/libnccl.so.2`` compares against another libnccl than torch's (for
example a newer one where the machine's is older than 2.30): ``load_libnccl`` then loads exactly
that file, and ``preload_requested_library`` re-executes a command with it in LD_PRELOAD so that
torch's own NCCL calls (``torch.cuda.nccl``, the torch.distributed nccl backend) reach it too.
``NcclLibrary`` says which NCCL ran: version, file and where the file came from.
"""
from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass

import torch

MULTI_RANK_MIN_VERSION = (2, 30)

# ncclDataType_t and ncclRedOp_t values from nccl.h (unchanged since NCCL 2.10, which added
# bfloat16 and ncclAvg).
NCCL_TYPES = {
    torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4,
    torch.float16: 6, torch.float32: 7, torch.float64: 8, torch.bfloat16: 9,
}
NCCL_OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}

NCCL_LIB_ENV = "RINGREDUCE_NCCL_LIB"
# Set in the environment of the process preload_requested_library() re-executes, to the path it
# preloaded: a second re-execution would mean LD_PRELOAD did not take, so it is an error instead.
PRELOADED_ENV = "RINGREDUCE_NCCL_PRELOADED"
NEWER_NCCL_HINT = (f"point {NCCL_LIB_ENV} at a libnccl.so.2 >= 2.30, e.g. the sm_90 build that "
                   "scripts/nccl_carry.sh takes to the GPU machine")

# NCCL's bounds on the CTAs (channels) of one communicator's kernel (NCCL_MIN_CTAS and
# NCCL_MAX_CTAS, read at communicator creation since NCCL 2.17; the names and their reading in
# init.cc unchanged through 2.28-2.30). Ranks that share a GPU spin on each other inside their
# kernels, so every rank's kernel must be resident at once: cap_shared_gpu_ctas keeps the
# ranks' CTAs together within half the GPU's SMs, at most MAX_CTAS_SHARED each.
CTA_ENV = ("NCCL_MIN_CTAS", "NCCL_MAX_CTAS")
MAX_CTAS_SHARED = 16


def shared_gpu_cta_cap(ranks_per_gpu, sms):
    """NCCL_MAX_CTAS for `ranks_per_gpu` ranks on a GPU of `sms` SMs: their CTAs together take
    at most half the SMs (room for one CTA of each on an SM of its own, and for the rest of the
    GPU's work), between 1 and MAX_CTAS_SHARED each."""
    return max(1, min(MAX_CTAS_SHARED, sms // (2 * ranks_per_gpu)))


def cap_shared_gpu_ctas(devices, environ=None):
    """Where ranks share a GPU, set NCCL_MAX_CTAS (shared_gpu_cta_cap, for the GPU holding the
    most ranks) and NCCL_MIN_CTAS=1 in `environ` (os.environ) unless the caller set them, before
    any communicator exists. Returns the values in force, {} where no GPU holds two ranks."""
    environ = os.environ if environ is None else environ
    index = [torch.device(d).index if not isinstance(d, int) else d for d in devices]
    counts = {d: index.count(d) for d in set(index)}
    most = max(counts.values(), default=0)
    if most < 2:
        return {}
    sms = min(torch.cuda.get_device_properties(d).multi_processor_count
              for d, n in counts.items() if n == most)
    environ.setdefault("NCCL_MAX_CTAS", str(shared_gpu_cta_cap(most, sms)))
    environ.setdefault("NCCL_MIN_CTAS", "1")
    return {k: environ[k] for k in CTA_ENV}


ORIGIN_ENV = f"from {NCCL_LIB_ENV}"
ORIGIN_TORCH = "torch's bundled"
ORIGIN_MAPS = "from /proc/self/maps"
ORIGIN_LOADER = "found by the dynamic loader"


class NcclLibraryError(RuntimeError):
    """The libnccl asked for cannot be used; the message names the variable and the path."""


@dataclass(frozen=True)
class NcclLibrary:
    """Which NCCL runs: its ncclGetVersion, its file (None: linked into torch) and where that
    file came from (one of the ORIGIN_* texts)."""
    version: tuple
    path: str | None
    origin: str

    @property
    def version_text(self):
        return ".".join(map(str, self.version))

    def describe(self):
        where = self.path if self.path is not None else "linked into torch"
        return f"NCCL {self.version_text} {self.origin} ({where})"

    def as_dict(self):
        return {"version": self.version_text, "path": self.path, "origin": self.origin}


def requested_library():
    """The absolute path RINGREDUCE_NCCL_LIB names, or None when it is unset or empty."""
    raw = os.environ.get(NCCL_LIB_ENV, "").strip()
    return os.path.abspath(raw) if raw else None


def mapped_libnccl():
    """The libnccl files mapped into this process, in /proc/self/maps order."""
    paths = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) < 6:
                    continue
                path = fields[5].strip()
                if "libnccl.so" in os.path.basename(path) and path not in paths:
                    paths.append(path)
    except OSError:
        pass
    return paths


def decode_version(code):
    """ncclGetVersion's integer as (major, minor, patch): major*10000 + minor*100 + patch
    since NCCL 2.9, major*1000 + minor*100 + patch before."""
    if code >= 10000:
        return (code // 10000, code // 100 % 100, code % 100)
    return (code // 1000, code // 100 % 10, code % 100)


def library_version(lib):
    """(major, minor, patch) from the ctypes library's ncclGetVersion."""
    get = lib.ncclGetVersion
    get.restype = ctypes.c_int
    get.argtypes = [ctypes.POINTER(ctypes.c_int)]
    code = ctypes.c_int(0)
    result = get(ctypes.byref(code))
    if result != 0:
        raise NcclLibraryError(f"ncclGetVersion failed with NCCL error {result}")
    return decode_version(code.value)


def _same_file(a, b):
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _under_torch(path):
    """Whether `path` is torch's own libnccl: in torch's folder or in the nvidia-nccl wheel
    torch depends on (site-packages/nvidia)."""
    torch_dir = os.path.dirname(os.path.realpath(torch.__file__))
    roots = (torch_dir, os.path.join(os.path.dirname(torch_dir), "nvidia"))
    real = os.path.realpath(path)
    return any(real.startswith(root + os.sep) for root in roots)


def library_origin(path, found=ORIGIN_MAPS):
    """ORIGIN_ENV when `path` is the file RINGREDUCE_NCCL_LIB names, ORIGIN_TORCH when it is
    torch's own, else `found` (how it was found)."""
    requested = requested_library()
    if requested is not None and _same_file(path, requested):
        return ORIGIN_ENV
    if _under_torch(path):
        return ORIGIN_TORCH
    return found


def _load_requested(path):
    if not os.path.isfile(path):
        raise NcclLibraryError(f"{NCCL_LIB_ENV}={path}: no such file (it must name a "
                               "libnccl.so.2)")
    try:
        lib = ctypes.CDLL(path)  # RTLD_LOCAL: beside torch's libnccl, not instead of it
    except OSError as e:
        raise NcclLibraryError(f"{NCCL_LIB_ENV}={path}: cannot be loaded: {e}") from e
    if not hasattr(lib, "ncclGetVersion"):
        raise NcclLibraryError(f"{NCCL_LIB_ENV}={path} is not a libnccl: it has no "
                               "ncclGetVersion")
    return lib


def load_libnccl():
    """(ctypes library, NcclLibrary): the file RINGREDUCE_NCCL_LIB names when it is set
    (NcclLibraryError if that cannot be used; never another one), else the libnccl torch itself
    loaded (found in /proc/self/maps), else the loader's libnccl.so.2."""
    requested = requested_library()
    if requested is not None:
        lib = _load_requested(requested)
        return lib, NcclLibrary(library_version(lib), requested, ORIGIN_ENV)
    before = mapped_libnccl()
    candidates = [(p, ORIGIN_MAPS) for p in before]
    candidates += [(name, ORIGIN_LOADER) for name in ("libnccl.so.2", "libnccl.so")]
    errors = []
    for c, found in candidates:
        try:
            lib = ctypes.CDLL(c)
            version = library_version(lib)  # AttributeError when ncclGetVersion is absent
        except (OSError, AttributeError, NcclLibraryError) as e:
            errors.append(f"{c}: {e}")
            continue
        if found == ORIGIN_LOADER:
            # The loader searched for the name; the file it chose is the new mapping.
            c = next((p for p in mapped_libnccl() if p not in before), c)
        return lib, NcclLibrary(version, c, library_origin(c, found))
    raise NcclLibraryError("cannot load libnccl: " + "; ".join(errors))


def _preload_list():
    return [p for p in os.environ.get("LD_PRELOAD", "").replace(":", " ").split() if p]


def torch_nccl_library(version=None):
    """The NcclLibrary torch.cuda.nccl and the torch.distributed nccl backend run. `version`
    is torch.cuda.nccl.version() (asked for when None); the file is the mapped libnccl whose
    ncclGetVersion gives that version, an LD_PRELOAD'ed one first (it is first in symbol
    lookup); when none does, torch has NCCL linked in."""
    if version is None:
        version = torch.cuda.nccl.version()
    version = tuple(version[:3])
    mapped = mapped_libnccl()
    preloaded = [p for p in mapped if any(_same_file(p, q) for q in _preload_list())]
    for path in preloaded + [p for p in mapped if p not in preloaded]:
        try:
            found = library_version(ctypes.CDLL(path))  # mapped already: nothing new loads
        except (OSError, AttributeError, NcclLibraryError):
            continue
        if found == version:
            return NcclLibrary(version, path, library_origin(path))
    return NcclLibrary(version, None, ORIGIN_TORCH)


def requested_mismatch(library):
    """A sentence when RINGREDUCE_NCCL_LIB is set but `library` (what runs) is another file,
    else None."""
    requested = requested_library()
    if requested is None or (library.path is not None and _same_file(library.path, requested)):
        return None
    why = ("torch has NCCL linked in, which LD_PRELOAD cannot replace" if library.path is None
           else "this process did not start with it preloaded")
    return f"{NCCL_LIB_ENV}={requested} is not what runs here ({why})"


def describe_route(route, library):
    """`library` (what runs) and `route` (how it is called) in words, with a warning when
    RINGREDUCE_NCCL_LIB names another file."""
    line = f"{library.describe()}, through {route}"
    mismatch = requested_mismatch(library)
    return line if mismatch is None else f"{line}; {mismatch}"


def preload_requested_library():
    """Make the library RINGREDUCE_NCCL_LIB names the NCCL that torch runs in this process.

    torch binds its NCCL calls when it is imported, so another libnccl can only replace torch's
    from the start of the process: this re-executes the current command (sys.orig_argv) once
    with the library first in LD_PRELOAD, which the loader then binds libtorch's libnccl.so.2
    (and any later dlopen of the same soname) to. Nothing happens when the variable is unset,
    or when the file is already mapped here and either preloaded or the only libnccl. Returns
    only when no re-execution is needed; raises NcclLibraryError when the file cannot be used
    or when the re-executed process still does not have it mapped. If torch has NCCL linked in
    statically, LD_PRELOAD cannot reach it: torch_nccl_library() and requested_mismatch() say
    so afterwards.
    """
    path = requested_library()
    if path is None:
        return
    mapped = mapped_libnccl()
    here = [p for p in mapped if _same_file(p, path)]
    if here and (len(mapped) == 1 or any(_same_file(q, path) for q in _preload_list())):
        return
    if os.environ.get(PRELOADED_ENV) == path:
        raise NcclLibraryError(
            f"{NCCL_LIB_ENV}={path}: this process was started with LD_PRELOAD="
            f"{os.environ.get('LD_PRELOAD', '')} but does not have the library mapped "
            f"(mapped libnccl: {mapped or 'none'})")
    _load_requested(path)
    orig_argv = getattr(sys, "orig_argv", None)
    if orig_argv is None:
        raise NcclLibraryError(
            f"{NCCL_LIB_ENV}={path}: re-executing this command with LD_PRELOAD needs Python "
            f">= 3.10 (sys.orig_argv); start it with LD_PRELOAD={path} instead")
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join([path] + [p for p in _preload_list() if p != path])
    env[PRELOADED_ENV] = path
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *orig_argv[1:]], env)


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
        lib, self.library = load_libnccl()
        self.path, self.version = self.library.path, self.library.version
        lib.ncclGetErrorString.restype = C.c_char_p
        lib.ncclGetErrorString.argtypes = [C.c_int]
        self._last_error = getattr(lib, "ncclGetLastError", None)
        if self._last_error is not None:
            self._last_error.restype = C.c_char_p
            self._last_error.argtypes = [C.c_void_p]
        lib.ncclCommInitAll.argtypes = [C.POINTER(C.c_void_p), C.c_int, C.POINTER(C.c_int)]
        lib.ncclAllReduce.argtypes = [C.c_void_p, C.c_void_p, C.c_size_t, C.c_int, C.c_int,
                                      C.c_void_p, C.c_void_p]
        lib.ncclCommDestroy.argtypes = [C.c_void_p]
        for f in (lib.ncclCommInitAll, lib.ncclAllReduce,
                  lib.ncclCommDestroy, lib.ncclGroupStart, lib.ncclGroupEnd):
            f.restype = C.c_int
        self._lib = lib
        if op not in NCCL_OPS:
            raise ValueError(f"NCCL all-reduce: op must be one of {', '.join(NCCL_OPS)}; got {op!r}")
        self._op = NCCL_OPS[op]
        self.devices = [torch.device(d).index if not isinstance(d, int) else d for d in devices]
        self.ctas = cap_shared_gpu_ctas(self.devices)
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
