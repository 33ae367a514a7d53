"""Adds the spread of a *real* PyTorch 2.x run to the bf16 vectors' tolerances.

Written for this project. make_vectors.py makes the bf16 trajectories on Debian's PyTorch 1.13
through torch2_compat.py, which emulates 2.x's eager bf16 rounding with 1.13's own float32 GEMM.
A genuine PyTorch 2.x build computes its bf16 matmuls with its own kernels (oneDNN on CPU), in
another float32 accumulation order; on ill-conditioned real gradients a single near-tie can then
round the other way and move the update by a per cent or more. That is the reference's own
rounding spread too, so a tolerance that a real 2.x run of the reference fails is too tight.

This script must run under a PyTorch >= 2 interpreter (e.g. a venv made by
scripts/test-torch2.sh). For every bf16 vector file it runs the microsoft/dion class natively
(eager: torch.compile is replaced by the identity, nothing else is patched), 1 and 2 threads,
on the file's inputs, measures relF(delta_run, delta_stored) over steps and matrices, stores it
as `torch2_native` / `torch2_native_threads2` in `bf16_reference_spread` and recomputes
tolerance_bf16_reference_delta_relfro = max(MARGIN x max spread, FLOOR) with make_vectors.py's
MARGIN and FLOOR, in the file and in the manifest.

  PY2=/path/to/venv/bin/python
  $PY2 tests/conformance/tools/torch2_native_spread.py --dion DION \
      --manifest tests/conformance/manifest.json tests/conformance/vectors/*.safetensors \
      tests/conformance/vectors/gpt/*.safetensors
  --check: only report (exit 1 if a native run exceeds a file's tolerance); writes nothing.
"""

import argparse
import importlib
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import vectors_io  # noqa: E402

MARGIN = 2.0   # the same rule as make_vectors.py
FLOOR = 2e-3
CLASSES = {"muon": ("muon", "Muon"), "normuon": ("normuon", "NorMuon"),
           "dion2": ("dion2", "Dion2"), "nordion2": ("nordion2", "NorDion2")}


def relf(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    nb = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / nb) if nb > 0 else float(np.linalg.norm(a - b))


def prefixes(md):
    n = int(md.get("num_params", "1"))
    return [""] + [f"p{i}." for i in range(1, n)]


def native_run(torch, dion_mod, t, md, threads):
    torch.set_num_threads(threads)
    mod, cls_name = CLASSES[md["algorithm"]]
    cls = getattr(importlib.import_module("dion." + mod), cls_name)
    pre = prefixes(md)
    opts = {k: (tuple(v) if isinstance(v, list) else v)
            for k, v in json.loads(md["param_group_options"]).items()}
    ps = [torch.nn.Parameter(torch.tensor(t[p + "param.init"].copy())) for p in pre]
    opt = cls([dict(params=ps, **opts)], **json.loads(md["constructor_kwargs"]))
    worst = 0.0
    for s in range(1, int(md["T"]) + 1):
        for p, x in zip(pre, ps):
            x.grad = torch.tensor(t[f"{p}grad.{s}"].copy())
        opt.step()
        for p, x in zip(pre, ps):
            init = t[p + "param.init"]
            worst = max(worst, relf(x.detach().numpy() - init, t[f"{p}param.{s}"] - init))
    return worst


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dion", required=True, help="microsoft/dion checkout (a directory)")
    ap.add_argument("--manifest", help="manifest.json to update")
    ap.add_argument("--check", action="store_true", help="report only, write nothing")
    ap.add_argument("files", nargs="+")
    args = ap.parse_args()

    import torch
    if int(torch.__version__.split(".")[0]) < 2:
        sys.exit(f"torch2_native_spread: needs PyTorch >= 2, this is {torch.__version__}")
    torch.compile = lambda f=None, **kw: f if f is not None else (lambda g: g)
    sys.path.insert(0, args.dion)
    import dion  # noqa: F401

    manifest = None
    if args.manifest and not args.check:
        with open(args.manifest) as f:
            manifest = json.load(f)
    over = 0
    for path in args.files:
        t, md = vectors_io.read(path)
        if md.get("algorithm") not in CLASSES:
            continue
        spread = json.loads(md.get("bf16_reference_spread", "{}"))
        native = {"torch2_native": native_run(torch, dion, t, md, 1),
                  "torch2_native_threads2": native_run(torch, dion, t, md, 2)}
        old_tol = float(md["tolerance_bf16_reference_delta_relfro"])
        worst = max(native.values())
        status = "within" if worst <= old_tol else "OVER"
        if worst > old_tol:
            over += 1
        spread.update({k: float("%.3g" % v) for k, v in native.items()})
        tol = float("%.3g" % max(MARGIN * max(spread.values()), FLOOR))
        print(f"{os.path.basename(path)}: torch {torch.__version__} native {native['torch2_native']:.3g} "
              f"(2 threads {native['torch2_native_threads2']:.3g}), {status} tolerance {old_tol:g}"
              f"{'' if args.check else f' -> {tol:g}'}", flush=True)
        if args.check:
            continue
        md["bf16_reference_spread"] = json.dumps(spread, sort_keys=True)
        md["tolerance_bf16_reference_delta_relfro"] = repr(tol)
        md["bf16_reference_spread_torch2"] = torch.__version__
        vectors_io.write(path, t, md)
        if manifest is not None:
            for c in manifest["cases"]:
                if c["file"] == os.path.basename(path):
                    c["tolerance"]["bf16_reference_delta_relfro"] = tol
                    c["measured"]["bf16_reference_spread"] = dict(spread)
    if manifest is not None:
        with open(args.manifest, "w") as f:
            json.dump(manifest, f, indent=1)
            f.write("\n")
    if args.check and over:
        sys.exit(1)


if __name__ == "__main__":
    main()
