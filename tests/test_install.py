"""A new user's install: plain `pip install -e .` in a fresh venv, then `import ringreduce`
compiles the extension against that venv's torch (ringreduce/_build.py), once however many
processes import at once; and the errors of a first-import compile where something is missing.

The fresh-venv test takes about 2 minutes (a venv, torch from the local wheel, the compile): it
runs where RINGREDUCE_REQUIRE_INSTALL_TEST=1 (.ci/run sets it) and is skipped elsewhere. The
error cases fail before compiling anything and always run.
"""
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from checks import communicate_bounded

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH = os.environ.get("RINGREDUCE_TORCH", "2.13.0")
SEED = 2813

# Each rank of the check all-reduces seeded integer-valued float32 tensors (exact sums) and
# compares with the sum in int64 computed here, before the call.
ALL_REDUCE = f"""
import torch
import ringreduce
print("ringreduce from", ringreduce.__file__)
print("extension from", ringreduce._C.__file__)
print("torch from", torch.__file__)
print("seed {SEED}")
g = torch.Generator().manual_seed({SEED})
a = torch.randint(-1000, 1000, (1031,), generator=g)
b = torch.randint(-1000, 1000, (1031,), generator=g)
expected = a + b
ta, tb = a.float(), b.float()
ringreduce.all_reduce([ta, tb])
assert torch.equal(ta.long(), expected) and torch.equal(tb.long(), expected), "wrong sum"
print("all_reduce ok")
"""


def clean_copy(dest):
    """The repository's tracked files (no build output) copied to `dest`."""
    if shutil.which("git") is None or not os.path.exists(os.path.join(REPO, ".git")):
        pytest.skip("needs git and a git checkout of the repository (copies its tracked files)")
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True,
                           timeout=60).stdout.decode().split("\0")
    for f in filter(None, files):
        src = os.path.join(REPO, f)
        if os.path.isfile(src):
            os.makedirs(os.path.join(dest, os.path.dirname(f)), exist_ok=True)
            shutil.copy2(src, os.path.join(dest, f))
    return dest


def run(cmd, timeout, **kw):
    """(exit status, stdout and stderr together) of `cmd`, killed past `timeout` seconds."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, **kw)
    out = communicate_bounded(proc, timeout)
    return proc.wait(timeout=10), out


@pytest.fixture(scope="module")
def source_copy(tmp_path_factory):
    return clean_copy(str(tmp_path_factory.mktemp("repo")))


# ---- errors of a first-import compile (they happen before anything is compiled)

def import_from_copy(source_copy, tmp_path, prelude="", **env):
    """`import ringreduce` from the uninstalled copy (no prebuilt extension) in this Python,
    with a fresh build cache."""
    full_env = dict(os.environ, PYTHONPATH=source_copy,
                    RINGREDUCE_CACHE_DIR=str(tmp_path / "cache"), **env)
    code = prelude + "\nimport ringreduce\nprint('imported', ringreduce.__file__)"
    return run([sys.executable, "-c", code], 300, cwd=str(tmp_path), env=full_env)


def assert_build_error(status, out, *phrases):
    assert status == 1, out
    assert "\nringreduce._build.BuildError: ringreduce" in out, out
    for phrase in phrases:
        assert phrase in out, out


def test_no_ninja_is_a_clear_error(source_copy, tmp_path):
    # No ninja on PATH, and the ninja package made unimportable.
    empty = tmp_path / "bin"
    empty.mkdir()
    status, out = import_from_copy(source_copy, tmp_path, "import sys; sys.modules['ninja'] = None",
                                   PATH=str(empty))
    assert_build_error(status, out, "needs ninja", "pip install ninja")


def test_no_compiler_is_a_clear_error(source_copy, tmp_path):
    status, out = import_from_copy(source_copy, tmp_path, CXX=str(tmp_path / "no-such-c++"))
    assert_build_error(status, out, "needs a C++ compiler", "no-such-c++' was not found")


def test_compiler_output_is_in_the_error(source_copy, tmp_path):
    cxx = tmp_path / "failing-c++"
    # Answers torch's version probe like the real compiler; fails every compile.
    cxx.write_text("#!/bin/sh\n"
                   "case \"$1\" in --version|-v|-dumpversion|-dumpfullversion) exec c++ \"$@\";; esac\n"
                   "echo 'failing-c++: planted compile error' >&2\nexit 1\n")
    cxx.chmod(0o755)
    status, out = import_from_copy(source_copy, tmp_path, CXX=str(cxx))
    assert_build_error(status, out, "compiling ringreduce._C (", "failed",
                       "planted compile error")
    assert "compiled ringreduce._C in" not in out, out


def test_old_torch_is_a_clear_error(source_copy, tmp_path):
    status, out = import_from_copy(source_copy, tmp_path,
                                   "import torch; torch.__version__ = '2.1.0+cpu'")
    assert_build_error(status, out, "needs torch>=2.11", "torch 2.1.0+cpu")


# ---- a new user's path

@pytest.mark.timeout(1200)
def test_fresh_venv_plain_editable_install(source_copy, tmp_path):
    if os.environ.get("RINGREDUCE_REQUIRE_INSTALL_TEST") != "1":
        pytest.skip("a fresh venv and a first-import compile take about 2 minutes: set "
                    "RINGREDUCE_REQUIRE_INSTALL_TEST=1 to run it (.ci/run does)")
    venv = tmp_path / "venv"
    status, out = run([sys.executable, "-m", "venv", str(venv)], 300)
    assert status == 0, out
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "--disable-pip-version-check"]
    status, out = run(pip + ["install", "-q", f"torch=={TORCH}"], 600)
    assert status == 0, out

    # What a new user types, in the repository: no flags.
    status, out = run(pip + ["install", "-e", "."], 600, cwd=source_copy)
    assert status == 0, out

    # Three processes import at once (ranks starting together) in a fresh build cache.
    cache = tmp_path / "cache"
    env = dict(os.environ, RINGREDUCE_CACHE_DIR=str(cache))
    env.pop("PYTHONPATH", None)
    procs = [subprocess.Popen([python, "-c", ALL_REDUCE], cwd=str(tmp_path), env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for _ in range(3)]
    outs = [communicate_bounded(p, 900) for p in procs]
    statuses = [p.wait(timeout=10) for p in procs]
    for status, out in zip(statuses, outs):
        assert status == 0, out
        assert "all_reduce ok" in out, out
        assert f"ringreduce from {source_copy}" in out, out  # the editable copy
        assert f"extension from {cache}" in out, out  # compiled on import, into the cache
        assert f"torch from {venv}" in out, out  # against the venv's torch
    compiling = [out for out in outs if "ringreduce: compiling ringreduce._C" in out]
    assert len(compiling) == 1, "the extension must be compiled once:\n" + "\n".join(outs)
    assert "compiled ringreduce._C in" in compiling[0], compiling[0]

    # The wheel of a plain `pip wheel .` (no torch at build time) carries the sources.
    status, out = run(pip + ["wheel", "-q", "--no-deps", "-w", str(tmp_path / "wheels"), "."],
                      600, cwd=source_copy)
    assert status == 0, out
    wheel, = (tmp_path / "wheels").glob("ringreduce-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in ("ringreduce/_build.py", "ringreduce/_csrc/bindings.cpp",
              "ringreduce/_csrc/multiprocess/dist_bindings.cpp", "ringreduce/_csrc/ring/plan.h"):
        assert f in names, sorted(names)
