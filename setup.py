"""Builds ringreduce's extensions.

CUDA build when torch has CUDA and nvcc is found, CPU-only otherwise. Knobs (environment):
  RINGREDUCE_FORCE_CPU=1           CPU-only build even where CUDA is available
  RINGREDUCE_CUDA_ARCH_LIST="8.0;9.0"  compute capabilities to compile for (default 8.0;9.0);
                                   PTX for the newest is embedded too, for newer GPUs
  RINGREDUCE_DEBUG=1               -O0 -g (and -lineinfo -G for device code)
  NVCC_THREADS=4                   nvcc --threads
Install without build isolation (torch must already be installed):
  pip install --no-build-isolation --use-pep517 -e .
"""
import glob
import os

from setuptools import find_packages, setup
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))


def env_flag(name):
    return os.environ.get(name, "0").strip().lower() not in ("", "0", "false", "no", "off")


def want_cuda():
    if env_flag("RINGREDUCE_FORCE_CPU"):
        return False
    import torch

    return torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None


def arch_list():
    raw = os.environ.get("RINGREDUCE_CUDA_ARCH_LIST", "8.0;9.0")
    archs = [a.strip() for a in raw.replace(",", ";").replace(" ", ";").split(";") if a.strip()]
    for a in archs:
        major, _, minor = a.partition(".")
        if not (major.isdigit() and minor.rstrip("af").isdigit()):
            raise SystemExit(f"RINGREDUCE_CUDA_ARCH_LIST: '{a}' is not a compute capability like 8.0")
    return archs


def gencode_flags(archs):
    flags = []
    for a in archs:
        cc = a.replace(".", "")
        flags.append(f"-gencode=arch=compute_{cc},code=sm_{cc}")
    newest = max(archs, key=lambda a: tuple(int(x.rstrip("af") or 0) for x in a.split(".")))
    newest = newest.replace(".", "")
    flags.append(f"-gencode=arch=compute_{newest},code=compute_{newest}")
    return flags


def sources(*patterns):
    out = []
    for p in patterns:
        out.extend(sorted(glob.glob(os.path.join("csrc", p))))
    return out


def make_extensions():
    cuda = want_cuda()
    debug = env_flag("RINGREDUCE_DEBUG")
    # No -std flag: torch's build adds the standard its headers need (C++17 or C++20).
    cxx = ["-O0", "-g"] if debug else ["-O3"]
    macros = [("RINGREDUCE_DEBUG", None)] if debug else []
    nvcc = ["-O0", "-g", "-G", "-lineinfo"] if debug else ["-O3"]
    if cuda:
        archs = arch_list()
        # Passed as a bare token (80_90): quotes and semicolons do not survive the build's shell.
        macros += [("RINGREDUCE_WITH_CUDA", None),
                   ("RINGREDUCE_ARCHS", "_".join(a.replace(".", "") for a in archs))]
        nvcc += gencode_flags(archs) + ["--threads", os.environ.get("NVCC_THREADS", "4")]

    def ext(name, srcs, cu_srcs):
        if cuda:
            return cpp_extension.CUDAExtension(
                name, srcs + cu_srcs, include_dirs=[os.path.join(ROOT, "csrc")],
                define_macros=macros, extra_compile_args={"cxx": cxx, "nvcc": nvcc})
        return cpp_extension.CppExtension(
            name, srcs, include_dirs=[os.path.join(ROOT, "csrc")], define_macros=macros,
            extra_compile_args={"cxx": cxx})

    exts = [ext("ringreduce._C", sources("bindings.cpp", "ring/*.cpp"), sources("ring/*.cu"))]
    if os.path.isdir(os.path.join(ROOT, "csrc", "multiprocess")):
        exts.append(ext("ringreduce._dist_C",
                        sources("multiprocess/*.cpp", "ring/cpu_executor.cpp"),
                        sources("multiprocess/*.cu", "ring/cuda_kernels.cu")))
    return exts


setup(
    name="ringreduce",
    version="0.1.0",
    description="Ring all-reduce over peer-to-peer GPU copies, as a PyTorch extension",
    packages=find_packages(include=["ringreduce", "ringreduce.*"]),
    ext_modules=make_extensions(),
    cmdclass={"build_ext": cpp_extension.BuildExtension},
    python_requires=">=3.9",
    # The progress bars of python -m ringreduce.train and bench/ (they run without it). torch
    # is not listed: the build uses the torch already installed.
    install_requires=["tqdm"],
    zip_safe=False,
)
