#!/usr/bin/env bash
# A real Prometheus server scrapes a real diond daemon: the shipped scrape config passes
# `promtool check config`, and diond's metrics become queryable through Prometheus's HTTP API.
#   prometheus_scrape_test.sh DIOND_BINARY DEPLOY_DIR
set -euo pipefail
diond=$1
deploy=$2
work=$(mktemp -d /tmp/diond-prom.XXXXXX)
pids=()
cleanup() { for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done; wait || true; rm -rf "$work"; }
trap cleanup EXIT

promtool check config "$deploy/prometheus/prometheus.yml"

"$diond" --device=cpu --listen="unix:$work/d.sock" --metrics_address=127.0.0.1:0 \
  --ready_file="$work/ready.json" 2>"$work/diond.log" &
pids+=($!)
for _ in $(seq 1 600); do [ -s "$work/ready.json" ] && break; sleep 0.1; done
mport=$(/usr/bin/python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["metrics_port"])' "$work/ready.json")

# Pick a free port for Prometheus itself.
pport=$(/usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
cat > "$work/prom.yml" <<YAML
global: { scrape_interval: 1s }
scrape_configs:
  - job_name: diond
    static_configs: [ { targets: ['127.0.0.1:$mport'] } ]
YAML
prometheus --config.file="$work/prom.yml" --web.listen-address="127.0.0.1:$pport" \
  --storage.tsdb.path="$work/tsdb" >"$work/prom.log" 2>&1 &
pids+=($!)

# The first sample takes ~6 s to become queryable (TOOLCHAIN.md P16): poll up to 60 s.
for _ in $(seq 1 120); do
  out=$(curl -s "http://127.0.0.1:$pport/api/v1/query?query=diond_build_info" || true)
  if echo "$out" | grep -q '"version":"'; then
    echo "prometheus sees diond: $out"
    up=$(curl -s "http://127.0.0.1:$pport/api/v1/query?query=up")
    echo "$up" | grep -q '"value":\[[0-9.]*,"1"\]' || { echo "target not up: $up"; exit 1; }
    rss=$(curl -s "http://127.0.0.1:$pport/api/v1/query?query=process_resident_memory_bytes")
    echo "$rss" | grep -q '"job":"diond"' || { echo "no process metrics: $rss"; exit 1; }
    echo "PASS"
    exit 0
  fi
  sleep 0.5
done
echo "FAIL: diond_build_info never became queryable"; tail -5 "$work/prom.log"; exit 1
