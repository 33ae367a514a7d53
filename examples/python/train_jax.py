#!/usr/bin/python3
"""A JAX MLP trained by diond: Muon on the hidden matrices, AdamW on the rest, chosen by label
as in optax.multi_transform. Starts its own daemon (diond.Daemon) unless --target is given.

    python examples/python/train_jax.py [--steps 200] [--target unix:/path/diond.sock]

Needs jax (PyPI's CPU wheel; scripts/test-integrations.sh installs the pinned version)."""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "client", "python"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import diond  # noqa: E402
import diond.jax  # noqa: E402


def init(key, sizes=(16, 64, 64, 1)):
    params = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        key, k = jax.random.split(key)
        params.append({"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros(b)})
    return params


def loss(params, x, y):
    for i, layer in enumerate(params):
        x = x @ layer["w"] + layer["b"]
        if i + 1 < len(params):
            x = jax.nn.gelu(x)
    return jnp.mean((x - y) ** 2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--target", default=None)
    args = ap.parse_args()
    daemon = None if args.target else diond.Daemon(compute_threads=2).start()
    target = args.target or daemon.target
    rng = np.random.default_rng(0)
    x = rng.standard_normal((512, 16)).astype(np.float32)
    y = np.sin(x[:, :4].sum(1, keepdims=True)).astype(np.float32)
    params = init(jax.random.PRNGKey(0))
    # Hidden matrices to Muon; the input/output layers and the biases to AdamW.
    labels = [{"w": "muon" if 0 < i < len(params) - 1 else "adamw", "b": "adamw"}
              for i in range(len(params))]
    step = jax.jit(jax.value_and_grad(loss))
    try:
        with diond.jax.Optimizer(params, labels=labels, target=target, groups={
                "muon": dict(algorithm="muon", lr=0.02),
                "adamw": dict(algorithm="adamw", lr=3e-3, weight_decay=0.0)}) as opt:
            first = None
            for s in range(args.steps):
                batch = rng.integers(0, len(x), 64)
                value, grads = step(params, x[batch], y[batch])
                params = opt.step(grads)
                first = float(value) if first is None else first
                if s % 50 == 0 or s == args.steps - 1:
                    print("step %4d  loss %.4f" % (s, float(value)), flush=True)
            final = float(loss(params, x, y))
            ckpt = opt.state_dict()  # a pytree of numpy arrays, for any JAX checkpointer
            print("final loss %.4f (first batch %.4f); %d state tensors"
                  % (final, first, len(jax.tree_util.tree_leaves(ckpt))))
            if not final < 0.5 * first:
                raise SystemExit("the loss did not fall")
    finally:
        if daemon is not None:
            daemon.stop()
            daemon.cleanup()


if __name__ == "__main__":
    main()
