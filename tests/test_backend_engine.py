"""The C++ backend's engine as real clients meet it (issue: the backend's engine in C++).

Each test reproduces a failure of the Python engine it replaced: torch's PowerSGD hook (its
callbacks wait on nested collectives), callbacks that wait on a nested collective's future,
copy-backs under inference mode, and an interpreter exit with work still posted.
"""
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from checks import free_port, segments_of
from test_distributed import init, run_ranks, values


def _train_powersgd(rank, world, store, backend, wrap_fp16):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    init(rank, world, store, backend=backend)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 8))
    # One bucket (DDP's default size): its hook's callbacks are then the only thread issuing
    # collectives during backward. With several buckets, callbacks of one bucket and the hook
    # of the next issue collectives from two threads, in an order no backend can make the same
    # on every rank.
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                               start_powerSGD_iter=2, min_compression_rate=0.5,
                               orthogonalization_epsilon=1e-8, random_seed=7)
    hook = psgd.powerSGD_hook
    if wrap_fp16:
        hook = default_hooks.fp16_compress_wrapper(hook)
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(6):  # steps 0-1 uncompressed, then PowerSGD
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    # numpy arrays: pickled by value (tensors would go through a sharing server that dies with
    # the process).
    params = [p.detach().numpy().copy() for p in model.parameters()]
    dist.destroy_process_group()
    return params


@pytest.mark.parametrize("wrap_fp16", [False, True], ids=["powerSGD", "fp16+powerSGD"])
def test_ddp_powersgd_hook_trains_like_gloo(tmp_path, wrap_fp16):
    got = values(run_ranks(_train_powersgd, 2, tmp_path, "ringreduce", wrap_fp16))
    ref = values(run_ranks(_train_powersgd, 2, tmp_path, "gloo", wrap_fp16))
    for rank in range(2):
        for a, b in zip(got[rank], ref[rank]):
            # Two ranks: every sum is a + b, the same bits whoever adds.
            assert a.tobytes() == b.tobytes(), (rank, abs(a - b).max())
    for a, b in zip(got[0], got[1]):
        assert a.tobytes() == b.tobytes(), "replicas differ"


def _nested_callbacks(rank, world, store):
    init(rank, world, store)
    t = torch.full((5,), float(rank + 1))

    def nested(fut):
        # A collective issued and waited for inside a callback.
        inner = fut.value()[0].clone()
        return dist.all_reduce(inner, async_op=True).get_future().wait()[0]

    def deeper(fut):
        x = fut.value().clone()
        return dist.all_reduce(x, op=dist.ReduceOp.MAX, async_op=True).get_future().wait()[0]

    chained = dist.all_reduce(t, async_op=True).get_future().then(nested).then(deeper)
    value = chained.wait().tolist()
    # Again and again. (One at a time: a callback that issues a collective while this thread
    # issues others would make the ranks' orders depend on timing, with any backend.)
    many = []
    for i in range(4):
        fut = dist.all_reduce(torch.full((3,), float(i + rank)), async_op=True).get_future()
        many.append(fut.then(nested).wait().tolist())
    dist.destroy_process_group()
    return value, many


def test_callbacks_that_wait_on_nested_collectives_complete(tmp_path):
    for value, many in values(run_ranks(_nested_callbacks, 2, tmp_path)):
        assert value == [6.0] * 5  # (1 + 2) summed twice
        assert many == [[2.0 * (2 * i + 1)] * 3 for i in range(4)]


def _inference_mode(rank, world, store):
    init(rank, world, store)
    out = {}
    with torch.inference_mode():
        base = torch.arange(24, dtype=torch.float32).reshape(4, 6) + rank
        view = base[:, ::2]  # non-contiguous: copied back after the collective
        works = [dist.all_reduce(view, async_op=True) for _ in range(3)]
        for w in works:
            w.wait()
        out["inference"] = base.tolist()
        gathered = [torch.empty(2, 3)[:, :2] for _ in range(world)]
        dist.all_gather(gathered, torch.full((2, 2), float(rank)))
        out["gathered"] = [g.tolist() for g in gathered]
    leaf = torch.ones(6, requires_grad=True)
    with torch.no_grad():
        w = dist.all_reduce(leaf.view(2, 3).t(), async_op=True)
    w.wait()
    out["leaf"] = leaf.tolist()
    dist.destroy_process_group()
    return out


def _contiguous_in_every_mode(rank, world, store):
    """Contiguous CPU all-reduces (the jobs that run without the InferenceMode guard, Job::
    memory_only) on inference tensors and on leaves that require grad, inside and outside
    inference mode and no_grad, synchronous and asynchronous, as gloo takes them."""
    init(rank, world, store)
    got = {}
    with torch.inference_mode():
        inf = torch.arange(5, dtype=torch.float32) + 10 * rank
        dist.all_reduce(inf)  # inside inference mode, synchronous
        dist.all_reduce(inf, async_op=True).wait()
    dist.all_reduce(inf)  # an inference tensor outside inference mode
    got["inference"] = inf.tolist()
    leaf = torch.full((4,), 1.0 + rank, requires_grad=True)
    dist.all_reduce(leaf)  # grad mode on
    with torch.no_grad():
        dist.all_reduce(leaf, async_op=True).wait()
    got["leaf"] = (leaf.tolist(), leaf.grad_fn is None, leaf.is_leaf)
    # The caller's modes are its own again afterwards: an op here records autograd as usual.
    got["grad_after"] = (leaf * 2).grad_fn is not None and torch.is_grad_enabled()
    dist.destroy_process_group()
    return got


@pytest.mark.parametrize("env", [{}, {"RINGREDUCE_ASYNC": "0"}, {"RINGREDUCE_CALLER_RUNS": "0"}],
                         ids=["default", "inline", "progress-thread"])
def test_contiguous_jobs_in_every_mode(tmp_path, env):
    for rank, got in enumerate(values(run_ranks(_contiguous_in_every_mode, 2, tmp_path,
                                                env=env))):
        # Three all-reduces of (x, x + 10) over 2 ranks: (2x + 10) * 4.
        assert got["inference"] == [(2.0 * x + 10) * 4 for x in range(5)], (rank, got)
        # Two of (1, 2): 3 * 2.
        assert got["leaf"] == ([6.0] * 4, True, True), (rank, got)
        assert got["grad_after"], (rank, got)


def test_copy_backs_work_under_inference_mode_and_for_leaves(tmp_path):
    for rank, out in enumerate(values(run_ranks(_inference_mode, 2, tmp_path))):
        # The whole base: the view's columns reduced, the columns between them (never part of
        # the collective) still this rank's own values.
        expect = torch.arange(24, dtype=torch.float32).reshape(4, 6) + rank
        expect[:, ::2] = (2 * expect[:, ::2] - 2 * rank + 1) * 4  # x + (x + 1), doubled twice
        got = torch.tensor(out["inference"])
        assert torch.equal(got, expect), (
            f"rank {rank}: the base after all-reducing its even columns:\n{got}\nexpected:\n"
            f"{expect}")
        assert out["gathered"] == [[[0.0, 0.0]] * 2, [[1.0, 1.0]] * 2]
        assert out["leaf"] == [2.0] * 6


EXIT_SCRIPT = textwrap.dedent("""
    import sys, torch, torch.distributed as dist, ringreduce
    dist.init_process_group("ringreduce")
    rank = dist.get_rank()
    dist.all_reduce(torch.ones(4))
    mode = sys.argv[1]
    if mode == "recv":
        # A receive nobody will ever send, still posted at exit.
        pending = dist.irecv(torch.empty(3), src=1 - rank, tag=99)
    elif mode == "queued":
        # A collective the peer never joins, queued at exit (its wait is cut short).
        if rank == 0:
            pending = dist.all_reduce(torch.ones(1 << 16), async_op=True)
    elif mode == "abort":
        dist.group.WORLD.abort()
    print("leaving", rank, flush=True)
""")


@pytest.mark.parametrize("mode", ["recv", "queued", "abort", "plain"])
def test_interpreter_exit_with_work_posted_is_clean(tmp_path, mode):
    script = tmp_path / "exit.py"
    script.write_text(EXIT_SCRIPT)
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE="2", PYTHONPATH=os.pathsep.join(sys.path))
        procs.append(subprocess.Popen([sys.executable, str(script), mode], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      start_new_session=True))
    start = time.monotonic()
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=90))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{mode}: a rank did not exit within 90 s")
    elapsed = time.monotonic() - start
    for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{err[-3000:]}"
        assert f"leaving {rank}" in out
        assert "terminate called" not in err, err[-3000:]
    assert elapsed < 45, f"exit took {elapsed:.1f} s"
    pids = [p.pid for p in procs]
    assert not segments_of(pids), f"left in /dev/shm: {segments_of(pids)}"
