"""diond.torch.Optimizer(overlap=True) against a real daemon (docs/DATA_PLANE.md "Overlapped
step"): every step after the first is handed to the daemon bucket by bucket during backward, and
the next forward waits per layer. The expectation is independent of the overlap: the same
training with overlap=False, bit for bit (weights, losses, optimizer state)."""
import math
import os
import signal
import subprocess
import sys
import time
import warnings

import grpc
import pytest
import torch

import diond
import diond.torch
from test_torch_optimizer import assert_bitwise, batch, make_model, mse, snapshot

ALGORITHMS = ["muon", "normuon", "dion", "dion2", "dion3", "adamw", "lion"]
HERE = os.path.dirname(os.path.abspath(__file__))
# Small buckets: the test model's six parameters make three or four of them.
BUCKET = 3000


def groups_for(model, algo):
    lin = [m for m in model if isinstance(m, torch.nn.Linear)]
    if algo in ("adamw", "lion"):
        return [dict(params=list(model.parameters()), algorithm=algo, lr=1e-3)]
    return [dict(params=[m.weight for m in lin], algorithm=algo, lr=0.02),
            dict(params=[m.bias for m in lin], algorithm="adamw", lr=1e-3)]


def loop(model, opt, steps, before_step=None, sched=None, dtype=torch.float32):
    losses = []
    for s in range(1, steps + 1):
        x, y = batch(s, dtype)
        opt.zero_grad()
        loss = mse(model(x), y)
        loss.backward()
        if before_step is not None:
            before_step(s, model, opt)
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


def run(daemon, algo, overlap, steps=5, arena="shm", dtype=torch.float32, before_step=None,
        make_sched=None, check=None, **kw):
    model = make_model(dtype=dtype)
    kw.setdefault("overlap_bucket_bytes", BUCKET)
    with diond.torch.Optimizer(groups_for(model, algo), target=daemon.target, arena=arena,
                               overlap=overlap, **kw) as opt:
        sched = make_sched(opt) if make_sched else None
        losses = loop(model, opt, steps, before_step, sched, dtype)
        stats = opt.overlap_stats
        state = opt.state_dict()  # synchronizes
        if check is not None:
            check(opt)
    return snapshot(model), losses, state, stats


def assert_same_run(a, b):
    assert_bitwise(a[0], b[0])
    assert a[1] == b[1]
    for i in a[2]["state"]:
        for k in a[2]["state"][i]:
            assert torch.equal(a[2]["state"][i][k], b[2]["state"][i][k]), (i, k)


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_overlapped_training_equals_synchronous_bitwise(daemon, algo):
    sync = run(daemon, algo, False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback, no unwaited bucket
        ov = run(daemon, algo, True)
    assert sync[3] is None
    assert ov[3]["buckets"] >= 2 and ov[3]["overlapped"] == 4 and ov[3]["synchronous"] == 0
    assert_same_run(sync, ov)


@pytest.mark.parametrize("algo", ["muon", "dion2"])
def test_over_a_sealed_memfd_and_in_bf16(daemon, algo):
    if not diond.fdchannel.supported():
        pytest.skip("no memfd on this platform")
    for kw in (dict(arena="memfd"), dict(dtype=torch.bfloat16, fp32_master_weights=True)):
        sync = run(daemon, algo, False, **kw)
        ov = run(daemon, algo, True, **kw)
        assert ov[3]["overlapped"] == 4 and ov[3]["synchronous"] == 0
        assert_same_run(sync, ov)


def test_a_scheduler_and_zero_grad_without_set_to_none(daemon):
    def sched(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))

    a = run(daemon, "dion", False, make_sched=sched)
    b = run(daemon, "dion", True, make_sched=sched)
    assert b[3]["overlapped"] == 4
    assert_same_run(a, b)


def nan_at(step, which):
    """A gradient hook that makes the gradient of parameter `which` NaN in `step`."""
    count = {"backward": 0}

    def hook(g):
        count["backward"] += 1
        return g * float("nan") if count["backward"] == step else g

    def install(model):
        return list(model.parameters())[which].register_hook(hook)

    return install


def test_a_nan_in_one_bucket_skips_the_whole_step(daemon):
    runs = []
    for overlap in (False, True):
        model = make_model()
        nan_at(3, 2)(model)  # the middle layer's weight: one bucket of several
        with diond.torch.Optimizer(groups_for(model, "muon"), target=daemon.target,
                                   arena="shm", overlap=overlap,
                                   overlap_bucket_bytes=BUCKET) as opt:
            losses = loop(model, opt, 5)
            resp = opt.synchronize()
            runs.append((snapshot(model), losses, opt.state_dict(), opt.overlap_stats))
            assert resp.step_index == 5
    assert runs[1][3]["overlapped"] == 4
    assert_same_run(runs[0], runs[1])


def test_a_nan_under_error_fails_at_the_next_forward_with_nothing_applied(daemon):
    model = make_model()
    nan_at(3, 2)(model)
    ref = make_model()
    with diond.torch.Optimizer(groups_for(ref, "muon"), target=daemon.target, arena="shm") as r:
        loop(ref, r, 2)
    with diond.torch.Optimizer(groups_for(model, "muon"), target=daemon.target, arena="shm",
                               overlap=True, overlap_bucket_bytes=BUCKET,
                               non_finite_policy="error") as opt:
        loop(model, opt, 3)  # step 3 is handed over with a NaN and fails in the daemon
        x, _ = batch(4)
        with pytest.raises(diond.DiondError) as e:
            model(x)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION or "finite" in str(e.value)
        assert opt._step_index == 2 and all(g["step"] == 2 for g in opt.param_groups)
        assert_bitwise(snapshot(model), snapshot(ref))


def test_refused_where_not_built(daemon):
    model = make_model()
    with pytest.raises(ValueError, match="remote mode are not built"):
        diond.torch.Optimizer(groups_for(model, "muon"), target=daemon.target, remote=True,
                              overlap=True)
    with pytest.raises(ValueError, match="remote mode are not built"):
        diond.torch.Optimizer(groups_for(model, "muon"), target=daemon.target, remote=True,
                              overlap="delayed")
    with pytest.raises(ValueError, match="overlap_bucket_bytes"):
        diond.torch.Optimizer(groups_for(model, "muon"), target=daemon.target, overlap=True,
                              overlap_bucket_bytes=0)
    # Nothing was left behind: the daemon has no session of these.
    with diond.Client(daemon.target) as c:
        assert not [s for s in c.list_sessions() if s.client_name == "diond.torch"]


def test_a_trainer_killed_mid_step_leaves_nothing_committed(daemon):
    """The trainer dies after backward handed some buckets over: the daemon's step waits for
    the last one, until the daemon finds every process of the session gone (its reaper looks
    every second) and gives the step up. A new trainer resumes the session: the step counter
    and the weights are those before the killed step, and training on equals an uninterrupted
    synchronous run bit for bit."""
    ref = make_model()
    with diond.torch.Optimizer(groups_for(ref, "muon"), target=daemon.target,
                               arena="shm") as opt:
        loop(ref, opt, 6)
    name = "overlap-killed"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "overlap_trainer.py"),
                             daemon.target, name, "3"], stdout=subprocess.PIPE, env=env)
    try:
        line = proc.stdout.readline().decode().strip()
        assert line == "mid-step 4", line
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    wait_for_log(daemon, "exited during an overlapped step")
    model = make_model(seed=123)  # everything must come from the daemon
    with diond.torch.Optimizer(groups_for(model, "muon"), target=daemon.target, session=name,
                               resume=True, arena="shm", overlap=True,
                               overlap_bucket_bytes=BUCKET) as opt:
        assert opt.resumed and opt.param_groups[0]["step"] == 3
        losses = []
        for s in range(4, 7):
            x, y = batch(s)
            opt.zero_grad()
            loss = mse(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        opt.synchronize()
        assert opt.overlap_stats["overlapped"] == 2
    assert_bitwise(snapshot(model), snapshot(ref))


def wait_for_log(daemon, text, seconds=30):
    deadline = time.monotonic() + seconds
    while text not in daemon.log_tail(200):
        assert time.monotonic() < deadline, "no %r in the daemon's log:\n%s" % (
            text, daemon.log_tail())
        time.sleep(0.05)


def accumulate_loop(model, opt, steps, no_sync):
    for s in range(1, steps + 1):
        opt.zero_grad()
        for micro in range(3):
            x, y = batch(10 * s + micro)
            last = micro == 2
            if no_sync and not last:
                with opt.no_sync():
                    mse(model(x), y).backward()
            else:
                mse(model(x), y).backward()
        opt.step()


def test_gradient_accumulation_signals_on_the_last_micro_batch(daemon):
    runs = []
    for overlap in (False, True):
        model = make_model()
        with diond.torch.Optimizer(groups_for(model, "dion2"), target=daemon.target,
                                   arena="shm", overlap=overlap,
                                   overlap_bucket_bytes=BUCKET) as opt:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                accumulate_loop(model, opt, 4, no_sync=True)
            opt.synchronize()
            runs.append((snapshot(model), opt.overlap_stats))
    assert runs[1][1] == {"buckets": runs[1][1]["buckets"], "overlapped": 3, "synchronous": 0}
    assert_bitwise(runs[0][0], runs[1][0])


def test_module_zero_grad_and_evaluation_between_steps(daemon):
    """model.zero_grad (torch 1.13: in place) and an evaluation forward under no_grad right after
    step(): the evaluation waits for the new weights."""
    outs = []
    for overlap in (False, True):
        model = make_model()
        with diond.torch.Optimizer(groups_for(model, "muon"), target=daemon.target,
                                   arena="shm", overlap=overlap,
                                   overlap_bucket_bytes=BUCKET) as opt:
            evals = []
            for s in range(1, 5):
                x, y = batch(s)
                model.zero_grad()
                mse(model(x), y).backward()
                opt.step()
                with torch.no_grad():
                    evals.append(model(batch(100)[0]))
            # model.state_dict() right after step() holds the step's weights (it synchronizes).
            x, y = batch(5)
            model.zero_grad()
            mse(model(x), y).backward()
            opt.step()
            saved = {k: v.clone() for k, v in model.state_dict().items()}
            outs.append((list(saved.values()), evals))
    assert_bitwise(outs[0][0], outs[1][0])
    assert_bitwise(outs[0][1], outs[1][1])


def clip(s, model, opt):
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)


def accumulate_outside_no_sync(s, model, opt):
    x, y = batch(50 + s)
    mse(model(x), y).backward()  # a second micro-batch after the buckets went


def freeze_from_step_3(s, model, opt):
    if s == 3:  # frozen after this backward: step 3 still has its gradient
        model[4].bias.requires_grad_(False)


@pytest.mark.parametrize("change,synchronous", [(clip, 4), (accumulate_outside_no_sync, 4)],
                         ids=["clip_grad_norm_", "accumulation"])
def test_gradients_written_after_backward_make_the_step_synchronous(daemon, change, synchronous):
    sync = run(daemon, "muon", False, before_step=change)
    with pytest.warns(RuntimeWarning, match="ran synchronously") as caught:
        ov = run(daemon, "muon", True, before_step=change)
    assert len([w for w in caught if "ran synchronously" in str(w.message)]) == 1
    assert ov[3]["synchronous"] == synchronous and ov[3]["overlapped"] == 4 - synchronous
    assert_same_run(sync, ov)


def test_a_new_set_of_parameters_without_a_gradient(daemon):
    sync = run(daemon, "dion", False, steps=6, before_step=freeze_from_step_3)
    with pytest.warns(RuntimeWarning, match="without a gradient changed"):
        ov = run(daemon, "dion", True, steps=6, before_step=freeze_from_step_3)
    # Step 4 finds the bias without a gradient (announced with it: the previous step's set);
    # from step 5 the new set is announced.
    assert ov[3] == {"buckets": ov[3]["buckets"], "overlapped": 4, "synchronous": 1}
    assert_same_run(sync, ov)


def test_one_bucket_overlaps_nothing_but_stays_exact(daemon):
    sync = run(daemon, "dion2", False)
    ov = run(daemon, "dion2", True, overlap_bucket_bytes=1 << 30)
    assert ov[3] == {"buckets": 1, "overlapped": 4, "synchronous": 0}
    assert_same_run(sync, ov)


@pytest.mark.parametrize("algo", ["muon", "dion2", "adamw"])
def test_delayed_mode_is_one_step_stale_exactly(daemon, algo):
    """overlap="delayed" against its definition, computed with a synchronous optimizer: step t
    applies the gradient taken at w_{t-2} (w_0 for t = 1, 2) to w_{t-1}."""
    steps = 5
    live, probe = make_model(), make_model()
    snaps = [snapshot(live)]  # w_0, w_1, ...
    with diond.torch.Optimizer(groups_for(live, algo), target=daemon.target, arena="shm") as opt:
        for t in range(1, steps + 1):
            with torch.no_grad():
                for p, w in zip(probe.parameters(), snaps[max(t - 2, 0)]):
                    p.copy_(w)
            probe.zero_grad(set_to_none=True)
            x, y = batch(t)
            mse(probe(x), y).backward()
            opt.zero_grad()
            for p, q in zip(live.parameters(), probe.parameters()):
                p.grad.copy_(q.grad)
            opt.step()
            snaps.append(snapshot(live))
    model = make_model()
    with diond.torch.Optimizer(groups_for(model, algo), target=daemon.target, arena="shm",
                               overlap="delayed") as opt:
        losses = loop(model, opt, steps)
        assert opt._step_index == steps - 1  # the last step is still in the daemon
        opt.synchronize()
        assert opt._step_index == steps
        assert_bitwise(snapshot(model), snaps[steps])
    assert losses[0] == losses[0] and all(math.isfinite(v) for v in losses)


def test_a_dropped_optimizer_leaves_a_model_that_trains_on(daemon):
    """The optimizer is garbage-collected mid-training (no close()): its hooks go with it, and
    the model's forward and backward run as plain torch's, with the step's weights."""
    import gc
    model = make_model()
    opt = diond.torch.Optimizer(groups_for(model, "muon"), target=daemon.target, arena="shm",
                                overlap=True, overlap_bucket_bytes=BUCKET)
    loop(model, opt, 3)
    assert opt.overlap_stats["overlapped"] == 2
    del opt
    gc.collect()
    ref = make_model()
    with diond.torch.Optimizer(groups_for(ref, "muon"), target=daemon.target, arena="shm") as r:
        loop(ref, r, 3)
    assert_bitwise(snapshot(model), snapshot(ref))  # the last step landed before the arena went
    x, y = batch(9)
    model.zero_grad()
    mse(model(x), y).backward()  # no hook of the dead optimizer runs, nothing hangs
    assert all(p.grad is not None for p in model.parameters())


def test_delayed_warmup_steps_run_synchronously(daemon):
    """The first delayed_warmup_steps steps equal synchronous ones; the rest are stale."""
    sync = run(daemon, "muon", False, steps=4)
    warm = run(daemon, "muon", "delayed", steps=4, delayed_warmup_steps=4)
    stale = run(daemon, "muon", "delayed", steps=4, delayed_warmup_steps=2)
    assert_same_run(sync, warm)
    # Step 3 still takes its gradient at w_2, as a synchronous step does; step 4 takes it at
    # w_2 instead of w_3.
    assert sync[1][:3] == stale[1][:3] and sync[1][3] != stale[1][3]
    assert not all(torch.equal(a, b) for a, b in zip(sync[0], stale[0]))


@pytest.mark.parametrize("waiting", [False, True], ids=["idle", "a_wait_rpc"])
def test_the_daemon_stops_promptly_during_an_overlapped_step(fresh_daemon, waiting):
    """SIGTERM while a step waits for the last bucket (the trainer never called step()), also
    with a Step wait RPC pending on it: the daemon cancels the step and exits cleanly."""
    import threading
    import time
    model = make_model()
    opt = diond.torch.Optimizer(groups_for(model, "muon"), target=fresh_daemon.target,
                                arena="shm", overlap=True, overlap_bucket_bytes=BUCKET)
    loop(model, opt, 2)
    x, y = batch(3)
    opt.zero_grad()
    mse(model(x), y).backward()  # step 3 is in the daemon, waiting for the held bucket
    assert opt._ov.started
    errors = []
    if waiting:
        def wait():
            try:
                opt.client.wait_step(opt.session_id, 3, timeout=30)
            except diond.DiondError as e:
                errors.append(e)
        th = threading.Thread(target=wait)
        th.start()
        time.sleep(0.3)
    t = time.monotonic()
    rc = fresh_daemon.stop(timeout=20)
    took = time.monotonic() - t
    assert rc == 0, fresh_daemon.log_tail()
    assert took < 12, "the daemon took %.1f s to stop" % took
    if waiting:
        th.join()
        assert errors and errors[0].code in (grpc.StatusCode.CANCELLED,
                                             grpc.StatusCode.UNAVAILABLE), errors
    opt._bind.client = None  # the daemon is gone; close() must not wait on it
    opt.close()


def test_the_daemon_clip_keeps_the_step_overlapped(daemon):
    sync = run(daemon, "muon", False, max_grad_norm=0.05,
               check=lambda opt: NORMS.setdefault("sync", opt.last_grad_norm))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ov = run(daemon, "muon", True, max_grad_norm=0.05,
                 check=lambda opt: NORMS.setdefault("ov", opt.last_grad_norm))
    assert ov[3]["overlapped"] == 4 and ov[3]["synchronous"] == 0
    assert_same_run(sync, ov)
    assert NORMS["sync"] == NORMS["ov"] > 0.05  # the clip was engaged


NORMS = {}


def test_the_daemon_clip_is_torchs_clip_grad_norm(daemon):
    """Against torch.nn.utils.clip_grad_norm_ in the trainer (another summation order, a float32
    coefficient): the same norm and, after 5 steps, the same weights to float rounding."""
    norms = []

    def clip_in_trainer(s, model, opt):
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))

    trainer = run(daemon, "dion", False, before_step=clip_in_trainer)
    daemon_norms = []  # step s - 1's, collected by step s's backward

    def collected(s, model, opt):
        if s > 1:
            daemon_norms.append(opt.last_grad_norm)

    ov = run(daemon, "dion", True, max_grad_norm=0.05, before_step=collected)
    assert norms[0] > 0.05  # the clip was engaged
    # Step 1's gradients are the same in both runs; later ones differ by rounding.
    assert daemon_norms[0] == pytest.approx(norms[0], rel=1e-6)
    assert daemon_norms == pytest.approx(norms[:4], rel=1e-4)
    for a, b in zip(trainer[0], ov[0]):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), (a - b).abs().max()


def test_max_grad_norm_is_checked(daemon):
    model = make_model()
    for bad in (0, -1.0, float("nan"), float("inf"), "1"):
        with pytest.raises(ValueError, match="max_grad_norm"):
            diond.torch.Optimizer(groups_for(model, "muon"), target=daemon.target,
                                  max_grad_norm=bad)
