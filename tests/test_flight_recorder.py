"""ringreduce's entries in torch's flight recorder (csrc/multiprocess/flight_recorder.h), against
gloo's for the same collectives, and the dumps on a failure read by torch's own analyzer.

Every check runs the same function under gloo and under ringreduce in spawned ranks where gloo
records the collective too, and compares what torch dumps (torch._C._distributed_c10d's
_dump_fr_trace_json, _dump_fr_trace) or what the analyzer says of the dump files.
"""
import datetime
import json
import os
import pickle
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from checks import communicate_bounded
from test_distributed import SPAWN_TIMEOUT, init, run_ranks, values

FR_ENV = {"TORCH_FR_BUFFER_SIZE": "200"}
# The group timeout of the failure scenarios: what a rank that never calls costs the others.
FAIL_TIMEOUT_S = 4.0
ANALYZER_TIMEOUT_S = 120
# What each entry must show alike on both backends (time_created_ns, thread_id, the state and
# its times differ by nature; gloo never moves past "scheduled").
SAME_FIELDS = ("record_id", "process_group", "collective_seq_id", "p2p_seq_id", "op_id",
               "input_sizes", "input_dtypes", "output_sizes", "output_dtypes", "timeout_ms",
               "is_p2p", "thread_name")


# torch 2.11's gloo has no all_to_all ("Backend gloo does not support alltoall"; 2.13 has).
GLOO_ALL_TO_ALL = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 13)


def _analyzer_reads_gloo():
    """torch 2.11's analyzer reads only nccl's and xccl's dumps ("name formatting error? gloo
    != 'nccl' or 'xccl'"); 2.13's reads gloo's too."""
    import inspect

    from torch.distributed.flight_recorder.components import types
    return '"gloo"' in inspect.getsource(types.Op.__init__)


def _dump_json():
    return json.loads(torch._C._distributed_c10d._dump_fr_trace_json(True, False))


def _dump_pickle():
    return pickle.loads(torch._C._distributed_c10d._dump_fr_trace(True, True, False))


def _user_frames(entry):
    """The frames of this file in an entry's stack: where the test called the collective."""
    return [(f["name"], f["line"]) for f in entry.get("frames", [])
            if f["filename"] == os.path.abspath(__file__)]


# ---------------------------------------------------------------------------------------------
# The script and the other collectives gloo has: the entries equal gloo's.

def _collectives(rank, world, store, backend):
    init(rank, world, store, backend=backend)
    t = torch.arange(4.0) + rank
    dist.all_reduce(t)
    dist.broadcast(t, 0)
    gathered = [torch.empty(4) for _ in range(world)]
    dist.all_gather(gathered, t)
    i = torch.tensor([rank], dtype=torch.int64)
    dist.all_reduce(i, op=dist.ReduceOp.MAX)
    dist.all_reduce(t, async_op=True).wait()
    dist.reduce(t, 0)
    dist.gather(t, [torch.empty(4) for _ in range(world)] if rank == 0 else None, 0)
    dist.scatter(torch.empty(4), [t.clone() for _ in range(world)] if rank == 0 else None, 0)
    dist.all_to_all_single(torch.empty(2 * world), torch.arange(2.0 * world))
    if GLOO_ALL_TO_ALL:
        dist.all_to_all([torch.empty(3) for _ in range(world)],
                        [torch.full((3,), float(rank)) for _ in range(world)])
    dist.barrier()
    return _dump_json(), _dump_pickle()


@pytest.mark.timeout(300)
def test_entries_equal_gloos_for_the_same_collectives(tmp_path):
    runs = {b: values(run_ranks(_collectives, 2, tmp_path, b, env=FR_ENV))
            for b in ("gloo", "ringreduce")}
    for rank in range(2):
        (gloo, gloo_pickled), (ours, ours_pickled) = runs["gloo"][rank], runs["ringreduce"][rank]
        theirs, mine = gloo["entries"], ours["entries"]
        names = [e["profiling_name"] for e in theirs]
        assert names[:6] == ["gloo:all_reduce", "gloo:broadcast", "gloo:all_gather",
                             "gloo:all_reduce", "gloo:all_reduce", "gloo:reduce"], names
        assert [e["profiling_name"] for e in mine] == [
            n.replace("gloo:", "ringreduce:") for n in names], (names, mine)
        for g, r in zip(theirs, mine):
            for field in SAME_FIELDS:
                assert g[field] == r[field], (rank, g["profiling_name"], field, g[field],
                                              r[field])
            # gloo's entries stay "scheduled"; ringreduce's ran to the end.
            assert r["state"] == "completed" and r["retired"], r
            assert 0 < r["time_discovered_started_ns"] <= r["time_discovered_completed_ns"], r
            assert "duration_ms" not in r, r  # TORCH_NCCL_ENABLE_TIMING is not set
        # gloo records its ranks before torch names the group (under the name ""): the same
        # ranks, under the group's name here.
        assert [c["ranks"] for c in gloo["pg_config"].values()] == ["[0, 1]"], gloo["pg_config"]
        assert ours["pg_config"] == {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}}
        n = len(mine)
        assert ours["pg_status"]["0"] == {"last_enqueued_collective": str(n),
                                          "last_started_collective": str(n),
                                          "last_completed_collective": str(n)}
        # The caller's stack, as torch asks for it (the pickled dump carries it).
        for g, r in zip(gloo_pickled["entries"], ours_pickled["entries"]):
            assert _user_frames(r) and _user_frames(r) == _user_frames(g), (r, g)


# ---------------------------------------------------------------------------------------------
# What gloo does not record: point-to-point, durations, sub-groups' global ranks.

def _p2p_and_groups(rank, world, store):
    init(rank, world, store)
    t = torch.arange(5.0)
    dist.all_reduce(t)
    if rank == 0:
        dist.send(t, 2)
        dist.isend(t, 1).wait()
    elif rank == 2:
        dist.recv(t, 0)
    else:
        dist.irecv(t, 0).wait()
    pair = dist.new_group([0, 2])
    if rank in (0, 2):
        dist.all_reduce(t, group=pair)
    dist.barrier()
    # The collectives recorded under torch's own names, per-rank blocks as one [world, ...] size.
    dist.all_gather_into_tensor(torch.empty(world * 4), torch.arange(4.0))
    dist.reduce_scatter_tensor(torch.empty(4), torch.arange(world * 4.0))
    dist.reduce_scatter(torch.empty(4), [torch.arange(4.0) for _ in range(world)])
    dist.all_reduce_coalesced([torch.ones(2), torch.ones(3)])
    return _dump_json()


# What _p2p_and_groups's last four collectives record (3 ranks): name, input and output sizes.
NAMED_SIZES = [("ringreduce:_all_gather_base", [[4]], [[12]]),
               ("ringreduce:_reduce_scatter_base", [[12]], [[4]]),
               ("ringreduce:reduce_scatter", [[3, 4]], [[4]]),
               ("ringreduce:allreduce_coalesced", [[2], [3]], [[2], [3]])]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("timing", [False, True])
def test_point_to_point_groups_and_durations(tmp_path, timing):
    env = dict(FR_ENV, TORCH_NCCL_ENABLE_TIMING="1" if timing else "0")
    dumps = values(run_ranks(_p2p_and_groups, 3, tmp_path, env=env))
    for rank, dump in enumerate(dumps):
        for e in dump["entries"]:
            assert e["state"] == "completed" and e["retired"], e
            if timing:
                # Milliseconds: within the entry's own time from its creation to its completion
                # (the slack: duration_ms is a float32).
                lifetime_ms = (e["time_discovered_completed_ns"] - e["time_created_ns"]) / 1e6
                assert 0 <= e["duration_ms"] <= lifetime_ms * (1 + 1e-6), (
                    e["duration_ms"], lifetime_ms, e)
            else:
                assert "duration_ms" not in e, e
        rows = [(e["profiling_name"], e["process_group"][0], e["collective_seq_id"],
                 e["p2p_seq_id"], e["op_id"], e["is_p2p"]) for e in dump["entries"]]
        p2p = {0: [("ringreduce:send 0->2", "0", 1, 1, 2, True),
                   ("ringreduce:send 0->1", "0", 1, 2, 3, True)],
               1: [("ringreduce:recv 1<-0", "0", 1, 1, 2, True)],
               2: [("ringreduce:recv 2<-0", "0", 1, 1, 2, True)]}[rank]
        pair = [("ringreduce:all_reduce", "1", 1, 0, 1, False)] if rank != 1 else []
        barrier_op = 2 + len(p2p)
        named = [(name, "0", 3 + i, len(p2p), barrier_op + 1 + i, False)
                 for i, (name, _, _) in enumerate(NAMED_SIZES)]
        assert rows == ([("ringreduce:all_reduce", "0", 1, 0, 1, False)] + p2p + pair +
                        [("ringreduce:barrier", "0", 2, len(p2p), barrier_op, False)] +
                        named), rows
        sizes = [(e["input_sizes"], e["output_sizes"]) for e in dump["entries"]]
        assert sizes == [([[5]], [[5]])] * (len(rows) - 1 - len(NAMED_SIZES)) + [([], [])] + [
            (i, o) for _, i, o in NAMED_SIZES], sizes
        config = {k: v["ranks"] for k, v in dump["pg_config"].items()}
        assert config == ({"0": "[0, 1, 2]", "1": "[0, 2]"} if rank != 1 else
                          {"0": "[0, 1, 2]"}), config


# ---------------------------------------------------------------------------------------------
# Off: nothing recorded unless TORCH_FR_BUFFER_SIZE asks (torch's recorder itself is on by
# default, and gloo records in it: that shows the dump would hold ringreduce's entries).

def _both_backends(rank, world, store):
    init(rank, world, store)
    gloo = dist.new_group(backend="gloo")
    t = torch.ones(3)
    dist.all_reduce(t)
    dist.all_reduce(t, group=gloo)
    dist.barrier()
    return [e["profiling_name"] for e in _dump_json().get("entries", [])]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("size", [None, "0"])
def test_nothing_recorded_when_the_recorder_is_off(tmp_path, monkeypatch, size):
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        monkeypatch.delenv(name, raising=False)
    env = {} if size is None else {"TORCH_FR_BUFFER_SIZE": size}
    names = values(run_ranks(_both_backends, 2, tmp_path, env=env))
    expected = ["gloo:all_reduce"] if size is None else []
    assert names == [expected, expected], names


# ---------------------------------------------------------------------------------------------
# Dumps on a failure, read by torch's analyzer: the mismatch and the missing rank it names,
# beside what it says of gloo's dumps (which the script writes itself: gloo does not dump).

def _failing(rank, world, store, backend, scenario, dump_dir):
    _meet(rank, world, store)
    init(rank, world, store, backend=backend, timeout=FAIL_TIMEOUT_S)
    t = torch.arange(4.0) + rank
    dist.all_reduce(t)
    dist.broadcast(t, 0)
    dist.all_gather([torch.empty(4) for _ in range(world)], t)
    error = None
    own_dump = os.path.join(dump_dir, f"trace_{rank}")
    if scenario == "missing" and rank == 3:
        # Never calls the all_reduce: waits (bounded) until the others have given up on it.
        others = [os.path.join(dump_dir, f"trace_{r}") for r in range(3)]
        wait_for = others if backend == "gloo" else [own_dump]
        _wait_for_dumps(wait_for, 100.0)
    else:
        try:
            if scenario == "mismatch" and rank == 2:
                dist.broadcast(t, 0)
            else:
                dist.all_reduce(t)
        except Exception as exc:  # the timeout or the mismatch
            error = str(exc)
    if backend == "gloo":
        with open(own_dump, "wb") as f:
            f.write(torch._C._distributed_c10d._dump_fr_trace(True, True, False))
        return error, None
    # After the failure: its entry (the fourth collective) and the group's status, as recorded.
    dump = _dump_json()
    failed = [{k: e.get(k) for k in ("profiling_name", "state", "retired",
                                     "time_discovered_completed_ns")}
              for e in dump["entries"] if e["collective_seq_id"] == 4]
    return error, (failed, dump["pg_status"]["0"])


def _check_failed_entries(records, failed_ranks):
    """On each rank whose fourth collective failed, its entry is retired and not completed, and
    the group's last completed collective is the third; a rank that never called it has none."""
    for rank, (entries, status) in enumerate(records):
        if rank not in failed_ranks:
            assert entries == [] and status["last_enqueued_collective"] == "3", (rank, entries,
                                                                                   status)
            continue
        assert len(entries) == 1, (rank, entries)
        e = entries[0]
        assert e["retired"] and e["state"] != "completed", (rank, e)
        assert not e["time_discovered_completed_ns"], (rank, e)  # the dump's 0: none
        assert status["last_enqueued_collective"] == "4", (rank, status)
        assert status["last_completed_collective"] == "3", (rank, status)


def _meet(rank, world, store):
    """Waits (up to SPAWN_TIMEOUT) until every rank has started and imported torch, so that the
    group's short timeout bounds the failure alone, not the ranks' start: 4 spawned ranks on a
    loaded 2-core machine start seconds apart."""
    met = dist.FileStore(f"{store}-meet", world)
    met.set(f"up{rank}", "1")
    met.wait([f"up{r}" for r in range(world)], datetime.timedelta(seconds=SPAWN_TIMEOUT))


def _wait_for_dumps(paths, timeout_s):
    """Until every file in `paths` holds a whole pickled dump."""
    deadline = time.monotonic() + timeout_s
    for path in paths:
        while True:
            try:
                with open(path, "rb") as f:
                    pickle.load(f)
                break
            except (OSError, EOFError, pickle.UnpicklingError):
                assert time.monotonic() < deadline, f"no dump at {path} after {timeout_s} s"
                time.sleep(0.1)


def _analyze(dump_dir, module):
    proc = subprocess.Popen([sys.executable, "-m", module, str(dump_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    out = communicate_bounded(proc, ANALYZER_TIMEOUT_S)
    assert proc.returncode == 0, out
    return out


def _name_gloos_group(dump_dir):
    """gloo records its group's ranks before torch names the group (under the name "", torch
    2.11 to 2.14.1), so torch's analyzer stops on gloo's dumps (KeyError: ('0', rank)): the
    test writes that record under the group's name, as ringreduce's dumps have it."""
    for path in dump_dir.iterdir():
        with open(path, "rb") as f:
            dump = pickle.load(f)
        config = dump["pg_config"]
        if set(config) == {""}:
            dump["pg_config"] = {"0": dict(config[""], name="0", desc="default_pg")}
            with open(path, "wb") as f:
                pickle.dump(dump, f)


def _findings(report):
    """The analyzer's report without what differs by nature between the backends: the states
    (gloo's never move past "scheduled"), the backend's name, and the lines of its loader."""
    keep = []
    for line in report.splitlines():
        if line.startswith(("collective state:", "tabulate is not installed")):
            continue
        keep.append(line.replace("gloo:", "ringreduce:"))
    return keep


def _run_failing(tmp_path, backend, scenario):
    dump_dir = tmp_path / f"{backend}-{scenario}"
    dump_dir.mkdir()
    env = dict(FR_ENV, TORCH_FR_DUMP_TEMP_FILE=str(dump_dir / "trace_"))
    results = run_ranks(_failing, 4, tmp_path, backend, scenario, str(dump_dir), env=env)
    errors, records = zip(*values(results))
    assert sorted(os.listdir(dump_dir)) == [f"trace_{r}" for r in range(4)]
    if backend == "gloo":
        _name_gloos_group(dump_dir)
    module = "ringreduce.fr_trace" if backend == "ringreduce" else \
        "torch.distributed.flight_recorder.fr_trace"
    return list(errors), records, _analyze(dump_dir, module)


def _check_findings_equal_gloos(tmp_path, scenario, ours):
    """The analyzer's findings on gloo's dumps of the same scenario equal `ours` (skipped, after
    ringreduce's were checked, where torch's analyzer cannot read gloo's dumps)."""
    if not _analyzer_reads_gloo():
        pytest.skip("ringreduce's findings checked; torch " + torch.__version__ + "'s analyzer "
                    "cannot read gloo's dumps to compare (nccl and xccl only before 2.13)")
    _, _, gloos = _run_failing(tmp_path, "gloo", scenario)
    assert _findings(ours) == _findings(gloos), (ours, gloos)


@pytest.mark.timeout(600)
def test_analyzer_names_the_mismatched_collective(tmp_path):
    errors, records, ours = _run_failing(tmp_path, "ringreduce", "mismatch")
    assert all(e and "ringreduce" in e for e in errors), errors
    _check_failed_entries(records, failed_ranks={0, 1, 2, 3})
    assert "Collective sequence number: 4 has errors" in ours, ours
    assert ("Culprit rank 2; Error type: COLLECTIVE_TYPE_MISMATCH, Expected collective type: "
            "'all_reduce' does not match found collective type: 'broadcast'") in ours, ours
    assert "collective: ringreduce:all_reduce" in ours, ours
    _check_findings_equal_gloos(tmp_path, "mismatch", ours)


@pytest.mark.timeout(600)
def test_analyzer_names_the_missing_rank(tmp_path):
    errors, records, ours = _run_failing(tmp_path, "ringreduce", "missing")
    assert errors[3] is None and all(errors[:3]), errors
    _check_failed_entries(records, failed_ranks={0, 1, 2})
    assert "Not all ranks joining collective, sequence number: 4" in ours, ours
    assert "missing ranks: {3}" in ours, ours
    _check_findings_equal_gloos(tmp_path, "missing", ours)
