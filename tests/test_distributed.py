"""The "ringreduce" torch.distributed backend, with real processes (spawned ranks, 1 to 4).

Each test starts its ranks once and runs many checks inside them (starting a rank costs a
torch import): results against the single-process core (bit for bit) and independent
references, DDP against gloo, faults (killed, hung, absent ranks; mismatched arguments), and
/dev/shm left clean. GPU variants run every rank on cuda:0 and skip without a GPU.
"""
import ctypes
import datetime
import faulthandler
import os
import queue as queue_module
import signal
import subprocess
import sys
import threading
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ringreduce
from ringreduce.distributed import register_backend

from checks import (assert_same_bits, assert_same_bits_but_nan_payload, ddp_steps,
                    native_stack_handler, needs_cuda, seeded, segments_of)
from reference import (ALL_DTYPES, _combine, adversarial_half_inputs, assert_close_to_wide,
                       fp32_ordered_sum, half_rounding, random_inputs, ring_model, rounds_once,
                       valid_ops)

SPAWN_TIMEOUT = 180


class Results(dict):
    """run_ranks' {rank: (status, value)}, with the ranks' process ids in .pids."""


def _entry(fn, rank, world, store, queue, args):
    # A rank that dies of a signal (a crash, an abort in malloc) leaves every thread's Python
    # stack on stderr, which pytest shows with the failing test; the result says only "died".
    faulthandler.enable(all_threads=True)
    try:
        torch.set_num_threads(1)
        register_backend()
        queue.put((rank, "ok", fn(rank, world, store, *args)))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    # Skip interpreter teardown: destroying a gloo group with the GIL held can deadlock with
    # gloo's worker threads (torch 2.13), which would turn a passing rank into a hung one.
    queue.close()
    queue.join_thread()
    os._exit(0)


def run_ranks(fn, world, tmp_path, *args, start=None, env=None):
    """Runs fn(rank, world, store_path, *args) in `world` spawned processes (only the ranks in
    `start` when given) and returns {rank: ("ok", value) or ("error", traceback)}. `env` is in
    each child's environment from its start, before it imports torch (PYTORCH_CUDA_ALLOC_CONF
    is read when torch starts, so setting it in the child would be too late). A rank that dies
    of a signal leaves its native stack on stderr too (checks.native_stack_handler, preloaded
    where nothing else is: a sanitizer's runtime must come first and keeps its own handler)."""
    handler = native_stack_handler()
    if handler and "LD_PRELOAD" not in os.environ and "LD_PRELOAD" not in (env or {}):
        env = {"LD_PRELOAD": handler, **(env or {})}
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    store = str(tmp_path / f"store-{time.monotonic_ns()}")
    ranks = range(world) if start is None else start
    procs = {r: ctx.Process(target=_entry, args=(fn, r, world, store, queue, args))
             for r in ranks}
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        for p in procs.values():
            p.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
    results = Results()
    results.pids = [p.pid for p in procs.values()]
    deadline = time.monotonic() + SPAWN_TIMEOUT
    try:
        while len(results) < len(procs) and time.monotonic() < deadline:
            try:
                rank, status, value = queue.get(timeout=1.0)
                results[rank] = (status, value)
            except queue_module.Empty:
                dead = [r for r, p in procs.items() if p.exitcode is not None and r not in results]
                if dead and all(procs[r].exitcode != 0 for r in dead):
                    for r in dead:
                        results[r] = ("died", procs[r].exitcode)
    finally:
        for p in procs.values():
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    missing = [r for r in procs if r not in results]
    assert not missing, f"ranks {missing} did not report within {SPAWN_TIMEOUT} s"
    return results


def values(results):
    bad = {r: v for r, (s, v) in results.items() if s != "ok"}
    assert not bad, "\n".join(f"rank {r}:\n{v}" for r, v in sorted(bad.items()))
    return [results[r][1] for r in sorted(results)]


def init(rank, world, store, backend="ringreduce", timeout=30.0):
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout))


# ---------------------------------------------------------------------------------------
# Correctness sweep: every collective, dtype, op and awkward size against references.

SIZES = (0, 1, 7, 33, 1000, 4099)


def _collectives_sweep(rank, world, store, device):
    init(rank, world, store)
    pg = dist.group.WORLD
    assert dist.get_backend(pg) == "ringreduce", dist.get_backend(pg)
    leftover = [n for n in segments_of([os.getpid()]) if n.endswith(f"-r{rank}")]
    assert not leftover, f"segment still linked after init: {leftover}"
    checked = 0
    for dtype in ALL_DTYPES:
        for op in valid_ops(dtype):
            for count in SIZES:
                g = torch.Generator().manual_seed(1000 + checked)
                inputs = random_inputs(world, count, dtype, op, generator=g)
                mine = inputs[rank].clone().to(device)
                dist.all_reduce(mine, op=getattr(dist.ReduceOp, {"prod": "PRODUCT"}.get(
                    op, op.upper())))
                mine = mine.cpu()
                core = [t.clone() for t in inputs]
                ringreduce.all_reduce(core, op)
                # The list API runs on CPU: on CUDA 16-bit sums round per hop, on CPU once.
                if half_rounding(device) == half_rounding() or not rounds_once(dtype, op, "once"):
                    assert torch.equal(mine, core[0]), f"{dtype} {op} n={count}: differs from core"
                assert torch.equal(mine, ring_model(inputs, op, half_rounding(device))), (
                    f"{dtype} {op} n={count}")
                if count:
                    assert_close_to_wide(mine, inputs, op)
                checked += 1
    # A 2-D, non-contiguous tensor: reduced through a contiguous copy, written back in place.
    base = torch.arange(24, dtype=torch.float64, device=device).reshape(4, 6) * (rank + 1)
    view = base.t()
    dist.all_reduce(view)
    expect = torch.arange(24, dtype=torch.float64).reshape(4, 6).t() * (world * (world + 1) // 2)
    assert torch.equal(view.cpu(), expect)

    for root in range(world):
        for count in (0, 5, 3001):
            t = torch.full((count,), float(rank * 10 + 1), device=device)
            dist.broadcast(t, src=root)
            assert torch.equal(t.cpu(), torch.full((count,), float(root * 10 + 1)))

    poison = -12345
    for count in (0, 3, 4099):
        mine = torch.arange(count, dtype=torch.int64, device=device) + 1000 * rank
        outs = [torch.full((count,), poison, dtype=torch.int64, device=device)
                for _ in range(world)]
        dist.all_gather(outs, mine)
        for r in range(world):
            assert torch.equal(outs[r].cpu(), torch.arange(count) + 1000 * r)
        flat = torch.full((world * count,), poison, dtype=torch.int64, device=device)
        dist.all_gather_into_tensor(flat, mine)
        assert torch.equal(flat.cpu(), torch.cat([torch.arange(count) + 1000 * r
                                                  for r in range(world)]))
        # The input is a view of the output straddling two slots (not this rank's own slot):
        # the backend must gather from a copy, not from memory it is overwriting.
        if count and world > 1:
            flat = torch.full((world * count,), poison, dtype=torch.int64, device=device)
            lo = count // 2
            flat[lo:lo + count] = mine
            dist.all_gather_into_tensor(flat, flat[lo:lo + count])
            assert torch.equal(flat.cpu(), torch.cat([torch.arange(count) + 1000 * r
                                                      for r in range(world)])), "overlap"
        # In place: the input is this rank's own slot of the output.
        flat = torch.full((world * count,), poison, dtype=torch.int64, device=device)
        flat[rank * count:(rank + 1) * count] = mine
        dist.all_gather_into_tensor(flat, flat[rank * count:(rank + 1) * count])
        assert torch.equal(flat.cpu(), torch.cat([torch.arange(count) + 1000 * r
                                                  for r in range(world)])), "in place"

    # reduce_scatter: 16-bit floats too (reference._combine: fp32 arithmetic, rounded to the
    # dtype at every hop, as the CUDA path does; on CPU sums and averages round once), out of
    # place, in place into this rank's own
    # segment of the input, and from a list.
    for dtype in (torch.int32, torch.float64, torch.float32, torch.bfloat16, torch.float16,
                  torch.int8):
        for op in ("sum", "max", "prod", "avg"):
            if op not in valid_ops(dtype):
                continue
            count = 1031
            g = torch.Generator().manual_seed(7)
            full = [t.reshape(world, count)
                    for t in random_inputs(world, world * count, dtype, op, generator=g)]
            reduce_op = getattr(dist.ReduceOp, {"prod": "PRODUCT"}.get(op, op.upper()))
            out = torch.full((count,), 7, dtype=dtype, device=device)
            flat = full[rank].reshape(-1).to(device, copy=True)  # in place below
            dist.reduce_scatter_tensor(out, flat, op=reduce_op)
            seg = [full[q][rank] for q in range(world)]
            expect = seg[0].clone()
            for q in range(1, world):
                expect = _combine(op, expect, seg[q], dtype, q == world - 1, world)
            if world > 1 and rounds_once(dtype, op, half_rounding(device)):
                expect = fp32_ordered_sum(seg, op)
            what = f"reduce_scatter_tensor {dtype} {op}"
            assert torch.equal(out.cpu().view(torch.uint8), expect.view(torch.uint8)), what
            dist.reduce_scatter_tensor(flat[rank * count:(rank + 1) * count], flat, op=reduce_op)
            assert torch.equal(flat[rank * count:(rank + 1) * count].cpu().view(torch.uint8),
                               expect.view(torch.uint8)), f"{what} in place"
            out_list = torch.full((count,), 7, dtype=dtype, device=device)
            dist.reduce_scatter(out_list, [s.to(device) for s in full[rank]], op=reduce_op)
            assert torch.equal(out_list.cpu().view(torch.uint8), expect.view(torch.uint8)), \
                f"reduce_scatter {dtype} {op}"
            if dtype == torch.float64:
                assert_close_to_wide(out.cpu(), seg, op)

    t = torch.full((11,), float(rank + 1), device=device)
    dist.reduce(t, dst=world - 1)
    if rank == world - 1:
        assert torch.equal(t.cpu(), torch.full((11,), float(world * (world + 1) // 2)))
    else:
        assert torch.equal(t.cpu(), torch.full((11,), float(rank + 1)))

    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank})
    assert objs == [{"rank": r} for r in range(world)]

    # Back-to-back collectives of every kind with no pause: a rank that races ahead into the
    # next one must not disturb peers still finishing this one.
    for i in range(40):
        t = torch.full((3 + i % 5,), float(rank + i), device=device)
        dist.all_reduce(t)
        assert torch.equal(t.cpu(), torch.full_like(t.cpu(), float(world * i + world *
                                                                    (world - 1) // 2)))
        dist.barrier()
        b = torch.full((2,), float(rank), device=device)
        dist.broadcast(b, src=i % world)
        assert torch.equal(b.cpu(), torch.full((2,), float(i % world)))
        outs = [torch.zeros(1, device=device) for _ in range(world)]
        dist.all_gather(outs, torch.full((1,), float(rank * i), device=device))
        assert [float(o) for o in outs] == [float(r * i) for r in range(world)]
        dist.barrier()
    work = dist.all_reduce(torch.ones(3, device=device), async_op=True)
    work.wait()
    dist.barrier()
    if device == "cpu":
        _half_rounding_checks(rank, world)
    comm = ringreduce.distributed.comm_of(pg)
    dist.destroy_process_group()
    assert comm.closed
    return checked


# 16-bit float sums on CPU (issue 47): odd counts, the largest (40 KiB of bfloat16) above the
# one-round path's 32 KiB and in several rounds of an 8 KiB staging area.
HALF_COUNTS = (1, 7, 1031, 20001)
_HALF_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG}


def _half_inputs(kind, world, count, dtype, op):
    g = seeded("backend half rounding", kind, world, count, dtype, op)
    if kind == "random":
        return random_inputs(world, count, dtype, op, generator=g)
    return adversarial_half_inputs(world, count, dtype, g)


def _half_rounding_checks(rank, world, counts=HALF_COUNTS):
    """float16 / bfloat16 sum and avg through the backend's CPU all_reduce (one-round and
    two-shot), reduce and reduce_scatter_tensor (out of place and in place): the fp32 sum in
    rank order, rounded once (reference.fp32_ordered_sum), on random and adversarial inputs.
    Then a group made under RINGREDUCE_HALF_ROUNDING=per_hop gives the ring's bits."""
    for dtype in (torch.bfloat16, torch.float16):
        for op, reduce_op in _HALF_OPS.items():
            for kind in ("random", "adversarial"):
                for count in counts:
                    case = f"{dtype} {op} {kind} world={world} count={count}"
                    inputs = _half_inputs(kind, world, count, dtype, op)
                    want = fp32_ordered_sum(inputs, op)
                    t = inputs[rank].clone()
                    dist.all_reduce(t, op=reduce_op)
                    assert_same_bits_but_nan_payload(t, want, f"all_reduce {case}")
                    t = inputs[rank].clone()
                    dist.reduce(t, dst=world - 1, op=reduce_op)
                    if rank == world - 1:
                        assert_same_bits_but_nan_payload(t, want, f"reduce {case}")
                    full = _half_inputs(kind, world, world * count, dtype, op)
                    want = fp32_ordered_sum([f[rank * count:(rank + 1) * count] for f in full], op)
                    out = torch.full((count,), 7, dtype=dtype)
                    flat = full[rank].clone()
                    dist.reduce_scatter_tensor(out, flat, op=reduce_op)
                    assert_same_bits_but_nan_payload(out, want, f"reduce_scatter {case}")
                    mine = flat[rank * count:(rank + 1) * count]
                    dist.reduce_scatter_tensor(mine, flat, op=reduce_op)
                    assert_same_bits_but_nan_payload(mine, want, f"reduce_scatter in place {case}")
    os.environ["RINGREDUCE_HALF_ROUNDING"] = "per_hop"
    try:
        per_hop = dist.new_group(list(range(world)))
    finally:
        del os.environ["RINGREDUCE_HALF_ROUNDING"]
    for dtype in (torch.bfloat16, torch.float16):
        for op, reduce_op in _HALF_OPS.items():
            for count in (7, 20001):
                case = f"per_hop {dtype} {op} world={world} count={count}"
                inputs = _half_inputs("random", world, count, dtype, op)
                t = inputs[rank].clone()
                dist.all_reduce(t, op=reduce_op, group=per_hop)
                assert_same_bits(t, ring_model(inputs, op, "per_hop"), f"all_reduce {case}")
                full = _half_inputs("random", world, world * count, dtype, op)
                seg = [f[rank * count:(rank + 1) * count] for f in full]
                expect = seg[0].clone()
                for q in range(1, world):
                    expect = _combine(op, expect, seg[q], dtype, q == world - 1, world)
                out = torch.full((count,), 7, dtype=dtype)
                dist.reduce_scatter_tensor(out, full[rank], op=reduce_op, group=per_hop)
                assert_same_bits(out, expect, f"reduce_scatter {case}")
    dist.destroy_process_group(per_hop)


def _half_rounding_only(rank, world, store):
    init(rank, world, store)
    _half_rounding_checks(rank, world, counts=(7, 20001))
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [7])
def test_half_rounding_cpu(tmp_path, world):
    """The sweep runs _half_rounding_checks at 1-4 ranks; here at 7 (more ranks than cores),
    with an odd count on the one-round path and one on the two-shot path."""
    values(run_ranks(_half_rounding_only, world, tmp_path, env={"RINGREDUCE_SHM_BYTES": "8192"}))


def _cuda_half_rounding_differs(rank, world, store):
    """Rank 1 asks for once-rounded CUDA sums, rank 0 for per-hop ones: the CUDA collectives
    would run different protocols, so the group must refuse to form (a CPU group checks it too:
    the setting travels in the segment header). Returns the error text, or None."""
    if rank == 1:
        os.environ["RINGREDUCE_CUDA_HALF_ROUNDING"] = "once"
    else:
        os.environ.pop("RINGREDUCE_CUDA_HALF_ROUNDING", None)
    try:
        init(rank, world, store, timeout=20.0)
        dist.all_reduce(torch.ones(4))
    except Exception as e:  # noqa: BLE001 - the message is the result
        return str(e)
    return None


def test_ranks_with_different_cuda_half_rounding_refuse_to_form_a_group(tmp_path):
    """Every rank fails; the one that sees the other's header first names the setting and both
    values (the other may then find that rank's segment gone)."""
    msgs = values(run_ranks(_cuda_half_rounding_differs, 2, tmp_path))
    assert all(m is not None for m in msgs), msgs
    named = [m for m in msgs if "RINGREDUCE_CUDA_HALF_ROUNDING" in m]
    assert named and "once" in named[0] and "per_hop" in named[0], msgs


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_collectives_cpu(tmp_path, world):
    # A small staging area makes the larger sizes go in several rounds.
    results = run_ranks(_collectives_sweep, world, tmp_path, "cpu",
                        env={"RINGREDUCE_SHM_BYTES": "8192"})
    assert values(results)[0] > 0
    assert not segments_of(results.pids), f"left in /dev/shm: {segments_of(results.pids)}"


@needs_cuda
@pytest.mark.parametrize("world", [2, 3])
def test_collectives_cuda_shared_gpu(tmp_path, world):
    values(run_ranks(_collectives_sweep, world, tmp_path, "cuda:0"))


# ---------------------------------------------------------------------------------------
# DDP: the same training under ringreduce and under gloo.

def _ddp_train(rank, world, store, device):
    init(rank, world, store)
    gloo = dist.new_group(backend="gloo")
    results = {}
    for name, group in (("ringreduce", None), ("gloo", gloo)):
        model = ddp_steps(rank, group, device)
        results[name] = [p.detach().cpu().clone() for p in model.state_dict().values()]
    ring, ref = results["ringreduce"], results["gloo"]
    # Two ranks: a + b is exact in either order, so the trainings agree bit for bit.
    same = all(torch.equal(a, b) for a, b in zip(ring, ref))
    close = all(torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-6)
                for a, b in zip(ring, ref))
    # Buffers (BatchNorm running statistics) stay per rank; parameters must be replicas.
    params = [p.detach().cpu() for p in model.parameters()]
    objs = [None] * world
    dist.all_gather_object(objs, [p.double().sum().item() for p in params])
    # No destroy_process_group here: see _entry (the gloo group is the problem).
    return same, close, objs


def test_ddp_matches_gloo(tmp_path):
    out = values(run_ranks(_ddp_train, 2, tmp_path, "cpu"))
    for same, close, objs in out:
        assert same, "DDP under ringreduce differs from DDP under gloo"
        assert close
        assert objs[0] == objs[1], "replicas diverged"


@needs_cuda
def test_ddp_cuda_shared_gpu(tmp_path):
    for same, close, objs in values(run_ranks(_ddp_train, 2, tmp_path, "cuda:0")):
        assert close and objs[0] == objs[1]


# ---------------------------------------------------------------------------------------
# API surface: registration, backend strings, the collectives beyond reductions (their full
# tests: test_distributed_surface.py), unsupported ops.

def test_import_registers_backend():
    code = ("import ringreduce, torch.distributed as dist; "
            "assert 'ringreduce' in dist.Backend.backend_list, dist.Backend.backend_list; "
            "from ringreduce.distributed import register_backend; "
            "assert register_backend() and register_backend()")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, ("`import ringreduce` must register the backend "
                                  f"(ringreduce/__init__.py):\n{proc.stderr}")


def _start_environment(rank, world, store):
    """The environment this process was started with: /proc/self/environ does not see later
    os.environ changes, which come after the spawned child has imported torch."""
    with open("/proc/self/environ", "rb") as f:
        return dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)


def test_run_ranks_env_is_set_before_the_child_starts(tmp_path):
    """PYTORCH_CUDA_ALLOC_CONF (the GPU tests' allocator variants) takes effect only if set
    before torch starts: run_ranks' env must be in the child's environment from exec on."""
    key = f"RINGREDUCE_TEST_ENV_{os.getpid()}"
    assert key not in os.environ
    for start_env in values(run_ranks(_start_environment, 2, tmp_path, env={key: "early"})):
        assert start_env.get(key.encode()) == b"early", "env was set after the child started"
    assert key not in os.environ, "run_ranks left its env in the parent"


def _die_of(rank, world, store, how):
    if how == "segv":
        ctypes.string_at(0)  # a read of address 0
    os.abort()


@pytest.mark.parametrize("how, signum", [("segv", signal.SIGSEGV), ("abort", signal.SIGABRT)])
def test_a_rank_that_dies_of_a_signal_leaves_both_stacks(tmp_path, capfd, how, signum):
    """A rank's crash (a SIGSEGV in the extension, malloc aborting on a corrupted heap) shows
    with the failing test: faulthandler's Python stack and the preloaded handler's native one,
    on the stderr the ranks share with the test."""
    if native_stack_handler() is None:
        pytest.skip("no C compiler here builds scripts/segv_backtrace.c")
    results = run_ranks(_die_of, 1, tmp_path, how)
    assert results[0] == ("died", -signum), results[0]
    err = capfd.readouterr().err
    assert f"segv_backtrace: signal {int(signum)} " in err, err[-2000:]
    assert "segv_backtrace: end" in err, err[-2000:]
    assert "Fatal Python error" in err and "_die_of" in err, err[-2000:]


def test_run_ranks_keeps_a_preload_that_is_there(tmp_path, monkeypatch):
    """A sanitizer's runtime in LD_PRELOAD must stay alone and first: run_ranks adds its crash
    handler only where nothing is preloaded."""
    monkeypatch.setenv("LD_PRELOAD", "")
    assert values(run_ranks(_start_environment, 1, tmp_path))[0][b"LD_PRELOAD"] == b""
    monkeypatch.delenv("LD_PRELOAD")
    handler = native_stack_handler()
    got = values(run_ranks(_start_environment, 1, tmp_path))[0].get(b"LD_PRELOAD")
    assert got == (handler.encode() if handler else None)


def test_cuda_reduce_ops_cover_valid_ops():
    """tests/test_distributed_cuda.py maps every op valid_ops yields (that file skips here)."""
    from test_distributed_cuda import REDUCE_OPS
    for dtype in ALL_DTYPES:
        missing = set(valid_ops(dtype)) - REDUCE_OPS.keys()
        assert not missing, f"REDUCE_OPS lacks {sorted(missing)} ({dtype})"


def _api_surface(rank, world, store):
    init(rank, world, store, backend="cpu:gloo,cuda:ringreduce")
    t = torch.full((5,), float(rank + 1))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((5,), 3.0))
    # torch binds each device to its backend: CPU tensors went to gloo.
    world_pg = dist.group.WORLD
    assert world_pg._get_backend(torch.device("cpu")).name() == "gloo"
    assert world_pg._get_backend(torch.device("cuda")).name() == "ringreduce"
    g = dist.new_group(backend="ringreduce")
    errors = {}
    got = torch.zeros(1)
    gathered = [torch.zeros(1) for _ in range(world)]
    swapped = torch.zeros(2)
    for name, call in (
            ("send", lambda: dist.send(torch.full((1,), 5.0), dst=1, group=g) if rank == 0 else
             dist.recv(got, src=0, group=g)),
            ("gather", lambda: dist.gather(torch.full((1,), rank + 1.0), gathered
                                           if rank == 0 else None, dst=0, group=g)),
            ("all_to_all_single", lambda: dist.all_to_all_single(
                swapped, torch.tensor([1.0, 2.0]) + 10 * rank, group=g)),
            ("monitored_barrier", lambda: dist.monitored_barrier(group=g)),
            ("PREMUL_SUM", lambda: dist.all_reduce(
                torch.ones(2), op=dist._make_nccl_premul_sum(2.0), group=g)),
            ("band on float", lambda: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND,
                                                      group=g)),
            ("avg on bool", lambda: dist.all_reduce(torch.ones(2, dtype=torch.bool),
                                                    op=dist.ReduceOp.AVG, group=g))):
        try:
            call()
            errors[name] = None
        except (RuntimeError, ValueError, TypeError) as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
    # Bad arguments are caught before any rank communicates, so the group still works.
    t = torch.ones(3)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g)
    dist.destroy_process_group()
    results = {"recv": got.tolist(), "all_to_all_single": swapped.tolist(),
               "gather": [g.item() for g in gathered]}
    return errors, results


def test_backend_spec_and_unsupported(tmp_path):
    for rank, (errors, results) in enumerate(values(run_ranks(_api_surface, 2, tmp_path))):
        for name in ("send", "gather", "all_to_all_single"):
            assert errors[name] is None, errors[name]
        assert results["recv"] == ([0.0] if rank == 0 else [5.0])
        assert results["gather"] == ([1.0, 2.0] if rank == 0 else [0.0, 0.0])
        assert results["all_to_all_single"] == [1.0 + rank, 11.0 + rank]
        # torch runs monitored_barrier on gloo groups only, before asking the backend; it says
        # so with a ValueError (torch 2.13) or a RuntimeError (others): torch's choice, not ours.
        barrier = errors["monitored_barrier"]
        assert barrier and barrier.split(":")[0] in ("ValueError", "RuntimeError"), barrier
        assert "gloo" in barrier.lower(), barrier
        assert errors["PREMUL_SUM"].startswith("ValueError"), errors["PREMUL_SUM"]
        assert "PREMUL_SUM" in errors["PREMUL_SUM"], errors["PREMUL_SUM"]
        assert errors["band on float"].startswith("TypeError"), errors["band on float"]
        assert "band" in errors["band on float"], errors["band on float"]
        assert errors["avg on bool"].startswith("TypeError"), errors["avg on bool"]


# ---------------------------------------------------------------------------------------
# Faults: every one ends in an error naming the collective and the peer, within the timeout.

FAULT_TIMEOUT = 6.0


def _mismatch(rank, world, store):
    init(rank, world, store, timeout=FAULT_TIMEOUT)
    messages = []
    for case in ("count", "dtype", "op", "collective"):
        group = dist.new_group(backend="ringreduce", timeout=datetime.timedelta(
            seconds=FAULT_TIMEOUT))
        t = torch.ones(10 + (rank if case == "count" else 0),
                       dtype=torch.float64 if case == "dtype" and rank else torch.float32)
        op = dist.ReduceOp.MAX if case == "op" and rank else dist.ReduceOp.SUM
        start = time.monotonic()
        try:
            if case == "collective" and rank == 1:
                dist.broadcast(t, src=0, group=group)
            else:
                dist.all_reduce(t, op=op, group=group)
            messages.append((case, None, 0.0))
        except RuntimeError as exc:
            messages.append((case, str(exc), time.monotonic() - start))
        try:
            dist.all_reduce(torch.ones(1), group=group)
            messages.append((case + " reuse", None, 0.0))
        except RuntimeError as exc:
            messages.append((case + " reuse", str(exc), 0.0))
    dist.destroy_process_group()
    return messages


def test_mismatched_arguments_fail_clearly(tmp_path):
    results = run_ranks(_mismatch, 2, tmp_path)
    assert not segments_of(results.pids), f"left in /dev/shm: {segments_of(results.pids)}"
    for rank, messages in enumerate(values(results)):
        for case, msg, elapsed in messages:
            assert msg is not None, f"rank {rank}: {case} mismatch was not detected"
            assert elapsed < FAULT_TIMEOUT
            if case.endswith("reuse"):
                assert "failed earlier" in msg, msg
                continue
            assert "disagree" in msg or "failed while this rank waited" in msg, msg
        text = " ".join(m for _, m, _ in messages)
        assert "count=10" in text and "count=11" in text
        assert "dtype=float32" in text and "dtype=float64" in text
        assert "op=sum" in text and "op=max" in text
        assert "broadcast" in text


def _killed(rank, world, store, mode, device, victim):
    init(rank, world, store, timeout=FAULT_TIMEOUT)
    t = torch.ones(1000, device=device)
    dist.all_reduce(t)
    if rank == victim:
        if t.is_cuda:
            torch.cuda.synchronize()  # its part of the last collective is done: no race
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "exit":
            os._exit(3)  # no destructors, no atexit: the segments stay linked by this rank
        time.sleep(FAULT_TIMEOUT + 3)  # "hang": alive, but never joins the next collective
        return None
    return _timed_all_reduce(t)


def _timed_all_reduce(t):
    """(error message or "no error", seconds the failing all_reduce took)."""
    start = time.monotonic()
    try:
        dist.all_reduce(t)
        return ("no error", 0.0)
    except RuntimeError as exc:
        return (str(exc), time.monotonic() - start)


# RINGREDUCE_CALLER_RUNS=0: the survivors' synchronous CPU collectives run on the progress
# thread and their errors reach the caller through Work.wait, the path every CUDA collective
# and its failures take (CALLER_RUNS_0 below).
CALLER_RUNS_0 = {"RINGREDUCE_CALLER_RUNS": "0"}


@pytest.mark.parametrize("device,mode,victim,env", [
    pytest.param("cpu", "kill", 2, None, id="cpu-kill-2"),
    pytest.param("cpu", "kill", 0, None, id="cpu-kill-0"),
    pytest.param("cpu", "exit", 2, None, id="cpu-exit-2"),
    pytest.param("cpu", "hang", 2, None, id="cpu-hang-2"),
    pytest.param("cpu", "kill", 2, CALLER_RUNS_0, id="cpu-kill-2-caller_runs0"),
    pytest.param("cpu", "hang", 2, CALLER_RUNS_0, id="cpu-hang-2-caller_runs0"),
    pytest.param("cuda:0", "kill", 2, None, marks=needs_cuda, id="cuda:0-kill-2"),
    pytest.param("cuda:0", "hang", 2, None, marks=needs_cuda, id="cuda:0-hang-2")])
def test_lost_rank_fails_within_timeout(tmp_path, device, mode, victim, env):
    """A rank killed (SIGKILL), gone through os._exit, or hung: the others fail naming it,
    "exited" for a dead rank (at once) and "timed out" for a live one (after the timeout); no
    segment of this run is left in /dev/shm, the dead rank's included."""
    world = 3
    results = run_ranks(_killed, world, tmp_path, mode, device, victim, env=env)
    if mode != "hang":
        assert results[victim][0] == "died", results[victim]
    for rank in set(range(world)) - {victim}:
        status, value = results[rank]
        assert status == "ok", value
        msg, elapsed = value
        assert "all_reduce" in msg and f"rank {victim}" in msg, msg
        if mode == "hang":
            assert "timed out" in msg and "exited" not in msg, msg
            # The timeout, neither sooner (a wait cut short) nor much later.
            assert FAULT_TIMEOUT - 0.5 < elapsed < FAULT_TIMEOUT + 2.0, (
                f"took {elapsed:.1f} s with a {FAULT_TIMEOUT} s timeout: {msg}")
        else:
            assert "exited" in msg and "timed out" not in msg, msg
            assert elapsed < FAULT_TIMEOUT / 2, f"took {elapsed:.1f} s to see the exit: {msg}"
    assert not segments_of(results.pids), f"left in /dev/shm: {segments_of(results.pids)}"


# A peer lost for good: teardown must not wait for it. The timeout is long, so that a teardown
# that waited for the lost peer (up to the timeout) shows. (The CUDA variants:
# test_distributed_cuda.py's test_killed_rank_fails_the_others and
# test_teardown_does_not_wait_for_an_aborted_peer.)
TEARDOWN_TIMEOUT = 20.0
LINGER_S = 4.0


def _lost_then_teardown(rank, world, store, how, victim):
    init(rank, world, store, timeout=TEARDOWN_TIMEOUT)
    pg = dist.group.WORLD
    t = torch.ones(1000)
    dist.all_reduce(t)
    if rank == victim:
        if how == "abort":
            pg.abort()
            time.sleep(LINGER_S)  # aborted but alive, its group not yet destroyed
            start = time.monotonic()
            dist.destroy_process_group()
            return "aborted", 0.0, time.monotonic() - start
        for _ in range(3):  # queued, not finished: the peers may already be waiting on them
            dist.all_reduce(t, async_op=True)
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(3)  # no cleanup at all, like a crash
    for _ in range(100):  # the victim's queued collectives may meet the first few of these
        msg, failed_s = _timed_all_reduce(t)
        if msg != "no error":
            break
    start = time.monotonic()
    dist.destroy_process_group()
    return msg, failed_s, time.monotonic() - start


@pytest.mark.parametrize("how,world,victim,env", [
    pytest.param("abort", 3, 0, None, id="abort-3-0"),
    pytest.param("kill", 3, 2, None, id="kill-3-2"),
    pytest.param("exit", 2, 0, None, id="exit-2-0"),
    pytest.param("abort", 3, 0, CALLER_RUNS_0, id="abort-3-0-caller_runs0"),
    pytest.param("kill", 3, 2, CALLER_RUNS_0, id="kill-3-2-caller_runs0")])
def test_teardown_does_not_wait_for_a_lost_peer(tmp_path, how, world, victim, env):
    """A peer aborted (and alive for LINGER_S more before it destroys its group), or killed
    (SIGKILL) or gone through os._exit right after queuing collectives: the others' failing
    all_reduce raises at once naming it, and every rank's destroy_process_group (the aborting
    one's too) returns within 3 s, far below the 20 s timeout; no segment of the run is left."""
    results = run_ranks(_lost_then_teardown, world, tmp_path, how, victim, env=env)
    if how != "abort":
        assert results[victim][0] == "died", results[victim]
    for rank in range(world):
        if rank == victim and how != "abort":
            continue
        status, value = results[rank]
        assert status == "ok", value
        msg, failed_s, teardown_s = value
        if rank != victim:
            assert "all_reduce" in msg and f"rank {victim}" in msg, msg
            assert failed_s < 5.0, f"rank {rank} took {failed_s:.1f} s to fail: {msg}"
        assert teardown_s < 3.0, f"rank {rank}: destroy_process_group took {teardown_s:.1f} s"
    assert not segments_of(results.pids), f"left in /dev/shm: {segments_of(results.pids)}"


def _absent(rank, world, store):
    start = time.monotonic()
    try:
        init(rank, world, store, timeout=3.0)
        return ("joined", 0.0)
    except RuntimeError as exc:
        return (str(exc), time.monotonic() - start)


def test_rank_that_never_joins(tmp_path):
    results = run_ranks(_absent, 3, tmp_path, start=[0, 1])
    for msg, elapsed in values(results):
        assert "rank(s) 2 did not join" in msg, msg
        assert elapsed < 3.0 + 5.0
    assert not segments_of(results.pids), f"left in /dev/shm: {segments_of(results.pids)}"


def _abort_while_waiting(rank, world, store):
    init(rank, world, store, timeout=60.0)
    pg = dist.group.WORLD
    t = torch.ones(100)
    dist.all_reduce(t)
    if rank == 1:
        time.sleep(3.0)  # rank 0 waits for this rank in its next collective, and is aborted
        return _timed_all_reduce(t)
    # A watchdog thread aborts the group while this thread waits (GIL released) for rank 1.
    timer = threading.Timer(0.5, pg.abort)
    timer.start()
    result = _timed_all_reduce(t)
    timer.join()
    comm = ringreduce.distributed.comm_of(pg)
    dist.destroy_process_group()
    assert comm.closed
    return result


def test_abort_from_another_thread_stops_a_waiting_collective(tmp_path):
    """abort() must not wait for the collective (lock order with the GIL); it fails the group,
    so the waiting call raises at once, and the peer then fails fast instead of timing out."""
    results = run_ranks(_abort_while_waiting, 2, tmp_path)
    (msg0, elapsed0), (msg1, elapsed1) = values(results)
    assert not segments_of(results.pids), f"left in /dev/shm: {segments_of(results.pids)}"
    assert "aborted" in msg0 and "all_reduce" in msg0, msg0
    assert elapsed0 < 5.0, f"abort took {elapsed0:.1f} s to stop the collective: {msg0}"
    assert "rank 0" in msg1 and "aborted" in msg1, msg1
    assert elapsed1 < 5.0, f"the peer took {elapsed1:.1f} s to notice: {msg1}"
