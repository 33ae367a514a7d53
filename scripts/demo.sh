#!/usr/bin/env bash
# The main job, on a fresh machine: installs and builds what is missing, starts a CPU daemon on a
# temporary Unix socket, shows it healthy and its metrics, then stops it cleanly with SIGTERM.
# (Training a model through the daemon joins this script with the Python client.)
#   scripts/demo.sh [BUILD_DIR]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}

DIOND_TARGETS="diond diondctl" bash "$root/scripts/build.sh" "$build"

work=$(mktemp -d /tmp/diond-demo.XXXXXX)
sock=$work/diond.sock
pid=""
cleanup() {
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then kill -TERM "$pid"; wait "$pid" || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

echo "== starting diond on unix:$sock (CPU) =="
"$build/bin/diond" --device=cpu --listen="unix:$sock" --metrics_address=127.0.0.1:0 \
  --ready_file="$work/ready.json" &
pid=$!
for _ in $(seq 1 300); do
  [ -s "$work/ready.json" ] && break
  kill -0 "$pid" 2>/dev/null || { echo "diond exited early"; exit 1; }
  sleep 0.1
done
[ -s "$work/ready.json" ] || { echo "diond did not become ready"; exit 1; }
metrics_port=$(/usr/bin/python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["metrics_port"])' "$work/ready.json")

echo "== health =="
"$build/bin/diondctl" --target="unix:$sock" health
"$build/bin/diondctl" --target="unix:$sock" health diond.v1.Optimizer
"$build/bin/diondctl" --target="unix:$sock" sessions

echo "== metrics (excerpt of http://127.0.0.1:$metrics_port/metrics) =="
curl -s "http://127.0.0.1:$metrics_port/metrics" | grep -E '^(diond_|process_resident)' | head -n 8

echo "== stopping diond (SIGTERM) =="
kill -TERM "$pid"
wait "$pid"
rc=$?
pid=""
echo "diond exited with status $rc"
[ ! -e "$sock" ] && echo "socket removed"
exit $rc
