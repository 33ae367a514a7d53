#!/usr/bin/env bash
# The main job, on a fresh machine: installs and builds what is missing, starts a CPU daemon on a
# temporary Unix socket, shows it healthy, trains a small character-level GPT through it
# (examples/python/train_gpt.py: Dion2 for the hidden matrices, AdamW for embeddings, head and
# norms; the corpus is the license texts in /usr/share/common-licenses), prints the loss going
# down, shows the daemon's step metrics, then stops it cleanly with SIGTERM (exit 0).
#   scripts/demo.sh [BUILD_DIR]
# Environment: DIOND_DEMO_STEPS (default 300), DIOND_DEMO_OPTIMIZER (default dion2; muon, ...).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
steps=${DIOND_DEMO_STEPS:-300}
optimizer=${DIOND_DEMO_OPTIMIZER:-dion2}

DIOND_TARGETS="diond diondctl diond_proto_python" bash "$root/scripts/build.sh" "$build"

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
  --compute_threads=2 --ready_file="$work/ready.json" &
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

echo "== training a character-level GPT through diond ($steps steps, $optimizer + AdamW) =="
PYTHONPATH="$build/python:$root/client/python" /usr/bin/python3 \
  "$root/examples/python/train_gpt.py" --target="unix:$sock" --steps="$steps" \
  --optimizer="$optimizer" --threads=2 --summary-json="$work/summary.json"
/usr/bin/python3 - "$work/summary.json" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
ok = s["final_loss"] < s["initial_loss"] - 1.0
print("loss %s: %.3f -> %.3f (val %.3f -> %.3f)" % (
    "went down" if ok else "DID NOT go down enough", s["initial_loss"], s["final_loss"],
    s["initial_val_loss"], s["final_val_loss"]))
sys.exit(0 if ok else 1)
EOF

echo "== metrics (excerpt of http://127.0.0.1:$metrics_port/metrics) =="
curl -s "http://127.0.0.1:$metrics_port/metrics" |
  grep -E '^diond_(steps_total|sessions|rpcs_total\{code="OK",method="/diond.v1.Optimizer/(Step|CreateSession|RegisterRegion|CloseSession)")' |
  head -n 8 || true

echo "== stopping diond (SIGTERM) =="
kill -TERM "$pid"
rc=0
wait "$pid" || rc=$?
pid=""
echo "diond exited with status $rc"
[ ! -e "$sock" ] && echo "socket removed"
exit $rc
