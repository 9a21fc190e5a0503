"""The first minute on a GPU (scripts/gpu_check.sh smoke): does the CUDA build import, and does
ringreduce.all_reduce give the right answer on cuda:0 by each path? Simulated ranks (several
tensors on one GPU): the one-shot kernel, the ring on one stream, the ring on a stream per rank
(the lanes executor), and the ring's hops through cudaMemcpyPeerAsync (RINGREDUCE_TRANSPORT=copy),
for 2 and 4 ranks, float32 and int32, against a float64 / int64 reference computed on the CPU.
Outputs are compared element for element; every case runs even when one fails; exit 1 if any
failed. Seeds are fixed and printed."""
import json
import os
import sys
import time
import traceback

import torch

import ringreduce

CASES = [  # (name, environment, count, one stream per rank)
    ("oneshot", {}, 1000, False),
    ("ring", {"RINGREDUCE_ONESHOT_BYTES": "0"}, (1 << 20) + 3, False),
    ("ring-lanes", {"RINGREDUCE_ONESHOT_BYTES": "0"}, (1 << 20) + 3, True),
    ("copy", {"RINGREDUCE_TRANSPORT": "copy", "RINGREDUCE_ONESHOT_BYTES": "0"}, 70001, False),
]


def check(name, env, count, lanes, nranks, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        host = [torch.rand(count, generator=g, dtype=torch.float64).mul_(2).sub_(1)
                for _ in range(nranks)]
    else:
        host = [torch.randint(-1000, 1000, (count,), generator=g, dtype=torch.int64)
                for _ in range(nranks)]
    wide = torch.stack(host).sum(0)
    tensors = [h.to(dtype).to("cuda:0") for h in host]
    streams = [torch.cuda.Stream() for _ in range(nranks)] if lanes else None
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        if streams is not None:
            for s in streams:
                s.wait_stream(torch.cuda.current_stream())
        ringreduce.all_reduce(tensors, "sum", streams=streams)
        if streams is not None:
            for s in streams:
                torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
    finally:
        for k, v in saved.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v
    wrong = 0
    for t in tensors:
        got = t.cpu()
        if dtype.is_floating_point:
            abs_sum = torch.stack(host).abs().sum(0)
            tol = abs_sum * nranks * torch.finfo(dtype).eps
            wrong += int(((got.double() - wide).abs() > tol).sum()) + int(got.isnan().sum())
        else:
            wrong += int((got.long() != wide).sum())
    return wrong


def main():
    info = ringreduce.build_info()
    print("build_info", json.dumps(info))
    if not info.get("cuda"):
        print("smoke: FAIL: not a CUDA build")
        return 1
    if not torch.cuda.is_available():
        print("smoke: FAIL: torch sees no GPU")
        return 1
    print("device", torch.cuda.get_device_name(0), "torch", torch.__version__)
    failed = total = 0
    seed = 27000
    for name, env, count, lanes in CASES:
        for nranks in (2, 4):
            for dtype in (torch.float32, torch.int32):
                seed += 1
                label = f"{name} n={nranks} {str(dtype)[6:]} count={count} seed={seed}"
                t0 = time.perf_counter()
                try:
                    wrong = check(name, env, count, lanes, nranks, dtype, seed)
                    verdict = "ok" if wrong == 0 else f"FAIL: {wrong} wrong elements"
                except Exception:  # noqa: BLE001  (every case runs; the error is printed)
                    verdict = "FAIL: " + traceback.format_exc().strip().replace("\n", "\n    ")
                failed += verdict != "ok"
                total += 1
                print(f"smoke: {label}: {verdict} ({time.perf_counter() - t0:.2f} s)",
                      flush=True)
    print(f"smoke: {total - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
