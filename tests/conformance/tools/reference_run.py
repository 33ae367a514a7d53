"""Runs a microsoft/dion optimizer class on given inputs (a compatibility-layer harness).

Written for this project. Used by make_vectors.py (new vectors, spread measurement) and by
`python3 reference_run.py --dion CHECKOUT --replay FILE...`, which feeds a committed vector
file's inputs to the upstream class and reports whether every stored parameter and final
state is reproduced bit for bit (the check that validates torch2_compat.py).
"""

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch2_compat  # noqa: E402
import vectors_io  # noqa: E402

CLASSES = {
    "muon": ("muon", "Muon"),
    "normuon": ("normuon", "NorMuon"),
    "dion2": ("dion2", "Dion2"),
    "nordion2": ("nordion2", "NorDion2"),
    "dion": ("dion", "Dion"),
    "dion_reference": ("dion_reference", "Dion"),
}


def optimizer_class(dion_checkout, algorithm):
    torch2_compat.load_dion(dion_checkout)
    import importlib
    mod_name, cls_name = CLASSES[algorithm]
    return getattr(importlib.import_module("dion." + mod_name), cls_name)


def run(dion_checkout, algorithm, kwargs, group_options, params_init, grads, state_init=None,
        rounding=None, per_param_groups=False, dtype=None):
    """Runs len(grads) steps on a list of parameters, all in one parameter group (one shape
    group, megabatched) unless per_param_groups (each parameter in its own group, so each is
    orthogonalized alone).

    params_init: list of arrays; grads: list over steps of lists over params;
    state_init: list over params of dict name -> array (loaded before step 1; Dion's Q).
    Returns (params after each step: list over steps of lists of arrays, final states).
    """
    import torch
    cls = optimizer_class(dion_checkout, algorithm)
    dtype = dtype or torch.float32
    ps = [torch.nn.Parameter(torch.tensor(np.asarray(p), dtype=dtype)) for p in params_init]
    if per_param_groups:
        groups = [dict(params=[p], **group_options) for p in ps]
    else:
        groups = [dict(params=ps, **group_options)]
    opt = cls(groups, **kwargs)
    rounding = rounding or {}
    if state_init:
        # Initialise the state the way the class does (first step would), then overwrite.
        _init_state(opt, ps, rounding)
        for p, st in zip(ps, state_init):
            for name, arr in st.items():
                if name not in opt.state[p]:
                    continue  # lazily created; reproduced by the seed (Dion's Q)
                opt.state[p][name].copy_(torch.tensor(np.asarray(arr), dtype=dtype))
    out = []
    for step_grads in grads:
        for p, g in zip(ps, step_grads):
            p.grad = torch.tensor(np.asarray(g), dtype=dtype)
        with torch2_compat.Torch2Rounding(**rounding):
            opt.step()
        out.append([p.detach().to(torch.float32).numpy().copy() for p in ps])
    finals = [{k: v.detach().to(torch.float32).numpy().copy()
               for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)} for p in ps]
    return out, finals


def _init_state(opt, ps, rounding):
    import torch
    if all(len(opt.state[p]) for p in ps):
        return
    # A step with zero gradients and lr 0 would change Q; use the class's own initialiser.
    for group in opt.param_groups:
        for p in group["params"]:
            if hasattr(opt, "_get_or_initialize_state"):
                try:
                    opt._get_or_initialize_state(p, group["algorithm"])
                except TypeError:
                    opt._get_or_initialize_state(p, group)


def replay(dion_checkout, path, rounding=None):
    t, md = vectors_io.read(path)
    algorithm = md["algorithm"]
    if algorithm not in CLASSES:
        return None, f"{algorithm}: not replayed"
    T = int(md["T"])
    n = int(md.get("num_params", "1"))
    pre = ["" if i == 0 else f"p{i}." for i in range(n)]
    kwargs = json.loads(md["constructor_kwargs"])
    opts = json.loads(md["param_group_options"])
    opts = {k: (tuple(v) if isinstance(v, list) else v) for k, v in opts.items()}
    state_names = json.loads(md["state_names"])
    state_init = [{s: t[q + f"state.{s}.init"] for s in state_names
                   if q + f"state.{s}.init" in t} for q in pre]
    import torch
    torch.manual_seed(int(md["seed"]))
    params, finals = run(dion_checkout, algorithm, kwargs, opts, [t[q + "param.init"] for q in pre],
                         [[t[q + f"grad.{s}"] for q in pre] for s in range(1, T + 1)],
                         state_init if any(state_init) else None, rounding=rounding)
    worst = []
    exact = True
    for s in range(1, T + 1):
        for i, q in enumerate(pre):
            a, b, p0 = params[s - 1][i], t[q + f"param.{s}"], t[q + "param.init"]
            d = float(np.linalg.norm((a - b).astype(np.float64)) /
                      max(np.linalg.norm((b - p0).astype(np.float64)), 1e-30))
            worst.append(d)
            exact &= bool(np.array_equal(a.view(np.uint32), b.view(np.uint32)))
    for i, q in enumerate(pre):
        for s in state_names:
            if s == "Q":
                continue
            exact &= bool(np.array_equal(finals[i][s], t[q + f"state.{s}.final"]))
    return exact, "max_t delta relF %.3g" % max(worst)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dion", required=True, help="microsoft/dion checkout (a directory)")
    ap.add_argument("--replay", nargs="+", required=True, help="vector files")
    ap.add_argument("--torch113-norm", action="store_true",
                    help="keep 1.13's bf16 norm rounding (how the first public vectors were made)")
    args = ap.parse_args()
    bad = 0
    for path in args.replay:
        exact, msg = replay(args.dion, path, dict(torch2_norm=not args.torch113_norm))
        tag = "skip" if exact is None else ("bit-exact" if exact else "DIFFERS")
        bad += exact is False
        print(f"{os.path.basename(path)}: {tag} ({msg})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
