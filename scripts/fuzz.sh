#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz with clang (-fsanitize=fuzzer,address,undefined) and
# runs each for a while on a corpus seeded from the tests (tests/fuzz/seeds/<target>/, text
# where possible, encoded here: protobuf text with protoc, manifests and Peer request sequences
# with the encoders in tests/fuzz/) and the conformance vectors' safetensors files. Every seed
# is run once first, so a regression seed that fails again fails the run. A crash, a sanitizer
# report, a leak or a violated property fails the run; the reproducer is left in
# WORK_DIR/artifacts/<target>/.
#   scripts/fuzz.sh [SECONDS_PER_TARGET=60] [WORK_DIR=build-fuzz] [TARGET...]
# Environment:
#   FUZZ_BUILD   a main build configured with -DDIOND_BUILD_FUZZERS=ON (scripts/sanitize.sh's
#                ASan+UBSan build is): its fuzz targets are used, session_fuzz and auth_fuzz
#                included (they link the session layer and server/rpc, so they exist in that
#                mode only), and nothing is compiled here. Without it the light targets are
#                built as a project of their own in WORK_DIR (tests/fuzz/CMakeLists.txt).
#   DIOND_JOBS (build jobs, default 2), FUZZ_RSS_MB (libFuzzer -rss_limit_mb, 2048),
#   FUZZ_NICE (nice level of the fuzzing processes, default 0).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
seconds=${1:-60}
work=${2:-$root/build-fuzz}
shift $(( $# > 2 ? 2 : $# )) || true
targets=("$@")
all=(create_session_fuzz hyperparameters_fuzz manifest_fuzz peer_fuzz layout_fuzz
     safetensors_fuzz bounded_fuzz)
[ -n "${FUZZ_BUILD:-}" ] && all=(session_fuzz auth_fuzz "${all[@]}")
[ ${#targets[@]} -gt 0 ] || targets=("${all[@]}")

start=$(date +%s)
if [ -n "${FUZZ_BUILD:-}" ]; then
  bin=$(cd "$FUZZ_BUILD" && pwd)/tests/fuzz
  cmake --build "$FUZZ_BUILD" -j"${DIOND_JOBS:-2}" --target "${targets[@]}"
else
  bin=$work
  launcher=()
  command -v ccache >/dev/null 2>&1 && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  CC=clang CXX=clang++ cmake -S "$root/tests/fuzz" -B "$work" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    "${launcher[@]}" >/dev/null
  cmake --build "$work" -j"${DIOND_JOBS:-2}" --target "${targets[@]}"
fi
echo "fuzz targets built in $(( $(date +%s) - start )) s"

# Seeds (the corpus folders keep what earlier runs found).
corpus=$work/corpus
seeds=$root/tests/fuzz/seeds
for t in "${all[@]}" session_fuzz auth_fuzz; do mkdir -p "$corpus/$t" "$work/artifacts/$t"; done
for f in "$seeds"/create_session/*.txtpb; do
  protoc -I"$root/proto" --encode=diond.v1.CreateSessionRequest diond/v1/optimizer.proto \
    < "$f" > "$corpus/create_session_fuzz/seed-$(basename "$f" .txtpb)"
done
# hyperparameters_fuzz: an algorithm byte (each seed under every algorithm), a [16, 8] shape,
# then the request.
for f in "$seeds"/hyperparameters/*.txtpb; do
  wire=$(mktemp)
  protoc -I"$root/proto" --encode=diond.v1.SetHyperparametersRequest diond/v1/optimizer.proto \
    < "$f" > "$wire"
  for a in 0 1 2 3 4 5 6; do
    { printf "\\x0$a\\x0f\\x07"; cat "$wire"; } \
      > "$corpus/hyperparameters_fuzz/seed-$(basename "$f" .txtpb)-$a"
  done
  rm -f "$wire"
done
for f in "$seeds"/manifest/*.json; do
  python3 "$root/tests/fuzz/encode_manifest_seed.py" "$f" \
    "$corpus/manifest_fuzz/seed-$(basename "$f" .json)"
done
for f in "$seeds"/peer/*.txt; do
  python3 "$root/tests/fuzz/encode_records.py" peer "$root/proto" "$f" \
    "$corpus/peer_fuzz/seed-$(basename "$f" .txt)"
done
for f in "$seeds"/session/*.txt; do
  python3 "$root/tests/fuzz/encode_records.py" session "$root/proto" "$f" \
    "$corpus/session_fuzz/seed-$(basename "$f" .txt)"
done
for f in "$seeds"/auth/*.txt; do
  python3 "$root/tests/fuzz/encode_records.py" auth "$root/proto" "$f" \
    "$corpus/auth_fuzz/seed-$(basename "$f" .txt)"
done
for f in "$root"/tests/conformance/vectors/*.safetensors; do
  [ "$(stat -c %s "$f")" -le 262144 ] && cp "$f" "$corpus/safetensors_fuzz/"
done
printf 'w.0/state.momentum' > "$corpus/bounded_fuzz/seed-name"
printf 'caf\xc3\xa9 \xe2\x80\xa6\n\x00\x1b[31m' > "$corpus/bounded_fuzz/seed-utf8-control"

status=0
for t in "${targets[@]}"; do
  art=$work/artifacts/$t
  failed=0
  echo "== $t: the seeds once, then ${seconds}s"
  mapfile -t seed_files < <(find "$corpus/$t" -maxdepth 1 -name 'seed-*' -type f)
  if [ ${#seed_files[@]} -gt 0 ] &&
     ! (cd "$art" && "$bin/$t" "${seed_files[@]}" >"$art/seeds.log" 2>&1); then
    tail -n 30 "$art/seeds.log"; echo "$t: FAILED on a seed"; status=1; continue
  fi
  if ! (cd "$art" && nice -n "${FUZZ_NICE:-0}" "$bin/$t" -max_total_time="$seconds" \
          -rss_limit_mb="${FUZZ_RSS_MB:-2048}" -max_len=65536 -print_final_stats=1 \
          -artifact_prefix="$art/" "$corpus/$t" >"$art/run.log" 2>&1); then
    failed=1
  fi
  grep -E '^#[0-9]+[[:space:]]+DONE|stat::number_of_executed_units|stat::peak_rss_mb' "$art/run.log" || true
  if [ $failed -ne 0 ] || ls "$art"/crash-* "$art"/leak-* "$art"/oom-* "$art"/timeout-* \
       >/dev/null 2>&1; then
    grep -E 'property violated|ERROR|runtime error|SUMMARY' "$art/run.log" | head -n 20 || true
    echo "$t: FAILED (reproducer and log in $art)"; status=1
  fi
done
exit $status
