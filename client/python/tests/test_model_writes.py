"""The trainer's own writes and groups added later, as with torch.optim:
  * a parameter the trainer writes between steps (model.load_state_dict, copy_, nn.init) is
    where the next step starts, also where the daemon keeps its own copy (fp32 master weights,
    remote mode);
  * add_param_group after construction keeps the existing groups' state bit for bit, and both
    the old and the new groups then train exactly as optimizers that had them alone."""
import pytest
import torch

import diond.torch


def model_pair(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    a = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 6))
    b = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 6))
    return a.to(dtype), b.to(dtype)


def groups(m, lr=0.02):
    return [dict(params=[m[0].weight, m[2].weight], algorithm="muon", lr=lr),
            dict(params=[m[0].bias, m[2].bias], algorithm="adamw", lr=1e-2)]


def batch(s, dtype):
    g = torch.Generator().manual_seed(500 + s)
    return torch.randn(16, 12, generator=g).to(dtype), torch.randn(16, 6, generator=g).to(dtype)


def loss_of(models, s, dtype=torch.float32):
    """A sum of independent terms: each model's gradient depends on that model only."""
    x, y = batch(s, dtype)
    return sum(((m(x).float() - y.float()) ** 2).mean() for m in models)


def run(models, opt, steps, dtype=torch.float32):
    for s in steps:
        opt.zero_grad()
        loss_of(models, s, dtype).backward()
        opt.step()


def params(m):
    return [p.detach().clone() for p in m.parameters()]


def assert_equal(a, b, what):
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), "%s: parameter %d differs (max |d| = %g)" % (
            what, i, (x.float() - y.float()).abs().max().item())


MODES = [dict(fp32_master_weights=True, dtype=torch.bfloat16, remote=False),
         dict(fp32_master_weights=False, dtype=torch.float32, remote=True),
         dict(fp32_master_weights=True, dtype=torch.bfloat16, remote=True)]


@pytest.mark.parametrize("mode", MODES, ids=["master-shm", "remote", "master-remote"])
@pytest.mark.parametrize("write", ["load_state_dict", "copy_", "init"])
def test_trainer_writes_are_where_the_next_step_starts(daemon, mode, write):
    dtype = mode["dtype"]
    kw = dict(target=daemon.target, fp32_master_weights=mode["fp32_master_weights"],
              remote=mode["remote"])
    finals = []
    for explicit_sync in (False, True):
        m, _ = model_pair(dtype=dtype)
        opt = diond.torch.Optimizer(groups(m), **kw)
        run([m], opt, range(1, 4), dtype)
        good = {k: v.clone() for k, v in m.state_dict().items()}
        run([m], opt, range(4, 6), dtype)
        if write == "load_state_dict":  # the rollback idiom
            m.load_state_dict(good)
        elif write == "copy_":
            with torch.no_grad():
                for p, v in zip(m.parameters(), good.values()):
                    p.copy_(v)
        else:
            torch.manual_seed(7)
            with torch.no_grad():
                for p in m.parameters():
                    torch.nn.init.normal_(p, std=0.1)
        written = params(m)
        if explicit_sync:
            opt.sync_parameters()  # the explicit way, as the expectation
        # A step at lr 0 (AdamW has weight decay 0.01 x lr = 0 too) leaves the weights where
        # they start: exactly the written ones.
        for g in opt.param_groups:
            g["lr"] = 0.0
        run([m], opt, [6], dtype)
        assert_equal(params(m), written, "a step at lr 0 after %s" % write)
        for g, lr in zip(opt.param_groups, (0.02, 1e-2)):
            g["lr"] = lr
        run([m], opt, range(7, 9), dtype)
        finals.append(params(m))
        opt.close()
    assert_equal(finals[0], finals[1], "training on after %s vs. explicit sync" % write)


@pytest.mark.parametrize("remote", [False, True], ids=["shm", "remote"])
def test_add_param_group_keeps_state_and_trains_exactly(daemon, remote):
    kw = dict(target=daemon.target, remote=remote)
    backbone, head = model_pair()
    head0 = params(head)
    opt = diond.torch.Optimizer(groups(backbone), **kw)
    run([backbone, head], opt, range(1, 4))  # the head is frozen: not in the optimizer
    before = opt.state_dict()
    assert_equal(params(head), head0, "the head before it joins")
    for g in groups(head, lr=0.03):
        opt.add_param_group(g)
    assert len(opt.param_groups) == 4
    after = opt.state_dict()
    for i, st in before["state"].items():
        for k, v in st.items():
            assert torch.equal(after["state"][i][k], v), (i, k)
    assert all(after["state"].get(i, {}) == {} or all(
        not v.any() for v in after["state"][i].values()) for i in range(4, 8))
    run([backbone, head], opt, range(4, 7))
    got_backbone, got_head = params(backbone), params(head)
    opt.close()

    # The expectations: each model alone in its own optimizer, over the same batches (the
    # losses are independent), the head's from its step 4 on with fresh state.
    b2, h2 = model_pair()
    o = diond.torch.Optimizer(groups(b2), **kw)
    run([b2], o, range(1, 7))
    o.close()
    assert_equal(got_backbone, params(b2), "the existing groups after add_param_group")
    o = diond.torch.Optimizer(groups(h2, lr=0.03), **kw)
    run([h2], o, range(4, 7))
    o.close()
    assert_equal(got_head, params(h2), "the added groups")


def test_add_param_group_refusals_leave_the_optimizer_working(daemon):
    m, h = model_pair()
    opt = diond.torch.Optimizer(groups(m), target=daemon.target)
    with pytest.raises(ValueError, match="needs matrices"):
        opt.add_param_group(dict(params=[h[0].bias], algorithm="muon"))
    with pytest.raises(ValueError, match="some parameters appear in more than one"):
        opt.add_param_group(dict(params=[m[0].weight], algorithm="muon"))
    assert len(opt.param_groups) == 2
    run([m], opt, range(1, 3))
    opt.close()
