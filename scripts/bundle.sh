#!/usr/bin/env bash
# Makes the relocatable diond bundle that a bare CUDA machine runs (docs/GPU.md "The bundle").
#   scripts/bundle.sh [--flavour check|release|cpu] [--build DIR] OUT.tar.xz
#     check    sm_90 SASS + PTX (H100/H200): small enough to travel beside the repository
#     release  sm_80, sm_90, sm_100 SASS + sm_100 PTX (A100, H100/H200, B200): the image's
#     cpu      no CUDA plugin, no gpu tests (the image built with BUILD_CUDA=OFF)
# --build DIR packs an existing CUDA build of the flavour's architectures (CI packs its own
# build folder); without it, the flavour is built into build-bundle-<flavour>/ first.
# DIOND_BUNDLE_CMAKE_ARGS adds configure flags (the Dockerfile: -DCMAKE_BUILD_TYPE=Release).
# Needs ldd, strip and patchelf (apt-get install patchelf).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
flavour=check build="" out=""
while [ $# -gt 0 ]; do
  case $1 in
    --flavour) flavour=$2; shift 2 ;;
    --build) build=$2; shift 2 ;;
    -h | --help) sed -n '2,11p' "$0"; exit 0 ;;
    -*) echo "bundle.sh: unknown option $1" >&2; exit 2 ;;
    *) out=$1; shift ;;
  esac
done
[ -n "$out" ] || { echo "usage: scripts/bundle.sh [--flavour check|release|cpu] [--build DIR] OUT.tar.xz" >&2; exit 2; }
case $flavour in
  check) archs="90-real;90-virtual" ;;
  release) archs="80-real;90-real;100-real;100-virtual" ;;
  cpu) archs="" ;;
  *) echo "bundle.sh: --flavour is check, release or cpu, not $flavour" >&2; exit 2 ;;
esac
if ! command -v patchelf >/dev/null 2>&1; then
  echo "bundle.sh: patchelf is missing (apt-get install patchelf)" >&2; exit 1
fi
if [ -z "$build" ]; then
  build=$root/build-bundle-$flavour
  # Everything: the gpu-labelled tests are found by their ctest label after the build.
  # shellcheck disable=SC2086  # DIOND_BUNDLE_CMAKE_ARGS: several flags
  if [ -n "$archs" ]; then
    bash "$root/scripts/build.sh" "$build" -DDIOND_WITH_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=$archs" \
      ${DIOND_BUNDLE_CMAKE_ARGS:-}
  else
    bash "$root/scripts/build.sh" "$build" -DDIOND_WITH_CUDA=OFF ${DIOND_BUNDLE_CMAKE_ARGS:-}
  fi
fi
exec /usr/bin/python3 "$root/scripts/bundle/pack.py" --build "$build" --src "$root" \
  --flavour "$flavour" --out "$out"
