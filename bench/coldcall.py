"""The cold call: dist.all_reduce on CPU when the ranks arrive together at an idle backend (the
common case in training: compute, then one collective), beside back-to-back calls.

    python bench/coldcall.py                          # 2 ranks, 8 B .. 64 MiB, every config
    python bench/coldcall.py --sizes 8 1K 64K --iters 400 --json cold.json
    python bench/coldcall.py --configs ringreduce,ringreduce-sync --sizes 8

Configurations, all in the same processes (one torch.distributed group each):
- ringreduce: the default group, the backend as a user gets it (asynchronous engine);
- ringreduce-sync: a ringreduce group made with RINGREDUCE_ASYNC=0 (every collective inline);
- gloo: torch's gloo group;
- fake: torch's FakeProcessGroup (torch.testing._internal.distributed.fake_pg), which moves no
  bytes: what torch's dispatch of dist.all_reduce costs by itself (the floor).

cold: before every timed call the ranks meet at a neutral barrier outside the timing (a spin on
flags in a shared-memory file of this benchmark's own; no torch.distributed, no ringreduce), so
they are released together; each rank times its own call, the iteration's time is the slowest
rank's, and the table gives the median over iterations. Each iteration visits every
configuration once, in the next of all their orders (visit_order), so drift (the machine's other
work, frequency) hits all of them alike, and each configuration comes right after each other one
equally often. gloo is timed in a pass of its own, after the others, for each size: a gloo call
leaves the machine busy for a while after it returns (its threads), and interleaved with it every
other configuration measured 3-5x its own time (2026-11-26, quiet 2-core VM, 8 B: fake 28.9 us
with gloo in the rotation, 6.4 us without; ringreduce 42.1 against 8.0).
b2b: runs of back-to-back calls (no barrier in between), timed one by one; the same per-call
statistic (slowest rank, median). Runs of the configurations alternate as above.

The buffers are integer-valued; the first call of each size is checked exactly (#wrong, fake
excepted). Timed calls keep summing into the same buffer (values grow, up to inf: the work does
not change, there are no denormals). Exits non-zero if a result is wrong or a rank fails.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import mmap
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

CONFIGS = ("ringreduce", "ringreduce-sync", "gloo", "fake")
DEFAULT_SIZES = ("8", "64", "1K", "4K", "16K", "64K", "256K", "1M", "4M", "16M", "64M")
SLOT = 64  # bytes per rank's flag in the barrier file: one cache line each


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma-separated subset of {','.join(CONFIGS)} (default: all)")
    p.add_argument("--sizes", nargs="+", type=common.parse_size,
                   default=[common.parse_size(s) for s in DEFAULT_SIZES],
                   help="message sizes in bytes (float32), e.g. 8 1K 64K 1M")
    p.add_argument("--iters", type=int, default=200,
                   help="timed cold calls per size and configuration (fewer from 1 MiB up: "
                        "at most 256 MiB moved per configuration and size, at least 8)")
    p.add_argument("--warmup", type=int, default=5, help="untimed rounds before timing")
    p.add_argument("--b2b-run", type=int, default=20,
                   help="back-to-back calls per run (runs alternate between configurations)")
    p.add_argument("--timeout", type=float, default=120.0, help="group timeout (s)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in args.configs if c not in CONFIGS]
    if bad or not args.configs:
        p.error(f"--configs: unknown {bad}; choose from {', '.join(CONFIGS)}")
    if args.ranks < 2:
        p.error("--ranks must be at least 2 (a cold call needs peers)")
    return args


def visit_order(configs, i):
    """The order of iteration i's calls: every permutation of `configs` in turn, so that over
    any len(configs)! consecutive iterations each configuration directly follows each other one
    equally often (a rotation would always put the same one after gloo)."""
    orders = list(itertools.permutations(configs))
    return orders[i % len(orders)]


def passes(configs):
    """The configurations timed together (interleaved), pass after pass: gloo alone, last."""
    together = [c for c in configs if c != "gloo"]
    return [p for p in (together, [c for c in configs if c == "gloo"]) if p]


def iterations(size, args):
    return max(8, min(args.iters, (256 * common.MiB) // max(size, 1)))


class ShmBarrier:
    """A barrier on one flag per rank in a shared file: a rank writes its epoch into its own
    slot, then spins until every slot holds it. The last rank to arrive releases everyone within
    a cache-line transfer; nothing here touches torch.distributed or the backends measured."""

    def __init__(self, path, rank, world):
        fd = os.open(path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, SLOT * world)
        finally:
            os.close(fd)
        self._flags = memoryview(self._mm).cast("q")
        self._stride = SLOT // 8
        self._mine = rank * self._stride
        self._all = [r * self._stride for r in range(world)]
        self._epoch = 0

    def wait(self, deadline_s=120.0):
        self._epoch += 1
        e, flags = self._epoch, self._flags
        flags[self._mine] = e
        give_up = time.monotonic() + deadline_s
        for i in self._all:
            spins = 0
            while flags[i] < e:
                spins += 1
                if spins & 0xFFFFF == 0 and time.monotonic() > give_up:
                    raise TimeoutError(f"coldcall barrier: no rank at slot {i // self._stride} "
                                       f"within {deadline_s} s")

    def close(self):
        self._flags.release()
        self._mm.close()


def _rank_main(rank, world, store, barrier_path, args, queue):
    common.report_rank(queue, rank, lambda: _rank_body(rank, world, store, barrier_path, args))


def _make_groups(rank, world, store, args):
    import torch.distributed as dist

    import ringreduce  # noqa: F401  (registers the backend)

    timeout = datetime.timedelta(seconds=args.timeout)
    os.environ.pop("RINGREDUCE_ASYNC", None)
    dist.init_process_group("ringreduce", init_method=f"file://{store}", rank=rank,
                            world_size=world, timeout=timeout)
    groups = {"ringreduce": dist.group.WORLD}
    # Every rank makes every group, in one order (new_group is collective).
    os.environ["RINGREDUCE_ASYNC"] = "0"  # read when the backend is made
    groups["ringreduce-sync"] = dist.new_group(backend="ringreduce", timeout=timeout)
    del os.environ["RINGREDUCE_ASYNC"]
    groups["gloo"] = dist.new_group(backend="gloo", timeout=timeout)
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")
    groups["fake"] = dist.new_group(backend="fake", timeout=timeout)
    return groups


def _rank_body(rank, world, store, barrier_path, args):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    groups = _make_groups(rank, world, store, args)
    configs = args.configs
    bar = ShmBarrier(barrier_path, rank, world)
    out = []
    for size in args.sizes:
        count = max(1, size // 4)
        bufs, wrong = common.checked_buffers(size, rank, world, {c: groups[c] for c in configs},
                                             before=bar.wait, unchecked=("fake",))
        n = iterations(size, args)
        cold = {c: [] for c in configs}
        b2b = {c: [] for c in configs}
        runs = max(2, (n + args.b2b_run - 1) // args.b2b_run)
        for together in passes(configs):
            for i in range(args.warmup + n):
                for c in visit_order(together, i):
                    bar.wait()
                    t0 = time.perf_counter()
                    dist.all_reduce(bufs[c], group=groups[c])
                    t1 = time.perf_counter()
                    if i >= args.warmup:
                        cold[c].append(t1 - t0)
            for i in range(runs):
                for c in visit_order(together, i):
                    bar.wait()
                    buf, group = bufs[c], groups[c]
                    dist.all_reduce(buf, group=group)  # the run's first call is not back-to-back
                    for _ in range(args.b2b_run):
                        t0 = time.perf_counter()
                        dist.all_reduce(buf, group=group)
                        b2b[c].append(time.perf_counter() - t0)
        out.append({"size": size, "count": count, "iters": n, "cold": cold, "b2b": b2b,
                    "wrong": wrong})
        del bufs
    bar.close()
    # Every rank's times to rank 0 (over gloo, after the timing).
    everyone = [None] * world
    dist.all_gather_object(everyone, out, group=groups["gloo"])
    for name in ("ringreduce-sync", "gloo", "fake"):
        dist.destroy_process_group(groups[name])
    dist.destroy_process_group()
    return everyone if rank == 0 else None


def summarise(everyone, configs):
    rows = []
    for i, r0 in enumerate(everyone[0]):
        row = {"size": r0["size"], "count": r0["count"], "iters": r0["iters"]}
        for c in configs:
            row[c] = {
                "cold_us": common.per_call_median([rk[i]["cold"][c] for rk in everyone]),
                "b2b_us": common.per_call_median([rk[i]["b2b"][c] for rk in everyone]),
                "wrong": (None if r0["wrong"][c] is None else
                          sum(rk[i]["wrong"][c] for rk in everyone)),
            }
        rows.append(row)
    return rows


def git_commit():
    try:
        res = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                             text=True, timeout=10,
                             cwd=os.path.dirname(os.path.abspath(__file__)))
        return res.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main(argv=None, out=sys.stdout):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import torch.multiprocessing as mp

    info = common.host_info()
    load = {"start": os.getloadavg()}
    print(f"# bench/coldcall.py  {info['date']}  host {info['host']}  commit {git_commit()}",
          file=out)
    print(f"# cpu: {info['cpu']} ({info['cpu_count']} logical cores)  torch {info['torch']}",
          file=out)
    print(f"# {args.ranks} ranks, float32 sum, configurations {', '.join(args.configs)} in the "
          "same processes, interleaved (gloo in a pass of its own)", file=out)
    print(f"# command: {common.command_line()}", file=out)
    print("# load average (1, 5, 15 min) at start: " +
          ", ".join(f"{x:.2f}" for x in load["start"]), file=out)
    out.flush()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp, \
            tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="coldcall-") as bar:
        bar.truncate(SLOT * args.ranks)
        bar.flush()
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank_main, args=(r, args.ranks, store, bar.name, args, queue))
                 for r in range(args.ranks)]
        results = common.collect_ranks(procs, queue)
    load["end"] = os.getloadavg()
    errors = [f"rank {r}: {v}" for r, (s, v) in sorted(results.items()) if s != "ok"]
    if errors or 0 not in results:
        print("bench/coldcall.py failed:\n" + ("\n".join(errors) or "ranks exited without "
              "reporting"), file=sys.stderr)
        return 2
    rows = summarise(results[0][1], args.configs)
    print("# load average at end: " + ", ".join(f"{x:.2f}" for x in load["end"]), file=out)
    print("# cold: ranks released together from a barrier outside the timing; b2b: back-to-back "
          "calls; both the median over calls of the slowest rank's time", file=out)
    cols = [common.Column("cold", "(us)", 9, ".1f"), common.Column("b2b", "(us)", 9, ".1f"),
            common.Column("#wrong", "", 6, "s")]
    diffs = []
    if "ringreduce" in args.configs and "ringreduce-sync" in args.configs:
        diffs.append(("ringreduce-sync", "-sync"))
    if "ringreduce" in args.configs and "fake" in args.configs:
        diffs.append(("fake", "-fake"))
    diff_cols = [common.Column(label, "(us)", 8, "+.1f") for _, label in diffs]
    groups = [(c, cols) for c in args.configs]
    if diffs:
        groups.append(("ringreduce cold", diff_cols))
    table = common.Table([common.Column("size", "(B)", 11, "d"),
                          common.Column("iters", "", 6, "d")], groups)
    print(file=out)
    print("\n".join(table.header()), file=out)
    bad = False
    for row in rows:
        cells = []
        for c in args.configs:
            r = row[c]
            bad = bad or bool(r["wrong"])
            cells.append([r["cold_us"], r["b2b_us"], "-" if r["wrong"] is None else str(r["wrong"])])
        if diffs:
            cells.append([row["ringreduce"]["cold_us"] - row[other]["cold_us"]
                          for other, _ in diffs])
        print(table.row([row["size"], row["iters"]], cells), file=out)
    if args.json:
        common.write_json(args.json, {"host": info, "commit": git_commit(),
                                      "config": {k: v for k, v in vars(args).items()
                                                 if k != "json"},
                                      "load_average": load, "rows": rows})
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
