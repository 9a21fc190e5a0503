"""float16 / bfloat16 sums and averages (csrc/ring/cpu_executor.cpp: sum_rounded_once, and each
hop of the per-hop ring, RINGREDUCE_HALF_ROUNDING=per_hop) run loops compiled for AVX-512, AVX2
(with F16C) and the baseline. RINGREDUCE_CPU_SIMD caps the width, read once per process, so
each width runs in its own interpreter: the list API's all_reduce (in and out of place), reduce
and reduce_scatter on every 16-bit pattern beside random and adversarial ones, odd counts around
the vectors' 8 and 16 lanes and the 1024-element block. Every width must give the model's bits
(reference.py; NaN where it has NaN) and the baseline's."""
import os
import subprocess
import sys

import pytest
import torch

from checks import assert_same_bits_but_nan_payload, seeded, simd_width_param
from reference import adversarial_half_inputs, reduce_scatter_model, ring_model

HERE = os.path.dirname(__file__)

# Writes {case name: the outputs' raw bits} to argv[2] and the loops' width to stdout.
_SCRIPT = """
import sys, torch, ringreduce
sys.path.insert(0, sys.argv[1])
from test_half_simd import cases
results = {}
for name, inputs, op in cases():
    n = len(inputs)
    outs = [torch.full_like(t, float("nan")) for t in inputs]
    ringreduce.all_reduce([t.clone() for t in inputs], op, outputs=outs)
    results[name + " all_reduce"] = torch.stack(outs)
    tensors = [t.clone() for t in inputs]
    ringreduce.all_reduce(tensors, op)
    results[name + " all_reduce in place"] = torch.stack(tensors)
    results[name + " reduce"] = ringreduce.reduce([t.clone() for t in inputs], root=n - 1, op=op)
    if inputs[0].numel() % n == 0:
        outs = [torch.full((inputs[0].numel() // n,), float("nan"), dtype=inputs[0].dtype)
                for _ in inputs]
        ringreduce.reduce_scatter([t.clone() for t in inputs], outs, op=op)
        results[name + " reduce_scatter"] = torch.stack(outs)
torch.save({k: v.view(torch.int16) for k, v in results.items()}, sys.argv[2])
print("ran", ringreduce._C.cpu_simd_ran())
"""


def _bit_patterns(count, dtype, generator):
    return torch.randint(-2**15, 2**15, (count,), generator=generator,
                         dtype=torch.int16).view(dtype)


def cases():
    """(name, inputs, op): seeded, the same in every process."""
    out = []
    for dtype in (torch.bfloat16, torch.float16):
        every = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
        for op in ("sum", "avg"):
            g = seeded("half simd every pattern", dtype, op)
            flipped = (every.view(torch.int16) ^ -2**15).view(dtype)  # -x, NaNs included
            out.append((f"{dtype} {op} every+random", [every, _bit_patterns(2**16, dtype, g)],
                        op))
            out.append((f"{dtype} {op} every+itself", [every, every.clone()], op))
            out.append((f"{dtype} {op} every+negated", [every, flipped], op))
            out.append((f"{dtype} {op} every+2 random",
                        [every] + [_bit_patterns(2**16, dtype, g) for _ in range(2)], op))
            for nranks in (2, 4, 7):
                for count in (1, 7, 8, 9, 15, 16, 17, 31, 33, 1023, 1025, 4099):
                    g = seeded("half simd adversarial", dtype, op, nranks, count)
                    inputs = adversarial_half_inputs(nranks, nranks * count, dtype, g)
                    out.append((f"{dtype} {op} adversarial {nranks}x{nranks * count}", inputs,
                                op))
            g = seeded("half simd random bits", dtype, op)
            out.append((f"{dtype} {op} random bits 5x70005",
                        [_bit_patterns(70005, dtype, g) for _ in range(5)], op))
    return out


def _run(width, rounding, path):
    env = dict(os.environ, RINGREDUCE_CPU_SIMD=width, RINGREDUCE_CPU_AVX512_MIN_BYTES="0",
               RINGREDUCE_HALF_ROUNDING=rounding)
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, HERE, str(path)], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"ran {width}\n" in proc.stdout, proc.stdout  # those loops, not a narrower width's
    return torch.load(path)


@pytest.fixture(scope="module")
def baselines(tmp_path_factory):
    """The baseline loops' results for each rounding, run once per module."""
    runs = {}

    def get(rounding):
        if rounding not in runs:
            path = tmp_path_factory.mktemp("half_simd") / f"baseline-{rounding}.pt"
            runs[rounding] = _run("baseline", rounding, path)
        return runs[rounding]
    return get


def _expected(name, inputs, op, rounding):
    if name.endswith(" reduce_scatter"):
        return torch.stack(reduce_scatter_model(inputs, op, rounding))
    full = ring_model(inputs, op, rounding)
    if name.endswith(" reduce"):
        return full
    return full.expand(len(inputs), -1)


@pytest.mark.parametrize("rounding", ["once", "per_hop"])
@pytest.mark.parametrize("width", [simd_width_param("avx512", "avx512f"),
                                   simd_width_param("avx2", "avx2", "f16c"),
                                   "baseline"])
def test_every_width_gives_the_models_bits(width, rounding, baselines, tmp_path):
    baseline = baselines(rounding)
    got = baseline if width == "baseline" else _run(width, rounding, tmp_path / f"{width}.pt")
    inputs = {name: (ins, op) for name, ins, op in cases()}
    checked = 0
    for key, bits in got.items():
        case = next(c for c in inputs if key.startswith(c + " "))
        ins, op = inputs[case]
        result = bits.view(ins[0].dtype)
        what = f"{width}, {rounding}: {key}"
        assert_same_bits_but_nan_payload(result, _expected(key, ins, op, rounding), what)
        assert_same_bits_but_nan_payload(result, baseline[key].view(ins[0].dtype),
                                         what + " against the baseline loops")
        checked += 1
    scattered = sum(1 for ins, _ in inputs.values() if ins[0].numel() % len(ins) == 0)
    assert checked == len(baseline) == 3 * len(inputs) + scattered, (checked, len(inputs))
