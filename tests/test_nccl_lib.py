"""RINGREDUCE_NCCL_LIB, another libnccl than torch's, on CPU: fake libnccl.so.2 files built here
with the C compiler (ncclGetVersion and ncclGetErrorString, and on a CUDA torch stubs of the
other nccl functions torch imports) stand for the real one.

Everything that loads a fake library runs in a child process, so that no fake libnccl stays
mapped in the test process, where load_libnccl() and torch_nccl_library() would find it later.
"""
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ringreduce.train.nccl import (NCCL_LIB_ENV, PRELOADED_ENV, NcclLibrary, NcclLibraryError,
                                   describe_route, load_libnccl, preload_requested_library)

ROOT = Path(__file__).resolve().parents[1]
CHILD_TIMEOUT_S = 120
CC = shutil.which("cc") or shutil.which("gcc")

FAKE_NCCL_C = r"""
#ifdef FAKE_VERSION
int ncclGetVersion(int *version) { *version = FAKE_VERSION; return 0; }
#endif
const char *ncclGetErrorString(int result) { return result ? "fake error" : "no error"; }
"""


def torch_nccl_imports():
    """The nccl* functions torch's own libraries import. A CUDA build of torch does not load
    with a preloaded libnccl.so.2 that lacks one of them (`undefined symbol: ncclRecv`), so the
    fakes define them all as stubs; a CPU build imports none."""
    import torch

    if torch.version.cuda is None:
        return set()
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("a CUDA torch needs the fake libnccl to define its nccl imports; no nm")
    names = set()
    for lib in Path(torch.__file__).parent.joinpath("lib").glob("libtorch*.so"):
        out = subprocess.run([nm, "-D", "--undefined-only", str(lib)], capture_output=True,
                             text=True, timeout=CHILD_TIMEOUT_S, check=True).stdout
        names.update(w for line in out.splitlines() for w in line.split()[-1:]
                     if w.startswith("nccl"))
    return names - {"ncclGetVersion", "ncclGetErrorString"}


def build_fake(folder, version=None, soname="libnccl.so.2", stubs=()):
    """A shared library named `soname` in `folder`; with `version` it exports ncclGetVersion
    returning that code (major*10000 + minor*100 + patch). `stubs`: more functions, each
    returning ncclInvalidUsage (5)."""
    folder.mkdir(parents=True, exist_ok=True)
    src = folder / "fake.c"
    src.write_text(FAKE_NCCL_C + "".join(f"int {name}(void) {{ return 5; }}\n"
                                         for name in sorted(stubs)))
    out = folder / soname
    flags = [] if version is None else [f"-DFAKE_VERSION={version}"]
    subprocess.run([CC, "-shared", "-fPIC", *flags, f"-Wl,-soname,{soname}", "-o", str(out),
                    str(src)], check=True, timeout=CHILD_TIMEOUT_S)
    return str(out)


@pytest.fixture(scope="module")
def fakes(tmp_path_factory):
    if CC is None:
        pytest.skip("no C compiler (cc or gcc) to build the fake libnccl.so.2")
    root = tmp_path_factory.mktemp("fake_nccl")
    stubs = torch_nccl_imports()
    return {"new": build_fake(root / "new", 23102, stubs=stubs),
            "old": build_fake(root / "old", 22703, stubs=stubs),
            "noversion": build_fake(root / "noversion", stubs=stubs),
            "other": build_fake(root / "other", soname="libother.so")}


def run_python(code, *args, env=None):
    """`code` in a fresh interpreter that imports this checkout's ringreduce, with none of
    RINGREDUCE_NCCL_LIB, its re-execution marker and LD_PRELOAD inherited; `env` is added."""
    full = {k: v for k, v in os.environ.items()
            if k not in (NCCL_LIB_ENV, PRELOADED_ENV, "LD_PRELOAD")}
    full["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                         if p)
    full.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args],
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, cwd=ROOT,
                          env=full)


def last_json(res):
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(res.stdout.splitlines()[-1])


LOAD = """
import json
from ringreduce.train.nccl import load_libnccl
lib, library = load_libnccl()
print(json.dumps({**library.as_dict(), "describe": library.describe()}))
"""


@pytest.mark.parametrize("which,version", [("new", "2.31.2"), ("old", "2.27.3")])
def test_load_libnccl_loads_the_named_file(fakes, which, version):
    got = last_json(run_python(LOAD, env={NCCL_LIB_ENV: fakes[which]}))
    assert got["version"] == version
    assert got["path"] == fakes[which]
    assert got["origin"] == "from RINGREDUCE_NCCL_LIB"
    assert got["describe"] == f"NCCL {version} from RINGREDUCE_NCCL_LIB ({fakes[which]})"


def test_a_missing_named_file_is_an_error(tmp_path, monkeypatch):
    missing = tmp_path / "nowhere" / "libnccl.so.2"
    monkeypatch.setenv(NCCL_LIB_ENV, str(missing))
    with pytest.raises(NcclLibraryError, match=f"{NCCL_LIB_ENV}={missing}: no such file"):
        load_libnccl()
    with pytest.raises(NcclLibraryError, match="no such file"):
        preload_requested_library()


def test_a_named_file_without_ncclGetVersion_is_an_error(fakes):
    res = run_python(LOAD, env={NCCL_LIB_ENV: fakes["noversion"]})
    assert res.returncode != 0
    assert (f"NcclLibraryError: {NCCL_LIB_ENV}={fakes['noversion']} is not a libnccl: it has no "
            "ncclGetVersion") in res.stderr


PRELOAD = """
import json, os, sys
print("START", flush=True)
from ringreduce.train.nccl import (mapped_libnccl, preload_requested_library,
                                   requested_mismatch, torch_nccl_library)
preload_requested_library()
new, old = torch_nccl_library((2, 31, 2)), torch_nccl_library((2, 27, 3))
print(json.dumps({"LD_PRELOAD": os.environ.get("LD_PRELOAD"), "mapped": mapped_libnccl(),
                  "argv": sys.argv[1:], "new": new.as_dict(), "old": old.as_dict(),
                  "old_mismatch": requested_mismatch(old)}))
"""


def test_preload_reexecutes_once_with_the_library_first(fakes):
    """The command starts again once, with the same arguments, the named library first in
    LD_PRELOAD before what was there, and mapped; torch_nccl_library then attributes the
    library's version to that file, and any other version to NCCL linked into torch."""
    res = run_python(PRELOAD, "a", "--b", env={NCCL_LIB_ENV: fakes["new"],
                                               "LD_PRELOAD": fakes["other"]})
    got = last_json(res)
    assert res.stdout.count("START") == 2
    assert got["LD_PRELOAD"] == f"{fakes['new']}:{fakes['other']}"
    # A CUDA torch maps its own bundled libnccl too (by path, beside the preloaded one).
    assert fakes["new"] in got["mapped"], got["mapped"]
    assert all(m == fakes["new"] or _torch_bundled(m) for m in got["mapped"]), got["mapped"]
    assert got["argv"] == ["a", "--b"]
    assert got["new"] == {"version": "2.31.2", "path": fakes["new"],
                          "origin": "from RINGREDUCE_NCCL_LIB"}
    assert got["old"] == {"version": "2.27.3", "path": None, "origin": "torch's bundled"}
    assert got["old_mismatch"].startswith(f"{NCCL_LIB_ENV}={fakes['new']} is not what runs here")


def _torch_bundled(path):
    """A libnccl that torch's own wheels bring (nvidia-nccl beside torch in site-packages)."""
    import torch

    return path.startswith(os.path.dirname(os.path.dirname(torch.__file__)) + os.sep)


def test_preload_does_nothing_without_the_variable():
    res = run_python(PRELOAD)
    got = last_json(res)
    assert res.stdout.count("START") == 1
    assert got["LD_PRELOAD"] is None
    assert all(_torch_bundled(m) for m in got["mapped"]), got["mapped"]
    assert got["old_mismatch"] is None


def test_preload_does_not_loop_when_ld_preload_did_not_take(fakes):
    """A process marked as re-executed for the library but without it mapped stops with an
    error instead of starting again."""
    res = run_python(PRELOAD, env={NCCL_LIB_ENV: fakes["new"], PRELOADED_ENV: fakes["new"]})
    assert res.returncode != 0
    assert res.stdout.count("START") == 1
    assert "does not have the library mapped" in res.stderr


def test_describe_route_warns_when_the_named_file_is_not_what_runs(fakes, monkeypatch):
    monkeypatch.setenv(NCCL_LIB_ENV, fakes["new"])
    named = NcclLibrary((2, 31, 2), fakes["new"], "from RINGREDUCE_NCCL_LIB")
    assert describe_route("torch.cuda.nccl.all_reduce", named) == (
        f"NCCL 2.31.2 from RINGREDUCE_NCCL_LIB ({fakes['new']}), "
        "through torch.cuda.nccl.all_reduce")
    linked = NcclLibrary((2, 27, 3), None, "torch's bundled")
    assert describe_route("torch.cuda.nccl.all_reduce", linked) == (
        "NCCL 2.27.3 torch's bundled (linked into torch), through torch.cuda.nccl.all_reduce; "
        f"{NCCL_LIB_ENV}={fakes['new']} is not what runs here (torch has NCCL linked in, "
        "which LD_PRELOAD cannot replace)")
    other = NcclLibrary((2, 27, 3), fakes["old"], "from /proc/self/maps")
    assert describe_route("torch.cuda.nccl.all_reduce", other).endswith(
        f"{NCCL_LIB_ENV}={fakes['new']} is not what runs here (this process did not start "
        "with it preloaded)")


RING_SETUP = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
import ring

def torch_version_not_wanted():
    raise AssertionError("setup_nccl asked for torch's NCCL version")

torch._C._nccl_all_reduce = object()  # pretend this CPU torch has NCCL
ring.nccl_version_tuple = torch_version_not_wanted
ring.torch_nccl_accepts = lambda cfg: len(set(cfg.rank_devices)) == cfg.ranks
ring._probe_nccl_in_child = lambda cfg: "stub trial (no GPU here)"
# an H100's SMs, for the CTA cap of ranks sharing a GPU
torch.cuda.get_device_properties = lambda d: type("P", (), {"multi_processor_count": 132})()
gpus = int(sys.argv[2])
cfg = ring.Config(device="cuda", rank_devices=[torch.device("cuda", r % gpus) for r in range(4)],
                  dtype_name="float32", op="sum", sizes=[8], iters=1, warmup=0, seed=0,
                  layout="test")
impl, why, info = ring.setup_nccl(cfg)
print(json.dumps({"impl": impl is not None, "short": why.short, "detail": why.detail,
                  "info": info, "header": info["library"]}))
"""


@pytest.mark.parametrize("gpus", [1, 4])
def test_ring_bench_calls_the_named_library(fakes, gpus):
    """With RINGREDUCE_NCCL_LIB the ring benchmark takes the ctypes route, on simulated ranks
    and on one rank per GPU alike, and its header and JSON name that library."""
    got = last_json(run_python(RING_SETUP, str(ROOT / "bench"), str(gpus),
                               env={NCCL_LIB_ENV: fakes["new"]}))
    info = got["info"]
    assert (info["version"], info["path"], info["origin"]) == (
        "2.31.2", fakes["new"], "from RINGREDUCE_NCCL_LIB")
    assert info["route"].startswith("libnccl via ctypes (ncclCommInitAll")
    assert ("with the GPU repeated" in info["route"]) == (gpus == 1)
    assert got["header"] == f"NCCL 2.31.2 from RINGREDUCE_NCCL_LIB ({fakes['new']})"
    assert "stub trial" in got["detail"]
    assert f"NCCL 2.31.2 from RINGREDUCE_NCCL_LIB ({fakes['new']})" in got["detail"]


def test_ring_bench_names_an_old_named_library_in_its_column(fakes):
    got = last_json(run_python(RING_SETUP, str(ROOT / "bench"), "1",
                               env={NCCL_LIB_ENV: fakes["old"]}))
    assert got["short"] == "not run: NCCL 2.27.3 < 2.30"
    assert "Duplicate GPU detected" in got["detail"]
    assert "RINGREDUCE_NCCL_LIB is set" in got["detail"]
    assert "nccl_carry.sh" not in got["detail"]  # no hint to set what is set


SKIP_REASON = """
import json, torch
from ringreduce.train.trainers import nccl_skip_reason
torch._C._nccl_all_reduce = object()  # pretend this CPU torch has NCCL
print(json.dumps(nccl_skip_reason([torch.device("cuda", 0)] * 2)))
"""


def test_trainer_judges_the_named_library_for_simulated_ranks(fakes):
    old = last_json(run_python(SKIP_REASON, env={NCCL_LIB_ENV: fakes["old"]}))
    assert old.startswith(f"NCCL 2.27.3 from RINGREDUCE_NCCL_LIB ({fakes['old']}) refuses "
                          "several ranks on one GPU")
    new = last_json(run_python(SKIP_REASON, env={NCCL_LIB_ENV: fakes["new"],
                                                 "NCCL_MULTI_RANK_GPU_ENABLE": "0"}))
    assert new.startswith("NCCL 2.31.2 from RINGREDUCE_NCCL_LIB")
    assert "only with NCCL_MULTI_RANK_GPU_ENABLE=1" in new
    assert last_json(run_python(SKIP_REASON, env={NCCL_LIB_ENV: fakes["new"],
                                                  "NCCL_MULTI_RANK_GPU_ENABLE": "1"})) is None


TRAIN = """
import os, sys
print("START", os.environ.get("LD_PRELOAD"), flush=True)
from ringreduce.train import main
sys.exit(main())
"""


def test_trainer_cli_starts_again_with_the_named_library(fakes):
    res = run_python(TRAIN, "--allreduce", "nccl", "--device", "cpu", "--epochs", "1",
                     env={NCCL_LIB_ENV: fakes["new"]})
    assert res.stdout.splitlines() == ["START None", f"START {fakes['new']}"]
    assert res.returncode == 2 and "NCCL needs CUDA ranks" in res.stderr


def test_trainer_cli_stops_on_an_unusable_named_library(tmp_path):
    missing = tmp_path / "libnccl.so.2"
    res = run_python(TRAIN, "--allreduce", "nccl", "--device", "cpu", "--epochs", "1",
                     env={NCCL_LIB_ENV: str(missing)})
    assert res.returncode == 2
    assert res.stdout.splitlines() == ["START None"]
    assert f"ringreduce.train: {NCCL_LIB_ENV}={missing}: no such file" in res.stderr
