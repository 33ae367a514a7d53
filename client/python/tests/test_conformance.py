"""Golden parity through Python: every public conformance vector of microsoft/dion replayed
through diond.torch.Optimizer (shared memory, real daemon), compared under the manifest's
tolerances:
  * precision "fp32": relF(p_T, param_f64.<T>) <= param_f64_final_relfro (every algorithm), and
    for the algorithms without a bf16 path (dion, adamw, lion) max_t relF(p_t, param.<t>) <=
    param_relfro;
  * precision "bf16_reference" (muon, normuon, dion2, nordion2): max_t relF(p_t, param.<t>) <=
    param_relfro.
Initial state (Dion's random Q) goes in through load_state_dict.
"""
import json
import os

import numpy as np
import pytest
import torch

import diond.torch
from conftest import conformance_dir, read_safetensors

CONF = conformance_dir()
CASES = json.load(open(os.path.join(CONF, "manifest.json")))["cases"]
BF16_ALGOS = {"muon", "normuon", "dion2", "nordion2"}
ALGO = {"dion_reference": "dion"}


def relf(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def run_case(case, target, precision):
    tensors, meta = read_safetensors(os.path.join(CONF, "vectors", case["file"]))
    algo = ALGO.get(case["algorithm"], case["algorithm"])
    kwargs = dict(case["hyperparameters"])
    group = {k: v for k, v in case["param_group_options"].items()}
    group["algorithm"] = algo
    p = torch.nn.Parameter(torch.from_numpy(tensors["param.init"].copy()))
    with diond.torch.Optimizer([dict(params=[p], **group)], target=target, precision=precision,
                               **kwargs) as opt:
        init = {k[len("state."):-len(".init")]: v for k, v in tensors.items()
                if k.startswith("state.") and k.endswith(".init")}
        if init:
            sd = opt.state_dict()
            for name, v in init.items():
                sd["state"][0][name] = torch.from_numpy(v.copy())
            opt.load_state_dict(sd)
        T = int(meta["T"])
        traj = 0.0
        for t in range(1, T + 1):
            g = torch.from_numpy(tensors["grad.%d" % t].copy())
            if t % 2:
                p.grad.copy_(g)  # into the arena view
            else:
                p.grad = g  # replaced: step() copies it into the arena
            opt.step()
            traj = max(traj, relf(p.detach().numpy(), tensors["param.%d" % t]))
        final64 = relf(p.detach().numpy(), tensors["param_f64.%d" % T])
    return traj, final64


@pytest.mark.skipif(not CASES, reason="conformance vectors not found (DIOND_CONFORMANCE_DIR)")
@pytest.mark.parametrize("case", CASES, ids=[c["file"].replace(".safetensors", "") for c in CASES])
def test_golden_vector(daemon, case):
    tol = case["tolerance"]
    traj, final64 = run_case(case, daemon.target, "fp32")
    assert final64 <= tol["param_f64_final_relfro"], (
        "fp32: relF(p_T, param_f64) = %.3g > %.3g" % (final64, tol["param_f64_final_relfro"]))
    if case["algorithm"] in BF16_ALGOS:
        traj16, _ = run_case(case, daemon.target, "bf16_reference")
        assert traj16 <= tol["param_relfro"], (
            "bf16_reference: max_t relF(p_t, param.t) = %.3g > %.3g" % (traj16, tol["param_relfro"]))
    else:
        assert traj <= tol["param_relfro"], (
            "fp32: max_t relF(p_t, param.t) = %.3g > %.3g" % (traj, tol["param_relfro"]))


def test_all_public_vectors_present():
    if not CASES:
        pytest.skip("conformance vectors not found")
    # Every manifest entry has its file and every file its entry; 23 original cases plus the 6
    # Dion qr_method cases at least.
    files = sorted(f for f in os.listdir(os.path.join(CONF, "vectors"))
                   if f.endswith(".safetensors"))
    assert sorted(c["file"] for c in CASES) == files
    assert len(CASES) >= 29
    assert {"qr", "cqr", "rcqr"} <= {c["hyperparameters"].get("qr_method") for c in CASES}
