#!/usr/bin/env python3
"""Error of float16 / bfloat16 sums: ringreduce's once-rounded CPU sum (the default) against its
per-hop ring (RINGREDUCE_HALF_ROUNDING=per_hop), and optionally gloo's, on the same inputs, each
against the float64 sum. Prints a markdown table (docs/API.md, "Rounding").

    python bench/half_error.py [--count 4096] [--ranks 2,4,7,8] [--seed 0]
    python bench/half_error.py --inputs resnet18 --peers gloo [--batch-size 8] [--image-size 16]
    python bench/half_error.py --device cuda --inputs resnet18 --peers gloo,nccl

--inputs random (the default): every rank's input is --count normal random values, seed
--seed + N for the N-rank rows. --inputs resnet18: every rank's input is the real gradient of
the trainer's ResNet-18 (ringreduce.train.models.resnet18(1, 10), 11,172,810 elements),
flattened and concatenated, from one forward/backward on the rank's own random minibatch
(bench/resnet18.py's rank_gradients: model seed --seed, rank r's minibatch seed --seed + 1 + r,
printed above the table); rank r has the same gradient in every row.

--peers gloo adds gloo's columns: the same 16-bit inputs all-reduced (SUM) by
torch.distributed's gloo backend across N processes (forkserver, a FileStore, the loopback
interface, every wait bounded by --timeout), rank 0's result measured the same way. A dtype
that gloo refuses (every rank with the same error) reads "n/a (reason)"; a rank that fails
otherwise or does not report in time ends the run with an error.

--device cuda: ringreduce's columns sum the inputs as CUDA tensors, every simulated rank on
cuda:0, rounded per hop or once as RINGREDUCE_CUDA_HALF_ROUNDING says (set per column), and a
column "once cpu!=cuda" counts the elements where the CUDA once-rounded sum differs from the CPU
one in any bit (0: the same bits on both paths). --peers nccl (only with --device cuda)
adds NCCL's columns: the same inputs summed by NCCL's all-reduce, one communicator per rank on
that GPU (ringreduce.train.trainers.make_all_reduce("nccl"): a NCCL that accepts several ranks
on one GPU, RINGREDUCE_NCCL_LIB and NCCL_MULTI_RANK_GPU_ENABLE=1 as for bench/resnet18.py;
"n/a (reason)" where it cannot run). gloo always sums CPU copies.

ulp: the 16-bit type's spacing at the largest input of the element (a sum that cancels to near
zero would otherwise make tiny units). exact: the share of elements equal to the float64 sum
rounded to the type.
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import queue
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (bench/ is not a package; common.py sits beside this file)
import ringreduce  # noqa: E402

MANTISSA_BITS = {torch.bfloat16: 8, torch.float16: 11}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
PEERS = ("gloo", "nccl")


def ulp_at(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    fi = torch.finfo(dtype)
    e = torch.floor(torch.log2(x.abs().clamp_min(fi.smallest_normal)))
    return torch.exp2(e - (MANTISSA_BITS[dtype] - 1))


ROUNDING_ENV = {"cpu": "RINGREDUCE_HALF_ROUNDING", "cuda": "RINGREDUCE_CUDA_HALF_ROUNDING"}


def same_on_every_rank(tensors: list[torch.Tensor], what: str) -> torch.Tensor:
    """Rank 0's result on the CPU, after checking that every rank holds its bits (the GPU's
    work waited for with a deadline)."""
    if tensors[0].is_cuda:
        common.bounded_sync([tensors[0].device.index], what=what)
    tensors = [t.cpu() for t in tensors]
    for t in tensors[1:]:
        assert torch.equal(t.view(torch.int16), tensors[0].view(torch.int16)), \
            f"{what}: ranks differ"
    return tensors[0]


def run(inputs: list[torch.Tensor], rounding: str, device: str = "cpu") -> torch.Tensor:
    """ringreduce's list-API sum of `inputs` on `device` (every rank on cuda:0 there), rounded
    per hop or once; rank 0's result on the CPU."""
    env = ROUNDING_ENV[device]
    before = os.environ.get(env)
    os.environ[env] = rounding
    try:
        tensors = [t.to(device, copy=True) for t in inputs]
        ringreduce.all_reduce(tensors, "sum")
        return same_on_every_rank(tensors, f"ringreduce's {rounding} sum")
    finally:
        if before is None:
            del os.environ[env]
        else:
            os.environ[env] = before


def nccl_sum(inputs: list[torch.Tensor], routes: set[str]) -> torch.Tensor | str:
    """Rank 0's result of NCCL's sum over `inputs`, one communicator per rank on cuda:0, or why
    NCCL cannot run here; adds the NCCL that ran, in words, to `routes`."""
    from ringreduce.train.nccl import describe_route
    from ringreduce.train.trainers import NcclUnavailable, make_all_reduce, nccl_route

    devices = [torch.device("cuda", 0)] * len(inputs)
    try:
        fn = make_all_reduce("nccl", devices)
    except NcclUnavailable as e:
        return str(e).splitlines()[0]
    routes.add(describe_route(*nccl_route(fn)))
    tensors = [t.to(d, copy=True) for t, d in zip(inputs, devices)]
    fn(tensors)
    result = same_on_every_rank(tensors, "NCCL's sum")
    # Each row makes its own communicators: gone before the next (left alone where the sum did
    # not finish: destroying them could wait on the hung kernels).
    close = getattr(fn, "close", None)
    if close is not None:
        close()
    return result


def _gloo_rank(rank, world, store_path, tensor, status, timeout_s):
    """One gloo rank: all-reduces its input in place and reports (rank, None), or (rank, why)."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # this process only: the group stays on loopback
    torch.set_num_threads(1)
    try:
        store = dist.FileStore(store_path, world)
        group = dist.ProcessGroupGloo(store, rank, world, datetime.timedelta(seconds=timeout_s))
        group.allreduce([tensor]).wait()  # SUM; bounded by the group's timeout
        status.put((rank, None))
    except Exception as exc:  # noqa: BLE001 - reported; gloo_sum tells a refusal from a failure
        status.put((rank, f"{type(exc).__name__}: {str(exc).splitlines()[0]}"))


def gloo_sum(inputs: list[torch.Tensor], timeout_s: float) -> torch.Tensor | str:
    """Rank 0's result of gloo's SUM over `inputs`, one process a rank, or the reason gloo
    refused them. The tensors travel in shared memory."""
    ctx = mp.get_context("forkserver")
    # The ranks fork from a server that imported these once (a spawn imports torch again in
    # every rank: ~3 s of CPU each here). Named: Python 3.11's forkserver never preloads its
    # default, __main__ (it looks for a key 'main_path' that get_preparation_data does not give).
    ctx.set_forkserver_preload(["torch", "torch.distributed", "ringreduce"])
    tensors = [t.clone().share_memory_() for t in inputs]
    status = ctx.Queue()
    deadline = time.monotonic() + timeout_s + 60  # the group's timeout, plus start and set-up
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_gloo_rank, daemon=True,
                             args=(r, len(inputs), os.path.join(tmp, "store"), t, status,
                                   timeout_s))
                 for r, t in enumerate(tensors)]
        for p in procs:
            p.start()
        reports = {}
        try:
            while len(reports) < len(procs):
                rank, why = status.get(timeout=max(0.0, deadline - time.monotonic()))
                reports[rank] = why
        except queue.Empty:
            pass
        finally:
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
                if p.is_alive():
                    p.kill()
                    p.join(10)
    if len(reports) < len(procs):
        missing = sorted(set(range(len(procs))) - set(reports))
        raise RuntimeError(f"gloo: ranks {missing} did not report within {timeout_s + 60:.0f} s "
                           f"(exit codes {[p.exitcode for p in procs]})")
    reasons = set(reports.values())
    if reasons == {None}:
        return tensors[0]
    if len(reasons) == 1:
        return reasons.pop()  # every rank refused alike, before any exchange
    raise RuntimeError(f"gloo: the ranks failed differently: {reports}")


def resnet18_gradients(ranks: int, batch: int, image: int, seed: int) -> list[torch.Tensor]:
    """Every rank's ResNet-18 gradient, flattened and concatenated, in float32."""
    bench = str(Path(__file__).resolve().parent)
    if bench not in sys.path:
        sys.path.insert(0, bench)
    from resnet18 import rank_gradients  # bench/ is not a package; imported here, when needed

    grads = rank_gradients([torch.device("cpu")] * ranks, batch, image, seed)
    return [torch.cat([g.reshape(-1) for g in rank]) for rank in grads]


def errors(got: torch.Tensor, exact: torch.Tensor, ulp: torch.Tensor) -> list[str]:
    """Mean and max error in ulp, and the share of elements equal to `exact` rounded."""
    err = (got.to(torch.float64) - exact).abs() / ulp
    same = float((got == exact.to(got.dtype)).double().mean())
    mean, worst = float(err.mean()), float(err.max())
    assert math.isfinite(mean) and math.isfinite(worst), "an error is not finite"
    return [f"{mean:.3f}", f"{worst:.2f}", f"{100 * same:.1f}%"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where ringreduce's (and NCCL's) sums run (cuda: see above)")
    parser.add_argument("--inputs", choices=("random", "resnet18"), default="random")
    parser.add_argument("--count", type=int, default=4096,
                        help="elements a rank with --inputs random")
    parser.add_argument("--ranks", default="2,4,7,8")
    parser.add_argument("--dtypes", default=",".join(DTYPES),
                        help="comma-separated subset of %(default)s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=8,
                        help="images in a rank's minibatch with --inputs resnet18")
    parser.add_argument("--image-size", type=int, default=16,
                        help="height and width of the 1-channel images with --inputs resnet18")
    parser.add_argument("--peers", default="",
                        help="comma-separated subset of %s (default: none)" % ",".join(PEERS))
    parser.add_argument("--timeout", type=float, default=120,
                        help="seconds a gloo group may take to form or to all-reduce")
    args = parser.parse_args(argv)
    args.ranks = [int(r) for r in args.ranks.split(",")]
    if min(args.ranks) < 1:
        parser.error("--ranks: every count must be >= 1")
    names = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for name in names:
        if name not in DTYPES:
            parser.error(f"--dtypes: {name!r} is not one of {', '.join(DTYPES)}")
    args.dtypes = [DTYPES[d] for d in names]
    args.peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    for peer in args.peers:
        if peer not in PEERS:
            parser.error(f"--peers: {peer!r} is not one of {', '.join(PEERS)}")
    if "nccl" in args.peers and args.device != "cuda":
        parser.error("--peers nccl needs --device cuda")
    for name in ("count", "batch_size", "image_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main() -> int:
    args = parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"bench/half_error.py: --device cuda, but torch {torch.__version__} sees no CUDA "
              "device", file=sys.stderr)
        return 2
    if "nccl" in args.peers:
        from ringreduce.train.nccl import NcclLibraryError, preload_requested_library
        try:
            preload_requested_library()  # with RINGREDUCE_NCCL_LIB: start again, preloaded
        except NcclLibraryError as e:
            print(f"bench/half_error.py: {e}", file=sys.stderr)
            return 2
    if args.device == "cuda":
        print(f"# device: {torch.cuda.get_device_name(0)} (every rank on cuda:0), torch "
              f"{torch.__version__}, CUDA {torch.version.cuda}")
    grads = None
    if args.inputs == "resnet18":
        grads = resnet18_gradients(max(args.ranks), args.batch_size, args.image_size, args.seed)
        print(f"# inputs: ResNet-18 gradients, {grads[0].numel():,} elements a rank; model seed "
              f"{args.seed}, rank r's minibatch ({args.batch_size} images of 1x{args.image_size}"
              f"x{args.image_size}) seed {args.seed} + 1 + r")
    columns = ["per_hop", "once"] + args.peers
    both = " | once cpu!=cuda" if args.device == "cuda" else ""
    routes = set()
    print("| dtype | N | " + " | ".join(f"{c} mean ulp | {c} max ulp | {c} exact"
                                       for c in columns) + both + " |")
    print("|---|---|" + "---|" * (3 * len(columns) + bool(both)))
    for dtype in args.dtypes:
        for n in args.ranks:
            if grads is None:
                g = torch.Generator().manual_seed(args.seed + n)
                inputs = [torch.randn(args.count, generator=g, dtype=torch.float64).to(dtype)
                          for _ in range(n)]
            else:
                inputs = [t.to(dtype) for t in grads[:n]]
            # In rank order from rank 0's value (signed zeros as the sum in rank order has them).
            exact = inputs[0].to(torch.float64)
            largest = exact.abs()
            for t in inputs[1:]:
                wide = t.to(torch.float64)
                exact = exact + wide
                largest = torch.maximum(largest, wide.abs())
            ulp = ulp_at(largest, dtype)
            cells = []
            for rounding in ("per_hop", "once"):
                cells += errors(run(inputs, rounding, args.device), exact, ulp)
            for peer in args.peers:
                got = (gloo_sum(inputs, args.timeout) if peer == "gloo"
                       else nccl_sum(inputs, routes))
                cells += (errors(got, exact, ulp) if isinstance(got, torch.Tensor)
                          else [f"n/a ({got})", "n/a", "n/a"])
            if both:
                cuda, cpu = run(inputs, "once", "cuda"), run(inputs, "once", "cpu")
                cells.append(str(int((cuda.view(torch.int16) != cpu.view(torch.int16)).sum())))
            print(f"| {str(dtype).replace('torch.', '')} | {n} | " + " | ".join(cells) + " |",
                  flush=True)
    for route in sorted(routes):
        print(f"# nccl: {route}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
