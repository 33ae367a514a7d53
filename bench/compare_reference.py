#!/usr/bin/env python3
"""diond against the microsoft/dion reference, in one process, alternating steps.

    PYTHONPATH=build/python:client/python <python> bench/compare_reference.py \
        --reference /path/to/dion-checkout --diond build/bin/diond \
        --bench build/bench/diond_bench --layers 12 --rounds 5 \
        --json build/bench-results/compare.json --markdown build/bench-results/compare.md

The reference is a checkout of https://github.com/microsoft/dion that the user supplies; nothing
of it is vendored here. The script starts its own daemon from --diond (Unix socket, shared
memory, --compute_threads = --threads) and drives it through `diond.torch.Optimizer`, the way a
trainer does.

Rows (docs/BENCHMARKS.md, "diond against the reference"):
  * Muon, NorMuon, Dion rank 1, Dion rank 1/4, Dion2 (fraction 1/4), Dion3 = NorDion2 (1/4), on
    the GPT-2-small hidden matrices, `--layers` × [4 × 768², 768×3072, 3072×768] (12 layers =
    84.9M parameters), fp32 parameters and gradients;
  * AdamW on every GPT-2-small parameter (embeddings, `--layers` blocks with biases and norms;
    12 layers = 124.4M) against `torch.optim.AdamW(foreach=True)`.
For each row, one round steps the reference once and then each diond mode once (the same
gradients, fresh per step from a fixed seed pool, copied in outside the timed region); the first
`--warmup` rounds are not counted. The reference has one arithmetic (its Polar Express runs in
bf16 whatever the parameters' dtype, Dion in fp32); diond runs `precision="fp32"` (everything in
float32) and, where the reference's bf16 arithmetic exists, `precision="bf16_reference"` (its
emulation, docs/CONFORMANCE.md) on each bf16 matmul engine (`bf16_matmul`): the session default
`auto` (the table names what it resolved to on this CPU: oneDNN's bf16 matmul where PyTorch
uses it, AVX-512 CPUs; else the float32 GEMM) and the other engine. `--modes` picks the diond
columns: fp32, bf16_reference (= auto), bf16_reference:float32_gemm, bf16_reference:onednn.
Every diond mode is divided by the same reference time.

Numerical sanity, per row and diond mode: after the rounds every side has taken the same steps
on the same gradients from the same initial parameters, so the table also reports
relF(p_diond, p_ref) = ‖p_diond − p_ref‖_F / ‖p_ref‖_F and the same for the updates
(p_t − p_0), over all the row's parameters: like is compared with like when these are small
(bf16_reference against a reference whose bf16 rounding differs, e.g. under the 1.x
compatibility layer, shows up here).

Interpreter: the reference is written for PyTorch >= 2.7. Under torch 1.x (Debian's 1.13) the
script installs the project's compatibility layer first (tests/conformance/tools/
torch2_compat.py: torch.compile as identity, inert DTensor stand-ins, Python loops for the
`torch._foreach_*` that 1.13 lacks); its bf16 rounding mode is not applied (timing only, the
work is the same). Under torch 2.x the reference runs natively, eagerly unless --compile. On the
development machine the reference ran several times FASTER under Debian's 1.13 than under the
PyPI torch 2.15 wheel (docs/BENCHMARKS.md), so 1.13 is the stricter comparison; the output names
the interpreter and mode.

Also in the same run:
  * STREAM triad: `torch.add(b, c, alpha=s, out=a)` on three float32 arrays of --triad-mib MiB
    each with --threads threads, counted as 3 × 4 bytes per element (STREAM's convention); the
    AdamW row reports diond's bytes moved per second (28 bytes per parameter: read parameter,
    gradient, m, v; write parameter, m, v) ÷ that bandwidth.
  * Orthogonalization GFLOP/s ÷ GEMM ceiling: runs `--bench` (diond_bench) filtered to the GEMM
    ceilings and the Polar Express benchmarks at --threads threads, and reports its counters.
  * The floor: per matrix row and diond column, the flops of the step's dense linear algebra at
    the fewest its arithmetic allows, at the GEMM ceiling of their precision, ÷ the reference's
    median: the lowest ratio any implementation of that arithmetic could reach on this machine
    (`floor_rows`; docs/BENCHMARKS.md, "The floor").

`--render JSON` runs nothing: it prints (and writes to --markdown) the tables of an earlier --json.

Nothing asserts on time. Exit status: 0 unless something failed to run.
"""

import argparse
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# (row key, label, reference module, reference class, diond algorithm, reference kwargs,
#  diond modes). The kwargs are the same for both sides (diond takes the reference's names).
BF16 = ("bf16_reference", "bf16_reference:other")
MATRIX_ROWS = [
    ("muon", "Muon", "muon", "Muon", "muon", {}, ("fp32",) + BF16),
    ("normuon", "NorMuon", "normuon", "NorMuon", "normuon", {}, ("fp32",) + BF16),
    ("dion_r1", "Dion, rank 1", "dion", "Dion", "dion", {"rank_fraction": 1.0}, ("fp32",)),
    ("dion_r4", "Dion, rank ¼", "dion", "Dion", "dion", {"rank_fraction": 0.25}, ("fp32",)),
    ("dion2", "Dion2 (¼)", "dion2", "Dion2", "dion2", {"fraction": 0.25}, ("fp32",) + BF16),
    ("dion3", "Dion3 / NorDion2 (¼)", "nordion2", "NorDion2", "dion3", {"fraction": 0.25},
     ("fp32",) + BF16),
]
ENGINES = ("float32_gemm", "onednn")


def auto_bf16_matmul():
    """What bf16_matmul="auto" resolves to in the daemon on this CPU (kernels/optim
    ResolveBf16Matmul: oneDNN iff AVX512F/BW/VL/DQ, PyTorch's check)."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                need = {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
                return "onednn" if need <= flags else "float32_gemm"
    except OSError:
        pass
    return "float32_gemm"


def mode_options(mode, auto_engine):
    """diond.torch.Optimizer options of a column: "fp32", "bf16_reference" (auto),
    "bf16_reference:<engine>", "bf16_reference:other" (the engine auto did not pick)."""
    if mode == "fp32":
        return {"precision": "fp32"}
    engine = mode.split(":", 1)[1] if ":" in mode else "auto"
    if engine == "other":
        engine = ENGINES[1 - ENGINES.index(auto_engine)]
    return {"precision": "bf16_reference", "bf16_matmul": engine}


def column_name(mode, auto_engine):
    o = mode_options(mode, auto_engine)
    if o["precision"] == "fp32":
        return "fp32"
    e = o["bf16_matmul"]
    return "bf16_reference (auto: %s)" % auto_engine if e == "auto" else "bf16_reference (%s)" % e
ROW_KEYS = [r[0] for r in MATRIX_ROWS] + ["adamw"]
HIDDEN = 768
VOCAB, CONTEXT = 50257, 1024


def matrix_shapes(layers):
    one = [(HIDDEN, HIDDEN)] * 4 + [(HIDDEN, 4 * HIDDEN), (4 * HIDDEN, HIDDEN)]
    return one * layers


def gpt2_shapes(layers):
    """Every GPT-2-small parameter (lm_head tied to wte): 124,439,808 at 12 layers."""
    h = HIDDEN
    block = [(h,), (h,), (h, 3 * h), (3 * h,), (h, h), (h,), (h,), (h,), (h, 4 * h), (4 * h,),
             (4 * h, h), (h,)]
    return [(VOCAB, h), (CONTEXT, h)] + block * layers + [(h,), (h,)]


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


# ---- The floor: the least time the row's arithmetic allows on this machine ----------------------
#
# The speed targets (TARGETS below) are ratios to the reference. A target is reachable only if
# diond's step can take that little time; the step's dense linear algebra alone cannot run faster
# than the GEMM ceiling measured in the same run (diond_bench, 2048³). So, per matrix row and diond
# column, the table "The floor" counts the flops of that linear algebra at the fewest the column's
# arithmetic allows (below), divides by the ceiling of its precision, and divides that time by the
# reference's median: the lowest ratio any implementation of that arithmetic could reach here.
# Elementwise passes, memory traffic, thread start-up and the client round trip are left out, so the
# floor is a lower bound: when it is above a target, the target cannot be met on this machine.
# (AdamW is bandwidth-bound and has no such row: the triad measured through PyTorch is no upper
# bound on this machine's bandwidth, docs/BENCHMARKS.md.)
TARGETS = {("muon", "fp32"): 1.0, ("normuon", "fp32"): 1.0, ("muon", "bf16"): 0.6,
           ("normuon", "bf16"): 0.6, ("dion_r1", "fp32"): 0.5, ("dion_r4", "fp32"): 0.5,
           ("dion2", "fp32"): 0.5, ("dion2", "bf16"): 0.5, ("dion3", "fp32"): 0.5,
           ("dion3", "bf16"): 0.5}


def polar_express_flops(m, n, symmetric=True):
    """Flops of Polar Express (5 iterations) on an m×n matrix, g = min, h = max: per iteration
    the Gram product (2g²h in full), A·A (2g³) and B·Y (2g²h). With `symmetric` the two symmetric
    products count as one triangle each (g²h and g³: the least the arithmetic needs; diond's fp32
    kernel and, where it pays, its oneDNN bf16 one compute that), else in full (the bf16
    float32_gemm engine, whose bit-exact arithmetic needs the full products)."""
    g, h = min(m, n), max(m, n)
    per = (g * g * h + g ** 3 + 2 * g * g * h) if symmetric else 2 * (2 * g * g * h + g ** 3)
    return 5 * per


def ortho_of_ceiling_cap(method, shape):
    """The highest "of ceiling" a diond_bench Polar Express row can show: its effective flops
    (the full products, 5 × (4g²h + 2g³)) ÷ the flops of the fewest products the method's
    arithmetic needs, i.e. the ratio with every product at the ceiling. The float32_gemm engine
    (PE_bf16) needs the full products (1.0); the others one triangle per symmetric product.
    None for a row this model does not know."""
    try:
        m, n = (int(x) for x in shape.split("×"))
    except ValueError:
        return None
    if not method.startswith("PE_"):
        return None
    half = method != "PE_bf16"
    return polar_express_flops(m, n, False) / polar_express_flops(m, n, half)


def dion_flops(m, n, rank_fraction):
    """One Dion step on an m×n matrix (a = max, b = min, r = ⌈fraction·b⌉, rank_multiple_of 1):
    the four products B·Q, Bᵀ·P, P·Rᵀ and P·Q_newᵀ (2abr each), and P's orthonormalization by
    the default qr_method "rcqr": a Householder QR with its Q formed (geqrf + orgqr, 8r³/3) when P
    is square, else the randomized Cholesky QR: sketch S·P (k×a by a×r, k = 128·⌈1.25r/128⌉), the
    R of S·P (2kr² − 2r³/3), two triangular solves (ar² each), PᵀP as one triangle (ar²) and its
    Cholesky factorization (r³/3)."""
    a, b = max(m, n), min(m, n)
    r = min(int(math.ceil(rank_fraction * b)), b)
    flops = 4 * 2 * a * b * r
    if a <= r:
        flops += 8 * r ** 3 / 3
    else:
        k = 128 * int(math.ceil(1.25 * r / 128))
        flops += 2 * k * a * r + (2 * k * r * r - 2 * r ** 3 / 3) + 3 * a * r * r + r ** 3 / 3
    return flops


def selected_shape(m, n, fraction, rows_always):
    """The submatrix Dion2 (the shorter side) or NorDion2 (rows, rows_always) orthogonalizes."""
    if rows_always or m <= n:
        return (min(int(math.ceil(fraction * m)), m), n)
    return (m, min(int(math.ceil(fraction * n)), n))


def column_engine(mode, auto_engine):
    """"fp32", or the bf16 matmul engine a bf16_reference column ran on ("onednn" or
    "float32_gemm")."""
    o = mode_options(mode, auto_engine)
    if o["precision"] == "fp32":
        return "fp32"
    return auto_engine if o["bf16_matmul"] == "auto" else o["bf16_matmul"]


def step_flops(key, engine, layers):
    """(flops, precision of the ceiling) of one step of a matrix row on `engine`
    (column_engine); None for a row without a model."""
    shapes = matrix_shapes(layers)
    prec = "bf16" if engine == "onednn" else "fp32"
    half = engine != "float32_gemm"
    if key in ("muon", "normuon"):
        return sum(polar_express_flops(m, n, half) for m, n in shapes), prec
    kwargs = {r[0]: r[5] for r in MATRIX_ROWS}.get(key, {})  # the row's own options
    if key in ("dion2", "dion3"):
        subs = [selected_shape(m, n, kwargs["fraction"], key == "dion3") for m, n in shapes]
        return sum(polar_express_flops(m, n, half) for m, n in subs), prec
    if key in ("dion_r1", "dion_r4") and engine == "fp32":
        return sum(dion_flops(m, n, kwargs["rank_fraction"]) for m, n in shapes), "fp32"
    return None


def floor_rows(res):
    """Per row and diond column: the floor (see above) and the lowest reachable ratio."""
    o = res.get("ortho") or {}
    ceil = o.get("ceilings", {})
    ceilings = {"fp32": max([v for k, v in ceil.items() if k.startswith("f32")] or [0]),
                "bf16": ceil.get("bf16_onednn", 0)}
    out = []
    for key in ROW_KEYS:
        row = res["rows"].get(key)
        if not row:
            continue
        ref = row["reference"]["median_s"]
        for mode, name in res.get("modes", {}).items():
            d = row.get(mode)
            if d is None:
                continue
            model = step_flops(key, column_engine(mode, res.get("bf16_matmul_auto", "")),
                               res["layers"])
            if model is None or not ceilings[model[1]]:
                continue
            flops, prec = model
            floor_s = flops / (ceilings[prec] * 1e9)
            work = "%.0f GFLOP at the %s ceiling %.0f GFLOP/s" % (flops / 1e9, prec,
                                                                  ceilings[prec])
            # The targets are for fp32 and the default bf16 column (bf16_matmul auto).
            target = (TARGETS.get((key, "fp32" if mode == "fp32" else "bf16"))
                      if mode in ("fp32", "bf16_reference") else None)
            out.append({"row": key, "label": row["label"], "mode": mode, "column": name,
                        "work": work, "floor_s": floor_s, "reference_s": ref,
                        "floor_ratio": floor_s / ref, "measured_ratio": d["median_s"] / ref,
                        "target": target})
    return out


def log(*args):
    print(*args, file=sys.stderr, flush=True)


class Workload:
    """Initial parameters and a small pool of gradient sets (fixed seeds), shared by all sides."""

    def __init__(self, torch, shapes, pool, seed=0):
        self.torch = torch
        gen = torch.Generator().manual_seed(seed)
        self.init = [torch.randn(s, generator=gen) * 0.02 for s in shapes]
        self.grads = [[torch.randn(s, generator=gen) * 0.01 for s in shapes] for _ in range(pool)]

    def params(self):
        return [self.torch.nn.Parameter(p.clone()) for p in self.init]

    def load_grads(self, params, step):
        g = self.grads[step % len(self.grads)]
        for p, src in zip(params, g):
            if p.grad is None:
                p.grad = src.clone()
            else:
                p.grad.copy_(src)


def summarize(times):
    return {"median_s": statistics.median(times), "min_s": min(times), "times_s": times}


def rel_fro(torch, xs, ys):
    """‖x − y‖_F / ‖y‖_F over all tensors of the lists, in float64."""
    num = sum(float(torch.sum((x.double() - y.double()) ** 2)) for x, y in zip(xs, ys))
    den = sum(float(torch.sum(y.double() ** 2)) for y in ys)
    return math.sqrt(num / den) if den > 0 else (0.0 if num == 0 else math.inf)


def run_row(torch, args, daemon, work, make_reference, diond_options, modes):
    """Alternates one reference step and one step per diond mode; returns timings per side and,
    per diond side, how far its parameters and updates are from the reference's."""
    import diond.torch as dt
    sides = [("reference", make_reference(work.params()))]
    for mode in modes:
        ps = work.params()
        opt = dt.Optimizer([dict(params=ps)], target=daemon.target,
                           **mode_options(mode, args.auto_engine), **diond_options)
        sides.append((mode, (opt, ps)))
    times = {name: [] for name, _ in sides}
    for r in range(args.warmup + args.rounds):
        this_round = []
        for name, (opt, ps) in sides:
            work.load_grads(ps, r)
            t0 = time.perf_counter()
            opt.step()
            this_round.append((name, time.perf_counter() - t0))
        for name, dt_s in this_round:
            if r >= args.warmup:
                times[name].append(dt_s)
        log("  round %d%s: %s" % (r, " (warm-up)" if r < args.warmup else "",
                                  ", ".join("%s %.3f s" % nt for nt in this_round)))
    out = {name: summarize(t) for name, t in times.items()}
    with torch.no_grad():
        ref_ps = [p.detach() for p in sides[0][1][1]]
        ref_delta = [p - p0 for p, p0 in zip(ref_ps, work.init)]
        for name, (opt, ps) in sides[1:]:
            mine = [p.detach().float() for p in ps]
            out[name]["param_relfro_vs_reference"] = rel_fro(torch, mine, ref_ps)
            out[name]["delta_relfro_vs_reference"] = rel_fro(
                torch, [p - p0 for p, p0 in zip(mine, work.init)], ref_delta)
    for name, (opt, _) in sides:
        if name != "reference":
            opt.close()
    del sides
    gc.collect()
    return out


def stream_triad(torch, mib, reps=10):
    n = mib * 1024 * 1024 // 4
    a = torch.zeros(n)
    b = torch.rand(n)
    c = torch.rand(n)
    torch.add(b, c, alpha=3.0, out=a)
    best = math.inf
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.add(b, c, alpha=3.0, out=a)
        dt_s = time.perf_counter() - t0
        samples.append(dt_s)
        best = min(best, dt_s)
    bytes_moved = 3 * 4 * n
    return {"array_mib": mib, "best_GBps": bytes_moved / best / 1e9,
            "median_GBps": bytes_moved / statistics.median(samples) / 1e9}


def ortho_bench(binary, threads):
    """diond_bench's GEMM ceilings and Polar Express rows at `threads` threads."""
    flt = ("BM_Gemm(F32|Bf16)/.*/threads:%d/|"
           "BM_Orthogonalize/PE_(fp32|fp32openblas|bf16|bf16onednn)/"
           ".*/threads:%d/" % (threads, threads))
    # The thread waiting the daemon runs with (server/exe/main.cc), unless the user chose.
    env = dict(os.environ)
    if "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env:
        env["GOMP_SPINCOUNT"] = "10000"
    if "OPENBLAS_THREAD_TIMEOUT" not in env and "GOTO_THREAD_TIMEOUT" not in env:
        env["OPENBLAS_THREAD_TIMEOUT"] = "18"
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([binary, "--benchmark_filter=" + flt, "--benchmark_out=" + f.name,
                        "--benchmark_out_format=json"], check=True, stdout=subprocess.DEVNULL,
                       env=env)
        data = json.load(open(f.name))
    rows = []
    ceilings = {}
    for b in data["benchmarks"]:
        name = b["name"]
        if name.startswith("BM_Gemm"):
            ceilings[name.split("/")[1]] = b.get("GFLOP/s", 0.0)  # the mean: what Ceiling() uses
            continue
        parts = name.split("/")
        args_ = dict(p.split(":") for p in parts[2:] if ":" in p)
        rows.append({"method": parts[1], "shape": "%s×%s" % (args_.get("m"), args_.get("n")),
                     "ms": b["real_time"], "eff_GFLOPs": b.get("eff_GFLOP/s"),
                     "ceiling_GFLOPs": b.get("ceiling_GFLOP/s"),
                     "of_ceiling": b.get("of_ceiling"), "label": b.get("label", "")})
    return {"ceilings": ceilings, "rows": rows}


def reference_classes(torch, checkout):
    major = int(torch.__version__.split(".")[0])
    if major < 2:
        sys.path.insert(0, os.path.join(ROOT, "tests", "conformance", "tools"))
        import torch2_compat
        torch2_compat.install()
    sys.path.insert(0, os.path.abspath(checkout))
    import importlib
    importlib.import_module("dion")
    return major


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reference", help="microsoft/dion checkout (its root)")
    ap.add_argument("--diond", default=os.path.join(ROOT, "build", "bin", "diond"))
    ap.add_argument("--bench", default=os.path.join(ROOT, "build", "bench", "diond_bench"),
                    help="diond_bench for the orthogonalization/ceiling rows ('' to skip)")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default=",".join(ROW_KEYS),
                    help="comma-separated subset of " + ",".join(ROW_KEYS))
    ap.add_argument("--modes", default="fp32,bf16_reference,bf16_reference:other",
                    help="diond columns: fp32, bf16_reference (bf16_matmul auto), "
                         "bf16_reference:float32_gemm, bf16_reference:onednn, "
                         "bf16_reference:other (the engine auto does not pick here)")
    ap.add_argument("--compile", action="store_true",
                    help="let the reference's torch.compile run (torch 2.x; default: eager)")
    ap.add_argument("--triad-mib", type=int, default=256)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--markdown", help="write the Markdown table here (also printed)")
    ap.add_argument("--render", metavar="JSON",
                    help="run nothing: print (and --markdown) the tables of an earlier --json")
    args = ap.parse_args()
    if args.render:
        with open(args.render) as f:
            emit(json.load(f), args.markdown)
        return
    if not args.reference:
        ap.error("--reference is required (or --render an earlier --json)")
    if args.rounds < 1 or args.warmup < 0 or args.layers < 1:
        ap.error("--rounds >= 1, --warmup >= 0, --layers >= 1")
    args.auto_engine = auto_bf16_matmul()
    all_modes = ("fp32", "bf16_reference", "bf16_reference:float32_gemm",
                 "bf16_reference:onednn", "bf16_reference:other")
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in all_modes:
            ap.error("unknown mode %r (have %s)" % (m, ", ".join(all_modes)))
    # Columns, deduplicated after resolving "other" (e.g. :onednn and :other on a non-AVX-512 CPU).
    args.modes_list = []
    for m in modes:
        if column_name(m, args.auto_engine) not in [column_name(x, args.auto_engine)
                                                    for x in args.modes_list]:
            args.modes_list.append(m)
    rows = [r for r in args.rows.split(",") if r]
    for r in rows:
        if r not in ROW_KEYS:
            ap.error("unknown row %r (have %s)" % (r, ", ".join(ROW_KEYS)))

    if not args.compile:
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # before torch is imported
    import torch
    torch.set_num_threads(args.threads)
    major = reference_classes(torch, args.reference)
    import importlib
    import diond.daemon

    started = time.time()
    result = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
              "started_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
              "python": sys.version.split()[0], "interpreter": sys.executable, "torch": torch.__version__,
              "reference_mode": ("torch 2.x, compiled" if major >= 2 and args.compile else
                                 "torch 2.x, eager" if major >= 2 else
                                 "torch 1.x with tests/conformance/tools/torch2_compat.py"),
              "layers": args.layers, "rounds": args.rounds, "warmup": args.warmup,
              "threads": args.threads, "machine": platform.processor() or platform.machine(),
              "bf16_matmul_auto": args.auto_engine,
              "modes": {m: column_name(m, args.auto_engine) for m in args.modes_list},
              "cpus": os.cpu_count(), "load_before": open("/proc/loadavg").read().split()[:3],
              "rows": {}}
    log("torch %s (%s), %d layers, %d rounds" % (torch.__version__, result["reference_mode"],
                                                 args.layers, args.rounds))
    daemon = diond.daemon.Daemon(args.diond, compute_threads=args.threads).start()
    try:
        matrix_work = None
        for key, label, mod, cls, algo, kwargs, modes in MATRIX_ROWS:
            if key not in rows:
                continue
            if matrix_work is None:
                matrix_work = Workload(torch, matrix_shapes(args.layers), pool=2)
            ref_cls = getattr(importlib.import_module("dion." + mod), cls)
            log("%s:" % label)
            t = run_row(torch, args, daemon, matrix_work,
                        lambda ps: (ref_cls(ps, **kwargs), ps),
                        dict(algorithm=algo, **kwargs),
                        [m for m in args.modes_list
                         if m == "fp32" or (m.startswith("bf16") and "bf16_reference" in modes)])
            result["rows"][key] = {"label": label, "params": sum(numel(p.shape) for p in
                                                                 matrix_work.init), **t}
        matrix_work = None
        gc.collect()
        if "adamw" in rows:
            work = Workload(torch, gpt2_shapes(args.layers), pool=2)
            log("AdamW:")
            t = run_row(torch, args, daemon, work,
                        lambda ps: (torch.optim.AdamW(ps, lr=0.01, betas=(0.9, 0.95),
                                                      weight_decay=0.01, eps=1e-8,
                                                      foreach=True), ps),
                        dict(algorithm="adamw"), ("fp32",))
            n = sum(numel(p.shape) for p in work.init)
            del work
            gc.collect()
            triad = stream_triad(torch, args.triad_mib)
            result["triad"] = triad
            bps = 28.0 * n / t["fp32"]["median_s"]
            result["rows"]["adamw"] = {"label": "AdamW", "params": n, **t,
                                       "bytes_per_step": 28 * n, "diond_GBps": bps / 1e9,
                                       "of_triad": bps / 1e9 / triad["best_GBps"]}
    finally:
        daemon.stop()
        daemon.cleanup()
    if args.bench:
        log("orthogonalization and GEMM ceilings (%s)" % args.bench)
        result["ortho"] = ortho_bench(args.bench, args.threads)
    result["load_after"] = open("/proc/loadavg").read().split()[:3]
    result["wall_s"] = time.time() - started
    emit(result, args.markdown)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


def emit(res, markdown_path):
    """Adds the floor to a result, prints its tables and writes them to `markdown_path`."""
    res["floor"] = floor_rows(res)
    md = markdown(res)
    print(md)
    if markdown_path:
        with open(markdown_path, "w") as f:
            f.write(md)


def markdown(res):
    out = []
    out.append("Generated %s by `%s` (%s; torch %s, Python %s; layers: %d, rounds: %d after %d "
               "warm-up, threads: %d; 1-min load average %s -> %s; %.0f s)."
               % (res["started_utc"], res["command"], res["reference_mode"], res["torch"],
                  res["python"], res["layers"], res["rounds"], res["warmup"], res["threads"],
                  res["load_before"][0], res["load_after"][0], res["wall_s"]))
    out.append("")
    modes = res.get("modes", {"fp32": "fp32", "bf16_reference": "bf16_reference"})
    head = ["algorithm", "params", "reference median / min (s)"]
    for m, name in modes.items():
        head += ["diond %s median / min (s)" % name, "%s ratio (median / min)" % name]
    out.append("| " + " | ".join(head) + " |")
    out.append("|" + " --- |" * len(head))
    sanity = []
    for key in ROW_KEYS:
        row = res["rows"].get(key)
        if not row:
            continue
        ref = row["reference"]
        cells = ["%s" % row["label"], "%.1fM" % (row["params"] / 1e6),
                 "%.3f / %.3f" % (ref["median_s"], ref["min_s"])]
        checks = []
        for mode, name in modes.items():
            d = row.get(mode)
            if d is None:
                cells += ["—", "—"]
                continue
            cells.append("%.3f / %.3f" % (d["median_s"], d["min_s"]))
            cells.append("**%.2f** / %.2f" % (d["median_s"] / ref["median_s"],
                                              d["min_s"] / ref["min_s"]))
            if "param_relfro_vs_reference" in d:
                checks.append("%s: params %.2g, updates %.2g"
                              % (name, d["param_relfro_vs_reference"],
                                 d["delta_relfro_vs_reference"]))
        out.append("| " + " | ".join(cells) + " |")
        if checks:
            sanity.append("* %s: %s." % (row["label"], "; ".join(checks)))
    if sanity:
        out.append("")
        out.append("Numerical sanity after the %d rounds (warm-up included), relF(diond, "
                   "reference) of the parameters and of the updates p_t − p_0, over all the "
                   "row's parameters (bf16_matmul auto resolved to %s on this CPU):"
                   % (res["rounds"] + res["warmup"], res.get("bf16_matmul_auto", "?")))
        out.append("")
        out.extend(sanity)
    if "adamw" in res["rows"]:
        a, t = res["rows"]["adamw"], res["triad"]
        out.append("")
        out.append("AdamW moves %.2f GB per step (28 bytes per parameter); diond's median step "
                   "moves %.1f GB/s, **%.2f** of the STREAM triad measured in the same run "
                   "(`torch.add(b, c, alpha=s, out=a)`, 3 × %d MiB float32, best %.1f GB/s, "
                   "median %.1f GB/s)." % (a["bytes_per_step"] / 1e9, a["diond_GBps"],
                                           a["of_triad"], t["array_mib"], t["best_GBps"],
                                           t["median_GBps"]))
    if "ortho" in res:
        o = res["ortho"]
        out.append("")
        out.append("GEMM ceilings (2048³, mean over the iterations, GFLOP/s): " + ", ".join(
            "%s %.0f" % (k, v) for k, v in sorted(o["ceilings"].items())) + ".")
        out.append("")
        out.append("| orthogonalization | shape | ms | eff. GFLOP/s | ceiling GFLOP/s "
                   "| of ceiling | at most |")
        out.append("| --- | --- | --- | --- | --- | --- | --- |")
        for r in o["rows"]:
            cap = ortho_of_ceiling_cap(r["method"], r["shape"])
            out.append("| %s (%s) | %s | %.0f | %.0f | %.0f | **%.2f** | %s |"
                       % (r["method"], r["label"], r["shape"], r["ms"], r["eff_GFLOPs"] or 0,
                          r["ceiling_GFLOPs"] or 0, r["of_ceiling"] or 0,
                          "%.2f" % cap if cap else "—"))
        out.append("")
        out.append("\"At most\": the \"of ceiling\" an orthogonalizer would reach with every "
                   "product at the ceiling (the benchmark's full-product flops ÷ the fewest the "
                   "method's arithmetic needs, `ortho_of_ceiling_cap`).")
    floors = res.get("floor") or []
    if floors:
        out.append("")
        out.append("The floor: the least time one step's dense linear algebra takes at this run's "
                   "GEMM ceiling of its precision, a lower bound "
                   "(bench/compare_reference.py, `floor_rows`). A target below the lowest "
                   "reachable ratio cannot be met on this machine by any implementation of that "
                   "arithmetic.")
        out.append("")
        out.append("| algorithm | diond column | one step's work | floor (s) | reference median "
                   "(s) | lowest reachable ratio | target | measured ratio |")
        out.append("|" + " --- |" * 8)
        for f in floors:
            t = f["target"]
            out.append("| %s | %s | %s | %.3f | %.3f | **%.2f**%s | %s | %.2f |"
                       % (f["label"], f["column"], f["work"], f["floor_s"], f["reference_s"],
                          f["floor_ratio"], " (above the target)" if t and f["floor_ratio"] > t
                          else "", "≤ %.1f" % t if t else "—", f["measured_ratio"]))
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
