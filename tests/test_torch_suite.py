"""What torch's own distributed suite (scripts/torch_suite.py) found missing, each reproduced
here: sparse all-reduce (and DDP with sparse gradients), sequence numbers under
TORCH_DISTRIBUTED_DEBUG=DETAIL, the timeout text torch's tests match; and the runner itself."""
import importlib.util
import os
import re
import sys
import time

import pytest
import torch
import torch.distributed as dist

from checks import run_bounded
from test_distributed import init, run_ranks, values

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KNOWN_GAPS = os.path.join(ROOT, "scripts", "torch_suite_known_gaps.txt")
# torch's own suite (scripts/torch_suite.py) imports expecttest, which torch does not install:
# CI and scripts/setup.sh install it; the offline GPU machine has none.
needs_expecttest = pytest.mark.skipif(
    importlib.util.find_spec("expecttest") is None,
    reason="expecttest is not installed: torch's own test suite imports it (pip install expecttest)")
SHAPE = (11, 6, 3)  # two sparse dims, one dense


SEEDS = (1, 2, 3, 4)


def _nnz(seed, rank):
    """How many entries rank `rank` has for seed `seed`: none, 0 or 1, uneven, many."""
    return {1: 0, 2: rank % 2, 3: 5 + 7 * rank, 4: 40}[seed]


def _sparse_of(rank, seed, nnz=None):
    """Rank `rank`'s sparse input: random (repeating, uncoalesced) indices, random values."""
    nnz = _nnz(seed, rank) if nnz is None else nnz
    g = torch.Generator().manual_seed(seed * 100 + rank)
    idx = torch.stack([torch.randint(0, SHAPE[0], (nnz,), generator=g),
                       torch.randint(0, SHAPE[1], (nnz,), generator=g)])
    val = torch.randn(nnz, SHAPE[2], generator=g, dtype=torch.float64)
    return torch.sparse_coo_tensor(idx, val, SHAPE)


def _sparse_sum(rank, world, store):
    init(rank, world, store)
    out = []
    for seed in SEEDS:
        t = _sparse_of(rank, seed)
        dist.all_reduce(t)
        # As lists: a tensor sent back through the queue would be a shared-memory handle that
        # dies with this process (run_ranks' _entry ends it with os._exit).
        out.append((t.is_coalesced(), t.coalesce().indices().tolist(),
                    t.coalesce().values().tolist()))
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_sparse_all_reduce_sums_like_dense(tmp_path, world):
    """Seeds 1-4 (SEEDS); nnz differ by rank, 0 and 1 included. Reference: the dense float64
    sum of every rank's input, built here; results identical on every rank."""
    results = values(run_ranks(_sparse_sum, world, tmp_path))
    for i, seed in enumerate(SEEDS):
        want = sum(_sparse_of(r, seed).to_dense() for r in range(world))
        for rank, per_rank in enumerate(results):
            coalesced, idx, val = per_rank[i]
            assert coalesced, (seed, rank)
            idx = torch.tensor(idx, dtype=torch.long).reshape(2, -1)
            val = torch.tensor(val, dtype=torch.float64).reshape(-1, SHAPE[2])
            got = torch.sparse_coo_tensor(idx, val, SHAPE).to_dense()
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12,
                                       msg=f"seed {seed} rank {rank}")
            assert per_rank[i] == results[0][i], (seed, rank)


def _sparse_bad(rank, world, store):
    init(rank, world, store)
    t = _sparse_of(rank, 5, nnz=4)
    before = t.coalesce().values().clone()
    errors = []
    try:  # (torch's dispatcher itself refuses sparse tensors in the other collectives)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        errors.append(None)
    except (ValueError, RuntimeError) as e:
        errors.append(str(e))
    untouched = torch.equal(t.coalesce().values(), before)
    # Another shape on one rank: every rank sees the gathered shapes and raises.
    other = torch.sparse_coo_tensor(torch.zeros(2, 1, dtype=torch.long), torch.ones(1, 3),
                                    (11 + rank, 6, 3))
    try:
        dist.all_reduce(other)
        errors.append(None)
    except (ValueError, RuntimeError) as e:
        errors.append(str(e))
    return errors, untouched


def test_sparse_all_reduce_bad_input(tmp_path):
    for rank, (errors, untouched) in enumerate(values(run_ranks(_sparse_bad, 2, tmp_path))):
        op_err, shape_err = errors
        assert op_err and "ReduceOp.SUM" in op_err and "max" in op_err, op_err
        assert untouched
        assert shape_err and "another shape" in shape_err, shape_err
        assert f"rank {1 - rank}'s sparse tensor" in shape_err, shape_err


class _Tagger(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 8, sparse=True)
        self.out = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.out(self.emb(x).mean(1))


def _ddp_sparse(rank, world, store):
    init(rank, world, store)
    gloo = dist.new_group(backend="gloo")
    params = {}
    for name, group in (("ringreduce", None), ("gloo", gloo)):
        torch.manual_seed(7 + rank)  # DDP broadcasts rank 0's weights
        model = _Tagger()
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
        g = torch.Generator().manual_seed(31 + rank)
        for _ in range(3):
            x = torch.randint(0, 50, (4, 5), generator=g)
            y = torch.randint(0, 3, (4,), generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            assert model.emb.weight.grad.is_sparse
            opt.step()
        params[name] = [p.detach().clone() for p in model.parameters()]
    dist.destroy_process_group()
    # Two ranks: a + b is exact in either order, so both trainings agree bit for bit.
    return all(torch.equal(a, b) for a, b in zip(params["ringreduce"], params["gloo"]))


def test_ddp_with_sparse_gradients_matches_gloo(tmp_path):
    assert values(run_ranks(_ddp_sparse, 2, tmp_path)) == [True, True]


def _sequence_numbers(rank, world, store):
    dist.set_debug_level_from_env()  # torch read it at import, before run_ranks set it
    assert dist.get_debug_level() == dist.DebugLevel.DETAIL
    init(rank, world, store)
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    seen = [backend._get_sequence_number_for_group()]
    t = torch.ones(3)
    dist.all_reduce(t)
    dist.barrier()
    seen.append(backend._get_sequence_number_for_group())
    # DETAIL mode: every collective's arguments are checked across ranks, by sequence number.
    sub = dist.new_group([0, 1])
    objs = [None] * 2
    dist.all_gather_object(objs, {"rank": rank}, group=sub)
    desync = None
    try:
        if rank == 0:
            dist.all_reduce(torch.ones(4))
        else:
            dist.broadcast(torch.ones(4), 0)
    except RuntimeError as e:
        desync = str(e)
    return seen, objs, desync


def test_sequence_numbers_and_debug_detail(tmp_path):
    results = values(run_ranks(_sequence_numbers, 2, tmp_path,
                               env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}))
    for seen, objs, desync in results:
        assert seen[1] >= seen[0] + 2, seen
        assert objs == [{"rank": 0}, {"rank": 1}]
        assert desync and "mismatch" in desync.lower(), desync
    assert results[0][0] == results[1][0]


def _barrier_timeout(rank, world, store):
    init(rank, world, store, timeout=2.0)
    if rank == 0:
        try:
            dist.barrier()
        except RuntimeError as e:
            return str(e)
    time.sleep(4.0)  # alive, but never in the barrier: rank 0 times out
    return None


def test_barrier_timeout_text_matches_torch(tmp_path):
    msg = values(run_ranks(_barrier_timeout, 2, tmp_path))[0]
    assert msg and re.search(" (Timed out|closed|timeout) ", msg), msg  # torch's own pattern
    assert "barrier" in msg and "timed out after" in msg and "rank 1" in msg, msg


def _profiled(rank, world, store):
    """Collectives under torch.profiler; returns the ringreduce events: (name, input shapes,
    is_async), in the order they began."""
    init(rank, world, store)
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3) + rank
    b = torch.full((5,), float(rank))
    g_in = torch.full((4, 2), float(rank))
    outs = [torch.empty(4, 2) for _ in range(world)]
    p2p = torch.full((3,), float(rank))
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        dist.all_reduce(t)
        dist.broadcast(b, 0)
        dist.all_gather(outs, g_in, async_op=True).wait()
        if rank == 0:
            dist.recv(p2p)  # from any rank: torch's recvAnySource
        else:
            dist.send(p2p, 0)
    dist.barrier()  # outside the profiler: not recorded
    dist.destroy_process_group()
    events = sorted((e.time_range.start, e.name, e.input_shapes, e.is_async)
                    for e in prof.events() if e.name.startswith("ringreduce"))
    return [e[1:] for e in events]


def test_profiler_records_ringreduce_events_with_shapes(tmp_path):
    """torch.profiler shows each collective as "ringreduce:<op>" with its input shapes, as it
    shows gloo's "gloo:<op>" (the suite's call_dist_op checks these too: scripts/torch_suite.py
    adds ringreduce to its profiling lists)."""
    results = values(run_ranks(_profiled, 2, tmp_path))
    for rank, events in enumerate(results):
        p2p = ("ringreduce:recvAnySource" if rank == 0 else "ringreduce:send", [[3]], True)
        assert events == [("ringreduce:all_reduce", [[2, 3]], True),
                          ("ringreduce:broadcast", [[5]], True),
                          ("ringreduce:all_gather", [[4, 2]], True), p2p], (rank, events)


def _any_source_timeout(rank, world, store):
    init(rank, world, store, timeout=2.0)
    if rank == 1:
        time.sleep(4.0)  # alive, but never sends: rank 0's receive times out
        return None
    try:
        dist.recv(torch.zeros(3))
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_any_source_receive_errors_name_recv_any_source(tmp_path):
    msg = values(run_ranks(_any_source_timeout, 2, tmp_path))[0]
    assert msg.startswith("ringreduce: recvAnySource #") and " timed out " in msg, msg


@needs_expecttest
def test_runner_widens_the_gloo_gates():
    """The runner runs sparse all-reduce (gloo-only in torch) on ringreduce, and it passes."""
    code, out = _runner("--backend", "ringreduce", "--world-size", "2", "--test-timeout", "120",
                        "-k", "^test_sparse_all_reduce_sum$", "-k", "^test_monitored_barrier_gloo$",
                        timeout=300)
    assert code == 0, out
    assert re.search(r"^PASS +test_sparse_all_reduce_sum ", out, re.M), out
    assert re.search(r"^EXCLUDED +test_monitored_barrier_gloo ", out, re.M), out


def _runner(*args, timeout):
    """Runs scripts/torch_suite.py with `args` (in its own session, killed by group past
    `timeout`); returns (exit status, output)."""
    return run_bounded([sys.executable, os.path.join(ROOT, "scripts", "torch_suite.py"), *args],
                       timeout)


@needs_expecttest
@pytest.mark.timeout(1300)
def test_torch_suite_world_size_2_has_no_gap(tmp_path):
    """torch's whole suite at world size 2, gloo then ringreduce (ranks forked: ~3 min on a
    loaded 2-core machine, about an hour spawned): every test gloo passes passes on ringreduce,
    but for scripts/torch_suite_known_gaps.txt, and every gap listed there is still open."""
    out_json = str(tmp_path / "suite")
    code, out = _runner("--compare", "--world-size", "2", "--start-method", "fork",
                        "--test-timeout", "240", "--json", out_json,
                        "--log", str(tmp_path / "suite.log"), timeout=1200)
    assert code == 0 and re.search(r"^# gap: ", out, re.M), out
    assert re.search(r"^# gloo world size 2: \d+ pass", out, re.M), out
    # The verdict can fail: the same results judged against no known gaps fail on each of them.
    empty = tmp_path / "no_known_gaps.txt"
    empty.write_text("")
    code, judged = _runner("--compare", "--world-size", "2", "--gloo-json", out_json + ".gloo",
                           "--ringreduce-json", out_json + ".ringreduce", "--known-gaps",
                           str(empty), timeout=120)
    known = [line.split(":", 1)[0].strip() for line in open(KNOWN_GAPS)
             if line.strip() and not line.startswith("#")]
    gaps = re.findall(r"^GAP +(test_\w+):", judged, re.M)
    assert sorted(gaps) == sorted(known) and code == (1 if known else 0), judged

