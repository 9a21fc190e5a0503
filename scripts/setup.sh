#!/usr/bin/env bash
# Sets up ringreduce in the current Python environment and builds its extensions.
# Installs only what is missing, so it also works offline where torch is already present
# (the GPU machine). Without torch it installs torch==${RINGREDUCE_TORCH:-2.13.0}.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

missing=()
$PY -c "import torch" 2>/dev/null || missing+=("torch==${RINGREDUCE_TORCH:-2.13.0}")
for mod in ninja pytest numpy expecttest; do
  $PY -c "import $mod" 2>/dev/null || missing+=("$mod")
done
# pytest-timeout bounds every test (tests/conftest.py gives each one a timeout).
$PY -c "import pytest_timeout" 2>/dev/null || missing+=("pytest-timeout")
# pyproject.toml's build requirement, which a build without isolation takes from this
# environment (older setuptools rejects pyproject.toml's SPDX license string).
$PY -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 77)" \
  2>/dev/null || missing+=("setuptools>=77")
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  $PY -m pip install -q "${missing[@]}"
fi
# tqdm draws the trainer's and the benchmarks' progress bars; without it (offline) they run
# without bars, so a failed install only warns.
if ! $PY -c "import tqdm" 2>/dev/null; then
  echo "setup: installing tqdm"
  $PY -m pip install -q --retries 1 --timeout 15 tqdm \
    || echo "setup: warning: tqdm could not be installed; the trainer and bench/ run without bars" >&2
fi

# No build isolation: the build compiles both extensions against the installed torch now (a
# plain `pip install -e .` would leave that to the first import; README, Install), and must
# work without network.
$PY -m pip install -q --no-build-isolation --no-deps --use-pep517 -e .
$PY -c "import ringreduce, json; print('setup: ringreduce', json.dumps(ringreduce.build_info()))"
