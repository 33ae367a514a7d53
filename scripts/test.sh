#!/usr/bin/env bash
# Runs every test suite of diond from a fresh machine: installs dependencies, builds, then runs
# ctest (all tests except the `gpu` label, which needs a GPU), the Python suite, the integration
# suite (HF Trainer, Lightning, JAX; scripts/test-integrations.sh) and the Rust client's cargo
# tests.
# The repository is all it needs: the golden vectors are in tests/conformance/, the design in
# docs/. A clone with nothing beside it passes; .ci/run proves it by running this script in such
# a clone, and the ctest repo_hygiene_test fails if a tracked file refers to a path outside the
# repository or cites a section of a document that does not exist.
#   scripts/test.sh [BUILD_DIR]
# Exits non-zero on any failure.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}

bash "$root/scripts/build.sh" "$build"

echo "== ctest (label gpu excluded) =="
ctest --test-dir "$build" -LE gpu --output-on-failure -j"${DIOND_JOBS:-2}" --timeout 900

# GPU tests: run them only when a GPU is present (they also skip themselves without one).
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "== ctest (label gpu) =="
  ctest --test-dir "$build" -L gpu --output-on-failure
fi

# Python suites run under Debian's interpreter (it has grpcio and torch); pytest exit 5 means
# "no tests collected", which only happens if the suite folder is empty.
if [ -d "$root/client/python/tests" ]; then
  echo "== pytest =="
  set +e
  DIOND_BINARY="$build/bin/diond" PYTHONPATH="$build/python:$root/client/python" \
    /usr/bin/python3 -m pytest -q -p no:cacheprovider "$root/client/python/tests"
  rc=$?
  set -e
  if [ $rc -ne 0 ] && [ $rc -ne 5 ]; then exit $rc; fi
  # The world of two daemons on one device again, on the TEST device (the device sessions'
  # world phases, overlapped steps included), as the GPU check runs it on a GPU.
  echo "== pytest: a world of two diond_testdevice daemons =="
  DIOND_BINARY="$build/bin/diond_testdevice" DIOND_WORLD_COMPUTE=test-device:0 \
    PYTHONPATH="$build/python:$root/client/python" \
    /usr/bin/python3 -m pytest -q -p no:cacheprovider "$root/client/python/tests/test_world_one_device.py"
fi
# HF Trainer, Lightning and JAX: their pinned packages go into a venv in the build folder.
echo "== integrations (scripts/test-integrations.sh) =="
bash "$root/scripts/test-integrations.sh" "$build"
# The Rust client: cargo test --offline against the daemon of this build (the tests start it
# themselves; the conformance test also runs build/bin/diond-golden-replay). Crates come from
# Debian's registry (client/rust/.cargo/config.toml); whichever cargo is first on PATH is used.
echo "== cargo test (client/rust) =="
abs_build=$(cd "$build" && pwd)
(cd "$root/client/rust" && DIOND_BINARY="$abs_build/bin/diond" CARGO_TARGET_DIR="$abs_build/rust-target" \
  cargo test --offline)
echo "all test suites passed"
