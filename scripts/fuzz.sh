#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz with clang (-fsanitize=fuzzer,address,undefined) and
# runs each for a while on a corpus seeded from the tests: the CreateSession seeds of
# tests/fuzz/seeds (text protobuf, encoded here with protoc) and the conformance vectors'
# safetensors files. A crash, a sanitizer report or a violated property fails the run; the
# reproducer is left in the work directory.
#   scripts/fuzz.sh [SECONDS_PER_TARGET=60] [WORK_DIR=build-fuzz] [TARGET...]
# Environment: DIOND_JOBS (build jobs, default 2), FUZZ_RSS_MB (libFuzzer -rss_limit_mb, 2048).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
seconds=${1:-60}
work=${2:-$root/build-fuzz}
shift $(( $# > 2 ? 2 : $# )) || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(create_session_fuzz layout_fuzz safetensors_fuzz bounded_fuzz)

CC=clang CXX=clang++ cmake -S "$root/tests/fuzz" -B "$work" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$work" -j"${DIOND_JOBS:-2}" --target "${targets[@]}"

corpus=$work/corpus
mkdir -p "$corpus"/{create_session_fuzz,layout_fuzz,safetensors_fuzz,bounded_fuzz}
for f in "$root"/tests/fuzz/seeds/create_session/*.txtpb; do
  protoc -I"$root/proto" --encode=diond.v1.CreateSessionRequest diond/v1/optimizer.proto \
    < "$f" > "$corpus/create_session_fuzz/$(basename "$f" .txtpb).bin"
done
for f in "$root"/tests/conformance/vectors/*.safetensors; do
  [ "$(stat -c %s "$f")" -le 262144 ] && cp "$f" "$corpus/safetensors_fuzz/"
done
printf 'w.0/state.momentum' > "$corpus/bounded_fuzz/name"

status=0
for t in "${targets[@]}"; do
  echo "== $t: ${seconds}s"
  if ! (cd "$work" && "./$t" -max_total_time="$seconds" -rss_limit_mb="${FUZZ_RSS_MB:-2048}" \
          -max_len=65536 -print_final_stats=1 "$corpus/$t" 2>&1 | tail -n 15); then
    status=1
  fi
  # libFuzzer's exit status is lost in the pipe above; a reproducer file means it failed.
  if ls "$work"/crash-* "$work"/leak-* "$work"/oom-* "$work"/timeout-* >/dev/null 2>&1; then
    echo "$t: FAILED (reproducers in $work)"; status=1
  fi
done
exit $status
