"""Bad input: a clear exception naming the argument and the rule, before any tensor changes."""
import pytest
import torch
import torch.distributed as dist

import ringreduce


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


@pytest.mark.parametrize("op", ["xor", "SUMM", "", 0, None, dist.ReduceOp.BAND,
                                dist.ReduceOp.BOR, dist.ReduceOp.PREMUL_SUM])
def test_unknown_op(op):
    _check_untouched(_ranks(), lambda ts: ringreduce.all_reduce(ts, op), ValueError, "op must be one of")


def test_op_names_are_case_insensitive():
    t = _ranks()
    ringreduce.all_reduce(t, "SUM")
    assert torch.equal(t[0], t[1])


@pytest.mark.parametrize("dtype", [torch.bool, torch.complex64, torch.int16, torch.float8_e4m3fn])
def test_unsupported_dtype(dtype):
    t = [torch.ones(4, dtype=dtype), torch.ones(4, dtype=dtype)]
    with pytest.raises(TypeError, match="not supported"):
        ringreduce.all_reduce(t)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int8, torch.uint8])
def test_avg_on_integers(dtype):
    t = [torch.arange(1, 9, dtype=dtype) for _ in range(3)]
    _check_untouched(t, lambda ts: ringreduce.all_reduce(ts, "avg"), TypeError, "floating-point")


@pytest.mark.skipif(ringreduce.build_info()["cuda"] or not torch.cuda.is_available(),
                    reason="needs CUDA tensors with a CPU-only ringreduce build")
def test_cuda_tensors_on_cpu_build():
    with pytest.raises(RuntimeError, match="no CUDA support"):
        ringreduce.all_reduce([torch.ones(4, device="cuda"), torch.ones(4, device="cuda")])


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
