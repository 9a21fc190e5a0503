"""Builds the C++ test drivers with the host compiler: `build` with a fake CUDA runtime
(tests/test_cuda_protocol.py, test_cuda_lanes.py, test_cuda_host_cost.py, test_step_kernel.py,
test_launch_geometry.py),
`compile_program` without one (tests/test_fused.py, test_oneshot.py)."""
import os
import shutil
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CSRC = os.path.join(ROOT, "csrc")
FAKE = os.path.join(ROOT, "tests", "fake_cuda")
CXX = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def compile_program(exe, sources, flags):
    """One compiler call: `sources` (paths) with `flags` into the executable `exe`, csrc/ on the
    include path; returns the CompletedProcess (the caller decides whether a failure skips)."""
    return subprocess.run([CXX, "-std=c++17", *flags, "-pthread", "-I", CSRC, *sources, "-o",
                           str(exe)], capture_output=True, text=True, timeout=600)


def build(out, name, sources):
    """Compiles `sources` (paths; .cu files as C++) in parallel into `out`/`name`; returns the
    executable's path. The fake's include directory comes first, so <cuda_runtime.h> is the
    fake one."""
    flags = ["-std=c++17", "-O1", "-g", "-pthread", "-Wall", "-Werror",
             "-I", os.path.join(FAKE, "include"), "-I", CSRC]
    objs, procs = [], []
    for src in sources:
        obj = os.path.join(str(out), os.path.basename(src) + ".o")
        objs.append(obj)
        lang = ["-x", "c++"] if src.endswith(".cu") else []
        procs.append((src, subprocess.Popen([CXX, *flags, *lang, "-c", src, "-o", obj],
                                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                            text=True)))
    for src, proc in procs:
        log, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"compiling {src} failed:\n{log}"
    exe = os.path.join(str(out), name)
    link = subprocess.run([CXX, "-pthread", *objs, "-lrt", "-o", exe],
                          capture_output=True, text=True, timeout=300)
    assert link.returncode == 0, link.stdout + link.stderr
    return exe
