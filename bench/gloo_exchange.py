"""gloo's ways of moving a shard between hosts, timed against each other: all-gather, all-to-all,
exchange and all-reduce, with every rank sending the same bytes (csrc/multiprocess/xhost.h picks
among them for the inter-host phase).

    python bench/gloo_exchange.py [--ranks 2] [--sizes 1M,4M,16M] [--iters 25]

For each size S (bytes each rank sends): all-gather of S per rank, all-to-all of a buffer whose
slots other than the rank's own hold S in all, the exchange: the same all-to-all with nothing for
the rank itself (its split sizes 0; xhost.h's two-host step), and all-reduce of a buffer of
S*N/(2(N-1)) bytes (a ring all-reduce sends 2(N-1)/N of it). The four run interleaved, a barrier
before each call, so a busy machine slows them alike; the table gives the median and the minimum
over --iters.
"""
import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def _rank(rank, world, store_path, sizes, iters, queue):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    pg = dist.ProcessGroupGloo(store, rank, world, datetime.timedelta(seconds=300))
    rows = []
    for size in sizes:
        n = size // 4
        src, gathered = torch.ones(n), torch.empty(world * n)
        per_slot = -(-n // (world - 1))
        send, recv = torch.ones(world * per_slot), torch.empty(world * per_slot)
        reduced = torch.ones(-(-n * world // (2 * (world - 1))))
        splits = [0 if r == rank else per_slot for r in range(world)]
        xsend, xrecv = torch.ones((world - 1) * per_slot), torch.empty((world - 1) * per_slot)
        calls = {
            "all_gather": lambda: pg._allgather_base(gathered, src).wait(),
            "all_to_all": lambda: pg.alltoall_base(recv, send, [], [],
                                                   dist.AllToAllOptions()).wait(),
            "exchange": lambda: pg.alltoall_base(xrecv, xsend, list(splits), list(splits),
                                                 dist.AllToAllOptions()).wait(),
            "all_reduce": lambda: pg.allreduce([reduced]).wait(),
        }
        times = {k: [] for k in calls}
        for _ in range(iters):
            for name, call in calls.items():
                pg.barrier().wait()
                t0 = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - t0)
        rows.append((size, {k: (statistics.median(v), min(v)) for k, v in times.items()}))
    queue.put((rank, rows))
    queue.close()
    queue.join_thread()
    os._exit(0)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--sizes", default="1M,4M,16M",
                   help="bytes each rank sends, comma-separated (default 1M,4M,16M)")
    p.add_argument("--iters", type=int, default=25)
    args = p.parse_args()
    if args.ranks < 2:
        p.error("--ranks must be >= 2")
    sizes = [common.parse_size(s) for s in args.sizes.split(",")]
    import torch.multiprocessing as mp

    info = common.host_info()
    print(f"# bench/gloo_exchange.py  {info['date']}  host {info['host']}  torch {info['torch']}")
    print(f"# cpu: {info['cpu']} ({info['cpu_count']} logical cores), {args.ranks} ranks, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"# command: {common.command_line()}")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(r, args.ranks, os.path.join(tmp, "store"),
                                                  sizes, args.iters, queue))
                 for r in range(args.ranks)]
        for proc in procs:
            proc.start()
        results = dict(queue.get(timeout=1800) for _ in procs)
        for proc in procs:
            proc.join(30)
    kinds = ("all_gather", "all_to_all", "exchange", "all_reduce")
    print(f"# {'sent/rank':>10}  " + "  ".join(f"{k + ' med/min (ms)':>24}" for k in kinds))
    for size, t in results[0]:
        cells = "  ".join(f"{t[k][0] * 1e3:11.2f} /{t[k][1] * 1e3:10.2f}"
                          for k in kinds)
        print(f"  {common.format_size(size):>10}  {cells}")


if __name__ == "__main__":
    main()
