#!/usr/bin/env bash
# CI: the real CUDA build. Builds the whole extension against torch's CUDA wheel (no GPU needed:
# nvcc compiles, the linker resolves every CUDA and torch symbol), imports it, checks that
# build_info() says CUDA, then runs the test suite on it (a CUDA build's CPU paths and the
# fake CUDA runtime). The CPU-torch run in .ci/run stays as it is; this one works in a
# copy of the tree and a venv of its own, so the two builds never overwrite each other.
#   bash scripts/ci_cuda_build.sh
# Knobs: RINGREDUCE_CUDA_TORCH (torch version, default 2.14.1, the CUDA 13.0 build);
# CUDA_HOME (default /usr/local/cuda); RINGREDUCE_CUDA_ARCH_LIST (default 9.0, one arch keeps
# the build near 4 minutes); CI_CUDA_WORKDIR (where the venv and the copy go; default a fresh
# temporary folder, removed at the end).
# The tests: the whole suite (tests/), as the CPU-torch run in .ci/run runs it, on the CUDA
# build: the CPU paths of a build with its CUDA branches compiled in, torch's CUDA wheel (a
# different torch release, so the suite's adaptations to torch versions are exercised too) and
# the fake CUDA runtime. Tests that need a GPU skip with their reason. Left out:
# tests/test_install.py's fresh-venv test (a new user's CPU install; it is run by the CPU-torch
# run already).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export RINGREDUCE_CUDA_ARCH_LIST=${RINGREDUCE_CUDA_ARCH_LIST:-9.0}
torch_version=${RINGREDUCE_CUDA_TORCH:-2.14.1}

[ -x "$CUDA_HOME/bin/nvcc" ] || { echo "ci_cuda_build: no nvcc at $CUDA_HOME/bin/nvcc" >&2; exit 1; }
work=${CI_CUDA_WORKDIR:-}
if [ -z "$work" ]; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
fi
stamp() { echo "ci_cuda_build: $1 ($(( SECONDS - t0 )) s)"; }
t0=$SECONDS

echo "== CUDA build: venv with torch==$torch_version in $work/venv"
python3 -m venv "$work/venv"
py=$work/venv/bin/python
"$py" -m pip install -q "torch==$torch_version" numpy pytest pytest-timeout ninja expecttest
# tqdm: the trainer's and benchmarks' bars; accelerate: tests/test_clients.py.
"$py" -m pip install -q tqdm "accelerate>=1.0"
"$py" -c "import torch; assert torch.version.cuda, 'torch ' + torch.__version__ + \
  ' is not a CUDA build'; print('ci_cuda_build: torch', torch.__version__, 'cuda', torch.version.cuda)"
stamp "venv ready"

echo "== CUDA build: the tree copied to $work/src (the CPU build's files stay untouched)"
mkdir -p "$work/src"
if git rev-parse --is-inside-work-tree > /dev/null 2>&1; then
  git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf - | tar -xf - -C "$work/src"
else  # no git: everything but the CPU build's outputs (the patterns of .gitignore)
  tar --exclude=./build --exclude=./dist --exclude='*.egg-info' --exclude='*.so' --exclude='*.o' \
    --exclude=__pycache__ --exclude=.pytest_cache --exclude=./gpu-logs -cf - . | tar -xf - -C "$work/src"
fi
cd "$work/src"
# A git checkout of its own (tests/test_install.py copies the tracked files of one); the build
# outputs that follow are ignored by the copied .gitignore.
if command -v git > /dev/null; then
  git init -q && git add -A && git -c user.name=ci -c user.email=ci@localhost commit -qm "copy"
fi
"$py" -m pip install -q --no-build-isolation --no-deps --use-pep517 -e .
stamp "built for sm_${RINGREDUCE_CUDA_ARCH_LIST//[.;]/}"

echo "== CUDA build: import, build_info()['cuda'] must be True"
"$py" - <<'EOF'
import json

import ringreduce

info = ringreduce.build_info()
print("ci_cuda_build: build_info", json.dumps(info))
assert info["cuda"] is True, f"build_info()['cuda'] is {info['cuda']!r}: not a CUDA build"
from ringreduce import _dist_C  # noqa: E402  (the backend's extension, built with CUDA too)

print("ci_cuda_build: _dist_C", _dist_C.__file__)
EOF

echo "== CUDA build: the test suite (tests/)"
unset RINGREDUCE_REQUIRE_INSTALL_TEST
"$py" -m pytest -q -rs --timeout=600 tests
stamp "tests done"
