"""diond.jax against a real daemon (runs where jax is installed: the integration stage of
scripts/test.sh installs it): a small model trains (the loss falls) with Muon on the matrices and
AdamW on the rest; AdamW matches optax.adamw on the same gradients; state_dict() is a pytree that
restores into a new optimizer and continues exactly."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import diond.jax


def init(key, sizes=(8, 32, 32, 1)):
    params = {}
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        key, k = jax.random.split(key)
        params["layer%d" % i] = {"w": jax.random.normal(k, (a, b)) / np.sqrt(a),
                                 "b": jnp.zeros((b,))}
    return params


def forward(params, x):
    n = len(params)
    for i in range(n):
        x = x @ params["layer%d" % i]["w"] + params["layer%d" % i]["b"]
        if i + 1 < n:
            x = jnp.tanh(x)
    return x


def loss(params, x, y):
    return jnp.mean((forward(params, x) - y) ** 2)


def data(step):
    rng = np.random.default_rng(step)
    x = rng.standard_normal((64, 8)).astype(np.float32)
    return x, np.sin(x.sum(axis=1, keepdims=True)).astype(np.float32)


grad_fn = jax.jit(jax.value_and_grad(loss))


@pytest.mark.parametrize("mode", ["memfd", "shm", "remote"])
def test_muon_and_adamw_by_label_train(daemon, mode):
    params = init(jax.random.PRNGKey(0))
    labels = jax.tree_util.tree_map(lambda p: "hidden" if p.ndim == 2 else "rest", params)
    kw = dict(remote=True) if mode == "remote" else dict(arena=mode)
    with diond.jax.Optimizer(params, labels=labels, target=daemon.target, groups={
            "hidden": dict(algorithm="muon", lr=0.02),
            "rest": dict(algorithm="adamw", lr=3e-3, weight_decay=0.0)}, **kw) as opt:
        assert [g["algorithm"] for g in opt.param_groups] == ["adamw", "muon"] or \
            sorted(g["algorithm"] for g in opt.param_groups) == ["adamw", "muon"]
        losses = []
        for s in range(60):
            value, grads = grad_fn(params, *data(s % 8))
            losses.append(float(value))
            params = opt.step(grads)
        assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(
            init(jax.random.PRNGKey(0)))
    first, last = np.mean(losses[:5]), np.mean(losses[-5:])
    assert last < 0.5 * first, (first, last)


def test_adamw_matches_optax(daemon):
    params = init(jax.random.PRNGKey(1))
    rng = np.random.default_rng(3)
    hp = dict(lr=1e-2, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
    ref_opt = optax.adamw(hp["lr"], b1=hp["b1"], b2=hp["b2"], eps=hp["eps"],
                          weight_decay=hp["weight_decay"])
    ref, ref_state = params, ref_opt.init(params)
    with diond.jax.Optimizer(params, labels=lambda p: jax.tree_util.tree_map(lambda _: "all", p),
                             groups={"all": dict(algorithm="adamw")}, lr=hp["lr"],
                             betas=(hp["b1"], hp["b2"]), epsilon=hp["eps"],
                             weight_decay=hp["weight_decay"], target=daemon.target) as opt:
        for s in range(20):
            grads = jax.tree_util.tree_map(
                lambda p: jnp.asarray(rng.standard_normal(p.shape).astype(np.float32)), params)
            got = opt.step(grads)
            updates, ref_state = ref_opt.update(grads, ref_state, ref)
            ref = optax.apply_updates(ref, updates)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)
    moved = max(float(jnp.abs(a - b).max()) for a, b in zip(
        jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(params)))
    assert moved > 0.05  # it did train


def test_state_dict_restores_and_continues_exactly(daemon):
    groups = {"matrix": dict(algorithm="dion2", lr=0.02), "vector": dict(algorithm="adamw")}
    p0 = init(jax.random.PRNGKey(2))

    def train(opt, params, steps):
        for s in steps:
            _, grads = grad_fn(params, *data(s))
            params = opt.step(grads)
        return params

    with diond.jax.Optimizer(p0, groups=groups, target=daemon.target) as opt:
        straight = train(opt, p0, range(6))
    with diond.jax.Optimizer(p0, groups=groups, target=daemon.target) as opt:
        mid = train(opt, p0, range(3))
        ckpt = jax.tree_util.tree_map(np.array, opt.state_dict())  # a pytree of arrays
    assert all(isinstance(x, np.ndarray) for x in jax.tree_util.tree_leaves(ckpt))
    with diond.jax.Optimizer(mid, groups=groups, target=daemon.target) as opt:
        opt.load_state_dict(ckpt)
        resumed = train(opt, mid, range(3, 6))
    for a, b in zip(jax.tree_util.tree_leaves(straight), jax.tree_util.tree_leaves(resumed)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_bad_labels_are_refused(daemon):
    params = init(jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="has no entry in groups"):
        diond.jax.Optimizer(params, labels=jax.tree_util.tree_map(lambda _: "x", params),
                            target=daemon.target)
    with pytest.raises(ValueError, match="needs matrices"):
        diond.jax.Optimizer(params, labels=jax.tree_util.tree_map(lambda _: "matrix", params),
                            target=daemon.target)


def test_forked_child_leaves_the_parents_session_alone(daemon):
    import gc
    import os
    params = init(jax.random.PRNGKey(4))
    opt = diond.jax.Optimizer(params, target=daemon.target)
    _, grads = grad_fn(params, *data(0))
    params = opt.step(grads)
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            try:
                opt.step(grads)
                code = 2  # the child stepped the parent's session
            except RuntimeError:
                pass
            opt.__del__()  # what garbage collection in the child does
            gc.collect()
        except BaseException:
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert status == 0
    _, grads = grad_fn(params, *data(1))
    opt.step(grads)  # the session is still open
    assert opt.step_count == 2
    opt.close()


def test_optax_adapter_trains_and_rounds_only_in_the_last_bits(daemon):
    params = init(jax.random.PRNGKey(5))
    with diond.jax.Optimizer(params, target=daemon.target) as opt:
        tx = diond.jax.as_optax(opt)
        state = tx.init(params)
        first = None
        for s in range(40):
            value, grads = grad_fn(params, *data(s % 8))
            first = float(value) if first is None else first
            updates, state = tx.update(grads, state, params)
            params = optax.apply_updates(params, updates)
            exact = opt.params()
            for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(exact)):
                # params + (new - params) is new up to the rounding of the delta
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)
            params = exact  # keep the trainer's copy the daemon's, as step() would
        assert float(loss(params, *data(0))) < 0.7 * first
        with pytest.raises(ValueError, match="needs params"):
            tx.update(grads, state)


@pytest.mark.parametrize("mode", ["memfd", "remote"])
def test_a_none_gradient_leaves_its_parameter_alone(daemon, mode):
    """A None leaf in step()'s gradients is a parameter without a gradient (torch.optim's rule):
    its weights and state stay bit for bit, and the other leaves are those of an optimizer that
    does not hold it, bit for bit."""
    kw = dict(remote=True) if mode == "remote" else dict(arena=mode)
    groups = {"matrix": dict(algorithm="muon", lr=0.02), "vector": dict(algorithm="adamw")}
    p0 = init(jax.random.PRNGKey(4))
    # layer2 is last in the flattened order, so the others keep their indices and names. The
    # session lists the parameters group by group (vectors, then matrices), where layer2's
    # leaves are not last: a mask sent in leaf order would hit layer1's matrix.
    lean0 = {k: v for k, v in p0.items() if k != "layer2"}
    with diond.jax.Optimizer(p0, groups=groups, target=daemon.target, **kw) as opt, \
            diond.jax.Optimizer(lean0, groups=groups, target=daemon.target, **kw) as lean:
        params, lean_params, before = p0, lean0, None
        for s in range(4):
            _, grads = grad_fn(params, *data(s))
            if s >= 1:
                grads["layer2"] = {"w": None, "b": None}
                held = opt.state_dict()["state"]
            params = opt.step(grads)
            lean_params = lean.step({k: v for k, v in grads.items() if k != "layer2"})
            for k in lean_params:
                for a, b in zip(jax.tree_util.tree_leaves(params[k]),
                                jax.tree_util.tree_leaves(lean_params[k])):
                    assert np.array_equal(np.asarray(a), np.asarray(b)), (s, k)
            if before is not None and s >= 1:
                for a, b in zip(jax.tree_util.tree_leaves(params["layer2"]),
                                jax.tree_util.tree_leaves(before)):
                    assert np.array_equal(np.asarray(a), np.asarray(b)), s
                now = opt.state_dict()["state"]
                for path in held:
                    if "layer2" in path:
                        for name in held[path]:
                            assert np.array_equal(held[path][name], now[path][name]), path
            before = params["layer2"]
