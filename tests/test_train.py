"""Tests for the data-parallel trainer: model, data, the ReplicaTrainer machinery, the CLI.

ResNet-18 is slow on the 2 CI cores, so every training test uses 8x8 images, a handful of
samples and 1-3 steps.
"""
import gzip
import io
import os
import re
import struct
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ringreduce.train.data import (FASHION_MNIST_FILES, load_fashion_mnist, minibatches,
                                   read_idx, synthetic_dataset)
from ringreduce.train import progress
from ringreduce.train.models import resnet18
from ringreduce.train.trainers import (NcclUnavailable, ReplicaTrainer, bucket_indices,
                                       make_all_reduce, naive_all_reduce, nccl_skip_reason,
                                       parse_devices)

from checks import load_module, needs_cuda

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------- model

def test_resnet18_parameter_count_and_shapes():
    # 11,173,962 is the well-known parameter count of the CIFAR-style ResNet-18 (3 channels,
    # 10 classes); one input channel removes 2 * 64 * 9 = 1,152 stem weights.
    assert sum(p.numel() for p in resnet18(3, 10).parameters()) == 11_173_962
    model = resnet18(1, 10)
    assert sum(p.numel() for p in model.parameters()) == 11_172_810
    assert len(list(model.parameters())) == 62
    stem = model.stem[0]
    assert (stem.kernel_size, stem.stride, stem.padding) == ((3, 3), (1, 1), (1, 1))
    assert not any(isinstance(m, torch.nn.MaxPool2d) for m in model.modules())
    assert sum(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules()) == 20
    model.eval()
    with torch.no_grad():
        # No stride in the stem and 3 stride-2 stages: 16x16 -> 2x2 before pooling.
        assert model.stages(model.stem(torch.randn(2, 1, 16, 16))).shape == (2, 512, 2, 2)
        assert model(torch.randn(3, 1, 28, 28)).shape == (3, 10)
        assert resnet18(3, 7)(torch.randn(2, 3, 8, 8)).shape == (2, 7)


def test_resnet18_rejects_bad_sizes():
    with pytest.raises(ValueError, match="in_channels"):
        resnet18(0, 10)
    with pytest.raises(ValueError, match="num_classes"):
        resnet18(1, 0)


# ---------------------------------------------------------------- data

def write_idx(path, array, gz):
    """An IDX file written independently of the reader: header with struct, data big-endian."""
    codes = {np.uint8: 0x08, np.int8: 0x09, np.int16: 0x0B, np.int32: 0x0C, np.float32: 0x0D,
             np.float64: 0x0E}
    code = codes[array.dtype.type]
    header = struct.pack(">BBBB", 0, 0, code, array.ndim)
    header += struct.pack(f">{array.ndim}I", *array.shape)
    payload = header + array.astype(array.dtype.newbyteorder(">")).tobytes()
    with open(path, "wb") as f:
        f.write(gzip.compress(payload) if gz else payload)


@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gzip"])
@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.int32, np.float32, np.float64])
def test_read_idx_round_trip(tmp_path, gz, dtype):
    rng = np.random.default_rng(1)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        array = rng.integers(info.min, info.max, size=(5, 3, 7), endpoint=True).astype(dtype)
    else:
        array = rng.standard_normal((5, 3, 7)).astype(dtype)
    path = tmp_path / "x.idx"
    write_idx(path, array, gz)
    got = read_idx(path)
    assert got.shape == (5, 3, 7)
    assert torch.equal(got, torch.from_numpy(array))


def test_read_idx_rejects_bad_files(tmp_path):
    path = tmp_path / "bad"
    path.write_bytes(b"\x01\x00\x08\x01" + struct.pack(">I", 2) + b"\x00\x00")
    with pytest.raises(ValueError, match="two zero bytes"):
        read_idx(path)
    path.write_bytes(b"\x00\x00\x07\x01" + struct.pack(">I", 2) + b"\x00\x00")
    with pytest.raises(ValueError, match="unknown type code 0x07"):
        read_idx(path)
    path.write_bytes(b"\x00\x00\x08\x02" + struct.pack(">II", 2, 3) + b"\x00" * 5)
    with pytest.raises(ValueError, match=r"needs 6 data bytes, the file has 5"):
        read_idx(path)
    path.write_bytes(b"\x00\x00\x08\x03" + struct.pack(">I", 2))
    with pytest.raises(ValueError, match="truncated header"):
        read_idx(path)
    path.write_bytes(gzip.compress(b"\x00\x00\x08\x01" + struct.pack(">I", 4) + b"abcd")[:-6])
    with pytest.raises(ValueError, match="corrupt gzip"):
        read_idx(path)


def write_fashion_mnist(folder, n_train=8, n_test=4, seed=0):
    """Tiny Fashion-MNIST-format files: train gzipped, test plain (both layouts covered)."""
    rng = np.random.default_rng(seed)
    arrays = {
        "train_images": rng.integers(0, 256, size=(n_train, 28, 28)).astype(np.uint8),
        "train_labels": rng.integers(0, 10, size=n_train).astype(np.uint8),
        "test_images": rng.integers(0, 256, size=(n_test, 28, 28)).astype(np.uint8),
        "test_labels": rng.integers(0, 10, size=n_test).astype(np.uint8),
    }
    for key, array in arrays.items():
        gz = key.startswith("train")
        write_idx(os.path.join(folder, FASHION_MNIST_FILES[key] + (".gz" if gz else "")), array, gz)
    return arrays


def test_load_fashion_mnist(tmp_path):
    arrays = write_fashion_mnist(tmp_path)
    data = load_fashion_mnist(str(tmp_path))
    assert data.train_x.shape == (8, 1, 28, 28) and data.test_x.shape == (4, 1, 28, 28)
    assert data.train_x.dtype == torch.float32 and data.train_y.dtype == torch.int64
    assert data.num_classes == 10
    assert torch.equal(data.train_y, torch.from_numpy(arrays["train_labels"]).long())
    assert torch.equal(data.test_y, torch.from_numpy(arrays["test_labels"]).long())
    pixels = torch.from_numpy(arrays["test_images"]).double() / 255
    expected = ((pixels - 0.2860) / 0.3530).float().unsqueeze(1)
    assert torch.allclose(data.test_x, expected, rtol=0, atol=1e-6)


def test_load_fashion_mnist_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="train-images-idx3-ubyte"):
        load_fashion_mnist(str(tmp_path))
    write_fashion_mnist(tmp_path)
    labels = os.path.join(tmp_path, FASHION_MNIST_FILES["test_labels"])
    write_idx(labels, np.array([1, 2, 3], dtype=np.uint8), gz=False)
    with pytest.raises(ValueError, match="test split has 4 images but 3 labels"):
        load_fashion_mnist(str(tmp_path))
    write_idx(labels, np.array([1, 2, 3, 10], dtype=np.uint8), gz=False)
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 10\)"):
        load_fashion_mnist(str(tmp_path))


def test_synthetic_dataset_is_deterministic_and_learnable():
    a = synthetic_dataset(n_train=1024, n_test=512, image_size=16, seed=3)
    b = synthetic_dataset(n_train=1024, n_test=512, image_size=16, seed=3)
    assert torch.equal(a.train_x, b.train_x) and torch.equal(a.test_y, b.test_y)
    assert not torch.equal(a.train_x, synthetic_dataset(n_train=1024, n_test=512, seed=4).train_x)
    assert a.train_x.shape == (1024, 1, 16, 16)
    assert set(a.train_y.tolist()) == set(range(10))
    # Learnable: a nearest-class-mean classifier fitted on the training split beats chance
    # (0.1) by far on the test split.
    means = torch.stack([a.train_x[a.train_y == c].mean(0) for c in range(10)])
    dist = ((a.test_x[:, None] - means[None]) ** 2).flatten(2).sum(-1)
    assert (dist.argmin(1) == a.test_y).float().mean() > 0.6


def test_minibatches_cover_every_sample_once():
    x, y = torch.arange(10).float()[:, None], torch.arange(10)
    batches = list(minibatches(x, y, 4, shuffle=True, generator=torch.Generator().manual_seed(0)))
    assert [len(b[1]) for b in batches] == [4, 4, 2]
    seen = torch.cat([b[1] for b in batches])
    assert sorted(seen.tolist()) == list(range(10))
    assert all(torch.equal(bx[:, 0].long(), by) for bx, by in batches)


# ---------------------------------------------------------------- devices, buckets

def test_parse_devices():
    cpu = torch.device("cpu")
    assert parse_devices("cpu", None) == [cpu, cpu]
    assert parse_devices("cpu", 3) == [cpu] * 3
    assert parse_devices("cpu,cpu,cpu", None) == [cpu] * 3
    with pytest.raises(ValueError, match="--ranks must be >= 1"):
        parse_devices("cpu", 0)
    with pytest.raises(ValueError, match="disagrees"):
        parse_devices("cpu,cpu", 3)
    with pytest.raises(ValueError, match="only cpu and cuda"):
        parse_devices("meta", 2)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            parse_devices("cuda", 2)


def test_bucket_indices():
    numels = [10, 300, 20, 1000, 5]
    buckets = bucket_indices(numels, 4, bucket_mb=4400 / 1e6)
    assert sorted(i for b in buckets for i in b) == list(range(5))
    assert [i for b in buckets for i in b] == [4, 3, 2, 1, 0]  # reverse order, as DDP
    assert all(sum(numels[i] * 4 for i in b) <= 4400 or len(b) == 1 for b in buckets)
    assert buckets == [[4, 3, 2], [1, 0]]  # 4100 bytes, then 1240
    assert bucket_indices(numels, 4, bucket_mb=0) == [[4], [3], [2], [1], [0]]
    assert bucket_indices(numels, 4, bucket_mb=1) == [[4, 3, 2, 1, 0]]


# ---------------------------------------------------------------- all-reduce methods

@pytest.mark.parametrize("nranks", [2, 3, 5])
def test_naive_and_ring_all_reduce_agree(nranks):
    g = torch.Generator().manual_seed(nranks)
    inputs = [torch.randn(1001, generator=g) for _ in range(nranks)]
    reference = torch.stack([t.double() for t in inputs]).sum(0)
    results = {}
    for method in ("naive", "ring"):
        tensors = [t.clone() for t in inputs]
        make_all_reduce(method, [torch.device("cpu")] * nranks)(tensors)
        for t in tensors[1:]:
            assert torch.equal(t, tensors[0]), f"{method}: ranks differ"
        assert torch.allclose(tensors[0].double(), reference, rtol=0, atol=1e-5)
        results[method] = tensors[0]
    # Sum on rank 0 in rank order: exactly the left-to-right fp32 sum.
    expected = inputs[0].clone()
    for t in inputs[1:]:
        expected += t
    assert torch.equal(results["naive"], expected)


def test_nccl_is_refused_on_cpu_with_a_reason():
    devices = [torch.device("cpu")] * 2
    assert "CUDA" in nccl_skip_reason(devices)
    with pytest.raises(NcclUnavailable, match="NCCL needs CUDA ranks"):
        make_all_reduce("nccl", devices)
    with pytest.raises(ValueError, match="one of ring, nccl, naive"):
        make_all_reduce("tree", devices)


# ---------------------------------------------------------------- data-parallel training

def make_batches(steps, batch, image=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 1, image, image, generator=g).to(dtype),
             torch.randint(0, 10, (batch,), generator=g)) for _ in range(steps)]


def assert_replicas_identical(dp, buffers=False):
    first = dp.replicas[0].state_dict() if buffers else dict(dp.replicas[0].named_parameters())
    for m in dp.replicas[1:]:
        other = m.state_dict() if buffers else dict(m.named_parameters())
        for name, t in first.items():
            assert torch.equal(t, other[name]), f"replicas differ in {name}"


def reference_step(model, opt, x, y, shards):
    """Single-model SGD step on the full batch. shards > 1: the forward runs shard by shard
    (so BatchNorm in training mode sees the same per-shard statistics as the replicas) and the
    losses are summed before one backward."""
    opt.zero_grad()
    if shards == 1:
        loss = F.cross_entropy(model(x), y)
    else:
        loss = sum(F.cross_entropy(model(xs), ys, reduction="sum")
                   for xs, ys in zip(torch.tensor_split(x, shards), torch.tensor_split(y, shards)))
        loss = loss / len(y)
    loss.backward()
    opt.step()
    return loss.detach()


def assert_params_close(model, dp, rtol, atol):
    for (name, ref), got in zip(model.named_parameters(), dp.replicas[0].parameters()):
        assert torch.allclose(got, ref, rtol=rtol, atol=atol), \
            f"{name}: max diff {(got - ref).abs().max().item():.3g}"


@pytest.mark.parametrize("nranks,batch", [(2, 6), (3, 7)])
def test_ring_training_matches_full_batch_single_replica(nranks, batch):
    # BatchNorm in eval mode normalises with its (fixed) running statistics, so the forward
    # pass of a sample does not depend on which other samples share its replica: the gradient
    # summed over the replicas' shards is then the full-batch gradient, and data-parallel
    # training must follow single-replica training on the full batch. float64 makes the
    # comparison tight (only summation order differs). batch 7 over 3 ranks gives unequal
    # shards (3, 2, 2), covered by scaling each replica's summed loss by the full batch size.
    torch.manual_seed(0)
    model = resnet18(1, 10).double().eval()
    initial = [p.detach().clone() for p in model.parameters()]
    dp = ReplicaTrainer(model, [torch.device("cpu")] * nranks, "ring", lr=0.05, momentum=0.9)
    dp.eval()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for x, y in make_batches(3, batch, dtype=torch.float64):
        ref_loss = reference_step(model, opt, x, y, shards=1)
        loss = dp.step(x, y)
        assert torch.allclose(loss, ref_loss, rtol=1e-12, atol=0)
        assert_replicas_identical(dp)
    assert_params_close(model, dp, rtol=1e-9, atol=1e-12)
    # a run that left the parameters alone would pass vacuously
    moved = [not torch.equal(p, q) for p, q in zip(initial, dp.replicas[0].parameters())]
    assert sum(moved) > len(moved) // 2, f"only {sum(moved)} of {len(moved)} parameters moved"


def test_ring_training_with_batchnorm_statistics_per_replica():
    # BatchNorm in training mode uses each replica's own shard statistics. The single-model
    # reference that is exact by construction runs the forward shard by shard (same per-shard
    # statistics) and sums the losses. Replicas must stay bitwise identical in parameters; their
    # running statistics differ (different shards) until sync_buffers() averages them.
    nranks, batch = 2, 8
    torch.manual_seed(1)
    model = resnet18(1, 10).double().train()
    dp = ReplicaTrainer(model, [torch.device("cpu")] * nranks, "ring", lr=0.05)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in make_batches(2, batch, seed=1, dtype=torch.float64):
        reference_step(model, opt, x, y, shards=nranks)
        dp.step(x, y)
        assert_replicas_identical(dp)
    assert_params_close(model, dp, rtol=1e-9, atol=1e-12)
    means = [m.stem[1].running_mean for m in dp.replicas]
    assert not torch.equal(means[0], means[1])
    expected = (means[0] + means[1]) / 2
    dp.sync_buffers()
    assert_replicas_identical(dp, buffers=True)
    assert torch.allclose(dp.replicas[0].stem[1].running_mean, expected, rtol=1e-15, atol=0)


def test_naive_and_ring_training_agree():
    # float32, BatchNorm in training mode, per-parameter all-reduces (bucket_mb=0) for naive and
    # 25 MB buckets for ring: the methods differ only in summation order. Parameters are compared
    # after the first step, where that rounding is all that differs (later steps can amplify it
    # wherever a ReLU input near zero changes sign); losses on every step.
    batches = make_batches(2, 8, seed=2)
    runs = {}
    for method, bucket_mb in (("naive", 0), ("ring", 25)):
        torch.manual_seed(2)
        dp = ReplicaTrainer(resnet18(1, 10), [torch.device("cpu")] * 2, method, lr=0.05,
                            bucket_mb=bucket_mb)
        dp.time_comm = True
        losses = [dp.step(*batches[0])]
        after_first = [p.detach().clone() for p in dp.replicas[0].parameters()]
        losses.append(dp.step(*batches[1]))
        assert_replicas_identical(dp)
        comm = dp.pop_comm_seconds()
        assert len(comm) == 2 and all(s > 0 for s in comm)
        runs[method] = (dp, losses, after_first)
    # 44.7 MB of gradients in buckets of at most 25 MB: 3 (the 9.4 MB layer-4 convs split them).
    assert len(runs["naive"][0].buckets) == 62 and len(runs["ring"][0].buckets) == 3
    for a, b in zip(runs["naive"][1], runs["ring"][1]):
        assert torch.allclose(a, b, rtol=1e-5, atol=0)
    for p, q in zip(runs["naive"][2], runs["ring"][2]):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-7), (p - q).abs().max()
    torch.manual_seed(2)
    start = list(resnet18(1, 10).parameters())
    assert not torch.equal(runs["ring"][2][0], start[0])  # the step did move the parameters


def test_step_rejects_a_batch_smaller_than_the_ranks():
    dp = ReplicaTrainer(resnet18(1, 10), [torch.device("cpu")] * 3, "naive")
    x, y = make_batches(1, 2)[0]
    with pytest.raises(ValueError, match="2 samples cannot feed 3 ranks"):
        dp.step(x, y)


def test_step_detects_grads_detached_from_buckets():
    dp = ReplicaTrainer(resnet18(1, 10), [torch.device("cpu")] * 2, "naive")
    for p in dp.replicas[1].parameters():
        p.grad = None
    x, y = make_batches(1, 4)[0]
    with pytest.raises(RuntimeError, match="no longer views its all-reduce bucket"):
        dp.step(x, y)


# ---------------------------------------------------------------- GPU (skipped without one)

@needs_cuda
@pytest.mark.parametrize("method", ["ring", "naive", "nccl"])
def test_cuda_simulated_ranks_match_cpu(method, monkeypatch):
    # TF32 (cuDNN's default for convolutions) rounds to 10 mantissa bits: the GPU run would
    # differ from the CPU's by far more than the tolerance below (seen on an H100: 0.057).
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    ranks = 2
    devices = ([torch.device("cuda", r) for r in range(ranks)] if torch.cuda.device_count() >= ranks
               else [torch.device("cuda", 0)] * ranks)
    if method == "nccl" and nccl_skip_reason(devices):
        pytest.skip(nccl_skip_reason(devices))
    batches = make_batches(2, 8, seed=4)
    torch.manual_seed(4)
    model = resnet18(1, 10)
    cpu = ReplicaTrainer(model, [torch.device("cpu")] * ranks, "naive", lr=0.05)
    gpu = ReplicaTrainer(model, devices, method, lr=0.05)
    for x, y in batches:
        cpu.step(x, y)
        gpu.step(x, y)
    gpu.synchronize()
    assert_replicas_identical(gpu)
    for p, q in zip(cpu.replicas[0].parameters(), gpu.replicas[0].parameters()):
        assert torch.allclose(p, q.cpu(), rtol=1e-3, atol=1e-4), (p - q.cpu()).abs().max()


@needs_cuda
def test_cuda_ring_and_nccl_all_reduce_agree():
    devices = ([torch.device("cuda", r) for r in range(2)] if torch.cuda.device_count() >= 2
               else [torch.device("cuda", 0)] * 2)
    reason = nccl_skip_reason(devices)
    if reason:
        pytest.skip(reason)
    g = torch.Generator().manual_seed(5)
    inputs = [torch.randn(1 << 20, generator=g) for _ in devices]
    out = {}
    for method in ("ring", "nccl"):
        tensors = [t.to(d) for t, d in zip(inputs, devices)]
        make_all_reduce(method, devices)(tensors)
        torch.cuda.synchronize()
        assert torch.equal(tensors[0].cpu(), tensors[1].cpu())
        out[method] = tensors[0].cpu()
    assert torch.allclose(out["ring"], out["nccl"], rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- command line

LINE = re.compile(r"^test acc: (\d\.\d\d), (\d+\.\d) sec/epoch on \[(.*)\]$")


def run_cli(*args):
    env = dict(os.environ, OMP_NUM_THREADS="2")
    return subprocess.run([sys.executable, "-m", "ringreduce.train", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_cli_synthetic_run_prints_the_epoch_lines():
    proc = run_cli("--device", "cpu", "--ranks", "2", "--epochs", "2", "--batch-size", "8",
                   "--train-size", "16", "--test-size", "8", "--image-size", "8",
                   "--allreduce", "naive", "--lr", "0.01")
    assert proc.returncode == 0, proc.stderr
    lines = [LINE.match(l) for l in proc.stdout.splitlines() if l.startswith("test acc")]
    assert len(lines) == 2 and all(lines), proc.stdout
    for m in lines:
        assert 0.0 <= float(m.group(1)) <= 1.0
        assert m.group(3) == "cpu, cpu"
    assert "epoch" not in proc.stderr  # no progress bar: stderr is not a terminal


def run_cli_on_terminal(*args, columns=100):
    """The CLI with stderr on a pseudo-terminal of `columns` columns; (process, stderr)."""
    import fcntl
    import pty
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    chunks = []

    def drain():  # the terminal's buffer is small: read while the CLI writes
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO once the last writer has closed the terminal
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain)
    reader.start()
    try:
        env = dict(os.environ, OMP_NUM_THREADS="2")
        proc = subprocess.run([sys.executable, "-m", "ringreduce.train", *args], cwd=REPO,
                              env=env, stdout=subprocess.PIPE, stderr=slave, text=True,
                              timeout=300)
    finally:
        os.close(slave)
        reader.join(timeout=30)
        os.close(master)
    return proc, b"".join(chunks).decode("utf-8", "replace")


def test_cli_draws_a_progress_bar_on_a_terminal_unless_quiet():
    pytest.importorskip("tqdm")
    args = ("--device", "cpu", "--ranks", "2", "--epochs", "1", "--batch-size", "8",
            "--train-size", "16", "--test-size", "8", "--image-size", "8",
            "--allreduce", "naive", "--lr", "0.01")
    proc, err = run_cli_on_terminal(*args)
    assert proc.returncode == 0, err
    # tqdm's last state of the epoch's bar: 2 steps of 2, the mean loss as its postfix.
    assert re.search(r"epoch 1/1: 100%\|.*\| 2/2 \[.*loss \d\.\d{3}\]", err), err
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith("ResNet-18 on synthetic") \
        and LINE.match(lines[1]), proc.stdout  # stdout as without a terminal
    proc, err = run_cli_on_terminal(*args, "--quiet")
    assert proc.returncode == 0, err
    assert "epoch" not in err and "%" not in err


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_without_tqdm_runs_without_a_bar_and_says_so_once(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # `from tqdm import tqdm` raises ImportError
    monkeypatch.setattr(progress, "_said_missing", False)
    pipe = io.StringIO()
    with progress.Progress(3, "quiet pipe", stream=pipe) as bar:
        bar.update(postfix=lambda: pytest.fail("postfix computed without a bar"))
    assert pipe.getvalue() == "" and not bar.shown  # no terminal: not even the notice
    term = Terminal()
    for _ in range(2):
        with progress.Progress(3, "no tqdm", stream=term) as bar:
            assert not bar.shown
            for _ in range(3):
                bar.update(postfix=lambda: pytest.fail("postfix computed without a bar"))
            with bar.hidden():
                pass
    assert term.getvalue().count("\n") == 1 and "tqdm is not installed" in term.getvalue()


def test_progress_bar_on_a_terminal():
    pytest.importorskip("tqdm")
    term = Terminal()
    calls = []
    with progress.Progress(4, "sizes", stream=term, unit="size") as bar:
        assert bar.shown
        for i in range(4):
            bar.update(postfix=lambda i=i: calls.append(i) or f"at {i}")
            with bar.hidden():
                pass
    assert calls[-1] == 3  # the last step's postfix is always shown
    assert "sizes: 100%" in term.getvalue() and "4/4" in term.getvalue()
    assert progress.Progress(4, "quiet", quiet=True, stream=Terminal()).shown is False


def test_cli_fashion_mnist_files_with_ring(tmp_path):
    write_fashion_mnist(tmp_path, n_train=8, n_test=4)
    proc = run_cli("--device", "cpu", "--ranks", "2", "--epochs", "1", "--batch-size", "4",
                   "--allreduce", "ring", "--data", str(tmp_path), "--max-steps", "1")
    assert proc.returncode == 0, proc.stderr
    assert "Fashion-MNIST (8 train / 4 test, 1x28x28" in proc.stdout
    assert any(LINE.match(l) for l in proc.stdout.splitlines()), proc.stdout


def test_cli_explains_refusals(tmp_path):
    proc = run_cli("--device", "cpu", "--allreduce", "nccl", "--epochs", "1")
    assert proc.returncode == 2
    assert "--allreduce nccl cannot run here: NCCL needs CUDA ranks" in proc.stderr
    proc = run_cli("--device", "cpu", "--data", str(tmp_path))
    assert proc.returncode == 2 and "train-images-idx3-ubyte" in proc.stderr
    proc = run_cli("--device", "cpu", "--ranks", "4", "--batch-size", "2")
    assert proc.returncode == 2 and "--batch-size 2 is smaller than the 4 ranks" in proc.stderr


# ---------------------------------------------------------------- benchmark

def load_bench():
    return load_module("bench_resnet18", os.path.join(REPO, "bench", "resnet18.py"))


def test_bench_checks_catch_wrong_results():
    bench = load_bench()
    g = torch.Generator().manual_seed(6)
    inputs = [torch.randn(1000, generator=g) for _ in range(3)]
    reference = torch.stack([t.double() for t in inputs]).sum(0)
    bound = torch.stack([t.double().abs() for t in inputs]).sum(0) * 3 * 2.0 ** -24
    good = [t.clone() for t in inputs]
    naive_all_reduce(good)
    assert bench.exchange_check(good, reference, bound, []) == 0
    stale = [t.clone() for t in good]
    stale[2][17] = inputs[2][17]  # one rank missed one element
    assert bench.exchange_check(stale, reference, bound, []) == 1  # rank 2 differs from rank 0
    stale[0][17] = inputs[0][17]
    # Now ranks 1 and 2 differ from rank 0, and rank 0 is off the sum.
    assert bench.exchange_check(stale, reference, bound, []) == 3
    assert bench.exchange_check(good, reference, bound, [good[0] + 1e-3]) == 1000


def test_bench_runs_on_cpu_and_writes_json(tmp_path, capsys):
    bench = load_bench()
    out = tmp_path / "r.json"
    rc = bench.main(["--device", "cpu", "--ranks", "2", "--methods", "ring,naive,nccl",
                     "--iters", "1", "--warmup", "0", "--steps", "1", "--step-warmup", "0",
                     "--batch-size", "4", "--image-size", "8", "--json", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "nccl: skipped: NCCL needs CUDA ranks" in printed
    import json

    result = json.loads(out.read_text())
    assert result["wrong"] == 0 and "nccl" in result["skipped"]
    layouts = {(r["method"], r["layout"]) for r in result["exchange"]}
    assert layouts == {(m, l) for m in ("ring", "naive") for l in ("per-tensor", "25MB-buckets")}
    assert all(r["bytes"] == 11_172_810 * 4 and r["time_ms"] > 0 for r in result["exchange"])
    # ring-dp: ringreduce.DataParallel (nn.DataParallel needs GPUs: skipped, saying why).
    assert [r["method"] for r in result["step"]] == ["ring", "naive", "ring-dp"]
    assert all(0 < r["comm_share"] < 1 for r in result["step"])
    assert "nn-dp: skipped: torch.nn.DataParallel replicates only on CUDA" in printed
