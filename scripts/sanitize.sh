#!/usr/bin/env bash
# Builds the suite with sanitizers in a folder of its own and runs its tests there.
#   scripts/sanitize.sh [SANITIZERS=address,undefined] [BUILD_DIR=build-<sanitizers>] [CTEST_ARGS...]
# e.g. scripts/sanitize.sh                      ASan+UBSan, every test but label gpu
#      scripts/tsan.sh                           TSan of the service and world tests (it builds
#                                                the TSan Abseil this script needs, then calls it)
# Every target is instrumented, the `diond` binary that the service, world, Python and Rust
# tests start included. CUDA is off (the plugin is not instrumented), benchmarks are not built,
# and the code is compiled -O1 -g1 (what the sanitizers recommend, and cheaper to build).
# A sanitizer report fails the run even when the test that caused it passed (a daemon that a
# test kills may report on its way out): every process writes its reports under
# BUILD_DIR/sanitizer-reports/, and any file there fails the run after the tests, printed.
# ASan's leak checker is off (gRPC and protobuf keep process-lifetime allocations); UBSan is
# built with -fno-sanitize-recover, so its first report aborts the process.
# Environment:
#   SAN_TARGETS       build only these targets (default: all)
#   SAN_FUZZERS=ON    also build the libFuzzer targets into this build (-DDIOND_BUILD_FUZZERS;
#                     default ON for address builds, OFF otherwise); scripts/fuzz.sh runs them
#                     with FUZZ_BUILD=BUILD_DIR
#   SAN_CLIENT_SUITES=1  also run the pytest and cargo suites against this build's daemon
#                     (address/undefined only; cargo reuses CARGO_TARGET_DIR, default
#                     BUILD_DIR/rust-target)
#   CC, CXX           compilers (default clang, clang++)
#   DIOND_JOBS        parallel jobs (default 2)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
san=${1:-address,undefined}
build=${2:-$root/build-${san//,/-}}
shift $(( $# > 2 ? 2 : $# )) || true
ctest_args=("$@")
[ ${#ctest_args[@]} -gt 0 ] || ctest_args=(-LE gpu)

# TSan needs an Abseil built with it: absl::Mutex's lock and unlock are compiled into libabsl,
# and Debian's is not instrumented, so TSan would report every absl::Mutex-guarded access as a
# race. A six-line probe finds out before anything is built (scripts/tsan.sh runs this script
# with LD_LIBRARY_PATH pointing at an instrumented Abseil, and the probe then passes;
# SAN_SKIP_ABSEIL_PROBE=1 skips it).
if [[ $san == *thread* ]] && [ "${SAN_SKIP_ABSEIL_PROBE:-0}" != 1 ]; then
  probe=$(mktemp -d)
  # shellcheck disable=SC2046
  "${CXX:-clang++}" -std=c++17 -fsanitize=thread -O1 -I/usr/include \
    "$root/tests/sanitizer/tsan_abseil_probe.cc" -o "$probe/probe" \
    $(pkg-config --libs absl_synchronization)
  if ! TSAN_OPTIONS=halt_on_error=1:exitcode=66 "$probe/probe" >"$probe/log" 2>&1; then
    head -n 4 "$probe/log"
    echo "sanitize: TSan does not see absl::Mutex here (the system Abseil is not built with"
    echo "  -fsanitize=thread): every report would be noise. Run scripts/tsan.sh instead: it"
    echo "  builds Debian's Abseil with TSan and runs this script against it."
    rm -rf "$probe"
    exit 3
  fi
  rm -rf "$probe"
fi

fuzzers=OFF
case $san in *address*) fuzzers=ON ;; esac
start=$(date +%s)
CC=${CC:-clang} CXX=${CXX:-clang++} DIOND_SKIP_DEPS=1 DIOND_TARGETS="${SAN_TARGETS:-}" \
  bash "$root/scripts/build.sh" "$build" -DDIOND_WITH_CUDA=OFF -DDIOND_BUILD_BENCHMARKS=OFF \
  -DDIOND_WERROR=OFF -DDIOND_SANITIZE="$san" -DDIOND_BUILD_FUZZERS="${SAN_FUZZERS:-$fuzzers}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG"
built=$(date +%s)

reports=$build/sanitizer-reports
rm -rf "$reports"
mkdir -p "$reports"
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:halt_on_error=1:log_path=$reports/asan:${ASAN_OPTIONS:-}
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1:log_path=$reports/ubsan:${UBSAN_OPTIONS:-}
export TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1:log_path=$reports/tsan:${TSAN_OPTIONS:-}
if [ -f "$root/tests/sanitizer/tsan.supp" ]; then
  export TSAN_OPTIONS=suppressions=$root/tests/sanitizer/tsan.supp:$TSAN_OPTIONS
fi

# Address builds: civetweb's threads get 1 MiB stacks (server/exe/thread_stack_floor.c
# explains: Debian's civetweb, inside prometheus-cpp's Exposer, creates its threads with a fixed
# 100 KiB stack, of which the daemon's static TLS (60 KiB of it OpenBLAS's) leaves too little
# for the instrumented /metrics handler). An uninstrumented LD_PRELOAD shim, compiled here, so
# that every process a test starts (the daemon, diondctl, the Python and Rust clients) has it.
if [[ $san == *address* ]]; then
  shim=$(cd "$build" && pwd)/thread_stack_floor.so
  cc -O2 -shared -fPIC -o "$shim" "$root/server/exe/thread_stack_floor.c" -ldl
  export LD_PRELOAD=$shim${LD_PRELOAD:+:$LD_PRELOAD}
fi

# Left out of address builds and run after the others with their own settings:
#  - ShmRegionDeathTest.*: the guard chains a SIGBUS outside every registered region to the
#    previous handler, which under ASan is ASan's (a report in sanitizer-reports, which fails the
#    run, instead of death by SIGBUS): run with ASan's SIGBUS handler off (handle_sigbus=0), so
#    that the death test sees what it sees in production.
#  - StrictDeviceDeathTest.*: its child faults on purpose (host access of the strict TEST
#    backend's PROT_NONE "device" memory); ASan's SEGV handler would write that fault as a report:
#    run with handle_segv=0, so that the child dies of the SIGSEGV the test expects.
# client_package_consumer_test builds its consumer with this build's compiler and sanitizer
# flags (client/cpp/tests/package_consumer_test.sh), so it runs like every other test.
# SAN_EXCLUDE=REGEX leaves other tests out (empty: none).
asan_separate='^(ShmRegionDeathTest|StrictDeviceDeathTest)\.'
exclude=${SAN_EXCLUDE-}
if [[ $san == *address* ]]; then
  exclude=${exclude:+$exclude|}$asan_separate
fi
[ -n "$exclude" ] && ctest_args+=(-E "$exclude")

status=0
ctest --test-dir "$build" "${ctest_args[@]}" -j"${DIOND_JOBS:-2}" --timeout 1800 \
  --output-on-failure || status=1
if [[ $san == *address* ]] && [ -z "${SAN_TARGETS:-}" ]; then
  ASAN_OPTIONS=handle_sigbus=0:handle_segv=0:$ASAN_OPTIONS ctest --test-dir "$build" -R "$asan_separate" \
    --timeout 600 --output-on-failure || status=1
fi
tested=$(date +%s)

if [ "${SAN_CLIENT_SUITES:-0}" = 1 ] && [ "$san" != thread ]; then
  abs_build=$(cd "$build" && pwd)
  echo "== pytest against the $san daemon =="
  set +e
  DIOND_BINARY="$abs_build/bin/diond" PYTHONPATH="$abs_build/python:$root/client/python" \
    /usr/bin/python3 -m pytest -q -p no:cacheprovider "$root/client/python/tests"
  rc=$?
  set -e
  if [ $rc -ne 0 ] && [ $rc -ne 5 ]; then status=1; fi
  echo "== cargo test (client/rust) against the $san daemon =="
  (cd "$root/client/rust" && DIOND_BINARY="$abs_build/bin/diond" \
     DIOND_GOLDEN_REPLAY="$abs_build/bin/diond-golden-replay" \
     CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$abs_build/rust-target}" cargo test --offline) ||
    status=1
fi

if [ -n "$(ls -A "$reports")" ]; then
  echo "== sanitizer reports (each fails the run) =="
  for f in "$reports"/*; do echo "--- $f"; head -n 80 "$f"; done
  status=1
fi
echo "sanitize ($san): build $(( built - start )) s, ctest $(( tested - built )) s," \
  "total $(( $(date +%s) - start )) s; status $status"
exit $status
