"""The trainer's hooks of an overlapped step (diond/overlap.py) on examples/python/train_gpt.py's
model, with real backward passes: no daemon. What is checked against torch itself: a bucket is
signalled only once every gradient in it is final (equal to the gradients after backward), in
the order backward finishes them; gradient accumulation signals on the armed micro-batch only;
the forward waits come before the modules that need them."""
import os
import sys

import pytest
import torch

from diond.overlap import BucketSignals, LayerWaits, plan_buckets, record_backward_order

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))))
sys.path.insert(0, os.path.join(REPO, "examples", "python"))
import train_gpt  # noqa: E402


def model_and_batch(seed=0):
    torch.manual_seed(seed)
    model = train_gpt.GPT(vocab=17, context=8, d=16, layers=3, heads=2)
    idx = torch.randint(0, 17, (4, 8))
    return model, idx, torch.roll(idx, -1, dims=1)


def nbytes(params):
    return [p.numel() * p.element_size() for p in params]


def test_backward_order_runs_from_the_head_to_the_embeddings():
    model, idx, tgt = model_and_batch()
    params = list(model.parameters())
    with record_backward_order(params) as order:
        model(idx, tgt).backward()
    assert sorted(order) == list(range(len(params)))
    pos = {id(params[i]): n for n, i in enumerate(order)}
    # The LM head's gradient comes before every block's, and the last block's before the first's.
    assert pos[id(model.head.weight)] < pos[id(model.blocks[2].fc2.weight)]
    assert pos[id(model.blocks[2].qkv.weight)] < pos[id(model.blocks[0].fc2.weight)]
    assert pos[id(model.blocks[0].qkv.weight)] < pos[id(model.tok.weight)]


def test_plan_buckets_cuts_by_bytes_and_places_every_parameter_once():
    assert plan_buckets([3, 1, 0, 2], [4, 4, 4, 4], 8) == [[3, 1], [0, 2]]
    # a small rest joins the last bucket; parameters never seen go there too
    assert plan_buckets([0, 1, 2], [8, 8, 2, 8], 8) == [[0], [1, 2, 3]]
    assert plan_buckets([2], [8, 8, 8], 100) == [[2, 0, 1]]
    assert plan_buckets([], [4, 4], 8) == [[0, 1]]
    with pytest.raises(ValueError, match="at most once"):
        plan_buckets([0, 0], [4, 4], 8)
    with pytest.raises(ValueError, match="positive"):
        plan_buckets([0], [4], 0)


def test_a_bucket_is_signalled_once_its_gradients_are_final():
    model, idx, tgt = model_and_batch()
    params = list(model.parameters())
    with record_backward_order(params) as order:
        model(idx, tgt).backward()
    buckets = plan_buckets(order, nbytes(params), sum(nbytes(params)) // 5)
    assert len(buckets) >= 4
    model.zero_grad(set_to_none=True)
    seen = []

    def on_ready(k):
        seen.append((k, [params[i].grad.clone() for i in buckets[k]]))
    signals = BucketSignals(params, buckets, on_ready)
    model(idx, tgt).backward()
    assert [k for k, _ in seen] == list(range(len(buckets)))
    for k, grads in seen:
        for i, g in zip(buckets[k], grads):
            assert torch.equal(g, params[i].grad), (k, i)
    assert signals.pending() == [] and signals.without_grad() == []

    # The next step, with gradient accumulation over two micro-batches: only the armed one
    # signals, and then with the sum of both.
    signals.reset()
    seen.clear()
    model.zero_grad(set_to_none=True)
    signals.armed = False
    model(idx, tgt).backward()
    assert seen == [] and signals.pending() == list(range(len(buckets)))
    signals.armed = True
    model(idx, tgt).backward()
    assert [k for k, _ in seen] == list(range(len(buckets)))
    for k, grads in seen:
        for i, g in zip(buckets[k], grads):
            assert torch.equal(g, params[i].grad), (k, i)
    signals.remove()
    signals.reset()
    seen.clear()
    model(idx, tgt).backward()
    assert seen == []


def test_a_parameter_without_a_gradient_leaves_its_bucket_pending():
    model, idx, tgt = model_and_batch()
    params = list(model.parameters())
    buckets = [[i] for i in range(len(params))]
    ready = []
    signals = BucketSignals(params, buckets, ready.append)
    model.head.weight.requires_grad_(False)
    model(idx, tgt).backward()
    head = next(i for i, p in enumerate(params) if p is model.head.weight)
    assert signals.pending() == [head]
    assert signals.without_grad() == [head]
    assert sorted(ready) == [i for i in range(len(params)) if i != head]
    with pytest.raises(ValueError, match="in no bucket"):
        BucketSignals(params, buckets[1:], ready.append)
    with pytest.raises(ValueError, match="two buckets"):
        BucketSignals(params, buckets + [[0]], ready.append)


def test_forward_waits_for_each_bucket_before_the_first_module_that_needs_it():
    model, idx, tgt = model_and_batch()
    params = list(model.parameters())
    index = {id(p): i for i, p in enumerate(params)}
    buckets = [[i] for i in range(len(params))]
    events = []
    waits = LayerWaits(model, params, buckets, lambda k: events.append(("wait", k)))
    for name, m in model.named_modules():
        if any(True for _ in m.parameters(recurse=False)):
            m.register_forward_pre_hook(lambda m, a, name=name: events.append(("run", name)))
    model(idx, tgt)
    owner = {index[id(p)]: name for name, m in model.named_modules()
             for p in m.parameters(recurse=False)}
    waited = [k for kind, k in events if kind == "wait"]
    assert sorted(waited) == list(range(len(params)))
    for k in waited:
        # the wait for bucket k comes before its module runs
        assert events.index(("wait", k)) < events.index(("run", owner[k]))
    events.clear()
    model(idx, tgt)
    assert [e for e in events if e[0] == "wait"] == []  # once per step
    waits.reset()
    waits.enabled = False
    model(idx, tgt)
    assert [e for e in events if e[0] == "wait"] == []
    waits.enabled = True
    model(idx, tgt)
    assert len([e for e in events if e[0] == "wait"]) == len(params)
    waits.remove()
