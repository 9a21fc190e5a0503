"""The "ringreduce" backend on CUDA tensors: 2 and 4 spawned processes sharing cuda:0.

Ran on an H100 on 2026-11-26 (docs/GPU_SESSION.md): every collective bitwise, both allocators,
empty_cache in flight and asynchronous wait passed; every test in which a peer dies, hangs or
aborts failed (a surviving rank died of SIGSEGV). The capture tests at the end have not run.

What it checks: every collective, dtype and awkward size (many larger than a small staging
area, so they go in rounds) bit for bit against ringreduce.all_reduce and the references; the
caching allocator releasing memory mid-run (torch.cuda.empty_cache on one rank, between
collectives and while they are in flight), and expandable segments and cudaMallocAsync (user
tensors are copied through each rank's own staging area, never mapped by a peer); a rank
killed mid-collective (SIGKILL or os._exit, first or last rank); asynchronous work ordered on
the caller's stream; bounded teardown.
"""
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

import ringreduce
from checks import assert_same_bits, needs_cuda, segments_of, sleep_cycles
from reference import (ALL_DTYPES, _combine, fp32_ordered_sum, random_inputs, ring_model,
                       valid_ops)
from test_distributed import init, run_ranks, values

# Every rank shares cuda:0. Skips without a GPU or a CUDA build; fails instead under
# RINGREDUCE_REQUIRE_CUDA=1.
pytestmark = needs_cuda

# A staging area of 8 KiB (two 4 KiB slots): most sizes below go in several rounds.
SMALL_STAGING = {"RINGREDUCE_CUDA_BUFFER_BYTES": "8192"}
SIZES = (0, 1, 7, 33, 1000, 4099)
BIG = 70001
# Every op valid_ops yields (integers and bool take the bitwise ones too).
REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
              "min": dist.ReduceOp.MIN, "prod": dist.ReduceOp.PRODUCT,
              "band": dist.ReduceOp.BAND, "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR}
FAULT_TIMEOUT = 6.0
DEV = torch.device("cuda", 0)


def _sweep(rank, world, store):
    init(rank, world, store)
    torch.cuda.set_device(DEV)
    pg = dist.group.WORLD

    def churn():
        # One rank returns its cached blocks to the driver between collectives: nothing a peer
        # uses may live in them.
        if rank == 0:
            torch.cuda.empty_cache()

    checked = 0
    for dtype in ALL_DTYPES:
        for op in valid_ops(dtype):
            big = op == "sum" and dtype in (torch.float32, torch.bfloat16)
            for count in SIZES + ((BIG,) if big else ()):
                g = torch.Generator().manual_seed(1000 + checked)
                inputs = random_inputs(world, count, dtype, op, generator=g)
                mine = inputs[rank].to(DEV)
                dist.all_reduce(mine, op=REDUCE_OPS[op])
                churn()
                core = [t.to(DEV) for t in inputs]
                ringreduce.all_reduce(core, op)
                got = mine.cpu()
                assert torch.equal(got, core[0].cpu()), f"{dtype} {op} n={count}: differs from core"
                assert torch.equal(got, ring_model(inputs, op, "per_hop")), (
                    f"{dtype} {op} n={count}")
                checked += 1
    assert ringreduce.distributed.comm_of(pg).cuda_distinct_gpus() is False, "every rank is on cuda:0: the GPU is shared"

    for dtype in (torch.float32, torch.int8, torch.float64):
        for root in range(world):
            for count in (0, 5, 3001, 20011):
                g = torch.Generator().manual_seed(root * 7 + count)
                expect = random_inputs(1, count, dtype, "sum", generator=g)[0]
                t = expect.to(DEV) if rank == root else torch.full(
                    (count,), 3, dtype=dtype, device=DEV)
                dist.broadcast(t, src=root)
                churn()
                assert torch.equal(t.cpu(), expect), f"broadcast {dtype} root={root} n={count}"

    poison = 100  # outside the values below (0..96)
    for dtype in (torch.int64, torch.float16, torch.uint8):
        for count in (0, 3, 4099, 9001):
            def value(r):
                return ((torch.arange(count) * 7 + 1000 * r) % 97).to(dtype)

            mine = value(rank).to(DEV)
            outs = [torch.full((count,), poison, dtype=dtype, device=DEV)
                    for _ in range(world)]
            dist.all_gather(outs, mine)
            mine.fill_(poison)  # after the call, on the caller's stream: must not leak in
            churn()
            for r in range(world):
                assert torch.equal(outs[r].cpu(), value(r)), f"all_gather {dtype} n={count}"
            flat = torch.full((world * count,), 5, dtype=dtype, device=DEV)
            flat[rank * count:(rank + 1) * count] = value(rank).to(DEV)
            dist.all_gather_into_tensor(flat, flat[rank * count:(rank + 1) * count])
            assert torch.equal(flat.cpu(), torch.cat([value(r) for r in range(world)])), \
                f"all_gather_into_tensor in place {dtype} n={count}"

    for dtype in (torch.int32, torch.float32, torch.float64, torch.bfloat16, torch.float16,
                  torch.int8):
        for op in ("sum", "max", "prod", "avg"):
            if op not in valid_ops(dtype):
                continue
            for count in (1, 1031, 5000):
                g = torch.Generator().manual_seed(count + len(op))
                full = [t.reshape(world, count)
                        for t in random_inputs(world, world * count, dtype, op, generator=g)]
                seg = [full[q][rank] for q in range(world)]
                expect = seg[0].clone()
                for q in range(1, world):
                    expect = _combine(op, expect, seg[q], dtype, q == world - 1, world)
                out = torch.full((count,), 7, dtype=dtype, device=DEV)
                flat = full[rank].reshape(-1).to(DEV)
                dist.reduce_scatter_tensor(out, flat, op=REDUCE_OPS[op])
                churn()
                assert torch.equal(out.cpu(), expect), f"reduce_scatter_tensor {dtype} {op}"
                # In place: the output is this rank's own segment of the input.
                dist.reduce_scatter_tensor(flat[rank * count:(rank + 1) * count], flat,
                                           op=REDUCE_OPS[op])
                assert torch.equal(flat[rank * count:(rank + 1) * count].cpu(), expect), \
                    f"reduce_scatter_tensor in place {dtype} {op}"
                out_list = torch.full((count,), 7, dtype=dtype, device=DEV)
                dist.reduce_scatter(out_list, [s.to(DEV) for s in full[rank]],
                                    op=REDUCE_OPS[op])
                assert torch.equal(out_list.cpu(), expect), f"reduce_scatter {dtype} {op}"

    dist.barrier()
    start = time.monotonic()
    dist.destroy_process_group()
    return checked, time.monotonic() - start


@pytest.mark.parametrize("asynchronous", ["1", "0"])
@pytest.mark.parametrize("world", [2, 4])
def test_collectives_bitwise(tmp_path, world, asynchronous):
    env = dict(SMALL_STAGING, RINGREDUCE_ASYNC=asynchronous)
    results = run_ranks(_sweep, world, tmp_path, env=env)
    for checked, teardown_s in values(results):
        assert checked > 0
        assert teardown_s < 5.0, f"destroy_process_group took {teardown_s:.1f} s"
    assert not segments_of(results.pids), f"left in /dev/shm: {segments_of(results.pids)}"


def _once_rounded(rank, world, store):
    """float16 / bfloat16 sum and avg in a group made under RINGREDUCE_CUDA_HALF_ROUNDING=once:
    all_reduce (the two-shot) and reduce_scatter_tensor (into a poisoned output, and in place)
    give the fp32 sum in rank order rounded once, the CPU collectives' bits."""
    init(rank, world, store)
    torch.cuda.set_device(DEV)
    checked = 0
    for dtype in (torch.bfloat16, torch.float16):
        for op in ("sum", "avg"):
            for count in (1, 7, 33, 4099, BIG):
                case = f"{dtype} {op} world={world} count={count}"
                g = torch.Generator().manual_seed(4700 + checked)
                inputs = random_inputs(world, count, dtype, op, generator=g)
                t = inputs[rank].to(DEV, copy=True)
                dist.all_reduce(t, op=REDUCE_OPS[op])
                torch.cuda.synchronize()
                assert_same_bits(t.cpu(), fp32_ordered_sum(inputs, op), f"all_reduce {case}")
                full = random_inputs(world, world * count, dtype, op, generator=g)
                want = fp32_ordered_sum([f[rank * count:(rank + 1) * count] for f in full], op)
                flat = full[rank].to(DEV, copy=True)
                out = torch.full((count,), 7, dtype=dtype, device=DEV)
                dist.reduce_scatter_tensor(out, flat, op=REDUCE_OPS[op])
                mine = flat[rank * count:(rank + 1) * count]
                dist.reduce_scatter_tensor(mine, flat, op=REDUCE_OPS[op])
                torch.cuda.synchronize()
                assert_same_bits(out.cpu(), want, f"reduce_scatter {case}")
                assert_same_bits(mine.cpu(), want, f"reduce_scatter in place {case}")
                checked += 1
    dist.destroy_process_group()
    return checked


@pytest.mark.parametrize("world", [2, 4])
def test_once_rounded_half_sums(tmp_path, world):
    env = dict(SMALL_STAGING, RINGREDUCE_CUDA_HALF_ROUNDING="once")
    assert all(c == 20 for c in values(run_ranks(_once_rounded, world, tmp_path, env=env)))


def _allocator_churn(rank, world, store, conf):
    init(rank, world, store)
    torch.cuda.set_device(DEV)
    backend = torch.cuda.memory.get_allocator_backend()
    for i in range(30):
        count = 1 + (i * 7919) % 50000
        t = torch.arange(count, dtype=torch.int64, device=DEV) * (rank + 1)
        dist.all_reduce(t)
        expect = torch.arange(count, dtype=torch.int64) * (world * (world + 1) // 2)
        assert torch.equal(t.cpu(), expect), f"all_reduce #{i} n={count} under {conf}"
        del t
        torch.cuda.empty_cache()
    dist.destroy_process_group()
    return backend


@pytest.mark.parametrize("conf", ["expandable_segments:True", "backend:cudaMallocAsync"])
def test_any_allocator(tmp_path, conf):
    env = dict(SMALL_STAGING, PYTORCH_CUDA_ALLOC_CONF=conf)
    for backend in values(run_ranks(_allocator_churn, 2, tmp_path, conf, env=env)):
        if conf.startswith("backend:"):
            assert backend == "cudaMallocAsync", backend


def _empty_cache_in_flight(rank, world, store, releaser):
    init(rank, world, store)
    torch.cuda.set_device(DEV)
    total = world * (world + 1) // 2
    released = 0
    fresh = []
    for i in range(16):
        # Alternating large and small: each large tensor gets a segment of its own, which the
        # next iteration's empty_cache can return to the driver once it is dropped.
        count = (1 << 20) + i if i % 2 == 0 else 1 + (i * 7919) % 50000
        kept = torch.arange(count, dtype=torch.int64, device=DEV) * (rank + 1)
        dropped = torch.full((count,), rank + 1, dtype=torch.int64, device=DEV)
        kept_work = dist.all_reduce(kept, async_op=True)
        dist.all_reduce(dropped, async_op=True)
        del dropped  # and its Work: the collective alone must keep the memory alive
        if releaser in (rank, "every"):
            before = torch.cuda.memory_reserved(DEV)
            torch.cuda.empty_cache()
            released += before - torch.cuda.memory_reserved(DEV)
        # May reuse freed or released memory: nothing the collectives write may land here.
        fresh.append(torch.full((count,), -7, dtype=torch.int64, device=DEV))
        kept_work.wait()
        got = kept.cpu()
        assert torch.equal(got, torch.arange(count, dtype=torch.int64) * total), \
            f"all_reduce #{i} n={count}"
    dist.barrier()
    torch.cuda.synchronize()  # every collective's GPU work, the dropped tensors' too, is done
    for i, t in enumerate(fresh):
        assert bool((t.cpu() == -7).all()), \
            f"#{i}: a collective wrote into memory handed out after its tensor was dropped"
    dist.destroy_process_group()
    return released


@pytest.mark.parametrize("releaser", [0, "every"])
@pytest.mark.parametrize("world", [2, 4])
def test_empty_cache_while_collectives_are_in_flight(tmp_path, world, releaser):
    """torch.cuda.empty_cache() on one rank (or every rank) while its collectives are queued,
    one of their tensors already dropped by the caller.

    What happens (expected from the design; to be confirmed by the first GPU run): nothing
    visible. Peers never map a user tensor (each rank copies through its own staging area,
    device memory the caching allocator does not see), and each collective holds its tensors
    until it has finished, recorded on the internal stream, so empty_cache can only return
    blocks no collective uses any more. The test checks the results stay exact, that memory
    allocated after the drop is never written by a collective, and that empty_cache really
    released memory on the releasing ranks (so the test is not vacuous).
    """
    env = {"RINGREDUCE_CUDA_BUFFER_BYTES": str(1 << 20)}  # a few rounds for the large ones
    results = values(run_ranks(_empty_cache_in_flight, world, tmp_path, releaser, env=env))
    for rank, released in enumerate(results):
        if releaser in (rank, "every"):
            assert released > 0, f"rank {rank}: empty_cache never released anything"


def _killed_mid_collective(rank, world, store, victim, how):
    init(rank, world, store, timeout=FAULT_TIMEOUT)
    torch.cuda.set_device(DEV)
    t = torch.ones(1 << 20, device=DEV)
    dist.all_reduce(t)
    torch.cuda.synchronize()
    if rank == victim:
        # Queued, not finished (no synchronize before the kill): the peers may already wait for
        # GPU work that never happens.
        for _ in range(3):
            dist.all_reduce(t, async_op=True)
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(3)  # no cleanup at all, like a crash; non-zero so run_ranks sees it died
    start = time.monotonic()
    msg = "no error"
    try:
        for _ in range(100):
            dist.all_reduce(t)
    except RuntimeError as exc:
        msg = str(exc)
    elapsed = time.monotonic() - start
    # No synchronize here: this rank's stream may wait forever for the dead rank's event.
    start = time.monotonic()
    dist.destroy_process_group()
    return msg, elapsed, time.monotonic() - start


@pytest.mark.parametrize("world,victim,how", [(2, "last", "sigkill"), (4, "last", "sigkill"),
                                              (2, "first", "exit"), (4, "first", "exit")])
def test_killed_rank_fails_the_others(tmp_path, world, victim, how):
    """A rank killed (SIGKILL, or os._exit) right after queuing collectives: every other rank's
    next collective raises within the timeout, naming the dead rank."""
    victim = 0 if victim == "first" else world - 1
    results = run_ranks(_killed_mid_collective, world, tmp_path, victim, how,
                        env={"RINGREDUCE_CUDA_BUFFER_BYTES": str(1 << 20)})
    assert results[victim][0] == "died", results[victim]
    for rank in range(world):
        if rank == victim:
            continue
        status, value = results[rank]
        assert status == "ok", value
        msg, elapsed, teardown_s = value
        assert "all_reduce" in msg and f"rank {victim}" in msg, msg
        assert elapsed < FAULT_TIMEOUT + 2.0, f"took {elapsed:.1f} s: {msg}"
        assert teardown_s < 5.0, f"destroy_process_group took {teardown_s:.1f} s"
    assert not segments_of(results.pids), f"left in /dev/shm: {segments_of(results.pids)}"


def _async_wait(rank, world, store):
    init(rank, world, store)
    torch.cuda.set_device(DEV)
    t = torch.full((4099,), float(rank + 1), device=DEV)
    dist.all_reduce(t)  # the CUDA setup step, so that the timed call below only queues work
    torch.cuda.synchronize()
    cycles = sleep_cycles(2.0)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(cycles)
        t.fill_(float(rank + 2))  # behind the sleep: the collective must wait for it
        start = time.monotonic()
        work = dist.all_reduce(t, async_op=True)
        issued = time.monotonic() - start
        # torch's documented meaning for CUDA work: completed once enqueued on the GPU, whose
        # sleep still runs; is_completed() must not wait for the GPU.
        while not work.is_completed() and time.monotonic() - start < 1.0:
            time.sleep(0.001)
        enqueued_while_busy = work.is_completed() and not stream.query()
        work.wait()
        waited = time.monotonic() - start
        busy = not stream.query()
        # Queued on the caller's stream after wait(): it must see the collective's result.
        snapshot = t.clone()
    stream.synchronize()
    expect = torch.full((4099,), float(sum(r + 2 for r in range(world))))
    same = torch.equal(snapshot.cpu(), expect) and torch.equal(t.cpu(), expect)
    dist.destroy_process_group()
    return issued, waited, busy, same, enqueued_while_busy


@pytest.mark.parametrize("world", [2, 4])
def test_async_wait_orders_the_current_stream(tmp_path, world):
    for issued, waited, busy, same, enqueued in values(run_ranks(_async_wait, world, tmp_path)):
        assert issued < 0.3, f"all_reduce(async_op=True) took {issued:.2f} s to return"
        assert waited < 1.0, f"wait() blocked the host for {waited:.2f} s (GPU still sleeping)"
        assert busy, "the caller's stream was idle right after wait(): the test proves nothing"
        assert same, "work queued on the caller's stream after wait() saw a stale tensor"
        assert enqueued, "is_completed() stayed False for 1 s while the GPU slept: CUDA work " \
            "is completed once enqueued (torch's Work.is_completed)"


def _peer_aborts(rank, world, store):
    init(rank, world, store, timeout=20.0)  # a stall waiting for the aborted peer would show
    torch.cuda.set_device(DEV)
    pg = dist.group.WORLD
    t = torch.ones(1000, device=DEV)
    dist.all_reduce(t)
    torch.cuda.synchronize()
    if rank == 0:
        pg.abort()
    else:
        try:
            dist.all_reduce(t)
        except RuntimeError:
            pass
    start = time.monotonic()
    dist.destroy_process_group()
    return time.monotonic() - start


def test_teardown_does_not_wait_for_an_aborted_peer(tmp_path):
    for teardown_s in values(run_ranks(_peer_aborts, 3, tmp_path)):
        assert teardown_s < 3.0, f"destroy_process_group took {teardown_s:.1f} s"


# ---------------------------------------------------------------------------------------
# CUDA graph capture beside the backend.

def _refused_in_capture(rank, world, store):
    """Rank 0 issues its all_reduce inside a graph capture, the others outside one: rank 0's
    call is refused in its own thread, and its next all_reduce (outside the capture) meets
    the others' first one."""
    init(rank, world, store, timeout=30.0)
    torch.cuda.set_device(DEV)
    t = torch.full((4099,), float(rank + 1), device=DEV)
    dist.all_reduce(t)  # the CUDA setup step
    torch.cuda.synchronize()
    t.fill_(float(rank + 1))
    refusal = ""
    if rank == 0:
        graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        try:
            with torch.cuda.graph(graph, stream=side):
                dist.all_reduce(t)
        except RuntimeError as exc:
            refusal = str(exc)
    dist.all_reduce(t)
    got = t.cpu()
    dist.destroy_process_group()
    return refusal, torch.equal(got, torch.full((4099,), float(sum(range(1, world + 1)))))


def test_collective_refused_in_graph_capture_leaves_the_group_usable(tmp_path):
    results = values(run_ranks(_refused_in_capture, 2, tmp_path))
    refusal, same = results[0]
    assert "capturing a CUDA graph" in refusal and "still usable" in refusal, refusal
    assert all(ok for _, ok in results), "the all_reduce after the refused one is wrong"
    assert results[1][0] == ""


def _capture_beside_inflight(rank, world, store):
    """A graph captured (global mode, torch's default) while a collective's GPU work is in
    flight, so that the backend's watchdog polls its end event during the capture: the capture
    must stay valid, and the collective correct."""
    init(rank, world, store, timeout=30.0)
    torch.cuda.set_device(DEV)
    t = torch.full((4099,), float(rank + 1), device=DEV)
    dist.all_reduce(t)
    torch.cuda.synchronize()
    cycles = sleep_cycles(1.5)
    t.fill_(float(rank + 1))
    torch.cuda._sleep(cycles)  # the collective's GPU work waits behind this
    work = dist.all_reduce(t, async_op=True)
    x = torch.arange(1000.0, device=DEV)
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    error = ""
    try:
        with torch.cuda.graph(graph, stream=side):
            y = x * 2
            time.sleep(0.4)  # the watchdog polls every 50 ms: several polls during the capture
    except RuntimeError as exc:
        error = str(exc)
    replayed = False
    if not error:
        graph.replay()
        torch.cuda.synchronize()
        replayed = torch.equal(y.cpu(), torch.arange(1000.0) * 2)
    work.wait()
    same = torch.equal(t.cpu(), torch.full((4099,), float(sum(range(1, world + 1)))))
    dist.destroy_process_group()
    return error, replayed, same


def test_capture_beside_collectives_in_flight(tmp_path):
    for error, replayed, same in values(run_ranks(_capture_beside_inflight, 2, tmp_path)):
        assert error == "", f"the capture failed beside a collective in flight: {error}"
        assert replayed, "the captured graph replayed a wrong result"
        assert same, "the collective in flight during the capture is wrong"
