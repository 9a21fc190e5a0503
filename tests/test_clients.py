"""Real torch.distributed clients on the ringreduce backend (CPU, spawned ranks), each against
the same code on gloo: FSDP2 (fully_shard on a DeviceMesh) training, torch.distributed.checkpoint
of its sharded state dict, a PyTorch-Lightning-style metric sync (AVG on int64), and accelerate
under torchrun."""
import datetime
import importlib.util
import sys

import pytest
import torch
import torch.distributed as dist

from checks import free_port, run_bounded
from test_distributed import run_ranks, values


def _init(rank, world, store, backend):
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))


def _fsdp2_model(world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    # Odd sizes: shards of unequal length, padding on the last rank.
    model = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.ReLU(),
                                torch.nn.Linear(33, 5)).double()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _fsdp2_train(rank, world, store, backend, ckpt_dir):
    _init(rank, world, store, backend)
    model = _fsdp2_model(world)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x = torch.randn(8, 16, generator=g, dtype=torch.float64)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    full = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}

    # DCP: save the sharded state dict, scribble over it, load it back.
    import torch.distributed.checkpoint as dcp

    state = {"model": model.state_dict()}
    dcp.save(state, checkpoint_id=ckpt_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(-7.0)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=ckpt_dir)
    model.load_state_dict(state["model"])
    loaded = {k: v.full_tensor() for k, v in model.state_dict().items()}
    restored = all(torch.equal(loaded[k], full[k]) for k in full)
    if backend != "gloo":  # see test_distributed._entry: gloo's teardown can deadlock
        dist.destroy_process_group()
    # Plain lists: tensors would travel back through shared memory of an exiting process.
    return {k: v.tolist() for k, v in full.items()}, restored


def test_fsdp2_training_and_dcp_match_gloo(tmp_path):
    out = {}
    for backend in ("gloo", "ringreduce"):
        ckpt = str(tmp_path / f"ckpt-{backend}")
        out[backend] = values(run_ranks(_fsdp2_train, 2, tmp_path, backend, ckpt))
    for rank in range(2):
        ring, ring_restored = out["ringreduce"][rank]
        ref, _ = out["gloo"][rank]
        assert ring_restored, f"rank {rank}: DCP load did not restore the saved parameters"
        for k in ref:
            # Two ranks: every reduction is a + b, exact in either order: the same bits.
            assert ring[k] == ref[k], f"rank {rank}: {k} differs from gloo's"
    assert out["ringreduce"][0][0] == out["ringreduce"][1][0]


def _lightning_avg(rank, world, store, backend):
    """What Lightning's `self.log(..., sync_dist=True)` sends for an int64 metric (it special-cases
    only gloo): all_reduce with AVG."""
    _init(rank, world, store, backend)
    counts = torch.tensor([rank * 7 + 3, -5 * rank - 1, 2 ** 40 + rank], dtype=torch.int64)
    dist.all_reduce(counts, op=dist.ReduceOp.AVG)
    dist.destroy_process_group()
    return counts.tolist()


def test_lightning_style_avg_on_int64(tmp_path):
    world = 3
    inputs = [torch.tensor([r * 7 + 3, -5 * r - 1, 2 ** 40 + r], dtype=torch.int64)
              for r in range(world)]
    total = sum(inputs)
    # NCCL's integer average: the sum, then division truncating toward zero.
    expect = torch.div(total, world, rounding_mode="trunc")
    for counts in values(run_ranks(_lightning_avg, world, tmp_path, "ringreduce")):
        assert counts == expect.tolist(), (counts, expect)


ACCELERATE_SCRIPT = """
import os, sys, torch, torch.distributed as dist
import ringreduce
from accelerate import Accelerator, PartialState
out = open(os.path.join(sys.argv[2], sys.argv[1] + "-" + os.environ["RANK"]), "w")
if sys.argv[1] == "kwarg":
    try:
        PartialState(cpu=True, backend="ringreduce")
        out.write("accepted")
    except ValueError as exc:
        out.write(f"refused: {exc}")
else:
    dist.init_process_group("ringreduce")
    acc = Accelerator(cpu=True)
    r = acc.reduce(torch.tensor([float(acc.process_index + 1)]), reduction="sum")
    g = acc.gather(torch.tensor([acc.process_index * 10 + 1]))
    out.write(f"{dist.get_backend()} {r.tolist()} {g.tolist()}")
    dist.destroy_process_group()
out.close()
"""


def _torchrun(script, *args, timeout):
    """Runs `script` under torchrun with 2 processes on this host, in a session of its own
    (checks.run_bounded); returns (exit status, output)."""
    return run_bounded(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(script),
         *map(str, args)], timeout)


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None,
                    reason="accelerate is not installed (.ci/run installs it)")
def test_accelerate_on_cpu_needs_the_group_initialised_first(tmp_path):
    """accelerate (1.x) hard-codes gloo (or mpi) for CPU training and refuses any other backend
    name, whatever the backend registers; on GPUs it passes `backend` through. The documented
    workaround: init_process_group("ringreduce") before creating the Accelerator."""
    script = tmp_path / "acc.py"
    script.write_text(ACCELERATE_SCRIPT)
    out = {}
    for mode in ("kwarg", "init"):
        code, log = _torchrun(script, mode, tmp_path, timeout=180)
        assert code == 0, log
        out[mode] = [(tmp_path / f"{mode}-{rank}").read_text() for rank in range(2)]
    assert all(r.startswith("refused") and "gloo" in r for r in out["kwarg"]), out["kwarg"]
    assert out["init"] == ["ringreduce [3.0] [1, 11]"] * 2, out["init"]


LIGHTNING_SCRIPT = """
import sys, torch, lightning as L
import ringreduce
from lightning.pytorch.strategies import DDPStrategy


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, 1))

    def training_step(self, batch, i):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


backend, out = sys.argv[1], sys.argv[2]
L.seed_everything(0)
g = torch.Generator().manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(128, 16, generator=g),
                                      torch.randn(128, 1, generator=g))
trainer = L.Trainer(accelerator="cpu", devices=2,
                    strategy=DDPStrategy(process_group_backend=backend), max_epochs=2,
                    enable_progress_bar=False, enable_checkpointing=False, logger=False)
model = Model()
trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=16))
params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
torch.save({"params": params, "loss": trainer.callback_metrics["loss"]},
           f"{out}-{trainer.global_rank}.pt")
"""


@pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                    reason="lightning is not installed (.ci/run installs it)")
def test_lightning_ddp_under_torchrun_trains_like_gloo(tmp_path):
    """Lightning's DDPStrategy with process_group_backend="ringreduce" under torchrun: the same
    parameters and logged loss as with gloo, on both ranks."""
    script = tmp_path / "lt.py"
    script.write_text(LIGHTNING_SCRIPT)
    got = {}
    for backend in ("gloo", "ringreduce"):
        code, log = _torchrun(script, backend, tmp_path / backend, timeout=240)
        assert code == 0, log[-6000:]
        got[backend] = [torch.load(tmp_path / f"{backend}-{r}.pt") for r in range(2)]
    for r in range(2):
        assert torch.equal(got["ringreduce"][r]["params"], got["gloo"][r]["params"]), r
        assert torch.equal(got["ringreduce"][r]["loss"], got["gloo"][r]["loss"]), r
    assert torch.equal(got["ringreduce"][0]["params"], got["ringreduce"][1]["params"])
