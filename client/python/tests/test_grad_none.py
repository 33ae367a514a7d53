"""Parameters without a gradient (torch.optim's `p.grad is None`) through diond.torch.Optimizer
and diond.Client, against real daemons (docs/ALGORITHMS.md §2.6): such a parameter and its
optimizer state stay exactly as they were, for every algorithm and precision, while the others
step as in a session without it; AdamW keeps each parameter's own step count (torch.optim.AdamW's
per-parameter "step"); an unused branch, a frozen layer and the zero_grad variants behave as with
torch.optim.AdamW; a world of two agrees on the set (AVERAGE: any rank's gradient counts;
REPLICATED: every rank must agree); a malformed set is refused."""
import gc
import json
import os
import threading
import weakref

import grpc
import numpy as np
import pytest
import torch

import diond
import diond.torch
from conftest import conformance_dir
from test_torch_optimizer import assert_bitwise, mse

ALGORITHMS = ["muon", "normuon", "dion", "dion2", "dion3", "adamw", "lion"]
MATRIX = {"muon", "normuon", "dion", "dion2", "dion3"}

# diond's AdamW and torch 1.13's torch.optim.AdamW (single-tensor path) are two float32
# evaluations of one formula that round in different places (diond: PyTorch 2.x's fused kernel,
# tests/conformance/README.md §5 item 6). The conformance AdamW cases bound each float32
# evaluation against float64 by relF <= param_relfro / 10 over 6 steps (the tolerance is ten
# times the measured distance); two such evaluations are within 2/10 of it of each other. The
# runs below take <= 8 steps at lr 1e-2 (the conformance cases: 6 at 1e-3): the weights' own
# roundings (~2^-24 relative per step) dominate, the update's rounding adds lr/|w| ~ 1/20 of
# that, so the drift grows about linearly in the steps: 8/6 x 2/10 = 0.27 of param_relfro
# (measured: <= 8e-8 = 0.06 of it). A parameter stepped when it must not be moves by
# lr * weight_decay = 1e-3 relative in one step, 1000x the tolerance; AdamW's bias correction
# from the group's step count instead of the parameter's own moves the update by tens of per
# cent.
ADAMW_RELF = max(c["tolerance"]["param_relfro"] for c in json.load(open(os.path.join(
    conformance_dir(), "manifest.json")))["cases"] if c["algorithm"] == "adamw")
ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def snapshot(params):
    """Copies of a module's parameters, or of a list of parameters."""
    if isinstance(params, torch.nn.Module):
        params = params.parameters()
    return [p.detach().clone() for p in params]


def relf(a, b):
    a = np.asarray(a.detach().float(), np.float64)
    b = np.asarray(b.detach().float(), np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def assert_close_to_torch(got, want, what=""):
    for i, (a, b) in enumerate(zip(got, want)):
        e = relf(a, b)
        assert e <= ADAMW_RELF, "%sparameter %d: relF = %.3g > %.3g" % (what, i, e, ADAMW_RELF)


def torch_adamw(params):
    return torch.optim.AdamW(params, lr=ADAMW["lr"], betas=ADAMW["betas"],
                             weight_decay=ADAMW["weight_decay"], eps=1e-8)


def states(opt):
    return {i: {k: v.clone() for k, v in st.items()} for i, st in opt.state_dict()["state"].items()}


def assert_same_state(a, b, what):
    assert set(a) == set(b), what
    for k in a:
        assert torch.equal(a[k], b[k]), "%s: state %s differs" % (what, k)


class Branchy(torch.nn.Module):
    """A trunk the loss uses and a branch computed from the same features that the loss never
    uses: backward never reaches the branch (torch leaves its .grad None)."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.trunk = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(),
                                         torch.nn.Linear(16, 4))
        self.branch = torch.nn.Linear(16, 3)

    def forward(self, x):
        h = self.trunk[1](self.trunk[0](x))
        return self.trunk[2](h), self.branch(h)


def batch(step):
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(16, 12, generator=g), torch.randn(16, 4, generator=g)


def twins(seed=0):
    """The same model twice: one for diond, one for torch.optim."""
    a, b = Branchy(seed), Branchy(seed)
    assert_bitwise(snapshot(a), snapshot(b))
    return a, b


def zero(kind, model, opt):
    # Explicit set_to_none: torch 1.13's zero_grad defaults to False, diond's (as torch 2.x) to
    # True.
    if kind == "opt":
        opt.zero_grad(set_to_none=True)
    elif kind == "opt_zeros":
        opt.zero_grad(set_to_none=False)
    elif kind == "model_none":
        model.zero_grad(set_to_none=True)
    else:
        assert kind == "model_zeros"
        model.zero_grad(set_to_none=False)  # torch 1.13's default


def train_step(model, opt, step, zero_kind="opt", asynchronous=False):
    zero(zero_kind, model, opt)
    x, y = batch(step)
    out, _ = model(x)
    mse(out, y).backward()
    if asynchronous:
        opt.step(asynchronous=True)
        opt.synchronize()
    else:
        opt.step()


MODES = {"memfd": dict(arena="memfd"), "shm": dict(arena="shm"), "remote": dict(remote=True),
         "async": {}}


@pytest.mark.parametrize("mode,zero_kind", [
    ("memfd", "opt"), ("shm", "opt"), ("remote", "opt"), ("async", "opt"),
    ("memfd", "model_none"), ("memfd", "model_zeros"), ("remote", "model_zeros")])
def test_unused_branch_matches_torch_adamw(daemon, mode, zero_kind):
    model, ref = twins()
    init = snapshot(model.branch)
    with diond.torch.Optimizer(model.parameters(), target=daemon.target, algorithm="adamw",
                               **ADAMW, **MODES[mode]) as opt:
        ref_opt = torch_adamw(ref.parameters())
        for s in range(1, 7):
            train_step(model, opt, s, zero_kind, asynchronous=mode == "async")
            train_step(ref, ref_opt, s, zero_kind)
        sd = opt.state_dict()["state"]
    assert ref.branch.weight.grad is None  # torch's side: the branch never had a gradient
    assert_bitwise(snapshot(model.branch), init)
    assert_close_to_torch(snapshot(model), snapshot(ref))
    assert relf(model.trunk[0].weight, Branchy().trunk[0].weight) > 100 * ADAMW_RELF  # trained
    # The branch (parameters 4, 5) has no step and zero moments: no step ever touched it.
    for i in (4, 5):
        assert sd[i]["step_dev"].item() == 0 and not sd[i]["momentum"].any()
    assert all(sd[i]["step_dev"].item() == 6 for i in range(4))
    # After close() the model's .grad is torch's: None where there was no gradient.
    if mode != "remote":
        assert model.branch.weight.grad is None and model.trunk[0].weight.grad is not None


def test_unused_branch_with_muon_is_a_model_without_it(daemon):
    """Muon on the matrices, AdamW on the vectors, the branch last in each group: the trunk's
    weights and state are bit for bit those of an optimizer that does not hold the branch, and
    the branch keeps its initial weights and empty state."""

    def groups(model, with_branch):
        t = model.trunk
        mats, vecs = [t[0].weight, t[2].weight], [t[0].bias, t[2].bias]
        if with_branch:
            mats, vecs = mats + [model.branch.weight], vecs + [model.branch.bias]
        return [dict(params=mats, algorithm="muon", lr=0.02),
                dict(params=vecs, algorithm="adamw", lr=1e-2)]

    model, lean = twins()
    init = snapshot(model.branch)
    with diond.torch.Optimizer(groups(model, True), target=daemon.target) as opt, \
            diond.torch.Optimizer(groups(lean, False), target=daemon.target) as lean_opt:
        for s in range(1, 5):
            train_step(model, opt, s)
            train_step(lean, lean_opt, s)
        got, want = states(opt), states(lean_opt)
    assert_bitwise(snapshot(model.trunk), snapshot(lean.trunk))
    assert_bitwise(snapshot(model.branch), init)
    # Session order: trunk matrices 0, 1, branch matrix 2, trunk biases 3, 4, branch bias 5.
    for mine, theirs in ((0, 0), (1, 1), (3, 2), (4, 3)):
        assert_same_state(got[mine], want[theirs], "parameter %d" % mine)
    assert not got[2]["momentum"].any() and not got[5]["momentum"].any()


@pytest.mark.parametrize("precision", ["fp32", "bf16_reference"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_parameter_without_gradient_is_left_alone(daemon, algorithm, precision):
    """The property, per algorithm and precision: across the steps where parameter b has no
    gradient, b's weights and optimizer state stay bit for bit what they were, and parameter a
    (same group, same shape, so in the same batch where the daemon batches) is bit for bit the
    parameter of a second session that holds a alone, through every step. b goes last, so a has
    the same index, name and seeds in both sessions."""
    g = torch.Generator().manual_seed(11)
    w_a, w_b = 0.1 * torch.randn(16, 12, generator=g), 0.1 * torch.randn(16, 12, generator=g)
    grads = [(torch.randn(16, 12, generator=g), torch.randn(16, 12, generator=g))
             for _ in range(6)]
    skipped = (3, 4, 5)
    kw = dict(target=daemon.target, algorithm=algorithm, precision=precision,
              lr=0.02 if algorithm in MATRIX else 1e-2)
    a, b, alone = (torch.nn.Parameter(w.clone()) for w in (w_a, w_b, w_a))
    with diond.torch.Optimizer([a, b], **kw) as opt, \
            diond.torch.Optimizer([alone], **kw) as alone_opt:
        for t, (ga, gb) in enumerate(grads, start=1):
            opt.zero_grad()
            alone_opt.zero_grad()
            loss = (a * ga).sum()  # d/da = ga exactly
            if t not in skipped:
                loss = loss + (b * gb).sum()
            loss.backward()
            (alone * ga).sum().backward()
            if t == skipped[0]:
                held, held_state = b.detach().clone(), states(opt)[1]
            opt.step()
            alone_opt.step()
            assert torch.equal(a, alone), "step %d: a differs from the session without b" % t
            if t in skipped:
                assert torch.equal(b, held), "step %d: b moved without a gradient" % t
                assert_same_state(states(opt)[1], held_state, "step %d, b" % t)
            assert_same_state(states(opt)[0], states(alone_opt)[0], "step %d, a" % t)
        assert not torch.equal(b, held)  # step 6 has b's gradient again


@pytest.mark.parametrize("zero_kind", ["opt", "model_none", "opt_zeros", "model_zeros"])
def test_frozen_layer_follows_torch(daemon, zero_kind):
    """trunk[0] is frozen (requires_grad_(False)) after 3 steps, with weight decay 0.1. Once
    zero_grad set its .grad to None it has no gradient: it stays bit for bit where it was
    (torch's rule). With set_to_none=False its .grad stays a zero gradient, and torch.optim
    steps it (weight decay, momentum): so does diond. The unused branch never moves."""
    model, ref = twins(seed=1)
    with diond.torch.Optimizer(model.parameters(), target=daemon.target, algorithm="adamw",
                               **ADAMW) as opt:
        ref_opt = torch_adamw(ref.parameters())
        for s in range(1, 4):
            train_step(model, opt, s, zero_kind)
            train_step(ref, ref_opt, s, zero_kind)
        for m in (model, ref):
            m.trunk[0].requires_grad_(False)
        frozen = snapshot(model.trunk[0])
        for s in range(4, 7):
            train_step(model, opt, s, zero_kind)
            train_step(ref, ref_opt, s, zero_kind)
    assert_close_to_torch(snapshot(model), snapshot(ref), "%s: " % zero_kind)
    assert_bitwise(snapshot(model.branch), snapshot(Branchy(seed=1).branch))
    if zero_kind.endswith("_zeros"):
        assert not torch.equal(model.trunk[0].weight, frozen[0])  # stepped with zeros, as torch
    else:
        assert_bitwise(snapshot(model.trunk[0]), frozen)


def test_a_layer_unfrozen_later_gets_its_gradients(daemon):
    """A parameter that did not require grad when the optimizer was built (no hook then) and is
    unfrozen later is stepped from its first backward on, as with torch.optim.AdamW."""
    model, ref = twins(seed=2)
    for m in (model, ref):
        m.trunk[0].requires_grad_(False)
    with diond.torch.Optimizer(model.parameters(), target=daemon.target, algorithm="adamw",
                               **ADAMW) as opt:
        ref_opt = torch_adamw(ref.parameters())
        train_step(model, opt, 1)
        train_step(ref, ref_opt, 1)
        assert_bitwise(snapshot(model.trunk[0]), snapshot(Branchy(seed=2).trunk[0]))
        for m in (model, ref):
            m.trunk[0].requires_grad_(True)
        for s in range(2, 5):
            train_step(model, opt, s)
            train_step(ref, ref_opt, s)
    assert_close_to_torch(snapshot(model), snapshot(ref))
    assert relf(model.trunk[0].weight, Branchy(seed=2).trunk[0].weight) > 100 * ADAMW_RELF


def test_micro_batches_accumulate_and_the_mask_follows(daemon):
    """Gradient accumulation: the branch has a gradient from the second micro-batch only (it is
    stepped), and in the step after that from none (left alone); as torch.optim.AdamW."""
    model, ref = twins(seed=3)
    with diond.torch.Optimizer(model.parameters(), target=daemon.target, algorithm="adamw",
                               **ADAMW) as opt:
        ref_opt = torch_adamw(ref.parameters())
        for s, branch_used in ((1, True), (2, False), (3, True)):
            for m, o in ((model, opt), (ref, ref_opt)):
                o.zero_grad(set_to_none=True)
                x, y = batch(s)
                out, _ = m(x[:8])
                mse(out, y[:8]).backward()
                out, side = m(x[8:])
                loss = mse(out, y[8:])
                if branch_used:
                    loss = loss + (side ** 2).mean()
                loss.backward()
            before = snapshot(model.branch)
            opt.step()
            ref_opt.step()
            if not branch_used:
                assert_bitwise(snapshot(model.branch), before)
            else:
                assert not torch.equal(model.branch.weight, before[0])
            assert_close_to_torch(snapshot(model), snapshot(ref), "step %d: " % s)


def test_writing_into_grad_gives_a_gradient(daemon):
    """In shared-memory mode .grad is a view from the start: writing a gradient into it gives
    the parameter one (as assigning .grad does), while nn.Module.zero_grad(set_to_none=False),
    which zeroes it in place, leaves a parameter without a gradient without one."""
    g = torch.Generator().manual_seed(4)
    a, b = (torch.nn.Parameter(0.1 * torch.randn(8, 6, generator=g)) for _ in range(2))
    w_b = b.detach().clone()
    with diond.torch.Optimizer([a, b], target=daemon.target, algorithm="adamw",
                               **ADAMW) as opt:
        w_a = a.detach().clone()
        a.grad.copy_(torch.randn(8, 6, generator=g))
        b.grad.zero_()  # what model.zero_grad(set_to_none=False) does
        opt.step()
        assert not torch.equal(a, w_a)
        assert torch.equal(b, w_b)
        # Flags persist across steps (torch does not clear .grad at step()): a, now with a
        # gradient, is stepped again with the same one; b only once it gets its own.
        w_a = a.detach().clone()
        opt.step()
        assert not torch.equal(a, w_a) and torch.equal(b, w_b)
        b.grad = torch.randn(8, 6, generator=g)
        opt.step()
        assert not torch.equal(b, w_b)


@pytest.mark.parametrize("remote", [False, True])
def test_adamw_bias_correction_counts_each_parameters_own_steps(daemon, remote):
    """a has gradients at steps 1-2 and 6-8, none at 3-5; b at every step. torch.optim.AdamW
    keeps a per-parameter step, so a's bias corrections at steps 6-8 are those of its steps 3-5;
    diond's must be too (its step_dev). Weight decay 0: a moving during 3-5 could only be the
    moments decaying."""
    g = torch.Generator().manual_seed(9)
    w = [0.1 * torch.randn(16, 12, generator=g) for _ in range(2)]
    grads = [[torch.randn(16, 12, generator=g) for _ in range(2)] for _ in range(8)]
    mine = [torch.nn.Parameter(x.clone()) for x in w]
    theirs = [torch.nn.Parameter(x.clone()) for x in w]
    ref_opt = torch.optim.AdamW(theirs, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0, eps=1e-8)
    with diond.torch.Optimizer(mine, target=daemon.target, algorithm="adamw", lr=1e-2,
                               betas=(0.9, 0.95), weight_decay=0.0, remote=remote) as opt:
        for t in range(1, 9):
            for ps in (mine, theirs):
                ps[0].grad = None if t in (3, 4, 5) else grads[t - 1][0].clone()
                ps[1].grad = grads[t - 1][1].clone()
            held = mine[0].detach().clone()
            opt.step()
            ref_opt.step()
            if t in (3, 4, 5):
                assert torch.equal(mine[0], held)
            assert_close_to_torch(mine, theirs, "step %d: " % t)
        sd = opt.state_dict()["state"]
    assert sd[0]["step_dev"].item() == 5 and sd[1]["step_dev"].item() == 8
    assert ref_opt.state[theirs[0]]["step"].item() == 5


@pytest.mark.parametrize("remote", [False, True])
def test_a_step_without_any_gradient_changes_no_weight(daemon, remote):
    """A first step before any backward (remote mode: nothing to upload yet) changes no weight
    and reports update norms of 0; the group step counters advance all the same."""
    model = Branchy(seed=5)
    init = snapshot(model)
    with diond.torch.Optimizer(model.parameters(), target=daemon.target, algorithm="adamw",
                               **ADAMW, remote=remote) as opt:
        opt.step()
        assert_bitwise(snapshot(model), init)
        assert dict(opt.last_step.update_norms) == {"group0": 0.0}
        assert opt.param_groups[0]["step"] == 1
        train_step(model, opt, 2)
        assert opt.last_step.update_norms["group0"] > 0
    assert_bitwise(snapshot(model.branch), init[4:])


def test_hooks_go_with_the_optimizer(daemon):
    """The hooks neither keep the optimizer alive nor outlive it: a dropped optimizer is
    collected (its finalizer gives the model back) and the parameters carry no hook after."""
    model = Branchy()
    opt = diond.torch.Optimizer(model.parameters(), target=daemon.target, algorithm="adamw")
    assert all(p._backward_hooks for p in model.parameters())
    train_step(model, opt, 1)
    ref = weakref.ref(opt)
    del opt
    gc.collect()
    assert ref() is None
    assert not any(p._backward_hooks for p in model.parameters())
    assert model.branch.weight.grad is None and model.trunk[0].weight.grad is not None
    # A new optimizer over the model starts from those: the branch has no gradient.
    with diond.torch.Optimizer(model.parameters(), target=daemon.target,
                               algorithm="adamw") as opt:
        before = snapshot(model.branch)
        opt.step()
        assert_bitwise(snapshot(model.branch), before)
        opt.close()
        assert not any(p._backward_hooks for p in model.parameters())


# -- diond.Client ------------------------------------------------------------------------------
def _raw_session(c, policy):
    pb = diond.client.pb
    sid = c.create_session(
        parameters=[pb.ParameterSpec(name="w", shape=[8, 4], dtype=pb.DTYPE_F32, group="m"),
                    pb.ParameterSpec(name="b", shape=[4], dtype=pb.DTYPE_F32, group="v")],
        groups=[pb.ParameterGroup(name="m", algorithm=pb.ALGORITHM_MUON,
                                  hyperparameters=pb.Hyperparameters(lr=0.02)),
                pb.ParameterGroup(name="v", algorithm=pb.ALGORITHM_ADAMW,
                                  hyperparameters=pb.Hyperparameters(lr=1e-2))],
        non_finite_policy=policy).session_id
    return sid


def test_a_malformed_mask_is_refused_and_changes_nothing(daemon):
    pb = diond.client.pb
    g = torch.Generator().manual_seed(6)
    w, b = torch.randn(8, 4, generator=g), torch.randn(4, generator=g)
    with diond.Client(daemon.target) as c:
        sid = _raw_session(c, pb.NON_FINITE_POLICY_ERROR)
        c.set_state(sid, {"w": w, "b": b})
        # b's gradient is NaN: a step that reads it fails (policy "error"); a masked b is
        # never read.
        c.push_gradients(sid, {"w": torch.randn(8, 4, generator=g),
                               "b": torch.full((4,), float("nan"))})
        before = {k: bytes(v.data) for k, v in c.get_state(sid, include_parameters=True).items()}
        for bad, what in (([2], "index 2"), ([-1], "index -1"), ([1, 1], "named twice"),
                          ([0, 7, 1], "index 7")):
            with pytest.raises(diond.DiondError) as e:
                c.step(sid, 1, params_without_grad=bad)
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT, (bad, e.value)
            assert "params_without_grad" in e.value.message and what in e.value.message
        with pytest.raises(diond.DiondError) as e:
            c.step(sid, 1)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT  # the NaN was read
        after = c.get_state(sid, include_parameters=True)
        assert set(after) == set(before)
        for k, v in after.items():
            assert bytes(v.data) == before[k], "%s changed" % k
        resp = c.step(sid, 1, params_without_grad=[1])
        assert resp.step_index == 1
        assert resp.update_norms["m"] > 0 and resp.update_norms["v"] == 0.0
        new = c.pull_parameters(sid)
        assert torch.equal(new["b"].torch(), b) and not torch.equal(new["w"].torch(), w)
        assert c.get_state(sid)["b/state.step_dev"].torch().item() == 0
        c.close_session(sid)


# -- a world of two ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def world():
    flags = ["--world_size=2", "--heartbeat_interval=200ms", "--peer_timeout=5s"]
    started = []
    try:
        d0 = diond.Daemon(compute_threads=1, tcp=True, extra_args=flags + ["--rank=0"]).start()
        started.append(d0)
        port = d0.tcp_target.rsplit(":", 1)[1]
        started.append(diond.Daemon(compute_threads=1, extra_args=flags + [
            "--rank=1", "--coordinator=127.0.0.1:" + port]).start())
        yield started
    finally:
        for d in started:
            d.kill()
            d.cleanup()


def _world_model():
    g = torch.Generator().manual_seed(21)
    return [torch.nn.Parameter(0.1 * torch.randn(*s, generator=g))
            for s in ((16, 12), (16, 12), (16,))]


def _world_groups(ps):
    return [dict(params=ps[:2], algorithm="muon", lr=0.02),
            dict(params=ps[2:], algorithm="adamw", lr=1e-2)]


def _world_grads(step):
    g = torch.Generator().manual_seed(300 + step)
    return [torch.randn(*s, generator=g) for s in ((16, 12), (16, 12), (16,))]


def _give(ps, step, without, scale=None):
    """The step's gradients, None for the indices in `without`; scale: {index: factor}."""
    for i, (p, gr) in enumerate(zip(ps, _world_grads(step))):
        p.grad = None if i in without else gr * (scale or {}).get(i, 1.0)


def _on_ranks(fns):
    """Runs one function per rank at once; returns each one's exception (or None)."""
    errors = [None] * len(fns)

    def run(r):
        try:
            fns[r]()
        except Exception as e:  # reported per rank
            errors[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a trainer hung"
    return errors


def _local(daemon, masks, scales=None):
    """One daemon's run with the given masks; a masked parameter must not move."""
    ps = _world_model()
    with diond.torch.Optimizer(_world_groups(ps), target=daemon.target) as opt:
        for step, without in enumerate(masks, start=1):
            _give(ps, step, without, (scales or {}).get(step))
            before = snapshot(ps)
            opt.step()
            for i in without:
                assert torch.equal(ps[i], before[i]), "step %d: parameter %d moved" % (step, i)
    return snapshot(ps)


def _world_run(world, key, sync, masks_per_rank):
    models = [_world_model(), _world_model()]

    def trainer(r):
        def f():
            with diond.torch.Optimizer(_world_groups(models[r]), target=world[r].target,
                                       world_key=key, gradient_sync=sync) as opt:
                for step, without in enumerate(masks_per_rank[r], start=1):
                    _give(models[r], step, without)
                    opt.step()
        return f

    errors = _on_ranks([trainer(0), trainer(1)])
    assert errors == [None, None], errors
    return [snapshot(m) for m in models]


# Per step, the parameters without a gradient: none, the second matrix, the matrix and the bias.
MASKS = [set(), {1}, {1, 2}, set()]


@pytest.mark.parametrize("sync", ["average", "replicated"])
def test_world_with_the_same_mask_on_every_rank_is_one_daemon(world, daemon, sync):
    want = _local(daemon, MASKS)
    got = _world_run(world, "grad-none-same-" + sync, sync, [MASKS, MASKS])
    for r in (0, 1):
        assert_bitwise(got[r], want)
    assert not torch.equal(want[1], _world_model()[1])


def test_world_average_steps_a_parameter_any_rank_has(world, daemon):
    """Under AVERAGE, parameter 1 at step 2 has a gradient on rank 1 only: it is stepped with
    (0 + g) / 2, i.e. one daemon given g / 2 (exact in float32), on both ranks; at step 3 no
    rank has it, and it stays."""
    got = _world_run(world, "grad-none-any", "average",
                     [[set(), {1}, {1}], [set(), set(), {1}]])
    want = _local(daemon, [set(), set(), {1}], scales={2: {1: 0.5}})
    for r in (0, 1):
        assert_bitwise(got[r], want)


def test_world_replicated_disagreement_fails_on_both_ranks_and_can_be_retried(world, daemon):
    """Under REPLICATED rank 0 has no gradient for parameter 1 at step 2 and rank 1 has one:
    the step fails with FAILED_PRECONDITION on both ranks and changes nothing (weights, state,
    step counter); retried with rank 1 agreeing, the run is one daemon's with that mask."""
    models = [_world_model(), _world_model()]
    seen = [dict(), dict()]

    def trainer(r):
        def f():
            ps = models[r]
            with diond.torch.Optimizer(_world_groups(ps), target=world[r].target,
                                       world_key="grad-none-disagree",
                                       gradient_sync="replicated") as opt:
                _give(ps, 1, set())
                opt.step()
                weights, state = snapshot(ps), states(opt)
                _give(ps, 2, {1} if r == 0 else set())
                try:
                    opt.step()
                except diond.DiondError as e:
                    seen[r]["error"] = e
                seen[r]["unchanged"] = opt._step_index == 1 and all(
                    torch.equal(a, b) for a, b in zip(snapshot(ps), weights))
                for i, st in states(opt).items():
                    assert_same_state(st, state[i], "rank %d parameter %d" % (r, i))
                _give(ps, 2, {1})
                opt.step()
                _give(ps, 3, set())
                opt.step()
        return f

    errors = _on_ranks([trainer(0), trainer(1)])
    assert errors == [None, None], errors
    for r in (0, 1):
        e = seen[r].get("error")
        assert e is not None, "rank %d: the disagreeing step did not fail" % r
        assert e.code == grpc.StatusCode.FAILED_PRECONDITION, (r, e)
        assert "params_without_grad" in e.message, e.message
        assert seen[r]["unchanged"], "rank %d: the failed step changed something" % r
    want = _local(daemon, [set(), {1}, set()])
    for r in (0, 1):
        assert_bitwise(snapshot(models[r]), want)
