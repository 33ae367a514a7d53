"""diond.torch.Optimizer against a real daemon: zero copy, schedulers, state_dict/resume across a
daemon crash, remote mode, bf16, closures, zero_grad, close."""
import os

import pytest
import torch

import diond
import diond.torch
from diond.client import pb


def make_model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.Tanh(), torch.nn.Linear(48, 32),
                            torch.nn.Tanh(), torch.nn.Linear(32, 8))
    return m.to(dtype)


def batch(step, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(32, 24, generator=g).to(dtype), torch.randn(32, 8, generator=g).to(dtype)


def mse(out, y):
    return ((out - y) ** 2).mean()  # torch 1.13 has no bf16 mse_loss on CPU


def groups(model, algos=("dion", "normuon")):
    lin = [m for m in model if isinstance(m, torch.nn.Linear)]
    return [
        dict(params=[lin[0].weight], algorithm=algos[0], lr=0.02),
        dict(params=[lin[1].weight, lin[2].weight], algorithm=algos[1], lr=0.02),
        dict(params=[m.bias for m in lin], algorithm="adamw", lr=1e-3, betas=(0.9, 0.95)),
    ]


def train(model, opt, steps, first=1, sched=None, dtype=torch.float32):
    losses = []
    for s in range(first, first + steps):
        x, y = batch(s, dtype)
        opt.zero_grad()
        loss = mse(model(x), y)
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


def snapshot(model):
    return [p.detach().clone() for p in model.parameters()]


def assert_bitwise(a, b):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x, y), "parameter %d differs (max |d| = %g)" % (
            i, (x.float() - y.float()).abs().max().item())


def test_zero_copy_views_and_close(daemon):
    model = make_model()
    before = snapshot(model)
    opt = diond.torch.Optimizer(groups(model), target=daemon.target, arena="shm")
    assert not opt.remote and opt.arena == "shm"
    shm_name = opt._shm.name
    assert os.path.exists("/dev/shm/" + shm_name)
    # The model's tensors are views of the arena: the values are unchanged, and bytes written
    # into the segment through another mapping show up in the parameter.
    assert_bitwise(snapshot(model), before)
    from multiprocessing import shared_memory
    other = shared_memory.SharedMemory(name=shm_name)
    try:
        w = model[0].weight
        layout = opt._layout["p0"]
        view = torch.frombuffer(other.buf, dtype=torch.float32, count=w.numel(),
                                offset=layout.param_offset_bytes).view(w.shape)
        view[0, 0] = 42.0
        assert w[0, 0].item() == 42.0
        del view
    finally:
        other.close()
    c = diond.Client(daemon.target)
    assert [s.session_id for s in c.list_sessions()] == [opt.session_id]
    train(model, opt, 2)
    after = snapshot(model)
    opt.close()
    opt.close()  # twice is fine
    assert c.list_sessions() == []
    assert not os.path.exists("/dev/shm/" + shm_name)
    assert_bitwise(snapshot(model), after)  # the model keeps its weights as ordinary tensors
    model[0].weight.data.add_(1.0)  # and they are writable, private memory
    c.close()


def test_training_reduces_loss_and_closure(daemon):
    model = make_model()
    with diond.torch.Optimizer(groups(model, ("muon", "dion2")), target=daemon.target) as opt:
        x, y = batch(0)

        def closure():
            opt.zero_grad()
            loss = mse(model(x), y)
            loss.backward()
            return loss

        first = opt.step(closure).item()
        for _ in range(30):
            last = opt.step(closure).item()
        assert last < 0.7 * first
        assert opt.last_step.step_index == 31
        assert set(opt.last_step.update_norms) == {"group0", "group1", "group2"}
        assert all(g["step"] == 31 for g in opt.param_groups)


def test_zero_grad_keeps_arena_views(daemon):
    model = make_model()
    with diond.torch.Optimizer(groups(model), target=daemon.target) as opt:
        train(model, opt, 1)
        ptrs = [p.grad.data_ptr() for p in model.parameters()]
        assert all(p.grad.abs().sum() > 0 for p in model.parameters())
        opt.zero_grad(set_to_none=True)
        assert [p.grad.data_ptr() for p in model.parameters()] == ptrs
        assert all(p.grad.abs().sum() == 0 for p in model.parameters())
        # model.zero_grad() (set_to_none in torch 2.x) and a replaced .grad are repaired at step
        model.zero_grad()
        train(model, opt, 1)
        model[0].weight.grad = torch.ones_like(model[0].weight)
        opt.step()
        assert model[0].weight.grad.data_ptr() == ptrs[0]


def test_scheduler_reaches_daemon_bitwise(daemon):
    """StepLR halves the lr every 2 steps; the same steps through the low-level client with an
    explicit lr_override per step give bit-identical parameters."""
    steps, lr0 = 6, 0.02
    model = make_model()
    init = snapshot(model)
    opt = diond.torch.Optimizer([dict(params=[model[0].weight, model[2].weight, model[4].weight],
                                      algorithm="muon", lr=lr0)], target=daemon.target)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    grads = []
    for s in range(1, steps + 1):
        x, y = batch(s)
        opt.zero_grad()
        mse(model(x), y).backward()
        grads.append([model[i].weight.grad.clone() for i in (0, 2, 4)])
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == lr0 / 8
    got = [model[i].weight.detach().clone() for i in (0, 2, 4)]
    opt.close()

    # The reference: a hand-written session (remote mode), lr given explicitly at every step.
    c = diond.Client(daemon.target)
    w0 = [init[0], init[2], init[4]]
    names = ["a", "b", "c"]
    sess = c.create_session(
        parameters=[pb.ParameterSpec(name=n, shape=list(w.shape), dtype=pb.DTYPE_F32, group="m")
                    for n, w in zip(names, w0)],
        groups=[pb.ParameterGroup(name="m", algorithm=pb.ALGORITHM_MUON,
                                  hyperparameters=pb.Hyperparameters(lr=lr0))]).session_id
    c.set_state(sess, dict(zip(names, w0)))
    for s in range(1, steps + 1):
        c.push_gradients(sess, dict(zip(names, grads[s - 1])))
        c.step(sess, s, lr_override={"m": lr0 * 0.5 ** ((s - 1) // 2)})
    ref = c.pull_parameters(sess)
    assert_bitwise(got, [ref[n].torch() for n in names])
    # ... and without the halving the numbers differ (the schedule did reach the daemon).
    c.close_session(sess)
    c.close()
    model2 = make_model()
    with diond.torch.Optimizer([dict(params=[model2[0].weight, model2[2].weight,
                                             model2[4].weight], algorithm="muon", lr=lr0)],
                               target=daemon.target) as opt2:
        for s in range(1, steps + 1):
            for i, k in enumerate((0, 2, 4)):
                model2[k].weight.grad.copy_(grads[s - 1][i])
            opt2.step()
    assert not torch.equal(model2[4].weight, got[2])


def test_weight_decay_change_reaches_daemon(daemon):
    def run(change):
        model = make_model()
        with diond.torch.Optimizer(groups(model), target=daemon.target) as opt:
            train(model, opt, 2)
            if change:
                for g in opt.param_groups:
                    g["weight_decay"] = 0.5
            train(model, opt, 2, first=3)
        return snapshot(model)

    a, b = run(False), run(True)
    assert not torch.equal(a[0], b[0])


def test_state_dict_structure_and_roundtrip(daemon):
    model = make_model()
    with diond.torch.Optimizer(groups(model), target=daemon.target) as opt:
        train(model, opt, 3)
        sd = opt.state_dict()
        assert [g["params"] for g in sd["param_groups"]] == [[0], [1, 2], [3, 4, 5]]
        assert sd["param_groups"][0]["algorithm"] == "dion"
        assert sd["param_groups"][2]["betas"] == (0.9, 0.95)
        assert "mu" not in sd["param_groups"][2]  # only the options AdamW has
        assert set(sd["state"]) == set(range(6))
        assert set(sd["state"][0]) == {"momentum", "Q"}
        assert set(sd["state"][1]) == {"momentum", "variance_neuron"}
        assert set(sd["state"][3]) == {"momentum", "variance", "step_dev"}
        assert sd["state"][3]["step_dev"].item() == 3.0
        assert sd["state"][1]["momentum"].shape == model[2].weight.shape
        # torch.save / torch.load round trip, then load: GetState gives the same back
        import io
        buf = io.BytesIO()
        torch.save(sd, buf)
        buf.seek(0)
        loaded = torch.load(buf)
        opt.load_state_dict(loaded)
        sd2 = opt.state_dict()
        for i in sd["state"]:
            for k in sd["state"][i]:
                assert torch.equal(sd["state"][i][k], sd2["state"][i][k])
        # a different option in the state dict is refused
        bad = opt.state_dict()
        bad["param_groups"][1]["mu"] = 0.5
        with pytest.raises(ValueError, match="mu"):
            opt.load_state_dict(bad)


def test_resume_after_daemon_crash_is_bitwise(daemon_factory):
    """10 steps, state_dict, SIGKILL the daemon, new daemon, load_state_dict, 10 more steps ==
    20 uninterrupted steps, bit for bit."""
    d1 = daemon_factory()
    ref_model = make_model()
    with diond.torch.Optimizer(groups(ref_model), target=d1.target) as opt:
        train(ref_model, opt, 20)
    ref = snapshot(ref_model)

    d2 = daemon_factory()
    model = make_model()
    opt = diond.torch.Optimizer(groups(model), target=d2.target)
    train(model, opt, 10)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    opt_state = opt.state_dict()
    d2.kill()  # SIGKILL: the session is gone with the daemon
    with pytest.raises(diond.DiondError):
        train(model, opt, 1, first=11)
    opt.close()

    d3 = daemon_factory()
    model2 = make_model(seed=123)  # different initial weights: everything must come from the save
    model2.load_state_dict(weights)
    with diond.torch.Optimizer(groups(model2), target=d3.target) as opt2:
        opt2.load_state_dict(opt_state)
        assert opt2.param_groups[0]["step"] == 10
        train(model2, opt2, 10, first=11)
    assert_bitwise(snapshot(model2), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_remote_mode_matches_shm_bitwise(daemon, dtype):
    results = []
    for remote in (False, True):
        model = make_model(dtype=dtype)
        with diond.torch.Optimizer(groups(model, ("dion2", "muon")), target=daemon.target,
                                   remote=remote) as opt:
            assert opt.remote == remote
            losses = train(model, opt, 5, dtype=dtype)
            sd = opt.state_dict()
        assert all(p.dtype == dtype for p in model.parameters())
        results.append((snapshot(model), losses, sd))
    assert_bitwise(results[0][0], results[1][0])
    assert results[0][1] == results[1][1]
    for i in results[0][2]["state"]:
        for k in results[0][2]["state"][i]:
            assert torch.equal(results[0][2]["state"][i][k], results[1][2]["state"][i][k])


def test_remote_resume_uploads_weights(daemon):
    """Remote mode keeps the weights in the daemon: load_state_dict sends the model's current
    weights along, so model.load_state_dict + opt.load_state_dict resume correctly."""
    ref_model = make_model()
    with diond.torch.Optimizer(groups(ref_model), target=daemon.target, remote=True) as opt:
        train(ref_model, opt, 6)
    model = make_model()
    with diond.torch.Optimizer(groups(model), target=daemon.target, remote=True) as opt:
        train(model, opt, 3)
        w, s = {k: v.clone() for k, v in model.state_dict().items()}, opt.state_dict()
    model2 = make_model(seed=7)
    with diond.torch.Optimizer(groups(model2), target=daemon.target, remote=True) as opt2:
        model2.load_state_dict(w)
        opt2.load_state_dict(s)
        train(model2, opt2, 3, first=4)
    assert_bitwise(snapshot(model2), snapshot(ref_model))


def test_bf16_master_weights(daemon):
    model = make_model(dtype=torch.bfloat16)
    with diond.torch.Optimizer(groups(model, ("muon", "muon")), target=daemon.target,
                               fp32_master_weights=True) as opt:
        losses = train(model, opt, 15, dtype=torch.bfloat16)
        assert model[0].weight.dtype == torch.bfloat16
        assert losses[-1] < losses[0]


def test_dion3_alias_and_lion(daemon):
    model = make_model()
    with diond.torch.Optimizer([
            dict(params=[model[0].weight, model[2].weight], algorithm="dion3", fraction=0.5),
            dict(params=[model[4].weight], algorithm="nordion2", fraction=0.5),
            dict(params=[m.bias for m in model if isinstance(m, torch.nn.Linear)],
                 algorithm="lion", lr=1e-4)], target=daemon.target, lr=0.02) as opt:
        losses = train(model, opt, 10)
        assert losses[-1] < losses[0]
        assert set(opt.state_dict()["state"][3]) == {"momentum"}


def test_torch_version_independent_calls():
    """The client uses no torch-2.x-only API: it runs on Debian's torch 1.13 as on 2.x."""
    assert hasattr(torch, "frombuffer")  # since 1.10
    t = torch.frombuffer(bytearray(8), dtype=torch.bfloat16, count=2, offset=4)
    assert t.shape == (2,)


def test_float16_parameters_shm_and_remote(daemon):
    """float16 weights (no model: torch 1.13 has no f16 matmul on CPU): the dtype maps to
    DTYPE_F16, the arena views stay float16, and both modes agree bit for bit."""
    out = []
    for remote in (False, True):
        torch.manual_seed(3)
        w = torch.nn.Parameter(torch.randn(32, 16).half())
        b = torch.nn.Parameter(torch.randn(16).half())
        with diond.torch.Optimizer([dict(params=[w], algorithm="muon"),
                                    dict(params=[b], algorithm="adamw")], lr=0.02,
                                   target=daemon.target, remote=remote) as opt:
            g = torch.Generator().manual_seed(5)
            for _ in range(4):
                w.grad = torch.randn(32, 16, generator=g).half()
                b.grad = torch.randn(16, generator=g).half()
                opt.step()
            assert w.dtype == torch.float16 and b.dtype == torch.float16
        out.append((w.detach().clone(), b.detach().clone()))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
    torch.manual_seed(3)
    assert not torch.equal(out[0][0], torch.randn(32, 16).half())
