"""The data-parallel trainer and what it is made of: ``python -m ringreduce.train``.

Not part of the library: ``import ringreduce`` loads none of it. The benchmarks (bench/) import
its pieces from here.

- ``cli``: the command line (``main``), one epoch loop with a progress bar
- ``trainers``: ``ReplicaTrainer`` (replicas in lockstep, gradients all-reduced by ring, nccl or
  naive) and ``WrappedTrainer`` (the model in ringreduce.DataParallel or torch.nn.DataParallel)
- ``data``: Fashion-MNIST from IDX files, or a synthetic image set
- ``models``: ResNet-18 for small images
- ``nccl``: which libnccl runs, and libnccl called directly for ranks sharing a GPU
- ``progress``: tqdm progress bars on stderr (only on a terminal), for bench/ too
"""

from .cli import main

__all__ = ["main"]
