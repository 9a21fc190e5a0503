"""GPU bring-up tests from the review of the CUDA code (issue 10), one section per finding.

Ran on an H100 on 2026-11-26 (docs/GPU_SESSION.md) up to test_65_ranks_rejected_before_touching_anything,
which died of SIGSEGV; every test before it passed, and of those after it only the graph-capture
and storage-offset cases in scripts/gpu_first.txt ran (and passed). Every GPU test here skips
without a GPU (and fails under RINGREDUCE_REQUIRE_CUDA=1). The CPU halves (NaN and Inf on the CPU path) run
everywhere.

- Virtual devices: ranks on one GPU, each on a stream of its own (streams=[s0, s1, ...]), which
  the executor orders with events as if they were separate devices. A rank's stream held back
  by torch.cuda._sleep exposes a missing entry or per-step wait as NaN poison in the results.
- Back-to-back calls without host synchronisation (copy transport, staging growing from call
  to call), and a call queued behind a long sleep returning to the host at once.
- Limits: more than 2^31 elements (int8), 64 ranks (the largest launch), 65 (a clear error).
- Storage offsets that keep 16-byte alignment (the vector path) and launches mixing aligned
  and unaligned ranks; on CPU too.
- NaN and Inf through sum/max/min: the CPU path against float64 / torch.maximum references, and
  the GPU against the CPU path.
- CUDA graphs: capture and replay on one stream bit for bit equal to eager calls; paths that
  cannot be captured (copy transport, several streams or devices) refused with a clear error,
  queuing nothing, and eager calls afterwards unaffected.

Every result is compared bit for bit with the CPU path or with the ring model
(tests/reference.py), which the CPU path equals bit for bit (tests/test_collectives.py); float
results also within rounding of a float64 reference, integer results exactly. The multi-process
tests of the issue are in tests/test_distributed_cuda.py.
"""
import contextlib
import functools
import os
import random
import re
import time

import pytest
import torch

import ringreduce
from checks import (POISON_BYTE, Unchanged, assert_same_bits, assert_same_bits_but_nan_payload,
                    bits, check_all_reduce,
                    check_copying_collectives, check_reducing_collectives, needs_cuda,
                    poison_like, seeded, sleep_cycles)
from reference import (UNIT_ROUNDOFF, all_gather_model, chunk_bounds, half_rounding,
                       random_inputs, reduce_scatter_model, ring_model)

DEV = torch.device("cuda", 0)
MULTI_GPU = torch.cuda.is_available() and torch.cuda.device_count() >= 2
IDS = lambda v: str(v).replace("torch.", "")  # noqa: E731
NAN = float("nan")


def _rank_streams(n):
    """n distinct streams on cuda:0, each ordered after the work already on the current stream
    (where the tests write the inputs)."""
    streams = [torch.cuda.Stream(DEV) for _ in range(n)]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream(DEV))
    return streams


@contextlib.contextmanager
def _ring_only():
    """RINGREDUCE_ONESHOT_BYTES=0 inside the block: every all_reduce takes the ring."""
    saved = os.environ.get("RINGREDUCE_ONESHOT_BYTES")
    os.environ["RINGREDUCE_ONESHOT_BYTES"] = "0"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["RINGREDUCE_ONESHOT_BYTES"]
        else:
            os.environ["RINGREDUCE_ONESHOT_BYTES"] = saved


def _load_ring_kernels(nranks, dtype, ops, streams=None):
    """One small all_reduce per op through the ring (never the one-shot), then a host wait, so
    that the ring kernels a later timed call launches are loaded. With lazy module loading (the
    default since CUDA 12.2) the first launch of a kernel may synchronise the context: inside a
    call queued behind a sleep that looks like a hidden host wait (issue 21, finding 3)."""
    with _ring_only():
        for op in ops:
            t = [torch.ones(4099, dtype=dtype, device=DEV) for _ in range(nranks)]
            ringreduce.all_reduce(t, op, streams=streams)
    torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------
# Virtual devices: distinct streams for ranks on one GPU

VIRTUAL_CASES = [(torch.float32, "sum"), (torch.float16, "avg"), (torch.bfloat16, "max"),
                 (torch.float64, "prod"), (torch.int32, "bxor"), (torch.int8, "sum"),
                 (torch.uint8, "min"), (torch.int64, "avg"), (torch.bool, "bor")]
VIRTUAL_SIZES = (0, 1, 7, 33, 4099, (1 << 18) + 5)


@needs_cuda
@pytest.mark.parametrize("dtype,op", VIRTUAL_CASES, ids=IDS)
@pytest.mark.parametrize("nranks", [2, 3, 4, 8])
def test_virtual_devices_give_the_ring_bits(dtype, op, nranks):
    """All five collectives with each rank on its own stream: the ring model's bits (the CPU
    path's), inputs unchanged where they must be."""
    g = torch.Generator().manual_seed(nranks * 100 + len(op))
    devices = [DEV] * nranks
    streams = [torch.cuda.Stream(DEV) for _ in range(nranks)]
    check_reducing_collectives(dtype, op, devices, g, VIRTUAL_SIZES, streams=streams)
    check_copying_collectives(dtype, devices, g, VIRTUAL_SIZES, streams=streams)


@needs_cuda
def test_virtual_devices_none_is_the_current_stream():
    """streams=[None, s1, s2]: rank 0 on the current stream, the others on their own."""
    g = torch.Generator().manual_seed(3)
    streams = [None, torch.cuda.Stream(DEV), torch.cuda.Stream(DEV)]
    for count in (7, 4099, (1 << 18) + 5):
        check_all_reduce(random_inputs(3, count, torch.float32, "sum", generator=g), "sum",
                         [DEV] * 3, streams)


def _check_after_late_rank(late_still_busy, snapshots, expected, what):
    """Waits for the GPU; the late rank's stream must still have been sleeping when the call
    returned (else the test proves nothing), and every rank's snapshot must be `expected`."""
    torch.cuda.synchronize()
    assert late_still_busy, (f"{what}: the sleep was over when the call returned (a host wait "
                             "in the call?): the test proves nothing")
    for r, snap in enumerate(snapshots):
        assert_same_bits(snap, expected, f"{what}: rank {r}")


@needs_cuda
@pytest.mark.parametrize("out_of_place", [False, True], ids=["in-place", "outputs"])
@pytest.mark.parametrize("late", ["first", "last"])
@pytest.mark.parametrize("nranks", [2, 3, 4, 8])
def test_virtual_devices_one_rank_late(nranks, late, out_of_place):
    """One rank's input is produced on its stream behind a 50 ms sleep, just before the call;
    every other input is ready at once and every buffer holds NaN until produced. A rank that
    does not wait for the late one reads NaN. After the call each rank's stream snapshots its
    result and then overwrites its input and output with NaN: the snapshot must be the result
    (work queued after the call sees it), and no rank may still be reading what is overwritten."""
    g = torch.Generator().manual_seed(nranks * 10 + (late == "last"))
    count = (1 << 20) + 3
    k = 0 if late == "first" else nranks - 1
    inputs = random_inputs(nranks, count, torch.float32, "sum", generator=g)
    sources = [x.to(DEV, copy=True) for x in inputs]
    tensors = [torch.full((count,), NAN, device=DEV) for _ in range(nranks)]
    outputs = [torch.full((count,), NAN, device=DEV) for _ in range(nranks)] \
        if out_of_place else None
    cycles = sleep_cycles(0.05)
    streams = _rank_streams(nranks)
    _load_ring_kernels(nranks, torch.float32, ["sum"], streams)
    for r, (s, t, src) in enumerate(zip(streams, tensors, sources)):
        with torch.cuda.stream(s):
            if r == k:
                torch.cuda._sleep(cycles)
            t.copy_(src)
    results = ringreduce.all_reduce(tensors, "sum", outputs=outputs, streams=streams)
    late_still_busy = not streams[k].query()
    snapshots = []
    for r, s in enumerate(streams):
        with torch.cuda.stream(s):
            snapshots.append(results[r].clone())
            tensors[r].fill_(NAN)
            if out_of_place:
                outputs[r].fill_(NAN)
    _check_after_late_rank(late_still_busy, snapshots, ring_model(inputs, "sum", "per_hop"),
                           f"late rank {k}")


@needs_cuda
@pytest.mark.parametrize("late", ["first", "middle", "last"])
@pytest.mark.parametrize("nranks", [2, 3, 4, 8])
def test_virtual_devices_late_between_two_calls(nranks, late):
    """Two in-place calls on the same tensors. Right after the first, every rank's stream
    snapshots its result and writes its next input, one of them behind a 50 ms sleep. The
    others' second call must not overwrite their buffers before the late rank has read them
    (the second call's entry waits), nor the late rank read stale data; the first call's
    readers must be done before anyone writes the next input (its exit waits)."""
    g = torch.Generator().manual_seed(nranks * 20 + len(late))
    count = (1 << 20) + 3
    k = {"first": 0, "middle": nranks // 2, "last": nranks - 1}[late]
    first = random_inputs(nranks, count, torch.float32, "sum", generator=g)
    second = random_inputs(nranks, count, torch.float32, "max", generator=g)
    second_src = [x.to(DEV, copy=True) for x in second]
    tensors = [x.to(DEV, copy=True) for x in first]
    cycles = sleep_cycles(0.05)
    streams = _rank_streams(nranks)
    _load_ring_kernels(nranks, torch.float32, ["sum", "max"], streams)
    ringreduce.all_reduce(tensors, "sum", streams=streams)
    snapshots = []
    for r, (s, t, src) in enumerate(zip(streams, tensors, second_src)):
        with torch.cuda.stream(s):
            snapshots.append(t.clone())
            if r == k:
                torch.cuda._sleep(cycles)
            t.copy_(src)
    ringreduce.all_reduce(tensors, "max", streams=streams)
    late_still_busy = not streams[k].query()
    _check_after_late_rank(late_still_busy, snapshots, ring_model(first, "sum", "per_hop"),
                           f"first call, late rank {k}")
    expected_second = ring_model(second, "max", "per_hop")
    for r, t in enumerate(tensors):
        assert_same_bits(t, expected_second, f"second call, rank {r} (late rank {k})")


# ---------------------------------------------------------------------------------------------
# Back-to-back calls without host synchronisation

@needs_cuda
@pytest.mark.parametrize("virtual", [False, True], ids=["one-stream", "virtual-devices"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32], ids=IDS)
def test_back_to_back_calls_with_a_growing_staging_buffer(dtype, virtual, monkeypatch):
    """RINGREDUCE_TRANSPORT=copy, four ranks, six calls on prefixes of the same buffers with
    growing lengths (so the staging buffer grows at every call) and changing ops, each queued
    behind a 20 ms sleep, with the odd ranks negating their prefix between calls. The host
    never waits; after each call it allocates and fills a buffer the size of that call's
    staging on the current stream, which must not receive memory a queued call still uses.
    The final buffers equal a replay of the same sequence on the CPU path, bit for bit."""
    monkeypatch.setenv("RINGREDUCE_TRANSPORT", "copy")
    n = 4
    calls = (("sum", 1000), ("max", 4099), ("avg", 33001), ("min", (1 << 17) + 5),
             ("prod", (1 << 20) + 3), ("sum", (1 << 22) + 1))
    longest = max(m for _, m in calls)
    g = torch.Generator().manual_seed(len(str(dtype)) + virtual)
    cpu = random_inputs(n, longest, dtype, "prod", generator=g)  # products stay small
    gpu = [x.to(DEV, copy=True) for x in cpu]
    streams = _rank_streams(n) if virtual else None
    cycles = sleep_cycles(0.02)
    current = torch.cuda.current_stream(DEV)
    junk = []
    for i, (op, m) in enumerate(calls):
        for r in range(1, n, 2):
            cpu[r][:m].neg_()  # exact in every dtype: the CPU and the GPU stay bitwise equal
            with torch.cuda.stream(streams[r] if virtual else current):
                gpu[r][:m].neg_()
        with torch.cuda.stream(streams[i % n] if virtual else current):
            torch.cuda._sleep(cycles)
        ringreduce.all_reduce([t[:m] for t in gpu], op, streams=streams)
        ringreduce.all_reduce([t[:m] for t in cpu], op)
        junk.append(torch.empty(m * cpu[0].element_size(), dtype=torch.uint8,
                                device=DEV).fill_(POISON_BYTE))
    torch.cuda.synchronize()
    for r in range(n):
        assert_same_bits(gpu[r], cpu[r], f"rank {r} after {len(calls)} calls")


@needs_cuda
@pytest.mark.parametrize("transport,virtual",
                         [("p2p", False), ("copy", False), ("p2p", True), ("copy", True)],
                         ids=["p2p", "copy-growing-staging", "p2p-virtual", "copy-virtual"])
def test_call_behind_a_sleep_returns_at_once(transport, virtual, monkeypatch):
    """A call queued behind a one-second sleep returns to the host well before the sleep ends:
    no hidden host synchronisation (the first call after a warm-up on a smaller size, so that
    the copy transport's staging buffer grows in the timed call). The warm-up takes the ring,
    as the timed call does: on the one-shot path (the default at its size on one stream) it
    would leave the ring kernels to be loaded, lazily, inside the timed call."""
    monkeypatch.setenv("RINGREDUCE_TRANSPORT", transport)
    n, small, big = 4, 4099, (1 << 22) + 3
    tensors = [torch.ones(big, device=DEV) for _ in range(n)]
    streams = _rank_streams(n) if virtual else None
    with _ring_only():
        ringreduce.all_reduce([t[:small] for t in tensors], streams=streams)
    torch.cuda.synchronize()
    cycles = sleep_cycles(1.0)
    sleeper = streams[0] if virtual else torch.cuda.current_stream(DEV)
    with torch.cuda.stream(sleeper):
        torch.cuda._sleep(cycles)
    start = time.perf_counter()
    ringreduce.all_reduce(tensors, streams=streams)
    elapsed = time.perf_counter() - start
    still_sleeping = not sleeper.query()
    torch.cuda.synchronize()
    assert elapsed < 0.25, f"the call took {elapsed:.3f} s on the host behind a 1 s sleep"
    assert still_sleeping, "the sleep was over when the call returned: the test proves nothing"
    expected = torch.full((big,), float(n))
    expected[:small] = float(n * n)
    for r, t in enumerate(tensors):
        assert torch.equal(t.cpu(), expected), f"rank {r}"


@needs_cuda
@pytest.mark.parametrize("collective", ["reduce", "reduce_scatter"])
def test_workspaces_come_from_the_ranks_streams(collective):
    """reduce and reduce_scatter keep partial results in workspaces. Buffers the size of a
    workspace are read on the current stream behind a 50 ms sleep and freed at once, and the
    call runs on other streams (streams=) that do not wait for that: a workspace allocated on
    the current stream would get their blocks and be written by the ranks before those reads
    (issue 21, finding 2). Allocated on the rank's own stream, it cannot."""
    n, count = 4, (1 << 18) + 5
    numel = count * n if collective == "reduce_scatter" else count
    g = torch.Generator().manual_seed(len(collective))
    inputs = random_inputs(n, numel, torch.float32, "sum", generator=g)
    tensors = [x.to(DEV, copy=True) for x in inputs]
    if collective == "reduce":
        outputs = [torch.empty(count, device=DEV)]
    else:
        outputs = [torch.empty(count, device=DEV) for _ in range(n)]
    streams = _rank_streams(n)
    _load_ring_kernels(n, torch.float32, ["sum"], streams)
    cycles = sleep_cycles(0.05)
    victims = [torch.full((numel,), float(r + 1), device=DEV) for r in range(n)]
    torch.cuda._sleep(cycles)
    snapshots = [v.clone() for v in victims]
    del victims  # their blocks are free for the current stream's next allocations
    if collective == "reduce":
        ringreduce.reduce(tensors, outputs[0], root=0, streams=streams)
        models = [ring_model(inputs, "sum", "per_hop")]
    else:
        ringreduce.reduce_scatter(tensors, outputs, streams=streams)
        models = reduce_scatter_model(inputs, "sum", "per_hop")
    torch.cuda.synchronize()
    for r, snap in enumerate(snapshots):
        assert torch.equal(snap, torch.full_like(snap, float(r + 1))), (
            f"a buffer read on the current stream was overwritten (rank {r}'s workspace?)")
    for r, (o, m) in enumerate(zip(outputs, models)):
        assert_same_bits(o, m, f"{collective} result {r}")


# ---------------------------------------------------------------------------------------------
# Limits: 2^31 elements, 64 and 65 ranks

def _fill_periodic(t, pattern):
    """t[i] = pattern[i % len(pattern)], without a temporary the size of t."""
    p = pattern.numel()
    full = t.numel() // p
    t[:full * p].view(full, p).copy_(pattern.expand(full, p))
    t[full * p:].copy_(pattern[:t.numel() - full * p])


@needs_cuda
def test_more_than_2_pow_31_elements_int8():
    """int8 sum over 2 ranks of 2^31 + 33 elements (64-bit offsets and counts everywhere): each
    rank holds a pattern of a different prime period, so a misplaced element shows. Every
    element is checked on the GPU, slice by slice; chosen positions (chunk boundaries, around
    2^31, the tail) and a random sample again with Python integers."""
    count = 2**31 + 33
    free, _ = torch.cuda.mem_get_info(DEV)
    need = 2 * count + (6 << 30)  # the two ranks, and the checks' temporaries
    if free < need:
        pytest.skip(f"needs {need / 2**30:.1f} GiB free on cuda:0; {free / 2**30:.1f} GiB free")
    periods = (251, 241)
    patterns = [((torch.arange(p, dtype=torch.int64) * mul + add) % 256 - 128).to(torch.int8)
                for p, mul, add in ((251, 7, 3), (241, 13, 100))]
    tensors = []
    for pattern in patterns:
        t = torch.empty(count, dtype=torch.int8, device=DEV)
        _fill_periodic(t, pattern.to(DEV))
        tensors.append(t)
    ringreduce.all_reduce(tensors, "sum")
    torch.cuda.synchronize()

    values = [p.tolist() for p in patterns]

    def expect(i):
        s = values[0][i % periods[0]] + values[1][i % periods[1]]
        return (s + 128) % 256 - 128  # int8 wrap-around

    wide = [p.to(DEV, torch.int32) for p in patterns]
    step = 1 << 26
    for lo in range(0, count, step):
        hi = min(count, lo + step)
        idx = torch.arange(lo, hi, dtype=torch.int64, device=DEV)
        s = wide[0][idx % periods[0]] + wide[1][idx % periods[1]]
        expected = ((s + 128) % 256 - 128).to(torch.int8)
        del idx, s
        for r, t in enumerate(tensors):
            part = t[lo:hi]
            if not torch.equal(part, expected):
                bad = lo + int((part != expected).nonzero()[0])
                pytest.fail(f"rank {r}: element {bad} is {int(t[bad])}, expected {expect(bad)}")

    positions = {0, 1, 15, 16, 17, 2**31 - 1, 2**31, 2**31 + 1, *range(count - 40, count)}
    for lo, hi in chunk_bounds(count, 2, 1):
        positions.update(range(max(lo - 3, 0), min(lo + 3, count)))
        positions.update(range(max(hi - 3, 0), min(hi + 3, count)))
    rng = random.Random(31)
    positions.update(rng.randrange(count) for _ in range(4000))
    positions = sorted(positions)
    idx = torch.tensor(positions, dtype=torch.int64, device=DEV)
    want = [expect(i) for i in positions]
    for r, t in enumerate(tensors):
        got = t[idx].cpu().tolist()
        wrong = [(i, v, w) for i, v, w in zip(positions, got, want) if v != w]
        assert not wrong, f"rank {r}: (position, got, expected) {wrong[:5]}"


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.int32], ids=IDS)
def test_64_ranks_on_one_gpu(dtype):
    """The largest launch: 64 simulated ranks, every collective, against the ring model, a
    float64 reference within rounding and exact integers."""
    g = torch.Generator().manual_seed(64)
    devices = [DEV] * 64
    check_reducing_collectives(dtype, "sum", devices, g, (1000, 4099))
    check_copying_collectives(dtype, devices, g, (1000,))


@needs_cuda
def test_65_ranks_rejected_before_touching_anything():
    n, count = 65, 130
    tensors = [torch.full((count,), float(r), device=DEV) for r in range(n)]
    outputs = [poison_like(t) for t in tensors]
    gathered = [poison_like(t, (n * count,)) for t in tensors]
    shards = [poison_like(t, (count // n,)) for t in tensors]
    kept = Unchanged((f"{name}[{i}]", t) for name, ts in
                     (("tensors", tensors), ("outputs", outputs), ("gathered", gathered),
                      ("shards", shards)) for i, t in enumerate(ts))
    calls = {
        "all_reduce": lambda: ringreduce.all_reduce(tensors),
        "all_reduce(outputs=)": lambda: ringreduce.all_reduce(tensors, outputs=outputs),
        "reduce": lambda: ringreduce.reduce(tensors, outputs[0], root=0),
        "broadcast": lambda: ringreduce.broadcast(tensors, root=3),
        "all_gather": lambda: ringreduce.all_gather(tensors, gathered),
        "reduce_scatter": lambda: ringreduce.reduce_scatter(tensors, shards),
    }
    for name, call in calls.items():
        with pytest.raises((RuntimeError, ValueError), match=r"at most 64"):
            call()
        torch.cuda.synchronize()
        kept.check()  # checked after each call: a partial launch would show at once


# ---------------------------------------------------------------------------------------------
# Storage offsets: aligned views (the vector path) and launches mixing aligned and unaligned

ALIGNMENT_PATTERNS = {
    "all-aligned": lambda r, n: True,
    "last-unaligned": lambda r, n: r != n - 1,  # most neighbour pairs stay on the vector path
    "alternate": lambda r, n: r % 2 == 0,
}


def _offset_views(numels, dtype, aligned, device=DEV):
    """One view per rank into a larger buffer at a non-zero storage offset: a multiple of 16
    bytes where aligned[r], one element more otherwise."""
    vec = 16 // torch.empty((), dtype=dtype).element_size()
    views = []
    for r, ok in enumerate(aligned):
        offset = vec * (r + 1) + (0 if ok else 1)
        base = torch.empty(numels + offset + vec, dtype=dtype, device=device)
        v = base.narrow(0, offset, numels)
        assert (v.data_ptr() % 16 == 0) == ok, "the view is not aligned as the test means it"
        views.append(v)
    return views


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=needs_cuda)])
@pytest.mark.parametrize("op", ["sum", "max"])
@pytest.mark.parametrize("pattern", list(ALIGNMENT_PATTERNS))
@pytest.mark.parametrize("nranks", [3, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8,
                                   torch.float64], ids=IDS)
def test_storage_offsets(dtype, nranks, pattern, op, device):
    """all_reduce (in place, and out of place into views aligned the other way round),
    reduce_scatter and all_gather on views at storage offsets: the ring model's bits. On CPU
    too: the combine's SIMD loops have aligned and unaligned paths of their own."""
    g = seeded("storage offsets", dtype, nranks, pattern, op)
    aligned = [ALIGNMENT_PATTERNS[pattern](r, nranks) for r in range(nranks)]
    flipped = aligned[::-1]
    big = (1 << 18) + 5 if device != "cpu" else 70001
    for count in (33, 4099, big):
        inputs = random_inputs(nranks, count, dtype, op, generator=g)
        expected = ring_model(inputs, op, half_rounding(device))
        views = _offset_views(count, dtype, aligned, device)
        for v, x in zip(views, inputs):
            v.copy_(x)
        ringreduce.all_reduce(views, op)
        for r, v in enumerate(views):
            assert_same_bits(v, expected, f"in place, rank {r}, n={count}")

        views = _offset_views(count, dtype, aligned, device)
        outs = _offset_views(count, dtype, flipped, device)
        for v, o, x in zip(views, outs, inputs):
            v.copy_(x)
            o.view(torch.uint8).fill_(POISON_BYTE)
        ringreduce.all_reduce(views, op, outputs=outs)
        for r, (v, o) in enumerate(zip(views, outs)):
            assert_same_bits(o, expected, f"outputs[{r}], n={count}")
            assert_same_bits(v, inputs[r], f"input {r} out of place, n={count}")

        blocks = random_inputs(nranks, count * nranks, dtype, op, generator=g)
        views = _offset_views(count * nranks, dtype, aligned, device)
        outs = _offset_views(count, dtype, flipped, device)
        for v, x in zip(views, blocks):
            v.copy_(x)
        ringreduce.reduce_scatter(views, outs, op=op)
        for r, (o, want) in enumerate(zip(outs, reduce_scatter_model(blocks, op,
                                                                    half_rounding(device)))):
            assert_same_bits(o, want, f"reduce_scatter outputs[{r}], n={count}")

        views = _offset_views(count, dtype, aligned, device)
        outs = _offset_views(count * nranks, dtype, flipped, device)
        for v, x in zip(views, inputs):
            v.copy_(x)
        ringreduce.all_gather(views, outs)
        want = all_gather_model(inputs)
        for r, o in enumerate(outs):
            assert_same_bits(o, want, f"all_gather outputs[{r}], n={count}")


# ---------------------------------------------------------------------------------------------
# NaN and Inf

SPECIAL_DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def _special_inputs(nranks, count, dtype, generator):
    """Finite random inputs with NaN, +Inf, -Inf and signed zeros: fixed combinations across
    the ranks in the first elements (NaN on one rank, inf + -inf, NaN beside inf, ...), then
    each special at random in about 3% of every rank's elements."""
    x = random_inputs(nranks, count, dtype, "sum", generator=generator)
    inf, last = float("inf"), nranks - 1
    combos = [{0: NAN}, {last: NAN}, {0: inf, 1: -inf}, {r: inf for r in range(nranks)},
              {0: inf, last: NAN}, {last: -inf}, {r: NAN for r in range(nranks)},
              {0: -inf, 1: -inf}, {0: 0.0, 1: -0.0}, {r: -0.0 for r in range(nranks)},
              {1: inf, 0: -inf}, {last: inf}]
    for pos, combo in enumerate(combos):
        for r, v in combo.items():
            x[r][pos] = v
    for t in x:
        u = torch.rand(count, generator=generator)
        u[:len(combos)] = 1.0
        t[u < 0.03] = NAN
        t[(u >= 0.03) & (u < 0.06)] = inf
        t[(u >= 0.06) & (u < 0.09)] = -inf
        t[(u >= 0.09) & (u < 0.10)] = -0.0
    return x


def _wide_special_reference(inputs, op):
    """float64: sum (inf + -inf is NaN), or max/min propagating NaN as torch.maximum does."""
    wide = [t.to(torch.float64) for t in inputs]
    combine = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}[op]
    return functools.reduce(combine, wide)


@pytest.mark.parametrize("op", ["sum", "max", "min"])
@pytest.mark.parametrize("nranks", [2, 3, 4])
@pytest.mark.parametrize("dtype", SPECIAL_DTYPES, ids=IDS)
def test_nan_and_inf_on_the_cpu_path(dtype, nranks, op):
    """The CPU half: NaN exactly where the float64 reference has it, the same infinities, max
    and min exact, finite sums within rounding; and the ring model's bits apart from NaN."""
    g = torch.Generator().manual_seed(nranks * 3 + len(op))
    for count in (12, 33, 4099):
        inputs = _special_inputs(nranks, count, dtype, g)
        results = ringreduce.all_reduce([x.clone() for x in inputs], op)
        for r, t in enumerate(results[1:], 1):
            assert_same_bits(t, results[0], f"rank {r} against rank 0")
        got = results[0].to(torch.float64)
        ref = _wide_special_reference(inputs, op)
        nan_got, nan_ref = torch.isnan(got), torch.isnan(ref)
        assert torch.equal(nan_got, nan_ref), (
            f"{op}: NaN at {(nan_got != nan_ref).nonzero().flatten().tolist()[:10]} differs "
            "from the float64 reference")
        if op in ("max", "min"):
            assert torch.equal(got[~nan_ref], ref[~nan_ref]), f"{op} differs from torch.{op}imum"
        else:
            inf = torch.isinf(ref)
            assert torch.equal(got[inf], ref[inf]), "infinite sums differ"
            finite = ~inf & ~nan_ref
            scale = torch.stack([x.to(torch.float64).abs() for x in inputs]).sum(0)
            err = (got[finite] - ref[finite]).abs()
            tol = (nranks + 1) * UNIT_ROUNDOFF[dtype] * scale[finite]
            assert bool((err <= tol).all()), f"finite sums off by up to {float(err.max()):.3g}"
        assert_same_bits_but_nan_payload(results[0], ring_model(inputs, op, half_rounding()),
                                         f"{op} vs ring model")


@needs_cuda
@pytest.mark.parametrize("op", ["sum", "max", "min"])
@pytest.mark.parametrize("nranks", [2, 3, 4])
@pytest.mark.parametrize("dtype", SPECIAL_DTYPES, ids=IDS)
def test_nan_and_inf_gpu_matches_cpu(dtype, nranks, op):
    """all_reduce and reduce_scatter on the GPU: NaN at the same elements as the CPU path, every
    other element the same bits."""
    g = torch.Generator().manual_seed(nranks * 5 + len(op))
    for count in (12, 33, 4099, (1 << 18) + 5):
        inputs = _special_inputs(nranks, count, dtype, g)
        gpu = ringreduce.all_reduce([x.to(DEV, copy=True) for x in inputs], op)
        cpu = ringreduce.all_reduce([x.clone() for x in inputs], op)
        for r in range(nranks):
            assert_same_bits_but_nan_payload(gpu[r], cpu[r], f"all_reduce rank {r}, n={count}")

        blocks = _special_inputs(nranks, count * nranks, dtype, g)
        gpu_out = [torch.empty(count, dtype=dtype, device=DEV) for _ in range(nranks)]
        cpu_out = [torch.empty(count, dtype=dtype) for _ in range(nranks)]
        ringreduce.reduce_scatter([x.to(DEV, copy=True) for x in blocks], gpu_out, op=op)
        ringreduce.reduce_scatter(blocks, cpu_out, op=op)
        for r in range(nranks):
            assert_same_bits_but_nan_payload(gpu_out[r], cpu_out[r],
                                       f"reduce_scatter rank {r}, n={count}")


# ---------------------------------------------------------------------------------------------
# CUDA graphs

REPLAYS = 100


def _load(dst, src):
    for d, s in zip(dst, src):
        d.copy_(s)


def _replays_match_eager(step, sources, input_sets, results):
    """step() copies from `sources` into the collective's tensors and runs it (both captured:
    an in-place collective replayed on its own output would not see the same input twice).
    Runs step() eagerly on each input set, captures it once, then replays it REPLAYS times,
    cycling through the sets: before each replay the sources are refilled and the results
    poisoned on the current stream, outside the graph. Every replay must give the eager bits
    of its set. Returns the eager results (bytes on the GPU), one list per set."""
    eager = []
    for inputs in input_sets:
        _load(sources, inputs)
        step()
        eager.append([r.reshape(-1).view(torch.uint8).clone() for r in results])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for i in range(REPLAYS):
        k = i % len(input_sets)
        _load(sources, input_sets[k])
        for r in results:
            r.view(torch.uint8).fill_(POISON_BYTE)
        graph.replay()
        for j, r in enumerate(results):
            if not torch.equal(r.reshape(-1).view(torch.uint8), eager[k][j]):
                pytest.fail(f"replay {i} (input set {k}): result {j} differs from the eager call")
    return eager


def _input_sets(nranks, count, dtype, op, seed, sets=3):
    g = torch.Generator().manual_seed(seed)
    cpu = [random_inputs(nranks, count, dtype, op, generator=g) for _ in range(sets)]
    return cpu, [[x.to(DEV, copy=True) for x in inputs] for inputs in cpu]


@needs_cuda
@pytest.mark.parametrize("out_of_place", [False, True], ids=["in-place", "outputs"])
@pytest.mark.parametrize("nranks", [2, 4, 5])
@pytest.mark.parametrize("dtype,op", [(torch.float32, "sum"), (torch.bfloat16, "avg"),
                                      (torch.int32, "max")], ids=IDS)
def test_graph_capture_all_reduce(dtype, op, nranks, out_of_place):
    """One device, every rank on the capturing stream, the default p2p transport: capture
    works, and 100 replays give the eager call's bits (which are the ring model's)."""
    count = (1 << 16) + 3
    cpu_sets, gpu_sets = _input_sets(nranks, count, dtype, op, nranks * 11 + out_of_place)
    sources = [torch.empty(count, dtype=dtype, device=DEV) for _ in range(nranks)]
    tensors = [torch.empty_like(s) for s in sources]
    outputs = [torch.empty_like(s) for s in sources] if out_of_place else None

    def step():
        _load(tensors, sources)
        ringreduce.all_reduce(tensors, op, outputs=outputs)

    eager = _replays_match_eager(step, sources, gpu_sets,
                                 outputs if out_of_place else tensors)
    for inputs, got in zip(cpu_sets, eager):
        want = bits(ring_model(inputs, op, "per_hop"))
        for r, b in enumerate(got):
            assert torch.equal(b.cpu(), want), f"eager rank {r} differs from the ring model"


@needs_cuda
@pytest.mark.parametrize("nranks", [2, 4])
@pytest.mark.parametrize("collective", ["reduce", "broadcast", "all_gather", "reduce_scatter"])
def test_graph_capture_other_collectives(collective, nranks):
    """reduce, broadcast, all_gather and reduce_scatter captured on one stream: 100 replays
    give the eager call's bits; the eager calls give the ring model's."""
    dtype, op, count = torch.bfloat16, "sum", 4099
    numel = count * nranks if collective == "reduce_scatter" else count
    cpu_sets, gpu_sets = _input_sets(nranks, numel, dtype, op, nranks * 13 + len(collective))
    sources = [torch.empty(numel, dtype=dtype, device=DEV) for _ in range(nranks)]
    tensors = [torch.empty_like(s) for s in sources]
    root = nranks - 1
    if collective == "reduce":
        results = [torch.empty(count, dtype=dtype, device=DEV)]

        def step():
            _load(tensors, sources)
            ringreduce.reduce(tensors, results[0], root=root, op=op)

        models = [[ring_model(inputs, op, "per_hop")] for inputs in cpu_sets]
    elif collective == "broadcast":
        results = tensors

        def step():
            tensors[root].copy_(sources[root])  # the others keep the poison until written
            ringreduce.broadcast(tensors, root=root)

        models = [[inputs[root]] * nranks for inputs in cpu_sets]
    elif collective == "all_gather":
        results = [torch.empty(count * nranks, dtype=dtype, device=DEV) for _ in range(nranks)]

        def step():
            _load(tensors, sources)
            ringreduce.all_gather(tensors, results)

        models = [[all_gather_model(inputs)] * nranks for inputs in cpu_sets]
    else:
        results = [torch.empty(count, dtype=dtype, device=DEV) for _ in range(nranks)]

        def step():
            _load(tensors, sources)
            ringreduce.reduce_scatter(tensors, results, op=op)

        models = [reduce_scatter_model(inputs, op, "per_hop") for inputs in cpu_sets]
    eager = _replays_match_eager(step, sources, gpu_sets, results)
    for k, (got, want) in enumerate(zip(eager, models)):
        for r, (b, m) in enumerate(zip(got, want)):
            assert torch.equal(b.cpu(), bits(m)), f"eager {collective}, set {k}, result {r}"


def _check_capture_refused(call, why, tensors):
    """call() inside torch.cuda.graph must raise a RuntimeError saying the path "cannot be
    captured" and matching `why` (the reason), before queuing anything: the capture stays
    valid, the graph holds only the marker queued before the call (a replay runs it once), and
    `tensors` stay unchanged. As in torch's own tests (test_graph_capture_oom), the error
    propagates out of the graph context, whose exit ends the capture."""
    marker = torch.zeros((), dtype=torch.int64, device=DEV)
    kept = Unchanged((f"tensors[{i}]", t) for i, t in enumerate(tensors))
    graph = torch.cuda.CUDAGraph()
    capture = torch.cuda.Stream(DEV)
    with torch.cuda.stream(capture):  # restores the current stream even if the capture fails
        with pytest.raises(RuntimeError, match="cannot be captured") as info:
            with torch.cuda.graph(graph, stream=capture):
                marker.add_(1)
                call()
    assert re.search(why, str(info.value), re.IGNORECASE), (
        f"the error should say why ({why}): {info.value}")
    torch.cuda.synchronize()
    graph.replay()
    torch.cuda.synchronize()
    assert int(marker) == 1, "the graph does not hold exactly the work queued before the call"
    kept.check()


@needs_cuda
@pytest.mark.parametrize("nranks", [2, 4])
def test_graph_capture_refused_for_the_copy_transport(nranks, monkeypatch):
    g = torch.Generator().manual_seed(nranks)
    inputs = random_inputs(nranks, 4099, torch.float32, "sum", generator=g)
    tensors = [x.to(DEV, copy=True) for x in inputs]
    monkeypatch.setenv("RINGREDUCE_TRANSPORT", "copy")
    ringreduce.all_reduce([t.clone() for t in tensors])  # the staging buffer exists already
    _check_capture_refused(lambda: ringreduce.all_reduce(tensors), r"copy", tensors)
    # Eager calls afterwards: unaffected, on either transport.
    check_all_reduce(inputs, "sum", [DEV] * nranks)
    monkeypatch.setenv("RINGREDUCE_TRANSPORT", "p2p")
    check_all_reduce(inputs, "sum", [DEV] * nranks)


@needs_cuda
@pytest.mark.parametrize("capturing", ["every-stream", "last-stream-only"])
@pytest.mark.parametrize("nranks", [2, 4])
def test_graph_capture_refused_for_virtual_devices(nranks, capturing):
    """Several streams on one device cannot be captured. "every-stream": each rank's stream
    joins the capture (it waits for the capturing stream, and is joined back after the call);
    "last-stream-only": only the last rank's stream is the capturing one, and the current
    stream at the call is another, which is not capturing (the check must look at the ranks'
    streams, not only at the current one)."""
    g = torch.Generator().manual_seed(nranks + 40)
    inputs = random_inputs(nranks, 4099, torch.float32, "sum", generator=g)
    tensors = [x.to(DEV, copy=True) for x in inputs]
    streams = [torch.cuda.Stream(DEV) for _ in range(nranks)]
    elsewhere = torch.cuda.Stream(DEV)
    ringreduce.all_reduce([t.clone() for t in tensors], streams=_rank_streams(nranks))
    torch.cuda.synchronize()

    def call():
        capture = torch.cuda.current_stream(DEV)
        if capturing == "last-stream-only":
            with torch.cuda.stream(elsewhere):
                ringreduce.all_reduce(tensors, streams=streams[:-1] + [capture])
            return
        for s in streams:
            s.wait_stream(capture)
        try:
            ringreduce.all_reduce(tensors, streams=streams)
        finally:
            for s in streams:
                capture.wait_stream(s)

    _check_capture_refused(call, r"stream", tensors)
    check_all_reduce(inputs, "sum", [DEV] * nranks, streams)


@needs_cuda
def test_graph_capture_refused_across_devices():
    if not MULTI_GPU:  # here rather than a skipif mark, so that needs_cuda decides first
        pytest.skip("needs two or more GPUs")
    g = torch.Generator().manual_seed(41)
    inputs = random_inputs(2, 4099, torch.float32, "sum", generator=g)
    devices = [DEV, torch.device("cuda", 1)]
    tensors = [x.to(d) for x, d in zip(inputs, devices)]
    _check_capture_refused(lambda: ringreduce.all_reduce(tensors), r"device", tensors)
    check_all_reduce(inputs, "sum", devices)
