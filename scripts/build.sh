#!/usr/bin/env bash
# Configures and builds diond: installs missing Debian packages first (scripts/install-deps.sh).
#   scripts/build.sh [BUILD_DIR] [extra cmake args...]
# Environment:
#   DIOND_JOBS        parallel jobs (default 2)
#   DIOND_TARGETS     space-separated targets to build (default: all)
#   DIOND_SKIP_DEPS=1 skip the package check
# CUDA: the plugin is built when nvcc is found (pass -DDIOND_WITH_CUDA=OFF to skip it).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
shift || true

if [ "${DIOND_SKIP_DEPS:-0}" != 1 ]; then
  bash "$root/scripts/install-deps.sh"
fi
# nvcc lives outside the default PATH on these machines.
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi

werror=OFF
if [ "${CI:-}" = true ]; then werror=ON; fi

start=$(date +%s)
cmake -S "$root" -B "$build" -DDIOND_WERROR=$werror "$@"
if [ -n "${DIOND_TARGETS:-}" ]; then
  # shellcheck disable=SC2086
  cmake --build "$build" -j"${DIOND_JOBS:-2}" --target ${DIOND_TARGETS}
else
  cmake --build "$build" -j"${DIOND_JOBS:-2}"
fi
echo "build: $build ready in $(( $(date +%s) - start )) s"
