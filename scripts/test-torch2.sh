#!/usr/bin/env bash
# Runs the Python client's test suite and examples/python/train_gpt.py on PyTorch 2.x (a PyPI
# wheel in a virtual environment) against an existing build (scripts/build.sh first):
#   scripts/test-torch2.sh [BUILD_DIR]
# Environment:
#   DIOND_TORCH2_VENV  the venv (default: $TMPDIR/diond-torch2-venv, outside the repository);
#                      created on the first run, reused while it holds torch 2.x
#   DIOND_TORCH2_SPEC  pip requirement for torch (default "torch>=2,<3"; the PyPI wheel pulls the
#                      CUDA runtime wheels, about 3 GB, and runs on a CPU)
#   DIOND_TORCH2_STEPS steps of the example run (default 100)
# The generated stubs come from BUILD_DIR/python (Debian's protoc 3.21 and grpc_python_plugin).
# protobuf is kept on the 4.x line the suite was run with (4.25; protoc 3.21 is protobuf 4.21's
# generator; a 7.x runtime also loads these stubs), grpcio >= Debian's 1.51.
# Measured (2 shared cores, torch 2.15.0 + CUDA 13 runtime wheels): first run 4.5 min of
# download and install (5.4 GB venv) plus about 7 min of tests; later runs about 7 min.
# Exits non-zero on any failure. Prints the time each phase took.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
venv=${DIOND_TORCH2_VENV:-${TMPDIR:-/tmp}/diond-torch2-venv}
spec=${DIOND_TORCH2_SPEC:-torch>=2,<3}
steps=${DIOND_TORCH2_STEPS:-100}
py=$venv/bin/python

if [ ! -x "$build/bin/diond" ] || [ ! -d "$build/python" ]; then
  echo "test-torch2: $build/bin/diond or $build/python is missing; build first:" >&2
  echo "  DIOND_TARGETS=\"diond diond_proto_python\" bash scripts/build.sh $build" >&2
  exit 1
fi

t0=$(date +%s)
have_torch2() {
  [ -x "$py" ] && "$py" - <<'EOF' 2>/dev/null
import sys, torch, grpc, google.protobuf, numpy, pytest
sys.exit(0 if int(torch.__version__.split(".")[0]) == 2 else 1)
EOF
}
if have_torch2; then
  echo "== venv $venv: reused =="
else
  echo "== venv $venv: installing $spec from PyPI =="
  /usr/bin/python3 -m venv "$venv"
  "$py" -m pip install --quiet --upgrade pip
  "$py" -m pip install --quiet "$spec" numpy pytest "grpcio>=1.51,<2" "protobuf>=4.21,<5"
fi
"$py" - <<'EOF'
import grpc, google.protobuf, numpy, torch
print("torch %s, grpcio %s, protobuf %s, numpy %s" % (torch.__version__, grpc.__version__,
      google.protobuf.__version__, numpy.__version__))
EOF
t1=$(date +%s)

export DIOND_BINARY="$build/bin/diond"
export PYTHONPATH="$build/python:$root/client/python"
echo "== pytest (client/python/tests) on torch 2 =="
set +e
"$py" -m pytest -q -p no:cacheprovider "$root/client/python/tests"
rc=$?
set -e
if [ $rc -ne 0 ]; then exit $rc; fi
t2=$(date +%s)

echo "== examples/python/train_gpt.py on torch 2 ($steps steps, Dion and Dion2) =="
for opt in dion dion2; do
  "$py" "$root/examples/python/train_gpt.py" --optimizer "$opt" --steps "$steps" \
    --log-every "$steps"
done
t3=$(date +%s)
echo "test-torch2: venv $((t1 - t0)) s, pytest $((t2 - t1)) s, example $((t3 - t2)) s," \
     "total $((t3 - t0)) s"
