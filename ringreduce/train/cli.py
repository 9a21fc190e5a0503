"""Data-parallel ResNet-18 training with a swappable all-reduce: `python -m ringreduce.train`.

    python -m ringreduce.train --allreduce ring                  # synthetic data, all defaults
    python -m ringreduce.train --data ~/fashion-mnist --device cuda --ranks 4 --allreduce nccl
    python -m ringreduce.train --wrapper dataparallel            # the d2l way, on the ring

Prints, after each epoch, on stdout
`test acc: 0.91, 12.2 sec/epoch on [cuda:0, cuda:1]` (seconds of training, evaluation excluded);
during the epoch a tqdm progress bar on stderr when it is a terminal (none with --quiet).
With --allreduce nccl it first says which NCCL runs (version, file, origin);
RINGREDUCE_NCCL_LIB=/path/libnccl.so.2 picks another libnccl than torch's (the command restarts
once with it in LD_PRELOAD).
"""

import argparse
import sys
import time

import torch

from .data import load_fashion_mnist, minibatches, synthetic_dataset
from .models import resnet18
from .nccl import NcclLibraryError, describe_route, preload_requested_library
from .progress import Progress, add_quiet_argument
from .trainers import (DEFAULT_BUCKET_MB, METHODS, WRAPPERS, NcclUnavailable, ReplicaTrainer,
                       WrappedTrainer, WrapperUnavailable, nn_dataparallel_skip_reason,
                       parse_devices)


def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m ringreduce.train",
        description="Single-process data-parallel ResNet-18 training; --allreduce picks how "
                    "gradients are summed across the replicas.")
    p.add_argument("--ranks", type=int, default=None,
                   help="number of replicas (default: 2 on CPU, one per visible GPU on CUDA; "
                        "more ranks than GPUs puts several simulated ranks on a GPU)")
    p.add_argument("--device", default=None,
                   help="cpu, cuda, cuda:N, or one device per rank separated by commas "
                        "(default: cuda if available, else cpu)")
    p.add_argument("--epochs", type=int, default=5, help="default: %(default)s")
    p.add_argument("--batch-size", type=int, default=128,
                   help="global minibatch size, split across the ranks (default: 128)")
    p.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (default: %(default)s)")
    p.add_argument("--momentum", type=float, default=0.0,
                   help="SGD momentum (default: %(default)s)")
    p.add_argument("--allreduce", choices=METHODS, default="ring",
                   help="gradient all-reduce: ring (ringreduce), nccl, or naive (sum on rank 0, "
                        "copy back); default: ring")
    p.add_argument("--wrapper", choices=WRAPPERS, default="replicas",
                   help="replicas: one persistent replica per rank, gradients all-reduced "
                        "(--allreduce); dataparallel: the model wrapped in "
                        "ringreduce.DataParallel, replicated at every forward, gradients "
                        "reduced onto the first rank over the ring (d2l's nn.DataParallel "
                        "code); nn-dataparallel: torch.nn.DataParallel (distinct GPUs only); "
                        "default: replicas")
    p.add_argument("--data", default=None, metavar="DIR",
                   help="folder with the Fashion-MNIST IDX files (train-images-idx3-ubyte[.gz] "
                        "...); default: the built-in synthetic dataset")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the model, the shuffling and the synthetic data (default: 0)")
    p.add_argument("--bucket-mb", type=float, default=DEFAULT_BUCKET_MB,
                   help="gradient bucket size in MB, one all-reduce per bucket; 0 = one per "
                        "parameter (default: %(default)s, as DDP)")
    p.add_argument("--train-size", type=int, default=2048,
                   help="synthetic data: number of training images (default: %(default)s)")
    p.add_argument("--test-size", type=int, default=512,
                   help="synthetic data: number of test images (default: %(default)s)")
    p.add_argument("--image-size", type=int, default=16,
                   help="synthetic data: height and width of the images (default: %(default)s)")
    p.add_argument("--max-steps", type=int, default=None,
                   help="stop each epoch after this many steps (for smoke tests)")
    add_quiet_argument(p)
    return p


def load_data(args):
    if args.data is not None:
        return load_fashion_mnist(args.data)
    return synthetic_dataset(n_train=args.train_size, n_test=args.test_size,
                             image_size=args.image_size, seed=args.seed)


def check_args(args):
    for name in ("epochs", "batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.lr <= 0:
        raise ValueError(f"--lr must be > 0, got {args.lr}")
    if args.max_steps is not None and args.max_steps < 1:
        raise ValueError(f"--max-steps must be >= 1, got {args.max_steps}")
    if args.wrapper != "replicas" and args.allreduce != "ring":
        raise ValueError(f"--allreduce {args.allreduce} applies to --wrapper replicas only "
                         f"(--wrapper {args.wrapper} has its own communication)")


def make_trainer(args, model, devices):
    if args.wrapper == "replicas":
        return ReplicaTrainer(model, devices, all_reduce=args.allreduce, lr=args.lr,
                              momentum=args.momentum, bucket_mb=args.bucket_mb)
    return WrappedTrainer(model, devices, wrapper=args.wrapper, lr=args.lr,
                          momentum=args.momentum)


def train(args, out=None, progress_stream=None):
    """Run the training the parsed `args` describe; returns the last epoch's test accuracy.
    `out` and `progress_stream` default to sys.stdout and sys.stderr as they are at the call."""
    out = sys.stdout if out is None else out
    progress_stream = sys.stderr if progress_stream is None else progress_stream
    check_args(args)
    devices = parse_devices(args.device, args.ranks)
    if args.wrapper == "nn-dataparallel" and nn_dataparallel_skip_reason(devices):
        raise WrapperUnavailable(nn_dataparallel_skip_reason(devices))
    if args.batch_size < len(devices):
        raise ValueError(f"--batch-size {args.batch_size} is smaller than the {len(devices)} "
                         f"ranks it is split across")
    data = load_data(args)
    torch.manual_seed(args.seed)
    model = resnet18(in_channels=data.image_shape[0], num_classes=data.num_classes)
    dp = make_trainer(args, model, devices)
    device_list = "[" + ", ".join(str(d) for d in devices) + "]"
    how = (f"allreduce={args.allreduce}" if args.wrapper == "replicas"
           else f"wrapper={args.wrapper}")
    print(f"ResNet-18 on {data.describe()}; {len(devices)} ranks {device_list}, {how}, "
          f"batch {args.batch_size}, lr {args.lr}", file=out, flush=True)
    if args.allreduce == "nccl":  # check_args: only with --wrapper replicas (a ReplicaTrainer)
        print(f"NCCL: {describe_route(*dp.nccl)}", file=out, flush=True)
    shuffle = torch.Generator().manual_seed(args.seed)
    steps = (len(data.train_y) + args.batch_size - 1) // args.batch_size
    if args.max_steps is not None:
        steps = min(steps, args.max_steps)
    acc = 0.0
    for epoch in range(1, args.epochs + 1):
        dp.train()
        loss_sum, done = None, 0
        start = time.perf_counter()
        with Progress(steps, f"epoch {epoch}/{args.epochs}", quiet=args.quiet, unit="step",
                      stream=progress_stream) as bar:
            for x, y in minibatches(data.train_x, data.train_y, args.batch_size, shuffle=True,
                                    generator=shuffle):
                if done == steps:
                    break
                if len(y) < len(devices):
                    # A last partial batch too small to give every rank a sample is dropped.
                    continue
                loss = dp.step(x, y)
                loss_sum = loss if loss_sum is None else loss_sum + loss
                done += 1
                # .item() waits for the GPU, so the loss is read only when the bar shows it.
                bar.update(postfix=lambda: f"loss {loss_sum.item() / done:.3f}")
        dp.synchronize()
        seconds = time.perf_counter() - start
        acc = dp.evaluate(data.test_x, data.test_y)
        print(f"test acc: {acc:.2f}, {seconds:.1f} sec/epoch on {device_list}", file=out,
              flush=True)
    return acc


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        if argv is None and args.allreduce == "nccl":
            # The command line as typed: it can start again with RINGREDUCE_NCCL_LIB preloaded.
            preload_requested_library()
        train(args)
    except NcclLibraryError as e:
        print(f"ringreduce.train: {e}", file=sys.stderr)
        return 2
    except NcclUnavailable as e:
        print(f"ringreduce.train: --allreduce nccl cannot run here: {e}", file=sys.stderr)
        return 2
    except WrapperUnavailable as e:
        print(f"ringreduce.train: --wrapper {args.wrapper} cannot run here: {e}",
              file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError) as e:
        print(f"ringreduce.train: {e}", file=sys.stderr)
        return 2
    return 0
