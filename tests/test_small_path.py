"""The one-round small-message all-reduce on CPU (csrc/multiprocess/cpu_collectives.cpp), through
the "ringreduce" torch.distributed backend with real processes.

- Exact results for every dtype x op x world size 1-4 x sizes (0, 1, odd, around the threshold)
  against ``ring_model`` (each ring chunk reduced in the order c, c+1, ..., c-1; for tensors of
  less than 16 bytes that is rank order 0..N-1), bit for bit, and equal to the ring's own result
  (a group with RINGREDUCE_SMALL_BYTES=0): the threshold changes the path, never the bits.
- RINGREDUCE_SMALL_BYTES switches paths: a mismatch message names the small-message path
  exactly for the sizes at or below the threshold.
- Interleaving: many back-to-back collectives of random kinds and sizes (small and ring
  all-reduces, broadcast, all_gather, reduce_scatter, barrier), queued asynchronously, with
  random sleeps on some rank, checked exactly (integers and small-integer float64).
- Mismatched arguments (count, dtype, op, collective, small vs ring) fail at once, with both
  ranks' descriptors in the message; bad or differing settings refuse to form the group.

Each test spawns its ranks once and runs every check inside them; new groups (dist.new_group)
pick up a changed RINGREDUCE_SMALL_BYTES, since the backend reads it when it creates a group.
"""
import ctypes
import datetime
import os
import random
import resource
import struct
import threading
import time

import pytest
import torch
import torch.distributed as dist

from reference import ALL_DTYPES, random_inputs, ring_model, valid_ops
from test_distributed import init, run_ranks, values

DEFAULT_SMALL_BYTES = 32 << 10  # host_group.cpp kDefaultSmallBytes
MARK = "small-message path"     # what a descriptor of the one-round path says
TORCH_OPS = {"prod": "PRODUCT"}


def _op(name):
    return getattr(dist.ReduceOp, TORCH_OPS.get(name, name.upper()))


def _group(small_bytes, timeout=30.0):
    """A new group over every rank created with RINGREDUCE_SMALL_BYTES=small_bytes (None:
    unset, the default)."""
    if small_bytes is None:
        os.environ.pop("RINGREDUCE_SMALL_BYTES", None)
    else:
        os.environ["RINGREDUCE_SMALL_BYTES"] = str(small_bytes)
    try:
        return dist.new_group(backend="ringreduce",
                              timeout=datetime.timedelta(seconds=timeout))
    finally:
        os.environ.pop("RINGREDUCE_SMALL_BYTES", None)


# ---------------------------------------------------------------------------------------
# Exact results

SMALL_T = 96  # bytes: a threshold that cuts every dtype's sizes in a few elements
INLINE_BYTES = 8  # host_group.h kInlineSmallBytes: data in the slot head's cache line


def _counts(esize, threshold):
    """0, 1, odd sizes, the sizes just around `threshold` bytes, and the last in the slot
    head's line and the first after it."""
    edge = threshold // esize
    inline = INLINE_BYTES // esize
    return sorted({0, 1, 3, 7, 33, max(0, edge - 1), edge, edge + 1, inline, inline + 1})


def _exact_sweep(rank, world, store):
    init(rank, world, store)
    groups = {"default": _group(None), "t96": _group(SMALL_T), "ring": _group(0)}
    checked = 0
    for dtype in ALL_DTYPES:
        esize = torch.empty((), dtype=dtype).element_size()
        counts = sorted(set(_counts(esize, SMALL_T)) | set(_counts(esize, DEFAULT_SMALL_BYTES)))
        for op in valid_ops(dtype):
            for count in counts:
                g = torch.Generator().manual_seed(7000 + checked)
                inputs = random_inputs(world, count, dtype, op, generator=g)
                expect = ring_model(inputs, op)
                got = {}
                for name, group in groups.items():
                    t = inputs[rank].clone()
                    dist.all_reduce(t, op=_op(op), group=group)
                    got[name] = t
                for name, t in got.items():
                    assert torch.equal(t, expect), (
                        f"world {world} rank {rank} {dtype} {op} count={count} group {name}: "
                        f"differs from the ring-order reference")
                checked += 1
    dist.destroy_process_group()
    return checked


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_exact_every_dtype_op_size(tmp_path, world):
    counts = values(run_ranks(_exact_sweep, world, tmp_path))
    assert len(set(counts)) == 1 and counts[0] > 500, counts


# ---------------------------------------------------------------------------------------
# The threshold switches paths

def _path_probe(rank, world, store, settings):
    """For each (small_bytes, nbytes): which path a float32 all_reduce of nbytes took, read
    from the mismatch message (rank 1 passes one element more)."""
    init(rank, world, store, timeout=10.0)
    seen = []
    for small_bytes, nbytes in settings:
        group = _group(small_bytes, timeout=10.0)
        t = torch.ones(nbytes // 4 + (1 if rank == 1 else 0))
        try:
            dist.all_reduce(t, group=group)
            seen.append("no error")
        except RuntimeError as exc:
            seen.append(str(exc))
    dist.destroy_process_group()
    return seen


def test_threshold_env_switches_paths(tmp_path):
    # The mismatched sizes straddle no threshold: both ranks take the same path. Rank 0's
    # descriptor says which; a rank that sees the mismatch first reports both descriptors, a
    # rank that only sees its peer fail quotes the peer's message.
    settings = [(None, 8), (None, DEFAULT_SMALL_BYTES - 4), (None, DEFAULT_SMALL_BYTES + 4),
                (0, 8), (0, 1024), (1024, 1020), (1024, 1028), (4096, 1028)]
    small = [True, True, False, False, False, True, False, True]
    for rank, seen in enumerate(values(run_ranks(_path_probe, 2, tmp_path, settings))):
        for (small_bytes, nbytes), want, msg in zip(settings, small, seen):
            assert "disagree" in msg, (rank, small_bytes, nbytes, msg)
            assert (MARK in msg) == want, (rank, small_bytes, nbytes, msg)


# ---------------------------------------------------------------------------------------
# Interleaving stress

STRESS_T = 512  # bytes: small below, ring above, both cheap


def _stress(rank, world, store, calls, seed):
    init(rank, world, store, timeout=60.0)
    group = _group(STRESS_T, timeout=60.0)
    rng = random.Random(seed)  # the same sequence on every rank
    pending = []  # (work, check)
    done = 0

    def settle(limit):
        nonlocal done
        while len(pending) > limit:
            work, check = pending.pop(0)
            work.wait()
            check()
            done += 1

    for i in range(calls):
        kind = rng.choice(["small", "small", "small", "ring", "broadcast", "all_gather",
                           "reduce_scatter", "barrier"])
        dtype = rng.choice([torch.int64, torch.float64, torch.int32])
        esize = torch.empty((), dtype=dtype).element_size()
        if kind == "small":
            count = rng.randint(0, STRESS_T // esize)
        else:
            count = rng.randint(STRESS_T // esize + 1, 3 * STRESS_T // esize)
        base = [rng.randint(-1000, 1000) for _ in range(world)]
        sleeper, nap = rng.randrange(world), rng.choice([0, 0, 0, 1e-5, 1e-4, 1e-3])
        if rank == sleeper and nap:
            time.sleep(nap)

        def row(r, n=count):
            return torch.arange(n, dtype=torch.int64) * (r + 1) + base[r]

        if kind in ("small", "ring"):
            op = rng.choice(["sum", "max", "min", "bxor"] if dtype != torch.float64
                            else ["sum", "max", "min"])
            t = row(rank).to(dtype)
            rows = torch.stack([row(r) for r in range(world)]) if count else None
            if count == 0:
                expect = t.clone()
            elif op == "sum":
                expect = rows.sum(0).to(dtype)
            elif op == "max":
                expect = rows.max(0).values.to(dtype)
            elif op == "min":
                expect = rows.min(0).values.to(dtype)
            else:
                expect = rows[0].to(dtype)
                for r in range(1, world):
                    expect = expect ^ rows[r].to(dtype)
            work = dist.all_reduce(t, op=_op(op), group=group, async_op=True)

            def check(t=t, expect=expect, i=i, kind=kind, op=op):
                assert torch.equal(t, expect), f"call {i}: {kind} all_reduce {op} {t.dtype}"
        elif kind == "broadcast":
            root = rng.randrange(world)
            t = row(rank).to(dtype)
            expect = row(root).to(dtype)
            work = dist.broadcast(t, src=root, group=group, async_op=True)

            def check(t=t, expect=expect, i=i):
                assert torch.equal(t, expect), f"call {i}: broadcast"
        elif kind == "all_gather":
            t = row(rank).to(dtype)
            outs = [torch.empty_like(t) for _ in range(world)]
            expect = [row(r).to(dtype) for r in range(world)]
            work = dist.all_gather(outs, t, group=group, async_op=True)

            def check(outs=outs, expect=expect, i=i):
                for r in range(world):
                    assert torch.equal(outs[r], expect[r]), f"call {i}: all_gather"
        elif kind == "reduce_scatter":
            per = max(1, count // world)
            full = [row(r, per * world).to(dtype) for r in range(world)]
            out = torch.empty(per, dtype=dtype)
            expect = sum(f.to(torch.int64) for f in full)[rank * per:(rank + 1) * per].to(dtype)
            work = dist.reduce_scatter_tensor(out, full[rank], group=group, async_op=True)

            def check(out=out, expect=expect, i=i):
                assert torch.equal(out, expect), f"call {i}: reduce_scatter"
        else:
            work = dist.barrier(group=group, async_op=True)

            def check():
                pass
        pending.append((work, check))
        settle(rng.choice([0, 4, 16]))
    settle(0)
    dist.destroy_process_group()
    return done


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_interleaved_small_and_ring_collectives(tmp_path, world):
    calls = {2: 3000, 3: 2000, 4: 1500}[world]
    done = values(run_ranks(_stress, world, tmp_path, calls, 1234 + world))
    assert done == [calls] * world


# ---------------------------------------------------------------------------------------
# Mismatches and settings

FAULT_TIMEOUT = 6.0


def _mismatch(rank, world, store):
    init(rank, world, store, timeout=FAULT_TIMEOUT)
    messages = []
    big = DEFAULT_SMALL_BYTES  # floats: 4x the threshold, the ring
    for case in ("count", "dtype", "op", "collective", "small vs ring", "ring vs small"):
        group = _group(None, timeout=FAULT_TIMEOUT)
        count = 10
        if case == "count" and rank == 1:
            count = 11
        if case == "small vs ring" and rank == 1 or case == "ring vs small" and rank == 0:
            count = big
        dtype = torch.float64 if case == "dtype" and rank == 1 else torch.float32
        op = dist.ReduceOp.MAX if case == "op" and rank == 1 else dist.ReduceOp.SUM
        t = torch.ones(count, dtype=dtype)
        start = time.monotonic()
        try:
            if case == "collective" and rank == 1:
                dist.broadcast(t, src=0, group=group)
            else:
                dist.all_reduce(t, op=op, group=group)
            messages.append((case, None, 0.0))
        except RuntimeError as exc:
            messages.append((case, str(exc), time.monotonic() - start))
    dist.destroy_process_group()
    return messages


def test_mismatches_fail_at_once_naming_both_sides(tmp_path):
    per_rank = values(run_ranks(_mismatch, 2, tmp_path))
    for rank, messages in enumerate(per_rank):
        for case, msg, elapsed in messages:
            assert msg is not None, f"rank {rank}: {case} mismatch was not detected"
            assert elapsed < FAULT_TIMEOUT / 2, (case, elapsed, msg)
            assert "disagree" in msg or "failed while this rank waited" in msg, msg
    for i, case in enumerate(("count", "dtype", "op", "collective", "small vs ring",
                              "ring vs small")):
        text = " ".join(per_rank[r][i][1] for r in range(2))
        want = {"count": ["count=10 ", "count=11 "],
                "dtype": ["dtype=float32", "dtype=float64"],
                "op": ["op=sum", "op=max"],
                "collective": ["broadcast", "all_reduce"],
                "small vs ring": ["count=10 ", f"count={DEFAULT_SMALL_BYTES} ", MARK],
                "ring vs small": ["count=10 ", f"count={DEFAULT_SMALL_BYTES} ", MARK]}[case]
        for w in want:
            assert w in text, (case, w, text)


def _bad_setting(rank, world, store, small_bytes, name="RINGREDUCE_SMALL_BYTES"):
    if small_bytes[rank] is not None:
        os.environ[name] = small_bytes[rank]
    try:
        init(rank, world, store, timeout=10.0)
        dist.all_reduce(torch.ones(3))
        return "no error"
    except Exception as exc:  # noqa: B902
        return f"{type(exc).__name__}: {exc}"


def test_bad_or_differing_settings_refuse_the_group(tmp_path):
    for setting in ("abc", "-1", str(1 << 30)):
        msg = values(run_ranks(_bad_setting, 1, tmp_path, [setting]))[0]
        assert "RINGREDUCE_SMALL_BYTES must be" in msg and repr(setting) in msg.replace(
            '"', "'"), msg
    msg = values(run_ranks(_bad_setting, 1, tmp_path, ["1e3"], "RINGREDUCE_SPIN_US"))[0]
    assert "RINGREDUCE_SPIN_US must be a number of microseconds" in msg, msg
    msg = values(run_ranks(_bad_setting, 1, tmp_path, ["2"], "RINGREDUCE_SPIN_YIELD"))[0]
    assert "RINGREDUCE_SPIN_YIELD must be 0 or 1" in msg and "'2'" in msg, msg
    msg = values(run_ranks(_bad_setting, 1, tmp_path, ["1M"], "RINGREDUCE_SHARED_CORE_BYTES"))[0]
    assert "RINGREDUCE_SHARED_CORE_BYTES must be a number of bytes" in msg and "'1M'" in msg, msg
    msg = values(run_ranks(_bad_setting, 1, tmp_path, ["0.1"], "RINGREDUCE_SLICE_US"))[0]
    assert "RINGREDUCE_SLICE_US must be a number of microseconds" in msg and "'0.1'" in msg, msg
    # The first rank to map a peer's segment names the setting and gives up, which removes its
    # own segment: the other rank may then fail to open that one instead.
    msgs = values(run_ranks(_bad_setting, 2, tmp_path, ["0", None]))
    assert "no error" not in msgs, msgs
    assert any(f"RINGREDUCE_SMALL_BYTES {DEFAULT_SMALL_BYTES} on rank 1 but 0 here" in m or
               f"RINGREDUCE_SMALL_BYTES 0 on rank 0 but {DEFAULT_SMALL_BYTES} here" in m for m in msgs), msgs


# ---------------------------------------------------------------------------------------
# Two ranks on one core

def _one_core(rank, world, store, seed):
    """Every rank pinned to the same CPU, with a 1 ms spin forced (RINGREDUCE_SPIN_US; the
    group would not spin by itself with more ranks than CPUs): each wait spins until its slice
    or the spin ends while the peer it waits for cannot run (host_group.cpp HostGroup::wait).
    Exact integer sums of the small path and the ring, several rounds of the staging area."""
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    torch.set_num_threads(1)  # torch's own worker threads would spin against each other
    init(rank, world, store, timeout=60.0)
    checked = 0
    for count in (1, 5, 1000, 70000, 600001):
        for i in range(3):
            g = torch.Generator().manual_seed(seed + 10 * count + i)
            inputs = [torch.randint(-1000, 1000, (count,), generator=g, dtype=torch.int64)
                      for _ in range(world)]
            expect = sum(inputs)
            t = inputs[rank].clone()
            dist.all_reduce(t)
            assert torch.equal(t, expect), (count, i)
            checked += 1
    cpus = os.sched_getaffinity(0)
    dist.destroy_process_group()
    return checked, len(cpus)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_pinned_to_one_core_with_a_forced_spin(tmp_path, world):
    seed = 4242
    print(f"seed {seed}")
    got = values(run_ranks(_one_core, world, tmp_path, seed,
                           env={"RINGREDUCE_SPIN_US": "1000"}))
    assert got == [(15, 1)] * world, got


def _shared_core_sleeps(rank, world, store, seed, count, calls):
    """Every rank pinned to one CPU with a 1 ms spin forced, as _one_core: the futex sleeps
    (voluntary context switches) per all_reduce of `count` int64 in a group with the default
    RINGREDUCE_SHARED_CORE_BYTES and in one where no size yields to a peer on the same CPU
    (the behaviour before it), exact sums checked in both."""
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    torch.set_num_threads(1)
    init(rank, world, store, timeout=60.0)
    os.environ["RINGREDUCE_SHARED_CORE_BYTES"] = str(1 << 62)
    try:
        never = dist.new_group(backend="ringreduce", timeout=datetime.timedelta(seconds=60))
    finally:
        os.environ.pop("RINGREDUCE_SHARED_CORE_BYTES")
    sleeps = {}
    for name, group in (("default", None), ("never", never)):
        g = torch.Generator().manual_seed(seed)
        inputs = [torch.randint(-1000, 1000, (count,), generator=g, dtype=torch.int64)
                  for _ in range(world)]
        expect = sum(inputs)
        t = inputs[rank].clone()
        dist.all_reduce(t, group=group)  # warm: pages touched, paths taken once
        dist.barrier(group=group)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
        for _ in range(calls):
            t.copy_(inputs[rank])
            dist.all_reduce(t, group=group)
            assert torch.equal(t, expect), name
        sleeps[name] = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - before
    dist.destroy_process_group()
    return sleeps


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_on_one_core_yield_to_each_other_in_large_collectives(tmp_path, world):
    """From RINGREDUCE_SHARED_CORE_BYTES (1 MiB) up, a spinning rank whose peer last published
    from its own CPU yields to it: the ranks hand the core to each other instead of spinning
    until the futex sleep. Counted as sleeps (not timed): the group that never yields sleeps at
    most hand-offs (11 per 16 MiB call with 2 ranks when measured), the default one (almost)
    never."""
    seed, count, calls = 4343, 2 << 20, 8  # 16 MiB of int64
    print(f"seed {seed}")
    per_rank = values(run_ranks(_shared_core_sleeps, world, tmp_path, seed, count, calls,
                                env={"RINGREDUCE_SPIN_US": "1000"}))
    default = sum(s["default"] for s in per_rank)
    never = sum(s["never"] for s in per_rank)
    print(f"futex sleeps over {calls} calls, all ranks: default {default}, never {never}")
    # The premise: without the yield, ranks sharing a core sleep at their hand-offs.
    assert never >= 3 * calls, per_rank
    assert default * 4 <= never, per_rank


def _move_off(rank, world, store, seed, calls):
    """Both ranks start on one CPU (pinned while the group forms and for a first call), then may
    run on every CPU again, with RINGREDUCE_MOVE_US=1: a spinning rank whose peer last published
    from its own CPU moves itself off it (host_group.cpp move_off_this_cpu) and gives its thread
    the mask back. Exact int64 sums of small and ring all-reduces; every thread's mask at the end
    as it was given."""
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})
    torch.set_num_threads(1)
    init(rank, world, store, timeout=60.0)
    t = torch.ones(3)
    dist.all_reduce(t)  # the engine's thread exists now, pinned too
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), allowed)
    rng = random.Random(seed)
    for i in range(calls):
        count = rng.choice((1, 7, 1000, 70000, 300001))
        g = torch.Generator().manual_seed(seed + i)
        inputs = [torch.randint(-1000, 1000, (count,), generator=g, dtype=torch.int64)
                  for _ in range(world)]
        t = inputs[rank].clone()
        dist.all_reduce(t)
        assert torch.equal(t, sum(inputs)), (i, count)
    masks = {int(tid): os.sched_getaffinity(int(tid)) for tid in os.listdir("/proc/self/task")}
    dist.destroy_process_group()
    return {tid: sorted(m) for tid, m in masks.items() if m != allowed}


@pytest.mark.timeout(300)
def test_a_rank_that_moves_off_its_peers_cpu_gives_its_thread_the_mask_back(tmp_path):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one usable CPU: there is nowhere to move")
    seed = 4545
    print(f"seed {seed}")
    changed = values(run_ranks(_move_off, 2, tmp_path, seed, 200,
                               env={"RINGREDUCE_MOVE_US": "1", "RINGREDUCE_SPIN_US": "1000"}))
    assert changed == [{}, {}], f"threads left with another CPU mask (tid: mask): {changed}"


# ---------------------------------------------------------------------------------------
# The time slice a collective's thread asks for (RINGREDUCE_SLICE_US)

# sched_getattr / sched_setattr (glibc has no wrappers before 2.41).
_SCHED_SYSCALLS = {"x86_64": (315, 314), "aarch64": (275, 274)}
_RESET_ON_FORK = 0x01


def _thread_slice_ns():
    """The calling thread's time slice, as sched_getattr(2) reports it (sched_runtime)."""
    get, _ = _SCHED_SYSCALLS[os.uname().machine]
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(48)
    if libc.syscall(get, 0, buf, 48, 0) != 0:
        raise OSError(ctypes.get_errno(), "sched_getattr")
    return struct.unpack_from("Q", buf.raw, 24)[0]


def _custom_slices_work():
    """Whether this kernel keeps a SCHED_OTHER thread's own slice (Linux 6.12+): asked for in a
    thread of its own, which ends with it."""
    if os.uname().machine not in _SCHED_SYSCALLS:
        return False
    _, set_ = _SCHED_SYSCALLS[os.uname().machine]
    got = []

    def probe():
        libc = ctypes.CDLL(None, use_errno=True)
        attr = ctypes.create_string_buffer(struct.pack("IIQiIQQQ", 48, 0, _RESET_ON_FORK,
                                                       os.getpriority(os.PRIO_PROCESS, 0), 0,
                                                       300000, 0, 0), 48)
        if libc.syscall(set_, 0, attr, 0) == 0:
            got.append(_thread_slice_ns())

    t = threading.Thread(target=probe)
    t.start()
    t.join()
    return got == [300000]


def _slices(rank, world, store, seed):
    """Both ranks pinned to one CPU (more ranks than cores: waits sleep rather than spin), the
    calling thread running every collective (RINGREDUCE_ASYNC=0). Its slice: untouched by a
    group with RINGREDUCE_SLICE_US=0 (the default group here) and by one whose waits spin
    (RINGREDUCE_SPIN_US), the knob's value in a third, the default (100 us) in a fourth, the
    kernel's again in the first two after that (the thread asked for nothing there); a
    thread started afterwards, and a forked child, get the kernel's default again
    (SCHED_FLAG_RESET_ON_FORK: threads and processes the rank starts are not changed by it).
    Exact sums in every group."""
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    torch.set_num_threads(1)
    before = _thread_slice_ns()
    init(rank, world, store)
    groups = [None]
    for name, value in (("RINGREDUCE_SPIN_US", "1000"), ("RINGREDUCE_SLICE_US", "250"),
                        ("RINGREDUCE_SLICE_US", None)):
        saved = {k: os.environ.pop(k) for k in ("RINGREDUCE_SPIN_US", "RINGREDUCE_SLICE_US")
                 if k in os.environ}
        if value is not None:
            os.environ[name] = value
        try:
            groups.append(dist.new_group(backend="ringreduce",
                                         timeout=datetime.timedelta(seconds=30)))
        finally:
            os.environ.pop(name, None)
            os.environ.update(saved)
    slices = []
    # Then the spinning group, the default one and the 100 us one again: a thread that asked for
    # a short slice gets the kernel's back for a group that asks for nothing.
    for i, group in enumerate(groups + [groups[1], groups[0], groups[3]]):
        g = torch.Generator().manual_seed(seed + i)
        inputs = [torch.randint(-1000, 1000, (70000,), generator=g, dtype=torch.int64)
                  for _ in range(world)]
        t = inputs[rank].clone()
        dist.all_reduce(t, group=group)
        assert torch.equal(t, sum(inputs)), i
        slices.append(_thread_slice_ns())
    later = []
    t = threading.Thread(target=lambda: later.append(_thread_slice_ns()))
    t.start()
    t.join()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(w, struct.pack("Q", _thread_slice_ns()))
        os._exit(0)
    os.waitpid(pid, 0)
    child = struct.unpack("Q", os.read(r, 8))[0]
    dist.destroy_process_group()
    return before, slices, later[0], child


@pytest.mark.timeout(120)
@pytest.mark.skipif(not _custom_slices_work(),
                    reason="this kernel keeps no time slice of a SCHED_OTHER thread's own "
                           "(sched_setattr's sched_runtime: Linux 6.12 and later)")
def test_a_collectives_thread_asks_for_a_short_slice(tmp_path):
    seed = 4444
    print(f"seed {seed}")
    got = values(run_ranks(_slices, 2, tmp_path, seed,
                           env={"RINGREDUCE_SLICE_US": "0", "RINGREDUCE_ASYNC": "0"}))
    for before, slices, later, child in got:
        assert before != 100000 and before != 250000, got
        assert slices == [before, before, 250000, 100000, before, before, 100000], got
        assert later == before and child == before, got
