#!/usr/bin/env bash
# Installs the diondClient package (component diond_client) from a build tree into a fresh
# prefix, then configures, builds and runs a consumer that uses find_package(diondClient CONFIG).
#   package_consumer_test.sh CMAKE BUILD_DIR CONSUMER_SOURCE_DIR WORK_DIR [CXX SANITIZERS]
# CXX and SANITIZERS (the build's compiler and -DDIOND_SANITIZE, given by sanitizer builds):
# the consumer is built with them, as a consumer of an instrumented library must be.
set -euo pipefail
cmake=$1 build=$2 src=$3 work=$4 cxx=${5:-} san=${6:-}
consumer_flags=()
if [ -n "$san" ]; then
  consumer_flags=(-DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_CXX_FLAGS="-fsanitize=$san"
                  -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=$san")
fi
rm -rf "$work"
mkdir -p "$work"
"$cmake" --install "$build" --component diond_client --prefix "$work/prefix"
# Only the client's files are installed.
find "$work/prefix" -type f | sed "s|$work/prefix/||" | sort
test -f "$work/prefix/include/diond/client.h"
test -f "$work/prefix/include/diond/proto/diond/v1/optimizer.grpc.pb.h"
test ! -e "$work/prefix/include/diond/internal"
"$cmake" -S "$src" -B "$work/build" -DCMAKE_PREFIX_PATH="$work/prefix" -DCMAKE_BUILD_TYPE=Release \
  "${consumer_flags[@]}"
"$cmake" --build "$work/build" -j2
"$work/build/consumer"
