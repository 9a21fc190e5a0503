"""ringreduce's collectives on CUDA: simulated ranks on one GPU, distinct GPUs, stream ordering.

Every GPU result is compared bit for bit with the ring model (tests/reference.py), which is
also what the CPU path produces: the reduction order and the per-hop rounding are the same.
"""
import os
import subprocess
import sys

import pytest
import torch

import ringreduce
from checks import check_copying_collectives, check_reducing_collectives, needs_cuda
from reference import (ALL_DTYPES, assert_close_to_wide, once_rounded_model, random_inputs,
                       ring_model, valid_ops)

# Skips without a GPU or a CUDA build; fails instead under RINGREDUCE_REQUIRE_CUDA=1.
pytestmark = needs_cuda
MULTI_GPU = torch.cuda.is_available() and torch.cuda.device_count() >= 2

# Around every threshold: fewer elements than ranks, odd counts, one 16-byte vector plus a
# tail, chunk sizes that leave trailing chunks empty, and sizes that need many blocks.
SIZES = (1, 3, 7, 9, 33, 1023, 4099, (1 << 18) + 5, (1 << 20) + 3)


def _devices(nranks, spread):
    if spread and MULTI_GPU:
        return [torch.device("cuda", r % torch.cuda.device_count()) for r in range(nranks)]
    return [torch.device("cuda", 0)] * nranks


def _run_and_check(inputs, op, devices, poison=True):
    tensors = [x.to(d) for x, d in zip(inputs, devices)]
    ringreduce.all_reduce(tensors, op)
    torch.cuda.synchronize()
    expected = ring_model(inputs, op, "per_hop")
    for r, t in enumerate(tensors):
        got = t.cpu()
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8)), (
            f"rank {r} on {t.device} differs from the ring model "
            f"({int((got != expected).sum())} of {got.numel()} elements)")
    assert_close_to_wide(tensors[0], inputs, op)


def _cases():
    for dtype in ALL_DTYPES:
        for op in valid_ops(dtype):
            yield dtype, op


@pytest.mark.parametrize("dtype,op", list(_cases()), ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("nranks", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("oneshot", ["default", "off"])
def test_simulated_ranks(dtype, op, nranks, oneshot, monkeypatch):
    """One stream of one GPU: small sizes take the one-shot kernel by default, the others (and
    every size with RINGREDUCE_ONESHOT_BYTES=0) the ring; both give the ring model's bits."""
    if oneshot == "off":
        monkeypatch.setenv("RINGREDUCE_ONESHOT_BYTES", "0")
    g = torch.Generator().manual_seed(nranks * 1000 + len(op))
    for count in SIZES:
        _run_and_check(random_inputs(nranks, count, dtype, op, generator=g), op,
                       _devices(nranks, spread=False))


@pytest.mark.parametrize("dtype,op", [(torch.float16, "sum"), (torch.bfloat16, "avg"),
                                      (torch.float32, "prod"), (torch.float32, "max"),
                                      (torch.int32, "sum"), (torch.uint8, "bxor")],
                         ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("nranks", [2, 3, 4, 7, 8, 64])
def test_oneshot_and_ring_agree_at_the_threshold(dtype, op, nranks, monkeypatch):
    """The same inputs through the one-shot kernel and through the ring, at the default
    threshold's size and around it, in place and out of place: identical bits (the GPU makes
    one canonical NaN, so even NaN payloads agree)."""
    esize = torch.empty(0, dtype=dtype).element_size()
    limit = ringreduce.core.ONESHOT_DEFAULT_BYTES // esize
    g = torch.Generator().manual_seed(nranks * 31 + esize)
    for count in (limit - 1, limit, limit + 1):
        inputs = random_inputs(nranks, count, dtype, op, generator=g)
        results = {}
        for name, limit_bytes in (("ring", "0"), ("oneshot", str(1 << 40))):
            monkeypatch.setenv("RINGREDUCE_ONESHOT_BYTES", limit_bytes)
            tensors = [x.cuda() for x in inputs]
            outputs = [torch.full_like(t, 7) for t in tensors]
            ringreduce.all_reduce(tensors, op, outputs=outputs)
            ringreduce.all_reduce(tensors, op)
            torch.cuda.synchronize()
            for t, o in zip(tensors, outputs):
                assert torch.equal(t.view(torch.uint8), o.view(torch.uint8))
            results[name] = tensors[0].cpu()
        assert torch.equal(results["ring"].view(torch.uint8),
                           results["oneshot"].view(torch.uint8)), (count, nranks)
        assert torch.equal(results["ring"].view(torch.uint8),
                           ring_model(inputs, op, "per_hop").view(torch.uint8))


@pytest.mark.parametrize("dtype,op", [(torch.float32, "sum"), (torch.bfloat16, "avg"),
                                      (torch.float64, "prod"), (torch.int8, "max"),
                                      (torch.int64, "min")],
                         ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("nranks", [2, 3, 5])
def test_copy_transport(dtype, op, nranks, monkeypatch):
    """RINGREDUCE_TRANSPORT=copy: every hop through cudaMemcpyPeerAsync (the path GPUs without
    peer access take), reduce-scatter via the staging buffer, all-gather straight into place."""
    monkeypatch.setenv("RINGREDUCE_TRANSPORT", "copy")
    g = torch.Generator().manual_seed(nranks * 7)
    for count in SIZES:
        _run_and_check(random_inputs(nranks, count, dtype, op, generator=g), op,
                       _devices(nranks, spread=True))


@pytest.mark.skipif(not MULTI_GPU, reason="needs two or more GPUs")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("nranks", [2, 3, 4, 8])
def test_distinct_gpus(dtype, nranks):
    g = torch.Generator().manual_seed(nranks)
    for op in valid_ops(dtype):
        for count in SIZES:
            _run_and_check(random_inputs(nranks, count, dtype, op, generator=g), op,
                           _devices(nranks, spread=True))


@pytest.mark.parametrize("path", ["ring", "oneshot"])
@pytest.mark.parametrize("offset", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int8])
def test_unaligned_storage_offsets_take_the_scalar_path(offset, dtype, path, monkeypatch):
    # 4099 elements are below the one-shot limit: the ring's scalar path needs it turned off.
    if path == "ring":
        monkeypatch.setenv("RINGREDUCE_ONESHOT_BYTES", "0")
    else:
        monkeypatch.delenv("RINGREDUCE_ONESHOT_BYTES", raising=False)
    g = torch.Generator().manual_seed(offset)
    count = 4099
    inputs = random_inputs(4, count, dtype, "sum", generator=g)
    bases = [torch.empty(count + 8, dtype=dtype, device="cuda") for _ in inputs]
    # ranks alternate between aligned and unaligned so both paths meet in one launch
    tensors = [b[(offset if r % 2 else 0):][:count] for r, b in enumerate(bases)]
    for t, x in zip(tensors, inputs):
        t.copy_(x)
    ringreduce.all_reduce(tensors)
    expected = ring_model(inputs, "sum", "per_hop")
    for t in tensors:
        assert torch.equal(t.cpu(), expected)


def test_repeatable_and_equal_on_all_ranks():
    g = torch.Generator().manual_seed(7)
    inputs = random_inputs(4, (1 << 20) + 1, torch.float32, "sum", generator=g)
    a = [x.cuda() for x in inputs]
    b = [x.cuda() for x in inputs]
    ringreduce.all_reduce(a)
    ringreduce.all_reduce(b)
    for t in a + b:
        assert torch.equal(t, a[0])


def test_matches_cpu_path_bitwise():
    g = torch.Generator().manual_seed(8)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        inputs = random_inputs(5, 10007, dtype, "avg", generator=g)
        cpu = [x.clone() for x in inputs]
        gpu = [x.cuda() for x in inputs]
        ringreduce.all_reduce(cpu, "avg")
        ringreduce.all_reduce(gpu, "avg")
        assert torch.equal(gpu[3].cpu(), cpu[3])


def _check_inputs_produced_late(seed, count, collective):
    """Inputs produced on a busy side stream right before `collective(side, tensors)` (which
    queues the all-reduce and returns the result tensors), everything overwritten there right
    after: an unordered read or a late write shows up as NaN poison or -1."""
    g = torch.Generator().manual_seed(seed)
    n = 4
    inputs = random_inputs(n, count, torch.float32, "sum", generator=g)
    staged = [x.pin_memory() for x in inputs]
    side = torch.cuda.Stream()
    big = torch.randn(4096, 4096, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        tensors = [torch.full((count,), float("nan"), device="cuda") for _ in range(n)]
        big @ big  # keep the stream busy so an unordered read would see the NaN poison
        for t, x in zip(tensors, staged):
            t.copy_(x, non_blocking=True)
    outputs = collective(side, tensors)
    with torch.cuda.stream(side):
        results = [t.clone() for t in outputs]
        for t in tensors + outputs:
            t.fill_(-1.0)
    side.synchronize()
    expected = ring_model(inputs, "sum", "per_hop")
    for r in results:
        assert torch.equal(r.cpu(), expected)


def test_stream_ordering_on_a_side_stream():
    """Inputs produced on the current stream right before the call, overwritten right after."""
    def on_current_stream(side, tensors):
        with torch.cuda.stream(side):
            return ringreduce.all_reduce(tensors)

    _check_inputs_produced_late(9, (1 << 22) + 7, on_current_stream)


def test_tensors_dropped_right_after_the_call():
    """Buffers allocated on the default stream, reduced late on a side stream, then dropped: the
    caching allocator must not hand them out before the ring is done (needs recordStream)."""
    g = torch.Generator().manual_seed(10)
    n, count = 4, (1 << 22) + 3
    inputs = random_inputs(n, count, torch.float32, "sum", generator=g)
    expected = ring_model(inputs, "sum", "per_hop")
    side = torch.cuda.Stream()
    for _ in range(3):
        tensors = [x.cuda() for x in inputs]
        keep = tensors[0]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)  # tens of milliseconds: the ring runs late
            ringreduce.all_reduce(tensors)
        del tensors
        reuse = [torch.full((count,), 7.0, device="cuda") for _ in range(n - 1)]
        torch.cuda.synchronize()
        assert torch.equal(keep.cpu(), expected)
        del reuse


def test_count_zero_and_single_rank_are_noops():
    t = [torch.empty(0, device="cuda") for _ in range(3)]
    assert ringreduce.all_reduce(t) is t
    x = torch.randn(5, device="cuda")
    before = x.clone()
    ringreduce.all_reduce([x], "avg")
    assert torch.equal(x, before)


def test_mixed_cpu_and_cuda_rejected_before_modification():
    a = torch.randn(8, device="cuda")
    b = torch.randn(8)
    before = (a.clone(), b.clone())
    with pytest.raises(ValueError, match="same device type"):
        ringreduce.all_reduce([a, b])
    assert torch.equal(a, before[0]) and torch.equal(b, before[1])


def test_build_info_reports_cuda():
    info = ringreduce.build_info()
    assert info["cuda"] is True
    assert info["arch_list"]
    report = ringreduce.peer_access()
    assert len(report["devices"]) == torch.cuda.device_count()


# The other collectives and all_reduce's outputs=, with the checks of test_collectives.py.
COLLECTIVE_SIZES = (0, 1, 7, 33, 1000, 4099, (1 << 18) + 5)


@pytest.mark.parametrize("dtype,op", list(_cases()), ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("nranks", [1, 2, 3, 4, 5, 8])
def test_collectives_simulated_ranks(dtype, op, nranks):
    g = torch.Generator().manual_seed(nranks * 1000 + len(op) + 17)
    check_reducing_collectives(dtype, op, _devices(nranks, spread=False), g, COLLECTIVE_SIZES)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("nranks", [1, 2, 3, 4, 5, 8])
def test_copying_collectives_simulated_ranks(dtype, nranks):
    g = torch.Generator().manual_seed(nranks + 29)
    check_copying_collectives(dtype, _devices(nranks, spread=False), g, COLLECTIVE_SIZES)


@pytest.mark.parametrize("dtype,op", [(torch.float32, "sum"), (torch.bfloat16, "avg"),
                                      (torch.int8, "max")],
                         ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("nranks", [2, 3, 5])
def test_collectives_copy_transport(dtype, op, nranks, monkeypatch):
    monkeypatch.setenv("RINGREDUCE_TRANSPORT", "copy")
    g = torch.Generator().manual_seed(nranks * 31)
    devices = _devices(nranks, spread=True)
    check_reducing_collectives(dtype, op, devices, g, COLLECTIVE_SIZES)
    check_copying_collectives(dtype, devices, g, COLLECTIVE_SIZES)


@pytest.mark.skipif(not MULTI_GPU, reason="needs two or more GPUs")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("nranks", [2, 3, 4, 8])
def test_collectives_distinct_gpus(dtype, nranks):
    g = torch.Generator().manual_seed(nranks + 37)
    devices = _devices(nranks, spread=True)
    for op in valid_ops(dtype):
        check_reducing_collectives(dtype, op, devices, g, COLLECTIVE_SIZES)
    check_copying_collectives(dtype, devices, g, COLLECTIVE_SIZES)


def test_collectives_on_given_streams():
    """streams=[...] runs the collective on those streams, not on the current ones."""
    def on_given_streams(side, tensors):
        # Poisoned on the side stream, where the ring writes them: filled on the current stream,
        # which the side stream never waits for, the fill could land after the result.
        with torch.cuda.stream(side):
            outputs = [torch.full_like(t, float("nan")) for t in tensors]
        return ringreduce.all_reduce(tensors, outputs=outputs, streams=[side] * len(tensors))

    _check_inputs_produced_late(41, (1 << 20) + 3, on_given_streams)


def test_distinct_streams_on_a_shared_device_are_separate_lanes():
    """Ranks on one GPU given distinct streams each run on their own stream ("virtual
    devices"); the result is the broadcast, and each stream's later work sees it."""
    tensors = [torch.full(((1 << 16) + 5,), float(r + 1), device="cuda") for r in range(3)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream(), None]
    for s in streams[:2]:
        s.wait_stream(torch.cuda.current_stream())  # the fills above are on the current stream
    ringreduce.broadcast(tensors, 0, streams=streams)
    for t, s in zip(tensors, streams):
        with torch.cuda.stream(s or torch.cuda.current_stream()):
            assert torch.equal(t, torch.ones_like(t))


def test_collectives_reject_outputs_on_another_device_before_modification():
    a = [torch.randn(8, device="cuda") for _ in range(2)]
    outs = [torch.empty(16, device="cuda"), torch.empty(16)]
    before = [t.clone() for t in a]
    with pytest.raises(ValueError, match=r"outputs\[1\] must be on the device of inputs\[1\]"):
        ringreduce.all_gather(a, outs)
    for t, b in zip(a, before):
        assert torch.equal(t, b)


# The fused ring kernel (csrc/ring/fused_cuda.h) through its test hook, and as the path of
# all_reduce that RINGREDUCE_FUSED=1 selects (not the default); these runs decide whether it
# becomes the default.
# tests/test_launch_geometry.py checks on the CPU, for the capacities of real GPUs, that the
# block counts these parameters lead to fit the flag buffer and the device.
FUSED_CASES = [(torch.float32, "sum"), (torch.float16, "avg"), (torch.bfloat16, "max"),
               (torch.int32, "sum"), (torch.int8, "bxor"), (torch.float64, "prod")]
FUSED_NRANKS = [2, 3, 4, 8]
FUSED_COUNTS = (1, 7, 33, 4099, (1 << 18) + 5)
FUSED_BLOCKS = (1, 2, 0)  # 0: the suggested count, capped by what the flag buffer holds
FUSED_FLAG_BLOCKS = 64  # blocks per rank the flag buffer is sized for


@pytest.mark.parametrize("dtype,op", FUSED_CASES, ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("nranks", FUSED_NRANKS)
def test_fused_kernel_gives_the_ring_bits(dtype, op, nranks):
    """Several calls on one flag buffer (epochs 1, 2, ...), block counts 1, 2 and the
    suggested one (which the flag buffer caps: an H100 suggests up to 129 for the largest
    size), sizes around the chunking: the ring model's bits on every rank."""
    from ringreduce import _C
    flags = torch.zeros(_C.fused_flags_bytes(nranks, FUSED_FLAG_BLOCKS), dtype=torch.uint8,
                        device="cuda")
    g = torch.Generator().manual_seed(nranks * 97 + len(op))
    epoch = 0
    for count in FUSED_COUNTS:
        for blocks in FUSED_BLOCKS:
            inputs = random_inputs(nranks, count, dtype, op, generator=g)
            tensors = [x.cuda() for x in inputs]
            epoch += 1
            used = _C.fused_all_reduce(tensors, op, blocks, flags, epoch)
            assert used == blocks or (blocks == 0 and 1 <= used <= FUSED_FLAG_BLOCKS), used
            want = ring_model(inputs, op, "per_hop").view(torch.uint8)
            for r, t in enumerate(tensors):
                assert torch.equal(t.cpu().view(torch.uint8), want), (count, blocks, r)


def _in_place_and_into_poison(inputs, op, want, label, streams=None):
    """Two CUDA all_reduces of the CPU tensors `inputs` (on `streams`, if given): in place, then
    into outputs filled with 0x5A bytes; every rank's result must have the bytes `want` and the
    second call's inputs must stay unchanged."""
    tensors = [x.cuda() for x in inputs]
    torch.cuda.synchronize()
    ringreduce.all_reduce(tensors, op, streams=streams)
    torch.cuda.synchronize()
    for r, t in enumerate(tensors):
        assert torch.equal(t.cpu().view(torch.uint8), want), (label, r)
    sources = [x.cuda() for x in inputs]
    outputs = [torch.empty_like(t) for t in sources]
    for o in outputs:
        o.view(torch.uint8).fill_(0x5A)
    torch.cuda.synchronize()
    ringreduce.all_reduce(sources, op, outputs=outputs, streams=streams)
    torch.cuda.synchronize()
    for r, (src, o) in enumerate(zip(sources, outputs)):
        assert torch.equal(o.cpu().view(torch.uint8), want), (label, r)
        assert torch.equal(src.cpu(), inputs[r]), (label, r)


@pytest.mark.parametrize("dtype,op", FUSED_CASES, ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("nranks", [2, 3, 4])
def test_fused_path_of_all_reduce_gives_the_ring_bits(dtype, op, nranks, monkeypatch):
    """RINGREDUCE_FUSED=1 with the one-shot off: every all_reduce on one stream of one GPU runs
    the fused kernel (counted by _C.fused_calls, so the ring beside it cannot pass for it), in
    place and into poisoned outputs, with the ring model's bits; the inputs of the out-of-place
    call stay unchanged. Without the setting the fused path does not run."""
    from ringreduce import _C
    seed = nranks * 131 + len(op)
    print(f"seed {seed}")
    g = torch.Generator().manual_seed(seed)
    monkeypatch.setenv("RINGREDUCE_ONESHOT_BYTES", "0")
    for count in (1, 33, 4099, (1 << 18) + 5):
        inputs = random_inputs(nranks, count, dtype, op, generator=g)
        want = ring_model(inputs, op, "per_hop").view(torch.uint8)
        monkeypatch.setenv("RINGREDUCE_FUSED", "1")
        before = _C.fused_calls()
        _in_place_and_into_poison(inputs, op, want, count)
        assert _C.fused_calls() == before + 2, count
        monkeypatch.delenv("RINGREDUCE_FUSED")
        ringreduce.all_reduce([x.cuda() for x in inputs], op)
        assert _C.fused_calls() == before + 2, count


def test_fused_path_stays_out_of_capture_and_of_several_streams(monkeypatch):
    """RINGREDUCE_FUSED=1: a captured call (the fused path synchronises) and a call over two
    streams take the ring, with its bits."""
    from ringreduce import _C
    monkeypatch.setenv("RINGREDUCE_FUSED", "1")
    monkeypatch.setenv("RINGREDUCE_ONESHOT_BYTES", "0")
    g = torch.Generator().manual_seed(4646)
    inputs = random_inputs(3, 4099, torch.float32, "sum", generator=g)
    want = ring_model(inputs, "sum", "per_hop")
    tensors = [x.cuda() for x in inputs]
    before = _C.fused_calls()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ringreduce.all_reduce(tensors)
    for t, x in zip(tensors, inputs):
        t.copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(t.cpu(), want) for t in tensors)
    streams = [torch.cuda.Stream(), torch.cuda.Stream(), None]
    tensors = [x.cuda() for x in inputs]
    torch.cuda.synchronize()
    ringreduce.all_reduce(tensors, streams=streams)
    torch.cuda.synchronize()
    assert all(torch.equal(t.cpu(), want) for t in tensors)
    assert _C.fused_calls() == before


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16],
                         ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("nranks", [2, 3, 4, 7])
def test_cuda_half_rounding_once_gives_the_cpu_bits(dtype, op, nranks, monkeypatch):
    """RINGREDUCE_CUDA_HALF_ROUNDING=once: float16 / bfloat16 sums and averages on one stream of
    one GPU, at one-shot and ring sizes, give once_rounded_model's bits (the fp32 sum in rank
    order, rounded once) and the CPU path's, in place and into poisoned outputs. From 3 ranks
    the per-hop ring's bits differ somewhere on these inputs, so the once-rounded kernel, not
    the ring, gave them."""
    seed = 4747 + nranks * 10 + len(op)
    print(f"seed {seed}")
    g = torch.Generator().manual_seed(seed)
    monkeypatch.setenv("RINGREDUCE_CUDA_HALF_ROUNDING", "once")
    monkeypatch.delenv("RINGREDUCE_HALF_ROUNDING", raising=False)  # the CPU's default: once
    differs = False
    for count in (1, 33, 4099, (1 << 18) + 5):
        inputs = random_inputs(nranks, count, dtype, op, generator=g)
        want = once_rounded_model(inputs, op).view(torch.uint8)
        on_cpu = [x.clone() for x in inputs]
        ringreduce.all_reduce(on_cpu, op)
        assert torch.equal(on_cpu[0].view(torch.uint8), want), count
        differs = differs or not torch.equal(ring_model(inputs, op, "per_hop").view(torch.uint8),
                                             want)
        _in_place_and_into_poison(inputs, op, want, count)
    assert differs or nranks == 2, "the per-hop ring gave the once-rounded bits everywhere"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16],
                         ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("nranks", [2, 3, 4, 7])
@pytest.mark.parametrize("layout", ["streams", "copy"])
def test_cuda_half_rounding_once_two_shot_gives_the_cpu_bits(dtype, op, nranks, layout,
                                                            monkeypatch):
    """RINGREDUCE_CUDA_HALF_ROUNDING=once where the one-shot does not run: a stream per rank
    (lanes ordered by events, as distinct GPUs are) or the copy transport (every read staged
    through cudaMemcpyPeerAsync) run the once-rounded two-shot (cuda_executor.h
    run_once_rounded), which must give once_rounded_model's bits and the CPU path's, in place
    and into poisoned outputs, at sizes where some ranks' chunks are empty (1, 33) and at large
    ones. From 3 ranks the per-hop ring's bits differ somewhere on these inputs."""
    seed = 4848 + nranks * 10 + len(op)
    print(f"seed {seed}")
    g = torch.Generator().manual_seed(seed)
    monkeypatch.setenv("RINGREDUCE_CUDA_HALF_ROUNDING", "once")
    monkeypatch.delenv("RINGREDUCE_HALF_ROUNDING", raising=False)
    if layout == "copy":
        monkeypatch.setenv("RINGREDUCE_TRANSPORT", "copy")
        streams = None
    else:
        streams = [torch.cuda.Stream() for _ in range(nranks)]
    differs = False
    for count in (1, 33, 4099, (1 << 18) + 5):
        inputs = random_inputs(nranks, count, dtype, op, generator=g)
        want = once_rounded_model(inputs, op).view(torch.uint8)
        differs = differs or not torch.equal(ring_model(inputs, op, "per_hop").view(torch.uint8),
                                             want)
        _in_place_and_into_poison(inputs, op, want, (layout, count), streams=streams)
    assert differs or nranks == 2, "the per-hop ring gave the once-rounded bits everywhere"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16],
                         ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("nranks", [2, 3, 4, 7])
@pytest.mark.parametrize("layout", ["stream", "streams", "copy"])
def test_cuda_half_rounding_once_reduce_and_reduce_scatter_give_the_cpu_bits(
        dtype, op, nranks, layout, monkeypatch):
    """RINGREDUCE_CUDA_HALF_ROUNDING=once: the list API's reduce (into a poisoned output, and in
    place at the root) and reduce_scatter (into poisoned outputs, and in place: block r of
    inputs[r]) run run_once_rounded on one stream, on a stream per rank and with the copy
    transport, and give once_rounded_model's bits; inputs not written stay unchanged."""
    seed = 4949 + nranks * 10 + len(op)
    print(f"seed {seed}")
    g = torch.Generator().manual_seed(seed)
    monkeypatch.setenv("RINGREDUCE_CUDA_HALF_ROUNDING", "once")
    if layout == "copy":
        monkeypatch.setenv("RINGREDUCE_TRANSPORT", "copy")
    streams = [torch.cuda.Stream() for _ in range(nranks)] if layout == "streams" else None
    bits = lambda t: t.cpu().view(torch.uint8)  # noqa: E731
    for count in (1, 33, 4099, (1 << 18) + 5):
        inputs = random_inputs(nranks, count, dtype, op, generator=g)
        want = bits(once_rounded_model(inputs, op))
        root = count % nranks
        tensors = [x.cuda() for x in inputs]
        output = torch.empty_like(tensors[root])
        output.view(torch.uint8).fill_(0x5A)
        torch.cuda.synchronize()
        ringreduce.reduce(tensors, output, root=root, op=op, streams=streams)
        torch.cuda.synchronize()
        assert torch.equal(bits(output), want), ("reduce", count)
        assert all(torch.equal(t.cpu(), x) for t, x in zip(tensors, inputs)), ("reduce", count)
        ringreduce.reduce(tensors, root=root, op=op, streams=streams)
        torch.cuda.synchronize()
        assert torch.equal(bits(tensors[root]), want), ("reduce in place", count)

        blocks = random_inputs(nranks, nranks * count, dtype, op, generator=g)
        wants = [bits(once_rounded_model([b[r * count:(r + 1) * count] for b in blocks], op))
                 for r in range(nranks)]
        sources = [b.cuda() for b in blocks]
        outputs = [torch.empty(count, dtype=dtype, device="cuda") for _ in range(nranks)]
        for o in outputs:
            o.view(torch.uint8).fill_(0x5A)
        torch.cuda.synchronize()
        ringreduce.reduce_scatter(sources, outputs, op=op, streams=streams)
        torch.cuda.synchronize()
        for r in range(nranks):
            assert torch.equal(bits(outputs[r]), wants[r]), ("reduce_scatter", count, r)
            assert torch.equal(sources[r].cpu(), blocks[r]), ("reduce_scatter", count, r)
        ringreduce.reduce_scatter(sources, [s[r * count:(r + 1) * count]
                                            for r, s in enumerate(sources)], op=op,
                                  streams=streams)
        torch.cuda.synchronize()
        for r in range(nranks):
            assert torch.equal(bits(sources[r][r * count:(r + 1) * count]), wants[r]), (
                "reduce_scatter in place", count, r)


def test_fused_kernel_refuses_too_many_blocks_and_stale_epochs():
    from ringreduce import _C
    tensors = [torch.full((4099,), float(r), device="cuda") for r in range(4)]
    before = [t.clone() for t in tensors]
    flags = torch.zeros(_C.fused_flags_bytes(4, 1 << 14), dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError):
        _C.fused_all_reduce(tensors, "sum", 1 << 14, flags, 1)
    for t, b in zip(tensors, before):
        assert torch.equal(t, b)
    _C.fused_all_reduce(tensors, "sum", 1, flags, 5)
    assert torch.equal(tensors[0], torch.full_like(tensors[0], 6.0))
    with pytest.raises(RuntimeError, match="epoch"):
        _C.fused_all_reduce(tensors, "sum", 1, flags, 5)  # reused
    _C.fused_all_reduce([t.fill_(1.0) for t in tensors], "sum", 1, flags, 6)
    assert torch.equal(tensors[3], torch.full_like(tensors[3], 4.0))


# RINGREDUCE_CUDA_STEP_UNROLL=4 (issue 46): four 16-byte packs in flight per thread of every ring
# step kernel. Read once per process, so it runs in a process of its own. Its body is checked
# pack by pack on the CPU (tests/test_step_kernel.py); this is the GPU's say.
_UNROLL_SCRIPT = r"""
import sys
import torch
sys.path.insert(0, sys.argv[1])
import ringreduce
from reference import random_inputs, ring_model
cases = [(torch.float32, "sum"), (torch.float16, "avg"), (torch.bfloat16, "max"),
         (torch.int32, "sum"), (torch.int8, "bxor"), (torch.float64, "prod")]
g = torch.Generator().manual_seed(4646)
checked = 0
for nranks in (2, 3, 4):
    for dtype, op in cases:
        for count in (1, 33, 4099, (1 << 18) + 5, (1 << 22) + 3):
            inputs = random_inputs(nranks, count, dtype, op, generator=g)
            want = ring_model(inputs, op, "per_hop").view(torch.uint8)
            tensors = [x.cuda() for x in inputs]
            ringreduce.all_reduce(tensors, op)
            for r, t in enumerate(tensors):
                assert torch.equal(t.cpu().view(torch.uint8), want), (nranks, dtype, op, count, r)
            checked += 1
print("unroll ok", checked)
"""


@pytest.mark.timeout(600)
def test_step_unroll_4_gives_the_ring_bits():
    """The ring's list API with four packs in flight per thread, the one-shot off: the ring
    model's bits for 2-4 simulated ranks on one GPU, 6 dtype/op pairs, sizes to 16 MiB."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, RINGREDUCE_CUDA_STEP_UNROLL="4", RINGREDUCE_ONESHOT_BYTES="0")
    proc = subprocess.run([sys.executable, "-c", _UNROLL_SCRIPT, here], env=env,
                          capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0 and "unroll ok 90" in proc.stdout, proc.stdout + proc.stderr
