"""Dion through diond.torch.Optimizer: the reference's qr_method / cqr_warmup_steps /
rcqr_oversample options reach the daemon (or are refused by name), and a reference run is
reproduced exactly by injecting its initial Q through state_dict()/load_state_dict() before
step 1 (docs/CONFORMANCE.md "Reproducing a reference Dion run").
"""
import json
import os
import re

import numpy as np
import pytest
import torch

import diond.torch
from conftest import conformance_dir, read_safetensors

CONF = conformance_dir()


def relf(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def one_step(daemon, shape=(64, 48), seed=0, **options):
    g = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter(0.1 * torch.randn(shape, generator=g))
    grad = torch.randn(shape, generator=g)
    with diond.torch.Optimizer([p], target=daemon.target, algorithm="dion", lr=0.02,
                               **options) as opt:
        p.grad.copy_(grad)
        opt.step()
        return p.detach().clone()


def test_qr_method_reaches_the_daemon(daemon):
    # rank_fraction 0.5: P is 64x24, tall, so rcqr runs the randomized Cholesky QR. The three
    # methods give the same update up to rounding, and different bits (were one of them
    # ignored, two results would be identical).
    runs = {m: one_step(daemon, qr_method=m, cqr_warmup_steps=0, rank_fraction=0.5)
            for m in ("rcqr", "qr", "cqr")}
    for m, x in runs.items():
        assert relf(x, runs["qr"]) < 1e-5, m
    assert not torch.equal(runs["rcqr"], runs["qr"])
    assert not torch.equal(runs["cqr"], runs["qr"])
    assert not torch.equal(runs["cqr"], runs["rcqr"])
    # During the warm-up cqr is rcqr, bit for bit.
    warm = one_step(daemon, qr_method="cqr", cqr_warmup_steps=1, rank_fraction=0.5)
    assert torch.equal(warm, runs["rcqr"])
    # The sketch size (rcqr_oversample, group key "oversample") changes the bits.
    assert not torch.equal(one_step(daemon, rcqr_oversample=16.0, rank_fraction=0.5),
                           runs["rcqr"])
    assert torch.equal(one_step(daemon, oversample=1.25, rank_fraction=0.5), runs["rcqr"])


def test_qr_options_are_group_options_with_the_reference_defaults(daemon):
    w = torch.nn.Parameter(torch.zeros(8, 4))
    b = torch.nn.Parameter(torch.zeros(4))
    with diond.torch.Optimizer([dict(params=[w], algorithm="dion", qr_method="qr"),
                                dict(params=[b], algorithm="adamw")],
                               target=daemon.target) as opt:
        g = opt.param_groups[0]
        assert (g["qr_method"], g["cqr_warmup_steps"], g["oversample"]) == ("qr", 150, 1.25)
        assert "qr_method" not in opt.param_groups[1]


@pytest.mark.parametrize("options, message", [
    (dict(qr_method="householder"), "qr_method must be 'rcqr', 'qr' or 'cqr'"),
    (dict(cqr_warmup_steps=-1), "cqr_warmup_steps must be an int >= 0"),
    (dict(cqr_warmup_steps=1.5), "cqr_warmup_steps must be an int >= 0"),
    (dict(rcqr_oversample=0.0), "oversample (rcqr_oversample) = 0.0 is out of range"),
    (dict(oversample=17), "out of range"),
    (dict(power_iters=2), "power_iters=2 is not supported"),
    (dict(rcqr_oversample=2.0, oversample=2.0), "not both"),
])
def test_bad_qr_options_are_refused_by_name(daemon, options, message):
    w = torch.nn.Parameter(torch.zeros(8, 4))
    with pytest.raises(ValueError, match=re.escape(message)):
        diond.torch.Optimizer([w], target=daemon.target, algorithm="dion", **options)


def test_qr_options_on_other_algorithms_are_refused(daemon):
    w = torch.nn.Parameter(torch.zeros(8, 4))
    with pytest.raises(ValueError, match="option 'qr_method' does not apply to algorithm 'muon'"):
        diond.torch.Optimizer([dict(params=[w], algorithm="muon", qr_method="qr")],
                              target=daemon.target)
    with pytest.raises(ValueError, match="used by no parameter group"):
        diond.torch.Optimizer([w], target=daemon.target, algorithm="muon", cqr_warmup_steps=3)


def test_selection_scope_is_a_group_option_as_upstream(daemon):
    w = torch.nn.Parameter(torch.zeros(8, 4))
    with diond.torch.Optimizer([dict(params=[w], algorithm="dion2", selection_scope="global")],
                               target=daemon.target):
        pass
    with pytest.raises(ValueError, match="selection_scope='row' is not supported"):
        diond.torch.Optimizer([dict(params=[w], algorithm="dion2", selection_scope="row")],
                              target=daemon.target)


# ---- injecting Q0: reproducing a reference run ---------------------------------------------------
def _replay(daemon, name, inject):
    tensors, meta = read_safetensors(os.path.join(CONF, "vectors", name + ".safetensors"))
    kwargs = json.loads(meta["hyperparameters"])
    p = torch.nn.Parameter(torch.from_numpy(tensors["param.init"].copy()))
    errs = []
    with diond.torch.Optimizer([p], target=daemon.target, algorithm="dion", **kwargs) as opt:
        if inject:
            sd = opt.state_dict()
            sd["state"][0]["Q"] = torch.from_numpy(tensors["state.Q.init"].copy())
            opt.load_state_dict(sd)
            # What the daemon now holds is the reference's Q0, bit for bit.
            assert torch.equal(opt.state_dict()["state"][0]["Q"],
                               torch.from_numpy(tensors["state.Q.init"]))
        for t in range(1, int(meta["T"]) + 1):
            p.grad.copy_(torch.from_numpy(tensors["grad.%d" % t]))
            opt.step()
            errs.append(relf(p.detach().numpy(), tensors["param.%d" % t]))
    return errs


@pytest.mark.parametrize("name", ["dion_reference-qr-64x48", "dion-default-48x80",
                                  "dion_reference-cqr-warm3-64x48"])
def test_injecting_q0_reproduces_the_reference_trajectory(daemon, name):
    case = next(c for c in json.load(open(os.path.join(CONF, "manifest.json")))["cases"]
                if c["file"] == name + ".safetensors")
    tol = case["tolerance"]["param_relfro"]
    with_q0 = _replay(daemon, name, inject=True)
    assert max(with_q0) <= tol, with_q0
    # Without the injection the daemon draws its own Q0 (seed 0): a different trajectory.
    without = _replay(daemon, name, inject=False)
    assert without[0] > 100 * tol, without


def test_cqr_warmup_continues_after_load_state_dict(daemon):
    """The warm-up counts the group's step, which load_state_dict restores (as the reference's
    group["step"]): 2 steps, a new optimizer (a new daemon session) resumed from the state dict,
    2 more steps == 4 uninterrupted steps, bit for bit. Steps 3-4 are past the warm-up; had the
    new session counted from 1 they would still use rcqr and differ in the last bits."""
    g = torch.Generator().manual_seed(5)
    w0 = 0.1 * torch.randn(64, 48, generator=g)
    grads = [torch.randn(64, 48, generator=g) for _ in range(4)]
    kw = dict(target=daemon.target, algorithm="dion", lr=0.02, rank_fraction=0.5,
              qr_method="cqr", cqr_warmup_steps=2)

    def run(ws, opt, steps):
        for t in steps:
            ws.grad.copy_(grads[t])
            opt.step()

    a = torch.nn.Parameter(w0.clone())
    with diond.torch.Optimizer([a], **kw) as opt:
        run(a, opt, range(4))
    b = torch.nn.Parameter(w0.clone())
    with diond.torch.Optimizer([b], **kw) as opt:
        run(b, opt, range(2))
        sd, wb = opt.state_dict(), b.detach().clone()
    c = torch.nn.Parameter(wb)
    with diond.torch.Optimizer([c], **kw) as opt:
        opt.load_state_dict(sd)
        assert opt.param_groups[0]["step"] == 2
        run(c, opt, range(2, 4))
    assert torch.equal(c.detach(), a.detach())
    # The same resume with the step counter reset to 0 takes the warm-up branch again.
    sd["param_groups"][0]["step"] = 0
    d = torch.nn.Parameter(wb.clone())
    with diond.torch.Optimizer([d], **kw) as opt:
        opt.load_state_dict(sd)
        run(d, opt, range(2, 4))
    assert not torch.equal(d.detach(), a.detach())
    assert relf(d.detach(), a.detach()) < 1e-5
