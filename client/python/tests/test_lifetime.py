"""The model outlives its optimizer, as with torch.optim: dropped however (a function returning
the model, del, an exception, interpreter exit, a fork, a new optimizer over the same model), the
optimizer leaves the model its last weights in ordinary memory, with no crash. Each case runs in
its own process (lifetime_child.py), so a SIGSEGV fails the test instead of the runner."""
import os
import subprocess
import sys

import pytest

import diond
from diond import fdchannel

HERE = os.path.dirname(os.path.abspath(__file__))
SCENARIOS = ["plain", "del", "exception", "exit", "fork", "recreate"]
MODES = ["shm", "memfd", "remote"]


def run_child(daemon, scenario, mode):
    env = dict(os.environ, DIOND_TARGET=daemon.target)
    return subprocess.run([sys.executable, os.path.join(HERE, "lifetime_child.py"), scenario,
                           mode], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_model_outlives_optimizer(daemon, scenario, mode):
    if mode == "memfd" and not fdchannel.supported():
        pytest.skip("memfd needs Linux")
    r = run_child(daemon, scenario, mode)
    out = r.stdout + r.stderr
    assert r.returncode == 0, "exit %d (-11 = SIGSEGV)\n%s" % (r.returncode, out[-3000:])
    assert r.stdout.strip().endswith("OK"), out[-3000:]
    # Every session the child opened is closed (by close() or by the finalizer at exit), and the
    # forked child closed none of its parent's early.
    with diond.Client(daemon.target) as c:
        assert c.list_sessions() == []


@pytest.mark.parametrize("arena", ["memfd", "shm"])
def test_arena_goes_with_its_last_view_and_is_not_leaked(daemon, arena):
    """Dropped optimizers leave no mapping behind; a view the user kept keeps the mapping (and
    its values) until it goes."""
    import gc

    import torch

    import diond.torch

    if arena == "memfd" and not fdchannel.supported():
        pytest.skip("memfd needs Linux")

    def mappings():
        with open("/proc/self/maps") as f:
            return sum(1 for line in f if "diond" in line)

    base = mappings()
    m = torch.nn.Linear(256, 256)

    def make():
        return diond.torch.Optimizer([dict(params=[m.weight], algorithm="muon"),
                                      dict(params=[m.bias], algorithm="adamw")],
                                     target=daemon.target, arena=arena)

    for _ in range(10):
        opt = make()
        m(torch.randn(2, 256)).sum().backward()
        opt.step()
        del opt
        gc.collect()
    assert mappings() == base
    opt = make()
    assert mappings() == base + 1
    kept = m.weight.data  # a view of the arena, held past the optimizer
    value = kept.clone()
    opt.close()
    assert mappings() == base + 1 and torch.equal(kept, value)
    assert m.weight.data.data_ptr() != kept.data_ptr()  # the model has its own copy
    del kept
    gc.collect()
    assert mappings() == base
