"""The backend's CUDA streams and lifetimes (issue 27): spawned ranks sharing cuda:0.

Ran on an H100 on 2026-11-26 (docs/GPU_SESSION.md): all four passed. Every CUDA test here skips
without a GPU. The reduce-scatter test also
runs on the CPU, which checks the test's own reference and flow.

- A non-contiguous reduce_scatter_tensor input is flattened by a copy made in the caller's
  thread; that copy must outlive the GPU work that reads it, however soon the caller drops the
  input and allocates again on its stream (it was freed at once: use after free).
- CUDA send/recv run on point-to-point's own internal stream, so they do not wait on the GPU
  behind a collective queued before them.
- CUDA send/recv between two simulated hosts are staged through pinned host memory (they were
  refused).
"""
import os
import time

import torch
import torch.distributed as dist

from checks import needs_cuda, sleep_cycles
from test_distributed import init, run_ranks, values

DEV = torch.device("cuda", 0)


def _rs_input(rank, rows, cols, world, step):
    """Rank `rank`'s exact-integer input of step `step`, as a contiguous (cols, world*rows)
    tensor on the CPU; the collective gets its transpose (non-contiguous)."""
    g = torch.Generator().manual_seed(7000 + 31 * step + rank)
    return torch.randint(-50, 50, (cols, world * rows), generator=g).to(torch.float32)


def _noncontiguous_reduce_scatter(rank, world, store, steps, rows, cols, device):
    init(rank, world, store)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
        cycles = sleep_cycles(0.05)
    wrong = []
    for step in range(steps):
        base = _rs_input(rank, rows, cols, world, step).to(device)
        inp = base.t()  # (world*rows, cols), not contiguous: the backend flattens a copy
        assert not inp.is_contiguous()
        out = torch.full((rows, cols), -7.0, device=device)
        if cuda:
            # The internal stream starts after this sleep: the copy is still unread when the
            # caller drops it below.
            torch.cuda._sleep(cycles)
        work = dist.reduce_scatter_tensor(out, inp, async_op=True)
        del base, inp
        deadline = time.monotonic() + 10.0
        while not work.is_completed() and time.monotonic() < deadline:
            time.sleep(0.001)  # the progress thread has queued the GPU work and let go of the job
        # Blocks of the dropped copy's size, poisoned on the caller's stream: before the fix one
        # of them was the copy the internal stream had yet to read.
        junk = [torch.full((world * rows * cols,), 1e6, device=device) for _ in range(4)]
        work.wait()
        got = out.cpu()
        del junk
        want = sum(_rs_input(q, rows, cols, world, step).t().contiguous().view(-1)
                   [rank * rows * cols:(rank + 1) * rows * cols] for q in range(world))
        if not torch.equal(got.view(-1), want):
            wrong.append(step)
    dist.destroy_process_group()
    return wrong


def _check_noncontiguous_reduce_scatter(tmp_path, device):
    steps = 20
    for rank, wrong in enumerate(values(run_ranks(_noncontiguous_reduce_scatter, 2, tmp_path,
                                                  steps, 257, 129, device))):
        assert not wrong, f"rank {rank}: wrong results at steps {wrong} of {steps} (seeds 7000+)"


@needs_cuda
def test_noncontiguous_reduce_scatter_input_outlives_its_gpu_work(tmp_path):
    _check_noncontiguous_reduce_scatter(tmp_path, DEV)


def test_noncontiguous_reduce_scatter_input_dropped_after_the_call_cpu(tmp_path):
    # Checks the test itself (its reference, its flow) where it can run; the bug was CUDA's.
    _check_noncontiguous_reduce_scatter(tmp_path, torch.device("cpu"))


def _p2p_beside_a_collective(rank, world, store):
    init(rank, world, store)
    torch.cuda.set_device(DEV)
    t = torch.ones(4099, device=DEV)
    dist.all_reduce(t)  # the CUDA setup step
    msg = torch.arange(1000, dtype=torch.float32, device=DEV) + 10 * rank
    if rank == 0:  # the point-to-point setup step
        dist.send(msg, dst=1)
    else:
        dist.recv(msg, src=0)
    torch.cuda.synchronize()
    cycles = sleep_cycles(3.0)
    # The collective's internal stream waits for this sleep (its ready event follows it).
    torch.cuda._sleep(cycles)
    work = dist.all_reduce(t, async_op=True)
    side = torch.cuda.Stream()  # not behind the sleep
    payload = torch.arange(1000, dtype=torch.float32) * 3 + 1
    with torch.cuda.stream(side):
        start = time.monotonic()
        if rank == 0:
            dist.send(payload.to(DEV), dst=1, tag=5)
            got = None
        else:
            got = torch.zeros(1000, device=DEV)
            dist.recv(got, src=0, tag=5)
            got = got.cpu()
        side.synchronize()
        elapsed = time.monotonic() - start
    work.wait()
    torch.cuda.synchronize()
    reduced = torch.equal(t.cpu(), torch.full((4099,), 4.0))
    dist.destroy_process_group()
    return elapsed, got is None or torch.equal(got, payload), reduced


@needs_cuda
def test_p2p_does_not_wait_behind_a_collective_on_the_gpu(tmp_path):
    for rank, (elapsed, ok, reduced) in enumerate(values(run_ranks(_p2p_beside_a_collective, 2,
                                                                   tmp_path))):
        assert ok, f"rank {rank}: the message differs"
        assert reduced, f"rank {rank}: the all_reduce queued before it is wrong"
        # Behind the collective it would take the 3 s the collective's GPU work waits for.
        assert elapsed < 1.5, f"rank {rank}: send/recv took {elapsed:.2f} s on a side stream"


def _cross_host_cuda_p2p(rank, world, store):
    os.environ["RINGREDUCE_HOST_ID"] = "ab"[rank // 2]
    init(rank, world, store)
    torch.cuda.set_device(DEV)
    problems = []

    def data(r, n, dtype, salt=0):
        return (torch.arange(n, dtype=torch.int64) * 3 + 100 * r + salt).to(dtype)

    def check(got, want, what):
        got = got.cpu()
        if not (got.dtype == want.dtype and torch.equal(got, want)):
            problems.append(f"{what}: got {got.tolist()}, want {want.tolist()}")

    # Across hosts (0 -> 2, 3 -> 1), tags received in the other order than sent.
    for a, b in ((0, 2), (3, 1)):
        if rank == a:
            dist.send(data(a, 4, torch.float16, 1).to(DEV), dst=b, tag=1)
            dist.send(data(a, 6, torch.int64, 2).to(DEV), dst=b, tag=2)
        elif rank == b:
            second = torch.zeros(6, dtype=torch.int64, device=DEV)
            first = torch.zeros(4, dtype=torch.float16, device=DEV)
            dist.recv(second, src=a, tag=2)
            dist.recv(first, src=a, tag=1)
            check(first, data(a, 4, torch.float16, 1), f"recv tag 1 from {a}")
            check(second, data(a, 6, torch.int64, 2), f"recv tag 2 from {a}")
    # isend then irecv across hosts (0-3, 1-2), the send's tensor overwritten right after the
    # call (its bytes were copied out), the receive into a non-contiguous CUDA view.
    peer = world - 1 - rank
    mine = data(rank, 7, torch.float32, 5).to(DEV)
    buf = torch.zeros(7, 2, device=DEV)
    sent = dist.isend(mine, dst=peer, tag=7)
    mine.fill_(-1.0)
    recvd = dist.irecv(buf[:, 1], src=peer, tag=7)
    sent.wait()
    recvd.wait()
    snapshot = buf[:, 1].clone()  # on the caller's stream, after wait()
    check(snapshot, data(peer, 7, torch.float32, 5), "isend then irecv")
    dist.all_reduce(torch.ones(3))  # the group still works (CPU tensors)
    dist.destroy_process_group()
    return problems


@needs_cuda
def test_cross_host_cuda_send_recv_is_staged(tmp_path):
    for rank, problems in enumerate(values(run_ranks(_cross_host_cuda_p2p, 4, tmp_path))):
        assert not problems, f"rank {rank}:\n" + "\n".join(problems)
