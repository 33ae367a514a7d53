"""World sessions from PyTorch: two daemons form a world, one trainer per daemon, each with its
own diond.torch.Optimizer created with the same world_key. The daemons shard the work and the
optimizer state; every trainer must end each step with the same weights as a single-daemon run
(the owners' math is the same code, so bit for bit)."""
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch

import diond
import diond.torch
from test_overlap_step import BUCKET, HERE, groups_for, loop, wait_for_log
from test_torch_optimizer import assert_bitwise, batch, make_model, mse, snapshot


def _world(daemon_factory, size=2):
    flags = ["--world_size=%d" % size, "--heartbeat_interval=200ms", "--peer_timeout=5s"]
    d0 = daemon_factory(tcp=True, extra_args=flags + ["--rank=0"])
    port = d0.tcp_target.rsplit(":", 1)[1]
    return [d0] + [daemon_factory(extra_args=flags + ["--rank=%d" % r,
                                                      "--coordinator=127.0.0.1:" + port])
                   for r in range(1, size)]


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(24, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16),
                               torch.nn.Tanh(), torch.nn.Linear(16, 8))


def _groups(model):
    mats = [p for p in model.parameters() if p.ndim == 2]
    vecs = [p for p in model.parameters() if p.ndim != 2]
    return [dict(params=mats), dict(params=vecs, algorithm="adamw", lr=1e-3)]


def _grads(step, model):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g) for p in model.parameters()]


def _train(opt, model, steps):
    for step in range(1, steps + 1):
        for p, g in zip(model.parameters(), _grads(step, model)):
            p.grad.copy_(g)
        opt.step()


def _square_loss_steps(opt, model, steps, seed_base, device="cpu"):
    """`steps` steps of the mean square of the model's output on N(0, 1) batches seeded
    seed_base + step; under overlap=True every step after the first must have overlapped.
    Collected (synchronize) at the end."""
    for step in range(1, steps + 1):
        x = torch.randn(8, 24, generator=torch.Generator().manual_seed(seed_base + step))
        opt.zero_grad()
        model(x.to(device)).square().mean().backward()
        opt.step()
    if opt.overlap_stats is not None:
        assert opt.overlap_stats["overlapped"] == steps - 1, opt.overlap_stats
    opt.synchronize()


def _on_all_ranks(fns):
    errors = []

    def run(f):
        try:
            f()
        except Exception as e:  # surfaced below, with its rank
            errors.append(e)

    threads = [threading.Thread(target=run, args=(f,)) for f in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a trainer hung"
    if errors:
        raise errors[0]


@pytest.mark.parametrize("algorithm", ["muon", "dion2"])
def test_two_daemons_match_one_daemon_bit_for_bit(daemon_factory, algorithm):
    steps = 3
    ref_daemon = daemon_factory()
    ref_model = _model()
    with diond.torch.Optimizer(_groups(ref_model), target=ref_daemon.target,
                               algorithm=algorithm, lr=0.02) as ref:
        for p in ref_model.parameters():
            p.grad = torch.zeros_like(p)
        _train(ref, ref_model, steps)
        expected = [p.detach().clone() for p in ref_model.parameters()]

    daemons = _world(daemon_factory)
    models = [_model(), _model()]
    opts = [None, None]
    states = [None, None]

    def trainer(rank):
        def f():
            model = models[rank]
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
            opts[rank] = diond.torch.Optimizer(_groups(model), target=daemons[rank].target,
                                               algorithm=algorithm, lr=0.02,
                                               world_key="py-world-" + algorithm)
            _train(opts[rank], model, steps)
            states[rank] = opts[rank].state_dict()
            opts[rank].close()
        return f

    _on_all_ranks([trainer(0), trainer(1)])
    for rank in (0, 1):
        for got, want in zip(models[rank].parameters(), expected):
            assert torch.equal(got.detach(), want), "rank %d differs from one daemon" % rank
    # The optimizer state is sharded: every parameter's state lives on exactly one rank.
    held = [set(states[r]["state"].keys()) for r in (0, 1)]
    assert held[0].isdisjoint(held[1])
    assert held[0] | held[1] == set(range(len(expected)))


def test_average_with_a_daemon_clip_clips_the_mean_gradient(daemon_factory):
    """max_grad_norm in a world under AVERAGE: the norm is the averaged gradients', as
    clip_grad_norm_ after DDP's all-reduce; one daemon clipping the mean gradients is the
    reference, bit for bit (the mean of two is exact), and its norm is the mean's, in double."""
    steps = 3

    def rank_grads(step, rank, model):
        g = torch.Generator().manual_seed(1000 * rank + step)
        return [torch.randn(p.shape, generator=g) for p in model.parameters()]

    def mean_grads(step, model):
        return [(a + b) / 2 for a, b in zip(rank_grads(step, 0, model),
                                            rank_grads(step, 1, model))]

    ref_model = _model()
    norms = []
    with diond.torch.Optimizer(_groups(ref_model), target=daemon_factory().target,
                               algorithm="muon", lr=0.02, max_grad_norm=1.0) as ref:
        for step in range(1, steps + 1):
            for p, g in zip(ref_model.parameters(), mean_grads(step, ref_model)):
                p.grad = g.clone()
            ref.step()
            norms.append(ref.last_grad_norm)
            want = float(sum(g.double().pow(2).sum() for g in mean_grads(step, ref_model)).sqrt())
            assert abs(ref.last_grad_norm - want) <= 1e-12 * want
            assert ref.last_grad_norm > 1.0  # clipped
        expected = [p.detach().clone() for p in ref_model.parameters()]

    daemons = _world(daemon_factory)
    models = [_model(), _model()]
    got_norms = [[], []]

    def trainer(rank):
        def f():
            model = models[rank]
            with diond.torch.Optimizer(_groups(model), target=daemons[rank].target,
                                       algorithm="muon", lr=0.02, max_grad_norm=1.0,
                                       world_key="py-world-clip", gradient_sync="average") as opt:
                for step in range(1, steps + 1):
                    for p, g in zip(model.parameters(), rank_grads(step, rank, model)):
                        p.grad = g.clone()
                    opt.step()
                    got_norms[rank].append(opt.last_grad_norm)
        return f

    _on_all_ranks([trainer(0), trainer(1)])
    for rank in (0, 1):
        assert got_norms[rank] == norms, "rank %d" % rank
        for got, want in zip(models[rank].parameters(), expected):
            assert torch.equal(got.detach(), want), "rank %d differs from one daemon" % rank


def test_world_options_are_checked():
    with pytest.raises(ValueError, match="gradient_sync"):
        diond.torch.Optimizer([torch.nn.Parameter(torch.zeros(4, 4))], target="unix:/nonexistent",
                              gradient_sync="sometimes")
    with pytest.raises(ValueError, match="needs a world_key"):
        diond.torch.Optimizer([torch.nn.Parameter(torch.zeros(4, 4))], target="unix:/nonexistent",
                              gradient_sync="average")


@pytest.mark.parametrize("algorithm,size,sync", [
    ("muon", 2, "average"), ("dion", 2, "average"), ("muon", 3, "average"),
    ("dion2", 3, "average"), ("dion", 2, "dion_compressed")])
def test_overlapped_steps_in_a_world_equal_synchronous_ones(daemon_factory, algorithm, size,
                                                            sync):
    """overlap=True in a world of 2 or 3 (each trainer its own data): the daemons take the
    buckets in declaration order, reduce-scatter each and exchange its updates, or under
    dion_compressed step Dion on every rank, averaging P and R bucket by bucket
    (docs/DISTRIBUTED.md "Overlapped step"); the weights equal overlap=False's on every rank,
    bit for bit. With 3 ranks and buckets of one or two parameters, a rank owns nothing of
    some bucket (its block is only the flag)."""
    steps = 4
    daemons = _world(daemon_factory, size)
    ranks = range(size)
    result = {}
    # Made here: torch's global generator is not for two threads at once.
    models = {(rank, overlap): _model() for rank in ranks for overlap in (False, True)}

    def trainer(rank):
        def f():
            for overlap in (False, True):
                model = models[(rank, overlap)]
                opt = diond.torch.Optimizer(_groups(model), target=daemons[rank].target,
                                            algorithm=algorithm, lr=0.02, overlap=overlap,
                                            overlap_bucket_bytes=1500, gradient_sync=sync,
                                            world_key="py-overlap-%s-%d-%s-%s" % (
                                                algorithm, size, sync, overlap))
                _square_loss_steps(opt, model, steps, 1000 * rank)
                result[(rank, overlap)] = [p.detach().clone() for p in model.parameters()]
                opt.close()
        return f

    _on_all_ranks([trainer(r) for r in ranks])
    for rank in ranks:
        for got, want, ref in zip(result[(rank, True)], result[(rank, False)], result[(0, False)]):
            assert torch.equal(got, want), "rank %d: overlap=True differs" % rank
            assert torch.equal(want, ref), "the ranks differ"


@pytest.mark.parametrize("sync,data", [("average", "same"), ("replicated", "same"),
                                       ("average", "own")])
def test_delayed_steps_in_a_world(daemon_factory, sync, data):
    """overlap="delayed" in a world of 2 (docs/DISTRIBUTED.md "Asynchronous steps"): each
    trainer's step N is a queued world step while its next forward and backward run on
    w_{N-1}. With the same data on both ranks the averaged gradient is each rank's own, so both
    trainers end with one daemon's delayed run, bit for bit; with data of their own (AVERAGE)
    both end with the same weights, which differ from the same-data run."""
    steps = 5
    ref_model = _model()
    with diond.torch.Optimizer(_groups(ref_model), target=daemon_factory().target, lr=0.02,
                               overlap="delayed") as ref:
        _square_loss_steps(ref, ref_model, steps, 0)
    expected = [p.detach().clone() for p in ref_model.parameters()]
    daemons = _world(daemon_factory)
    models = [_model(), _model()]

    def trainer(rank):
        def f():
            with diond.torch.Optimizer(_groups(models[rank]), target=daemons[rank].target,
                                       lr=0.02, overlap="delayed", gradient_sync=sync,
                                       world_key="py-delayed-%s-%s" % (sync, data)) as opt:
                _square_loss_steps(opt, models[rank], steps,
                                   1000 * rank if data == "own" else 0)
                assert opt._step_index == steps
        return f

    _on_all_ranks([trainer(0), trainer(1)])
    for a, b, want in zip(models[0].parameters(), models[1].parameters(), expected):
        assert torch.equal(a.detach(), b.detach()), "the ranks differ"
        if data == "same":
            assert torch.equal(a.detach(), want), "differs from one daemon's delayed run"
    if data == "own":
        assert not all(torch.equal(p.detach(), w) for p, w in zip(models[0].parameters(),
                                                                   expected))


def test_a_trainer_killed_mid_step_fails_that_step_on_every_rank(daemon_factory):
    """overlap=True in a world of 2 under AVERAGE: rank 0's trainer (a process of its own) is
    SIGKILLed in step 4's backward, its daemon's step waiting for the last bucket while rank 1's
    waits in that bucket's collective. Rank 0's daemon finds its trainer gone and gives the step
    up, so rank 1's step 4 fails as given up on rank 0 (not on --peer_timeout, which would break
    the world session), with nothing committed: rank 1's weights are those of step 3."""
    flags = ["--world_size=2", "--heartbeat_interval=200ms", "--peer_timeout=120s"]
    d0 = daemon_factory(tcp=True, extra_args=flags + ["--rank=0"])
    port = d0.tcp_target.rsplit(":", 1)[1]
    d1 = daemon_factory(extra_args=flags + ["--rank=1", "--coordinator=127.0.0.1:" + port])
    key = "py-killed-in-a-world"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "overlap_trainer.py"),
                             d0.target, "", "3", key], stdout=subprocess.PIPE, env=env)
    out = {}

    def rank1():
        model = make_model()
        with diond.torch.Optimizer(groups_for(model, "muon"), target=d1.target, arena="shm",
                                   overlap=True, overlap_bucket_bytes=BUCKET,
                                   gradient_sync="average", world_key=key) as opt:
            loop(model, opt, 3)
            opt.synchronize()
            out["before"] = snapshot(model)
            x, y = batch(4)
            opt.zero_grad()
            mse(model(x), y).backward()
            try:
                opt.step()
                opt.synchronize()
            except Exception as e:  # the step's failure, checked below
                out["error"] = e
            out["after"] = snapshot(model)

    _on_all_ranks([rank1, lambda: _kill_mid_step(proc, out)])
    assert "mid-step 4" == out["line"], out["line"]
    assert "error" in out, "rank 1's step 4 did not fail"
    assert "given up on rank(s) 0" in str(out["error"]), out["error"]
    assert_bitwise(out["after"], out["before"])
    wait_for_log(d0, "exited during an overlapped step")


def _kill_mid_step(proc, out):
    try:
        out["line"] = proc.stdout.readline().decode().strip()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
