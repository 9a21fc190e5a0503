"""Bad input: a clear exception naming the argument and the rule, before any tensor changes."""
import sys

import pytest
import torch
import torch.distributed as dist

import ringreduce
from checks import run_bounded, seeded
from reference import BITWISE_OPS, random_inputs, ring_model


def _ranks(n=3, count=8, dtype=torch.float32):
    g = torch.Generator().manual_seed(n * 100 + count)
    return [torch.randn(count, generator=g).to(dtype) + 3 for _ in range(n)]


def _check_untouched(tensors, fn, exc, match):
    before = [t.clone() for t in tensors]
    with pytest.raises(exc, match=match):
        fn(tensors)
    for t, b in zip(tensors, before):
        assert torch.equal(t, b), "a tensor was modified before the error was raised"


@pytest.mark.parametrize("arg,exc,match", [
    ([], ValueError, "one tensor per rank"),
    (torch.ones(3), TypeError, "must be a list"),
    ("abc", TypeError, "must be a list"),
    (None, TypeError, "must be a list"),
    ([torch.ones(3), 3.0], TypeError, r"tensors\[1\] must be a torch.Tensor"),
])
def test_bad_container(arg, exc, match):
    with pytest.raises(exc, match=match):
        ringreduce.all_reduce(arg)


def test_shape_mismatch():
    t = _ranks()
    t.append(torch.randn(9))
    _check_untouched(t, ringreduce.all_reduce, ValueError, r"same shape.*tensors\[3\]")


def test_same_numel_different_shape():
    t = [torch.randn(2, 3) + 3, torch.randn(3, 2) + 3]
    _check_untouched(t, ringreduce.all_reduce, ValueError, "same shape")


def test_dtype_mismatch():
    t = _ranks() + [torch.randn(8, dtype=torch.float64)]
    _check_untouched(t, ringreduce.all_reduce, TypeError, r"same dtype.*tensors\[3\]")


def test_device_type_mismatch():
    t = _ranks(2) + [torch.empty(8, device="meta")]
    _check_untouched(t[:2], lambda ts: ringreduce.all_reduce(ts + t[2:]), ValueError,
                     "same device type")


def test_unsupported_device_type():
    with pytest.raises(ValueError, match="only cpu and cuda"):
        ringreduce.all_reduce([torch.empty(8, device="meta"), torch.empty(8, device="meta")])


def test_non_contiguous():
    t = _ranks(2) + [torch.randn(16)[::2]]
    _check_untouched(t, ringreduce.all_reduce, ValueError, r"tensors\[2\] is not contiguous")


def test_sparse_layout():
    t = [torch.eye(3).to_sparse(), torch.eye(3).to_sparse()]
    with pytest.raises(ValueError, match="layout"):
        ringreduce.all_reduce(t)


def test_same_tensor_twice():
    a = _ranks(1)[0]
    b = _ranks(2)[1]
    _check_untouched([b, a, a], ringreduce.all_reduce, ValueError, "overlap")


def test_overlapping_views():
    base = torch.randn(12) + 3
    before = base.clone()
    with pytest.raises(ValueError, match=r"tensors\[0\] and tensors\[1\] overlap"):
        ringreduce.all_reduce([base[0:8], base[4:12]])
    assert torch.equal(base, before)


@pytest.mark.parametrize("op", ["xor", "SUMM", "", 0, None, dist.ReduceOp.PREMUL_SUM])
def test_unknown_op(op):
    _check_untouched(_ranks(), lambda ts: ringreduce.all_reduce(ts, op), ValueError, "op must be one of")


@pytest.mark.parametrize("spelling", ["SUM", "Sum", "MAX", "Min", "PROD", "AVG", "bAnD", "BXOR"])
def test_op_names_are_case_insensitive(spelling):
    """Each spelling reduces as its lower-case op: every rank holds the ring model's bits."""
    op = spelling.lower()
    dtype = torch.int32 if op in BITWISE_OPS else torch.float32
    inputs = random_inputs(3, 33, dtype, op, generator=seeded("case", spelling))
    tensors = [t.clone() for t in inputs]
    ringreduce.all_reduce(tensors, spelling)
    expected = ring_model(inputs, op)
    for r, t in enumerate(tensors):
        assert torch.equal(t, expected), f"op {spelling!r}: rank {r} differs from the {op} model"


@pytest.mark.parametrize("dtype", [torch.complex64, torch.int16, torch.float8_e4m3fn])
def test_unsupported_dtype(dtype):
    t = [torch.ones(4, dtype=dtype), torch.ones(4, dtype=dtype)]
    with pytest.raises(TypeError, match="not supported"):
        ringreduce.all_reduce(t)


def test_avg_on_bool():
    t = [torch.tensor([True, False, True]) for _ in range(3)]
    _check_untouched(t, lambda ts: ringreduce.all_reduce(ts, "avg"), TypeError,
                     "op 'avg' needs a numeric dtype, not bool; got bool")


@pytest.mark.parametrize("op", ["band", "bor", "bxor", dist.ReduceOp.BXOR])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_bitwise_op_on_floats(op, dtype):
    t = _ranks(dtype=dtype)
    _check_untouched(t, lambda ts: ringreduce.all_reduce(ts, op), TypeError,
                     "needs an integer or bool dtype; got")


@pytest.mark.skipif(ringreduce.build_info()["cuda"],
                    reason="this ringreduce build has CUDA support (the check is the CPU-only "
                           "build's)")
@pytest.mark.parametrize("fn", ["all_reduce", "reduce", "broadcast", "all_gather",
                                "reduce_scatter"])
def test_cuda_tensors_on_cpu_build(fn):
    """A CPU-only build refuses CUDA tensors, naming the device and the reason. No GPU needed:
    the tensors are torch's fake tensors on cuda:0 (FakeTensorMode: a device, no memory), and
    with no elements nothing of theirs is read before the check."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        ins = [torch.empty(0, device="cuda") for _ in range(2)]
        outs = [torch.empty(0, device="cuda") for _ in range(2)]
    assert all(t.is_cuda for t in ins + outs), "FakeTensorMode made no CUDA tensors"
    call = {"all_reduce": lambda: ringreduce.all_reduce(ins),
            "reduce": lambda: ringreduce.reduce(ins),
            "broadcast": lambda: ringreduce.broadcast(ins),
            "all_gather": lambda: ringreduce.all_gather(ins, outs),
            "reduce_scatter": lambda: ringreduce.reduce_scatter(ins, outs)}[fn]
    with pytest.raises(RuntimeError, match=f"ringreduce.{fn}: tensors are on cuda:0 but this "
                                           "ringreduce build has no CUDA support"):
        call()


_SIXTY_FIVE_RANKS = """
import torch, ringreduce
from torch._subclasses.fake_tensor import FakeTensorMode
with FakeTensorMode():
    ins = [torch.empty(0, device="cuda") for _ in range(65)]
assert all(t.is_cuda for t in ins), "FakeTensorMode made no CUDA tensors"
for _ in range(2):
    try:
        ringreduce.all_reduce(ins)
        print("no error")
    except RuntimeError as exc:
        print(type(exc).__name__, exc)
"""


@pytest.mark.skipif(not ringreduce.build_info()["cuda"],
                    reason="the 64-rank limit is the CUDA build's (a CPU-only build refuses CUDA "
                           "tensors first: test_cuda_tensors_on_cpu_build)")
def test_65_cuda_ranks_raise_out_of_the_cuda_build_without_a_gpu():
    """The c10::Error that 65 CUDA ranks raise out of _C (TORCH_CHECK in check_device_support;
    on an H100 this call died of SIGSEGV instead, docs/GPU_SESSION.md), raised by the CUDA
    build without a GPU, twice, in a fresh process (so the first is the first c10::Error out
    of _C there, as in the crash): torch's fake tensors on cuda:0 (a device, no memory; with no
    elements nothing of theirs is read before the check). Passing here puts the crash in what
    a GPU adds, not in raising through the CUDA build."""
    status, out = run_bounded([sys.executable, "-c", _SIXTY_FIVE_RANKS], timeout=120)
    expected = ("RuntimeError ringreduce.all_reduce: at most 64 ranks are supported on CUDA; "
                "got 65")
    lines = [line for line in out.splitlines() if line.startswith(("RuntimeError", "no error"))]
    assert status == 0 and lines == [expected] * 2, f"exit {status}:\n{out}"


def test_single_rank_is_noop():
    t = _ranks(1)
    before = t[0].clone()
    assert ringreduce.all_reduce(t, "avg") is t
    assert torch.equal(t[0], before)


def test_tuple_is_accepted():
    t = tuple(_ranks(2))
    out = ringreduce.all_reduce(t)
    assert out is t and torch.equal(t[0], t[1])


def test_build_info():
    info = ringreduce.build_info()
    for key in ("version", "cuda", "arch_list", "torch_version", "cuda_version"):
        assert key in info
    assert info["torch_version"] == torch.__version__
    if info["cuda"]:
        assert info["arch_list"], "a CUDA build must report the architectures it targets"
    report = ringreduce.peer_access()
    n = len(report["devices"])
    assert len(report["can_access_peer"]) == n
    assert all(len(row) == n for row in report["can_access_peer"])


# The other collectives (reduce, broadcast, all_gather, reduce_scatter) and all_reduce's
# outputs=: every bad argument raises, naming it, before any input or output changes.

def _raises_untouched(call, tensors, exc, match):
    def raw(t):  # bytes, so that uninitialised NaNs compare equal
        return t.detach().contiguous().reshape(-1).view(torch.uint8).clone()

    before = [raw(t) for t in tensors]
    with pytest.raises(exc, match=match):
        call()
    for t, b in zip(tensors, before):
        assert torch.equal(raw(t), b), "a tensor was modified before the error was raised"


def _outs(n=3, count=8, dtype=torch.float32):
    return [torch.full((count,), 7.0).to(dtype) for _ in range(n)]


@pytest.mark.parametrize("outputs,exc,match", [
    (lambda: _outs(2), ValueError, r"outputs must hold one tensor per rank.*got 2"),
    (lambda: [], ValueError, r"outputs must hold one tensor per rank.*got 0"),
    (lambda: _outs(count=9), ValueError, r"outputs\[0\] must have 8 elements"),
    (lambda: _outs(dtype=torch.float64), TypeError, r"outputs\[0\] must have the dtype"),
    (lambda: _outs()[:2] + [torch.empty(8, device="meta")], ValueError,
     r"outputs\[2\] must be on the device"),
    (lambda: _outs()[:2] + [torch.randn(16)[::2]], ValueError, r"outputs\[2\] is not contiguous"),
    (lambda: _outs()[:2] + [3.0], TypeError, r"outputs\[2\] must be a torch.Tensor"),
    (lambda: torch.ones(8), TypeError, "outputs must be a list"),
])
def test_all_reduce_bad_outputs(outputs, exc, match):
    ins, outs = _ranks(), outputs()
    tensors = ins + [o for o in (outs if isinstance(outs, list) else [outs])
                     if isinstance(o, torch.Tensor) and o.device.type == "cpu"]
    _raises_untouched(lambda: ringreduce.all_reduce(ins, outputs=outs), tensors, exc, match)


def test_all_reduce_outputs_overlapping_another_rank():
    ins = _ranks()
    outs = [ins[1], torch.empty(8), torch.empty(8)]
    _raises_untouched(lambda: ringreduce.all_reduce(ins, outputs=outs), ins + outs, ValueError,
                      r"tensors\[1\] and outputs\[0\] overlap.*may be tensors\[i\] itself")
    base = torch.zeros(20)
    outs = [base[0:8], base[4:12], torch.empty(8)]
    _raises_untouched(lambda: ringreduce.all_reduce(ins, outputs=outs), ins + [base], ValueError,
                      r"outputs\[0\] and outputs\[1\] overlap")
    # a partial overlap with the rank's own input is not in place
    base = torch.randn(12) + 3
    outs = [torch.empty(8), torch.empty(8), base[2:10]]
    _raises_untouched(lambda: ringreduce.all_reduce(ins[:2] + [base[:8]], outputs=outs),
                      ins + [base], ValueError, r"tensors\[2\] and outputs\[2\] overlap")


def test_all_reduce_outputs_positionally_is_rejected():
    ins = _ranks()
    _raises_untouched(lambda: ringreduce.all_reduce(ins, _outs()), ins, TypeError, "outputs=")


@pytest.mark.parametrize("root,exc,match", [
    (-1, ValueError, r"root must be a rank in \[0, 3\); got -1"),
    (3, ValueError, r"root must be a rank in \[0, 3\); got 3"),
    (True, TypeError, "root must be an int"),
    ("0", TypeError, "root must be an int"),
    (None, TypeError, "root must be an int"),
])
@pytest.mark.parametrize("fn", ["reduce", "broadcast"])
def test_bad_root(fn, root, exc, match):
    ins = _ranks()
    call = {"reduce": lambda: ringreduce.reduce(ins, None, root),
            "broadcast": lambda: ringreduce.broadcast(ins, root)}[fn]
    _raises_untouched(call, ins, exc, f"ringreduce.{fn}: {match}")


@pytest.mark.parametrize("case,exc,match", [
    (lambda ins: (ins, torch.empty(9)), ValueError, "output must have 8 elements"),
    (lambda ins: (ins, torch.empty(8, dtype=torch.float64)), TypeError,
     "output must have the dtype"),
    (lambda ins: (ins, torch.empty(8, device="meta")), ValueError,
     "output must be on the device"),
    (lambda ins: (ins, torch.empty(16)[::2]), ValueError, "output is not contiguous"),
    (lambda ins: (ins, [torch.empty(8)] * 3), TypeError, "output must be one torch.Tensor"),
    (lambda ins: (ins, ins[0]), ValueError, r"inputs\[0\] and output overlap"),
    (lambda ins: (ins, torch.cat([ins[1], ins[1]])[3:11]), None, None),
    (lambda ins: ((lambda base: ([ins[0], base[:8], ins[2]], base[2:10]))(torch.randn(12) + 3)),
     ValueError, r"inputs\[1\] and output overlap.*inputs\[root\] itself"),
])
def test_reduce_bad_output(case, exc, match):
    ins, out = case(_ranks())
    if exc is None:  # a control: a distinct output is fine
        assert ringreduce.reduce(ins, out, root=1) is out
        return
    touched = ins + ([out] if isinstance(out, torch.Tensor) and out.device.type == "cpu" else [])
    _raises_untouched(lambda: ringreduce.reduce(ins, out, root=1), touched, exc,
                      f"ringreduce.reduce: {match}")


def test_reduce_other_checks():
    ins = _ranks()
    _raises_untouched(lambda: ringreduce.reduce(ins, comms=[object()]), ins, ValueError,
                      r"ringreduce.reduce: comms \(NCCL communicators\)")
    _raises_untouched(lambda: ringreduce.reduce(ins + [torch.randn(9)]), ins, ValueError,
                      r"same shape.*inputs\[3\]")
    _raises_untouched(lambda: ringreduce.reduce(ins, op="xor"), ins, ValueError,
                      "op must be one of")
    _raises_untouched(lambda: ringreduce.reduce(ins, op="band"), ins, TypeError,
                      "ringreduce.reduce: op 'band' needs an integer or bool dtype")
    bools = [torch.ones(8, dtype=torch.bool) for _ in range(3)]
    _raises_untouched(lambda: ringreduce.reduce(bools, op="avg"), bools, TypeError, "not bool")
    _raises_untouched(lambda: ringreduce.reduce(ins[:1] + [ins[0]]), ins, ValueError,
                      r"inputs\[0\] and inputs\[1\] overlap")


def test_broadcast_checks():
    ins = _ranks()
    _raises_untouched(lambda: ringreduce.broadcast([ins[0], ins[1], ins[1]]), ins, ValueError,
                      r"ringreduce.broadcast: inputs\[1\] and inputs\[2\] overlap")
    _raises_untouched(lambda: ringreduce.broadcast(ins + [torch.randn(8, dtype=torch.float64)]),
                      ins, TypeError, r"same dtype.*inputs\[3\]")
    _raises_untouched(lambda: ringreduce.broadcast(ins[:2] + [torch.randn(16)[::2]]), ins,
                      ValueError, r"inputs\[2\] is not contiguous")
    _raises_untouched(lambda: ringreduce.broadcast(ins, comms=1), ins, ValueError, "comms")
    with pytest.raises(ValueError, match="one tensor per rank"):
        ringreduce.broadcast([])
    with pytest.raises(TypeError, match="inputs must be a list"):
        ringreduce.broadcast(ins[0])


@pytest.mark.parametrize("outputs,exc,match", [
    (lambda ins: _outs(2, 24), ValueError, r"outputs must hold one tensor per rank"),
    (lambda ins: _outs(3, 8), ValueError, r"outputs\[0\] must have 24 elements; got 8"),
    (lambda ins: _outs(3, 24, torch.float16), TypeError, r"outputs\[0\] must have the dtype"),
    (lambda ins: _outs(3, 24)[:2] + [torch.empty(24, device="meta")], ValueError,
     r"outputs\[2\] must be on the device"),
    (lambda ins: _outs(3, 24)[:2] + [torch.empty(48)[::2]], ValueError,
     r"outputs\[2\] is not contiguous"),
    (lambda ins: [torch.empty(24)] * 3, ValueError, r"outputs\[0\] and outputs\[1\] overlap"),
])
def test_all_gather_bad_outputs(outputs, exc, match):
    ins = _ranks()
    outs = outputs(ins)
    touched = ins + [o for o in outs if o.device.type == "cpu"]
    _raises_untouched(lambda: ringreduce.all_gather(ins, outs), touched, exc,
                      f"ringreduce.all_gather: {match}")


def test_all_gather_overlap_rules():
    outs = [torch.zeros(24) for _ in range(3)]
    # in place: inputs[i] is block i of outputs[i]
    ins = [outs[i][8 * i:8 * (i + 1)] for i in range(3)]
    for i, t in enumerate(ins):
        t.copy_(torch.arange(8.0) + 10 * i)
    ringreduce.all_gather(ins, outs)
    for out in outs:
        assert torch.equal(out, torch.cat([torch.arange(8.0) + 10 * i for i in range(3)]))
    # block 0 of outputs[1] is not inputs[1]'s place
    outs = [torch.zeros(24) for _ in range(3)]
    ins = [torch.ones(8), outs[1][:8], torch.ones(8)]
    _raises_untouched(lambda: ringreduce.all_gather(ins, outs), ins + outs, ValueError,
                      r"inputs\[1\] and outputs\[1\] overlap.*block i of outputs\[i\]")
    ins = [torch.ones(8), torch.ones(8), outs[0][16:]]
    _raises_untouched(lambda: ringreduce.all_gather(ins, outs), ins + outs, ValueError,
                      r"inputs\[2\] and outputs\[0\] overlap")


@pytest.mark.parametrize("outputs,exc,match", [
    (lambda: _outs(4, 8), ValueError, r"outputs must hold one tensor per rank"),
    (lambda: _outs(3, 7), ValueError, r"outputs\[0\] must have 8 elements; got 7"),
    (lambda: _outs(3, 8, torch.float64), TypeError, r"outputs\[0\] must have the dtype"),
    (lambda: _outs(3, 8)[:1] + [torch.empty(8, device="meta")] + _outs(1, 8), ValueError,
     r"outputs\[1\] must be on the device"),
    (lambda: [torch.empty(8)] * 3, ValueError, r"outputs\[0\] and outputs\[1\] overlap"),
])
def test_reduce_scatter_bad_outputs(outputs, exc, match):
    ins = _ranks(3, 24)
    outs = outputs()
    touched = ins + [o for o in outs if o.device.type == "cpu"]
    _raises_untouched(lambda: ringreduce.reduce_scatter(ins, outs), touched, exc,
                      f"ringreduce.reduce_scatter: {match}")


def test_reduce_scatter_other_checks():
    ins = _ranks(3, 10)
    outs = _outs(3, 3)
    _raises_untouched(lambda: ringreduce.reduce_scatter(ins, outs), ins + outs, ValueError,
                      r"multiple of 3 elements\); inputs\[0\] has 10")
    ins = _ranks(3, 24)
    outs = [ins[0][8:16], torch.empty(8), torch.empty(8)]
    _raises_untouched(lambda: ringreduce.reduce_scatter(ins, outs), ins + outs, ValueError,
                      r"inputs\[0\] and outputs\[0\] overlap.*block i of inputs\[i\]")
    outs = [torch.empty(8), ins[2][8:16], torch.empty(8)]
    _raises_untouched(lambda: ringreduce.reduce_scatter(ins, outs), ins + outs, ValueError,
                      r"inputs\[2\] and outputs\[1\] overlap")
    _raises_untouched(lambda: ringreduce.reduce_scatter(ins, _outs(3, 8), op="bogus"), ins,
                      ValueError, "op must be one of")
    _raises_untouched(lambda: ringreduce.reduce_scatter(ins, _outs(3, 8), op="bor"), ins,
                      TypeError, "ringreduce.reduce_scatter: op 'bor' needs an integer or bool")
    with pytest.raises(TypeError, match="outputs must be a list"):
        ringreduce.reduce_scatter(ins, None)


def test_bad_streams():
    ins = _ranks()
    outs = [torch.empty(24) for _ in range(3)]
    _raises_untouched(lambda: ringreduce.all_gather(ins, outs, streams="s"), ins + outs,
                      TypeError, "streams must be None or a list")
    _raises_untouched(lambda: ringreduce.all_gather(ins, outs, streams=[None, 3, None]),
                      ins + outs, TypeError, r"streams\[1\] must be a torch.cuda.Stream")
    _raises_untouched(lambda: ringreduce.all_gather(ins, outs, streams=[None]), ins + outs,
                      ValueError, r"streams must hold one stream \(or None\) per rank")
    cpu_stream = torch.Stream(device="cpu")
    _raises_untouched(lambda: ringreduce.all_reduce(ins, streams=[None, cpu_stream, None]), ins,
                      ValueError, r"streams\[1\] is given but tensors\[1\] is on cpu")


@pytest.mark.parametrize("name,value,message", [
    ("RINGREDUCE_ONESHOT_BYTES", "-1", "RINGREDUCE_ONESHOT_BYTES must be a whole number of bytes"),
    ("RINGREDUCE_ONESHOT_BYTES", "64k", "RINGREDUCE_ONESHOT_BYTES must be a whole number of bytes"),
    ("RINGREDUCE_ONESHOT_BYTES", "1.5", "RINGREDUCE_ONESHOT_BYTES must be a whole number of bytes"),
    ("RINGREDUCE_FUSED", "2", "RINGREDUCE_FUSED must be 0"),
    ("RINGREDUCE_FUSED", "yes", "RINGREDUCE_FUSED must be 0"),
    ("RINGREDUCE_FUSED", "true", "RINGREDUCE_FUSED must be 0"),
    ("RINGREDUCE_CUDA_HALF_ROUNDING", "1", "RINGREDUCE_CUDA_HALF_ROUNDING must be 'per_hop'"),
    ("RINGREDUCE_CUDA_HALF_ROUNDING", "ONCE", "RINGREDUCE_CUDA_HALF_ROUNDING must be 'per_hop'")])
def test_bad_path_settings(name, value, message, monkeypatch):
    ins = _ranks()
    monkeypatch.setenv(name, value)
    _raises_untouched(lambda: ringreduce.all_reduce(ins), ins, ValueError, message)


def test_fused_setting_leaves_cpu_tensors_on_the_cpu_path(monkeypatch):
    """RINGREDUCE_FUSED=1 concerns CUDA tensors on one stream of one GPU only: CPU tensors still
    get the CPU path's result (exact integer sums), and the fused path does not run."""
    g = torch.Generator().manual_seed(46)
    print("seed 46")
    ins = [torch.randint(-99, 99, (1001,), generator=g, dtype=torch.int64) for _ in range(3)]
    expect = ins[0] + ins[1] + ins[2]
    before = ringreduce._C.fused_calls()
    monkeypatch.setenv("RINGREDUCE_FUSED", "1")
    ringreduce.all_reduce(ins)
    assert all(torch.equal(t, expect) for t in ins)
    assert ringreduce._C.fused_calls() == before


def test_settings_follow_the_environment_at_each_call(monkeypatch):
    monkeypatch.delenv("RINGREDUCE_TRANSPORT", raising=False)
    monkeypatch.delenv("RINGREDUCE_ONESHOT_BYTES", raising=False)
    monkeypatch.delenv("RINGREDUCE_HALF_ROUNDING", raising=False)
    monkeypatch.delenv("RINGREDUCE_FUSED", raising=False)
    monkeypatch.delenv("RINGREDUCE_CUDA_HALF_ROUNDING", raising=False)
    assert ringreduce.settings() == {"transport": "p2p",
                                     "oneshot_max_bytes": ringreduce.core.ONESHOT_DEFAULT_BYTES,
                                     "half_rounding": "once", "fused": False,
                                     "cuda_half_rounding": "per_hop"}
    monkeypatch.setenv("RINGREDUCE_TRANSPORT", "copy")
    monkeypatch.setenv("RINGREDUCE_ONESHOT_BYTES", "0")
    monkeypatch.setenv("RINGREDUCE_HALF_ROUNDING", "per_hop")
    monkeypatch.setenv("RINGREDUCE_FUSED", "1")
    monkeypatch.setenv("RINGREDUCE_CUDA_HALF_ROUNDING", "once")
    assert ringreduce.settings() == {"transport": "copy", "oneshot_max_bytes": 0,
                                     "half_rounding": "per_hop", "fused": True,
                                     "cuda_half_rounding": "once"}
    monkeypatch.setenv("RINGREDUCE_TRANSPORT", "")  # empty is unset
    assert ringreduce.settings()["transport"] == "p2p"
    monkeypatch.setenv("RINGREDUCE_TRANSPORT", "ib")
    with pytest.raises(ValueError, match="RINGREDUCE_TRANSPORT"):
        ringreduce.settings()
