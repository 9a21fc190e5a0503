"""ringreduce.DataParallel and ringreduce.comm: nn.DataParallel's code with its collectives on
the ring, on CPU "devices" (GPU variants skip without a GPU).

References are exact where they can be (integer-valued sums, the same tensors, bitwise
repeatability) and float64 otherwise (only the summation order differs from an unwrapped
model, so 1e-12). Models are small so that the file runs in seconds on the 2 CI cores.
"""
import copy
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ringreduce
from ringreduce import comm
from ringreduce.train.trainers import WrappedTrainer, WrapperUnavailable

from checks import needs_cuda

CPU = torch.device("cpu")
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2,
                                    reason="nn.DataParallel needs two distinct GPUs "
                                           f"({torch.cuda.device_count()} visible)")


def integer_valued(shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-50, 50, shape, generator=g).to(dtype)


def shares_memory(a, b):
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


# ---------------------------------------------------------------- comm

@pytest.mark.parametrize("ndev", [2, 3])
def test_comm_broadcast_gives_every_rank_its_own_copy(ndev):
    src = integer_valued((5, 7), 0)
    out = comm.broadcast(src, [CPU] * ndev)
    assert len(out) == ndev and out[0] is src  # the source rank keeps the source, as in torch
    for t in out[1:]:
        assert torch.equal(t, src) and not shares_memory(t, src)
    assert not shares_memory(out[1], out[-1]) or ndev == 2
    strided = src.t()  # not contiguous: staged for the ring, still returned as itself
    out = comm.broadcast(strided, ["cpu", "cpu"])
    assert out[0] is strided and torch.equal(out[1], strided)
    targets = [torch.zeros(5, 7), torch.zeros(7, 5).t()]
    assert comm.broadcast(src, out=targets)[1] is targets[1]
    assert all(torch.equal(t, src) for t in targets)
    with pytest.raises(RuntimeError, match="exactly one of 'devices' and 'out'"):
        comm.broadcast(src)
    with pytest.raises(ValueError, match=r"out\[0\] must have the source's shape"):
        comm.broadcast(src, out=[torch.zeros(3)])


def test_comm_broadcast_coalesced_all_dtypes_in_buckets():
    tensors = [integer_valued((3, 4), 1), torch.arange(6), torch.tensor([True, False, True]),
               torch.randn(5, dtype=torch.complex64), integer_valued((100,), 2, torch.float64),
               integer_valued((2, 2), 3)]
    # 64-byte buckets: the float64 tensor (800 bytes) and the two float32 ones go apart.
    out = comm.broadcast_coalesced(tensors, [CPU] * 3, buffer_size=64)
    assert len(out) == 3 and all(a is b for a, b in zip(out[0], tensors))
    for rank in out[1:]:
        for got, want in zip(rank, tensors):
            assert got.dtype == want.dtype and torch.equal(got, want)
            assert not shares_memory(got, want)
    # Views of one flat buffer, each with its own version counter: an in-place update of one
    # (a BatchNorm running statistic) must not invalidate another saved for backward.
    a, b = out[1][0], out[1][5]
    version = b._version
    a.add_(1)
    assert b._version == version and torch.equal(b, tensors[5])
    with pytest.raises(ValueError, match="must be on devices\\[0\\]"):
        comm.broadcast_coalesced([torch.zeros(2, device="meta")], [CPU, CPU])


@pytest.mark.parametrize("ndev", [2, 3, 4])
def test_comm_reduce_add_is_exact_and_leaves_inputs(ndev):
    inputs = [integer_valued((33, 3), 10 + r) for r in range(ndev)]
    pristine = [t.clone() for t in inputs]
    got = comm.reduce_add(inputs, destination="cpu")
    assert torch.equal(got, torch.stack(pristine).sum(0))
    assert all(torch.equal(a, b) for a, b in zip(inputs, pristine))
    assert not any(shares_memory(got, t) for t in inputs)
    z = [torch.complex(integer_valued((4,), r), integer_valued((4,), 20 + r)) for r in range(3)]
    assert torch.equal(comm.reduce_add(z, CPU), z[0] + z[1] + z[2])
    same = integer_valued((6,), 5)  # one tensor passed for two ranks: copied, not refused
    assert torch.equal(comm.reduce_add([same, same], -1), 2 * same)
    with pytest.raises(ValueError, match="input 1 has size"):
        comm.reduce_add([torch.zeros(3), torch.zeros(4)], CPU)
    with pytest.raises(RuntimeError, match="destination cuda:0 must be the device of one"):
        comm.reduce_add([torch.zeros(3), torch.zeros(3)], torch.device("cuda", 0))


def test_comm_reduce_add_coalesced_matches_per_tensor_sums():
    shapes = [(3, 4), (10,), (2, 2, 2), (1,), (40,)]
    inputs = [[integer_valued(s, 100 * r + i) for i, s in enumerate(shapes)] for r in range(3)]
    inputs[1][2] = inputs[1][2].double()  # not the same dtype on every rank: refused below
    with pytest.raises((TypeError, ValueError, RuntimeError), match="dtype"):
        comm.reduce_add_coalesced(inputs, CPU, buffer_size=32)
    inputs[1][2] = inputs[1][2].float()
    got = comm.reduce_add_coalesced(inputs, CPU, buffer_size=32)
    for i, s in enumerate(shapes):
        assert got[i].shape == s
        assert torch.equal(got[i], inputs[0][i] + inputs[1][i] + inputs[2][i])
    sparse = [torch.eye(3).to_sparse() * (r + 1) for r in range(2)]
    (total,) = comm.reduce_add_coalesced([[sparse[0]], [sparse[1]]], CPU)
    assert torch.equal(total.to_dense(), 3 * torch.eye(3))


def test_comm_finds_torch_cuda_comm_in_a_fresh_process():
    """ringreduce.comm hands CUDA scatter and gather to torch.cuda.comm, which `import torch`
    does not import (seen on the GPU machine, torch 2.11: "module 'torch.cuda' has no attribute
    'comm'" when nothing had imported torch.nn.parallel first)."""
    code = ("import torch, ringreduce.comm; "
            "print(hasattr(torch.cuda, 'comm') and hasattr(torch.cuda.comm, 'scatter'))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "True", proc.stdout


def test_comm_scatter_and_gather_on_cpu():
    x = torch.arange(21.0).view(7, 3)
    chunks = comm.scatter(x, [CPU] * 3)
    assert [c.shape[0] for c in chunks] == [3, 3, 1]  # torch.chunk's sizes
    assert torch.equal(comm.gather(chunks, 0, CPU), x)
    parts = comm.scatter(x, [CPU] * 2, chunk_sizes=[2, 5])
    assert [p.shape[0] for p in parts] == [2, 5]
    out = [torch.zeros(4, 3), torch.zeros(3, 3)]
    comm.scatter(x, out=out)
    assert torch.equal(torch.cat(out), x)
    dest = torch.zeros(3, 7)
    comm.gather([x.t()[:, :4], x.t()[:, 4:]], dim=1, out=dest)
    assert torch.equal(dest, x.t())


def test_comm_timer_counts_the_collectives():
    with comm.CommTimer() as timer:
        comm.broadcast_coalesced([torch.randn(1000)], [CPU] * 2)
        comm.reduce_add([torch.randn(1000), torch.randn(1000)], CPU)
    comm.broadcast(torch.randn(10), [CPU] * 2)  # outside: not counted
    assert len(timer._marks) == 2 and timer.seconds() > 0
    assert timer.seconds() == 0.0  # read once


# ---------------------------------------------------------------- replicate

def test_replicas_on_one_device_do_not_alias():
    model = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5))
    replicas = ringreduce.parallel.replicate(model, [CPU] * 3)
    sources = list(model.parameters()) + list(model.buffers())
    storages = set()
    for r, replica in enumerate(replicas):
        tensors = [replica[0].weight, replica[0].bias, replica[1].weight, replica[1].bias,
                   replica[1].running_mean, replica[1].running_var,
                   replica[1].num_batches_tracked]
        for got, want in zip(tensors, sources):
            assert torch.equal(got, want)
            # Replica 0 uses the module's own tensors (so buffer updates reach the module).
            assert shares_memory(got, want) == (r == 0)
        if r > 0:
            storages.add(tensors[0].untyped_storage().data_ptr())
            storages.add(tensors[4].untyped_storage().data_ptr())
        assert list(replica.parameters()) == []  # copies are plain attributes, as in torch
    assert len(storages) == 4


# ---------------------------------------------------------------- training against references

def small_net():
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 5 * 5, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def batches(steps, batch, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 2, 5, 5, generator=g, dtype=torch.float64),
             torch.randint(0, 3, (batch,), generator=g)) for _ in range(steps)]


def train_steps(net, data, lr=0.1, momentum=0.9):
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def max_diff(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a, b))


@pytest.mark.parametrize("ndev,batch", [(2, 8), (3, 7)])
def test_training_matches_the_unwrapped_module_on_the_full_batch(ndev, batch):
    # No BatchNorm: a sample's output does not depend on its shard, so the gradients summed
    # over the replicas are the full-batch gradient up to summation order. batch 7 over 3
    # devices gives unequal shards (3, 3, 1).
    torch.manual_seed(0)
    model = small_net()
    start = copy.deepcopy(model)
    reference = copy.deepcopy(model)
    data = batches(3, batch, seed=ndev)
    # The reference trains first, in this thread: the replicas' threads must not be the first
    # in the process to call torch's float64 tanh. Two threads making that first call at once
    # sometimes get a result one ulp off every later call's (torch 2.13 CPU, without
    # ringreduce: 1 process in 200 with torch.tanh alone, 5 in 150 with this net's forward,
    # none of 200 once the main thread has called it), which made the run-to-run check below
    # fail about once in 30 runs of this file.
    ref_losses = train_steps(reference, data)
    net = ringreduce.DataParallel(model, device_ids=[CPU] * ndev)
    assert net.device_ids == [CPU] * ndev and net.output_device == CPU
    losses = train_steps(net, data)
    for a, b in zip(losses, ref_losses):
        assert abs(a.item() - b.item()) <= 1e-12
    assert max_diff(model.parameters(), reference.parameters()) <= 1e-12
    assert max_diff(model.parameters(), start.parameters()) > 1e-3  # training moved them
    # Bitwise the same from run to run.
    again = copy.deepcopy(start)
    train_steps(ringreduce.DataParallel(again, device_ids=[CPU] * ndev), data)
    pairs = list(zip(model.parameters(), again.parameters()))
    assert all(torch.equal(p, q) for p, q in pairs), \
        f"run-to-run differences per parameter: {[(p - q).abs().max().item() for p, q in pairs]}"


def test_more_devices_than_samples_uses_as_many_replicas_as_chunks():
    torch.manual_seed(1)
    model = small_net()
    reference = copy.deepcopy(model)
    x, y = batches(1, 2, seed=1)[0]
    net = ringreduce.DataParallel(model, device_ids=[CPU] * 3)
    F.cross_entropy(net(x), y).backward()
    F.cross_entropy(reference(x), y).backward()
    assert max_diff([p.grad for p in model.parameters()],
                    [p.grad for p in reference.parameters()]) <= 1e-12


class TutorialModel(nn.Module):
    """PyTorch's multi-GPU tutorial: a submodule wrapped in DataParallel inside a model."""

    def __init__(self, wrap=None):
        super().__init__()
        self.block1 = nn.Linear(10, 20)
        self.block2 = nn.Linear(20, 20)
        if wrap is not None:
            self.block2 = wrap(self.block2)
        self.block3 = nn.Linear(20, 20)

    def forward(self, x):
        return self.block3(F.relu(self.block2(F.relu(self.block1(x)))))


def test_tutorial_model_with_a_wrapped_submodule():
    torch.manual_seed(2)
    plain = TutorialModel().double()
    wrapped = TutorialModel(lambda m: ringreduce.DataParallel(m, device_ids=[CPU] * 3)).double()
    wrapped.load_state_dict({k.replace("block2.", "block2.module."): v
                             for k, v in plain.state_dict().items()})
    g = torch.Generator().manual_seed(2)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (plain, wrapped)]
    for _ in range(3):
        x = torch.randn(9, 10, generator=g, dtype=torch.float64)
        target = torch.randn(9, 20, generator=g, dtype=torch.float64)
        for m, opt in zip((plain, wrapped), opts):
            opt.zero_grad()
            F.mse_loss(m(x), target).backward()
        grads = [[p.grad for p in m.parameters()] for m in (plain, wrapped)]
        assert max_diff(*grads) <= 1e-12
        assert max(g.abs().max().item() for g in grads[0]) > 1e-3
        for opt in opts:
            opt.step()
    assert max_diff(plain.parameters(), wrapped.parameters()) <= 1e-12


def test_state_dict_round_trips_with_nn_dataparallel_keys():
    torch.manual_seed(3)
    ours = ringreduce.DataParallel(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)),
                                   device_ids=[CPU, CPU])
    theirs = nn.DataParallel(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)))
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert all(k.startswith("module.") for k in ours.state_dict())
    theirs.load_state_dict(ours.state_dict())
    for (k, a), b in zip(ours.state_dict().items(), theirs.state_dict().values()):
        assert torch.equal(a, b), k
    fresh = ringreduce.DataParallel(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)),
                                    device_ids=[CPU, CPU])
    fresh.load_state_dict(theirs.state_dict())
    for a, b in zip(fresh.state_dict().values(), ours.state_dict().values()):
        assert torch.equal(a, b)


def test_batchnorm_trains_with_per_replica_statistics():
    # Each replica normalises its own shard; the module's running statistics are updated by
    # the source replica only (its first shard), as with nn.DataParallel. The reference runs
    # the unwrapped module shard by shard: the same statistics, one backward of the sum.
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(),
                          nn.Linear(6, 2)).double()
    reference = copy.deepcopy(model)
    first_shard_only = copy.deepcopy(model)
    net = ringreduce.DataParallel(model, device_ids=[CPU] * 2)
    g = torch.Generator().manual_seed(4)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (net, reference)]
    for _ in range(3):
        x = torch.randn(10, 4, generator=g, dtype=torch.float64)
        y = torch.randn(10, 2, generator=g, dtype=torch.float64)
        for opt in opts:
            opt.zero_grad()
        first_shard_only.load_state_dict(model.state_dict())
        with torch.no_grad():
            first_shard_only(x.chunk(2)[0])
        out = net(x)
        F.mse_loss(out, y, reduction="sum").backward()
        ref_out = torch.cat([reference(s) for s in x.chunk(2)])
        F.mse_loss(ref_out, y, reduction="sum").backward()
        assert (out - ref_out).abs().max().item() <= 1e-12
        for opt in opts:
            opt.step()
        stats = model[1]
        assert torch.equal(stats.running_mean, first_shard_only[1].running_mean)
        assert torch.equal(stats.running_var, first_shard_only[1].running_var)
    assert model[1].num_batches_tracked.item() == 3
    assert max_diff(model.parameters(), reference.parameters()) <= 1e-12
    assert not torch.equal(model[1].running_mean, reference[1].running_mean)  # 6 vs 3 updates
    net.eval()
    with torch.no_grad():
        assert (net(x) - model(x)).abs().max().item() <= 1e-12


def test_kwargs_and_structured_outputs():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2).double()

        def forward(self, x, scale=1.0, extra=None):
            return {"y": self.lin(x) * scale, "pair": (x.sum(1), extra)}

    torch.manual_seed(5)
    module = Net()
    net = ringreduce.DataParallel(module, device_ids=[CPU] * 2)
    x = torch.randn(5, 3, dtype=torch.float64)
    out = net(x, scale=2.0, extra=None)
    assert (out["y"] - module(x, 2.0)["y"]).abs().max().item() <= 1e-12
    assert torch.equal(out["pair"][0], x.sum(1)) and out["pair"][1] is None


def test_data_parallel_function_matches_the_module():
    torch.manual_seed(6)
    model = small_net()
    x, _ = batches(1, 6, seed=6)[0]
    got = ringreduce.data_parallel(model, x, device_ids=[CPU] * 3)
    assert (got - model(x)).abs().max().item() <= 1e-12


def test_errors_name_the_rule():
    with pytest.raises(ValueError, match="must all be CPU devices or all CUDA devices"):
        ringreduce.DataParallel(nn.Linear(2, 2), device_ids=[CPU, torch.device("cuda", 0)])
    with pytest.raises(ValueError, match="at least one device"):
        ringreduce.DataParallel(nn.Linear(2, 2), device_ids=[])
    net = ringreduce.DataParallel(nn.Linear(2, 2, device="meta"), device_ids=[CPU, CPU])
    with pytest.raises(RuntimeError, match="on device cpu \\(device_ids\\[0\\]\\) but found one "
                                           "of them on device: meta"):
        net(torch.zeros(4, 2))

    class Broken(nn.Module):
        def forward(self, x):
            raise KeyError("boom")

    with pytest.raises(KeyError, match="boom") as info:
        ringreduce.DataParallel(Broken(), device_ids=[CPU] * 2)(torch.zeros(4, 1))
    assert any("in replica" in note for note in getattr(info.value, "__notes__", []))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU default; a GPU is here")
def test_without_a_gpu_and_device_ids_the_module_is_called_directly():
    module = nn.Linear(3, 2)
    net = ringreduce.DataParallel(module)
    assert net.device_ids == []
    x = torch.randn(4, 3)
    assert torch.equal(net(x), module(x))
    assert list(net.state_dict()) == ["module.weight", "module.bias"]


# ---------------------------------------------------------------- trainer

def test_wrapped_trainer_follows_the_replica_trainer():
    from ringreduce.train.trainers import ReplicaTrainer

    torch.manual_seed(7)
    model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(),
                          nn.Linear(3 * 4 * 4, 10)).double()
    wrapped = WrappedTrainer(model, [CPU] * 2, "dataparallel", lr=0.1)
    replicas = ReplicaTrainer(model, [CPU] * 2, "ring", lr=0.1)
    wrapped.time_comm = True
    g = torch.Generator().manual_seed(7)
    for _ in range(2):
        x = torch.randn(6, 1, 6, 6, generator=g, dtype=torch.float64)
        y = torch.randint(0, 10, (6,), generator=g)
        assert abs(wrapped.step(x, y).item() - replicas.step(x, y).item()) <= 1e-12
    assert max_diff(wrapped.model.parameters(), replicas.replicas[0].parameters()) <= 1e-12
    comm_seconds = wrapped.pop_comm_seconds()
    assert len(comm_seconds) == 2 and all(s > 0 for s in comm_seconds)
    assert 0.0 <= wrapped.evaluate(x, y, batch_size=4) <= 1.0
    with pytest.raises(WrapperUnavailable, match="replicates only on CUDA GPUs"):
        WrappedTrainer(model, [CPU] * 2, "nn-dataparallel")


def run_cli(capsys, *args):
    from ringreduce.train import main

    rc = main(list(args))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_cli_trains_through_ringreduce_dataparallel(capsys):
    # `python -m ringreduce.train` runs main(); tests/test_train.py covers the subprocess.
    rc, out, err = run_cli(capsys, "--device", "cpu", "--ranks", "2", "--epochs", "1",
                           "--batch-size", "8", "--train-size", "16", "--test-size", "8",
                           "--image-size", "8", "--wrapper", "dataparallel", "--lr", "0.01")
    assert rc == 0, err
    assert "wrapper=dataparallel" in out and "sec/epoch on [cpu, cpu]" in out
    assert "loss" not in err  # no progress bar: stderr is not a terminal
    rc, out, err = run_cli(capsys, "--device", "cpu", "--wrapper", "nn-dataparallel")
    assert rc == 2
    assert "--wrapper nn-dataparallel cannot run here: torch.nn.DataParallel" in err
    rc, out, err = run_cli(capsys, "--device", "cpu", "--wrapper", "dataparallel",
                           "--allreduce", "naive")
    assert rc == 2 and "applies to --wrapper replicas only" in err


# ---------------------------------------------------------------- GPU

def simulated_gpus(n=2):
    return [torch.device("cuda", 0)] * n


@needs_cuda
def test_cuda_comm_on_simulated_ranks():
    devices = simulated_gpus(3)
    src = integer_valued((1000, 3), 8).cuda()
    out = comm.broadcast_coalesced([src, src[0].clone()], devices)
    assert out[0][0] is src
    for rank in out[1:]:
        assert torch.equal(rank[0], src) and not shares_memory(rank[0], src)
    inputs = [integer_valued((1001,), 30 + r).cuda() for r in range(3)]
    got = comm.reduce_add(inputs, devices[0])
    assert torch.equal(got.cpu(), sum(t.cpu() for t in inputs))
    x = torch.arange(12.0).view(6, 2)
    chunks = comm.scatter(x, devices)
    assert all(c.device == devices[0] for c in chunks)
    assert torch.equal(comm.gather(chunks, 0, CPU), x)


@needs_cuda
def test_cuda_simulated_ranks_match_the_cpu_reference():
    torch.manual_seed(9)
    model = small_net()
    reference = copy.deepcopy(model)
    data = batches(3, 7, seed=9)
    net = ringreduce.DataParallel(model.cuda(), device_ids=simulated_gpus(3))
    train_steps(net, [(x.cuda(), y.cuda()) for x, y in data])
    train_steps(reference, data)
    assert max_diff([p.cpu() for p in model.parameters()], reference.parameters()) <= 1e-12


@needs_cuda
@needs_two_gpus
def test_cuda_matches_nn_dataparallel_on_distinct_gpus():
    torch.manual_seed(10)
    ours_model = small_net().cuda()
    theirs_model = copy.deepcopy(ours_model)
    data = [(x.cuda(), y.cuda()) for x, y in batches(3, 8, seed=10)]
    train_steps(ringreduce.DataParallel(ours_model, device_ids=[0, 1]), data)
    train_steps(nn.DataParallel(theirs_model, device_ids=[0, 1]), data)
    assert max_diff(ours_model.parameters(), theirs_model.parameters()) <= 1e-12
