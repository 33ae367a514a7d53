#!/usr/bin/env bash
# The GPU check: one command for a machine with one GPU (docs/GPU.md "Running the check").
#   scripts/gpu-check.sh --bundle FILE [--steps LIST] [OUT_DIR]   a bare CUDA machine
#   scripts/gpu-check.sh [--steps LIST] [OUT_DIR]                 builds from source first
# OUT_DIR defaults to $OUT, else ./gpu-check-out. It receives three files: summary.md,
# summary.json and gpu-check-logs.tar.gz (every log, JUnit and JSON result of the run).
# Bundle mode (scripts/bundle.sh made FILE; nothing is built):
#   unpack      the bundle into a temporary folder
#   libs        the CUDA libraries are looked up on this machine (the nvidia/*/lib folders of
#               python3's packages, where NCCL comes from, then the toolkit's lib64 and lib and
#               the driver's folder) and put on LD_LIBRARY_PATH (only those: the bundle's own libraries
#               come through its $ORIGIN RUNPATH); then tools/check-libs.sh checks with ldd that
#               every library of every binary resolves, naming any that does not
#   without a GPU the check stops here: exit 77 (1 if a library did not resolve)
# From source: build (scripts/build.sh, sm_90 SASS + PTX, -Werror, only what the check runs);
# without a GPU it exits 77 before building.
# Then, in both modes, within one time budget ($DIOND_GPU_CHECK_BUDGET s, default 330):
#   ctest_gpu   every `gpu`-labelled ctest case (bundle: tools/run_gpu_tests.py, no ctest tree;
#               each GoogleTest case's JSON result lands in the summary's per-case table)
#   ops_json    (from source only) cuda_ops_test's per-op / per-rule results as JSON
#   conformance diond-conformance --device cuda:0 --mode both on every vector
#   example     examples/python/train_gpt.py against a daemon started with --device=cuda:0
#   world       a world of two daemons on this one GPU (client/python/tests/
#               test_world_one_device.py with DIOND_WORLD_DEVICE=cuda:0): NCCL refuses two ranks
#               on one GPU, so they exchange over --world_device_collectives=gloo; each rank's
#               weights must equal one GPU daemon's
#   python_cuda the Python CUDA arenas (client/python/tests/test_cuda_arena.py,
#               test_cuda_region.py) with $DIOND_GPU_PYTHON (bundle: python3 on PATH; source:
#               /usr/bin/python3), whose torch must see the GPU, else the step fails
#   bench       diond-gpu-bench (orthogonalization and step ratios) as JSON
#   ipc_bench   diond-ipc-bench: a GPU daemon's Step through a CudaArena and a ShmArena ÷ the
#               same update in-process, as JSON
#   overlap_bench examples/python/bench_overlap.py on the GPU (a GPT-2-small-sized model on CUDA
#               arenas against a --device=cuda:0 daemon): the synchronous and the overlapped
#               step ÷ forward plus backward, for Muon, Dion2 and AdamW, as JSON
# --steps a,b,c runs only those of the steps above (a second call after a fix).
# Exit status: 0 when every step run passed, 1 otherwise (the summary says which), 77 no GPU.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bundle_file="" only="" out=""
while [ $# -gt 0 ]; do
  case $1 in
    --bundle) bundle_file=$(readlink -f "$2"); shift 2 ;;
    --steps) only=",$2,"; shift 2 ;;
    -h | --help) sed -n '2,33p' "$0"; exit 0 ;;
    -*) echo "gpu-check: unknown option $1" >&2; exit 2 ;;
    *) out=$1; shift ;;
  esac
done
out=${out:-${OUT:-$PWD/gpu-check-out}}
t_start=$(date +%s)

have_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; }
if [ -z "$bundle_file" ] && ! have_gpu; then
  echo "gpu-check: no GPU on this machine (nvidia-smi lists no device); nothing to check" >&2
  exit 77
fi
if [ -n "$bundle_file" ] && [ ! -f "$bundle_file" ]; then
  echo "gpu-check: no bundle file $bundle_file" >&2; exit 2
fi
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/diond-gpu-check.XXXXXX")
logs=$work/logs
mkdir -p "$logs"
steps=()
budget=${DIOND_GPU_CHECK_BUDGET:-330}

run_step() {  # run_step NAME TIMEOUT_S COMMAND...  (skipped unless in --steps, when given)
  local name=$1 limit=$2; shift 2
  local t0 rc left
  if [ -n "$only" ] && [[ $only != *",$name,"* ]]; then return 0; fi
  if [ -n "${deadline:-}" ]; then
    left=$(( deadline - $(date +%s) ))
    if [ "$left" -le 5 ]; then
      steps+=("$name 124 0")
      echo "== $name: not run, the time budget of $budget s is spent" | tee -a "$logs/gpu-check.log"
      return 124
    fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  t0=$(date +%s)
  echo "== $name (limit ${limit} s): $*" | tee -a "$logs/gpu-check.log"
  timeout "$limit" "$@" >"$logs/$name.log" 2>&1
  rc=$?
  steps+=("$name $rc $(( $(date +%s) - t0 ))")
  echo "   -> exit $rc in $(( $(date +%s) - t0 )) s" | tee -a "$logs/gpu-check.log"
  if [ $rc -ne 0 ]; then tail -5 "$logs/$name.log" | sed 's/^/      /'; fi
  return $rc
}

# Where this machine keeps its CUDA libraries: the toolkit, the driver's folder, and the
# nvidia/*/lib folders of python3's packages (the torch venv's wheels; NCCL is only there).
# The venv's come first: they are the ones its torch loads (LD_LIBRARY_PATH outranks torch's own
# RUNPATH), so the daemon and the trainer in one check use the same CUDA libraries.
cuda_lib_dirs() {
  local d sub
  "${DIOND_GPU_PYTHON:-python3}" - 2>/dev/null <<'EOF'
import glob, importlib.util, os
spec = importlib.util.find_spec("nvidia")
for base in (spec.submodule_search_locations if spec else []):
    for d in sorted(glob.glob(os.path.join(base, "*", "lib"))):
        print(d)
EOF
  for d in ${CUDA_HOME:+"$CUDA_HOME"} /usr/local/cuda; do
    for sub in lib64 lib targets/x86_64-linux/lib; do [ -d "$d/$sub" ] && echo "$d/$sub"; done
  done
  for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib; do [ -d "$d" ] && echo "$d"; done
}
# tar.xz without an xz program (a minimal image may lack xz-utils): Python's lzma.
unpack_cmd='if command -v xz >/dev/null 2>&1; then exec tar -xJf "$1" -C "$2"; fi
exec "$0" -c "import sys, tarfile
kw = dict(filter=tarfile.tar_filter) if sys.version_info >= (3, 12) else dict()
tarfile.open(sys.argv[1]).extractall(sys.argv[2], **kw)" "$1" "$2"'


if have_gpu; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >"$logs/gpu.txt" 2>&1
else
  echo "none (nvidia-smi lists no device)" >"$logs/gpu.txt"
fi

if [ -n "$bundle_file" ]; then
  mode=bundle
  python=${DIOND_GPU_PYTHON:-python3}
  run_step unpack 120 bash -c "$unpack_cmd" "${DIOND_GPU_PYTHON:-python3}" "$bundle_file" "$work"
  b=$(find "$work" -mindepth 2 -maxdepth 2 -name MANIFEST.json -printf '%h\n' | head -1)
  dirs=$(cuda_lib_dirs | awk '!seen[$0]++' | paste -sd:)
  export LD_LIBRARY_PATH="$dirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  echo "CUDA library folders on LD_LIBRARY_PATH: ${dirs:-none found}" | tee -a "$logs/gpu-check.log"
  if [ -z "$b" ]; then
    echo "gpu-check: $bundle_file holds no MANIFEST.json" | tee -a "$logs/gpu-check.log"
    steps+=("libs 1 0")
    prepared=1
  else
    cp "$b/MANIFEST.json" "$logs/MANIFEST.json"
    run_step libs 120 bash "$b/tools/check-libs.sh" "$b"
    prepared=$?
    grep -v "from this machine" "$logs/libs.log"
  fi
  bin=$b/bin vectors=$b/tests/conformance/vectors
  pypath=$b/client/python example=$b/examples/python/train_gpt.py pytests=$b/client/python/tests
else
  mode=source
  python=${DIOND_GPU_PYTHON:-/usr/bin/python3}
  build=${DIOND_GPU_BUILD:-$root/build-gpu}
  # (every binary with a `gpu`-labelled ctest case, plus the tools the later steps run)
  targets="diond diond_cuda diond_conformance diond_gpu_bench cuda_ops_test nccl_communicator_test"
  targets="$targets gpu_device_test diond_proto_python client_cuda_arena_test diond_ipc_bench"
  targets="$targets cuda_lost_context_gpu_test cuda_rules_gpu_test"
  only='' run_step build 540 env DIOND_SKIP_DEPS=1 DIOND_JOBS="$(nproc)" DIOND_TARGETS="$targets" \
    bash "$root/scripts/build.sh" "$build" -DDIOND_WITH_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES="90-real;90-virtual" -DDIOND_WERROR=ON
  prepared=$?
  bin=$build/bin vectors=$root/tests/conformance/vectors
  pypath=$build/python:$root/client/python example=$root/examples/python/train_gpt.py
  pytests=$root/client/python/tests
fi

gpu_rc=0
if [ "$prepared" -eq 0 ] && ! have_gpu; then
  echo "gpu-check: no GPU on this machine (nvidia-smi lists no device); the bundle unpacked and" \
    "its libraries resolve; nothing more to check" | tee -a "$logs/gpu-check.log"
  gpu_rc=77
elif [ "$prepared" -eq 0 ]; then
  deadline=$(( $(date +%s) + budget ))
  plugin=$bin/libdiond_cuda.so
  # 1. The gpu-labelled tests.
  if [ $mode = bundle ]; then
    run_step ctest_gpu 200 "$python" "$b/tools/run_gpu_tests.py" "$b" "$logs/gpu-tests" \
      --junit "$logs/ctest-gpu.xml" --deadline "$deadline"
  else
    run_step ctest_gpu 300 ctest --test-dir "$build" -L gpu --output-on-failure \
      --output-junit "$logs/ctest-gpu.xml"
    run_step ops_json 300 "$build/kernels/cuda_ops_test" --gtest_output="json:$logs/cuda_ops.json"
  fi
  # 2. Every conformance vector on the GPU, both precision modes.
  run_step conformance 90 "$bin/diond-conformance" --device cuda:0 --mode both \
    --cuda_plugin "$plugin" "$vectors"
  # A GPU daemon for the Python steps: gpu_daemon LOG starts one ($dir/diond.sock, $daemon),
  # gpu_daemon_stop ends it.
  corpus=/usr/share/common-licenses   # the example's default; else the bundle's docs
  [ -d "$corpus" ] || [ $mode != bundle ] || corpus=$b/docs
  gpu_daemon() {
    dir=$(mktemp -d)
    "$bin/diond" --device=cuda:0 --cuda_plugin="$plugin" --listen="unix:$dir/diond.sock" \
      --metrics_address= --health_address= >"$1" 2>&1 &
    daemon=$!
    for _ in $(seq 100); do [ -S "$dir/diond.sock" ] && break; sleep 0.1; done
  }
  gpu_daemon_stop() {
    kill "$daemon" 2>/dev/null
    wait "$daemon" 2>/dev/null
    rm -rf "$dir"
  }
  # 3. The Python example against a GPU daemon.
  if [ -z "$only" ] || [[ $only == *",example,"* ]]; then
    gpu_daemon "$logs/daemon.log"
    run_step example 120 env PYTHONPATH="$pypath" DIOND_BINARY="$bin/diond" \
      "$python" "$example" --target "unix:$dir/diond.sock" --steps 100 --corpus "$corpus" \
      --summary-json "$logs/train_gpt.json"
    gpu_daemon_stop
  fi
  # 3b. A world of two daemons on this one GPU, over Gloo (NCCL refuses two ranks on one GPU).
  run_step world 90 env PYTHONPATH="$pypath" DIOND_BINARY="$bin/diond" DIOND_WORLD_DEVICE=cuda:0 \
    DIOND_CUDA_PLUGIN="$plugin" "$python" -m pytest -q -p no:cacheprovider \
    --junitxml="$logs/world.xml" "$pytests/test_world_one_device.py"
  # 4. The Python CUDA arenas: the tests skip without a GPU in torch, so check that first
  # rather than record a pass that tested nothing.
  run_step python_cuda 120 env DIOND_BINARY="$bin/diond" PYTHONPATH="$pypath" bash -c '
    "$0" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" || {
      echo "python_cuda: torch in $0 sees no GPU; set DIOND_GPU_PYTHON to a CUDA torch" >&2
      exit 1
    }
    exec "$0" -m pytest -q -p no:cacheprovider -rs --junitxml="$1" "${@:2}"' \
    "$python" "$logs/python-cuda.xml" "$pytests/test_cuda_arena.py" "$pytests/test_cuda_region.py"
  # 5. The GPU benchmarks.
  run_step bench 90 "$bin/diond-gpu-bench" --cuda_plugin "$plugin" --out "$logs/gpu-bench.json"
  run_step ipc_bench 90 "$bin/diond-ipc-bench" --diond "$bin/diond" --cuda_plugin "$plugin" \
    --out "$logs/ipc-bench.json"
  # 6. The overlapped step against forward plus backward (docs/BENCHMARKS.md), last: it takes
  # what is left of the budget.
  if [ -z "$only" ] || [[ $only == *",overlap_bench,"* ]]; then
    gpu_daemon "$logs/overlap-daemon.log"
    run_step overlap_bench 120 env PYTHONPATH="$pypath" "$python" "$(dirname "$example")/bench_overlap.py" \
      --target "unix:$dir/diond.sock" --device cuda:0 --corpus "$corpus" --layers 12 \
      --d-model 768 --heads 12 --context 256 --batch 16 --steps 20 --warmup 2 \
      --json "$logs/overlap-bench.json"
    gpu_daemon_stop
  fi
fi

# Summary: JSON + Markdown in OUT_DIR, every log in one archive beside them.
summary_python=$python
command -v "$summary_python" >/dev/null 2>&1 || summary_python=/usr/bin/python3
# (the step list goes through a file: the program itself is python's stdin)
printf '%s\n' "${steps[@]}" >"$logs/steps.txt"
"$summary_python" - "$logs" "$out" "$mode" "$gpu_rc" "$(( $(date +%s) - t_start ))" <<'EOF'
import glob, json, os, re, sys
logs, out, mode, gpu_rc, total = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
steps = []
for line in open(os.path.join(logs, "steps.txt")).read().split("\n"):
    if line.strip():
        name, rc, secs = line.split()
        steps.append({"step": name, "exit": int(rc), "seconds": int(secs), "log": name + ".log"})
summary = {"mode": mode, "gpu": open(os.path.join(logs, "gpu.txt")).read().strip(),
           "seconds": total, "steps": steps,
           "passed": gpu_rc == 0 and bool(steps) and all(s["exit"] == 0 for s in steps)}
if gpu_rc == 77:
    summary["note"] = "no GPU: only the unpack and library checks ran"
man = os.path.join(logs, "MANIFEST.json")
if os.path.exists(man):
    m = json.load(open(man))
    summary["bundle"] = {k: m.get(k) for k in ("flavour", "cuda_architectures", "commit", "dirty",
                                                "gpu_cases")}
libs = os.path.join(logs, "libs.log")
if os.path.exists(libs):
    summary["libraries"] = [l[len("check-libs: "):] for l in open(libs).read().splitlines()
                            if l.startswith("check-libs: ")]
# Per GoogleTest case: the gtest JSON of the from-source ops_json step, or the one each bundle
# case wrote.
cases = []
files = [os.path.join(logs, "cuda_ops.json")] + sorted(glob.glob(os.path.join(logs, "gpu-tests", "gtest", "*.json")))
for path in files:
    if not os.path.exists(path):
        continue
    try:
        doc = json.load(open(path))
    except ValueError:
        continue
    exe = os.path.basename(path).split(".")[0] + ": " if "gpu-tests" in path else ""
    for suite in doc.get("testsuites", []):
        for t in suite.get("testsuite", []):
            cases.append({"case": exe + suite["name"] + "." + t["name"],
                          "result": "FAIL" if t.get("failures") else t.get("result", "?")})
if cases:
    summary["ops_and_rules"] = cases
# Whether the GPU daemon's steps ran as CUDA graphs (docs/GPU.md "CUDA graphs"): its log says
# which phases were captured and which fell back, and why.
log = os.path.join(logs, "daemon.log")
if os.path.exists(log):
    text = open(log, errors="replace").read()
    captured = sorted(set(re.findall(r"the (\w+) phase was captured as a graph", text)))
    eager = [{"phase": m[0], "reason": m[1], "detail": m[2]} for m in
             re.findall(r"the (\w+) phase of its steps runs eagerly, not as a captured graph "
                        r"\(reason (\w+): (.*)\)", text)]
    summary["step_graphs"] = {"captured": captured, "eager": eager}
summary["bench"] = {}
for key, name in (("gpu", "gpu-bench.json"), ("ipc", "ipc-bench.json"), ("train_gpt", "train_gpt.json"),
                  ("overlap", "overlap-bench.json")):
    path = os.path.join(logs, name)
    if os.path.exists(path):
        try:
            summary["bench"][key] = json.load(open(path))
        except ValueError:
            summary["bench"][key] = "unreadable: " + path
if not summary["bench"]:
    del summary["bench"]
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=2)
md = ["# diond GPU check (%s mode)" % mode, "", "GPU: " + summary["gpu"], ""]
if "bundle" in summary:
    md += ["Bundle: %(flavour)s, CUDA %(cuda_architectures)s, commit %(commit)s" % summary["bundle"], ""]
if "note" in summary:
    md += [summary["note"], ""]
md += ["| step | exit | seconds |", "|---|---|---|"]
md += ["| %s | %d | %d |" % (s["step"], s["exit"], s["seconds"]) for s in steps]
md += ["", "total: %d s; every log is in gpu-check-logs.tar.gz" % total]
bad = [l for l in summary.get("libraries", []) if not l.startswith(("from this machine", "all "))]
if bad:
    md += ["", "## Library problems", ""] + ["- " + l for l in bad]
if "ops_and_rules" in summary:
    md += ["", "## GoogleTest cases on the GPU", "", "| case | result |", "|---|---|"]
    md += ["| %s | %s |" % (c["case"], c["result"]) for c in cases]
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
      ("no GPU" if gpu_rc == 77 else "every step passed" if summary["passed"] else "FAILURES", out))
EOF
tar -czf "$out/gpu-check-logs.tar.gz" -C "$work" logs
rm -rf "$work"
[ "$gpu_rc" = 77 ] && exit 77
all_ok=1
for s in "${steps[@]}"; do
  read -r _ rc _ <<<"$s"
  [ "$rc" = 0 ] || all_ok=0
done
[ $all_ok = 1 ] && [ ${#steps[@]} -gt 0 ] && exit 0
exit 1
