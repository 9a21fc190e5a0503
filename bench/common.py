"""Helpers shared by the benchmarks in bench/: message sizes, timing, bandwidth, machine
description and output (nccl-tests style table, JSON, CSV, plot).

Torch is imported inside the functions that need it and CUDA is touched only by the functions
given CUDA devices, so a CPU run never initialises CUDA.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import os
import platform
import re
import shlex
import socket
import statistics
import subprocess
import sys
import time
from typing import Callable, Iterable, Sequence

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": KiB, "m": MiB, "g": GiB, "t": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from '8', '64K', '64KiB', '1M', '1G' (binary multiples). For argparse `type=`."""
    m = _SIZE_RE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}: expected a whole number of bytes with an optional "
            "K/M/G/T suffix (binary multiples), e.g. 8, 64K, 1G")
    return int(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]


def format_size(nbytes: int) -> str:
    """'8 B', '4 KiB', '1.5 MiB'."""
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def doubling_sizes(min_bytes: int, max_bytes: int, elem_size: int) -> list[int]:
    """Message sizes from min_bytes to max_bytes, doubling, each rounded down to whole elements
    and up to at least one element; sizes that round to the same value appear once."""
    if min_bytes <= 0:
        raise ValueError(f"min_bytes must be positive, got {min_bytes}")
    if max_bytes < min_bytes:
        raise ValueError(f"max_bytes ({max_bytes}) must be >= min_bytes ({min_bytes})")
    sizes: list[int] = []
    s = min_bytes
    while s <= max_bytes:
        rounded = max(elem_size, s // elem_size * elem_size)
        if not sizes or rounded != sizes[-1]:
            sizes.append(rounded)
        s *= 2
    return sizes


def bandwidths(size_bytes: int, seconds: float, bus_factor: float) -> tuple[float, float]:
    """(algbw, busbw) in GB/s as nccl-tests defines them: algbw = size / time,
    busbw = algbw * bus_factor (2(N-1)/N for all-reduce)."""
    alg = size_bytes / seconds / 1e9
    return alg, alg * bus_factor


def rotation_sets(set_bytes: int, cache_bytes: int, max_sets: int) -> int:
    """How many buffer sets to rotate through so that the bytes touched between two uses of
    one set are at least twice the cache, at most max_sets (and at least one)."""
    need = math.ceil(2 * cache_bytes / max(1, set_bytes))
    return max(1, min(need, max_sets))


def cpu_cache_bytes(default: int = 32 * MiB) -> int:
    """Size of the largest CPU cache level of cpu0 (Linux sysfs), else `default`."""
    best = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        entries = os.listdir(base)
    except OSError:
        return default
    for entry in entries:
        try:
            with open(os.path.join(base, entry, "size")) as f:
                text = f.read().strip().upper()
        except OSError:
            continue
        m = re.match(r"^(\d+)([KMG]?)$", text)
        if m:
            best = max(best, int(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    return best or default


def cuda_l2_bytes(device: int, default: int = 50 * MiB) -> int:
    import torch
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or default)


class SyncTimeout(RuntimeError):
    """Work queued on a GPU did not finish within its deadline: most likely a hung kernel, which
    nothing in this process can stop (the process must exit without waiting for the GPU)."""


# The bound of one wait for the GPU in the benchmarks (bounded_sync): far above any call they
# time (a 1 GiB all-reduce takes milliseconds), far below a device session's minutes.
SYNC_DEADLINE_S = 60.0


def bounded_sync(devices: Sequence[int], deadline_s: float = SYNC_DEADLINE_S,
                 what: str = "queued work") -> None:
    """Wait until the work queued so far on the current stream of each CUDA device in `devices`
    has finished, for at most `deadline_s` seconds in all; SyncTimeout names the device and
    `what` when it has not. torch.cuda.synchronize() would wait forever on a hung kernel (NCCL's
    ranks spinning on each other), so every wait of the benchmarks polls an event instead."""
    import torch
    events = []
    for d in devices:
        e = torch.cuda.Event()
        e.record(torch.cuda.current_stream(d))
        events.append((f"cuda:{d}", e))
    wait_events(events, deadline_s, what)


def wait_events(events: Sequence[tuple[str, object]], deadline_s: float = SYNC_DEADLINE_S,
                what: str = "queued work") -> None:
    """Wait for every recorded CUDA event of `events` ((where, event) pairs) by polling, for at
    most `deadline_s` seconds in all; SyncTimeout names `where` and `what` otherwise."""
    end = time.monotonic() + deadline_s
    pause = 1e-5
    for where, e in events:
        while not e.query():
            if time.monotonic() >= end:
                raise SyncTimeout(f"{what} on {where} had not finished after {deadline_s:g} s "
                                  "(a hung kernel?)")
            time.sleep(pause)
            pause = min(2 * pause, 0.01)


def time_iterations(fn: Callable[[int], object], iters: int, warmup: int,
                    cuda_devices: Sequence[int] | None = None,
                    sync_deadline_s: float = SYNC_DEADLINE_S) -> list[float]:
    """Run fn(0 .. warmup-1) untimed, then time fn(warmup .. warmup+iters-1) one call at a time.

    CPU (cuda_devices None): time.perf_counter around each call, which must be synchronous.
    CUDA: an event pair per call on the current stream of every device in cuda_devices; a
    call's time is the longest of its per-device spans (events of different devices cannot
    be compared). Every wait for the GPU is bounded by sync_deadline_s (bounded_sync). Returns
    seconds per call.
    """
    for i in range(warmup):
        fn(i)
    if cuda_devices is None:
        times = []
        for i in range(warmup, warmup + iters):
            t0 = time.perf_counter()
            fn(i)
            times.append(time.perf_counter() - t0)
        return times

    import torch
    bounded_sync(cuda_devices, sync_deadline_s, "the warm-up calls")
    pairs = []
    for i in range(warmup, warmup + iters):
        starts, ends = {}, {}
        for d in cuda_devices:
            starts[d] = torch.cuda.Event(enable_timing=True)
            starts[d].record(torch.cuda.current_stream(d))
        fn(i)
        for d in cuda_devices:
            ends[d] = torch.cuda.Event(enable_timing=True)
            ends[d].record(torch.cuda.current_stream(d))
        pairs.append((starts, ends))
    bounded_sync(cuda_devices, sync_deadline_s, "the timed calls")
    return [max(s[d].elapsed_time(e[d]) for d in cuda_devices) / 1e3 for s, e in pairs]


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def per_call_median(per_rank: Sequence[Sequence[float]], across: Callable = max) -> float:
    """Per iteration `across` the ranks' seconds (max: the slowest rank's; sum: all ranks'
    together), then the median over iterations, in us."""
    return statistics.median(across(col) for col in zip(*per_rank)) * 1e6


def cuda_copy_bandwidth(device: int, nbytes: int = GiB, iters: int = 20, warmup: int = 5) -> float:
    """Device-to-device copy bandwidth in bytes/s counting bytes read plus bytes written
    (2 * nbytes per copy_), median over `iters` copies of nbytes between two buffers."""
    import torch
    with torch.cuda.device(device):
        src = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}").fill_(0x5A)
        dst = torch.empty_like(src)
        t = median(time_iterations(lambda i: dst.copy_(src), iters, warmup, [device]))
    return 2 * nbytes / t


def cpu_copy_bandwidth(nbytes: int, iters: int = 8, warmup: int = 2) -> float:
    """Host memory copy bandwidth in bytes/s counting bytes read plus bytes written
    (2 * nbytes per copy), the faster of two ways of copying nbytes between two buffers, each
    the best of `iters` copies: torch copy_ with torch's current intra-op thread count (all cores
    by default), and one memcpy on one core (numpy.copyto, where numpy is installed).
    Both and the best rather than the median because it serves as a bound and load only slows a
    copy down: a parallel copy_ waits for its slowest thread, so on a busy machine it loses half
    its speed when one thread loses its core (seen on 2 cores: 10.9 GB/s against 21), while
    glibc's memcpy, with non-temporal stores at this size, draws the whole memory bandwidth of a
    small machine from one core (18-21 GB/s there, loaded or not). Choose nbytes well above the
    last-level cache, or this measures the cache."""
    import torch
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(0x5A)
    dst = torch.empty_like(src).fill_(0)  # touch every page before timing
    t = min(time_iterations(lambda i: dst.copy_(src), iters, warmup))
    try:
        import numpy as np
    except ImportError:
        return 2 * nbytes / t
    a, b = src.numpy(), dst.numpy()
    t = min(t, *time_iterations(lambda i: np.copyto(b, a), iters, warmup))
    return 2 * nbytes / t


# ---------------------------------------------------------------------------------------------
# Describing the machine and the run.

def now_iso() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def command_line(argv: Sequence[str] | None = None) -> str:
    argv = sys.argv if argv is None else argv
    return "python " + " ".join(shlex.quote(a) for a in argv)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def host_info() -> dict:
    import torch
    return {
        "date": now_iso(),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }


def nvidia_driver_version() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        with open("/proc/driver/nvidia/version") as f:
            m = re.search(r"Kernel Module\s+(?:for \S+\s+)?([\d.]+)", f.read())
            if m:
                return m.group(1)
    except OSError:
        pass
    return "unknown"


def cuda_info(devices: Sequence[int]) -> dict:
    """GPU names, memory, SM count and L2 of the given devices, plus driver and CUDA versions."""
    import torch
    gpus = []
    for d in devices:
        p = torch.cuda.get_device_properties(d)
        gpus.append({
            "index": d,
            "name": p.name,
            "memory_gib": round(p.total_memory / GiB, 1),
            "sms": p.multi_processor_count,
            "capability": f"{p.major}.{p.minor}",
            "l2_bytes": cuda_l2_bytes(d),
        })
    return {"driver": nvidia_driver_version(), "cuda_runtime": torch.version.cuda, "gpus": gpus}


def report_rank(queue, rank: int, body: Callable[[], object]) -> None:
    """A spawned rank's last act: puts (rank, "ok", body()) or (rank, "error", its traceback) on
    `queue`, flushes it and leaves without interpreter teardown (destroying a gloo group with
    the GIL held can deadlock with gloo's worker threads, seen with torch 2.13)."""
    import traceback
    try:
        queue.put((rank, "ok", body()))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    queue.close()
    queue.join_thread()
    os._exit(0)


def checked_buffers(size: int, rank: int, world: int, groups: dict,
                    before: Callable[[], object] = lambda: None, unchecked=()) -> tuple:
    """For every group in `groups` (name -> torch.distributed group): this rank's float32
    buffer of `size` bytes (rank+1 times the pattern 1..7: integer-valued, so sums are exact),
    after one all_reduce on that group (`before()` runs before each), and how many elements of
    the result differ from the exact sum (None for the names in `unchecked`, groups that move
    no bytes). Returns (buffers, wrong)."""
    import torch
    import torch.distributed as dist
    count = max(1, size // 4)
    pattern = (torch.arange(count, dtype=torch.int64) % 7 + 1).to(torch.float32)
    expect = pattern * (world * (world + 1) // 2)
    bufs, wrong = {}, {}
    for name, group in groups.items():
        bufs[name] = pattern * (rank + 1)
        before()
        dist.all_reduce(bufs[name], group=group)
        wrong[name] = None if name in unchecked else int((bufs[name] != expect).sum())
    return bufs, wrong


def collect_ranks(procs, queue) -> dict:
    """Starts the rank processes `procs`, each of which puts (rank, status, value) on `queue`
    once, and returns {rank: (status, value)} for those that reported; stops waiting once every
    process has exited, joins them (30 s each) and kills any left."""
    for p in procs:
        p.start()
    results = {}
    try:
        while len(results) < len(procs):
            try:
                rank, status, value = queue.get(timeout=5)
                results[rank] = (status, value)
            except Exception:  # noqa: BLE001 - queue.Empty, or the queue broke with a rank
                if all(p.exitcode is not None for p in procs):
                    break
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return results


# ---------------------------------------------------------------------------------------------
# Output.

class Column:
    def __init__(self, name: str, unit: str, width: int, fmt: str):
        self.name, self.unit, self.width, self.fmt = name, unit, width, fmt

    def cell(self, value) -> str:
        text = "-" if value is None else format(value, self.fmt)
        return text.rjust(self.width)


class Table:
    """A table in the form of nccl-tests: key columns, then one group of columns per
    implementation, with the group's name centred above it. A group's cells may be replaced by
    one text (why there are no numbers) spanning the group's width."""

    SEP = " "

    def __init__(self, keys: Sequence[Column], groups: Sequence[tuple[str, Sequence[Column]]]):
        self.keys = list(keys)
        self.groups = [(title, list(cols)) for title, cols in groups]

    @classmethod
    def _width(cls, cols: Sequence[Column]) -> int:
        return sum(c.width for c in cols) + len(cls.SEP) * (len(cols) - 1)

    def header(self) -> list[str]:
        key_w = self._width(self.keys)
        titles = [" " * (key_w - 1)]
        names = [self.SEP.join(c.name.rjust(c.width) for c in self.keys)[1:]]
        units = [self.SEP.join(c.unit.rjust(c.width) for c in self.keys)[1:]]
        for title, cols in self.groups:
            w = self._width(cols)
            titles.append(title[:w].center(w))
            names.append(self.SEP.join(c.name.rjust(c.width) for c in cols))
            units.append(self.SEP.join(c.unit.rjust(c.width) for c in cols))
        gap = self.SEP * 2
        return ["#" + gap.join(titles).rstrip(), "#" + gap.join(names).rstrip(),
                "#" + gap.join(units).rstrip()]

    def row(self, keys: Sequence, groups: Sequence[Sequence | str]) -> str:
        parts = [self.SEP.join(c.cell(v) for c, v in zip(self.keys, keys))]
        for (_, cols), values in zip(self.groups, groups):
            if isinstance(values, str):
                w = self._width(cols)
                text = values if len(values) <= w else values[:w - 3] + "..."
                parts.append(text.rjust(w))
            else:
                parts.append(self.SEP.join(c.cell(v) for c, v in zip(cols, values)))
        return (self.SEP * 2).join(parts)


def dump_stacks_on_sigterm() -> None:
    """On SIGTERM (what `timeout` sends first), print every Python thread's stack on stderr, then
    die of the signal as before (chain): a run stopped at its bound says where it was."""
    import faulthandler
    import signal
    faulthandler.register(signal.SIGTERM, file=sys.stderr, all_threads=True, chain=True)


def write_json(path: str, data: dict) -> None:
    """Written to a temporary file beside `path`, then renamed over it: a process killed while
    writing leaves the previous complete file, never half of one (bench/ring.py rewrites its
    JSON after every size)."""
    part = f"{path}.part"
    with open(part, "w") as f:
        json.dump(data, f, indent=1, sort_keys=False)
        f.write("\n")
    os.replace(part, path)


def write_csv(path: str, fieldnames: Sequence[str], rows: Iterable[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(fieldnames))
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in fieldnames})


class PlotUnavailable(RuntimeError):
    pass


def require_matplotlib():
    """The pyplot module with a file-only backend, or PlotUnavailable saying what to do."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise PlotUnavailable(
            f"--plot needs matplotlib, which cannot be imported here ({e}). Install it with "
            "`pip install matplotlib`, or drop --plot and plot later from the --json or --csv "
            "output.") from e
    return plt


def plot_sweep(path: str, series: dict[str, list[tuple[int, float, float]]], title: str,
               dashed: Iterable[str] = ()) -> None:
    """Two panels against message size (log axes): bus bandwidth and time. series maps a line's
    label to (size_bytes, time_us, busbw_gbps) points."""
    plt = require_matplotlib()
    dashed = set(dashed)
    fig, (ax_bw, ax_t) = plt.subplots(1, 2, figsize=(13, 5))
    for label, points in series.items():
        if not points:
            continue
        pts = sorted(points)
        xs = [p[0] for p in pts]
        style = "--" if label in dashed else "-"
        ax_bw.plot(xs, [max(p[2], 1e-6) for p in pts], style, marker=".", label=label)
        ax_t.plot(xs, [p[1] for p in pts], style, marker=".", label=label)
    for ax, ylabel in ((ax_bw, "busbw (GB/s)"), (ax_t, "time (us)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("size per rank (bytes)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
