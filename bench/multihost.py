"""ringreduce across two simulated hosts against gloo over the same ranks: all-reduce per-call
time, 8 B to 64 MiB, both in the same processes and the same run.

    sudo python bench/multihost.py                       # 2 hosts x 2 ranks, 8 B .. 64 MiB
    sudo python bench/multihost.py --sizes 8 1K 1M --iters 20 --json mh.json

Each host is a launcher in mount and UTS namespaces of its own (`unshare --mount --uts`): a
private tmpfs on /dev/shm (no shared-memory segment can cross hosts), a hostname of its own
(which is how ringreduce finds the hosts: no RINGREDUCE_HOST_ID), and TCP on 127.0.0.1 only
between hosts (the store and gloo, GLOO_SOCKET_IFNAME=lo). This needs root (or user
namespaces) and util-linux's unshare; the command says so and exits 2 where it cannot.

Every rank makes the ringreduce group (the default group: the ring inside each host, gloo
between hosts, composed in C++) and a gloo group over the same ranks. For each size, iteration
i calls both, in an order alternating with i, so drift hits both alike; each call is timed on
its own (back-to-back calls, no barrier), an iteration's time is its slowest rank's, and the
table gives the median over iterations, the ratio ringreduce / gloo (below 1: ringreduce is
faster) and gloo's time over ringreduce's (speedup). Beside each time, the CPU time the call
took in all the ranks' processes together (every thread: gloo's too), median over iterations:
where it nears cores x time the ranks share saturated cores, and the time ratio can only follow
the CPU ratio. Buffers are integer-valued float32; the first call of each size is checked
exactly (#wrong). Exits 1 if a result is wrong, 2 if a rank fails.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

DEFAULT_SIZES = ("8", "1K", "8K", "64K", "256K", "1M", "4M", "16M", "64M")
BACKENDS = ("ringreduce", "gloo")
HERE = os.path.abspath(__file__)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--ranks-per-host", type=int, default=2)
    p.add_argument("--sizes", nargs="+", type=common.parse_size,
                   default=[common.parse_size(s) for s in DEFAULT_SIZES],
                   help="message sizes in bytes (float32), e.g. 8 1K 1M")
    p.add_argument("--iters", type=int, default=50,
                   help="timed calls per size and backend (fewer for large sizes: at most "
                        "256 MiB moved per backend and size, at least 5)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300.0, help="group timeout (s)")
    p.add_argument("--json", default=None, help="write the results here")
    # Internal: one host's launcher (inside its namespaces), and one rank.
    p.add_argument("--launch-host", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def iterations(size, args):
    return max(5, min(args.iters, (256 * common.MiB) // max(size, 1)))


def namespaces_unavailable():
    """Why the hosts cannot be simulated here, or None."""
    if shutil.which("unshare") is None:
        return "util-linux's unshare is not installed"
    probe = subprocess.run(["unshare", "--mount", "--uts", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs tmpfs /dev/shm && hostname probe"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return ("cannot make mount and UTS namespaces (run as root): " +
                (probe.stderr.strip() or f"exit {probe.returncode}"))
    return None


# ---------------------------------------------------------------------------------------------
# One rank (inside its host's namespaces).

def _rank_main(rank, world, args, queue):
    common.report_rank(queue, rank, lambda: _rank_body(rank, world, args))


def _rank_body(rank, world, args):
    import torch
    import torch.distributed as dist

    import ringreduce  # noqa: F401  (registers the backend)
    from ringreduce.distributed import comm_of

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=args.timeout)
    dist.init_process_group("ringreduce", init_method=f"tcp://127.0.0.1:{args.port}",
                            rank=rank, world_size=world, timeout=timeout)
    groups = {"ringreduce": dist.group.WORLD, "gloo": dist.new_group(backend="gloo",
                                                                     timeout=timeout)}
    layout = comm_of().layout
    out = {"hosts": layout.hosts, "labels": layout.labels, "sweep": []}
    for size in args.sizes:
        count = max(1, size // 4)
        bufs, wrong = common.checked_buffers(size, rank, world, groups)
        n = iterations(size, args)
        times = {b: [] for b in BACKENDS}
        cpu = {b: [] for b in BACKENDS}
        dist.barrier(group=groups["gloo"])
        for i in range(args.warmup + n):
            for b in (BACKENDS if i % 2 == 0 else BACKENDS[::-1]):
                c0, t0 = time.process_time(), time.perf_counter()
                dist.all_reduce(bufs[b], group=groups[b])
                if i >= args.warmup:
                    times[b].append(time.perf_counter() - t0)
                    cpu[b].append(time.process_time() - c0)
        out["sweep"].append({"size": size, "count": count, "iters": n, "times": times,
                             "cpu": cpu, "wrong": wrong})
        del bufs
    everyone = [None] * world
    dist.all_gather_object(everyone, out, group=groups["gloo"])
    dist.destroy_process_group(groups["gloo"])
    dist.destroy_process_group()
    return everyone if rank == 0 else None


def launch_host(args):
    """One host: its ranks (rank = host * ranks_per_host + local), inside this process's
    namespaces; rank 0's results go to args.out."""
    import torch.multiprocessing as mp

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ.pop("RINGREDUCE_HOST_ID", None)
    world = args.hosts * args.ranks_per_host
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    first = args.launch_host * args.ranks_per_host
    procs = [ctx.Process(target=_rank_main, args=(first + q, world, args, queue))
             for q in range(args.ranks_per_host)]
    results = common.collect_ranks(procs, queue)
    errors = {r: v for r, (s, v) in results.items() if s != "ok"}
    if len(results) < len(procs):
        errors["?"] = "ranks exited without reporting"
    if 0 in results and not errors:
        with open(args.out, "w") as f:
            json.dump(results[0][1], f)
    for r, v in errors.items():
        print(f"bench/multihost.py: host {args.launch_host}, rank {r}:\n{v}", file=sys.stderr)
    return 2 if errors else 0


# ---------------------------------------------------------------------------------------------
# Driver.

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_hosts(args):
    """Starts one launcher per host in namespaces of its own; returns (every rank's results,
    None) or (None, why not)."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        launchers = []
        for h in range(args.hosts):
            inner = [sys.executable, HERE, "--launch-host", str(h), "--port", str(port),
                     "--out", out, "--hosts", str(args.hosts),
                     "--ranks-per-host", str(args.ranks_per_host), "--iters", str(args.iters),
                     "--warmup", str(args.warmup), "--timeout", str(args.timeout),
                     "--sizes", *map(str, args.sizes)]
            script = ('mount -t tmpfs -o size=2g tmpfs /dev/shm && hostname "$0" && exec "$@"')
            launchers.append(subprocess.Popen(
                ["unshare", "--mount", "--uts", "--propagation", "private", "sh", "-c", script,
                 f"host{'ab'[h] if h < 2 else h}", *inner],
                start_new_session=True))
        deadline = time.monotonic() + 60 + args.timeout * 2
        try:
            for p in launchers:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in launchers:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
            return None, "timed out"
        if any(p.returncode != 0 for p in launchers) or not os.path.exists(out):
            return None, "failed (exit codes " + ", ".join(str(p.returncode) for p in launchers) + ")"
        with open(out) as f:
            return json.load(f), None


def main(argv=None, out=sys.stdout):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.launch_host is not None:
        return launch_host(args)
    why = namespaces_unavailable()
    if why:
        print(f"bench/multihost.py: {why}", file=sys.stderr)
        return 2
    info = common.host_info()
    load = {"start": os.getloadavg()}
    print(f"# bench/multihost.py  {info['date']}  host {info['host']}", file=out)
    print(f"# cpu: {info['cpu']} ({info['cpu_count']} logical cores)  torch {info['torch']}",
          file=out)
    print(f"# {args.hosts} simulated hosts x {args.ranks_per_host} ranks (own mount and UTS "
          "namespaces, private /dev/shm, own hostname, TCP on 127.0.0.1); float32 sum; "
          "ringreduce and gloo over the same ranks, interleaved", file=out)
    print(f"# command: {common.command_line()}", file=out)
    print("# load average (1, 5, 15 min) at start: " +
          ", ".join(f"{x:.2f}" for x in load["start"]), file=out)
    out.flush()
    everyone, why = run_hosts(args)
    load["end"] = os.getloadavg()
    if everyone is None:
        print(f"bench/multihost.py: {why}", file=sys.stderr)
        return 2
    print(f"# hosts found by ringreduce: {everyone[0]['hosts']} "
          f"(hostnames {everyone[0]['labels']})", file=out)
    print("# load average at end: " + ", ".join(f"{x:.2f}" for x in load["end"]), file=out)
    print("# time: per call, the slowest rank's, median over iterations; ratio: ringreduce / "
          "gloo; speedup: gloo / ringreduce", file=out)
    print("# cpu: per call, the CPU time of every rank's process (all its threads) added up, "
          "median over iterations", file=out)
    cols = [common.Column("time", "(us)", 11, ".1f"), common.Column("cpu", "(us)", 11, ".1f"),
            common.Column("#wrong", "", 6, "d")]
    table = common.Table([common.Column("size", "(B)", 11, "d"),
                          common.Column("iters", "", 6, "d")],
                         [(b, cols) for b in BACKENDS] +
                         [("ringreduce vs gloo", [common.Column("ratio", "", 7, ".2f"),
                                                   common.Column("speedup", "", 7, ".2f")])])
    print(file=out)
    print("\n".join(table.header()), file=out)
    rows, bad = [], False
    for i, r0 in enumerate(everyone[0]["sweep"]):
        row = {"size": r0["size"], "iters": r0["iters"]}
        for b in BACKENDS:
            sweeps = [rk["sweep"][i] for rk in everyone]
            row[b] = {"time_us": common.per_call_median([sw["times"][b] for sw in sweeps], max),
                      "cpu_us": common.per_call_median([sw["cpu"][b] for sw in sweeps], sum),
                      "wrong": sum(sw["wrong"][b] for sw in sweeps)}
            bad = bad or row[b]["wrong"] > 0
        row["ratio"] = row["ringreduce"]["time_us"] / row["gloo"]["time_us"]
        rows.append(row)
        print(table.row([row["size"], row["iters"]],
                        [[row[b]["time_us"], row[b]["cpu_us"], row[b]["wrong"]]
                         for b in BACKENDS] +
                        [[row["ratio"], 1.0 / row["ratio"]]]), file=out)
    if args.json:
        common.write_json(args.json, {"host": info, "config": {
            k: v for k, v in vars(args).items() if k not in ("json", "launch_host", "port", "out")},
            "load_average": load, "hosts": everyone[0]["hosts"], "rows": rows})
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
