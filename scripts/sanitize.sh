#!/usr/bin/env bash
# Builds the suite with sanitizers in a folder of its own and runs its tests there.
#   scripts/sanitize.sh [SANITIZERS=address,undefined] [BUILD_DIR=build-<sanitizers>] [CTEST_REGEX]
# ASan's leak checker is off (gRPC and protobuf keep process-lifetime allocations); a
# sanitizer report fails the test that caused it. CUDA is off (the plugin is not instrumented).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
san=${1:-address,undefined}
build=${2:-$root/build-${san//,/-}}
regex=${3:-}
DIOND_SKIP_DEPS=1 bash "$root/scripts/build.sh" "$build" -DDIOND_WITH_CUDA=OFF \
  -DDIOND_SANITIZE="$san" -DCMAKE_BUILD_TYPE=RelWithDebInfo
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:${ASAN_OPTIONS:-}
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1:${UBSAN_OPTIONS:-}
export TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1:${TSAN_OPTIONS:-}
args=(--test-dir "$build" -LE gpu -j"${DIOND_JOBS:-2}" --timeout 1800 --output-on-failure)
[ -n "$regex" ] && args+=(-R "$regex")
ctest "${args[@]}"
