"""Clean errors: each case raises a clear exception quickly, none hangs."""
import time

import grpc
import pytest
import torch

import diond
import diond.torch


def linear_params():
    torch.manual_seed(0)
    return torch.nn.Linear(16, 8)


class Timer:
    def __init__(self, limit):
        self.limit = limit

    def __enter__(self):
        self.t0 = time.monotonic()
        return self

    def __exit__(self, *exc):
        self.elapsed = time.monotonic() - self.t0
        assert self.elapsed < self.limit, "took %.1f s (limit %g s)" % (self.elapsed, self.limit)


def test_daemon_not_running(tmp_path):
    target = "unix:" + str(tmp_path / "nobody-listens.sock")
    with Timer(10):
        with pytest.raises(diond.DiondError) as e:
            diond.torch.Optimizer(linear_params().parameters(), algorithm="adamw",
                                  target=target, connect_timeout=2)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    assert "is the daemon running" in e.value.message
    with Timer(10), pytest.raises(diond.DiondError):
        diond.Client(target, connect_timeout=1)


def test_daemon_killed_mid_training(fresh_daemon):
    lin = linear_params()
    opt = diond.torch.Optimizer([dict(params=[lin.weight], algorithm="muon"),
                                 dict(params=[lin.bias], algorithm="adamw")],
                                target=fresh_daemon.target, timeout=10)
    x = torch.randn(4, 16)
    for _ in range(2):
        opt.zero_grad()
        lin(x).square().mean().backward()
        opt.step()
    w = lin.weight.detach().clone()
    fresh_daemon.kill()
    opt.zero_grad()
    lin(x).square().mean().backward()
    with Timer(15):
        with pytest.raises(diond.DiondError) as e:
            opt.step()
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    assert e.value.method == "Step"
    assert torch.equal(lin.weight.detach(), w)  # nothing applied
    with Timer(15):
        opt.close()  # does not hang on the dead daemon
    assert torch.equal(lin.weight.detach(), w)


def test_remote_daemon_killed_mid_training(fresh_daemon):
    lin = linear_params()
    opt = diond.torch.Optimizer(lin.parameters(), algorithm="adamw",
                                target=fresh_daemon.target, remote=True, timeout=10)
    lin(torch.randn(2, 16)).sum().backward()
    opt.step()
    fresh_daemon.kill()
    with Timer(15), pytest.raises(diond.DiondError) as e:
        opt.step()
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    opt.close()


@pytest.mark.parametrize("group, kwargs, exc, match", [
    (dict(algorithm="adamw", momentum=0.9), {}, ValueError, "unknown option 'momentum'"),
    (dict(algorithm="adamw", nesterov=True), {}, ValueError,
     "option 'nesterov' does not apply to algorithm 'adamw'"),
    (dict(algorithm="dion2", mu=0.9), {}, ValueError, "'mu' does not apply to algorithm 'dion2'"),
    (dict(algorithm="sgd"), {}, ValueError, "unknown algorithm 'sgd'"),
    (dict(algorithm="dion2", fraction=1.5), {}, ValueError, r"fraction = 1.5 is out of range"),
    (dict(algorithm="adamw", betas=(0.9,)), {}, ValueError, "betas must be a pair"),
    (dict(algorithm="muon", lr=-1.0), {}, ValueError, "lr = -1.0 is out of range"),
    (dict(algorithm="muon", adjust_lr="spectral"), {}, ValueError, "adjust_lr must be"),
    (dict(algorithm="muon", split_sizes=[8]), {}, ValueError, "split_sizes must be"),
    (dict(algorithm="muon"), dict(momentum=0.9), TypeError, "unexpected option 'momentum'"),
    (dict(algorithm="muon"), dict(use_gram_newton_schulz=True), ValueError,
     "use_gram_newton_schulz=True is not supported"),
    (dict(algorithm="dion2"), dict(rank_fraction=0.5), ValueError,
     "rank_fraction=0.5 is used by no parameter group"),
    (dict(algorithm="muon", precision="bf16"), {}, ValueError, "precision must be"),
])
def test_wrong_group_option(daemon, group, kwargs, exc, match):
    lin = linear_params()
    with Timer(5), pytest.raises(exc, match=match):
        diond.torch.Optimizer([dict(params=[lin.weight], **group)], target=daemon.target,
                              **kwargs)
    assert diond.Client(daemon.target).list_sessions() == []  # nothing reached the daemon


def test_vector_in_matrix_group(daemon):
    lin = linear_params()
    with pytest.raises(ValueError, match="needs matrices"):
        diond.torch.Optimizer([dict(params=[lin.bias], algorithm="muon")], target=daemon.target)


def test_option_refused_by_the_daemon(daemon):
    """num_heads must divide the rows: the daemon's INVALID_ARGUMENT comes back with its message,
    and no session is left behind."""
    lin = linear_params()
    with Timer(10), pytest.raises(diond.DiondError) as e:
        diond.torch.Optimizer([dict(params=[lin.weight], algorithm="muon", num_heads=3)],
                              target=daemon.target)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "num_heads" in e.value.message
    assert diond.Client(daemon.target).list_sessions() == []


def test_non_contiguous_parameter(daemon):
    p = torch.nn.Parameter(torch.randn(8, 16).t())
    assert not p.is_contiguous()
    with pytest.raises(ValueError, match="not contiguous"):
        diond.torch.Optimizer([p], algorithm="muon", target=daemon.target)


def test_dtype_mismatch(daemon):
    p64 = torch.nn.Parameter(torch.randn(8, 16, dtype=torch.float64))
    with pytest.raises(TypeError, match="dtype torch.float64 is not supported"):
        diond.torch.Optimizer([p64], algorithm="muon", target=daemon.target)
    # a parameter whose data is later replaced by another dtype
    lin = linear_params()
    with diond.torch.Optimizer(lin.parameters(), algorithm="adamw", target=daemon.target) as opt:
        lin.weight.data = lin.weight.data.double()
        with pytest.raises(ValueError, match="dtype torch.float64"):
            opt.step()
    # optimizer state of the wrong shape: the daemon refuses it, state untouched
    lin = linear_params()
    with diond.torch.Optimizer(lin.parameters(), algorithm="adamw", target=daemon.target) as opt:
        sd = opt.state_dict()
        sd["state"][0]["momentum"] = torch.zeros(3, 3)
        with pytest.raises(diond.DiondError) as e:
            opt.load_state_dict(sd)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_tcp_target_uses_remote_mode(daemon_factory):
    """Over TCP there is no shared memory: remote mode by default, and asking for shared memory
    is a clear error, not a hang."""
    d = daemon_factory(tcp=True)
    assert d.tcp_target and d.tcp_target.startswith("127.0.0.1:")
    lin = linear_params()
    with diond.torch.Optimizer(lin.parameters(), algorithm="adamw", target=d.tcp_target,
                               token=d.token) as opt:
        assert opt.remote
        lin(torch.randn(2, 16)).sum().backward()
        opt.step()
    with pytest.raises(ValueError, match="Unix-socket target"):
        diond.torch.Optimizer(lin.parameters(), algorithm="adamw", target=d.tcp_target,
                              token=d.token, remote=False)
    assert diond.Client(d.target).list_sessions() == []


def test_low_level_errors(daemon):
    c = diond.Client(daemon.target, timeout=5)
    with pytest.raises(diond.DiondError) as e:
        c.step("no-such-session", 1)
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    lin = linear_params()
    with diond.torch.Optimizer(lin.parameters(), algorithm="adamw", target=daemon.target) as opt:
        with pytest.raises(diond.DiondError) as e:
            c.step(opt.session_id, 7)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "expected 1" in e.value.message
        with pytest.raises(diond.DiondError) as e:
            c.set_hyperparameters(opt.session_id, "group0", lr=-1)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    c.close()
