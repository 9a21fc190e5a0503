#!/usr/bin/env python3
"""Error of float16 / bfloat16 sums: ringreduce's once-rounded CPU sum (the default) against its
per-hop ring (RINGREDUCE_HALF_ROUNDING=per_hop), on the same inputs, both against the float64
sum. Prints a markdown table (docs/API.md, "Rounding").

    python bench/half_error.py [--count 4096] [--ranks 2,4,7,8] [--seed 0]

ulp: the 16-bit type's spacing at the largest input of the element (a sum that cancels to near
zero would otherwise make tiny units). exact: the share of elements equal to the float64 sum
rounded to the type.
"""
from __future__ import annotations

import argparse
import math
import os

import torch

import ringreduce

MANTISSA_BITS = {torch.bfloat16: 8, torch.float16: 11}


def ulp_at(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    fi = torch.finfo(dtype)
    e = torch.floor(torch.log2(x.abs().clamp_min(fi.smallest_normal)))
    return torch.exp2(e - (MANTISSA_BITS[dtype] - 1))


def run(inputs: list[torch.Tensor], rounding: str) -> torch.Tensor:
    before = os.environ.get("RINGREDUCE_HALF_ROUNDING")
    os.environ["RINGREDUCE_HALF_ROUNDING"] = rounding
    try:
        tensors = [t.clone() for t in inputs]
        ringreduce.all_reduce(tensors, "sum")
    finally:
        if before is None:
            del os.environ["RINGREDUCE_HALF_ROUNDING"]
        else:
            os.environ["RINGREDUCE_HALF_ROUNDING"] = before
    for t in tensors[1:]:
        assert torch.equal(t.view(torch.int16), tensors[0].view(torch.int16)), "ranks differ"
    return tensors[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=4096)
    parser.add_argument("--ranks", default="2,4,7,8")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print("| dtype | N | per_hop mean ulp | per_hop max ulp | per_hop exact | "
          "once mean ulp | once max ulp | once exact |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype in (torch.bfloat16, torch.float16):
        for n in (int(r) for r in args.ranks.split(",")):
            g = torch.Generator().manual_seed(args.seed + n)
            inputs = [torch.randn(args.count, generator=g, dtype=torch.float64).to(dtype)
                      for _ in range(n)]
            exact = torch.stack([t.to(torch.float64) for t in inputs]).sum(0)
            correct = exact.to(dtype)
            ulp = ulp_at(torch.stack([t.to(torch.float64).abs() for t in inputs]).amax(0), dtype)
            cells = []
            for rounding in ("per_hop", "once"):
                got = run(inputs, rounding)
                err = (got.to(torch.float64) - exact).abs() / ulp
                same = float((got.view(torch.int16) == correct.view(torch.int16)).double().mean())
                cells += [f"{float(err.mean()):.3f}", f"{float(err.max()):.2f}",
                          f"{100 * same:.1f}%"]
            assert all(math.isfinite(float(c.rstrip("%"))) for c in cells)
            print(f"| {str(dtype).replace('torch.', '')} | {n} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
