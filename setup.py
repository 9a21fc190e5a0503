"""Builds ringreduce's extensions (the metadata is in pyproject.toml).

Where torch is importable at build time (`pip install --no-build-isolation ...`, as
scripts/setup.sh runs it), both extensions are compiled here, against that torch: CUDA where torch
has CUDA and nvcc is found, CPU-only otherwise. In pip's default isolated build environment there
is no torch (none is listed in pyproject.toml's build requirements: a CUDA torch is gigabytes),
so only the package is installed and the first `import ringreduce` compiles the extension
against the torch it finds (ringreduce/_build.py). Either way the wheel carries the sources,
under ringreduce/_csrc. Sources, flags and knobs: ringreduce/_build.py.
"""
import importlib.util
import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))


def _load_build_module():
    """ringreduce/_build.py alone (importing the package would import torch and the extension)."""
    path = os.path.join(ROOT, "ringreduce", "_build.py")
    spec = importlib.util.spec_from_file_location("_ringreduce_build", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build = _load_build_module()


class BuildPyWithSources(build_py):
    """Ships csrc/ inside the package as ringreduce/_csrc, for a first-import compile."""

    def run(self):
        super().run()
        if self.editable_mode:
            return  # the editable package finds csrc/ beside itself
        target = os.path.join(self.build_lib, build.PACKAGE, "_csrc")
        for folder, _, files in os.walk(os.path.join(ROOT, "csrc")):
            for f in files:
                if f.endswith(build.SOURCE_SUFFIXES):
                    src = os.path.join(folder, f)
                    dst = os.path.join(target, os.path.relpath(src, os.path.join(ROOT, "csrc")))
                    os.makedirs(os.path.dirname(dst), exist_ok=True)
                    shutil.copy2(src, dst)


def make_extensions():
    """(extensions, build_ext command) against the installed torch; ([], None) without one."""
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        print("setup.py: no torch in the build environment: installing the package only; the "
              "first `import ringreduce` compiles the extension against the torch it finds")
        return [], None
    if build.torch_too_old(torch.__version__):
        raise SystemExit(f"ringreduce needs torch>={build.MIN_TORCH[0]}.{build.MIN_TORCH[1]}; "
                         f"the build environment has torch {torch.__version__}")
    cuda, _ = build.want_cuda(torch, cpp_extension)
    try:
        flags = build.build_flags(cuda)
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc
    if flags["ldflags"]:
        raise SystemExit("RINGREDUCE_SANITIZE builds happen at first import only (a prebuilt "
                         "library would be loaded without the sanitizer's runtime): unset it "
                         "for the install, then see scripts/sanitize.sh")
    csrc = os.path.join(ROOT, "csrc")

    def ext(name):
        # Relative paths: setuptools refuses absolute source paths.
        srcs = [os.path.relpath(s, ROOT) for s in build.compiled_sources(name, csrc, cuda)]
        kind = cpp_extension.CUDAExtension if cuda else cpp_extension.CppExtension
        args = {"cxx": flags["cxx"], "nvcc": flags["nvcc"]} if cuda else {"cxx": flags["cxx"]}
        return kind(f"{build.PACKAGE}.{name}", srcs, include_dirs=[csrc],
                    define_macros=flags["macros"], extra_compile_args=args)

    return [ext(name) for name in build.EXTENSIONS], cpp_extension.BuildExtension


extensions, build_ext = make_extensions()
commands = {"build_py": BuildPyWithSources}
if build_ext is not None:
    commands["build_ext"] = build_ext
setup(ext_modules=extensions, cmdclass=commands)
