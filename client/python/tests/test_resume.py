"""Re-attach after a restart: a trainer process is SIGKILLed after 10 steps; a new
trainer with a freshly initialised model re-attaches by session name (resume=True), gets the
daemon's weights, step counter and optimizer state, and 10 more steps equal 20 uninterrupted ones
bit for bit. The same when the daemon is SIGKILLed too and restarted with --recover."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import diond
import diond.torch
from test_torch_optimizer import assert_bitwise, groups, make_model, snapshot, train

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON = sys.executable


def reference(target, remote):
    model = make_model()
    with diond.torch.Optimizer(groups(model), target=target, remote=remote) as opt:
        train(model, opt, 20)
    return snapshot(model)


def start_trainer(target, name, total, remote):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    return subprocess.Popen([PYTHON, os.path.join(HERE, "resume_trainer.py"), target, name,
                             str(total), "1" if remote else "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)


def run_trainer_until(target, name, total, remote, want):
    """Starts resume_trainer.py, waits for "trained <want>", SIGKILLs it."""
    proc = start_trainer(target, name, total, remote)
    try:
        lines = []
        while True:
            line = proc.stdout.readline().decode().strip()
            lines.append(line)
            if not line or line.startswith("trained"):
                break
        assert line == "trained %d" % want, lines
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize("remote", [False, True], ids=["shm", "remote"])
def test_sigkilled_trainer_is_resumed_by_a_new_one_bitwise(daemon, remote):
    ref = reference(daemon.target, remote)
    name = "job-17/rank-0-%s" % ("remote" if remote else "shm")
    run_trainer_until(daemon.target, name, 10, remote, want=10)
    # The session outlived its trainer.
    listed = {s.session_name: s for s in diond.Client(daemon.target).list_sessions()}
    assert listed[name].last_step_index == 10

    model = make_model(seed=123)  # different weights: everything must come from the daemon
    opt = diond.torch.Optimizer(groups(model), target=daemon.target, session=name, resume=True,
                                remote=remote)
    assert opt.resumed
    assert opt.param_groups[0]["step"] == 10
    train(model, opt, 10, first=11)
    opt.close()
    assert_bitwise(snapshot(model), ref)


def test_resume_without_a_live_session_creates_it_and_names_are_unique(daemon):
    model = make_model()
    opt = diond.torch.Optimizer(groups(model), target=daemon.target, session="job-3/r0",
                                resume=True)
    assert not opt.resumed and opt.param_groups[0]["step"] == 0
    with pytest.raises(diond.DiondError) as e:
        diond.torch.Optimizer(groups(make_model()), target=daemon.target, session="job-3/r0")
    assert e.value.code.name == "ALREADY_EXISTS"
    # A model that does not match the session is refused, and the session is left alone.
    other = torch.nn.Sequential(torch.nn.Linear(24, 8))
    with pytest.raises(ValueError, match="does not match|parameters"):
        diond.torch.Optimizer([dict(params=[other[0].weight], algorithm="muon"),
                               dict(params=[other[0].bias], algorithm="adamw")],
                              target=daemon.target, session="job-3/r0", resume=True)
    train(model, opt, 2)  # the first trainer's regions were not touched by the refused attach
    opt.close()
    with pytest.raises(ValueError, match="needs session"):
        diond.torch.Optimizer(groups(make_model()), target=daemon.target, resume=True)


def test_trainer_and_daemon_sigkilled_recover_bitwise(daemon_factory, tmp_path):
    ref_daemon = daemon_factory()
    ref = reference(ref_daemon.target, remote=False)
    flags = ["--state_dir=%s" % (tmp_path / "state"), "--checkpoint_every=1", "--recover"]
    d = daemon_factory(extra_args=flags)
    run_trainer_until(d.target, "job-5/rank-0", 10, False, want=10)
    d.kill()  # both are gone now
    d.start()  # same socket, --recover restores the session under its name
    assert "--recover: restored 1 session(s)" in open(d.log_path).read()
    model = make_model(seed=7)
    opt = diond.torch.Optimizer(groups(model), target=d.target, session="job-5/rank-0",
                                resume=True)
    assert opt.resumed and opt.param_groups[0]["step"] == 10
    train(model, opt, 10, first=11)
    opt.close()
    assert_bitwise(snapshot(model), ref)


def test_random_trainer_sigkills_resume_bitwise(daemon):
    """A campaign: the trainer process is SIGKILLed after a random number of steps (sometimes in
    the middle of one), three times; each new trainer resumes from the daemon's step counter; the
    run ends equal to 30 uninterrupted steps."""
    import random
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    model = make_model()
    with diond.torch.Optimizer(groups(model), target=daemon.target) as opt:
        train(model, opt, 30)
    ref = snapshot(model)
    name = "job-21/rank-0"
    resumed_at = []
    for _ in range(3):
        proc = start_trainer(daemon.target, name, 30, False)
        try:
            first = proc.stdout.readline().decode().split()
            assert first[0] == "resumed", (seed, first)
            resumed_at.append(int(first[1]))
            for _ in range(rng.randrange(1, 6)):  # a few steps, then die at a random moment
                line = proc.stdout.readline().decode()
                if not line.startswith("step"):
                    break
            time.sleep(rng.random() * 0.05)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    assert resumed_at[0] == 0 and resumed_at == sorted(resumed_at), (seed, resumed_at)
    model = make_model(seed=99)
    opt = diond.torch.Optimizer(groups(model), target=daemon.target, session=name, resume=True)
    assert opt.resumed, seed
    done = opt.param_groups[0]["step"]
    train(model, opt, 30 - done, first=done + 1)
    opt.close()
    assert_bitwise(snapshot(model), ref)
