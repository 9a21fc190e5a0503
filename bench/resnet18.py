"""ResNet-18 gradient all-reduce benchmark: ringreduce vs NCCL vs naive, on real gradients.

    python bench/resnet18.py                                   # CUDA if available, else CPU
    python bench/resnet18.py --device cpu --ranks 2 --iters 5 --steps 3 --json out.json
    NCCL_MULTI_RANK_GPU_ENABLE=1 python bench/resnet18.py --device cuda:0 --ranks 4

Part 1, the gradient exchange: every rank's gradients come from a real forward/backward of
the trainer's ResNet-18 (62 tensors, 11,172,810 floats) on its own random minibatch. Each
method all-reduces them per tensor (62 calls) and flattened into 25 MB buckets as DDP does;
time per full exchange (median over --iters, after --warmup), algbw = bytes per rank / time,
busbw = algbw * 2(N-1)/N (nccl-tests' definitions). Checked after the last iteration: every
rank holds bitwise the same values, within the fp32 summation error bound
(N-1) * 2^-24 * sum_r |g_r| of the float64 sum, and within twice that bound of the other
methods' results; #wrong counts the elements that fail.

Part 2, the training step: ReplicaTrainer steps (forward and backward on every replica, the
bucketed exchange, SGD) with each method; median step time, median time in the exchange and
its share of the step. Then the same steps the d2l way, the model wrapped in
ringreduce.DataParallel (row ring-dp: parameters broadcast at every forward and gradients
reduced onto the first rank, both on the ring; comm = the time in those collectives) and, on
distinct GPUs, torch.nn.DataParallel (row nn-dp; its communication is not timed). Checked:
replicas bitwise identical after the steps, and parameters after the first step close to the
first row's. Exits 1 when anything is wrong.

The header names the NCCL the nccl rows ran (version, file, origin); RINGREDUCE_NCCL_LIB=
/path/libnccl.so.2 picks another libnccl than torch's (the command restarts once with it in
LD_PRELOAD; ranks sharing a GPU call it directly).
"""

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import common  # noqa: E402  (bench/ is not a package; common.py sits beside this file)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from ringreduce.train.models import resnet18
from ringreduce.train.nccl import NcclLibraryError, describe_route, preload_requested_library
from ringreduce.train.progress import Progress, add_quiet_argument
from ringreduce.train.trainers import (DEFAULT_BUCKET_MB, METHODS, NcclUnavailable, ReplicaTrainer,
                                       WrappedTrainer, bucket_indices, make_all_reduce,
                                       nccl_route, nn_dataparallel_skip_reason, parse_devices)

FP32_UNIT_ROUNDOFF = 2.0 ** -24
# Step rows for the module wrappers: ringreduce.DataParallel and torch.nn.DataParallel.
WRAPPER_ROWS = {"dataparallel": "ring-dp", "nn-dataparallel": "nn-dp"}


def parse_args(argv=None):
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None,
                   help="cpu, cuda, cuda:N or one device per rank, comma-separated "
                        "(default: cuda if available, else cpu)")
    p.add_argument("--ranks", type=int, default=None,
                   help="default: one per GPU with --device cuda, at least 2 (simulated ranks "
                        "on one GPU); 2 on CPU")
    p.add_argument("--methods", default=",".join(METHODS),
                   help="comma-separated subset of %(default)s")
    p.add_argument("--wrappers", default=",".join(WRAPPER_ROWS),
                   help="training-step rows for module wrappers, a comma-separated subset of "
                        "%(default)s (rows ring-dp and nn-dp; empty for none)")
    p.add_argument("--bucket-mb", type=float, default=DEFAULT_BUCKET_MB)
    p.add_argument("--iters", type=int, default=20 if cuda else 5)
    p.add_argument("--warmup", type=int, default=5 if cuda else 1)
    p.add_argument("--steps", type=int, default=20 if cuda else 3,
                   help="timed training steps per method (0 skips part 2)")
    p.add_argument("--step-warmup", type=int, default=3 if cuda else 1)
    p.add_argument("--batch-size", type=int, default=256 if cuda else 32,
                   help="global minibatch of a training step")
    p.add_argument("--image-size", type=int, default=28 if cuda else 16,
                   help="height and width of the 1-channel images (Fashion-MNIST: 28)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH", help="write results and config here")
    add_quiet_argument(p)
    args = p.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in args.methods:
        if m not in METHODS:
            p.error(f"--methods: {m!r} is not one of {', '.join(METHODS)}")
    args.wrappers = [w.strip() for w in args.wrappers.split(",") if w.strip()]
    for w in args.wrappers:
        if w not in WRAPPER_ROWS:
            p.error(f"--wrappers: {w!r} is not one of {', '.join(WRAPPER_ROWS)}")
    for name in ("iters", "batch_size", "image_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0 or args.steps < 0 or args.step_warmup < 0:
        p.error("--warmup, --steps and --step-warmup must be >= 0")
    if args.ranks is not None and args.ranks < 2:
        p.error("--ranks must be >= 2 (an all-reduce over one rank moves nothing)")
    return args


class Stopwatch:
    """Wall time on CPU; on CUDA, events on every rank device's current stream, the slowest
    device's elapsed time counting."""

    def __init__(self, devices):
        self.devices = list(dict.fromkeys(devices))
        self.cuda = self.devices[0].type == "cuda"

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        marks = []
        for d in self.devices:
            e = torch.cuda.Event(enable_timing=True)
            e.record(torch.cuda.current_stream(d))
            marks.append(e)
        return marks

    def start(self):
        self._start = self._mark()

    def stop(self):
        end = self._mark()
        if not self.cuda:
            return end - self._start
        common.wait_events([(str(d), e) for d, e in zip(self.devices, end)],
                           what="the timed work")
        return max(s.elapsed_time(e) for s, e in zip(self._start, end)) / 1e3


def synchronize(devices):
    """Bounded (common.bounded_sync): a hung collective ends the run with SyncTimeout."""
    if devices[0].type == "cuda":
        common.bounded_sync([d.index for d in dict.fromkeys(devices)], what="the queued work")


def rank_gradients(devices, batch, image, seed):
    """Each rank's real ResNet-18 gradients: one forward/backward on its own random shard."""
    torch.manual_seed(seed)
    model = resnet18(1, 10)
    grads = []
    for r, d in enumerate(devices):
        replica = copy.deepcopy(model).to(d)
        g = torch.Generator().manual_seed(seed + 1 + r)
        x = torch.randn(batch, 1, image, image, generator=g).to(d)
        y = torch.randint(0, 10, (batch,), generator=g).to(d)
        F.cross_entropy(replica(x), y).backward()
        grads.append([p.grad.detach().clone() for p in replica.parameters()])
    return grads


def layouts(grads, bucket_mb):
    """{layout: [per all-reduce call: one tensor per rank]}: per tensor, and DDP-style buckets."""
    numels = [g.numel() for g in grads[0]]
    flat = []
    for bucket in bucket_indices(numels, grads[0][0].element_size(), bucket_mb):
        flat.append([torch.cat([rank[i].reshape(-1) for i in bucket]) for rank in grads])
    per_tensor = [[rank[i] for rank in grads] for i in range(len(numels))]
    return {"per-tensor": per_tensor, f"{bucket_mb:g}MB-buckets": flat}


def exchange_check(per_rank, reference, bound, others):
    """Elements wrong after an exchange: ranks differing from rank 0, rank 0 outside the fp32
    bound around the float64 sum, or more than twice the bound away from another method."""
    got = per_rank[0]
    wrong = sum(int((other != got).sum()) for other in per_rank[1:])
    wrong += int(((got.double() - reference).abs() > bound).sum())
    for prev in others:
        wrong += int(((got.double() - prev.double()).abs() > 2 * bound).sum())
    return wrong


def in_parameter_order(calls, layout, like, bucket_mb):
    """Every rank's exchanged gradients as one flat CPU tensor in parameter order (buckets
    hold the parameters back to front)."""
    n = len(calls[0])
    if layout == "per-tensor":
        return [torch.cat([c[r].reshape(-1).cpu() for c in calls]) for r in range(n)]
    numels = [g.numel() for g in like]
    order = [i for b in bucket_indices(numels, like[0].element_size(), bucket_mb) for i in b]
    out = []
    for r in range(n):
        pieces = torch.cat([c[r].cpu() for c in calls]).split([numels[i] for i in order])
        by_param = dict(zip(order, pieces))
        out.append(torch.cat([by_param[i] for i in range(len(numels))]))
    return out


def bench_exchange(args, devices, methods):
    n = len(devices)
    grads = rank_gradients(devices, batch=8, image=args.image_size, seed=args.seed)
    stacked = [torch.stack([rank[i].double().cpu() for rank in grads]) for i in range(len(grads[0]))]
    reference = torch.cat([s.sum(0).reshape(-1) for s in stacked])
    # |fl(sum) - sum| <= (N-1) u sum|x_r| for any summation order (plus a term in u^2, covered
    # by the factor N instead of N-1), u = 2^-24.
    bound = torch.cat([s.abs().sum(0).reshape(-1) for s in stacked]) * n * FP32_UNIT_ROUNDOFF
    del stacked
    nbytes = sum(g.numel() * g.element_size() for g in grads[0])
    rows = []
    for layout, pristine in layouts(grads, args.bucket_mb).items():
        done = []  # earlier methods' results on this layout, for the cross-method check
        for method, fn in methods.items():
            calls = [[t.clone() for t in call] for call in pristine]
            watch = Stopwatch(devices)
            times = []
            with Progress(args.warmup + args.iters, f"{method} {layout}", quiet=args.quiet,
                          leave=False) as bar:
                for it in range(args.warmup + args.iters):
                    for call, orig in zip(calls, pristine):
                        for t, o in zip(call, orig):
                            t.copy_(o)
                    synchronize(devices)
                    watch.start()
                    for call in calls:
                        fn(call)
                    elapsed = watch.stop()
                    if it >= args.warmup:
                        times.append(elapsed)
                    bar.update()
            per_rank = in_parameter_order(calls, layout, grads[0], args.bucket_mb)
            wrong = exchange_check(per_rank, reference, bound, done)
            done.append(per_rank[0])
            t = statistics.median(times)
            algbw, busbw = common.bandwidths(nbytes, t, 2 * (n - 1) / n)
            rows.append({"method": method, "layout": layout, "calls": len(calls), "ranks": n,
                         "bytes": nbytes, "time_ms": t * 1e3, "algbw_GBps": algbw,
                         "busbw_GBps": busbw, "wrong": wrong,
                         "times_ms": [x * 1e3 for x in times]})
            print_row(rows[-1])
    return rows


EXCHANGE_HEADER = (f"{'method':>7} {'layout':>14} {'calls':>5} {'size(MB)':>9} {'time(ms)':>9} "
                   f"{'algbw(GB/s)':>11} {'busbw(GB/s)':>11} {'#wrong':>7}")


def print_row(row):
    print(f"{row['method']:>7} {row['layout']:>14} {row['calls']:>5} {row['bytes'] / 1e6:>9.2f} "
          f"{row['time_ms']:>9.3f} {row['algbw_GBps']:>11.3f} {row['busbw_GBps']:>11.3f} "
          f"{row['wrong']:>7}", flush=True)


STEP_HEADER = (f"{'method':>7} {'step(ms)':>9} {'comm(ms)':>9} {'compute(ms)':>11} "
               f"{'comm share':>10} {'#wrong':>7}")


def bench_steps(args, devices, methods, wrappers=()):
    steps = args.step_warmup + args.steps
    g = torch.Generator().manual_seed(args.seed)
    batches = [(torch.randn(args.batch_size, 1, args.image_size, args.image_size, generator=g),
                torch.randint(0, 10, (args.batch_size,), generator=g)) for _ in range(steps)]
    runs = [(m, lambda model, m=m: ReplicaTrainer(model, devices, m, lr=0.01,
                                                  bucket_mb=args.bucket_mb)) for m in methods]
    runs += [(WRAPPER_ROWS[w], lambda model, w=w: WrappedTrainer(model, devices, w, lr=0.01))
             for w in wrappers]
    rows, first_params = [], None
    # Parameters after the first step differ between methods only by the exchange's rounding;
    # later steps amplify that (a ReLU input near zero flips), so the methods are compared
    # there. Replicas of one method stay bitwise identical through all the steps.
    for label, make in runs:
        torch.manual_seed(args.seed)
        dp = make(resnet18(1, 10))
        model = dp.model if isinstance(dp, WrappedTrainer) else dp.replicas[0]
        step_times = []
        with Progress(len(batches), f"{label} steps", quiet=args.quiet, leave=False,
                      unit="step") as bar:
            for i, (x, y) in enumerate(batches):
                dp.time_comm = i >= args.step_warmup
                synchronize(devices)
                start = time.perf_counter()
                dp.step(x, y)
                dp.synchronize()
                if dp.time_comm:
                    step_times.append(time.perf_counter() - start)
                if i == 0:
                    params = [p.detach().cpu().clone() for p in model.parameters()]
                bar.update()
        comm_times = dp.pop_comm_seconds()
        wrong = 0
        for m in getattr(dp, "replicas", [model])[1:]:
            wrong += sum(int((p != q).sum()) for p, q in
                         zip(model.parameters(), m.parameters()))
        if first_params is None:
            first_params = params
        else:
            wrong += sum(int((~torch.isclose(p, q, rtol=1e-5, atol=1e-6)).sum())
                         for p, q in zip(params, first_params))
        step = statistics.median(step_times)
        # torch.nn.DataParallel's communication (torch.cuda.comm) is not instrumented.
        comm = statistics.median(comm_times) if comm_times else None
        rows.append({"method": label, "step_ms": step * 1e3,
                     "comm_ms": None if comm is None else comm * 1e3,
                     "compute_ms": None if comm is None else (step - comm) * 1e3,
                     "comm_share": None if comm is None else comm / step,
                     "wrong": wrong, "step_times_ms": [t * 1e3 for t in step_times],
                     "comm_times_ms": [t * 1e3 for t in comm_times]})
        r = rows[-1]
        if comm is None:
            timing = f"{'n/a':>9} {'n/a':>11} {'n/a':>10}"
        else:
            timing = (f"{r['comm_ms']:>9.2f} {r['compute_ms']:>11.2f} "
                      f"{100 * r['comm_share']:>9.1f}%")
        print(f"{label:>7} {r['step_ms']:>9.2f} {timing} {wrong:>7}", flush=True)
    return rows


def describe_devices(devices):
    if devices[0].type == "cuda":
        names = {str(d): torch.cuda.get_device_name(d) for d in dict.fromkeys(devices)}
        return ", ".join(f"{k} {v}" for k, v in names.items())
    return (f"cpu ({common.cpu_model()}, {os.cpu_count()} cores, "
            f"{torch.get_num_threads()} torch threads)")


def main(argv=None):
    args = parse_args(argv)
    if argv is None:
        common.dump_stacks_on_sigterm()
    try:
        devices = parse_devices(args.device, args.ranks)
        if len(devices) < 2:
            devices = parse_devices(args.device, 2)
    except ValueError as e:
        print(f"bench/resnet18.py: {e}", file=sys.stderr)
        return 2
    if argv is None and "nccl" in args.methods and devices[0].type == "cuda":
        try:
            preload_requested_library()  # with RINGREDUCE_NCCL_LIB: start again, preloaded
        except NcclLibraryError as e:
            print(f"bench/resnet18.py: {e}", file=sys.stderr)
            return 2
    import ringreduce

    config = {"date": common.now_iso(), "command": common.command_line(),
              "devices": [str(d) for d in devices], "device_names": describe_devices(devices),
              "torch": torch.__version__, "cuda": torch.version.cuda,
              "ringreduce": ringreduce.build_info(), **{k: v for k, v in vars(args).items()}}
    print(f"# ResNet-18 gradient all-reduce, {len(devices)} ranks on {config['device_names']}")
    print(f"# ranks {config['devices']}; torch {torch.__version__}; ringreduce "
          f"{config['ringreduce']['version']} (cuda build: {config['ringreduce']['cuda']})")
    methods, skipped = {}, {}
    for m in args.methods:
        try:
            methods[m] = make_all_reduce(m, devices)
        except NcclUnavailable as e:
            skipped[m] = str(e)
            print(f"# {m}: skipped: {e}")
    if "nccl" in methods:
        route, library = nccl_route(methods["nccl"])
        config["nccl"] = {**library.as_dict(), "route": route}
        print(f"# nccl: {describe_route(route, library)}")
    wrappers = []
    for w in args.wrappers:
        reason = nn_dataparallel_skip_reason(devices) if w == "nn-dataparallel" else None
        if reason is None:
            wrappers.append(w)
        else:
            skipped[WRAPPER_ROWS[w]] = reason
            print(f"# {WRAPPER_ROWS[w]}: skipped: {reason}")
    print(f"# exchange: median of {args.iters} after {args.warmup} warm-up; "
          f"bucket {args.bucket_mb:g} MB")
    print(EXCHANGE_HEADER)
    exchange = bench_exchange(args, devices, methods)
    step_rows = []
    if args.steps > 0:
        print(f"# training step: batch {args.batch_size} of 1x{args.image_size}x"
              f"{args.image_size}, median of {args.steps} after {args.step_warmup} warm-up; "
              f"comm = the bucketed gradient exchange inside the step (ring-dp: the "
              f"parameter broadcast and the gradient reduction)")
        print(STEP_HEADER)
        step_rows = bench_steps(args, devices, list(methods), wrappers)
    wrong = sum(r["wrong"] for r in exchange + step_rows)
    print(f"# {'OK' if wrong == 0 else f'FAILED: {wrong} wrong elements'}")
    if args.json:
        common.write_json(args.json, {"config": config, "skipped": skipped, "exchange": exchange,
                                      "step": step_rows, "wrong": wrong})
    return 0 if wrong == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
