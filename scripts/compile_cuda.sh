#!/usr/bin/env bash
# Compile-only check of every CUDA source (csrc/**/*.cu) with nvcc, no GPU needed: for sm_90 and
# the architectures the build compiles by default (DEFAULT_CUDA_ARCHS in ringreduce/_build.py,
# with the newest also as PTX, as the build embeds it), in C++17 (the torch-free layer's standard) and
# C++20 (what torch's cpp_extension passes to nvcc), with every warning an error: nvcc's own,
# the host compiler's (-Wall) and ptxas's.
#   PTXAS_LOG=FILE  also writes ptxas's resource usage (-Xptxas -v, the C++20 pass) to FILE, for
#                   scripts/ptxas_report.py
#   CUDA_STDS="c++20" / CUDA_ARCHS="9.0" narrow the checks
#   COMPILE_JOBS=N  nvcc processes at once (default: the usable cores)
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
[ -x "$NVCC" ] || { echo "compile_cuda: nvcc not found (set NVCC=...)" >&2; exit 1; }
# The default arch list of the extension's build (setup.py and the first-import compile use it).
default_archs=$(sed -n 's/^DEFAULT_CUDA_ARCHS = "\([^"]*\)".*/\1/p' ringreduce/_build.py | head -n 1)
[ -n "$default_archs" ] || { echo "compile_cuda: no DEFAULT_CUDA_ARCHS found in ringreduce/_build.py" >&2; exit 1; }
archs=$(printf '%s\n' 9.0 ${CUDA_ARCHS:-${default_archs//;/ }} | sort -u -t. -k1,1n -k2,2n)
gencode=()
token=""
for a in $archs; do
  cc=${a/./}
  gencode+=("-gencode=arch=compute_$cc,code=sm_$cc")
  token+="${token:+_}$cc"
done
gencode+=("-gencode=arch=compute_$cc,code=compute_$cc")  # the newest as PTX too
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
[ -z "${PTXAS_LOG:-}" ] || : > "$PTXAS_LOG"
# One nvcc per (standard, source), COMPILE_JOBS at a time (default: the usable cores; 2 cores
# halve CI's 9 minutes); each writes its own log, read back in order once all have ended.
jobs=${COMPILE_JOBS:-$(nproc)}
stds=${CUDA_STDS:-c++17 c++20}
sources=$(find csrc -name '*.cu' | sort)
ptxas_pass() { [ -n "${PTXAS_LOG:-}" ] && [ "$1" = c++20 ]; }  # ptxas_pass STD: -Xptxas -v?
compile() {  # compile STD SRC TAG: exit status in $out/TAG.rc, output in $out/TAG.log
  local verbose=()
  if ptxas_pass "$1"; then verbose=(-Xptxas -v); fi
  local rc=0
  "$NVCC" -std="$1" -O3 -Icsrc -DRINGREDUCE_WITH_CUDA -DRINGREDUCE_ARCHS="$token" \
    "${gencode[@]}" -Werror=all-warnings -Xcompiler -Wall,-Werror -Xptxas -Werror \
    "${verbose[@]}" -c "$2" -o "$out/$3.o" > "$out/$3.log" 2>&1 || rc=$?
  echo "$rc" > "$out/$3.rc"
}
running=0
for std in $stds; do
  for src in $sources; do
    tag="$std-$(basename "$src")"
    echo "compile_cuda: $src (-std=$std, sm $token)"
    if [ "$running" -ge "$jobs" ]; then
      wait -n || true
      running=$((running - 1))
    fi
    compile "$std" "$src" "$tag" &
    running=$((running + 1))
  done
done
wait
status=0
for std in $stds; do
  for src in $sources; do
    tag="$std-$(basename "$src")"
    if [ "$(cat "$out/$tag.rc" 2>/dev/null || echo 1)" != 0 ]; then
      echo "compile_cuda: $src (-std=$std) failed:" >&2
      cat "$out/$tag.log" >&2
      status=1
      continue
    fi
    if ptxas_pass "$std"; then
      grep -v '^ptxas info' "$out/$tag.log" | grep -v '^ *[0-9]* bytes stack frame' | grep . >&2 || true
      { echo "# source $src"; cat "$out/$tag.log"; } >> "$PTXAS_LOG"
    else
      cat "$out/$tag.log" >&2
    fi
  done
done
[ $status -eq 0 ] && echo "compile_cuda: every CUDA source compiles (sm $token; $stds)"
exit $status
