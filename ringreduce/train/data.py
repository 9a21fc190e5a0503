"""Data for the trainer: Fashion-MNIST from IDX files, or a built-in synthetic image set.

Nothing here touches the network: Fashion-MNIST is read from files the user already has
(`--data DIR`), and without them a synthetic, learnable dataset is generated from a seed.
"""

import gzip
import math
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

# IDX type codes (third byte of the magic number) -> big-endian numpy dtype.
_IDX_DTYPES = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_GZIP_MAGIC = b"\x1f\x8b"

FASHION_MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
FASHION_MNIST_CLASSES = 10
# Mean and standard deviation of the Fashion-MNIST training pixels scaled to [0, 1].
FASHION_MNIST_MEAN = 0.2860
FASHION_MNIST_STD = 0.3530


@dataclass
class Dataset:
    """Images (N, C, H, W) float32 and labels (N,) int64, train and test splits, in memory."""

    name: str
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int

    @property
    def image_shape(self):
        return tuple(self.train_x.shape[1:])

    def describe(self):
        c, h, w = self.image_shape
        return (f"{self.name} ({len(self.train_y)} train / {len(self.test_y)} test, "
                f"{c}x{h}x{w}, {self.num_classes} classes)")


def read_idx(path):
    """Read one IDX file (gzipped or not: detected from its first bytes) into a tensor.

    The format (LeCun's MNIST page): two zero bytes, a type code, the number of dimensions,
    that many big-endian uint32 sizes, then the data in big-endian order.
    """
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:2] == _GZIP_MAGIC:
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as e:
            raise ValueError(f"IDX file {path}: corrupt gzip data ({e})") from e
    if len(raw) < 4:
        raise ValueError(f"IDX file {path}: {len(raw)} bytes is shorter than the 4-byte magic number")
    if raw[0] != 0 or raw[1] != 0:
        raise ValueError(f"IDX file {path}: the magic number must start with two zero bytes, "
                         f"got {raw[0]:#04x} {raw[1]:#04x}")
    code, ndim = raw[2], raw[3]
    if code not in _IDX_DTYPES:
        raise ValueError(f"IDX file {path}: unknown type code {code:#04x} "
                         f"(known: {', '.join(f'{c:#04x}' for c in _IDX_DTYPES)})")
    if ndim == 0:
        raise ValueError(f"IDX file {path}: the number of dimensions must be >= 1, got 0")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"IDX file {path}: truncated header ({len(raw)} bytes, need {header})")
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    dtype = _IDX_DTYPES[code]
    expected = math.prod(shape) * dtype.itemsize
    if len(raw) - header != expected:
        raise ValueError(f"IDX file {path}: shape {shape} of {dtype.name} needs {expected} data "
                         f"bytes, the file has {len(raw) - header}")
    data = np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)
    return torch.from_numpy(data.astype(dtype.newbyteorder("=")))


def _find_idx(root, stem):
    """Path of `stem` or `stem.gz` in root, or in root/FashionMNIST/raw (torchvision's layout)."""
    for folder in (root, os.path.join(root, "FashionMNIST", "raw")):
        for name in (stem, stem + ".gz"):
            path = os.path.join(folder, name)
            if os.path.isfile(path):
                return path
    raise FileNotFoundError(f"--data {root}: no {stem} or {stem}.gz there (nor in "
                            f"{os.path.join(root, 'FashionMNIST', 'raw')}); Fashion-MNIST needs "
                            f"{', '.join(FASHION_MNIST_FILES.values())} (gzipped or not)")


def _images_to_float(images, path):
    if images.dim() != 3:
        raise ValueError(f"IDX file {path}: images must have 3 dimensions (N, H, W), "
                         f"got shape {tuple(images.shape)}")
    x = images.to(torch.float32).div_(255.0).unsqueeze(1)
    return x.sub_(FASHION_MNIST_MEAN).div_(FASHION_MNIST_STD)


def load_fashion_mnist(root):
    """Fashion-MNIST (or any MNIST-format set with 10 classes) from the four IDX files in root.

    Images become float32 (N, 1, 28, 28) normalised with the training set's mean and std.
    """
    tensors = {}
    for key, stem in FASHION_MNIST_FILES.items():
        path = _find_idx(root, stem)
        t = read_idx(path)
        if key.endswith("images"):
            t = _images_to_float(t, path)
        else:
            if t.dim() != 1:
                raise ValueError(f"IDX file {path}: labels must have 1 dimension, "
                                 f"got shape {tuple(t.shape)}")
            t = t.to(torch.int64)
            if len(t) and (t.min() < 0 or t.max() >= FASHION_MNIST_CLASSES):
                raise ValueError(f"IDX file {path}: labels must lie in [0, "
                                 f"{FASHION_MNIST_CLASSES}), got [{t.min()}, {t.max()}]")
        tensors[key] = t
    for split in ("train", "test"):
        n_img, n_lab = len(tensors[f"{split}_images"]), len(tensors[f"{split}_labels"])
        if n_img != n_lab:
            raise ValueError(f"--data {root}: {split} split has {n_img} images but {n_lab} labels")
    return Dataset("Fashion-MNIST", tensors["train_images"], tensors["train_labels"],
                   tensors["test_images"], tensors["test_labels"], FASHION_MNIST_CLASSES)


def synthetic_dataset(n_train=2048, n_test=512, image_size=16, channels=1, num_classes=10,
                      noise=2.0, seed=0):
    """A learnable image classification set generated from `seed`, shaped like Fashion-MNIST.

    Each class has a smooth random prototype (4x4 Gaussian noise upsampled bilinearly); a
    sample is its class prototype with a random contrast, shifted by up to 2 pixels, plus
    per-pixel Gaussian noise of std `noise` (the prototypes have std about 1). Train and test
    samples are drawn from the same distribution.
    """
    if image_size < 4:
        raise ValueError(f"image_size must be >= 4, got {image_size}")
    if n_train < 1 or n_test < 1:
        raise ValueError(f"n_train and n_test must be >= 1, got {n_train} and {n_test}")
    g = torch.Generator().manual_seed(seed)
    coarse = torch.randn(num_classes, channels, 4, 4, generator=g)
    protos = F.interpolate(coarse, size=(image_size, image_size), mode="bilinear",
                           align_corners=False)
    protos = (protos - protos.mean(dim=(1, 2, 3), keepdim=True)) / protos.std(dim=(1, 2, 3),
                                                                              keepdim=True)

    def draw(n):
        y = torch.randint(0, num_classes, (n,), generator=g)
        contrast = 0.75 + 0.5 * torch.rand(n, 1, 1, 1, generator=g)
        x = protos[y] * contrast
        shifts = torch.randint(-2, 3, (n, 2), generator=g)
        for dy in range(-2, 3):
            for dx in range(-2, 3):
                sel = (shifts[:, 0] == dy) & (shifts[:, 1] == dx)
                if sel.any():
                    x[sel] = torch.roll(x[sel], shifts=(dy, dx), dims=(2, 3))
        x += noise * torch.randn(x.shape, generator=g)
        return x.contiguous(), y

    train_x, train_y = draw(n_train)
    test_x, test_y = draw(n_test)
    return Dataset("synthetic", train_x, train_y, test_x, test_y, num_classes)


def minibatches(x, y, batch_size, shuffle=False, generator=None):
    """Yield (x, y) minibatches in order, or in a random order drawn from `generator`."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    n = len(y)
    order = torch.randperm(n, generator=generator) if shuffle else None
    for start in range(0, n, batch_size):
        if order is None:
            yield x[start:start + batch_size], y[start:start + batch_size]
        else:
            idx = order[start:start + batch_size]
            yield x[idx], y[idx]
