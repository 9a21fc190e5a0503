"""Latency of the raw shared-memory transport: ringreduce._dist_C.Comm.all_reduce on CPU tensors,
one process per rank, no torch.distributed and no engine in between.

Every rank builds a Comm the way ringreduce/distributed.py does (segment names exchanged
through a FileStore, attach, unlink), then times each all_reduce call (float32, sum) after a
warm-up; the table gives, per size, the median over calls of the slowest rank's median, and
the spread (10th/90th percentile) on that rank, and the period of a loop of back-to-back calls
(loop(us), the slowest rank's). Inputs are small integers refilled before every
call (outside the timed region), so every result is checked exactly (#wrong).

    python bench/shm_latency.py                         # 2 and 4 ranks, default threshold
    python bench/shm_latency.py --small-bytes 0         # ring only (small path disabled)
    python bench/shm_latency.py --small-bytes 0 65536   # both, side by side
    python bench/shm_latency.py --ranks 2 --sizes 8 1K 16K 64K 256K --json out.json

--small-bytes sets RINGREDUCE_SMALL_BYTES in the ranks ("default": leave it unset); --spin-us
sets RINGREDUCE_SPIN_US. Exits non-zero if any result is wrong or a rank fails.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import format_size, parse_size  # noqa: E402

DEFAULT_SIZES = ("8", "1K", "64K", "1M")


def _percentile(values, q):
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


def _iters_for(nbytes, budget_s, base_iters):
    """Fewer calls for large messages, so a sweep stays within a few seconds per size."""
    guess_us = 20 + nbytes / 1000.0  # ~1 GB/s: pessimistic on a busy machine
    return max(50, min(base_iters, int(budget_s * 1e6 / guess_us)))


def _rank(rank, world, store_path, env, sizes, iters, budget_s, capacity, queue):
    os.environ.update(env)
    try:
        torch.set_num_threads(1)
        from torch.distributed import FileStore

        from ringreduce import _dist_C

        store = FileStore(store_path, world)
        tag = f"bench-{os.getppid()}-{time.monotonic_ns() % 100000}"
        if rank == 0:
            store.set("tag", tag)
        tag = store.get("tag").decode()
        comm = _dist_C.Comm(rank, world, capacity, 60.0, tag, 1 << 20)
        store.set(f"name/{rank}", comm.name)
        names = [store.get(f"name/{r}").decode() for r in range(world)]
        comm.attach(names)
        store.set(f"mapped/{rank}", "1")
        store.wait([f"mapped/{r}" for r in range(world)])
        comm.unlink()
        rows = []
        for nbytes in sizes:
            count = max(1, nbytes // 4)
            src = torch.full((count,), float(rank + 1))
            src[::3] = float(2 * rank + 1)
            expect = sum(torch.where(torch.arange(count) % 3 == 0, 2.0 * r + 1, r + 1.0)
                         for r in range(world)).to(torch.float32)
            t = src.clone()
            n = _iters_for(nbytes, budget_s, iters)
            times = []
            wrong = 0
            for i in range(n + max(20, n // 10)):
                t.copy_(src)
                t0 = time.perf_counter_ns()
                comm.all_reduce(t, "sum")
                t1 = time.perf_counter_ns()
                if i >= max(20, n // 10):
                    times.append((t1 - t0) / 1000.0)
                if not torch.equal(t, expect):
                    wrong += int((t != expect).sum())
            # Back to back without refills or checks: the period of a loop of calls, which no
            # rank can hide by arriving late (the sums overflow to inf; same speed).
            t.copy_(src)
            comm.all_reduce(t, "sum")
            t0 = time.perf_counter_ns()
            for _ in range(n):
                comm.all_reduce(t, "sum")
            loop_us = (time.perf_counter_ns() - t0) / 1000.0 / n
            rows.append({"bytes": count * 4, "count": count, "calls": n, "loop_us": loop_us,
                         "median_us": statistics.median(times),
                         "p10_us": _percentile(times, 0.1), "p90_us": _percentile(times, 0.9),
                         "wrong": wrong})
        comm.close()
        queue.put((rank, "ok", rows))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))


def run(world, env, sizes, iters, budget_s, capacity):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank, args=(r, world, store, env, sizes, iters, budget_s,
                                                 capacity, queue)) for r in range(world)]
        for p in procs:
            p.start()
        results = {}
        for _ in range(world):
            rank, status, value = queue.get(timeout=600)
            results[rank] = (status, value)
        for p in procs:
            p.join(timeout=30)
    errors = [f"rank {r}: {v}" for r, (s, v) in sorted(results.items()) if s != "ok"]
    if errors:
        raise RuntimeError("\n".join(errors))
    out = []
    for i, _ in enumerate(sizes):
        per_rank = [results[r][1][i] for r in range(world)]
        slow = max(per_rank, key=lambda row: row["median_us"])
        out.append(dict(slow, wrong=sum(row["wrong"] for row in per_rank),
                        loop_us=max(row["loop_us"] for row in per_rank)))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--sizes", type=parse_size, nargs="+",
                   default=[parse_size(s) for s in DEFAULT_SIZES])
    p.add_argument("--small-bytes", nargs="+", default=["default", "0"],
                   help="values of RINGREDUCE_SMALL_BYTES to compare ('default': unset)")
    p.add_argument("--spin-us", default=None, help="RINGREDUCE_SPIN_US for the ranks")
    p.add_argument("--iters", type=int, default=2000, help="timed calls per size (at most)")
    p.add_argument("--budget", type=float, default=2.0, help="seconds per size, roughly")
    p.add_argument("--shm-bytes", type=parse_size, default=4 << 20,
                   help="staging capacity per rank (RINGREDUCE_SHM_BYTES' default)")
    p.add_argument("--json", help="write the rows and the configuration here")
    args = p.parse_args(argv)

    cpus = len(os.sched_getaffinity(0))
    print(f"# shm_latency: torch {torch.__version__}, {cpus} usable cpus, "
          f"ringreduce from {os.path.dirname(__import__('ringreduce').__file__)}")
    header = (f"{'ranks':>5} {'small_bytes':>11} {'size':>9} {'count':>8} {'time(us)':>9} "
              f"{'p10(us)':>8} {'p90(us)':>8} {'loop(us)':>8} {'#wrong':>6}")
    print(header)
    rows = []
    bad = False
    for world in args.ranks:
        for small in args.small_bytes:
            env = {} if small == "default" else {"RINGREDUCE_SMALL_BYTES": str(small)}
            if args.spin_us is not None:
                env["RINGREDUCE_SPIN_US"] = str(args.spin_us)
            for row in run(world, env, args.sizes, args.iters, args.budget, args.shm_bytes):
                row.update(ranks=world, small_bytes=small, cpus=cpus, spin_us=args.spin_us)
                rows.append(row)
                bad |= row["wrong"] != 0
                print(f"{world:>5} {small:>11} {format_size(row['bytes']):>9} {row['count']:>8} "
                      f"{row['median_us']:>9.1f} {row['p10_us']:>8.1f} {row['p90_us']:>8.1f} "
                      f"{row['loop_us']:>8.1f} {row['wrong']:>6}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv, "cpus": cpus, "torch": torch.__version__,
                       "rows": rows}, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
