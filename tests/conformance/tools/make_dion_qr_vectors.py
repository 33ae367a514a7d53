#!/usr/bin/env python3
"""Generates the Dion qr_method conformance vectors (tests/conformance/vectors/dion_reference-*qr*).

Runs the class dion.dion_reference.Dion of an unmodified microsoft/dion checkout (the commit in
tests/conformance/manifest.json) on PyTorch's CPU build, single process, float32 parameters, and
writes one safetensors file per case in the format of tests/conformance/README.md, plus the
manifest entries (printed as JSON, or merged with --manifest).

    /usr/bin/python3 tests/conformance/tools/make_dion_qr_vectors.py \
        --upstream /path/to/microsoft-dion-checkout --out tests/conformance/vectors \
        --manifest tests/conformance/manifest.json

Only the upstream package's own files are imported (dion/dion_reference.py and the two helper
modules it imports); nothing of it is copied here. The small compatibility layer below lets
that code import and run on PyTorch 1.13 (Debian's build); the calls it provides are the ones
the conformance README lists in its section 5, restricted to what dion_reference needs:
torch.compile (identity), torch.distributed.tensor and _functional_collectives (placeholders,
never used: no DTensor exists and no mesh is given) and torch.optim.optimizer.ParamsT.

Cases (T = 6; each file's metadata `qr_path` records the branch every step took, read from the
reference's cholesky_ex results):
  dion_reference-qr-64x48, -qr-48x80       qr_method="qr": Householder QR, tall and wide
  dion_reference-cqr-warm3-64x48           "cqr", cqr_warmup_steps=3: rcqr at steps 1-3, cqr after
  dion_reference-cqr-warm2-rank0.25-48x80  "cqr", warm-up 2, r = 12, wide
  dion_reference-cqr-fallback-64x48        "cqr", warm-up 0, ill-conditioned state.Q.init: the
                                           float32 Cholesky of P^T P fails at step 1 -> rcqr
  dion_reference-cqr-illcond-64x48         "cqr", warm-up 0, ill-conditioned gradients: Cholesky
                                           fails at steps 1-2 -> rcqr (loose tolerances: rounding
                                           dominates the weak directions of P)
dion.dion.Dion itself accepts only qr_method="rcqr" (ValueError otherwise), so every qr/cqr case
uses dion.dion_reference.Dion.

Besides the stored run the script makes the two comparison runs of the README's tolerance rule,
replaying the stored run's random sketches: float64 parameters/gradients/state with the code's
float32 casts unchanged, and every float32 cast promoted to float64 ("exact"). Dion has no bf16
cast, so the "float32 program" is the stored run itself.
"""
import argparse
import importlib
import json
import math
import os
import struct
import sys
import types

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

UPSTREAM_COMMIT = "0a059a4542e5aa74b40dcd1dce363836c7afcd48"


# ---- compatibility layer (PyTorch 1.13) --------------------------------------------------------
def install_compat():
    if not hasattr(torch, "compile"):
        def compile_(fn=None, **_kw):
            if fn is None:
                return lambda f: f
            return fn
        torch.compile = compile_
    optmod = importlib.import_module("torch.optim.optimizer")
    if not hasattr(optmod, "ParamsT"):
        optmod.ParamsT = object
    try:
        importlib.import_module("torch.distributed.tensor")  # PyTorch >= 2.5 has it
    except ImportError:
        mod = types.ModuleType("torch.distributed.tensor")

        class _Never:  # isinstance(x, DTensor) is always False
            def __init__(self, *a, **k):
                raise RuntimeError("DTensor is not available in this compatibility layer")

        for name in ("DTensor", "DeviceMesh", "Placement", "Replicate", "Shard"):
            setattr(mod, name, type(name, (_Never,), {}))
        mod.randn = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no DTensor randn"))
        pt = types.ModuleType("torch.distributed.tensor.placement_types")
        mod.placement_types = pt
        sys.modules["torch.distributed.tensor"] = mod
        sys.modules["torch.distributed.tensor.placement_types"] = pt
    try:
        importlib.import_module("torch.distributed._functional_collectives")
    except ImportError:
        fc = types.ModuleType("torch.distributed._functional_collectives")
        sys.modules["torch.distributed._functional_collectives"] = fc


# ---- function mode: record/replay the sketches, promote float32 casts, log the QR branch -------
class Mode(TorchFunctionMode):
    def __init__(self, promote=False, replay=None):
        super().__init__()
        self.promote = promote      # every cast to float32 becomes a cast to float64
        self.replay = replay        # list of recorded sketches to hand out, or None to record
        self.sketches = []
        self.cholesky = []          # info of every cholesky_ex call, in order

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if self.promote and func in (torch.Tensor.to,):
            if kwargs.get("dtype") is torch.float32:
                kwargs["dtype"] = torch.float64
            args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        if func is torch.Tensor.normal_:
            t = args[0]
            if self.replay is not None:
                src = self.replay.pop(0)
                with torch.no_grad():
                    t.copy_(src.to(t.dtype))
                return t
            out = func(*args, **kwargs)
            self.sketches.append(out.detach().clone())
            return out
        out = func(*args, **kwargs)
        if func is torch.linalg.cholesky_ex:
            self.cholesky.append(int(out[1]))
        return out


# ---- safetensors writer -------------------------------------------------------------------------
def write_safetensors(path, tensors, metadata):
    header = {"__metadata__": metadata}
    blobs, off = [], 0
    for name, arr in tensors:
        a = np.ascontiguousarray(arr, dtype="<f4")
        b = a.tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
    return 8 + len(h) + off


def relf(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    d = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / d) if d else float(np.linalg.norm(a - b))


def align_cols(mine, ref):
    mine = np.array(mine, np.float64)
    for c in range(mine.shape[1]):
        if np.dot(mine[:, c], ref[:, c]) < 0:
            mine[:, c] = -mine[:, c]
    return mine


def sig(x):
    return float("%.3g" % x)


# ---- cases ------------------------------------------------------------------------------------
def ill_conditioned(rng, rows, cols, t, decades):
    """U diag(s) V^T with fixed (per case) singular vectors and singular values spread over
    `decades` decades, so that P = B Q inherits a condition number near 10**decades."""
    k = min(rows, cols)
    base = np.random.default_rng([rng, 0, 1])
    u, _ = np.linalg.qr(base.standard_normal((rows, k)))
    v, _ = np.linalg.qr(base.standard_normal((cols, k)))
    s = np.logspace(0, -decades, k) * (1 + 0.1 * np.random.default_rng([rng, t, 1]).random(k))
    return (u * s) @ v.T


CASES = [
    dict(case="qr-64x48", variant="qr", shape=(64, 48), seed=101,
         kwargs=dict(lr=0.02, qr_method="qr"),
         desc="qr_method='qr': Householder QR (torch.linalg.qr) of P at every step; tall"),
    dict(case="qr-48x80", variant="qr", shape=(48, 80), seed=102,
         kwargs=dict(lr=0.02, qr_method="qr"),
         desc="qr_method='qr': Householder QR of P at every step; wide (transposed: P = M^T Q)"),
    dict(case="cqr-warm3-64x48", variant="cqr-warm3", shape=(64, 48), seed=103,
         kwargs=dict(lr=0.02, qr_method="cqr", cqr_warmup_steps=3),
         desc="qr_method='cqr', cqr_warmup_steps=3: randomized Cholesky QR at steps 1-3, "
              "Cholesky QR from step 4"),
    dict(case="cqr-warm2-rank0.25-48x80", variant="cqr-warm2-rank0.25", shape=(48, 80), seed=104,
         kwargs=dict(lr=0.02, qr_method="cqr", cqr_warmup_steps=2, rank_fraction=0.25),
         desc="qr_method='cqr', cqr_warmup_steps=2, rank_fraction=0.25 (r = 12) on a wide "
              "matrix: randomized Cholesky QR at steps 1-2, Cholesky QR from step 3"),
    dict(case="cqr-fallback-64x48", variant="cqr-fallback", shape=(64, 48), seed=105,
         kwargs=dict(lr=0.02, qr_method="cqr", cqr_warmup_steps=0), q0_decades=4.5,
         desc="qr_method='cqr', cqr_warmup_steps=0, with an ill-conditioned initial Q "
              "(singular values over 4.5 decades, stored as state.Q.init): at step 1 P = M Q "
              "is so ill-conditioned that the float32 Cholesky factorisation of P^T P fails "
              "and the reference falls back to randomized Cholesky QR; from step 2 Q is the "
              "column-normalized R and Cholesky QR succeeds (see qr_path)"),
    dict(case="cqr-illcond-64x48", variant="cqr-illcond", shape=(64, 48), seed=106,
         kwargs=dict(lr=0.02, qr_method="cqr", cqr_warmup_steps=0), decades=3.5,
         desc="qr_method='cqr', cqr_warmup_steps=0 on ill-conditioned gradients (singular "
              "values over 3.5 decades, shared singular vectors): P is so ill-conditioned that "
              "the float32 Cholesky factorisation of P^T P fails at some steps and the "
              "reference falls back to randomized Cholesky QR (see qr_path); the tolerances "
              "are loose because the weak directions of P are dominated by rounding"),
]


def make_inputs(c, T):
    m, n = c["shape"]
    p0 = 0.1 * np.random.default_rng([c["seed"], 0]).standard_normal((m, n))
    grads = []
    for t in range(1, T + 1):
        if "decades" in c:
            grads.append(ill_conditioned(c["seed"], m, n, t, c["decades"]))
        else:
            grads.append(c.get("grad_scale", 1.0) *
                         np.random.default_rng([c["seed"], t]).standard_normal((m, n)))
    return p0.astype(np.float32), [g.astype(np.float32) for g in grads]


def run(DionRef, c, p0, grads, dtype, q0=None, mode=None):
    torch.manual_seed(c["seed"])
    x = torch.nn.Parameter(torch.tensor(p0, dtype=dtype))
    opt = DionRef([x], **c["kwargs"])
    traj, q_init = [], None
    for t, g in enumerate(grads, 1):
        x.grad = torch.tensor(g, dtype=dtype)
        if t == 1:
            # The optimizer draws Q at its first step; inject the stored run's Q before it.
            st = opt.state[x]
            opt._init_opt_state_dion(x, st, opt.param_groups[0]["rank_fraction"],
                                     opt.param_groups[0]["rank_multiple_of"])
            if q0 is None and "q0_decades" in c:
                q0 = ill_conditioned(c["seed"], st["Q"].shape[0], st["Q"].shape[1], 0,
                                     c["q0_decades"]) * math.sqrt(st["Q"].shape[0])
                q0 = q0.astype(np.float32)
            if q0 is not None:
                st["Q"] = torch.tensor(q0, dtype=dtype)
            q_init = st["Q"].detach().double().numpy().copy()
        if mode is not None:
            with mode:
                opt.step()
        else:
            opt.step()
        traj.append(x.detach().double().numpy().copy())
    st = opt.state[x]
    final = {"Q": st["Q"].detach().double().numpy(), "momentum": st["momentum"].detach().double().numpy()}
    hp = dict(opt.defaults)
    return traj, q_init, final, opt


def qr_path(kwargs, cholesky_infos, T):
    """Which orthonormalisation each step ran (from the stored run's cholesky_ex calls)."""
    method = kwargs.get("qr_method", "rcqr")
    warm = kwargs.get("cqr_warmup_steps", 150)
    infos = list(cholesky_infos)
    out = {}
    for t in range(1, T + 1):
        if method == "qr":
            out[str(t)] = "qr"
        elif method == "cqr" and t > warm:
            info = infos.pop(0)
            if info == 0:
                out[str(t)] = "cqr"
            else:
                infos.pop(0)  # the fallback's own Cholesky of Q^T Q
                out[str(t)] = "cqr failed (info %d) -> rcqr" % info
        else:
            infos.pop(0)
            out[str(t)] = "rcqr (warm-up)" if method == "cqr" else "rcqr"
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--upstream", required=True, help="microsoft/dion checkout (the repo root)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--manifest", help="manifest.json to merge the entries into")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--only", nargs="*")
    a = ap.parse_args()
    torch.set_num_threads(1)
    install_compat()
    sys.path.insert(0, a.upstream)
    DionRef = importlib.import_module("dion.dion_reference").Dion
    T = a.steps
    entries = []
    for c in CASES:
        if a.only and c["case"] not in a.only:
            continue
        p0, grads = make_inputs(c, T)
        rec = Mode()
        traj, q0, final, opt = run(DionRef, c, p0, grads, torch.float32, mode=rec)
        path = qr_path(c["kwargs"], rec.cholesky, T)
        sketches = rec.sketches
        # Comparison runs, replaying the sketches.
        torch.set_default_dtype(torch.float64)
        try:
            t64, _, f64p_final, _ = run(DionRef, c, p0, grads, torch.float64, q0=q0,
                                        mode=Mode(replay=list(sketches)))
            tex, _, ex_final, _ = run(DionRef, c, p0, grads, torch.float64, q0=q0,
                                      mode=Mode(promote=True, replay=list(sketches)))
        finally:
            torch.set_default_dtype(torch.float32)
        p0d = p0.astype(np.float64)
        pr = [max(relf(s, f), relf(s, e)) for s, f, e in zip(traj, t64, tex)]
        dr = [max(relf(s - p0d, f - p0d), relf(s - p0d, e - p0d)) for s, f, e in zip(traj, t64, tex)]
        prog = [relf(s, e) for s, e in zip(traj, tex)]
        dprog = [relf(s - p0d, e - p0d) for s, e in zip(traj, tex)]
        st_q = relf(align_cols(final["Q"], ex_final["Q"]), ex_final["Q"])
        st_m = relf(final["momentum"], ex_final["momentum"])
        tol = {
            "param_relfro": sig(max(10 * max(pr), 1e-6)),
            "delta_relfro": sig(max(10 * max(dr), 1e-6)),
            "param_f64_final_relfro": sig(max(10 * max(prog), 1e-6)),
            "delta_f64_final_relfro": sig(max(10 * max(dprog), 1e-6)),
            "states_final_relfro": {"Q": sig(max(10 * st_q, 1e-6)),
                                    "momentum": sig(max(10 * st_m, 1e-6))},
        }
        hp = {"lr": 0.01, "mu": 0.95, "betas": [0.9, 0.95], "weight_decay": 0.01,
              "epsilon": 1e-8, "rank_fraction": 1.0, "rank_multiple_of": 1, "power_iters": 1,
              "qr_method": "rcqr", "cqr_warmup_steps": 150, "rcqr_oversample": 1.25}
        hp.update(c["kwargs"])
        name = "dion_reference-%s" % c["case"]
        m, n = c["shape"]
        tensors = [("param.init", p0)]
        for t in range(1, T + 1):
            tensors.append(("grad.%d" % t, grads[t - 1]))
            tensors.append(("param.%d" % t, traj[t - 1]))
        tensors += [("state.Q.init", q0), ("state.momentum.init", np.zeros((m, n))),
                    ("state.Q.final", final["Q"]), ("state.momentum.final", final["momentum"]),
                    ("param_f64.%d" % T, tex[-1])]
        if "decades" in c:
            inputs = ("param.init = 0.1 * N(0,1) from numpy.random.default_rng([seed, 0]); grad.t "
                      "= U diag(s_t) V^T, U, V orthonormal from default_rng([seed, 0, 1]), s_t = "
                      "logspace(0, -%g, min(m,n)) * (1 + 0.1 * uniform from default_rng([seed, t, 1])); "
                      "cast to float32" % c["decades"])
        else:
            inputs = ("param.init = 0.1 * N(0,1) from numpy.random.default_rng([seed, 0]); grad.t = "
                      "%g * N(0,1) from numpy.random.default_rng([seed, t]); cast to float32"
                      % c.get("grad_scale", 1.0))
        if "q0_decades" in c:
            inputs += ("; state.Q.init = sqrt(rows of Q) * U diag(s) V^T, U, V orthonormal from "
                       "default_rng([seed, 0, 1]), s = logspace(0, -%g, r) * (1 + 0.1 * uniform "
                       "from default_rng([seed, 0, 1])), set before step 1 instead of the "
                       "optimizer's randn draw" % c["q0_decades"])
        md = {
            "format_version": "1", "algorithm": "dion_reference", "case": c["case"],
            "variant": c["variant"], "variant_description": c["desc"],
            "class": "dion.dion_reference.Dion", "class_file": "dion/dion_reference.py",
            "code_files": json.dumps(["dion/dion_reference.py"]),
            "hyperparameters": json.dumps(hp, sort_keys=True),
            "constructor_kwargs": json.dumps(c["kwargs"], sort_keys=True),
            "param_group_options": "{}", "T": str(T), "shape": json.dumps([m, n]),
            "upstream_commit": UPSTREAM_COMMIT,
            "ortho_dtype": "float32 (hard-coded upstream: QR / Cholesky / triangular solves in "
                           "float32; the other matmuls in the parameter dtype, float32 here)",
            "ns_dtype": "float32", "param_dtype": "float32", "seed": str(c["seed"]),
            "inputs": inputs,
            "torch_seed": "torch.manual_seed(seed) before constructing the optimizer",
            "state_names": json.dumps(["Q", "momentum"]),
            "random_draws": json.dumps({"state_init": ["randn"] if "q0_decades" not in c else [],
                                        "per_step_sketch_steps": [int(k) for k, v in path.items()
                                                                  if "rcqr" in v],
                                        "sketch_stored": False}),
            "qr_path": json.dumps(path),
            "tolerance_param_relfro": str(tol["param_relfro"]),
            "tolerance_delta_relfro": str(tol["delta_relfro"]),
            "tolerance_param_f64_final_relfro": str(tol["param_f64_final_relfro"]),
            "reference_runtime": "PyTorch %s CPU, 1 thread, eager (torch.compile stubbed), "
                                 "tests/conformance/tools/make_dion_qr_vectors.py" % torch.__version__,
        }
        os.makedirs(a.out, exist_ok=True)
        nbytes = write_safetensors(os.path.join(a.out, name + ".safetensors"), tensors, md)
        entries.append({
            "T": T, "algorithm": "dion_reference", "bytes": nbytes, "case": c["case"],
            "class": "dion.dion_reference.Dion", "class_file": "dion/dion_reference.py",
            "description": c["desc"], "file": name + ".safetensors",
            "hyperparameters": hp,
            "measured": {
                "param_relfro_golden_vs_f64_params": [sig(relf(s, f)) for s, f in zip(traj, t64)],
                "param_relfro_golden_vs_exact_f64": [sig(relf(s, e)) for s, e in zip(traj, tex)],
                "delta_relfro_golden_vs_f64_params": [sig(relf(s - p0d, f - p0d)) for s, f in zip(traj, t64)],
                "delta_relfro_golden_vs_exact_f64": [sig(x) for x in dprog],
                "states_final_relfro_golden_vs_exact_f64": {"Q": sig(st_q), "momentum": sig(st_m)},
            },
            "notes": "state.Q.final is defined only up to the sign of each column; compare it "
                     "column-sign-insensitively. qr_path: " + json.dumps(path),
            "ns_dtype": "float32", "param_group_options": {}, "seed": c["seed"],
            "shape": [m, n], "tensors": [t[0] for t in tensors], "tolerance": tol,
            "variant": c["variant"],
        })
        print("%-40s path=%s tol=%s" % (name, json.dumps(path), json.dumps(tol)), file=sys.stderr)
    if a.manifest:
        with open(a.manifest) as f:
            man = json.load(f)
        # Entries of the other generators keep their place; ours are replaced or appended.
        mine = {e["file"]: e for e in entries}
        cases = [mine.pop(e["file"], e) for e in man["cases"]]
        cases += [e for e in entries if e["file"] in mine]
        man["cases"] = cases
        man["total_bytes"] = sum(e["bytes"] for e in man["cases"])
        with open(a.manifest, "w") as f:
            json.dump(man, f, indent=1)
            f.write("\n")
    else:
        json.dump(entries, sys.stdout, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
