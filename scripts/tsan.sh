#!/usr/bin/env bash
# TSan of the service and world tests, with an Abseil built with TSan.
#   scripts/tsan.sh [BUILD_DIR=build-tsan] [CTEST_ARGS...]   (default: -L 'service|world' -LE gpu)
# Debian's libabsl is not built with -fsanitize=thread, so TSan sees no absl::Mutex lock or
# unlock and reports every absl::Mutex-guarded access as a race (tests/sanitizer/
# tsan_abseil_probe.cc). This script:
#  1. downloads Debian's own source of the installed libabsl-dev (the .dsc, .orig and .debian
#     files from deb.debian.org, checked against the SHA-256 sums below), unpacks it with its
#     Debian patches (dpkg-source: the same options.h, inline namespace and SONAMEs as
#     libabsl20220623);
#  2. builds it with clang -fsanitize=thread as shared libraries into ABSL_TSAN_PREFIX
#     (default BUILD_DIR/absl-tsan), skipped when that prefix is already complete;
#  3. runs scripts/sanitize.sh thread with LD_LIBRARY_PATH pointing there, so that the daemon,
#     the tests and the system's gRPC (which links libabsl too) all use the instrumented Abseil.
#     diond compiles against the system's Abseil headers, which are the same files.
# Environment: ABSL_TSAN_PREFIX, ABSL_SRC_DIR (where the source is unpacked, default
# BUILD_DIR/absl-src), SAN_TARGETS (default service_world_tests), DIOND_JOBS (default 2).
# Nothing here is cached for correctness: a missing or partial prefix is rebuilt.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build-tsan}
shift $(( $# > 1 ? 1 : $# )) || true
ctest_args=("$@")
[ ${#ctest_args[@]} -gt 0 ] || ctest_args=(-L 'service|world' -LE gpu)
mkdir -p "$build"
build=$(cd "$build" && pwd)
prefix=${ABSL_TSAN_PREFIX:-$build/absl-tsan}
src=${ABSL_SRC_DIR:-$build/absl-src}
jobs=${DIOND_JOBS:-2}

version=$(dpkg-query -W -f='${Version}' libabsl-dev)
want=20220623.1-1+deb12u2
if [ "$version" != "$want" ]; then
  echo "tsan: libabsl-dev is $version; this script knows the sums of $want only (update them)"
  exit 2
fi
start=$(date +%s)
if [ ! -f "$prefix/.complete-$want" ]; then
  dl=$build/absl-download
  mkdir -p "$dl"
  base=http://deb.debian.org/debian/pool/main/a/abseil
  while read -r sum file; do
    if [ ! -f "$dl/$file" ] || ! echo "$sum  $dl/$file" | sha256sum -c --quiet - 2>/dev/null; then
      curl -sSfL -o "$dl/$file" "$base/$file"
      echo "$sum  $dl/$file" | sha256sum -c --quiet -
    fi
  done <<'SUMS'
ba731eaced569332fa4ce802a7ff2615ae57ac25beaf2d02f634ef908f2e62c2 abseil_20220623.1-1+deb12u2.dsc
abfe2897f3a30edaa74bc34365afe3c2a3cd012091a97dc7e008f7016adcd5fe abseil_20220623.1.orig.tar.gz
e08490fc7b6f3beca1925953b0c4fb92df2de5e2a01295e4641e2a3d4e528eeb abseil_20220623.1-1+deb12u2.debian.tar.xz
SUMS
  rm -rf "$src"
  (cd "$dl" && dpkg-source --no-check -x "abseil_$want.dsc" "$src" >/dev/null)
  # The unpacked headers must be the installed ones, or the two ABIs could differ.
  if ! diff -q "$src/absl/base/options.h" /usr/include/absl/base/options.h >/dev/null; then
    echo "tsan: the patched options.h differs from the installed one"; exit 2
  fi
  launcher=()
  command -v ccache >/dev/null 2>&1 && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  rm -rf "$build/absl-build" "$prefix"
  CC=clang CXX=clang++ cmake -S "$src" -B "$build/absl-build" "${launcher[@]}" \
    -DCMAKE_CXX_STANDARD=17 -DBUILD_SHARED_LIBS=ON -DBUILD_TESTING=OFF \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" \
    -DCMAKE_CXX_FLAGS="-fsanitize=thread" -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=thread" \
    -DCMAKE_INSTALL_PREFIX="$prefix" -DCMAKE_INSTALL_LIBDIR=lib >/dev/null
  cmake --build "$build/absl-build" -j"$jobs"
  cmake --install "$build/absl-build" >/dev/null
  touch "$prefix/.complete-$want"
fi
absl_built=$(date +%s)
echo "tsan: instrumented Abseil in $prefix ($(( absl_built - start )) s)"

export LD_LIBRARY_PATH=$prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
status=0
SAN_TARGETS=${SAN_TARGETS:-service_world_tests} \
  bash "$root/scripts/sanitize.sh" thread "$build" "${ctest_args[@]}" || status=$?
echo "tsan: Abseil $(( absl_built - start )) s, total $(( $(date +%s) - start )) s; status $status"
exit $status
