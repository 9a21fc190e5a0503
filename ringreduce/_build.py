"""Building ringreduce's compiled extensions: what setup.py compiles at install and what the first
import compiles where the install had no torch (the shape of DeepSpeed's OpBuilder.load()).

`compiled_sources()` and `build_flags()` are the one description of both extensions (sources,
flags, macros, CUDA architectures); setup.py reads them from this file without importing the
package, so this module imports nothing outside the standard library at its top.

`load_extension(name)` returns ``ringreduce.<name>``: the module setup.py built, where there is
one, else the one compiled from the shipped sources with torch.utils.cpp_extension (ninja), into
a cache directory per torch version and build flags, under an exclusive lock so that ranks
importing at once compile once.

Knobs (environment):
  RINGREDUCE_FORCE_CPU=1               CPU-only build even where CUDA is available
  RINGREDUCE_CUDA_ARCH_LIST="8.0;9.0"  compute capabilities to compile for (default below);
                                       PTX for the newest is embedded too, for newer GPUs
  RINGREDUCE_DEBUG=1                   -O0 -g (and -lineinfo -G for device code)
  RINGREDUCE_SANITIZE=address|thread   host code built with AddressSanitizer or ThreadSanitizer,
                                       by the first-import compile only (never the prebuilt
                                       library); run with the sanitizer's runtime preloaded
                                       (scripts/sanitize.sh)
  NVCC_THREADS=4                       nvcc --threads
  RINGREDUCE_CACHE_DIR=DIR             where first-import builds go
                                       (default $XDG_CACHE_HOME/ringreduce, ~/.cache/ringreduce)
  RINGREDUCE_BUILD_WAIT_S=1800         how long an import waits for another process's compile
"""
import fcntl
import glob
import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import time

PACKAGE = "ringreduce"
MIN_TORCH = (2, 11)
DEFAULT_CUDA_ARCHS = "8.0;9.0"

# Sources relative to csrc/: (C++ patterns, CUDA patterns compiled only in a CUDA build).
EXTENSIONS = {
    "_C": (("bindings.cpp", "ring/*.cpp"), ("ring/*.cu",)),
    "_dist_C": (("multiprocess/*.cpp", "ring/cpu_executor.cpp"),
                ("multiprocess/*.cu", "ring/cuda_kernels.cu", "ring/oneshot_kernel.cu")),
}
SOURCE_SUFFIXES = (".cpp", ".cu", ".h", ".cuh")

# Wall seconds measured on the shared 2-core CI machine (CUDA: one arch), what the progress line
# promises (docs/INSTALL.md).
TYPICAL_BUILD_S = {("_C", False): 60, ("_dist_C", False): 150, ("_C", True): 110,
                   ("_dist_C", True): 85}


class BuildError(ImportError):
    """An extension could not be compiled or loaded; the message says why and what to do."""


def env_flag(name):
    return os.environ.get(name, "0").strip().lower() not in ("", "0", "false", "no", "off")


def arch_list():
    raw = os.environ.get("RINGREDUCE_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS)
    archs = [a.strip() for a in raw.replace(",", ";").replace(" ", ";").split(";") if a.strip()]
    if not archs:
        raise ValueError("RINGREDUCE_CUDA_ARCH_LIST: no compute capability given (e.g. '9.0')")
    for a in archs:
        major, _, minor = a.partition(".")
        if not (major.isdigit() and minor.rstrip("af").isdigit()):
            raise ValueError(f"RINGREDUCE_CUDA_ARCH_LIST: '{a}' is not a compute capability "
                             "like 8.0")
    return archs


def gencode_flags(archs):
    flags = [f"-gencode=arch=compute_{a.replace('.', '')},code=sm_{a.replace('.', '')}"
             for a in archs]
    newest = max(archs, key=lambda a: tuple(int(x.rstrip("af") or 0) for x in a.split(".")))
    newest = newest.replace(".", "")
    flags.append(f"-gencode=arch=compute_{newest},code=compute_{newest}")
    return flags


def build_flags(cuda):
    """{"cxx": [...], "nvcc": [...], "macros": [(name, value or None)]} for both extensions."""
    debug = env_flag("RINGREDUCE_DEBUG")
    # No -std flag: torch's build adds the standard its headers need (C++17 or C++20).
    cxx = ["-O0", "-g"] if debug else ["-O3"]
    macros = [("RINGREDUCE_DEBUG", None)] if debug else []
    ldflags = []
    sanitizer = sanitize()
    if sanitizer:
        cxx = ["-O0" if debug else "-O1", "-g", "-fno-omit-frame-pointer",
               f"-fsanitize={sanitizer}"]
        ldflags = [f"-fsanitize={sanitizer}"]
    nvcc = ["-O0", "-g", "-G", "-lineinfo"] if debug else ["-O3"]
    if cuda:
        archs = arch_list()
        # A bare token (80_90): quotes and semicolons do not survive the build's shell.
        macros += [("RINGREDUCE_WITH_CUDA", None),
                   ("RINGREDUCE_ARCHS", "_".join(a.replace(".", "") for a in archs))]
        nvcc += gencode_flags(archs) + ["--threads", os.environ.get("NVCC_THREADS", "4")]
    return {"cxx": cxx, "nvcc": nvcc, "macros": macros, "ldflags": ldflags}


def sanitize():
    """RINGREDUCE_SANITIZE: "address", "thread" or "" (none)."""
    value = os.environ.get("RINGREDUCE_SANITIZE", "").strip().lower()
    if value not in ("", "address", "thread"):
        raise ValueError(f"RINGREDUCE_SANITIZE must be address or thread; got {value!r}")
    return value


def compiled_sources(name, csrc, cuda):
    """The sources of extension `name` under the directory `csrc`, sorted, CUDA ones included
    only in a CUDA build."""
    cpp, cu = EXTENSIONS[name]
    out = []
    for pattern in cpp + (cu if cuda else ()):
        out.extend(sorted(glob.glob(os.path.join(csrc, pattern))))
    return out


def source_dir():
    """csrc/ of the source tree (editable install, or a checkout on sys.path), else the copy
    that setup.py ships inside the package (ringreduce/_csrc)."""
    here = os.path.dirname(os.path.abspath(__file__))
    for candidate in (os.path.join(os.path.dirname(here), "csrc"), os.path.join(here, "_csrc")):
        if os.path.isfile(os.path.join(candidate, "bindings.cpp")):
            return candidate
    raise BuildError(f"{PACKAGE}: its C++ sources are missing (looked for csrc/ beside {here} "
                     f"and {here}/_csrc); reinstall with `pip install .` from the repository")


def load_extension(name):
    """``ringreduce.<name>``: the one setup.py built beside this file, else compiled on first
    use (cached)."""
    full = f"{PACKAGE}.{name}"
    module = sys.modules.get(full)
    if module is None:
        import torch  # noqa: F401  (the extension links against libtorch, which this loads)

        # A sanitizer build is never the prebuilt library (setup.py builds without one).
        module = (None if sanitize() else _load_prebuilt(name, full)) or _jit_load(name, full)
        setattr(sys.modules[PACKAGE], name, module)
    return module


def _load_prebuilt(name, full):
    """The library setup.py built in this package's directory, or None. Looked for there
    rather than imported by name: an editable install's import hook would find the one of
    another source tree."""
    here = os.path.dirname(os.path.abspath(__file__))
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(here, name + suffix)
        if os.path.isfile(path):
            break
    else:
        return None
    try:
        return _import_from(path, full)
    except ImportError as exc:
        raise BuildError(
            f"{PACKAGE}: the prebuilt {path} does not load ({exc}). It was probably built "
            "against another torch than this one; rebuild it (scripts/setup.sh or `pip install "
            "--no-build-isolation -e .`), or delete it to have it compiled on import") from exc


def _check_torch():
    import torch

    if torch_too_old(torch.__version__):
        raise BuildError(f"{PACKAGE} needs torch>={MIN_TORCH[0]}.{MIN_TORCH[1]}; this Python has "
                         f"torch {torch.__version__} "
                         f"(pip install 'torch>={MIN_TORCH[0]}.{MIN_TORCH[1]}')")
    return torch


def torch_too_old(version):
    """Whether torch `version` ("2.13.0+cpu", "2.14.0.dev20260101") is older than MIN_TORCH."""
    return tuple(int(p) for p in str(version).split("+")[0].split(".")[:2]) < MIN_TORCH


def _find_ninja():
    """ninja's directory: on PATH, else the one the `ninja` pip package carries (its console
    script sits in a venv's bin/, which is not on PATH when the venv is not activated)."""
    found = shutil.which("ninja")
    if found:
        return os.path.dirname(found)
    try:
        import ninja
    except ImportError:
        ninja = None
    if ninja is not None and os.path.isfile(os.path.join(ninja.BIN_DIR, "ninja")):
        return ninja.BIN_DIR
    raise BuildError(f"{PACKAGE}: compiling its extension on first import needs ninja, which is "
                     "neither on PATH nor installed as a Python package: pip install ninja")


def _check_compiler():
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        origin = "$CXX" if "CXX" in os.environ else "the default C++ compiler"
        raise BuildError(f"{PACKAGE}: compiling its extension on first import needs a C++ "
                         f"compiler; {origin} '{cxx}' was not found (install g++, or point CXX "
                         "at a compiler)")
    return cxx


def want_cuda(torch, cpp_extension):
    """(cuda, why not) for this torch and machine."""
    if env_flag("RINGREDUCE_FORCE_CPU"):
        return False, "RINGREDUCE_FORCE_CPU is set"
    if torch.version.cuda is None:
        return False, "this torch has no CUDA"
    if cpp_extension.CUDA_HOME is None or not os.path.isfile(
            os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc")):
        return False, "nvcc was not found (set CUDA_HOME to the CUDA toolkit)"
    return True, ""


def _cache_root():
    root = os.environ.get("RINGREDUCE_CACHE_DIR")
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, PACKAGE)
    return root


def _build_dir(name, torch, cuda, flags, sources, cxx, nvcc):
    """One directory per torch version, Python, flags, compilers and list of sources (a file
    added to the tree is a new build: ninja, run on the old build file, would not see it)."""
    kind = f"cu{torch.version.cuda.replace('.', '')}" if cuda else "cpu"
    key = repr((flags, sources, cxx, nvcc, sys.version, sysconfig.get_config_var("EXT_SUFFIX")))
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    tag = f"torch{torch.__version__.replace('+', '-')}-py{sys.version_info[0]}{sys.version_info[1]}"
    return os.path.join(_cache_root(), f"{tag}-{kind}-{digest}", name)


def _lock(path, what):
    """An exclusive flock on `path` (released by the kernel if the holder dies), waited for at
    most RINGREDUCE_BUILD_WAIT_S seconds."""
    wait_s = float(os.environ.get("RINGREDUCE_BUILD_WAIT_S", "1800"))
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + wait_s
    told = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise BuildError(f"{PACKAGE}: waited {wait_s:.0f} s for another process compiling "
                                 f"{what} (lock {path}); raise RINGREDUCE_BUILD_WAIT_S or remove "
                                 "the build directory if no such process is running") from None
            if not told:
                print(f"{PACKAGE}: waiting for another process compiling {what} ({path})",
                      file=sys.stderr, flush=True)
                told = True
            time.sleep(0.2)
    return fd


def _up_to_date(build_dir, name, ninja_dir):
    """Whether the library exists and ninja has nothing to do for it."""
    if not (os.path.isfile(os.path.join(build_dir, "build.ninja"))
            and os.path.isfile(os.path.join(build_dir, name + ".so"))):
        return False
    proc = subprocess.run([os.path.join(ninja_dir, "ninja"), "-n", "-C", build_dir],
                          capture_output=True, text=True, timeout=60)
    return proc.returncode == 0 and "no work to do" in proc.stdout


def _import_from(path, full):
    loader = importlib.machinery.ExtensionFileLoader(full, path)
    spec = importlib.util.spec_from_file_location(full, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.modules[full] = module
    return module


def _jit_load(name, full):
    torch = _check_torch()
    ninja_dir = _find_ninja()
    cxx = _check_compiler()
    from torch.utils import cpp_extension

    cuda, why_cpu = want_cuda(torch, cpp_extension)
    try:
        flags = build_flags(cuda)
    except ValueError as exc:
        raise BuildError(f"{PACKAGE}: {exc}") from exc
    csrc = source_dir()
    sources = compiled_sources(name, csrc, cuda)
    nvcc = os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc") if cuda else None
    build_dir = _build_dir(name, torch, cuda, flags, sources, cxx, nvcc)
    os.makedirs(build_dir, exist_ok=True)
    if ninja_dir not in os.environ.get("PATH", "").split(os.pathsep):
        # torch runs `ninja` from PATH
        os.environ["PATH"] = ninja_dir + os.pathsep + os.environ.get("PATH", "")
    defines = [f"-D{k}" if v is None else f"-D{k}={v}" for k, v in flags["macros"]]
    what = f"{full} ({'CUDA ' + ';'.join(arch_list()) if cuda else 'CPU-only: ' + why_cpu})"
    library = os.path.join(build_dir, name + ".so")
    fd = _lock(os.path.join(build_dir, "ringreduce.lock"), what)
    try:
        if not _up_to_date(build_dir, name, ninja_dir):
            # torch's own lock (a file, not a flock) is uncontended under ours: one left by a
            # killed build would make torch wait forever.
            stale = os.path.join(build_dir, "lock")
            if os.path.exists(stale):
                os.remove(stale)
            print(f"{PACKAGE}: compiling {what} against torch {torch.__version__}, once per "
                  f"torch version and build flags; takes about "
                  f"{TYPICAL_BUILD_S[(name, cuda)]} s on 2 cores (build directory {build_dir})",
                  file=sys.stderr, flush=True)
            start = time.monotonic()
            try:
                cpp_extension.load(
                    name=name, sources=sources, build_directory=build_dir,
                    extra_include_paths=[csrc], extra_cflags=flags["cxx"] + defines,
                    extra_cuda_cflags=flags["nvcc"] + defines, with_cuda=cuda,
                    extra_ldflags=flags["ldflags"],
                    is_python_module=False, verbose=False)
            except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
                log = os.path.join(build_dir, "build.log")
                with open(log, "w") as f:
                    f.write(str(exc))
                raise BuildError(
                    f"{PACKAGE}: compiling {what} failed (full output in {log}; sources in "
                    f"{csrc}):\n{_tail(str(exc))}") from exc
            print(f"{PACKAGE}: compiled {full} in {time.monotonic() - start:.0f} s",
                  file=sys.stderr, flush=True)
        try:
            return _import_from(library, full)
        except ImportError as exc:
            raise BuildError(f"{PACKAGE}: the compiled {library} does not load ({exc}); delete "
                             f"{build_dir} to have it compiled again") from exc
    finally:
        os.close(fd)


def _tail(text, lines=200):
    parts = text.splitlines()
    if len(parts) <= lines:
        return text
    return "\n".join([f"[... {len(parts) - lines} lines before; see the log]"] + parts[-lines:])
