#!/usr/bin/env bash
# Syntax-only compile of the torch glue's CUDA branches (-DRINGREDUCE_WITH_CUDA) with the host
# compiler against the installed torch's headers, so that a CPU-only machine (a CPU torch, no
# GPU) still rejects a CUDA-only compile error in csrc/bindings.cpp, csrc/multiprocess/
# dist_bindings.cpp or any other .cpp under csrc/ that includes torch or has a
# RINGREDUCE_WITH_CUDA branch (found by a glob and a grep, so a backend file added later is
# covered). nvcc compiles the .cu files (scripts/compile_cuda.sh); the .cpp files that hold
# torch code are built by the host compiler even in a CUDA build, and this is the only check of
# their CUDA branches without one.
#
# The CPU wheel ships c10/cuda but lacks the one generated header c10/cuda/impl/
# cuda_cmake_macros.h: tests/stub_include holds a stand-in, searched after torch's own headers
# (a CUDA torch's real header wins). The C++ standard is the one torch's cpp_extension builds
# with (C++20 since its headers need it; CXX_STD overrides).
#   bash scripts/check_bindings.sh [FILE...]   (default: every such file)
set -euo pipefail
cd "$(dirname "$0")/.."
CXX=${CXX:-$(command -v g++ || command -v c++)}
PY=${PYTHON:-python3}
CUDA_INC=${CUDA_HOME:-/usr/local/cuda}/include
[ -f "$CUDA_INC/cuda_runtime.h" ] || { echo "check_bindings: no $CUDA_INC/cuda_runtime.h" \
  "(set CUDA_HOME)" >&2; exit 1; }
read -r -a TORCH_FLAGS < <($PY - <<'EOF'
import sysconfig
import torch
from torch.utils import cpp_extension
flags = [f"-isystem{p}" for p in cpp_extension.include_paths()]
flags.append("-isystem" + sysconfig.get_paths()["include"])
flags.append(f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}")
print(" ".join(flags))
EOF
)
if [ $# -gt 0 ]; then
  files=("$@")
else
  files=()
  for f in csrc/*.cpp csrc/*/*.cpp; do
    grep -qE '#include <(torch|ATen|c10)/|RINGREDUCE_WITH_CUDA' "$f" && files+=("$f")
  done
fi
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
pids=()
for f in "${files[@]}"; do
  name=_C
  case $f in csrc/multiprocess/*) name=_dist_C ;; esac
  "$CXX" -fsyntax-only -std="${CXX_STD:-c++20}" -Wall -Werror \
    -DRINGREDUCE_WITH_CUDA -DRINGREDUCE_ARCHS=80_90 -DTORCH_API_INCLUDE_EXTENSION_H \
    -DTORCH_EXTENSION_NAME="$name" -Icsrc "${TORCH_FLAGS[@]}" -isystem "$CUDA_INC" \
    -idirafter tests/stub_include "$f" > "$logs/$(basename "$f").log" 2>&1 &
  pids+=($!)
done
status=0
for i in "${!files[@]}"; do
  if wait "${pids[$i]}"; then
    echo "check_bindings: ${files[$i]} ok"
  else
    echo "check_bindings: ${files[$i]} FAILED" >&2
    cat "$logs/$(basename "${files[$i]}").log" >&2
    status=1
  fi
done
exit $status
