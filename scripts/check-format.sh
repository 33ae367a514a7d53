#!/usr/bin/env bash
# Every tracked C, C++ and CUDA source is as .clang-format lays it out (STYLE.md B6).
#   scripts/check-format.sh [--fix] [REPO]
#     --fix        rewrite the files that differ instead of failing
#     --self-test  the check on a scratch repository: a misformatted file must fail it, and
#                  the same file after --fix must pass
# Formatting changes between clang-format releases, so the check pins one: clang-format 14, the
# one Debian 12 ships (install-deps.sh). Exit 1 lists the files that differ and the command
# that fixes them.
set -euo pipefail
fix=0
if [ "${1:-}" = --self-test ]; then
  self=$(cd "$(dirname "$0")" && pwd)/check-format.sh
  t=$(mktemp -d); trap 'rm -rf "$t"' EXIT
  git -C "$t" init -q
  cp "$(dirname "$0")/../.clang-format" "$t/"
  printf 'int  f( int x ){return x;}\n' >"$t/bad.cc"
  git -C "$t" add .clang-format bad.cc
  if bash "$self" "$t" >/dev/null; then echo "self-test: a misformatted file passed"; exit 1; fi
  bash "$self" --fix "$t" >/dev/null
  bash "$self" "$t" >/dev/null || { echo "self-test: the file after --fix failed"; exit 1; }
  echo "self-test: passed"; exit 0
fi
if [ "${1:-}" = --fix ]; then fix=1; shift; fi
repo=$(cd "${1:-$(dirname "$0")/..}" && pwd)
fmt=""
for c in clang-format-14 clang-format; do
  if command -v "$c" >/dev/null && "$c" --version | grep -q 'version 14\.'; then fmt=$c; break; fi
done
if [ -z "$fmt" ]; then
  echo "check-format: clang-format 14 is not installed (scripts/install-deps.sh)"; exit 1
fi
mapfile -t files < <(git -C "$repo" ls-files '*.h' '*.cc' '*.c' '*.cu' '*.cuh' '*.def')
cd "$repo"
if [ $fix = 1 ]; then
  printf '%s\n' "${files[@]}" | xargs -r "$fmt" --style=file -i
  echo "check-format: formatted ${#files[@]} files"; exit 0
fi
bad=()
for f in "${files[@]}"; do
  "$fmt" --style=file --dry-run --Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done
if [ ${#bad[@]} -gt 0 ]; then
  printf 'check-format: differs from .clang-format: %s\n' "${bad[@]}"
  echo "check-format: ${#bad[@]} of ${#files[@]} files differ; fix with: bash scripts/check-format.sh --fix"
  exit 1
fi
echo "check-format: all ${#files[@]} files formatted"
