"""What torch's flight recorder costs a ringreduce collective: dist.all_reduce on CPU tensors
with the recorder off (TORCH_FR_BUFFER_SIZE unset) and on (TORCH_FR_BUFFER_SIZE=2000), in fresh
processes for each, the modes taking turns (each first in turn) so that the machine's load
falls on all alike.

    python bench/fr_cost.py                               # 2 ranks, 8 B to 64 KiB, 3 trials
    python bench/fr_cost.py --trials 5 --json fr.json
    python bench/fr_cost.py --base /tmp/before            # also a tree without the recorder

--base DIR adds a third mode, "base": the ringreduce package of another checkout (one before
the recorder, with its extensions built in place or under --base-cache as RINGREDUCE_CACHE_DIR),
so that "off" can be compared with no recorder at all.

Per trial and mode: the time of init_process_group, of the cold call (the group's first
all_reduce, 8 B, after the ranks met at the store) and, per size, the median over --iters calls
of the slowest rank's time (host wall clock, each call synchronous). The table gives, per size,
the median over trials of those medians, the 10th/90th percentile of the per-call times pooled
over trials, and on - off (and off - base). Each call's input is refilled outside the timed
region and every result checked (#wrong). Each rank counts the ringreduce entries in torch's
dump at the end: none when off (and base), one per call when on, up to the buffer's 2000
(checked: the exit status is 1 otherwise).
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

MODES = {"off": {}, "on": {"TORCH_FR_BUFFER_SIZE": "2000"}}
FR_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
COLD_BYTES = 8


def _store_barrier(store, key, world):
    store.add(key, 1)
    deadline = time.monotonic() + 60
    while int(store.add(key, 0)) < world:
        if time.monotonic() > deadline:
            raise TimeoutError(f"ranks did not meet at {key}")
        time.sleep(0.0005)


def _rank(rank, world, store_path, env, tree, sizes, iters, warmup, queue):
    try:
        for v in FR_VARS:
            os.environ.pop(v, None)
        os.environ.update(env)
        if tree:
            sys.path.insert(0, tree)
        import json

        import torch
        import torch.distributed as dist

        import ringreduce  # registers the backend

        if tree and not os.path.abspath(ringreduce.__file__).startswith(os.path.abspath(tree)):
            raise RuntimeError(f"ringreduce came from {ringreduce.__file__}, not from {tree}")

        torch.set_num_threads(1)
        store = dist.FileStore(store_path, world)
        t0 = time.perf_counter()
        dist.init_process_group("ringreduce", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        init_s = time.perf_counter() - t0
        cold = torch.full((COLD_BYTES // 4,), float(rank + 1))
        _store_barrier(store, "cold", world)
        t0 = time.perf_counter()
        dist.all_reduce(cold)
        cold_s = time.perf_counter() - t0
        calls = 1
        expected = world * (world + 1) / 2
        wrong = int((cold != expected).sum())
        per_size = {}
        for nbytes in sizes:
            t = torch.empty(max(1, nbytes // 4))
            times = []
            for i in range(warmup + iters):
                t.fill_(float(rank + 1))
                t0 = time.perf_counter()
                dist.all_reduce(t)
                dt = time.perf_counter() - t0
                if i >= warmup:
                    times.append(dt)
            calls += warmup + iters
            wrong += int((t != expected).sum())
            per_size[nbytes] = times
        entries = json.loads(torch._C._distributed_c10d._dump_fr_trace_json(True, False))
        recorded = sum(1 for e in entries.get("entries", []) or []
                       if e["profiling_name"].startswith("ringreduce:"))
        dist.destroy_process_group()
        queue.put((rank, {"init_s": init_s, "cold_s": cold_s, "times": per_size,
                          "wrong": wrong, "calls": calls, "recorded": recorded}))
    except BaseException:
        queue.put((rank, {"error": traceback.format_exc()}))


def run_trial(mode, args):
    import torch.multiprocessing as mp
    env, tree = dict(MODES.get(mode, {})), None
    if mode == "base":
        tree = os.path.abspath(args.base)
        if args.base_cache:
            env["RINGREDUCE_CACHE_DIR"] = args.base_cache
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        procs = [ctx.Process(target=_rank, args=(r, args.ranks, os.path.join(d, "store"),
                                                 env, tree, args.sizes, args.iters,
                                                 args.warmup, queue))
                 for r in range(args.ranks)]
        for p in procs:
            p.start()
        results = {}
        for _ in procs:
            r, res = queue.get(timeout=600)
            results[r] = res
        for p in procs:
            p.join(timeout=60)
    for r, res in sorted(results.items()):
        if "error" in res:
            raise RuntimeError(f"{mode}: rank {r} failed:\n{res['error']}")
    return [results[r] for r in range(args.ranks)]


def _pct(values, q):
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--sizes", type=common.parse_size, nargs="+",
                   default=[8, 64, 512, 4096, 32768, 65536])
    p.add_argument("--iters", type=int, default=1000, help="timed calls per size and trial")
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--trials", type=int, default=3, help="process sets per mode, alternating")
    p.add_argument("--base", metavar="DIR", help="a checkout without the recorder: mode 'base'")
    p.add_argument("--base-cache", metavar="DIR", help="RINGREDUCE_CACHE_DIR for --base")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    modes = (["base"] if args.base else []) + list(MODES)

    import torch
    load_start = os.getloadavg()
    print(f"# bench/fr_cost.py  {common.now_iso()}  host {common.host_info()['host']}")
    print(f"# cpu: {common.cpu_model()} ({os.cpu_count()} logical cores)  torch {torch.__version__}")
    print(f"# command: {common.command_line()}")
    print(f"# {args.ranks} ranks (processes), CPU tensors, float32 sum, dist.all_reduce "
          f"(ringreduce backend); {args.iters} timed calls per size after {args.warmup}; "
          f"{args.trials} trials per mode; 'on' = TORCH_FR_BUFFER_SIZE=2000")
    print("# load average (1, 5, 15 min) at start: " + ", ".join(f"{x:.2f}" for x in load_start))

    runs = {m: [] for m in modes}
    for i in range(args.trials):
        for mode in modes[i % len(modes):] + modes[:i % len(modes)]:  # each mode first in turn
            runs[mode].append(run_trial(mode, args))

    failed = False
    for mode, trials in runs.items():
        for ranks in trials:
            for r, res in enumerate(ranks):
                want = min(res["calls"], 2000) if mode == "on" else 0
                if res["recorded"] != want or res["wrong"]:
                    failed = True
                    print(f"# WRONG: {mode}, rank {r}: {res['recorded']} entries recorded "
                          f"(expected {want}), {res['wrong']} wrong elements")

    def slowest(trial, nbytes):
        return [max(per) for per in zip(*(res["times"][nbytes] for res in trial))]

    print("#")
    print("# per call, the slowest rank's time (us): median over trials of each trial's median;"
          " p10/p90 of all calls")
    deltas = (["off-base"] if "base" in runs else []) + ["on-off"]
    print(f"# {'size':>8} {'count':>7} {'type':>8} {'redop':>5}"
          + "".join(f"   {m:>7} {'p10':>6} {'p90':>6}" for m in runs) + "  "
          + "".join(f" {d:>8}" for d in deltas) + f" {'#wrong':>6}")
    print(f"# {'(B)':>8} {'(elems)':>7}")
    rows = []
    for nbytes in args.sizes:
        row = {"bytes": nbytes, "count": max(1, nbytes // 4)}
        for mode, trials in runs.items():
            per_trial = [statistics.median(slowest(t, nbytes)) * 1e6 for t in trials]
            pooled = [x * 1e6 for t in trials for x in slowest(t, nbytes)]
            row[mode] = statistics.median(per_trial)
            row[mode + "_trials"] = per_trial
            row[mode + "_p10"] = _pct(pooled, 0.1)
            row[mode + "_p90"] = _pct(pooled, 0.9)
        for d in deltas:
            later, earlier = d.split("-")
            row[d] = row[later] - row[earlier]
        row["wrong"] = sum(res["wrong"] for trials in runs.values() for t in trials for res in t)
        rows.append(row)
        print(f"  {nbytes:>8} {row['count']:>7} {'float32':>8} {'sum':>5}"
              + "".join(f"   {row[m]:7.1f} {row[m + '_p10']:6.1f} {row[m + '_p90']:6.1f}"
                        for m in runs) + "  "
              + "".join(f" {row[d]:+8.1f}" for d in deltas) + f" {row['wrong']:>6}")
    print("#")
    cold = {}
    for mode, trials in runs.items():
        inits = [max(res["init_s"] for res in t) * 1e3 for t in trials]
        colds = [max(res["cold_s"] for res in t) * 1e6 for t in trials]
        cold[mode] = {"init_ms": inits, "cold_us": colds}
        print(f"# {mode:>4}: init_process_group (ms, slowest rank, per trial): "
              + " ".join(f"{x:.1f}" for x in inits)
              + f";  cold call, {COLD_BYTES} B (us, slowest rank, per trial): "
              + " ".join(f"{x:.0f}" for x in colds))
    load_end = os.getloadavg()
    print("# load average (1, 5, 15 min) at end: " + ", ".join(f"{x:.2f}" for x in load_end))
    if args.json:
        common.write_json(args.json, {"config": vars(args) | {"host": common.host_info(),
                                                             "command": common.command_line(),
                                                             "load_start": load_start,
                                                             "load_end": load_end},
                                      "rows": rows, "cold": cold})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
