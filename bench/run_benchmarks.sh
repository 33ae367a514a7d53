#!/usr/bin/env bash
# Runs the GEMM ceilings, the orthogonalization benchmarks and the plain-PyTorch bf16 Polar
# Express comparison in one go, then writes docs/BENCHMARKS.md (orthogonalization and ceiling
# sections; the per-algorithm step-time section is kept as is).
#
# Usage: bench/run_benchmarks.sh [build-dir]   (default: build). About 2-3 minutes on 2 cores.
# Needs the diond_bench target built and /usr/bin/python3 with torch.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${1:-$root/build}"
bin="$build/bench/diond_bench"
out="$build/bench-results"   # raw JSON kept next to the build for inspection
mkdir -p "$out"
if [[ ! -x "$bin" ]]; then
  echo "missing $bin: cmake --build $build --target diond_bench" >&2
  exit 1
fi
cmd="bench/run_benchmarks.sh $*"
cut -d' ' -f1-3 /proc/loadavg > "$out/load_before.txt"
echo "running $bin" >&2
"$bin" --benchmark_format=json --benchmark_out="$out/cpp.json" --benchmark_out_format=json \
  > /dev/null
echo "running bench/torch_polar_express.py" >&2
/usr/bin/python3 "$root/bench/torch_polar_express.py" --threads 2 > "$out/torch.jsonl"
cut -d' ' -f1-3 /proc/loadavg > "$out/load_after.txt"
/usr/bin/python3 "$root/bench/render_benchmarks.py" --load "$(cat "$out/load_before.txt") -> $(cat "$out/load_after.txt")" --cpp "$out/cpp.json" \
  --torch "$out/torch.jsonl" --doc "$root/docs/BENCHMARKS.md" --command "$cmd" \
  --build-type "$(sed -n 's/^CMAKE_BUILD_TYPE:STRING=//p' "$build/CMakeCache.txt")"
echo "wrote $root/docs/BENCHMARKS.md" >&2
