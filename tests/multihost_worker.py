"""One rank under torchrun for tests/test_multihost.py: two launchers (--nnodes 2) on one
machine are two hosts (torchrun's GROUP_RANK). Writes OUTDIR/rank<r>.txt, which must be the
same on every rank: the layout, any problems, and a digest of every result."""
import datetime
import hashlib
import os
import sys

import torch
import torch.distributed as dist

import ringreduce  # registers the backend
from test_multihost import _ddp, hierarchical_model
from reference import assert_close_to_wide, random_inputs

torch.set_num_threads(1)
dist.init_process_group("ringreduce", timeout=datetime.timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
layout = ringreduce.distributed.comm_of().layout
problems, digest = [], hashlib.sha256()
for dtype, op in ((torch.int64, "sum"), (torch.float32, "sum"), (torch.float16, "avg"),
                  (torch.float64, "max"), (torch.int8, "prod")):
    for count in (1, 33, 50000):
        g = torch.Generator().manual_seed(count)
        inputs = random_inputs(world, count, dtype, op, generator=g)
        t = inputs[rank].clone()
        dist.all_reduce(t, op=getattr(dist.ReduceOp, {"prod": "PRODUCT"}.get(op, op.upper())))
        if not torch.equal(t, hierarchical_model(inputs, op, layout.hosts)):
            problems.append(f"{dtype} {op} {count}: differs from the hierarchical model")
        try:
            assert_close_to_wide(t, inputs, op)
        except AssertionError as exc:
            problems.append(f"{dtype} {op} {count}: {exc}")
        digest.update(t.view(torch.uint8).numpy().tobytes())
for p in _ddp(rank, None):
    digest.update(p.view(torch.uint8).numpy().tobytes())
dist.barrier()
with open(os.path.join(sys.argv[1], f"rank{rank}.txt"), "w") as f:
    f.write(f"hosts {layout.hosts} labels {[x.split('@')[0] for x in layout.labels]}\n"
            f"problems {problems}\ndigest {digest.hexdigest()}\n")
dist.destroy_process_group()
