"""Runs one list-API collective on given devices and checks it against tests/reference.py.

Shared by the CPU tests (test_collectives.py) and the GPU tests (test_cuda.py,
test_cuda_review.py). Every output is poisoned before the call, every result compared bit for bit
with the ring model (and reduced results with the exact or float64 reference), and every tensor
the call must not write is checked unchanged. `streams` (one CUDA stream per rank, or None) is
passed to the collective; each given stream first waits for the current stream, where the
inputs were written.

Also what every GPU test module shares: `needs_cuda` (skip, or fail under
RINGREDUCE_REQUIRE_CUDA=1, where no GPU test can run) and `sleep_cycles`; and the helpers more
than one test module needs: `free_port`, `communicate_bounded`, `run_bounded`, `alive`,
`load_module` (bench/ scripts), `small_net`/`ddp_steps` (the DDP model), `thread_count`,
`fd_count`, `anon_rss_kib`, `heap_bytes`, `native_stack_handler` (scripts/segv_backtrace.c built).
"""
import ctypes
import functools
import glob
import hashlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import zlib

import pytest
import torch

import ringreduce
from reference import (all_gather_model, assert_close_to_wide, half_rounding, random_inputs,
                       reduce_scatter_model, ring_model)

POISON_BYTE = 0xA5


def cuda_missing():
    """Why the GPU tests cannot run here, or None where they can."""
    if not torch.cuda.is_available():
        return "no CUDA device visible to torch"
    if not ringreduce.build_info()["cuda"]:
        return "ringreduce was built CPU-only (torch without CUDA or no nvcc)"
    return None


def require_cuda():
    """Skips the calling test where no GPU test can run, with the reason; fails it instead
    under RINGREDUCE_REQUIRE_CUDA=1 (scripts/gpu_check.sh sets it: a GPU run must not pass by
    skipping every CUDA test)."""
    reason = cuda_missing()
    if reason is None:
        return
    if os.environ.get("RINGREDUCE_REQUIRE_CUDA") == "1":
        pytest.fail(f"RINGREDUCE_REQUIRE_CUDA=1 but {reason}", pytrace=False)
    pytest.skip(reason)


# Marks a GPU test (or, as pytestmark, a module of them, or a pytest.param); conftest.py's
# autouse fixture calls require_cuda() for every test that carries it.
needs_cuda = pytest.mark.needs_cuda


def sleep_cycles(seconds):
    """GPU clock cycles that torch.cuda._sleep spins for about `seconds` on the current device
    (measured once: the clock differs between GPUs and with boost)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 10_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return int(cycles * seconds * 1000.0 / max(start.elapsed_time(end), 1e-3))


def poison_like(t, shape=None):
    out = torch.empty(t.shape if shape is None else shape, dtype=t.dtype, device=t.device)
    out.view(torch.uint8).fill_(POISON_BYTE)
    return out


def bits(t):
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def assert_same_bits(got, expected, what):
    assert got.dtype == expected.dtype, f"{what}: dtype {got.dtype}, expected {expected.dtype}"
    a, b = bits(got), bits(expected)
    assert torch.equal(a, b), (
        f"{what} differs from the model in {int((a != b).sum())} of {a.numel()} bytes")
    if got.dtype == torch.bool:
        assert bool((a <= 1).all()), f"{what}: a bool holds a byte other than 0 or 1"


def assert_same_bits_but_nan_payload(got, expected, what):
    """The same elements are NaN (CPU and GPU, or two orders of one add, may give NaNs different
    payloads), and every other element has the same bits."""
    got, expected = got.detach().cpu().reshape(-1), expected.detach().cpu().reshape(-1)
    nan_got, nan_exp = torch.isnan(got), torch.isnan(expected)
    assert torch.equal(nan_got, nan_exp), (
        f"{what}: NaN at {int((nan_got & ~nan_exp).sum())} elements that should not be, and "
        f"missing at {int((nan_exp & ~nan_got).sum())}")
    assert_same_bits(got[~nan_got], expected[~nan_exp], f"{what} (elements that are not NaN)")


def _place(inputs, devices):
    return [x.to(d, copy=True) for x, d in zip(inputs, devices)]


def _sync(tensors):
    if any(t.is_cuda for t in tensors):
        torch.cuda.synchronize()


def _fork(streams):
    """The given streams wait for the current stream (where _place wrote the inputs)."""
    for s in streams or ():
        if s is not None:
            s.wait_stream(torch.cuda.current_stream(s.device))
    return streams


class Unchanged:
    """Remembers tensors' bytes; check() asserts the call left them alone."""

    def __init__(self, named):
        self.saved = [(name, t, bits(t).clone()) for name, t in named]

    def check(self):
        for name, t, before in self.saved:
            assert torch.equal(bits(t), before), f"{name} was modified"


def check_all_reduce(inputs, op, devices, streams=None):
    """Out of place: inputs unchanged, every output the ring model's bits."""
    tensors = _place(inputs, devices)
    outputs = [poison_like(t) for t in tensors]
    kept = Unchanged((f"tensors[{i}]", t) for i, t in enumerate(tensors))
    assert ringreduce.all_reduce(tensors, op, outputs=outputs, streams=_fork(streams)) is outputs
    _sync(outputs)
    expected = ring_model(inputs, op, half_rounding(tensors[0].device))
    for r, out in enumerate(outputs):
        assert out.device == tensors[r].device
        assert_same_bits(out, expected, f"all_reduce outputs[{r}]")
    kept.check()
    if expected.numel():
        assert_close_to_wide(outputs[0], inputs, op)


def check_reduce(inputs, op, devices, root, in_place, streams=None):
    """The root's output holds all_reduce's bits; nothing else changes."""
    tensors = _place(inputs, devices)
    output = None if in_place else poison_like(tensors[root])
    kept = Unchanged((f"inputs[{i}]", t) for i, t in enumerate(tensors)
                     if not (in_place and i == root))
    result = ringreduce.reduce(tensors, output, root=root, op=op, streams=_fork(streams))
    assert result is (tensors[root] if in_place else output)
    _sync([result])
    expected = ring_model(inputs, op, half_rounding(tensors[0].device))
    assert_same_bits(result, expected, f"reduce to root {root}")
    kept.check()
    if expected.numel():
        assert_close_to_wide(result, inputs, op)


def check_reduce_scatter(inputs, op, devices, in_place=False, streams=None):
    """inputs: nranks blocks each; outputs[r] = block r reduced. Out of place the inputs stay
    unchanged; in place outputs[r] is block r of inputs[r] and only that block changes."""
    n = len(inputs)
    tensors = _place(inputs, devices)
    count = inputs[0].numel() // n
    flat = [t.reshape(-1) for t in tensors]
    if in_place:
        outputs = [f[r * count:(r + 1) * count] for r, f in enumerate(flat)]
        kept = Unchanged(
            (f"inputs[{r}] outside block {r}", part) for r, f in enumerate(flat)
            for part in (f[:r * count], f[(r + 1) * count:]))
    else:
        outputs = [poison_like(t, (count,)) for t in tensors]
        kept = Unchanged((f"inputs[{i}]", t) for i, t in enumerate(tensors))
    assert ringreduce.reduce_scatter(tensors, outputs, op=op, streams=_fork(streams)) is outputs
    _sync(outputs)
    expected = reduce_scatter_model(inputs, op, half_rounding(tensors[0].device))
    for r, out in enumerate(outputs):
        assert_same_bits(out, expected[r], f"reduce_scatter outputs[{r}]")
        if count:
            blocks = [x.reshape(-1)[r * count:(r + 1) * count] for x in inputs]
            assert_close_to_wide(out, blocks, op)
    kept.check()


def check_all_gather(inputs, devices, in_place=False, streams=None):
    """outputs[r] = the inputs concatenated; inputs unchanged."""
    n = len(inputs)
    tensors = _place(inputs, devices)
    count = inputs[0].numel()
    outputs = [poison_like(t, (n * count,)) for t in tensors]
    if in_place:
        tensors = [out[r * count:(r + 1) * count].view(inputs[r].shape)
                   for r, out in enumerate(outputs)]
        for t, x in zip(tensors, inputs):
            t.copy_(x)
    kept = Unchanged((f"inputs[{i}]", t) for i, t in enumerate(tensors))
    assert ringreduce.all_gather(tensors, outputs, streams=_fork(streams)) is outputs
    _sync(outputs)
    expected = all_gather_model(inputs)
    for r, out in enumerate(outputs):
        assert_same_bits(out, expected, f"all_gather outputs[{r}]")
    kept.check()


def check_broadcast(inputs, devices, root, streams=None):
    """Every tensor ends with inputs[root]'s bits."""
    tensors = _place(inputs, devices)
    for r, t in enumerate(tensors):
        if r != root:
            t.view(torch.uint8).fill_(POISON_BYTE)
    assert ringreduce.broadcast(tensors, root=root, streams=_fork(streams)) is tensors
    _sync(tensors)
    for r, t in enumerate(tensors):
        assert_same_bits(t, inputs[root], f"broadcast from {root} into inputs[{r}]")


def check_reducing_collectives(dtype, op, devices, generator, sizes, streams=None):
    """all_reduce (out of place), reduce (to the first and, in place, the last rank) and
    reduce_scatter (in place for odd sizes) for each size, on fresh random inputs."""
    n = len(devices)
    for count in sizes:
        def fresh(numel):
            return random_inputs(n, numel, dtype, op, generator=generator)

        check_all_reduce(fresh(count), op, devices, streams)
        check_reduce(fresh(count), op, devices, root=0, in_place=False, streams=streams)
        check_reduce(fresh(count), op, devices, root=n - 1, in_place=True, streams=streams)
        check_reduce_scatter(fresh(count * n), op, devices, in_place=count % 2 == 1,
                             streams=streams)


def check_copying_collectives(dtype, devices, generator, sizes, streams=None):
    """all_gather (in place for odd sizes) and broadcast from a few roots for each size."""
    n = len(devices)
    for count in sizes:
        check_all_gather(random_inputs(n, count, dtype, "sum", generator=generator), devices,
                         in_place=count % 2 == 1, streams=streams)
        for root in sorted({0, n // 2, n - 1}):
            check_broadcast(random_inputs(n, count, dtype, "sum", generator=generator), devices,
                            root, streams)


# ---------------------------------------------------------------------------------------
# Helpers shared by several test modules.

def free_port():
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def communicate_bounded(proc, timeout):
    """proc.communicate() bounded by `timeout`; past it the whole process group is killed (start
    proc with start_new_session=True: orphaned children would hold the pipe open otherwise) and
    the remaining output is read with a second bound. Returns the output."""
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            out = proc.communicate(timeout=10)[0]
        except subprocess.TimeoutExpired:
            out = "(output unreadable: the pipe stayed open after the kill)"
        return f"{out}\n(killed after {timeout} s)"


def run_bounded(cmd, timeout, stderr=subprocess.STDOUT, **popen_kwargs):
    """Runs `cmd` (a launcher: torchrun, a bench that spawns ranks) in a session of its own, so
    that past `timeout` communicate_bounded kills it with every process it started; a timed-out
    launcher's workers would run on into later tests otherwise. Returns (exit status, stdout),
    stderr in stdout unless `stderr` (a file) says where else."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True,
                            start_new_session=True, **popen_kwargs)
    out = communicate_bounded(proc, timeout)
    return proc.returncode, out


def alive(pid):
    """Whether `pid` is a process that has not exited (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False


def load_module(name, path):
    """Imports a script (bench/ring.py, ...) as module `name`."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def small_net():
    """The small conv net the DDP tests train (BatchNorm buffers included)."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 5))


def ddp_steps(rank, group, device="cpu", steps=4):
    """Trains small_net under DDP on `group` from a different initial state per rank (DDP must
    broadcast rank 0's); returns the model."""
    torch.manual_seed(1234 + rank)
    model = small_net().to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group,
                                                    bucket_cap_mb=0.001)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(99 + rank)
    for _ in range(steps):
        x = torch.randn(8, 1, 6, 6, generator=g).to(device)
        y = torch.randint(0, 5, (8,), generator=g).to(device)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    return model


def thread_count():
    """Threads of this process, C++ std::threads included (threading.active_count() sees only
    Python's)."""
    return len(os.listdir("/proc/self/task"))


def thread_names():
    """{thread id: name} of this process's threads (/proc/self/task/*/comm; "?" for one that
    ended while being read)."""
    names = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names[int(tid)] = f.read().strip()
        except OSError:
            names[int(tid)] = "?"
    return names


def fd_count():
    return len(os.listdir("/proc/self/fd"))


def anon_rss_kib():
    """Resident anonymous memory (RssAnon): the heap, pymalloc's arenas and other private
    mappings, without the shared-memory segments (VmRSS counts their pages as they are first
    touched, which a long run of point-to-point messages does for a whole ring)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    raise RuntimeError("no RssAnon in /proc/self/status")


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


_libc = None


def heap_bytes():
    """Bytes malloc (glibc, every arena: C++ new included) has handed out and not had back,
    exact to the chunk; None where the C library has no mallinfo2 (glibc < 2.33, musl)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None)
        if hasattr(_libc, "mallinfo2"):
            _libc.mallinfo2.restype = _Mallinfo2
    if not hasattr(_libc, "mallinfo2"):
        return None
    info = _libc.mallinfo2()
    return info.uordblks + info.hblkhd


def segments_of(pids):
    """The /dev/shm segments created by these processes (a segment's name starts with its
    creator's pid; other tests and other runs on this machine make segments of their own)."""
    return sorted(n for n in glob.glob("/dev/shm/ringreduce-*")
                  if any(n.startswith(f"/dev/shm/ringreduce-{pid}-") for pid in pids))


@functools.lru_cache(maxsize=None)
def native_stack_handler():
    """scripts/segv_backtrace.c built as a shared object (once per source text, in the temporary
    directory), for LD_PRELOAD: a process that dies of SIGSEGV, SIGBUS, SIGILL, SIGFPE or SIGABRT
    then prints its native stack on stderr as well as faulthandler's Python one. Returns its
    path, or None where no C compiler builds it (the stacks are a diagnosis, not a result)."""
    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts",
                          "segv_backtrace.c")
    with open(source, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    lib = os.path.join(tempfile.gettempdir(), f"ringreduce-segv-{digest}.so")
    if os.path.exists(lib):
        return lib
    partial = f"{lib}.{os.getpid()}"  # pytest-xdist workers may build it at once
    try:
        subprocess.run([os.environ.get("CC", "cc"), "-shared", "-fPIC", "-O1", "-o", partial,
                        source], check=True, capture_output=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return None
    os.replace(partial, lib)
    return lib


def cpu_flags():
    """The CPU's feature flags as the kernel lists them (empty where /proc/cpuinfo is not)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f
                         if line.startswith("flags")), set())
    except OSError:
        return set()


def simd_width_param(name, *flags):
    """RINGREDUCE_CPU_SIMD=name as a test parameter, skipped where the CPU lacks one of `flags`:
    there cpu_executor.cpp takes a narrower width's loops, and the case would check another."""
    missing = [f for f in flags if f not in cpu_flags()]
    return pytest.param(name, marks=pytest.mark.skipif(
        bool(missing), reason=f"this CPU lacks {' '.join(missing)} (/proc/cpuinfo): "
        f"RINGREDUCE_CPU_SIMD={name} would run a narrower width's loops here"))


def seeded(*case):
    """A generator seeded from the case's description: the same seed in every process and run
    (hash() of a str is randomised per process), printed so a failure can be reproduced."""
    name = " ".join(str(part).replace("torch.", "") for part in case)
    seed = zlib.crc32(name.encode())
    print(f"seed {seed} ({name})")
    return torch.Generator().manual_seed(seed)
