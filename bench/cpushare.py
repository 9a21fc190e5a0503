"""Where a CPU all-reduce's time goes under load: per rank, the wall time per call beside the CPU
time it used and its context switches (voluntary: futex sleeps; involuntary: preempted or
yielded), with its ranks placed where asked.

    python bench/cpushare.py --size 64M                        # quiet
    python bench/cpushare.py --size 64M --load 2               # one busy loop per core, own sessions
    python bench/cpushare.py --size 64M --load 2 --session same
    python bench/cpushare.py --size 16M --pin                  # every rank on one CPU

CPU time / wall time is the share of a core a rank got (or burnt spinning): quiet about 1.0;
beside busy loops in their own sessions about a third where the kernel groups tasks by session
(/proc/sys/kernel/sched_autogroup_enabled), about a half in the same session. CPU time above
the quiet run's is time spent spinning on a peer. bench/load.py measures the slowdowns; this
tells why. Inputs are integer-valued floats: the sum is exact and checked (exit status 1 if
wrong).
"""
from __future__ import annotations

import argparse
import datetime
import os
import queue as queue_module
import resource
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

_BUSY = "while True: pass"


def _rank(rank, world, store, args, queue):
    import ringreduce  # noqa: F401  registers the backend

    if args.pin:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    torch.set_num_threads(1)
    dist.init_process_group("ringreduce", init_method=f"file://{store}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=args.timeout))
    count = args.size // 4
    t = (torch.arange(count, dtype=torch.float32) % 7 + 1) * (rank + 1)
    expect = (torch.arange(count, dtype=torch.float32) % 7 + 1) * (world * (world + 1) // 2)
    for _ in range(args.warmup):
        dist.all_reduce(t)
    dist.barrier()
    r0, w0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(args.iters):
        dist.all_reduce(t)
    w1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    # The timed calls sum in place, over and over: one more call on fresh inputs is checked.
    t = (torch.arange(count, dtype=torch.float32) % 7 + 1) * (rank + 1)
    dist.all_reduce(t)
    wrong = int((t != expect).sum())
    n = args.iters
    queue.put({"rank": rank, "wall_ms": 1e3 * (w1 - w0) / n,
               "cpu_ms": 1e3 * ((r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)) / n,
               "vol": (r1.ru_nvcsw - r0.ru_nvcsw) / n, "invol": (r1.ru_nivcsw - r0.ru_nivcsw) / n,
               "wrong": wrong})
    dist.destroy_process_group()


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--size", type=common.parse_size, default=64 << 20, help="bytes per rank")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--load", type=int, default=0, help="busy-loop processes beside the ranks")
    p.add_argument("--session", choices=("own", "same"), default="own",
                   help="the busy loops in sessions of their own, or in this one")
    p.add_argument("--pin", action="store_true", help="every rank on the lowest usable CPU")
    p.add_argument("--timeout", type=float, default=120.0)
    args = p.parse_args(argv)
    if args.ranks < 2 or args.iters < 1 or args.load < 0 or args.size < 4:
        p.error("--ranks >= 2, --iters >= 1, --load >= 0, --size >= 4")
    args.size -= args.size % 4
    return args


def main(argv=None):
    args = parse_args(argv)
    loads = [subprocess.Popen([sys.executable, "-c", _BUSY], stdin=subprocess.DEVNULL,
                              start_new_session=args.session == "own")
             for _ in range(args.load)]
    store = f"/tmp/ringreduce-cpushare-{os.getpid()}-{time.monotonic_ns()}"
    try:
        if loads:
            time.sleep(0.5)
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        procs = [ctx.Process(target=_rank, args=(r, args.ranks, store, args, queue))
                 for r in range(args.ranks)]
        for p in procs:
            p.start()
        rows = []
        deadline = time.monotonic() + args.timeout + 60
        while len(rows) < args.ranks and time.monotonic() < deadline:
            try:
                rows.append(queue.get(timeout=1.0))
            except queue_module.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    finally:
        for p in loads:
            p.kill()
            p.wait()
        if os.path.exists(store):
            os.unlink(store)
    if len(rows) < args.ranks:
        print(f"only {len(rows)} of {args.ranks} ranks reported", file=sys.stderr)
        return 2
    where = f"{args.load} busy loops ({args.session} session)" if args.load else "quiet"
    print(f"# {args.ranks} ranks, {common.format_size(args.size)} float32 sum, {args.iters} calls, "
          f"{where}{', ranks pinned to one CPU' if args.pin else ''}")
    print("# rank  wall ms/call  cpu ms/call  cpu/wall  sleeps/call  preempted/call  #wrong")
    for r in sorted(rows, key=lambda r: r["rank"]):
        print(f"  {r['rank']:4d}  {r['wall_ms']:12.2f}  {r['cpu_ms']:11.2f}  "
              f"{r['cpu_ms'] / r['wall_ms']:8.2f}  {r['vol']:11.1f}  {r['invol']:14.1f}  "
              f"{r['wrong']:6d}")
    return 1 if any(r["wrong"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
