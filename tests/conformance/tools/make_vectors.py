"""Makes the bf16 conformance vectors and their rounding-spread tolerances from microsoft/dion.

Written for this project; it runs the upstream optimizer classes (never copies them) through
torch2_compat.py on Debian's PyTorch 1.13. Two jobs:

  refresh   Re-runs the reference on the inputs of existing vector files (bf16 algorithms) with
            the corrected bf16 norm rounding, rewrites their reference trajectory
            (param.<t>, state.<name>.final) and adds the bf16_reference tolerance.
  gpt       Trains a small character-level transformer (model and corpus defined below) with
            the reference class and writes new multi-parameter cases from its real gradients.

Both measure the reference's own rounding spread: the same case rerun with 2 threads instead of
1, with the matrices orthogonalized one at a time instead of stacked (or, for one-matrix
cases, stacked with a copy), with every bf16 matmul's inner dimension summed in two float32
halves, and (Dion2/NorDion2) with the selected slices in sorted instead of torch.topk's
unsorted order. spread = max over those reruns, steps and matrices of relF(delta_rerun, delta_stored);
tolerance_bf16_reference_delta_relfro = max(MARGIN * spread, FLOOR).

Usage (from the repository root, DION = a microsoft/dion checkout):
  /usr/bin/python3 tests/conformance/tools/make_vectors.py --dion DION refresh FILE...
  /usr/bin/python3 tests/conformance/tools/make_vectors.py --dion DION gpt \
      --out tests/conformance/vectors/gpt --manifest tests/conformance/vectors/gpt/manifest.json
"""

import argparse
import copy
import json
import math
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import reference_run  # noqa: E402
import vectors_io  # noqa: E402

MARGIN = 2.0     # tolerance = MARGIN x measured spread ...
FLOOR = 2e-3     # ... but at least this (covers float32 accumulation order inside BLAS)
BF16_ALGORITHMS = ("muon", "normuon", "dion2", "nordion2")
RUNTIME = ("PyTorch 1.13 CPU (Debian) + tests/conformance/tools/torch2_compat.py (PyTorch 2.x "
           "eager bf16 rounding incl. float32-accumulated bf16 norm), eager, 1 thread")


def relf(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    den = np.linalg.norm(b)
    num = np.linalg.norm(a - b)
    if den == 0:
        return 0.0 if num == 0 else math.inf
    return float(num / den)


def delta_spread(base, other, inits):
    """max over steps and matrices of relF(other_t - init, base_t - init)."""
    worst = 0.0
    for bt, ot in zip(base, other):
        for b, o, p0 in zip(bt, ot, inits):
            worst = max(worst, relf(o - p0, b - p0))
    return worst


class Case:
    """One run: algorithm, constructor kwargs, group options, inputs for every parameter."""

    def __init__(self, algorithm, kwargs, group_options, params, grads, seed=0):
        self.algorithm = algorithm
        self.kwargs = kwargs
        self.group_options = group_options
        self.params = params          # list of init arrays
        self.grads = grads            # list over steps of lists over params
        self.seed = seed

    def run(self, dion, rounding=None, per_param_groups=False, threads=1, dtype=None,
            duplicate=False):
        import torch
        torch.set_num_threads(threads)
        torch.manual_seed(self.seed)
        params, grads = self.params, self.grads
        if duplicate:  # the case's matrices stacked with a copy of themselves
            params = params + [p.copy() for p in params]
            grads = [g + [x.copy() for x in g] for g in grads]
        try:
            out, finals = reference_run.run(
                dion, self.algorithm, self.kwargs, self.group_options, params, grads,
                rounding=rounding, per_param_groups=per_param_groups, dtype=dtype)
        finally:
            torch.set_num_threads(1)
        n = len(self.params)
        return [o[:n] for o in out], finals[:n]

    def spread(self, dion, base):
        inits = self.params
        runs = {
            "threads2": self.run(dion, threads=2)[0],
            "matmul_split2": self.run(dion, rounding=dict(matmul_split=2))[0],
        }
        if self.algorithm in ("dion2", "nordion2"):
            runs["topk_sorted"] = self.run(dion, rounding=dict(topk_sorted=True))[0]
        if len(self.params) > 1:
            runs["one_at_a_time"] = self.run(dion, per_param_groups=True)[0]
        else:
            runs["stacked_with_copy"] = self.run(dion, duplicate=True)[0]
        return {k: delta_spread(base, v, inits) for k, v in runs.items()}


def tolerance_from(spread):
    return float("%.3g" % max(MARGIN * max(spread.values()), FLOOR))


def f64_run(case, dion):
    """The upstream code with every float32/bfloat16 cast promoted to float64 (param_f64)."""
    import torch
    out, _ = case.run(dion, rounding=dict(promote=torch.float64), dtype=torch.float64)
    return out


# ---- refresh -------------------------------------------------------------------------------

def trajectory_tolerances(case, dion, base, finals):
    """The public set's rule (tests/conformance/README.md, Tolerances) for the tolerances that
    depend on the stored trajectory, re-measured for a re-made one: 10x the distance of the
    stored run to (a) the same code with float64 parameters and (b) the float64 "exact" run."""
    import torch
    f64p, _ = case.run(dion, dtype=torch.float64)
    exact, exact_finals = case.run(dion, rounding=dict(promote=torch.float64),
                                   dtype=torch.float64)
    p0 = case.params[0]
    m = {
        "param_relfro_golden_vs_f64_params": [relf(b[0], a[0]) for b, a in zip(base, f64p)],
        "param_relfro_golden_vs_exact_f64": [relf(b[0], a[0]) for b, a in zip(base, exact)],
        "delta_relfro_golden_vs_f64_params": [relf(b[0] - p0, a[0] - p0)
                                              for b, a in zip(base, f64p)],
        "delta_relfro_golden_vs_exact_f64": [relf(b[0] - p0, a[0] - p0)
                                             for b, a in zip(base, exact)],
        "states_final_relfro_golden_vs_exact_f64": {
            n: relf(finals[0][n], exact_finals[0][n]) for n in finals[0]},
    }
    m = {k: ({n: float("%.3g" % x) for n, x in v.items()} if isinstance(v, dict)
             else [float("%.3g" % x) for x in v]) for k, v in m.items()}
    tols = {
        "param_relfro": float("%.3g" % max(10 * max(m["param_relfro_golden_vs_f64_params"] +
                                                   m["param_relfro_golden_vs_exact_f64"]), 1e-6)),
        "delta_relfro": float("%.3g" % max(10 * max(m["delta_relfro_golden_vs_f64_params"] +
                                                   m["delta_relfro_golden_vs_exact_f64"]), 1e-6)),
        "states_final_relfro": {n: float("%.3g" % max(10 * x, 1e-6)) for n, x in
                                m["states_final_relfro_golden_vs_exact_f64"].items()},
    }
    return m, tols


def refresh(dion, paths, manifest_path):
    manifest = None
    if manifest_path and os.path.exists(manifest_path):
        with open(manifest_path) as f:
            manifest = json.load(f)
    rows = []
    for path in paths:
        t, md = vectors_io.read(path)
        if md["algorithm"] not in BF16_ALGORITHMS:
            continue
        T = int(md["T"])
        opts = {k: (tuple(v) if isinstance(v, list) else v)
                for k, v in json.loads(md["param_group_options"]).items()}
        case = Case(md["algorithm"], json.loads(md["constructor_kwargs"]), opts,
                    [t["param.init"]], [[t[f"grad.{s}"]] for s in range(1, T + 1)],
                    seed=int(md["seed"]))
        base, finals = case.run(dion)
        measured, tols = trajectory_tolerances(case, dion, base, finals)
        old = [[t[f"param.{s}"]] for s in range(1, T + 1)]
        before = delta_spread(base, old, case.params)
        spread = case.spread(dion, base)
        tol = tolerance_from(spread)
        for s in range(1, T + 1):
            t[f"param.{s}"] = base[s - 1][0]
        for name in json.loads(md["state_names"]):
            t[f"state.{name}.final"] = finals[0][name]
        md["reference_runtime"] = RUNTIME
        md["tolerance_param_relfro"] = repr(tols["param_relfro"])
        md["tolerance_delta_relfro"] = repr(tols["delta_relfro"])
        md["tolerance_bf16_reference_delta_relfro"] = repr(tol)
        md["bf16_reference_spread"] = json.dumps(
            {k: float("%.3g" % v) for k, v in spread.items()}, sort_keys=True)
        vectors_io.write(path, t, md)
        rows.append((os.path.basename(path), before, spread, tol))
        print(f"{os.path.basename(path)}: old trajectory vs corrected reference {before:.3g}; "
              f"spread {spread}; tolerance {tol}", flush=True)
        if manifest is not None:
            for c in manifest["cases"]:
                if c["file"] == os.path.basename(path):
                    c["tolerance"]["bf16_reference_delta_relfro"] = tol
                    c["tolerance"]["param_relfro"] = tols["param_relfro"]
                    c["tolerance"]["delta_relfro"] = tols["delta_relfro"]
                    c["tolerance"]["states_final_relfro"] = tols["states_final_relfro"]
                    c["measured"].update(measured)
                    c["measured"]["bf16_reference_spread"] = {
                        k: float("%.3g" % v) for k, v in spread.items()}
                    c["measured"]["old_trajectory_vs_corrected_delta_relfro"] = float(
                        "%.3g" % before)
    if manifest is not None:
        with open(manifest_path, "w") as f:
            json.dump(manifest, f, indent=1)
            f.write("\n")
    return rows


# ---- the transformer -----------------------------------------------------------------------

CORPUS = "/usr/share/common-licenses/GPL-3"
D_MODEL, N_LAYERS, N_HEADS, D_FF, SEQ, BATCH = 48, 2, 4, 96, 64, 8
MODEL_SEED = 1234


def build_model(vocab):
    """A 2-layer pre-norm character GPT: fused qkv [144, 48], out proj [48, 48], MLP up
    [96, 48] (tall) and down [48, 96] (wide); q, k and v are 4 heads of 12 rows each."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(D_MODEL)
            self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL, bias=False)
            self.proj = nn.Linear(D_MODEL, D_MODEL, bias=False)
            self.ln2 = nn.LayerNorm(D_MODEL)
            self.up = nn.Linear(D_MODEL, D_FF, bias=False)
            self.down = nn.Linear(D_FF, D_MODEL, bias=False)

        def forward(self, x):
            b, s, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(D_MODEL, dim=-1)
            hd = d // N_HEADS
            q = q.view(b, s, N_HEADS, hd).transpose(1, 2)
            k = k.view(b, s, N_HEADS, hd).transpose(1, 2)
            v = v.view(b, s, N_HEADS, hd).transpose(1, 2)
            att = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
            mask = torch.ones(s, s, dtype=torch.bool).tril()
            att = att.masked_fill(~mask, float("-inf")).softmax(-1)
            y = (att @ v).transpose(1, 2).reshape(b, s, d)
            x = x + self.proj(y)
            return x + self.down(F.gelu(self.up(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(vocab, D_MODEL)
            self.pos = nn.Parameter(torch.randn(SEQ, D_MODEL) * 0.02)
            self.blocks = nn.ModuleList(Block() for _ in range(N_LAYERS))
            self.ln = nn.LayerNorm(D_MODEL)
            self.head = nn.Linear(D_MODEL, vocab, bias=False)

        def forward(self, idx):
            x = self.emb(idx) + self.pos[: idx.shape[1]]
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.ln(x))

    torch.manual_seed(MODEL_SEED)
    return GPT()


def corpus_batches(steps, seed):
    text = open(CORPUS, encoding="utf-8").read()
    chars = sorted(set(text))
    ids = np.array([chars.index(c) for c in text], dtype=np.int64)
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        starts = rng.integers(0, len(ids) - SEQ - 1, size=BATCH)
        x = np.stack([ids[s:s + SEQ] for s in starts])
        y = np.stack([ids[s + 1:s + SEQ + 1] for s in starts])
        out.append((x, y))
    return len(chars), out


# Case name -> (which matrices of the model, group options). Each case trains only its own
# matrices (the rest of the model stays at its initialisation).
def gpt_groups():
    """Case name -> (matrices, group options) for the current model size."""
    d, layers = D_MODEL, N_LAYERS
    return {
        # Several same-shape matrices per group (megabatching): 2x up (tall), 2x down (wide),
        # 2x out proj (square).
        "mlp": (["blocks.0.up", "blocks.1.up", "blocks.0.down", "blocks.1.down",
                 "blocks.0.proj", "blocks.1.proj"], {}),
        # The attention input projections, with the tiny q/k gradients at initialisation,
        # orthogonalised per head (12 heads of d/4 x d per fused qkv).
        "qkv-heads": (["blocks.0.qkv", "blocks.1.qkv"], {"num_heads": 12}),
        # The same fused qkv as three d x d row blocks (split_sizes; Muon and NorMuon only).
        "qkv-split": (["blocks.0.qkv", "blocks.1.qkv"], {"split_sizes": (d, d, d)}),
        # Every attention matrix of every layer in one group (not in the committed set).
        "attn-all": ([f"blocks.{i}.{n}" for i in range(layers) for n in ("qkv", "proj")], {}),
    }


GPT_ALGORITHMS = {
    "muon": ["mlp", "qkv-heads", "qkv-split"],
    "normuon": ["mlp", "qkv-heads", "qkv-split"],
    "dion2": ["mlp", "qkv-heads"],
    "nordion2": ["mlp", "qkv-heads"],
}
GPT_T = 3
GPT_LR = {"muon": 0.02, "normuon": 0.02, "dion2": 0.02, "nordion2": 0.02}


def gpt_case(dion, algorithm, group, steps=GPT_T, data_seed=7):
    """Trains the group's matrices of the model with the reference class for `steps` steps and
    returns (Case with the recorded real gradients, names, the stored trajectory, finals)."""
    import torch
    import torch.nn.functional as F
    names, options = gpt_groups()[group]
    vocab, batches = corpus_batches(steps, data_seed)
    model = build_model(vocab)
    named = dict(model.named_parameters())
    for p in model.parameters():
        p.requires_grad_(False)
    params = [named[n + ".weight"] for n in names]
    for p in params:
        p.requires_grad_(True)
    cls = reference_run.optimizer_class(dion, algorithm)
    import torch2_compat
    torch.manual_seed(data_seed)
    opt = cls([dict(params=params, **options)], lr=GPT_LR[algorithm])
    init = [p.detach().numpy().copy() for p in params]
    grads, traj = [], []
    for x, y in batches:
        for p in params:
            p.grad = None
        logits = model(torch.tensor(x))
        loss = F.cross_entropy(logits.reshape(-1, vocab), torch.tensor(y).reshape(-1))
        loss.backward()
        grads.append([p.grad.detach().numpy().copy() for p in params])
        with torch2_compat.Torch2Rounding():
            opt.step()
        traj.append([p.detach().numpy().copy() for p in params])
    finals = [{k: v.detach().numpy().copy() for k, v in opt.state[p].items()
               if isinstance(v, torch.Tensor)} for p in params]
    case = Case(algorithm, {"lr": GPT_LR[algorithm]}, options, init, grads, seed=data_seed)
    return case, names, traj, finals


def write_gpt_case(dion, algorithm, group, out_dir):
    import torch
    case, names, traj, finals = gpt_case(dion, algorithm, group)
    # The replay through the class on the recorded gradients must give the training run.
    base, base_finals = case.run(dion)
    assert all(np.array_equal(a, b) for ta, tb in zip(base, traj) for a, b in zip(ta, tb)), \
        "replay differs from the training run"
    spread = case.spread(dion, base)
    tol = tolerance_from(spread)
    exact = f64_run(case, dion)
    fp32_prog, _ = case.run(dion, rounding=dict(promote=torch.float32))
    T = len(case.grads)
    f64_tol = max(10 * max(relf(a, b) for a, b in zip(fp32_prog[-1], exact[-1])), 1e-6)
    f64_delta_tol = max(10 * max(relf(a - p0, b - p0) for a, b, p0 in
                                 zip(fp32_prog[-1], exact[-1], case.params)), 1e-5)
    traj_tol = max(10 * max(relf(a, b) for a, b in zip(base[-1], exact[-1])), 1e-6)
    state_names = sorted(base_finals[0].keys())
    exact_finals = case.run(dion, rounding=dict(promote=torch.float64), dtype=torch.float64)[1]
    state_tol = {n: max(10 * max(relf(f[n], e[n]) for f, e in zip(base_finals, exact_finals)),
                        1e-6) for n in state_names}
    tensors = {}
    for i in range(len(case.params)):
        pre = "" if i == 0 else f"p{i}."
        tensors[pre + "param.init"] = case.params[i]
        for s in range(1, T + 1):
            tensors[pre + f"grad.{s}"] = case.grads[s - 1][i]
            tensors[pre + f"param.{s}"] = base[s - 1][i]
        for n in state_names:  # state.<n>.init is absent: zeros
            tensors[pre + f"state.{n}.final"] = base_finals[i][n]
        tensors[pre + f"param_f64.{T}"] = exact[-1][i].astype(np.float32)
    cls_mod, cls_name = reference_run.CLASSES[algorithm]
    hp = {"lr": GPT_LR[algorithm]}
    name = f"{algorithm}-gpt-{group}"
    shapes = [list(p.shape) for p in case.params]
    md = {
        "format_version": "1",
        "algorithm": algorithm,
        "case": f"gpt-{group}",
        "variant": f"gpt-{group}",
        "variant_description": (f"real gradients of a 2-layer character GPT ({CORPUS}); "
                                f"matrices {names}"),
        "class": f"dion.{cls_mod}.{cls_name}",
        "class_file": f"dion/{cls_mod}.py",
        "hyperparameters": json.dumps(hp),
        "constructor_kwargs": json.dumps(hp),
        "param_group_options": json.dumps({k: (list(v) if isinstance(v, tuple) else v)
                                           for k, v in case.group_options.items()}),
        "T": str(T),
        "shape": json.dumps(shapes[0]),
        "num_params": str(len(shapes)),
        "param_shapes": json.dumps(shapes),
        "param_names": json.dumps(names),
        "upstream_commit": UPSTREAM_COMMIT,
        "ns_dtype": "bfloat16",
        "param_dtype": "float32",
        "seed": str(case.seed),
        "inputs": (f"model: tests/conformance/tools/make_vectors.py build_model, torch seed "
                   f"{MODEL_SEED}; batches of {BATCH}x{SEQ} characters of {CORPUS} drawn with "
                   f"numpy.random.default_rng({case.seed}); grad.t = the gradient of the "
                   f"cross-entropy at the parameters after step t-1 of this reference run"),
        "state_names": json.dumps(state_names),
        "reference_runtime": RUNTIME,
        "tolerance_param_relfro": repr(float("%.3g" % traj_tol)),
        "tolerance_param_f64_final_relfro": repr(float("%.3g" % f64_tol)),
        "tolerance_delta_f64_final_relfro": repr(float("%.3g" % f64_delta_tol)),
        "tolerance_states_final_relfro": json.dumps(
            {n: float("%.3g" % v) for n, v in state_tol.items()}),
        "tolerance_bf16_reference_delta_relfro": repr(tol),
        "bf16_reference_spread": json.dumps({k: float("%.3g" % v) for k, v in spread.items()},
                                            sort_keys=True),
    }
    path = os.path.join(out_dir, name + ".safetensors")
    vectors_io.write(path, tensors, md)
    print(f"{name}: {len(shapes)} matrices {shapes}; spread {spread}; tolerance {tol}",
          flush=True)
    return {
        "file": name + ".safetensors", "algorithm": algorithm, "case": f"gpt-{group}",
        "class": md["class"], "shape": shapes[0], "param_shapes": shapes,
        "param_names": names, "T": T, "seed": case.seed,
        "hyperparameters": hp, "param_group_options": json.loads(md["param_group_options"]),
        "ns_dtype": "bfloat16",
        "tolerance": {
            "param_relfro": float(md["tolerance_param_relfro"]),
            "param_f64_final_relfro": float(md["tolerance_param_f64_final_relfro"]),
            "delta_f64_final_relfro": float(md["tolerance_delta_f64_final_relfro"]),
            "states_final_relfro": json.loads(md["tolerance_states_final_relfro"]),
            "bf16_reference_delta_relfro": tol,
        },
        "measured": {"bf16_reference_spread": json.loads(md["bf16_reference_spread"])},
    }


UPSTREAM_COMMIT = "0a059a4542e5aa74b40dcd1dce363836c7afcd48"


def main():
    global D_MODEL, D_FF, N_LAYERS
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dion", required=True, help="microsoft/dion checkout (a directory)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("refresh")
    r.add_argument("files", nargs="+")
    r.add_argument("--manifest", help="manifest.json to update (tolerance and spread)")
    g = sub.add_parser("gpt")
    g.add_argument("--out", required=True)
    g.add_argument("--manifest", help="manifest.json to add the cases to")
    g.add_argument("--only", nargs="*", help="case names (e.g. muon-gpt-mlp)")
    g.add_argument("--d-model", type=int, default=D_MODEL,
                   help="model width (the committed set: 48; a multiple of 4)")
    g.add_argument("--d-ff", type=int, default=D_FF, help="MLP width (committed: 96)")
    g.add_argument("--layers", type=int, default=N_LAYERS, help="layers (committed: 2; >= 2)")
    g.add_argument("--attn-all", action="store_true",
                   help="also the attn-all case (every qkv and proj in one group)")
    args = ap.parse_args()
    if args.cmd == "refresh":
        refresh(args.dion, args.files, args.manifest)
        return 0
    D_MODEL, D_FF, N_LAYERS = args.d_model, args.d_ff, args.layers
    entries = []
    for algorithm, groups in GPT_ALGORITHMS.items():
        for group in groups + (["attn-all"] if args.attn_all else []):
            if args.only and f"{algorithm}-gpt-{group}" not in args.only:
                continue
            entries.append(write_gpt_case(args.dion, algorithm, group, args.out))
    if args.manifest:
        manifest = {"format_version": "1", "set": "gpt", "upstream_repository": "microsoft/dion",
                    "upstream_commit": UPSTREAM_COMMIT, "cases": []}
        if os.path.exists(args.manifest):
            with open(args.manifest) as f:
                manifest = json.load(f)
        files = {e["file"] for e in entries}
        manifest["cases"] = [c for c in manifest["cases"] if c["file"] not in files] + entries
        for c in manifest["cases"]:
            c["bytes"] = os.path.getsize(os.path.join(args.out, c["file"]))
        manifest["total_bytes"] = sum(c["bytes"] for c in manifest["cases"])
        with open(args.manifest, "w") as f:
            json.dump(manifest, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
