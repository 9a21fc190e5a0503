"""The backend's asynchronous engine: one progress thread per group, Work objects, overlap with
DDP's backward, faults in and around the engine, and a soak (CPU, spawned ranks)."""
import array
import datetime
import os
import signal
import sys
import time

import pytest
import torch
import torch.distributed as dist

from checks import (anon_rss_kib, fd_count, heap_bytes, segments_of, thread_count,
                    thread_names)
from test_distributed import CALLER_RUNS_0, FAULT_TIMEOUT, init, run_ranks, values


def _delayed_peer(rank, world, store):
    init(rank, world, store)
    dist.barrier()
    t = torch.arange(1000, dtype=torch.float64) * (rank + 1)
    if rank == 1:
        time.sleep(1.0)
    start = time.monotonic()
    work = dist.all_reduce(t, async_op=True)
    issued = time.monotonic() - start
    pending = not work.is_completed()
    # Issue order: a broadcast and an all_gather queued behind the pending all_reduce.
    b = torch.full((5,), float(rank + 7))
    w2 = dist.broadcast(b, src=1, async_op=True)
    outs = [torch.full((3,), -1.0) for _ in range(world)]
    w3 = dist.all_gather(outs, torch.full((3,), float(rank)), async_op=True)
    w3.wait()
    done = [work.is_completed(), w2.is_completed(), w3.is_completed()]
    ok = torch.equal(t, torch.arange(1000, dtype=torch.float64) * 3)
    fut_value = work.get_future().wait()
    same_tensor = fut_value[0] is t
    work.wait()  # again: no error, no change
    result = (issued, pending, done, ok, torch.equal(b, torch.full((5,), 8.0)),
              [float(o[0]) for o in outs], same_tensor, work.is_success())
    dist.destroy_process_group()
    return result


def test_work_pending_while_peer_delayed_then_correct(tmp_path):
    for rank, (issued, pending, done, ok, bcast, gathered, same, success) in enumerate(
            values(run_ranks(_delayed_peer, 2, tmp_path))):
        assert issued < 0.5, f"rank {rank}: the call took {issued:.2f} s to return"
        if rank == 0:
            assert pending, "the Work was complete right after the call while rank 1 slept"
        assert done == [True, True, True], "collectives finished out of issue order"
        assert ok and bcast and gathered == [0.0, 1.0]
        assert same and success


def _sync_mode(rank, world, store):
    init(rank, world, store)
    dist.barrier()
    t = torch.ones(10)
    if rank == 1:
        time.sleep(1.0)
    start = time.monotonic()
    work = dist.all_reduce(t, async_op=True)
    issued = time.monotonic() - start
    completed = work.is_completed()
    dist.destroy_process_group()
    return issued, completed, float(t[0])


def test_sync_mode_runs_inline(tmp_path):
    """RINGREDUCE_ASYNC=0 keeps the old behaviour: done when the call returns."""
    issued, completed, value = values(run_ranks(_sync_mode, 2, tmp_path,
                                                env={"RINGREDUCE_ASYNC": "0"}))[0]
    assert completed and value == 2.0
    assert issued > 0.5, "rank 0 did not wait for rank 1 inside the call"


def _who_runs(rank, world, store):
    import ringreduce.distributed
    init(rank, world, store)
    t = torch.ones(10)
    for _ in range(3):
        dist.all_reduce(t)  # synchronous, nothing queued before it
    works = [dist.all_reduce(t, async_op=True) for _ in range(3)]
    for w in works:
        w.wait()
    ran = ringreduce.distributed.backend_of().ran_by_callers
    dist.destroy_process_group()
    return ran, float(t[0])


@pytest.mark.parametrize("env,by_callers", [(None, True), (CALLER_RUNS_0, False)],
                         ids=["default", "caller_runs0"])
def test_caller_runs_knob_sends_every_collective_through_the_progress_thread(tmp_path, env,
                                                                             by_callers):
    """By default a synchronous CPU collective with nothing queued before it runs in the
    caller's thread; RINGREDUCE_CALLER_RUNS=0 sends it (and every Work.wait) through the
    progress thread, as every CUDA collective goes, so the fault tests can take that path."""
    for ran, value in values(run_ranks(_who_runs, 2, tmp_path, env=env)):
        assert value == 64.0
        if by_callers:
            assert ran >= 3, ran
        else:
            assert ran == 0, ran


def _callback_outlives_group(rank, world, store):
    import threading
    init(rank, world, store)
    # Rank 0's all_reduce cannot complete before rank 1 has joined it, and rank 1 joins only
    # once rank 0 has chained its callback: so the callback runs on rank 0's completion thread.
    # (A future already complete when `then` is called runs the callback at once in the caller:
    # what the ranks did before this handshake, now and then, when the collective finished
    # first.) Rank 1 only takes part.
    handshake = dist.FileStore(f"{store}-handshake", world)
    if rank == 1:
        handshake.wait(["chained"], datetime.timedelta(seconds=30))
        t = torch.ones(4)
        dist.all_reduce(t)
        assert torch.equal(t, torch.full((4,), 2.0)), t
        dist.destroy_process_group()
        return None
    entered, release = threading.Event(), threading.Event()
    ran_on = []

    def slow(fut):
        ran_on.append(threading.get_native_id())
        entered.set()
        release.wait(20)
        return fut.value()[0]

    work = dist.all_reduce(torch.ones(4), async_op=True)
    chained = work.get_future().then(slow)
    del work  # the completion thread's task now holds the only Work, and through it the group
    handshake.set("chained", "1")
    assert entered.wait(20)
    (tid,) = ran_on
    assert tid != threading.get_native_id(), "the callback ran in the caller"
    start = time.monotonic()
    dist.destroy_process_group()  # its completion thread is inside `slow`: left detached
    shut = time.monotonic() - start
    named = thread_names()  # the detached completion thread among them
    release.set()
    value = chained.wait()
    # The task ends, dropping the last reference to the group from inside the completion
    # thread, which must then leave at once (it used to wait 5 s for itself in the group's
    # destructor, then lock the freed group's mutex). Watched by its id: other threads may
    # come meanwhile (numpy's BLAS pool starts when numpy is first used).
    start = time.monotonic()
    while os.path.exists(f"/proc/self/task/{tid}") and time.monotonic() - start < 3.0:
        time.sleep(0.01)
    left = time.monotonic() - start
    seen = f"then {sorted(named.items())}, now {sorted(thread_names().items())}"
    time.sleep(0.5)
    return shut, float(value[0]), left, tid in named, seen


def test_completion_thread_outlives_its_group(tmp_path):
    """A future callback still running when the group is destroyed: destroy_process_group
    returns after the completer's 2 s grace, and the detached completion thread that then
    drops the last reference to the group keeps the state it uses alive and leaves at once.
    With the completion state owned by the group, the thread waited 5 s for itself in the
    group's destructor (this failed: still there after 3 s), then used the freed group
    (scripts/sanitize.sh also runs this test under AddressSanitizer)."""
    rank0, rank1 = values(run_ranks(_callback_outlives_group, 2, tmp_path))
    assert rank1 is None
    shut, value, left, counted, seen = rank0
    assert value == 2.0
    assert shut < 4.0, f"destroy_process_group took {shut:.1f} s"
    assert counted, f"the completion thread was gone before its task ended; threads {seen}"
    assert left < 2.0, (f"the completion thread was still there {left:.1f} s after its "
                        f"task; threads {seen}")


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps: the first layer of the model, so its backward is the
    last thing backward does."""

    @staticmethod
    def forward(ctx, x, seconds, log):
        ctx.seconds, ctx.log = seconds, log
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        ctx.log["backward_end"] = time.monotonic()
        return grad, None, None


def _ddp_overlap(rank, world, store):
    init(rank, world, store)
    log = {"inside": [], "done": []}

    def timed(_, bucket):
        # DDP's default all-reduce, timed: how long backward spends inside the call.
        start = time.monotonic()
        work = dist.all_reduce(bucket.buffer(), async_op=True)
        log["inside"].append(time.monotonic() - start)
        fut = work.get_future()
        fut.then(lambda _: log["done"].append(time.monotonic()))
        return fut.then(lambda f: f.value()[0].div_(world))

    torch.manual_seed(0)
    body = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
    ddp = torch.nn.parallel.DistributedDataParallel(body, bucket_cap_mb=0.01)
    ddp.register_comm_hook(None, timed)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(rank))
    results = []
    for step in range(3):
        log["inside"].clear()
        log["done"].clear()
        dist.barrier()
        # (After the forward: DDP's forward may itself communicate, e.g. when it rebuilds
        # its buckets after the first step.)
        out = ddp(_SlowBackward.apply(x.requires_grad_(), 0.6 if rank == 0 else 0.0, log))
        if rank == 1:
            time.sleep(0.3)  # rank 0's all-reduces wait for this rank
        out.square().sum().backward()
        results.append((sum(log["inside"]), len(log["done"]),
                        sum(d < log["backward_end"] for d in log["done"])))
    grads = [p.grad.clone() for p in body.parameters()]
    everyone = [None] * world
    dist.all_gather_object(everyone, [g.double().sum().item() for g in grads])
    dist.destroy_process_group()
    return results, everyone


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_ddp_overlaps_allreduce_with_backward(tmp_path, mode):
    """Rank 0's all-reduces of the late layers' buckets wait 0.3 s for rank 1. With the engine
    they run while rank 0's backward goes on (0.6 s more of it): the calls return at once and
    the all-reduces finish before backward does. Run inline (RINGREDUCE_ASYNC=0), the backward
    thread itself waits those 0.3 s."""
    env = {"RINGREDUCE_ASYNC": "0" if mode == "sync" else "1"}
    (results, everyone), (_, everyone1) = values(run_ranks(_ddp_overlap, 2, tmp_path, env=env))
    assert everyone == everyone1 and everyone[0] == everyone[1], "replicas' gradients differ"
    inside, ndone, before_end = results[-1]
    assert ndone >= 3, f"only {ndone} all-reduces (buckets) seen"
    if mode == "async":
        assert inside < 0.15, f"backward spent {inside:.2f} s inside allreduce() calls"
        assert before_end >= ndone - 1, (
            f"only {before_end} of {ndone} all-reduces finished before backward ended")
    else:
        assert inside > 0.25, f"inline mode spent only {inside:.2f} s inside allreduce()"


def _wait_each(works):
    """wait() on each Work: None where it succeeded, else the error's message."""
    out = []
    for w in works:
        try:
            w.wait()
            out.append(None)
        except RuntimeError as exc:
            out.append(str(exc))
    return out


def _engine_error(rank, world, store):
    init(rank, world, store, timeout=60.0)
    dist.all_reduce(torch.ones(4))
    # The first collective fails inside the engine: the ranks disagree on its size, which the
    # executor finds once both have started it (the arguments themselves are valid).
    start = time.monotonic()
    works = [dist.all_reduce(torch.ones(4 + rank), async_op=True)]
    works += [dist.all_reduce(torch.ones(4), async_op=True) for _ in range(2)]
    errors = _wait_each(works)
    elapsed = time.monotonic() - start
    try:
        dist.broadcast(torch.ones(2), src=0)
        errors.append(None)
    except RuntimeError as exc:
        errors.append(str(exc))
    shut = time.monotonic()
    dist.destroy_process_group()
    return errors, elapsed, time.monotonic() - shut


@pytest.mark.parametrize("env", [None, CALLER_RUNS_0], ids=["default", "caller_runs0"])
def test_error_in_engine_fails_the_group_and_peers_fast(tmp_path, env):
    results = run_ranks(_engine_error, 2, tmp_path, env=env)
    (e0, t0, s0), (e1, t1, s1) = values(results)
    assert not segments_of(results.pids), f"left in /dev/shm: {segments_of(results.pids)}"
    for errors in (e0, e1):
        assert errors[0] and "disagree" in errors[0], errors
        assert all(e and "failed earlier" in e for e in errors[1:]), errors
    assert t0 < 5.0 and t1 < 5.0, f"took {t0:.1f} / {t1:.1f} s with a 60 s timeout"
    assert s0 < 5.0 and s1 < 5.0


def _bad_arguments(rank, world, store):
    init(rank, world, store)
    errors = []
    t = torch.ones(4, dtype=torch.int16)
    for call in (lambda: dist.all_reduce(t),
                 lambda: dist.broadcast(torch.ones(2), src=world + 3),
                 lambda: dist.all_gather([torch.ones(2)] * world, torch.ones(3))):
        try:
            call()
            errors.append(None)
        except (ValueError, TypeError, RuntimeError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    x = torch.ones(3)
    dist.all_reduce(x)  # the group still works: nothing was queued
    dist.destroy_process_group()
    return errors, float(x[0])


def test_bad_arguments_raise_in_the_caller_and_leave_the_group_usable(tmp_path):
    for errors, value in values(run_ranks(_bad_arguments, 2, tmp_path)):
        assert errors[0].startswith("TypeError") and "dtype" in errors[0], errors[0]
        assert errors[1].startswith("ValueError") and "broadcast: root must be in [0, 2)" in \
            errors[1], errors[1]
        assert "output" in errors[2], errors[2]
        assert value == 2.0


def _abort_queued(rank, world, store):
    init(rank, world, store, timeout=60.0)
    pg = dist.group.WORLD
    dist.barrier()
    if rank == 1:
        time.sleep(4.0)  # never joins the queued collectives in time
        try:
            dist.all_reduce(torch.ones(2))
            return ("no error", 0.0, 0.0)
        except RuntimeError as exc:
            return (str(exc), 0.0, 0.0)
    works = [dist.all_reduce(torch.ones(8), async_op=True) for _ in range(5)]
    time.sleep(0.3)
    start = time.monotonic()
    pg.abort()
    messages = _wait_each(works)
    waited = time.monotonic() - start
    start = time.monotonic()
    dist.destroy_process_group()
    return (messages, waited, time.monotonic() - start)


def test_abort_fails_queued_work_and_shutdown_returns(tmp_path):
    results = run_ranks(_abort_queued, 2, tmp_path)
    (messages, waited, shut), (peer_msg, _, _) = values(results)
    assert not segments_of(results.pids), f"left in /dev/shm: {segments_of(results.pids)}"
    assert all(m and "abort" in m for m in messages), messages
    assert waited < 2.0 and shut < 2.0, f"abort took {waited:.1f} s, shutdown {shut:.1f} s"
    assert "rank 0" in peer_msg, peer_msg


def _killed_during_async(rank, world, store):
    init(rank, world, store, timeout=FAULT_TIMEOUT)
    dist.barrier()
    if rank == world - 1:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    works = [dist.all_reduce(torch.ones(100), async_op=True) for _ in range(3)]
    start = time.monotonic()
    return _wait_each(works), time.monotonic() - start


def test_dead_peer_fails_every_queued_work_on_every_survivor(tmp_path):
    world = 3
    results = run_ranks(_killed_during_async, world, tmp_path)
    assert results[world - 1][0] == "died"
    for rank in range(world - 1):
        status, (messages, elapsed) = results[rank]
        assert status == "ok"
        first = messages[0]
        assert first and "all_reduce" in first and f"rank {world - 1}" in first, first
        # died, not timed out: FAULT_TIMEOUT is longer than the 2 s bound below
        assert "exited" in first and "timed out" not in first, first
        assert all(m for m in messages[1:]), messages
        assert elapsed < 2.0, f"rank {rank} noticed the dead peer after {elapsed:.1f} s"
    assert not segments_of(results.pids), f"left in /dev/shm: {segments_of(results.pids)}"


def _exchange(rank, sent, got, group):
    """A send and a receive between the two ranks of `group` (None: the world)."""
    peer = 1 - rank
    if rank == 0:
        dist.send(sent, peer, group=group)
        dist.recv(got, peer, group=group)
    else:
        dist.recv(got, peer, group=group)
        dist.send(sent, peer, group=group)


def _memory_sample():
    """(resident anonymous KiB, malloc'd bytes in use or -1, Python's allocated blocks, fds)."""
    heap = heap_bytes()
    return anon_rss_kib(), -1 if heap is None else heap, sys.getallocatedblocks(), fd_count()


def _soak(rank, world, store, rounds, every):
    """Two groups, the world and one from new_group. Each of `rounds` rounds: 8 async
    all-reduces then a wait and a broadcast on the world, an all-reduce on the other group, and a
    send/recv pair on each group. Returns the _memory_sample()s taken every `every` rounds and at
    the end (into a preallocated array, so that sampling allocates nothing that stays), the
    process's threads (/proc/self/task: C++ threads too) before and after the first
    point-to-point call on each group, threads and fds before init_process_group and after
    destroy_process_group, and a final all-reduce's value."""
    before = (thread_count(), fd_count())
    init(rank, world, store)
    sub = dist.new_group(backend="ringreduce")
    t, got = torch.ones(64), torch.zeros(64)
    for group in (None, sub):
        dist.all_reduce(t, group=group)
    p2p_threads = [thread_count()]
    for group in (None, sub):
        _exchange(rank, t, got, group)
    p2p_threads.append(thread_count())
    fields = len(_memory_sample())
    samples = array.array("q", bytes(8 * fields * (rounds // every + 1)))
    taken = 0
    for i in range(rounds):
        if i % every == 0:
            samples[taken * fields:(taken + 1) * fields] = array.array("q", _memory_sample())
            taken += 1
        works = [dist.all_reduce(t, async_op=True) for _ in range(8)]
        for w in works:
            w.wait()
        dist.broadcast(t, src=i % world)
        dist.all_reduce(t, group=sub)
        for group in (None, sub):
            _exchange(rank, t, got, group)
    samples[taken * fields:] = array.array("q", _memory_sample())
    t.fill_(1.0)
    dist.all_reduce(t)
    dist.destroy_process_group()
    rows = [tuple(samples[k:k + fields]) for k in range(0, len(samples), fields)]
    return rows, p2p_threads, before, (thread_count(), fd_count()), float(t[0])


# 5,000 rounds of 10 collectives and 4 point-to-point operations; 11 samples (10 in the loop,
# one after), the first before the warm-up rounds (allocator, import, first-use caches).
SOAK_ROUNDS, SOAK_EVERY = 5000, 500
# Allowed growth from the second sample to the last, over 4,500 rounds. Measured on the 2-core
# CI machine (torch 2.13): the heap within 9 KiB, RssAnon 16 KiB, Python's blocks 7. So
# 100 bytes kept by any one operation of a round (450,000 bytes) fails the heap bound, as does
# one Python object kept per round the block bound.
SOAK_HEAP_BYTES = 64 << 10
SOAK_ANON_KIB = 512
SOAK_PY_BLOCKS = 100


@pytest.mark.timeout(120)
def test_soak_flat_memory_descriptors_and_threads(tmp_path):
    """50,000 collectives and 20,000 point-to-point operations on two groups: after warm-up the
    malloc heap, anonymous memory and Python's allocated blocks stay within the bounds above
    and open fds do not change; destroy_process_group leaves as many threads and open fds as
    there were before init_process_group, the groups' point-to-point threads included."""
    for rank, (samples, p2p_threads, before, after, value) in enumerate(
            values(run_ranks(_soak, 2, tmp_path, SOAK_ROUNDS, SOAK_EVERY))):
        print(f"rank {rank}: samples (anon KiB, heap B, py blocks, fds) {samples}")
        assert value == 2.0
        assert len(samples) == SOAK_ROUNDS // SOAK_EVERY + 1, samples
        assert p2p_threads[1] >= p2p_threads[0] + 2, (
            f"the first send/recv on each of two groups took the threads from {p2p_threads[0]} "
            f"to {p2p_threads[1]}: not one point-to-point thread per group (distributed.py) "
            "started, so the soak cannot see one leak")
        assert after[0] == before[0], f"{after[0]} threads after destroy, {before[0]} before init"
        assert after[1] == before[1], f"{after[1]} open fds after destroy, {before[1]} before init"
        steady = samples[1:]
        assert len({s[3] for s in steady}) == 1, f"open fds changed: {samples}"
        anon, heap, blocks = (max(s[k] for s in steady) - steady[0][k] for k in range(3))
        assert anon < SOAK_ANON_KIB, f"anonymous memory grew by {anon} KiB: {samples}"
        assert steady[0][1] < 0 or heap < SOAK_HEAP_BYTES, f"the heap grew by {heap} B: {samples}"
        assert blocks < SOAK_PY_BLOCKS, f"Python's blocks grew by {blocks}: {samples}"


def _groups(rank, world, store):
    init(rank, world, store)
    names = [dist.group.WORLD.group_name]
    sub = dist.new_group(ranks=list(range(world)), backend="ringreduce", group_desc="mine")
    names.append(sub.group_name)
    desc = sub.group_desc
    import torch.distributed._functional_collectives as fc
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    x = fc.all_reduce(torch.full((4,), float(rank + 1)), "sum", mesh)
    y = fc.all_reduce(torch.full((2,), float(rank)), "max", sub)
    value = (x.wait() if hasattr(x, "wait") else x).tolist()
    value2 = (y.wait() if hasattr(y, "wait") else y).tolist()
    mesh_pg = mesh.get_group()
    dist.destroy_process_group()
    return names, desc, value, value2, type(mesh_pg).__name__


def test_group_names_device_mesh_and_functional_collectives(tmp_path):
    out = values(run_ranks(_groups, 2, tmp_path))
    for names, desc, value, value2, mesh_type in out:
        assert all(isinstance(n, str) and n for n in names) and names[0] != names[1], names
        assert desc == "mine"
        assert value == [3.0] * 4 and value2 == [1.0, 1.0]
        assert mesh_type == "ProcessGroup"
    assert out[0][0] == out[1][0], "ranks disagree on group names"
