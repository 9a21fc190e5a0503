#!/usr/bin/env python3
"""All-reduce bandwidth benchmark: ringreduce against NCCL side by side, in nccl-tests form.

    python bench/ring.py                      # defaults fit the machine (see --help)
    python bench/ring.py --device cpu --max-bytes 1M --json out.json --csv out.csv --plot out.png

For every message size (bytes per rank, doubling) it prints size, count, type, redop, then
time(us), algbw(GB/s), busbw(GB/s) and #wrong for each implementation, run on the same
buffers in the same process:
  ringreduce  ringreduce.all_reduce
  nccl        CUDA only: torch.cuda.nccl.all_reduce (one tensor per GPU); with several ranks
              on one GPU torch refuses ("inputs must be on unique devices"), so libnccl is called
              directly (ncclCommInitAll with the GPU repeated), which needs NCCL >= 2.30 and
              NCCL_MULTI_RANK_GPU_ENABLE=1. Where NCCL cannot run, the reason stands in its column.
              RINGREDUCE_NCCL_LIB=/path/libnccl.so.2: that library instead, called directly
              whatever the layout (the command restarts once with it in LD_PRELOAD). The header
              and JSON name the NCCL that ran: version, file and where it came from.
  reference   CPU only: torch.stack + reduce + copy back into every rank
  roofline    all ranks on one GPU: ringreduce's time as a percentage of the ideal time
              5*S*(N-1)/B, B the device-to-device copy bandwidth measured in this run.
Exits 1 when any result is wrong or ringreduce fails, 2 on bad arguments or an unusable
RINGREDUCE_NCCL_LIB.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import common  # noqa: E402  (bench/ is not a package; common.py sits beside this file)
import torch  # noqa: E402
from ringreduce.train.nccl import (  # noqa: E402
    CTA_ENV, MULTI_RANK_MIN_VERSION, NCCL_LIB_ENV, NCCL_OPS, NEWER_NCCL_HINT, LibNccl,
    NcclLibraryError, cap_shared_gpu_ctas, load_libnccl, preload_requested_library,
    requested_library, torch_nccl_library)
from ringreduce.train.progress import Progress, add_quiet_argument  # noqa: E402

DTYPES = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int32": torch.int32, "int64": torch.int64,
    "int8": torch.int8, "uint8": torch.uint8,
}
OPS = ("sum", "avg", "max", "min", "prod")

DEFAULT_MAX_BYTES = {"cuda": common.GiB, "cpu": 64 * common.MiB}
DEFAULT_ITERS = {"cuda": (20, 5), "cpu": (10, 2)}  # (timed iterations, warm-up iterations)
SIMULATED_RANKS = 4   # default rank count on one GPU and on CPU
NCCL_PROBE_TIMEOUT_S = 120
NCCL_PROBE_FLAG = "--nccl-probe"
# The probe's element counts besides the run's largest: an odd count (NCCL's LL protocol) and
# just over 1 MiB of float32, where the first GPU run hung (LL128, more channels).
NCCL_PROBE_COUNTS = (4099, (1 << 18) + 3)
# What --impls may name; the columns come in this order. On CPU the torch reference follows.
IMPL_CHOICES = ("ringreduce", "oneshot", "fused", "nccl", "graph")
IMPL_NAMES = {"ringreduce": "ringreduce", "oneshot": "ringreduce-oneshot",
              "fused": "ringreduce-fused", "nccl": "nccl", "graph": "ringreduce-graph"}
# Columns whose failure skips their further sizes and is reported, without failing the run (a
# wrong result fails it always): NCCL, and the forced and graphed variants of ringreduce.
OPTIONAL_IMPLS = ("nccl", "ringreduce-graph", "ringreduce-oneshot", "ringreduce-fused")
# Exit statuses beyond 0 (all right), 1 (a wrong result or a failing ringreduce) and 2 (bad
# arguments): a wait for the GPU passed --deadline (the run stops there: a hung kernel cannot be
# stopped, so the process ends without waiting for it), and --budget ran out before every size.
EXIT_HUNG = 3
EXIT_BUDGET = 4

IMPL_COLUMNS = [
    common.Column("time", "(us)", 10, ".2f"),
    common.Column("algbw", "(GB/s)", 8, ".2f"),
    common.Column("busbw", "(GB/s)", 8, ".2f"),
    common.Column("#wrong", "", 7, "d"),
]
KEY_COLUMNS = [
    common.Column("size", "(B)", 12, "d"),
    common.Column("count", "(elements)", 12, "d"),
    common.Column("type", "", 9, "s"),
    common.Column("redop", "", 6, "s"),
]
TOLERANCE_TEXT = {  # what make_reference allows for rounding, for the header
    "sum": "tolerance eps*(N*sum|x|+|ref|)",
    "avg": "tolerance eps*(sum|x|+|ref|)",
    "prod": "tolerance N*eps*|ref|",
    "max": "exact",
    "min": "exact",
}
ROOFLINE_COLUMNS = [
    common.Column("ideal", "(us)", 10, ".2f"),
    common.Column("ring", "(%ideal)", 8, ".1f"),
]


@dataclass
class Config:
    device: str                      # "cpu" or "cuda"
    rank_devices: list[torch.device]
    dtype_name: str
    op: str
    sizes: list[int]
    iters: int
    warmup: int
    seed: int
    layout: str                      # how the ranks sit on the hardware, for the header
    deadline_s: float = common.SYNC_DEADLINE_S  # bound of every wait for the GPU
    budget_s: float | None = None    # --budget: the whole run's time, the NCCL probe's included

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.dtype_name]

    @property
    def ranks(self) -> int:
        return len(self.rank_devices)

    @property
    def elem_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def cuda_indices(self) -> list[int]:
        return sorted({d.index for d in self.rank_devices}) if self.device == "cuda" else []

    @property
    def one_gpu(self) -> bool:
        return self.device == "cuda" and len(self.cuda_indices) == 1

    @property
    def bus_factor(self) -> float:
        return 2 * (self.ranks - 1) / self.ranks


@dataclass
class Impl:
    name: str
    describe: str
    run: object                      # callable(list[Tensor]) -> None, in place
    close: object = None
    prepare: object = None           # callable(every buffer set of a size), untimed, before run
    environ: dict | None = None      # variables set while this implementation runs, then restored
    min_size: int = 0                # smaller sizes are not run ...
    below_min: str = ""              # ... and this says why, in the row and the table


@dataclass
class Unavailable:
    name: str
    short: str                       # fits in the column group
    detail: str                      # the whole reason, for the header and JSON


@dataclass
class Outcome:
    ok: bool = True
    failures: list[str] = field(default_factory=list)


class Hung(RuntimeError):
    """A wait for the GPU passed its deadline while measuring `row` (which says so)."""

    def __init__(self, row: dict, what: str):
        super().__init__(what)
        self.row = row


# ---------------------------------------------------------------------------------------------
# Arguments and configuration.

def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="bench/ring.py",
        description="All-reduce bandwidth: ringreduce against NCCL (CUDA) or a torch reference "
                    "(CPU), nccl-tests columns. Sizes are bytes per rank.")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="default: cuda when a GPU is visible, else cpu")
    p.add_argument("--ranks", type=int, default=None,
                   help="default: all GPUs when there are two or more (one rank each); "
                        f"{SIMULATED_RANKS} simulated ranks on one GPU; {SIMULATED_RANKS} on CPU. "
                        "More ranks than GPUs are placed round-robin (rank r on GPU r %% #GPUs); "
                        "restrict GPUs with CUDA_VISIBLE_DEVICES")
    p.add_argument("--min-bytes", type=common.parse_size, default=8,
                   help="smallest size per rank (default 8); K/M/G suffixes allowed")
    p.add_argument("--max-bytes", type=common.parse_size, default=None,
                   help="largest size per rank (default 1G on CUDA, 64M on CPU). Sizes double "
                        "from --min-bytes; each is rounded down to whole elements and up to at "
                        "least one element, and repeats after rounding are dropped")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    p.add_argument("--op", choices=OPS, default="sum")
    p.add_argument("--iters", type=int, default=None,
                   help="timed iterations per size, median reported (default 20 CUDA, 10 CPU)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed iterations per size before timing (default 5 CUDA, 2 CPU)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--json", metavar="PATH", help="write rows and the run's configuration")
    p.add_argument("--csv", metavar="PATH", help="write one line per size")
    p.add_argument("--plot", metavar="PATH",
                   help="busbw and time against size, one line per implementation (matplotlib)")
    p.add_argument("--graph", action="store_true",
                   help="also time ringreduce replayed from a CUDA graph (ranks on one GPU, "
                        "one stream): the column ringreduce-graph (the same as adding graph "
                        "to --impls)")
    p.add_argument("--impls", default="ringreduce,nccl",
                   help="the columns, comma-separated, from " + ", ".join(IMPL_CHOICES)
                        + " (default %(default)s): ringreduce as it chooses its kernel; "
                        "oneshot: ringreduce with the one-shot kernel forced, at the sizes where "
                        "it would run the ring (ranks on one GPU); fused: ringreduce with "
                        "RINGREDUCE_FUSED=1 (the fused ring kernel, synchronous) at those sizes; "
                        "nccl; graph (as --graph). "
                        "On CPU the torch reference is always added. `--impls ringreduce` and "
                        "`--impls nccl` measure each in a process of its own, so that a hang in "
                        "one cannot cost the other")
    p.add_argument("--deadline", type=float, default=common.SYNC_DEADLINE_S, metavar="SECONDS",
                   help="bound of every wait for the GPU (default %(default)g): past it the run "
                        f"records the hang in its row and JSON and exits {EXIT_HUNG} without "
                        "waiting for the GPU")
    p.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                   help="start no further size once this many seconds have passed since the "
                        "start, or when the next size (taken as twice the last) would end past "
                        f"them; the sizes not run are listed and the exit status is "
                        f"{EXIT_BUDGET} (default: no budget)")
    add_quiet_argument(p)
    p.add_argument(NCCL_PROBE_FLAG, action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    for i in impls:
        if i not in IMPL_CHOICES:
            p.error(f"--impls: {i!r} is not one of {', '.join(IMPL_CHOICES)}")
    if args.graph and "graph" not in impls:
        impls.append("graph")
    if not impls:
        p.error("--impls: name at least one of " + ", ".join(IMPL_CHOICES))
    args.impls = [i for i in IMPL_CHOICES if i in impls]
    if not args.deadline > 0:
        p.error(f"--deadline must be > 0 (got {args.deadline})")
    if args.budget is not None and not args.budget > 0:
        p.error(f"--budget must be > 0 (got {args.budget})")
    return p, args


def make_config(parser, args) -> Config:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible to torch "
                     f"(torch {torch.__version__}, CUDA {torch.version.cuda})")
    ngpu = torch.cuda.device_count() if device == "cuda" else 0
    if args.ranks is not None and args.ranks < 2:
        parser.error(f"--ranks must be at least 2 (got {args.ranks}): an all-reduce over one "
                     "rank moves no data")
    if device == "cpu":
        ranks = args.ranks or SIMULATED_RANKS
        rank_devices = [torch.device("cpu")] * ranks
        layout = f"{ranks} ranks on CPU" + ("" if args.ranks else " (default for CPU)")
    else:
        if args.ranks is None:
            ranks = ngpu if ngpu >= 2 else SIMULATED_RANKS
        else:
            ranks = args.ranks
        rank_devices = [torch.device("cuda", r % ngpu) for r in range(ranks)]
        used = len({d.index for d in rank_devices})
        if used == 1:
            layout = f"{ranks} simulated ranks on one GPU (cuda:0)"
        elif used == ranks:
            layout = f"{ranks} ranks, one per GPU"
        else:
            layout = f"{ranks} ranks round-robin over {used} GPUs"
        if args.ranks is None:
            layout += " (default for one GPU)" if ngpu == 1 else " (default: all GPUs)"

    if args.op == "avg" and not DTYPES[args.dtype].is_floating_point:
        parser.error(f"--op avg needs a floating-point --dtype (got {args.dtype})")
    iters = DEFAULT_ITERS[device][0] if args.iters is None else args.iters
    warmup = DEFAULT_ITERS[device][1] if args.warmup is None else args.warmup
    if iters < 1 or warmup < 0:
        parser.error(f"--iters must be >= 1 and --warmup >= 0 (got {iters}, {warmup})")
    elem = torch.empty((), dtype=DTYPES[args.dtype]).element_size()
    max_bytes = DEFAULT_MAX_BYTES[device] if args.max_bytes is None else args.max_bytes
    try:
        sizes = common.doubling_sizes(args.min_bytes, max_bytes, elem)
    except ValueError as e:
        parser.error(f"--min-bytes/--max-bytes: {e}")
    return Config(device=device, rank_devices=rank_devices, dtype_name=args.dtype, op=args.op,
                  sizes=sizes, iters=iters, warmup=warmup, seed=args.seed, layout=layout,
                  deadline_s=args.deadline, budget_s=args.budget)


# ---------------------------------------------------------------------------------------------
# Inputs, reference and check.

def make_inputs(cfg: Config, count: int, seed: int) -> list[torch.Tensor]:
    """Random inputs, one per rank, whose exact reduction fits the dtype: sums cannot
    overflow, products stay within [2^-4, 2^4] (floats) or the integer range."""
    n, dtype = cfg.ranks, cfg.dtype
    out = []
    for r, dev in enumerate(cfg.rank_devices):
        g = torch.Generator(device=dev).manual_seed(seed * 1000003 + r)
        if dtype.is_floating_point:
            gen_dtype = torch.float64 if dtype == torch.float64 else torch.float32
            u = torch.rand(count, generator=g, device=dev, dtype=gen_dtype)
            if cfg.op == "prod":
                mag = torch.exp2((2 * u - 1) * min(1.0, 4.0 / n))
                sign = torch.randint(0, 2, (count,), generator=g, device=dev) * 2 - 1
                x = mag * sign
            else:
                x = 2 * u - 1
            out.append(x.to(dtype))
        else:
            info = torch.iinfo(dtype)
            if cfg.op == "prod":
                b = max(1, int(math.floor(info.max ** (1.0 / n))))
                x = torch.randint(1, b + 1, (count,), generator=g, device=dev, dtype=torch.int64)
                if info.min < 0:
                    x *= torch.randint(0, 2, (count,), generator=g, device=dev) * 2 - 1
            elif cfg.op == "sum":
                b = max(1, min(info.max // n, 1 << 24))
                lo = -b if info.min < 0 else 0
                x = torch.randint(lo, b + 1, (count,), generator=g, device=dev, dtype=torch.int64)
            else:
                b = min(info.max, 1 << 24)
                lo = max(info.min, -b)
                x = torch.randint(lo, b + 1, (count,), generator=g, device=dev, dtype=torch.int64)
            out.append(x.to(dtype))
    return out


@dataclass
class Reference:
    value: torch.Tensor              # float64 for floating dtypes, the dtype itself for integers
    tol: torch.Tensor | None         # per-element absolute tolerance; None: exact comparison


def make_reference(cfg: Config, inputs: list[torch.Tensor]) -> Reference:
    """The reduction of `inputs` computed once, on the first rank's device: exactly in int64
    for integers; in float64 for floats, with a tolerance for the implementation's rounding.

    An implementation reduces in the storage type, rounding once per ring hop (N-1 times; a
    half-type result is rounded to 16 bits at each hop), in its own fixed order. The error of
    such a sum is at most (N-1)*u*sum|x_i| (u = eps/2, unit roundoff); the tolerance is
    eps*(N*sum|x_i| + |ref|), twice that bound plus the final rounding. A product is within
    (N-1)*u relative, tolerance N*eps*|ref|. Max and min are exact.
    """
    n, op = cfg.ranks, cfg.op
    dev = inputs[0].device
    floating = cfg.dtype.is_floating_point
    wide = torch.float64 if floating else torch.int64
    acc = inputs[0].to(dev, wide, copy=True)  # without copy, float64/int64 inputs would alias
    abs_sum = acc.abs() if floating and op in ("sum", "avg") else None
    for x in inputs[1:]:
        xw = x.to(dev, wide)
        if op in ("sum", "avg"):
            acc += xw
            if abs_sum is not None:
                abs_sum += xw.abs()
        elif op == "prod":
            acc *= xw
        elif op == "max":
            torch.maximum(acc, xw, out=acc)
        else:
            torch.minimum(acc, xw, out=acc)
        del xw
    if not floating:
        return Reference(acc.to(cfg.dtype), None)
    eps = torch.finfo(cfg.dtype).eps
    if op == "sum":
        tol = abs_sum.mul_(n * eps).add_(acc.abs(), alpha=eps)
    elif op == "avg":
        acc /= n
        tol = abs_sum.mul_(eps).add_(acc.abs(), alpha=eps)
    elif op == "prod":
        tol = acc.abs().mul_(n * eps)
    else:
        tol = None
    return Reference(acc, tol)


def count_wrong(outputs: list[torch.Tensor], ref: Reference) -> int:
    """Elements, over all ranks, outside the reference's tolerance (NaN counts as wrong)."""
    wrong = 0
    for out in outputs:
        if ref.value.dtype == torch.float64:
            diff = out.to(ref.value.device, torch.float64, copy=True).sub_(ref.value).abs_()
            bad = diff.ne(0) if ref.tol is None else diff.le(ref.tol).logical_not_()
            bad |= diff.isnan()
            del diff
        else:
            bad = out.to(ref.value.device).ne(ref.value)
        wrong += int(bad.sum().item())
    return wrong


# ---------------------------------------------------------------------------------------------
# Implementations.

def run_ringreduce(tensors: list[torch.Tensor], op: str) -> None:
    import ringreduce
    ringreduce.all_reduce(tensors, op=op)


class GraphedRingreduce:
    """ringreduce.all_reduce captured in a CUDA graph per buffer set, then replayed: the time
    per call without the host's launch cost. prepare(sets), untimed, captures every buffer set
    of a size (each first runs once eagerly outside the capture, as warm-up, then its inputs
    are restored); calls only replay, so the timed loop never times a capture. A graph is keyed
    on everything it baked in (pointers, element count, dtype, devices, op), and prepare drops
    the graphs of earlier sizes, whose buffers are freed: the caching allocator hands the next
    size the same blocks, and a graph keyed on pointers alone would replay the old count."""

    def __init__(self, op: str):
        self._op = op
        self._graphs = {}

    def _key(self, tensors: list[torch.Tensor]) -> tuple:
        return (self._op,) + tuple((t.data_ptr(), t.numel(), t.dtype, t.device)
                                   for t in tensors)

    def prepare(self, sets: list[list[torch.Tensor]]) -> None:
        self._graphs = {}
        for tensors in sets:
            key = self._key(tensors)
            if key in self._graphs:
                continue
            saved = [t.clone() for t in tensors]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                run_ringreduce(tensors, self._op)
            torch.cuda.current_stream().wait_stream(side)
            for t, s in zip(tensors, saved):
                t.copy_(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run_ringreduce(tensors, self._op)
            self._graphs[key] = graph

    def __call__(self, tensors: list[torch.Tensor]) -> None:
        graph = self._graphs.get(self._key(tensors))
        if graph is None:
            raise RuntimeError("ringreduce-graph: this buffer set was not captured by prepare() "
                               "(captures happen before timing, never inside the timed loop)")
        graph.replay()


def ringreduce_path(cfg: Config, size: int) -> str:
    """Which kernel ringreduce.all_reduce runs at this size (the rule in csrc/bindings.cpp): the
    one-shot kernel when every rank is on one stream of one GPU with the p2p transport and a
    rank holds at most RINGREDUCE_ONESHOT_BYTES, else the ring."""
    if cfg.device != "cuda":
        return "ring"
    from ringreduce.core import settings
    s = settings()
    if cfg.one_gpu and s["transport"] == "p2p" and size <= s["oneshot_max_bytes"]:
        return "oneshot"
    return "ring"


def _now() -> float:
    """The run's clock (seconds): --budget and each row's seconds."""
    return time.monotonic()


def _off_one_gpu(cfg: Config, transport: str, choice: str, what: str) -> Unavailable | None:
    """Why the column `choice` cannot run (its kernel needs every rank on one GPU and the p2p
    transport), or None."""
    if cfg.one_gpu and transport == "p2p":
        return None
    return Unavailable(IMPL_NAMES[choice], "needs ranks on one GPU",
                       f"{choice}: {what} runs only with every rank on one GPU and "
                       "RINGREDUCE_TRANSPORT=p2p")


def forced_oneshot(cfg: Config, transport: str) -> Impl | Unavailable:
    """ringreduce with the one-shot kernel forced (RINGREDUCE_ONESHOT_BYTES above every size,
    set only while it runs), at the sizes where ringreduce's own choice is the ring: on one GPU
    the one-shot kernel (each rank reads every peer once) may beat the ring at any size."""
    off = _off_one_gpu(cfg, transport, "oneshot", "the one-shot kernel")
    if off is not None:
        return off
    from ringreduce.core import settings
    default_max = settings()["oneshot_max_bytes"]
    forced = str(max(cfg.sizes))
    return Impl(IMPL_NAMES["oneshot"],
                f"ringreduce.all_reduce with RINGREDUCE_ONESHOT_BYTES={forced}: the one-shot "
                f"kernel forced, above {common.format_size(default_max)} (below, ringreduce "
                "runs it anyway)",
                lambda ts: run_ringreduce(ts, cfg.op), environ={"RINGREDUCE_ONESHOT_BYTES": forced},
                min_size=default_max + 1, below_min="one-shot by default")


def forced_fused(cfg: Config, transport: str) -> Impl | Unavailable:
    """ringreduce with RINGREDUCE_FUSED=1 (set only while it runs): the fused ring kernel, one
    cooperative launch instead of 2(N-1) step kernels, at the sizes where ringreduce's own choice
    is the ring. Each call waits for its kernel (the path checks the kernel's status), so its
    time includes a host synchronisation that the other columns do not pay."""
    off = _off_one_gpu(cfg, transport, "fused", "the fused ring kernel (one stream)")
    if off is not None:
        return off
    from ringreduce.core import settings
    default_max = settings()["oneshot_max_bytes"]
    return Impl(IMPL_NAMES["fused"],
                "ringreduce.all_reduce with RINGREDUCE_FUSED=1: the fused ring kernel "
                f"(synchronous), above {common.format_size(default_max)} (below, the one-shot "
                "runs)",
                lambda ts: run_ringreduce(ts, cfg.op), environ={"RINGREDUCE_FUSED": "1"},
                min_size=default_max + 1, below_min="one-shot by default")


_STACK_REDUCE = {
    "sum": lambda s: s.sum(0, dtype=s.dtype),
    "avg": lambda s: s.mean(0),
    "max": lambda s: s.amax(0),
    "min": lambda s: s.amin(0),
    "prod": lambda s: s.prod(0, dtype=s.dtype),
}


def run_stack_reference(tensors: list[torch.Tensor], op: str) -> None:
    reduced = _STACK_REDUCE[op](torch.stack(tensors))
    for t in tensors:
        t.copy_(reduced)


class TorchNccl:
    """torch.cuda.nccl.all_reduce: one tensor per GPU, each on its device's current stream."""

    def __init__(self, op: str):
        import torch.cuda.nccl as tnccl
        self._nccl = tnccl
        self._op = NCCL_OPS[op]

    def __call__(self, tensors):
        self._nccl.all_reduce(tensors, op=self._op)


def torch_nccl_accepts(cfg: Config) -> bool:
    """torch.cuda.nccl.is_available() for tensors laid out like this run's ranks. False when
    ranks share a GPU: torch's NCCL binding takes one tensor per device."""
    import torch.cuda.nccl as tnccl
    return tnccl.is_available([torch.empty(1, device=d) for d in cfg.rank_devices])


def nccl_version_tuple():
    import torch.cuda.nccl as tnccl
    return tuple(tnccl.version()[:3])


def probe_counts(cfg: Config) -> list[int]:
    """The element counts the NCCL probe all-reduces, in order: NCCL_PROBE_COUNTS and the
    run's largest size, so that a size where NCCL hangs or errs shows up in a child process
    (the first GPU run's probe tried 4,099 elements, and the run then hung at 1 MiB)."""
    largest = cfg.sizes[-1] // cfg.elem_size
    return sorted(set(NCCL_PROBE_COUNTS) | {largest})


def _probe_nccl_in_child(cfg: Config) -> str | None:
    """Run NCCL in a child process at the probe_counts (same dtype, op and rank layout): a
    crash or a hang there must not take the benchmark down. None when it worked, else why not."""
    cmd = [sys.executable, str(Path(__file__).resolve()), NCCL_PROBE_FLAG, "--device", "cuda",
           "--ranks", str(cfg.ranks), "--dtype", cfg.dtype_name, "--op", cfg.op,
           "--min-bytes", str(cfg.sizes[0]), "--max-bytes", str(cfg.sizes[-1]),
           "--deadline", str(min(cfg.deadline_s, NCCL_PROBE_TIMEOUT_S / 4))]
    bound = NCCL_PROBE_TIMEOUT_S
    if cfg.budget_s is not None:  # half the run's budget at most: the sweep needs the rest
        bound = min(bound, max(10.0, cfg.budget_s / 2))
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=bound,
                             env=dict(os.environ))
    except subprocess.TimeoutExpired:
        return f"a trial all-reduce hung (no result after {bound:g} s)"
    if res.returncode == 0 and "NCCL_PROBE_OK" in res.stdout:
        return None
    lines = [ln.strip() for ln in (res.stderr + "\n" + res.stdout).splitlines() if ln.strip()]
    last = lines[-1] if lines else "no output"
    if res.returncode < 0:
        return f"a trial all-reduce died with signal {-res.returncode}: {last}"
    return f"a trial all-reduce failed: {last}"


def nccl_probe_main(cfg: Config) -> int:
    """Child side of _probe_nccl_in_child: one checked all-reduce at each of probe_counts,
    every wait bounded by --deadline (a hang exits at once, without waiting for the GPU)."""
    impl = LibNccl([d.index for d in cfg.rank_devices], cfg.op)
    for count in probe_counts(cfg):
        inputs = make_inputs(cfg, count, seed=12345)
        ref = make_reference(cfg, inputs)
        impl(inputs)
        try:
            common.bounded_sync(cfg.cuda_indices, cfg.deadline_s,
                                f"a trial all-reduce of {count} elements")
        except common.SyncTimeout as e:
            print(f"NCCL: {e}", file=sys.stderr, flush=True)
            os._exit(EXIT_HUNG)
        wrong = count_wrong(inputs, ref)
        if wrong:
            print(f"NCCL gave {wrong} wrong elements of {count * cfg.ranks} in a trial "
                  f"all-reduce of {count} elements", file=sys.stderr)
            return 1
        print(f"NCCL probe: {count} elements right", flush=True)
    common.bounded_sync(cfg.cuda_indices, cfg.deadline_s, "the trial all-reduces")
    impl.close()
    print("NCCL_PROBE_OK")
    return 0


def setup_nccl(cfg: Config) -> tuple[Impl | None, Unavailable | None, dict]:
    """The NCCL implementation for this run, or why there is none; plus what the header and
    JSON should say about NCCL (route, and version, file and origin of the library that runs).

    With RINGREDUCE_NCCL_LIB set, the named library is called directly through ctypes whatever
    the layout, so that it is what runs; a file that cannot be used raises NcclLibraryError.
    Otherwise torch.cuda.nccl runs where it accepts the ranks (one per GPU), and torch's own
    libnccl is called directly where ranks share a GPU."""
    info: dict = {"route": None, "library": None, "version": None, "path": None, "origin": None}

    def no(short, detail):
        info["reason"] = detail
        return None, Unavailable("nccl", "not run: " + short, "not run: " + detail), info

    if cfg.device != "cuda":
        return no("CPU run", "CPU run; NCCL needs CUDA")
    if not hasattr(torch._C, "_nccl_all_reduce"):
        return no("no NCCL in torch", f"torch {torch.__version__} was built without NCCL")
    devices = [d.index for d in cfg.rank_devices]
    shared = len(set(devices)) < len(devices)
    if shared:
        # NCCL reads its environment when first used; set before any call into it.
        os.environ.setdefault("NCCL_MULTI_RANK_GPU_ENABLE", "1")
        info["NCCL_MULTI_RANK_GPU_ENABLE"] = os.environ["NCCL_MULTI_RANK_GPU_ENABLE"]
    requested = requested_library() is not None
    if requested:
        library = load_libnccl()[1]
    else:
        try:
            library = torch_nccl_library(nccl_version_tuple())
        except Exception as e:  # noqa: BLE001  (any failure here is a reason to print)
            return no("no NCCL version", f"torch.cuda.nccl.version() failed: {e}")
    info.update(library.as_dict(), library=library.describe())
    vtext = library.version_text
    if not requested and torch_nccl_accepts(cfg):
        info["route"] = "torch.cuda.nccl.all_reduce"
        return (Impl("nccl", f"torch.cuda.nccl.all_reduce, {library.describe()}",
                     TorchNccl(cfg.op)), None, info)
    if not requested and not shared:
        return no("torch.cuda.nccl refuses",
                  "torch.cuda.nccl.is_available() is False for these tensors")

    info["route"] = ("libnccl via ctypes (ncclCommInitAll"
                     + (" with the GPU repeated)" if shared else ")"))
    if requested:
        why = f"{NCCL_LIB_ENV} is set, so the library it names is called directly"
    else:
        why = ("torch.cuda.nccl takes one tensor per GPU (is_available() is False here; "
               "all_reduce raises \"inputs must be on unique devices\")")
    if shared and library.version < MULTI_RANK_MIN_VERSION:
        hint = "" if requested else f"; {NEWER_NCCL_HINT}"
        return no(f"NCCL {vtext} < 2.30",
                  f"{library.describe()} is older than 2.30 and refuses several ranks on one "
                  f"GPU (\"Duplicate GPU detected\"); {why}{hint}")
    if shared:
        # Before the probe's child and the communicators: NCCL reads them at communicator creation.
        info.update(cap_shared_gpu_ctas(devices))
    reason = _probe_nccl_in_child(cfg)
    if reason is not None:
        enable = info.get("NCCL_MULTI_RANK_GPU_ENABLE")
        return no("NCCL failed (see header)", f"{library.describe()}"
                  + (f" with NCCL_MULTI_RANK_GPU_ENABLE={enable}" if shared else "")
                  + f": {reason}")
    try:
        lib = LibNccl(devices, cfg.op)
    except Exception as e:  # noqa: BLE001
        return no("NCCL init failed (see header)", f"{library.describe()}: {e}")
    info.update(lib.library.as_dict(), library=lib.library.describe())
    describe = (f"{lib.library.describe()} called directly, ncclCommInitAll(devlist={devices})"
                + (f", NCCL_MULTI_RANK_GPU_ENABLE={info['NCCL_MULTI_RANK_GPU_ENABLE']}"
                   if shared else "")
                + "".join(f", {k}={info[k]}" for k in CTA_ENV if k in info)
                + f", one stream per rank; {why}")
    return Impl("nccl", describe, lib, close=lib.close), None, info


# ---------------------------------------------------------------------------------------------
# The sweep.

def _sync(cfg: Config, what: str) -> None:
    """Bounded by cfg.deadline_s (common.SyncTimeout): a hung call ends the run, not the phase."""
    if cfg.device == "cuda":
        common.bounded_sync(cfg.cuda_indices, cfg.deadline_s, what)


@contextlib.contextmanager
def environment(values: dict | None):
    """os.environ with `values` set inside the block, as it was after it."""
    saved = {k: os.environ.get(k) for k in values or {}}
    os.environ.update(values or {})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _cache_bytes(cfg: Config) -> int:
    if cfg.device == "cuda":
        return max(common.cuda_l2_bytes(d) for d in cfg.cuda_indices)
    return common.cpu_cache_bytes()


def _max_ranks_per_device(cfg: Config) -> int:
    return max(sum(1 for d in cfg.rank_devices if d == dev) for dev in set(cfg.rank_devices))


def measure_size(cfg: Config, impls: list[Impl], size: int, cache_bytes: int,
                 copy_bw: float | None, outcome: Outcome, log) -> dict:
    """Check and time every implementation at one size; the row for table, JSON and CSV."""
    count = size // cfg.elem_size
    inputs = make_inputs(cfg, count, seed=cfg.seed * 7919 + size)
    ref = make_reference(cfg, inputs)
    nsets = common.rotation_sets(size * _max_ranks_per_device(cfg), cache_bytes,
                                 max_sets=min(64, cfg.iters + cfg.warmup))
    sets = [[x.clone() for x in inputs] for _ in range(nsets)]
    row = {"size": size, "count": count, "type": cfg.dtype_name, "redop": cfg.op,
           "buffer_sets": nsets, "path": ringreduce_path(cfg, count * cfg.elem_size),
           "results": {}}
    timing_devices = cfg.cuda_indices if cfg.device == "cuda" else None

    for impl in list(impls):
        if size < impl.min_size:
            row["results"][impl.name] = {"skipped": impl.below_min}
            continue
        try:
            with environment(impl.environ):
                for dst, src in zip(sets[0], inputs):
                    dst.copy_(src)
                if impl.prepare is not None:
                    impl.prepare(sets)
                impl.run(sets[0])
                _sync(cfg, f"{impl.name}'s checked call at {size} B")
                wrong = count_wrong(sets[0], ref)
                times = common.time_iterations(lambda i: impl.run(sets[i % nsets]),
                                               cfg.iters, cfg.warmup, timing_devices,
                                               cfg.deadline_s)
        except common.SyncTimeout as e:
            # Nothing can stop a hung kernel, and every later wait would hang behind it: the row
            # says so and the run ends here (main writes the JSON and exits EXIT_HUNG).
            row["results"][impl.name] = {"error": f"hung: {e}"}
            outcome.ok = False
            outcome.failures.append(f"{impl.name} at {size} B: hung: {e}")
            raise Hung(row, f"{impl.name} at {size} B: {e}") from e
        except Exception as e:  # noqa: BLE001  (reported in the row; the sweep goes on)
            msg = f"{type(e).__name__}: {e}".strip()
            row["results"][impl.name] = {"error": msg}
            log(f"# {impl.name} failed at size {size}: {msg}")
            if impl.name in OPTIONAL_IMPLS:
                log(f"#   {impl.name}: further sizes skipped")
                impls.remove(impl)
            else:
                outcome.ok = False
                outcome.failures.append(f"{impl.name} at {size} B: {msg}")
            continue
        t = common.median(times)
        alg, bus = common.bandwidths(size, t, cfg.bus_factor)
        row["results"][impl.name] = {"time_us": t * 1e6, "algbw_gbps": alg, "busbw_gbps": bus,
                                     "wrong": wrong}
        if wrong:
            outcome.ok = False
            outcome.failures.append(f"{impl.name} at {size} B: {wrong} wrong elements")

    if copy_bw is not None:
        ideal = 5 * size * (cfg.ranks - 1) / copy_bw
        alg, bus = common.bandwidths(size, ideal, cfg.bus_factor)
        ring = row["results"].get("ringreduce", {})
        pct = ideal / (ring["time_us"] * 1e-6) * 100 if "time_us" in ring else None
        row["roofline"] = {"ideal_us": ideal * 1e6, "algbw_gbps": alg, "busbw_gbps": bus,
                           "ringreduce_pct_of_ideal": pct}
    return row


def table_cells(row: dict, impl_names: list[str], unavailable: dict[str, Unavailable],
                roofline: bool) -> tuple[list, list]:
    keys = [row["size"], row["count"], row["type"], row["redop"]]
    groups = []
    for name in impl_names:
        if name in unavailable:
            groups.append(unavailable[name].short)
            continue
        r = row["results"].get(name)
        if r is None:
            groups.append("skipped after an error")
        elif "skipped" in r:
            groups.append(r["skipped"])
        elif "error" in r:
            groups.append("error: " + r["error"])
        else:
            groups.append([r["time_us"], r["algbw_gbps"], r["busbw_gbps"], r["wrong"]])
    if roofline:
        rl = row.get("roofline", {})
        groups.append([rl.get("ideal_us"), rl.get("ringreduce_pct_of_ideal")])
    return keys, groups


def csv_fields(impl_names: list[str], roofline: bool) -> list[str]:
    fields = ["size", "count", "type", "redop", "ranks", "path"]
    for name in impl_names:
        fields += [f"{name}_time_us", f"{name}_algbw_gbps", f"{name}_busbw_gbps",
                   f"{name}_wrong", f"{name}_error"]
    if roofline:
        fields += ["ideal_time_us", "ideal_busbw_gbps", "ringreduce_pct_of_ideal"]
    return fields


def csv_row(row: dict, cfg: Config, impl_names: list[str],
            unavailable: dict[str, Unavailable]) -> dict:
    out = {k: row[k] for k in ("size", "count", "type", "redop", "path")}
    out["ranks"] = cfg.ranks
    for name in impl_names:
        r = row["results"].get(name, {})
        for key in ("time_us", "algbw_gbps", "busbw_gbps", "wrong", "error"):
            out[f"{name}_{key}"] = r.get(key)
        if name in unavailable:
            out[f"{name}_error"] = unavailable[name].detail
    if "roofline" in row:
        rl = row["roofline"]
        out.update(ideal_time_us=rl["ideal_us"], ideal_busbw_gbps=rl["busbw_gbps"],
                   ringreduce_pct_of_ideal=rl["ringreduce_pct_of_ideal"])
    return out


def write_plot(path: str, rows: list[dict], impl_names: list[str], title: str) -> None:
    series = {name: [] for name in impl_names}
    series["ideal (copy roofline)"] = []
    for row in rows:
        for name, r in row["results"].items():
            if "time_us" in r:
                series[name].append((row["size"], r["time_us"], r["busbw_gbps"]))
        if "roofline" in row:
            rl = row["roofline"]
            series["ideal (copy roofline)"].append((row["size"], rl["ideal_us"],
                                                    rl["busbw_gbps"]))
    common.plot_sweep(path, series, title, dashed=["ideal (copy roofline)"])


def describe_run(cfg: Config, argv) -> dict:
    import ringreduce
    desc = {"command": common.command_line(["bench/ring.py", *argv]),
            "host": common.host_info(), "device": cfg.device, "layout": cfg.layout,
            "ranks": cfg.ranks, "rank_devices": [str(d) for d in cfg.rank_devices],
            "dtype": cfg.dtype_name, "op": cfg.op, "sizes": cfg.sizes, "iters": cfg.iters,
            "warmup": cfg.warmup, "seed": cfg.seed, "timing": "median",
            "ringreduce": ringreduce.build_info()}
    if cfg.device == "cuda":
        desc["cuda"] = common.cuda_info(cfg.cuda_indices)
    return desc


def header_lines(cfg: Config, desc: dict, impls: list[Impl], unavailable: dict,
                 nccl: dict, copy_bw: float | None, cache_bytes: int) -> list[str]:
    h = desc["host"]
    bi = desc["ringreduce"]
    lines = ["# bench/ring.py: all_reduce, ringreduce vs "
             + ("NCCL" if cfg.device == "cuda" else "a torch reference") + " (nccl-tests columns)",
             f"# date {h['date']}  host {h['host']}",
             f"# command: {desc['command']}"]
    if cfg.device == "cuda":
        c = desc["cuda"]
        names = ", ".join(f"cuda:{g['index']} {g['name']} ({g['memory_gib']} GiB, "
                          f"{g['sms']} SMs, L2 {common.format_size(g['l2_bytes'])})"
                          for g in c["gpus"])
        lines.append(f"# device: {names}; driver {c['driver']}")
        lines.append(f"# versions: torch {h['torch']}, CUDA {c['cuda_runtime']}, "
                     f"{nccl.get('library') or 'NCCL n/a'}, ringreduce {bi.get('version')} "
                     f"(CUDA build: {bi.get('cuda')}, arch {bi.get('arch_list')})")
    else:
        lines.append(f"# device: CPU, {h['cpu']}, {h['cpu_count']} cores, "
                     f"torch threads {h['torch_threads']}")
        lines.append(f"# versions: torch {h['torch']}, ringreduce {bi.get('version')} "
                     f"(CUDA build: {bi.get('cuda')}), python {h['python']}")
    lines.append(f"# ranks: {cfg.layout}")
    lines.append(f"# {cfg.dtype_name} {cfg.op}, sizes {common.format_size(cfg.sizes[0])} .. "
                 f"{common.format_size(cfg.sizes[-1])} per rank (doubling; rounded down to whole "
                 "elements, at least one), "
                 f"{cfg.iters} timed iterations (median) after {cfg.warmup} warm-up, "
                 + ("CUDA events" if cfg.device == "cuda" else "perf_counter"))
    lines.append(f"# buffers: in place; below 2 x cache ({common.format_size(cache_bytes)}) per "
                 "device, timed calls rotate over several buffer sets (at most iters+warmup)")
    if cfg.dtype.is_floating_point:
        check = "float64 reference, " + TOLERANCE_TEXT[cfg.op]
    else:
        check = "exact int64 reference"
    lines.append("# check: random inputs, restored before one checked call per implementation; "
                 f"{check}; #wrong = wrong elements over all ranks")
    lines.append("# implementations:")
    for impl in impls:
        lines.append(f"#   {impl.name}: {impl.describe}")
    for u in unavailable.values():
        lines.append(f"#   {u.name}: {u.detail}")
    if copy_bw is not None:
        lines.append(f"#   roofline: device-to-device copy bandwidth B = {copy_bw / 1e9:.1f} GB/s "
                     "(read + write, copy_ of 1 GiB); ideal = 5*S*(N-1)/B; "
                     "ring(%ideal) = ideal / ringreduce time")
    if cfg.device == "cuda":
        oneshot = [r for r in cfg.sizes if ringreduce_path(cfg, r) == "oneshot"]
        if oneshot:
            lines.append(f"#   ringreduce path: the one-shot kernel up to "
                         f"{common.format_size(oneshot[-1])} per rank (RINGREDUCE_ONESHOT_BYTES; "
                         "0 runs the ring at every size), the ring above; JSON rows say which")
        else:
            lines.append("#   ringreduce path: the ring at every size")
    return lines


def main(argv=None, out=None) -> int:
    started = _now()
    from_command_line = argv is None
    argv = sys.argv[1:] if argv is None else list(argv)
    out = out or sys.stdout
    if from_command_line:
        common.dump_stacks_on_sigterm()

    def log(line=""):
        print(line, file=out, flush=True)

    parser, args = parse_args(argv)
    if args.plot:
        try:
            common.require_matplotlib()
        except common.PlotUnavailable as e:
            print(f"bench/ring.py: {e}", file=sys.stderr)
            return 2
    cfg = make_config(parser, args)
    if from_command_line and cfg.device == "cuda":
        # With RINGREDUCE_NCCL_LIB, the command starts again with that library preloaded:
        # torch's own NCCL calls then bind to it too, and the process holds one NCCL, not the
        # named one beside torch's.
        try:
            preload_requested_library()
        except NcclLibraryError as e:
            print(f"bench/ring.py: {e}", file=sys.stderr)
            return 2
    if args.nccl_probe:
        return nccl_probe_main(cfg)
    try:
        import ringreduce
        build = ringreduce.build_info()
    except ImportError as e:
        print(f"bench/ring.py: cannot import ringreduce ({e}); build it first: bash "
              "scripts/setup.sh (or pip install --no-build-isolation --use-pep517 -e .)",
              file=sys.stderr)
        return 2
    if cfg.device == "cuda" and not build.get("cuda"):
        print("bench/ring.py: --device cuda needs a CUDA build of ringreduce, but "
              f"build_info() says cuda={build.get('cuda')}", file=sys.stderr)
        return 2

    transport = os.environ.get("RINGREDUCE_TRANSPORT", "p2p")
    impls = []
    unavailable: dict[str, Unavailable] = {}
    if "ringreduce" in args.impls:
        impls.append(Impl("ringreduce", "ringreduce.all_reduce"
                          + (" (CPU ring)" if cfg.device == "cpu"
                             else f" (RINGREDUCE_TRANSPORT={transport})"),
                          lambda ts: run_ringreduce(ts, cfg.op)))
    for choice, make in (("oneshot", forced_oneshot), ("fused", forced_fused)):
        if choice in args.impls:
            forced = make(cfg, transport)
            if isinstance(forced, Impl):
                impls.append(forced)
            else:
                unavailable[forced.name] = forced
    nccl_info: dict = {"route": None, "reason": "not asked for (--impls)"}
    if "nccl" in args.impls:
        try:
            nccl, why_not, nccl_info = setup_nccl(cfg)
        except NcclLibraryError as e:
            print(f"bench/ring.py: {e}", file=sys.stderr)
            return 2
        if nccl is not None:
            impls.append(nccl)
        else:
            unavailable["nccl"] = why_not
    if "graph" in args.impls:
        if cfg.device == "cuda" and cfg.one_gpu:
            graphed = GraphedRingreduce(cfg.op)
            impls.append(Impl("ringreduce-graph", "ringreduce.all_reduce captured in a CUDA "
                              "graph per buffer set (before timing) and replayed", graphed,
                              prepare=graphed.prepare))
        else:
            unavailable["ringreduce-graph"] = Unavailable(
                "ringreduce-graph", "needs ranks on one GPU",
                "--graph: capture needs every rank on one GPU and one stream")
    if not impls:
        for u in unavailable.values():
            print(f"bench/ring.py: {u.name}: {u.detail}", file=sys.stderr)
        print("bench/ring.py: nothing to measure: no implementation --impls names can run here",
              file=sys.stderr)
        if args.json:  # the reasons, where the rows would have been
            common.write_json(args.json, {
                "config": {**describe_run(cfg, argv), "nccl": nccl_info,
                           "unavailable": {u.name: u.detail for u in unavailable.values()}},
                "rows": [], "complete": True, "ok": False,
                "failures": ["nothing to measure: " + "; ".join(
                    f"{u.name}: {u.detail}" for u in unavailable.values())],
                "stopped": None, "not_run": cfg.sizes})
        return 1
    if cfg.device == "cpu":
        impls.append(Impl("reference", "torch.stack + reduce + copy back into every rank",
                          lambda ts: run_stack_reference(ts, cfg.op)))
    # On CUDA a missing NCCL keeps its column, with the reason in it; on CPU it is only named
    # in the header, as nobody expects NCCL there.
    impl_names = [i.name for i in impls] + (list(unavailable) if cfg.device == "cuda" else [])

    copy_bw = None
    if cfg.one_gpu and "ringreduce" in args.impls:
        copy_bw = common.cuda_copy_bandwidth(cfg.cuda_indices[0])
    cache_bytes = _cache_bytes(cfg)
    desc = describe_run(cfg, argv)
    desc["nccl"] = nccl_info
    desc["implementations"] = {i.name: i.describe for i in impls}
    desc["unavailable"] = {u.name: u.detail for u in unavailable.values()}
    desc["cache_bytes"] = cache_bytes
    desc["copy_bandwidth_gbps"] = None if copy_bw is None else copy_bw / 1e9

    groups = [(name, IMPL_COLUMNS) for name in impl_names]
    if copy_bw is not None:
        groups.append(("roofline", ROOFLINE_COLUMNS))
    table = common.Table(KEY_COLUMNS, groups)
    for line in header_lines(cfg, desc, impls, unavailable, nccl_info, copy_bw, cache_bytes):
        log(line)
    log("#")
    for line in table.header():
        log(line)

    outcome = Outcome()
    rows = []
    running = list(impls)
    result = {"config": desc, "rows": rows, "complete": False, "ok": outcome.ok,
              "failures": outcome.failures, "stopped": None, "not_run": []}

    def save():  # after every size: a run killed later still leaves the sizes it finished
        if args.json:
            result["ok"] = outcome.ok
            common.write_json(args.json, result)

    save()
    hung = None
    try:
        with Progress(len(cfg.sizes), "sizes", quiet=args.quiet, leave=False,
                      unit="size") as bar:
            def log_above_bar(line=""):
                with bar.hidden():
                    log(line)

            last_s = 0.0
            for i, size in enumerate(cfg.sizes):
                elapsed = _now() - started
                if args.budget is not None and elapsed + 2 * last_s > args.budget:
                    result["not_run"] = cfg.sizes[i:]
                    result["stopped"] = (f"--budget {args.budget:g} s: {elapsed:.0f} s spent, "
                                         f"the next size would take about {2 * last_s:.0f} s")
                    break
                t0 = _now()
                try:
                    row = measure_size(cfg, running, size, cache_bytes, copy_bw, outcome,
                                       log_above_bar)
                except Hung as e:
                    row, hung = e.row, e
                last_s = _now() - t0
                row["seconds"] = round(last_s, 3)
                rows.append(row)
                keys, cells = table_cells(row, impl_names, unavailable, copy_bw is not None)
                log_above_bar(table.row(keys, cells))
                bar.update()
                if hung is not None:
                    result["not_run"] = cfg.sizes[i + 1:]
                    result["stopped"] = f"hung: {hung}"
                    break
                save()
    finally:
        if hung is None:
            for impl in impls:
                if impl.close is not None:
                    impl.close()

    total_wrong = sum(r.get("wrong", 0) for row in rows for r in row["results"].values())
    log(f"# Out of bounds values : {total_wrong} {'OK' if outcome.ok else 'FAILED'}")
    for name in impl_names:
        bws = [row["results"][name]["busbw_gbps"] for row in rows
               if "busbw_gbps" in row["results"].get(name, {})]
        if bws:
            log(f"# Avg bus bandwidth    : {sum(bws) / len(bws):.3f} GB/s ({name})")
    for f in outcome.failures:
        log(f"# FAILED: {f}")
    log(f"# Sizes run            : {len(rows)} of {len(cfg.sizes)}"
        + (f" (stopped: {result['stopped']}; not run: "
           f"{', '.join(common.format_size(n) for n in result['not_run']) or 'none'})"
           if result["stopped"] else "")
        + f", {_now() - started:.0f} s")

    result["complete"] = not result["stopped"]
    save()
    if args.csv:
        common.write_csv(args.csv, csv_fields(impl_names, copy_bw is not None),
                         (csv_row(row, cfg, impl_names, unavailable) for row in rows))
    if args.plot:
        machine = desc["cuda"]["gpus"][0]["name"] if cfg.device == "cuda" else desc["host"]["cpu"]
        title = f"all_reduce {cfg.dtype_name} {cfg.op}, {cfg.layout}; {machine}"
        write_plot(args.plot, rows, impl_names, title)
    if hung is not None:
        if from_command_line:
            # A hung kernel: CUDA's teardown at exit would wait for it for ever.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_HUNG)
        return EXIT_HUNG
    if not outcome.ok:
        return 1
    return EXIT_BUDGET if result["stopped"] else 0


if __name__ == "__main__":
    sys.exit(main())
