"""Renders the benchmark JSON of bench/run_benchmarks.sh into docs/BENCHMARKS.md.

Replaces everything between the markers BEGIN/END GENERATED; keeps the rest of the file (the
step-time section maintained by the update-rule work).
"""
import argparse
import json
import os
import platform
import re
import subprocess
import time

BEGIN = "<!-- BEGIN GENERATED: bench/run_benchmarks.sh -->"
END = "<!-- END GENERATED: bench/run_benchmarks.sh -->"

SKELETON = f"""# Benchmarks

{BEGIN}
{END}

## Optimizer step time (per algorithm)

<!-- Owned by the update-rule work (kernels/optim): one row per algorithm and shape. -->

| algorithm | shape | precision | threads | step time (ms) |
| --- | --- | --- | --- | --- |
| _to be filled in_ | | | | |
"""


def machine():
    model = "unknown"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        m = re.search(r"Model name:\s*(.+)", out)
        model = m.group(1).strip() if m else model
        flags = re.search(r"Flags:\s*(.+)", out)
        flags = flags.group(1).split() if flags else []
    except OSError:
        flags = []
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return model, os.cpu_count(), isa


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpp", required=True)
    ap.add_argument("--torch", required=True)
    ap.add_argument("--doc", required=True)
    ap.add_argument("--command", required=True)
    ap.add_argument("--build-type", default="?")
    ap.add_argument("--load", default="?")
    a = ap.parse_args()
    cpp = json.load(open(a.cpp))
    torch_rows = [json.loads(l) for l in open(a.torch) if l.strip()]
    model, cores, isa = machine()
    ctx = cpp.get("context", {})

    core = "?"
    for b in cpp["benchmarks"]:
        m = re.search(r"openblas:(\S+)", b.get("label", ""))
        if m:
            core = m.group(1)
    lines = []
    lines.append(f"Generated {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by `{a.command}`.\n")
    lines.append("Machine: " + f"{model}, {cores} cores ({', '.join(isa)}), "
                 f"`OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset)')}`, "
                 f"OpenBLAS kernels `{core}`, diond build type {a.build_type}, "
                 f"{platform.platform()}.\n")
    lines.append("All numbers are wall-clock means over the timed iterations. Other processes "
                 "may share the cores: load average (1, 5, 15 min) before -> after the run was "
                 f"{a.load}; with a 1-min load near or above the core count, expect every number "
                 "(ceilings included) to drop 2-3x, so compare rows of the same run only.\n")

    lines.append("### GEMM ceilings (2048³, through the ops API)\n")
    lines.append("| engine | precision | threads | GFLOP/s (mean) | GFLOP/s (best iteration) |")
    lines.append("| --- | --- | --- | --- | --- |")
    for b in cpp["benchmarks"]:
        if not b["name"].startswith("BM_Gemm"):
            continue
        eng = b["name"].split("/")[1]
        thr = re.search(r"threads:(\d+)", b["name"]).group(1)
        lines.append(f"| {eng} | {b.get('label', '').split()[0]} | {thr} | {b['GFLOP/s']:.0f} | "
                     f"{b['best_GFLOP/s']:.0f} |")
    lines.append("")

    lines.append("### Orthogonalization (5 iterations, one matrix)\n")
    lines.append("Effective GFLOP/s counts 5 × (4m²n + 2m³) flops (m ≤ n), the count of three "
                 "general GEMMs per iteration, whatever the kernel does; the fp32 mode computes "
                 "A = YYᵀ and bA + cA² with SYRK (one triangle), i.e. 3m²n + m³ per iteration, so "
                 "it can exceed 100% of the GEMM ceiling. \"of ceiling\" divides by the ceiling "
                 "of the same precision at the same thread count measured in the same run "
                 "(fp32: the faster of OpenBLAS and oneDNN).\n")
    lines.append("| method | mode | shape | threads | ms | eff. GFLOP/s | of ceiling |")
    lines.append("| --- | --- | --- | --- | --- | --- | --- |")
    ours = {}
    for b in cpp["benchmarks"]:
        if not b["name"].startswith("BM_Orthogonalize"):
            continue
        parts = b["name"].split("/")
        method, mode = parts[1].split("_")
        m = int(re.search(r"m:(\d+)", b["name"]).group(1))
        n = int(re.search(r"n:(\d+)", b["name"]).group(1))
        thr = int(re.search(r"threads:(\d+)", b["name"]).group(1))
        ms = b["real_time"]
        ours[(method, mode, m, n, thr)] = ms
        lines.append(f"| {method} | {b.get('label', mode)} | {m}×{n} | {thr} | {ms:.0f} | "
                     f"{b['eff_GFLOP/s']:.0f} | {100 * b['of_ceiling']:.0f}% |")
    lines.append("")

    lines.append("### bf16 Polar Express: diond bf16_reference vs plain PyTorch (same run)\n")
    lines.append("PyTorch: `bench/torch_polar_express.py` (eager bf16, torch "
                 f"{torch_rows[0]['torch'] if torch_rows else '?'}, "
                 "`torch.set_num_threads(2)`).\n")
    lines.append("| shape | threads | PyTorch ms | diond ms | speed-up |")
    lines.append("| --- | --- | --- | --- | --- |")
    for r in torch_rows:
        d = ours.get(("PE", "bf16", r["m"], r["n"], r["threads"]))
        if d is None:
            continue
        lines.append(f"| {r['m']}×{r['n']} | {r['threads']} | {r['ms']:.0f} | {d:.0f} | "
                     f"{r['ms'] / d:.2f}× |")
    lines.append("")
    generated = "\n".join(lines)

    doc = open(a.doc).read() if os.path.exists(a.doc) else SKELETON
    if BEGIN not in doc or END not in doc:
        doc = SKELETON + "\n" + doc
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    open(a.doc, "w").write(head + BEGIN + "\n" + generated + "\n" + END + tail)


if __name__ == "__main__":
    main()
