#!/usr/bin/env bash
# Installs the diondClient package (component diond_client) from a build tree into a fresh
# prefix, then configures, builds and runs a consumer that uses find_package(diondClient CONFIG).
#   package_consumer_test.sh CMAKE BUILD_DIR CONSUMER_SOURCE_DIR WORK_DIR
set -euo pipefail
cmake=$1 build=$2 src=$3 work=$4
rm -rf "$work"
mkdir -p "$work"
"$cmake" --install "$build" --component diond_client --prefix "$work/prefix"
# Only the client's files are installed.
find "$work/prefix" -type f | sed "s|$work/prefix/||" | sort
test -f "$work/prefix/include/diond/client.h"
test -f "$work/prefix/include/diond/proto/diond/v1/optimizer.grpc.pb.h"
test ! -e "$work/prefix/include/diond/internal"
"$cmake" -S "$src" -B "$work/build" -DCMAKE_PREFIX_PATH="$work/prefix" -DCMAKE_BUILD_TYPE=Release
"$cmake" --build "$work/build" -j2
"$work/build/consumer"
