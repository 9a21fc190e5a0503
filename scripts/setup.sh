#!/usr/bin/env bash
# Sets up ringreduce in the current Python environment and builds its extensions.
# Installs only what is missing, so it also works offline where torch is already present
# (the GPU machine). Without torch it installs torch==${RINGREDUCE_TORCH:-2.13.0}.
# Needed (the build and the tests fail without them): torch, ninja, numpy, pytest,
# pytest-timeout, setuptools>=64. Optional (warned about, never fatal): tqdm (progress bars),
# expecttest (torch's own test suite, scripts/torch_suite.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

has() { $PY -c "import $1" 2>/dev/null; }
# Offline (no route to the package index), pip would spend minutes on retries before failing:
# ask once, quickly, and then install nothing that is only nice to have.
online() {
  [ -z "${_online:-}" ] || return "$_online"
  _online=1
  $PY - <<'PYEOF' 2>/dev/null && _online=0
import os, socket, subprocess, sys, urllib.parse
index = os.environ.get("PIP_INDEX_URL") or subprocess.run(
    [sys.executable, "-m", "pip", "config", "get", "global.index-url"],
    capture_output=True, text=True).stdout.strip() or "https://pypi.org/simple"
url = urllib.parse.urlparse(index)
if url.scheme == "file":
    sys.exit(0)
proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
if proxy:  # pip goes through the proxy: that is what must answer
    url = urllib.parse.urlparse(proxy if "://" in proxy else "http://" + proxy)
socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                         timeout=5).close()
PYEOF
  return "$_online"
}

missing=()
has torch || missing+=("torch==${RINGREDUCE_TORCH:-2.13.0}")
for mod in ninja pytest numpy; do
  has "$mod" || missing+=("$mod")
done
# pytest-timeout bounds every test (tests/conftest.py gives each one a timeout).
has pytest_timeout || missing+=("pytest-timeout")
# The build runs without isolation and takes setuptools from this environment: 64 builds an
# editable install (PEP 660).
$PY -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 64)" \
  2>/dev/null || missing+=("setuptools>=64")
# ...and bdist_wheel, built into setuptools from 70.1, from the wheel package before it.
$PY -c "import setuptools.command.bdist_wheel" 2>/dev/null || has wheel || missing+=("wheel")
if [ ${#missing[@]} -gt 0 ]; then
  if ! online; then
    echo "setup: offline, and these are needed but missing: ${missing[*]}" >&2
    exit 1
  fi
  echo "setup: installing ${missing[*]}"
  $PY -m pip install -q "${missing[@]}"
fi
# Nice to have: tqdm draws the trainer's and the benchmarks' progress bars (they run without
# bars); expecttest is needed only by torch's own test suite (scripts/torch_suite.py).
optional=()
has tqdm || optional+=("tqdm")
has expecttest || optional+=("expecttest")
if [ ${#optional[@]} -gt 0 ]; then
  if online; then
    echo "setup: installing ${optional[*]} (optional)"
    $PY -m pip install -q --retries 1 --timeout 15 "${optional[@]}" \
      || echo "setup: warning: could not install ${optional[*]}; going on without" >&2
  else
    echo "setup: warning: offline; going on without ${optional[*]} (optional: progress bars," \
      "torch's own test suite)" >&2
  fi
fi

# No build isolation: the build compiles both extensions against the installed torch now (a
# plain `pip install -e .` would leave that to the first import; docs/INSTALL.md), and must
# work without network.
$PY -m pip install -q --no-build-isolation --no-deps --use-pep517 -e .
$PY -c "import ringreduce, json; print('setup: ringreduce', json.dumps(ringreduce.build_info()))"
