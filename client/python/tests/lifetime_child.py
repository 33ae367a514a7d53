"""A trainer whose optimizer goes away before its model does, run in its own process by
test_lifetime.py (so that a crash is a failed test, not a dead test runner).

    lifetime_child.py SCENARIO MODE      (DIOND_TARGET names the daemon)

SCENARIO: plain, del, exception, exit, fork, recreate. MODE: shm, memfd, remote. The last
weights seen by the optimizer (a copy taken after its last step) are the expectation; the model
must hold them, stay usable (forward, backward, in-place writes) and, for "recreate", a new
optimizer must start from them. Prints OK and exits 0 on success.
"""
import atexit
import gc
import os
import sys

import torch

import diond.torch

SCENARIO, MODE = sys.argv[1], sys.argv[2]
TARGET = os.environ["DIOND_TARGET"]


def kwargs():
    if MODE == "remote":
        return dict(remote=True)
    return dict(arena=MODE)


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def groups(model):
    return [dict(params=[model[0].weight, model[2].weight], algorithm="muon", lr=0.02),
            dict(params=[model[0].bias, model[2].bias], algorithm="adamw", lr=1e-2)]


def batch(s):
    g = torch.Generator().manual_seed(100 + s)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def step(model, opt, s):
    x, y = batch(s)
    opt.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    return loss.item()


def snapshot(model):
    return [p.detach().clone() for p in model.parameters()]


def check(model, expect, what):
    for i, (p, e) in enumerate(zip(model.parameters(), expect)):
        if not torch.equal(p.detach(), e):
            print("FAIL %s: parameter %d differs from the last weights (max |d| = %g)"
                  % (what, i, (p.detach() - e).abs().max().item()), flush=True)
            os._exit(3)


def use(model, expect, what):
    """The model works as any model: the weights are the last ones, churn cannot move them,
    forward/backward run and in-place writes stick."""
    junk = [torch.randn(1 << 16) for _ in range(64)]  # reuse freed memory, if any was freed
    del junk
    gc.collect()
    check(model, expect, what)
    x, y = batch(99)
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    for p, e in zip(model.parameters(), expect):
        assert torch.equal(p.detach(), e + 1.0), what
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(1.0)


def train_and_return(steps=4):
    """The optimizer is local: it goes when this function returns."""
    model = make_model()
    opt = diond.torch.Optimizer(groups(model), target=TARGET, **kwargs())
    for s in range(1, steps + 1):
        step(model, opt, s)
    return model, snapshot(model)


def main():
    if SCENARIO == "plain":
        model, last = train_and_return()
        gc.collect()
        use(model, last, "after the function that built the optimizer returned")
    elif SCENARIO == "del":
        model = make_model()
        opt = diond.torch.Optimizer(groups(model), target=TARGET, **kwargs())
        for s in range(1, 4):
            step(model, opt, s)
        last = snapshot(model)
        del opt
        gc.collect()
        use(model, last, "after del opt")
    elif SCENARIO == "exception":
        model = make_model()
        box = {}

        def loop():
            opt = diond.torch.Optimizer(groups(model), target=TARGET, **kwargs())
            for s in range(1, 10):
                step(model, opt, s)
                box["last"] = snapshot(model)
                if s == 3:
                    raise KeyError("loss spike")

        try:
            loop()
        except KeyError:
            pass
        gc.collect()
        use(model, box["last"], "after an exception left the training loop")
    elif SCENARIO == "exit":
        model = make_model()
        box = {}
        # atexit runs last-registered first: this runs after the optimizers' finalizers.
        atexit.register(lambda: (use(model, box["last"], "at interpreter exit"),
                                 print("OK", flush=True)))
        opt = diond.torch.Optimizer(groups(model), target=TARGET, **kwargs())
        for s in range(1, 4):
            step(model, opt, s)
        box["last"] = snapshot(model)
        globals()["OPT"] = opt  # alive until the interpreter tears down
        return
    elif SCENARIO == "fork":
        model = make_model()
        opt = diond.torch.Optimizer(groups(model), target=TARGET, **kwargs())
        for s in range(1, 4):
            step(model, opt, s)
        last = snapshot(model)
        pid = os.fork()
        if pid == 0:
            # The child: its model is its own (writes stay here) and it exits normally, which
            # runs its finalizers; the parent's session must survive that.
            try:
                use(model, last, "in a forked child")
                with torch.no_grad():
                    for p in model.parameters():
                        p.fill_(1234.0)
                try:
                    opt.step()
                    print("FAIL the child stepped the parent's session", flush=True)
                    os._exit(4)
                except RuntimeError:
                    pass
            except BaseException as e:
                print("FAIL child: %r" % (e,), flush=True)
                os._exit(5)
            sys.exit(0)
        _, status = os.waitpid(pid, 0)
        if status != 0:
            print("FAIL the forked child exited with status %d" % status, flush=True)
            os._exit(6)
        check(model, last, "in the parent after the child wrote its model and exited")
        step(model, opt, 4)  # the session is still the parent's
        last = snapshot(model)
        opt.close()
        use(model, last, "in the parent after close")
    elif SCENARIO == "recreate":
        model = make_model()
        opt = diond.torch.Optimizer(groups(model), target=TARGET, **kwargs())
        for s in range(1, 4):
            step(model, opt, s)
        last = snapshot(model)
        del opt
        gc.collect()
        opt = diond.torch.Optimizer(groups(model), target=TARGET, **kwargs())
        check(model, last, "after a new optimizer was built over the model")
        # The new optimizer continues from these weights: one step from them equals a fresh
        # optimizer's step on a copy of the model holding the same weights.
        twin = make_model()
        with torch.no_grad():
            for p, e in zip(twin.parameters(), last):
                p.copy_(e)
        topt = diond.torch.Optimizer(groups(twin), target=TARGET, **kwargs())
        step(model, opt, 4)
        step(twin, topt, 4)
        check(model, snapshot(twin), "one step of the new optimizer")
        opt.close()
        topt.close()
    else:
        raise SystemExit("unknown scenario %r" % SCENARIO)
    print("OK", flush=True)


main()
