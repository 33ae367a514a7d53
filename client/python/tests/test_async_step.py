"""Asynchronous Step from Python (docs/DATA_PLANE.md "Asynchronous Step"), against a real
daemon over its Unix socket and shared memory: diond.torch.Optimizer.step(asynchronous=True)
plus synchronize() trains bit for bit like synchronous steps (memfd, shm and remote mode); a
queued step's failure is raised by the call that synchronizes, with its step index, and the
step counter does not advance; the raw client sees the daemon's refusals while a step is
queued."""
import math

import grpc
import pytest
import torch

import diond
import diond.torch
from test_torch_optimizer import assert_bitwise, batch, groups, make_model, mse, snapshot, train


def train_async(model, opt, steps):
    losses = []
    for s in range(1, steps + 1):
        x, y = batch(s)
        opt.zero_grad()  # synchronizes with the step queued before
        loss = mse(model(x), y)
        loss.backward()
        opt.step(asynchronous=True)
        assert opt.last_step.queued and opt.last_step.step_index == s
        # Work that does not touch the model may run here; then the weights are the daemon's.
        resp = opt.synchronize()
        assert not resp.queued and resp.step_index == s and len(resp.update_norms) == 3
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("mode", ["memfd", "shm", "remote"])
def test_async_steps_match_sync_steps_bitwise(daemon, mode):
    kw = dict(remote=True) if mode == "remote" else dict(arena=mode)
    runs = []
    for asynchronous in (False, True):
        model = make_model()
        with diond.torch.Optimizer(groups(model, ("dion", "muon")), target=daemon.target,
                                   **kw) as opt:
            losses = (train_async if asynchronous else train)(model, opt, 4)
            norms = dict(opt.last_step.update_norms)
            sd = opt.state_dict()
            assert opt._step_index == 4 and all(g["step"] == 4 for g in opt.param_groups)
        runs.append((snapshot(model), losses, norms, sd))
    assert_bitwise(runs[0][0], runs[1][0])
    assert runs[0][1] == runs[1][1]
    assert runs[0][2] == runs[1][2]
    for i in runs[0][3]["state"]:
        for k in runs[0][3]["state"][i]:
            assert torch.equal(runs[0][3]["state"][i][k], runs[1][3]["state"][i][k])


def test_a_queued_failure_is_raised_by_synchronize_and_the_counter_stays(daemon):
    model = make_model()
    opt = diond.torch.Optimizer(groups(model), target=daemon.target, non_finite_policy="error")
    try:
        train(model, opt, 1)
        before = snapshot(model)
        opt.zero_grad()
        mse(model(batch(2)[0]), batch(2)[1]).backward()
        model[0].weight.grad[0, 0] = math.nan
        opt.step(asynchronous=True)  # valid request: queued
        with pytest.raises(diond.DiondError) as e:
            opt.synchronize()
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "asynchronous step 2 failed" in e.value.message
        assert opt._step_index == 1
        assert_bitwise(snapshot(model), before)
        # Retried with finite gradients: step 2 applies.
        model[0].weight.grad[0, 0] = 0.0
        opt.step(asynchronous=True)
        assert opt.synchronize().step_index == 2 and opt._step_index == 2
    finally:
        opt.close()


def test_raw_client_refusals_while_a_step_is_queued(daemon):
    model = make_model()
    opt = diond.torch.Optimizer(groups(model), target=daemon.target)
    try:
        c, sid = opt.client, opt.session_id
        r = c.step(sid, 1, asynchronous=True)
        assert r.queued
        with pytest.raises(diond.DiondError) as e:
            c.get_state(sid)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "step 1 was queued by an asynchronous Step" in e.value.message
        with pytest.raises(diond.DiondError) as e:
            c.step(sid, 5, asynchronous=True)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "the next Step is 2" in e.value.message
        # The next step collects the queued one.
        r2 = c.step(sid, 2, asynchronous=True)
        assert r2.queued and r2.HasField("previous") and r2.previous.step_index == 1
        done = c.wait_step(sid)
        assert done.step_index == 2 and not done.replayed
        # A retried wait (its answer lost) replays the last answer.
        again = c.wait_step(sid)
        assert again.replayed and again.update_norms == done.update_norms
        opt._step_index = 2
        for g in opt.param_groups:
            g["step"] = 2
    finally:
        opt.close()


def test_close_with_a_queued_step(daemon):
    model = make_model()
    opt = diond.torch.Optimizer(groups(model), target=daemon.target)
    train(model, opt, 1)
    opt.zero_grad()
    mse(model(batch(2)[0]), batch(2)[1]).backward()
    opt.step(asynchronous=True)
    sid = opt.session_id
    opt.close()  # the daemon finishes the step, then closes the session
    with diond.Client(daemon.target) as c:
        with pytest.raises(diond.DiondError) as e:
            c.wait_step(sid)
    assert e.value.code == grpc.StatusCode.NOT_FOUND
