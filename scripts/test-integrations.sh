#!/usr/bin/env bash
# The integration suite (client/python/integration: HF Trainer, PyTorch Lightning, diond.jax)
# and examples/python/train_jax.py, against an existing build (scripts/build.sh first):
#   scripts/test-integrations.sh [BUILD_DIR]
# Its packages are not Debian's: a venv over Debian's python3 (--system-site-packages, so torch
# 1.13, numpy, grpcio and pytest are Debian's) in BUILD_DIR/py-integrations gets the pinned
# client/python/integration/requirements.txt with --no-deps (every dependency is listed there;
# pip's resolver rejects Debian's torch version string). The venv is reused while its stamp
# matches the requirements file; pip's cache makes a rebuild cheap.
# Measured on 2 shared cores: a fresh venv 61 s with an empty pip cache, 25 s with a warm one,
# 0 s reused; the tests and the example 14 s.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
venv=$build/py-integrations
req=$root/client/python/integration/requirements.txt
py=$venv/bin/python

if [ ! -x "$build/bin/diond" ] || [ ! -d "$build/python" ]; then
  echo "test-integrations: $build/bin/diond or $build/python is missing; build first" >&2
  exit 1
fi
t0=$(date +%s)
stamp=$(sha256sum "$req" | cut -d' ' -f1)
if [ -x "$py" ] && [ "$(cat "$venv/.diond-stamp" 2>/dev/null)" = "$stamp" ]; then
  echo "== integration venv $venv: reused =="
else
  echo "== integration venv $venv: installing $req =="
  rm -rf "$venv"
  /usr/bin/python3 -m venv --system-site-packages "$venv"
  "$py" -m pip install --quiet --disable-pip-version-check --no-deps -r "$req"
  echo "$stamp" > "$venv/.diond-stamp"
fi
t1=$(date +%s)
export DIOND_BINARY="$build/bin/diond"
export PYTHONPATH="$build/python:$root/client/python"
echo "== pytest (client/python/integration) =="
(cd "$root" && "$py" -m pytest -q -p no:cacheprovider client/python/integration)
echo "== examples/python/train_jax.py =="
"$py" "$root/examples/python/train_jax.py" --steps 100
t2=$(date +%s)
echo "test-integrations: venv $((t1 - t0)) s, tests $((t2 - t1)) s"
