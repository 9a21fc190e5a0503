"""The two-shot all-reduce with the ring's bits on CPU (csrc/multiprocess/cpu_collectives.cpp,
two_shot_all_reduce; HostGroup::two_shot), through the "ringreduce" backend with real processes.

Groups whose every rank's waits sleep (more ranks than cores, or RINGREDUCE_SPIN_US=0) take it
for all-reduces of RINGREDUCE_TWO_SHOT_MIN_BYTES to RINGREDUCE_TWO_SHOT_MAX_BYTES (512 KiB-2 MiB
by default): 3 hand-offs a round instead of the ring's 2N - 1 (issue 49, bench/RESULTS.md).

- Exact results for every dtype x op x world size 2-4 x sizes (1, odd, several rounds of a small
  staging area) against ``ring_model`` (each ring chunk reduced in the order c, c+1, ..., c-1),
  bit for bit, and equal to the ring's own result (a group with RINGREDUCE_TWO_SHOT_MAX_BYTES=0):
  the path changes the speed, never the bits. Each group says which path it took
  (Comm.all_reduce_path), so the comparison cannot pass with both groups on the ring.
- The default window, and the rule that every rank must sleep: a group where one rank spins
  keeps the ring on every rank.
- A mismatched count names the two-shot path in the message; differing or bad window settings
  refuse to form the group.
"""
import datetime
import os

import pytest
import torch
import torch.distributed as dist

import ringreduce.distributed as rrd
from reference import ALL_DTYPES, random_inputs, ring_model, rounds_once, valid_ops
from test_distributed import init, run_ranks, values
from test_small_path import _op

KIB = 1 << 10
MIB = 1 << 20
DEFAULT_MIN = 512 * KIB  # host_group.cpp kDefaultTwoShotMinBytes
DEFAULT_MAX = 2 * MIB    # kDefaultTwoShotMaxBytes
MARK = "(two-shot path)"  # what a descriptor of the two-shot path says
KNOBS = ("RINGREDUCE_SPIN_US", "RINGREDUCE_TWO_SHOT_MIN_BYTES", "RINGREDUCE_TWO_SHOT_MAX_BYTES",
         "RINGREDUCE_SMALL_BYTES", "RINGREDUCE_SHM_BYTES")


def _group(timeout=30.0, **env):
    """A new group over every rank created with the knobs in `env` (the rest unset)."""
    saved = {k: os.environ.pop(k, None) for k in KNOBS}
    os.environ.update({k: str(v) for k, v in env.items()})
    try:
        return dist.new_group(backend="ringreduce", timeout=datetime.timedelta(seconds=timeout))
    finally:
        for k in KNOBS:
            os.environ.pop(k, None)
        os.environ.update({k: v for k, v in saved.items() if v is not None})


def _path(group, t, op):
    return rrd.comm_of(group).all_reduce_path(t, op)


# ---------------------------------------------------------------------------------------
# Exact results

SHM = 8192  # bytes of staging area: every size below 8 KiB goes in several rounds
COUNTS = (1, 3, 7, 33, 1001, 4099)


def _exact_sweep(rank, world, store):
    init(rank, world, store)
    common = {"RINGREDUCE_SMALL_BYTES": 0, "RINGREDUCE_SHM_BYTES": SHM,
              "RINGREDUCE_SPIN_US": 0}
    groups = {"two_shot": _group(RINGREDUCE_TWO_SHOT_MIN_BYTES=0,
                                 RINGREDUCE_TWO_SHOT_MAX_BYTES=1 << 40, **common),
              "ring": _group(RINGREDUCE_TWO_SHOT_MAX_BYTES=0, **common)}
    checked = 0
    for dtype in ALL_DTYPES:
        for op in valid_ops(dtype):
            once = rounds_once(dtype, op, "once")
            for count in COUNTS:
                g = torch.Generator().manual_seed(9100 + checked)
                if rank == 0 and checked == 0:
                    print(f"seeds 9100.. world {world}", flush=True)
                inputs = random_inputs(world, count, dtype, op, generator=g)
                expect = ring_model(inputs, op)
                for name, group in groups.items():
                    t = inputs[rank].clone()
                    want = "two_shot" if (name == "two_shot" or (once and world > 2)) else "ring"
                    assert _path(group, t, op) == want, (name, dtype, op, count)
                    dist.all_reduce(t, op=_op(op), group=group)
                    assert torch.equal(t, expect), (
                        f"world {world} rank {rank} {dtype} {op} count={count} group {name}: "
                        f"differs from the ring-order reference")
                checked += 1
    dist.destroy_process_group()
    return checked


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_exact_every_dtype_op_size(tmp_path, world):
    counts = values(run_ranks(_exact_sweep, world, tmp_path))
    assert len(set(counts)) == 1 and counts[0] > 300, counts


def _large(rank, world, store):
    """The default window with sleeping waits: float32 sums of 512 KiB-2 MiB take the two-shot
    path over a 4 MiB staging area (one round), each checked against the ring-order model."""
    init(rank, world, store, timeout=60.0)
    group = _group(timeout=60.0, RINGREDUCE_SPIN_US=0)
    seen = []
    for nbytes in (DEFAULT_MIN - 4, DEFAULT_MIN, MIB + 12, DEFAULT_MAX, DEFAULT_MAX + 4):
        g = torch.Generator().manual_seed(9200 + nbytes)
        inputs = random_inputs(world, nbytes // 4, torch.float32, "sum", generator=g)
        t = inputs[rank].clone()
        seen.append(_path(group, t, "sum"))
        dist.all_reduce(t, group=group)
        assert torch.equal(t, ring_model(inputs, "sum")), (rank, nbytes)
    # RINGREDUCE_TWO_SHOT_MAX_BYTES=0: never, not even for an empty tensor.
    off = _group(RINGREDUCE_SPIN_US=0, RINGREDUCE_SMALL_BYTES=0, RINGREDUCE_TWO_SHOT_MIN_BYTES=0,
                 RINGREDUCE_TWO_SHOT_MAX_BYTES=0)
    for count in (0, MIB // 4):
        t = torch.full((count,), float(rank + 1))
        seen.append(_path(off, t, "sum"))
        dist.all_reduce(t, group=off)
        assert torch.equal(t, torch.full((count,), float(world * (world + 1) // 2))), count
    dist.destroy_process_group()
    return seen


@pytest.mark.timeout(120)
def test_default_window(tmp_path):
    want = ["ring", "two_shot", "two_shot", "two_shot", "ring", "ring", "ring"]
    assert values(run_ranks(_large, 3, tmp_path)) == [want] * 3


def _mixed(rank, world, store):
    """Rank 0 sleeps in its waits, rank 1 spins: neither takes the two-shot path. Beside it, the
    same sizes in a group where both sleep take it."""
    init(rank, world, store, timeout=30.0)
    window = {"RINGREDUCE_TWO_SHOT_MIN_BYTES": 0, "RINGREDUCE_TWO_SHOT_MAX_BYTES": 1 << 40}
    groups = [_group(RINGREDUCE_SPIN_US=0 if rank == 0 else 1000, **window),
              _group(RINGREDUCE_SPIN_US=0, **window)]
    out = []
    for group in groups:
        for count in (10001, 300001):
            t = torch.arange(count, dtype=torch.int64) * (rank + 1)
            out.append(_path(group, t, "sum"))
            dist.all_reduce(t, group=group)
            assert torch.equal(t, torch.arange(count, dtype=torch.int64) * 3), (rank, count)
    dist.destroy_process_group()
    return out


def test_every_rank_must_sleep(tmp_path):
    want = ["ring", "ring", "two_shot", "two_shot"]
    assert values(run_ranks(_mixed, 2, tmp_path)) == [want] * 2


# ---------------------------------------------------------------------------------------
# Messages and settings

def _mismatch(rank, world, store):
    init(rank, world, store, timeout=10.0)
    group = _group(timeout=10.0, RINGREDUCE_SPIN_US=0)
    t = torch.ones(MIB // 4 + rank)  # both in the window: both take the two-shot path
    try:
        dist.all_reduce(t, group=group)
        return "no error"
    except RuntimeError as exc:
        return str(exc)


def test_mismatch_names_the_path(tmp_path):
    for rank, msg in enumerate(values(run_ranks(_mismatch, 2, tmp_path))):
        assert "disagree" in msg and MARK in msg, (rank, msg)


def _bad_setting(rank, world, store, settings, name):
    if settings[rank] is not None:
        os.environ[name] = settings[rank]
    try:
        init(rank, world, store, timeout=10.0)
        dist.all_reduce(torch.ones(3))
        return "no error"
    except Exception as exc:  # noqa: B902
        return f"{type(exc).__name__}: {exc}"


@pytest.mark.parametrize("name", ["RINGREDUCE_TWO_SHOT_MIN_BYTES",
                                  "RINGREDUCE_TWO_SHOT_MAX_BYTES"])
def test_bad_or_differing_settings_refuse_the_group(tmp_path, name):
    for setting in ("abc", "-1", "1M"):
        msg = values(run_ranks(_bad_setting, 1, tmp_path, [setting], name))[0]
        assert f"{name} must be a number of bytes" in msg and repr(setting) in msg.replace(
            '"', "'"), msg
    # The first rank to map a peer's segment names the setting and gives up, which removes its
    # own segment: the other rank may then fail to open that one instead.
    msgs = values(run_ranks(_bad_setting, 2, tmp_path, ["4096", None], name))
    dflt = DEFAULT_MIN if name.endswith("MIN_BYTES") else DEFAULT_MAX
    assert "no error" not in msgs, msgs
    assert any(f"{name} {dflt} on rank 1 but 4096 here" in m or
               f"{name} 4096 on rank 0 but {dflt} here" in m for m in msgs), msgs
