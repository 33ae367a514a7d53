#!/usr/bin/env bash
# clang-tidy's bug-finding checks (.clang-tidy: bugprone-*, performance-*) over every production
# translation unit of a build, and the project headers they include (STYLE.md B7).
#   scripts/tidy.sh [BUILD_DIR] [FILE...]
# BUILD_DIR (default build) must hold compile_commands.json (CMake writes it). Without FILEs: the
# .cc and .c files of the build outside tests, benchmarks and testing/ folders (the TEST backend,
# the reference rules), never the CUDA sources (clang-tidy 14 does not know CUDA 13). Any finding
# fails (exit 1). The version is pinned, clang-tidy 14 (Debian 12's, install-deps.sh), since
# checks change between releases.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:-$repo/build}" && pwd)
shift || true
tidy=""
for c in clang-tidy-14 clang-tidy; do
  if command -v "$c" >/dev/null && "$c" --version | grep -q 'version 14\.'; then tidy=$c; break; fi
done
[ -n "$tidy" ] || { echo "tidy: clang-tidy 14 is not installed (scripts/install-deps.sh)"; exit 1; }
[ -f "$build/compile_commands.json" ] || { echo "tidy: no $build/compile_commands.json"; exit 1; }
if [ $# -gt 0 ]; then
  files=("$@")
else
  mapfile -t files < <(python3 - "$repo" "$build/compile_commands.json" <<'PY'
import json, os, sys
repo, db = sys.argv[1], sys.argv[2]
seen = set()
for c in json.load(open(db)):
    f = os.path.realpath(os.path.join(c["directory"], c["file"]))
    rel = os.path.relpath(f, repo)
    if rel.startswith(("..", "build", "tests/", "bench/")) or "/testing/" in rel:
        continue
    if not rel.endswith((".cc", ".c")) or rel.endswith("_test.cc") or "/fake_cuda/" in rel:
        continue
    seen.add(rel)
print("\n".join(sorted(seen)))
PY
)
fi
log=$(mktemp); trap 'rm -f "$log"' EXIT
start=$(date +%s)
cd "$repo"
# One process a file, as many at once as there are cores; the header filter keeps the project's
# own headers (not the build's generated ones, nor the system's).
printf '%s\n' "${files[@]}" | xargs -r -P "$(nproc)" -n 1 "$tidy" -p "$build" --quiet \
  --header-filter="^$repo/(common|kernels|server|client|examples)/" >"$log" 2>&1 || true
findings=$(grep -E '^[^ ].*: (warning|error): ' "$log" | sort -u || true)
if [ -n "$findings" ]; then
  echo "$findings"
  echo "tidy: $(echo "$findings" | wc -l) findings in ${#files[@]} files" \
    "($(( $(date +%s) - start )) s); see .clang-tidy"
  exit 1
fi
if grep -qE 'error: (unable|no such file|unknown)' "$log"; then cat "$log"; exit 1; fi
echo "tidy: ${#files[@]} files, no findings ($(( $(date +%s) - start )) s)"
