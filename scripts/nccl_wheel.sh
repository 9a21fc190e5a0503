#!/usr/bin/env bash
# NCCL from the nvidia-nccl-cu13 wheel (default 2.31.2) for the offline GPU machine, where
# torch's own NCCL may be older than the 2.30 that simulated ranks need. The device tool carries
# at most about 60 MB of ignored files per call, and the machine keeps /tmp only while it stays
# warm, so the wheel goes over in pieces and everything "there" must follow without a long pause:
#   here:  bash scripts/nccl_wheel.sh fetch [--dry-run]   the wheel, split into .nccl/
#                                                         (git-excluded)
#   there: bash scripts/nccl_wheel.sh append PIECE        once per piece, in order, carrying PIECE;
#                                                         appends to /tmp/nccl-wheel.part
#          bash scripts/nccl_wheel.sh unpack [SHA256]     into /tmp/nccl; prints libnccl.so.2's
#                                                         path and its ncclGetVersion
#   then:  RINGREDUCE_NCCL_LIB=/tmp/nccl/nvidia/nccl/lib/libnccl.so.2 bash scripts/gpu_check.sh
# fetch prints the exact calls, with the wheel's SHA256 for unpack to check.
# Knobs: NCCL_WHEEL_VERSION (2.31.2), NCCL_PIECE_SIZE (60M, split -b units).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${NCCL_WHEEL_VERSION:-2.31.2}
PIECE_SIZE=${NCCL_PIECE_SIZE:-60M}
PIECES=.nccl
PART=/tmp/nccl-wheel.part
APPENDED=/tmp/nccl-wheel.pieces
DEST=/tmp/nccl
# The wheel is py3-none-manylinux_*: these are the tags it has been published under.
PLATFORMS=(manylinux_2_18_x86_64 manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_27_x86_64)

die() { echo "nccl_wheel: $*" >&2; exit 1; }

download() {  # download PLATFORM DIR [--print]
  local cmd=(python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12
             --implementation cp --platform "$1" -d "$2" "nvidia-nccl-cu13==$VERSION")
  if [ "${3:-}" = --print ]; then echo "${cmd[*]}"; else "${cmd[@]}"; fi
}

fetch() {
  local dry=0
  case ${1:-} in
    --dry-run) dry=1 ;;
    "") ;;
    *) die "fetch takes only --dry-run, not '$1'" ;;
  esac
  local exclude
  exclude=$(git rev-parse --git-path info/exclude)
  if [ "$dry" = 1 ]; then
    echo "nccl_wheel: would try, until one gets the wheel:"
    for p in "${PLATFORMS[@]}"; do echo "  $(download "$p" DIR --print)"; done
    echo "nccl_wheel: then split -b $PIECE_SIZE into $PIECES/, and add /$PIECES/ to $exclude"
    return 0
  fi
  local tmp wheel="" p
  tmp=$(mktemp -d)
  # shellcheck disable=SC2064  # the folder's name now: $tmp is out of scope at exit
  trap "rm -rf '$tmp'" EXIT
  for p in "${PLATFORMS[@]}"; do
    if download "$p" "$tmp" >&2; then
      wheel=$(find "$tmp" -maxdepth 1 -name 'nvidia_nccl_cu13-*.whl' | head -n1)
      [ -n "$wheel" ] && break
    fi
    echo "nccl_wheel: no wheel for platform $p, trying the next" >&2
  done
  [ -n "$wheel" ] || die "pip found no nvidia-nccl-cu13==$VERSION wheel for ${PLATFORMS[*]}"
  local sha
  sha=$(sha256sum "$wheel" | cut -d' ' -f1)
  rm -rf "$PIECES"
  mkdir -p "$PIECES" "$(dirname "$exclude")"
  split -b "$PIECE_SIZE" "$wheel" "$PIECES/nccl-wheel.part-"
  grep -qxF "/$PIECES/" "$exclude" 2>/dev/null || echo "/$PIECES/" >> "$exclude"
  git check-ignore -q "$PIECES/nccl-wheel.part-aa" \
    || die "git does not ignore $PIECES/ although $exclude lists it (the device tool" \
           "carries ignored paths only)"
  echo "nccl_wheel: $(basename "$wheel") ($(stat -c %s "$wheel") bytes, sha256 $sha)"
  echo "nccl_wheel: in $PIECES/ (listed in $exclude). On the GPU machine, one run call" \
       "each, without long pauses:"
  for p in "$PIECES"/nccl-wheel.part-*; do
    echo "  carry [\"$p\"]  command: bash scripts/nccl_wheel.sh append $p"
  done
  echo "  command: bash scripts/nccl_wheel.sh unpack $sha"
}

append() {
  local piece=${1:-}
  [ -n "$piece" ] || die "append needs a piece, e.g. $PIECES/nccl-wheel.part-aa"
  [ -f "$piece" ] || die "no piece $piece here: carry it with the call (carry [\"$piece\"])"
  local name last
  name=$(basename "$piece")
  if [ -f "$APPENDED" ] && grep -qxF "$name" "$APPENDED"; then
    die "$name is in $PART already (rm $PART $APPENDED to start again)"
  fi
  last=$(tail -n1 "$APPENDED" 2>/dev/null || true)
  if [ -n "$last" ] && [[ ! "$name" > "$last" ]]; then
    die "$name comes before $last, appended last: the pieces go in order"
  fi
  cat "$piece" >> "$PART"
  echo "$name" >> "$APPENDED"
  echo "nccl_wheel: appended $name; $PART is $(stat -c %s "$PART") bytes" \
       "($(paste -sd' ' "$APPENDED"))"
}

unpack() {
  [ -f "$PART" ] || die "no $PART: append the pieces first (a machine that went idle lost /tmp)"
  if [ -n "${1:-}" ]; then
    echo "$1  $PART" | sha256sum -c --quiet - \
      || die "$PART is not the wheel fetch saw (sha256 differs): a piece is missing or repeated"
  fi
  rm -rf "$DEST"
  python3 -m zipfile -e "$PART" "$DEST"
  local lib=$DEST/nvidia/nccl/lib/libnccl.so.2
  [ -f "$lib" ] || die "the wheel has no nvidia/nccl/lib/libnccl.so.2"
  python3 - "$lib" <<'EOF'
import ctypes
import sys

code = ctypes.c_int(0)
if ctypes.CDLL(sys.argv[1]).ncclGetVersion(ctypes.byref(code)) != 0:
    sys.exit(f"nccl_wheel: ncclGetVersion failed in {sys.argv[1]}")
v = code.value  # major*10000 + minor*100 + patch since NCCL 2.9
print(f"nccl_wheel: {sys.argv[1]}: ncclGetVersion {v} = "
      f"NCCL {v // 10000}.{v // 100 % 100}.{v % 100}")
EOF
  echo "nccl_wheel: use it with RINGREDUCE_NCCL_LIB=$lib"
}

case ${1:-} in
  fetch) shift; fetch "$@" ;;
  append) shift; append "$@" ;;
  unpack) shift; unpack "$@" ;;
  *) die "usage: bash scripts/nccl_wheel.sh fetch [--dry-run] | append PIECE | unpack [SHA256]" ;;
esac
