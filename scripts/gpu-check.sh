#!/usr/bin/env bash
# The GPU check of issue 11: one command for a machine with one GPU (docs/GPU.md).
#   scripts/gpu-check.sh [OUT_DIR]        (default: $OUT, else ./gpu-check-out)
# Steps, each recorded (exit status, seconds, log) in OUT_DIR/summary.json and summary.md:
#   build       scripts/build.sh with -j$(nproc), sm_90 only (SASS + PTX), -Werror
#   ctest_gpu   ctest -L gpu (cuda_ops_test: every op and every rule, GPU vs CPU; NCCL; device)
#   ops_json    cuda_ops_test's per-op / per-rule results as JSON
#   conformance diond-conformance --device cuda:0 --mode both on every vector
#   example     examples/python/train_gpt.py against a daemon started with --device=cuda:0
#   python_cuda issue 12's Python CUDA arenas (client/python/tests/test_cuda_arena.py, legacy IPC
#               and VMM fd against GPU daemons; test_cuda_region.py), with $DIOND_GPU_PYTHON
#               (default /usr/bin/python3): its torch must see the GPU, else the step fails
#   bench       diond-gpu-bench (ratios of item 7) as JSON
#   ipc_bench   diond-ipc-bench (issue 12): a GPU daemon's Step through a CudaArena (legacy IPC)
#               and a ShmArena ÷ the same update in-process, as JSON
# Without a GPU it exits 77 with one line, before building anything. Exit status: 0 when every
# step passed, 1 otherwise (the summary says which).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-${OUT:-$PWD/gpu-check-out}}

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  echo "gpu-check: no GPU on this machine (nvidia-smi lists no device); nothing to check" >&2
  exit 77
fi
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi
mkdir -p "$out"
out=$(cd "$out" && pwd)
build=${DIOND_GPU_BUILD:-$root/build-gpu}
jobs=$(nproc)
python=/usr/bin/python3
steps=()

run_step() {  # run_step NAME TIMEOUT_S COMMAND...
  local name=$1 limit=$2; shift 2
  local t0 rc
  t0=$(date +%s)
  echo "== $name: $*" | tee -a "$out/gpu-check.log"
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  rc=$?
  steps+=("$name $rc $(( $(date +%s) - t0 ))")
  echo "   -> exit $rc in $(( $(date +%s) - t0 )) s (log: $out/$name.log)" | tee -a "$out/gpu-check.log"
  return $rc
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >"$out/gpu.txt" 2>&1

# 1. Build only what the check runs, for sm_90 only.
# (every binary with a `gpu`-labelled ctest case, plus the tools the later steps run)
targets="diond diond_cuda diond_conformance diond_gpu_bench cuda_ops_test nccl_communicator_test"
targets="$targets gpu_device_test diond_proto_python client_cuda_arena_test diond_ipc_bench"
run_step build 540 env DIOND_SKIP_DEPS=1 DIOND_JOBS="$jobs" DIOND_TARGETS="$targets" \
  bash "$root/scripts/build.sh" "$build" -DDIOND_WITH_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES="90-real;90-virtual" -DDIOND_WERROR=ON
build_rc=$?

if [ $build_rc -eq 0 ]; then
  # 2. The gpu-labelled tests, and the per-op / per-rule comparison as JSON.
  run_step ctest_gpu 300 ctest --test-dir "$build" -L gpu --output-on-failure \
    --output-junit "$out/ctest-gpu.xml"
  run_step ops_json 300 "$build/kernels/cuda_ops_test" --gtest_output="json:$out/cuda_ops.json"
  # 3. Every conformance vector on the GPU, both precision modes.
  run_step conformance 300 "$build/bin/diond-conformance" --device cuda:0 --mode both \
    --cuda_plugin "$build/bin/libdiond_cuda.so" "$root/tests/conformance/vectors"
  # 4. The Python example against a GPU daemon.
  dir=$(mktemp -d)
  "$build/bin/diond" --device=cuda:0 --cuda_plugin="$build/bin/libdiond_cuda.so" \
    --listen="unix:$dir/diond.sock" --metrics_address= --health_address= \
    >"$out/daemon.log" 2>&1 &
  daemon=$!
  for _ in $(seq 100); do [ -S "$dir/diond.sock" ] && break; sleep 0.1; done
  run_step example 300 env PYTHONPATH="$build/python:$root/client/python" DIOND_BINARY="$build/bin/diond" \
    "$python" "$root/examples/python/train_gpt.py" --target "unix:$dir/diond.sock" --steps 100 \
    --summary-json "$out/train_gpt.json"
  kill "$daemon" 2>/dev/null
  wait "$daemon" 2>/dev/null
  rm -rf "$dir"
  # 5. The Python CUDA arenas (issue 12): the tests skip without a GPU in torch, so check that
  # first rather than record a pass that tested nothing.
  run_step python_cuda 300 env DIOND_BINARY="$build/bin/diond" \
    PYTHONPATH="$build/python:$root/client/python" bash -c '
    "$0" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" || {
      echo "python_cuda: torch in $0 sees no GPU; set DIOND_GPU_PYTHON to a CUDA torch" >&2
      exit 1
    }
    exec "$0" -m pytest -q -p no:cacheprovider -rs --junitxml="$1" "${@:2}"' \
    "${DIOND_GPU_PYTHON:-$python}" "$out/python-cuda.xml" \
    "$root/client/python/tests/test_cuda_arena.py" "$root/client/python/tests/test_cuda_region.py"
  # 6. The GPU benchmarks.
  run_step bench 300 "$build/bin/diond-gpu-bench" --cuda_plugin "$build/bin/libdiond_cuda.so" \
    --out "$out/gpu-bench.json"
  run_step ipc_bench 300 "$build/bin/diond-ipc-bench" --diond "$build/bin/diond" \
    --cuda_plugin "$build/bin/libdiond_cuda.so" --out "$out/ipc-bench.json"
fi

# Summary: JSON + Markdown.
printf '%s\n' "${steps[@]}" | "$python" - "$out" <<'EOF'
import json, os, sys
out = sys.argv[1]
steps = []
for line in sys.stdin.read().split("\n"):
    if line.strip():
        name, rc, secs = line.split()
        steps.append({"step": name, "exit": int(rc), "seconds": int(secs),
                      "log": os.path.join(out, name + ".log")})
summary = {"gpu": open(os.path.join(out, "gpu.txt")).read().strip(), "steps": steps,
           "passed": all(s["exit"] == 0 for s in steps)}
ops = os.path.join(out, "cuda_ops.json")
if os.path.exists(ops):
    cases = []
    for suite in json.load(open(ops)).get("testsuites", []):
        for t in suite.get("testsuite", []):
            cases.append({"case": suite["name"] + "." + t["name"],
                          "result": "FAIL" if t.get("failures") else t.get("result", "?")})
    summary["ops_and_rules"] = cases
# Whether the GPU daemon's steps ran as CUDA graphs (docs/GPU.md "CUDA graphs"): its log says
# which phases were captured and which fell back, and why (a real cudaStreamBeginCapture over
# cuBLAS / cuSOLVER / pinned-memory copies is first exercised here).
log = os.path.join(out, "daemon.log")
if os.path.exists(log):
    import re
    text = open(log, errors="replace").read()
    captured = sorted(set(re.findall(r"the (\w+) phase was captured as a graph", text)))
    eager = [{"phase": m[0], "reason": m[1], "detail": m[2]} for m in
             re.findall(r"the (\w+) phase of its steps runs eagerly, not as a captured graph "
                        r"\(reason (\w+): (.*)\)", text)]
    summary["step_graphs"] = {"captured": captured, "eager": eager}
summary["bench"] = {}
for key, name in (("gpu", "gpu-bench.json"), ("ipc", "ipc-bench.json")):
    path = os.path.join(out, name)
    if os.path.exists(path):
        summary["bench"][key] = json.load(open(path))
if not summary["bench"]:
    del summary["bench"]
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=2)
md = ["# diond GPU check", "", "GPU: " + summary["gpu"], "",
      "| step | exit | seconds |", "|---|---|---|"]
md += ["| %s | %d | %d |" % (s["step"], s["exit"], s["seconds"]) for s in steps]
if "ops_and_rules" in summary:
    md += ["", "## GPU vs CPU, per op and per rule", "", "| case | result |", "|---|---|"]
    md += ["| %s | %s |" % (c["case"], c["result"]) for c in summary["ops_and_rules"]]
if "step_graphs" in summary:
    g = summary["step_graphs"]
    md += ["", "## Step graphs of the GPU daemon (example run)", "",
           "captured: " + (", ".join(g["captured"]) or "none")]
    md += ["- %s phase eager: %s (%s)" % (e["phase"], e["reason"], e["detail"]) for e in g["eager"]]
if "bench" in summary:
    md += ["", "## Benchmarks (ratios measured in the same run)", "", "```",
           json.dumps(summary["bench"], indent=2), "```"]
open(os.path.join(out, "summary.md"), "w").write("\n".join(md) + "\n")
print("gpu-check: %s; summary in %s/summary.md" %
      ("every step passed" if summary["passed"] else "FAILURES", out))
sys.exit(0 if summary["passed"] else 1)
EOF
