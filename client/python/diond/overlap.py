"""The trainer's hooks for an overlapped step (docs/DATA_PLANE.md "Overlapped step"): which
parameters form a bucket, when backward has finished a bucket, and where the next forward must
wait for one. Torch only; no daemon here (diond.torch wires these to the doorbells).

- ``record_backward_order`` / ``plan_buckets``: the order backward produces the gradients, cut
  into buckets of about ``bucket_bytes``.
- ``BucketSignals``: calls ``on_ready(k)`` once per step, as soon as every parameter of bucket k
  has its gradient accumulated, while backward goes on with earlier layers.
- ``LayerWaits``: forward pre-hooks that call ``wait(k)`` before a module that owns parameters of
  bucket k runs, once per bucket and step.

A gradient is "accumulated" after torch's AccumulateGrad node wrote ``p.grad``: the hooks sit on
that node (what DistributedDataParallel used before torch 2.1), one path for torch 1.13 and 2.x
(2.1's ``register_post_accumulate_grad_hook`` would be the same moment).
"""
import threading

import torch


def _on_accumulated(p, fn):
    """Calls fn() each time backward has accumulated p's gradient into p.grad. Returns the handle
    (which keeps the node alive: torch holds it only weakly)."""
    with torch.enable_grad():
        node = p.expand_as(p).grad_fn.next_functions[0][0]
    handle = node.register_hook(lambda *_: fn())
    return _NodeHandle(node, handle)


class _NodeHandle:
    def __init__(self, node, handle):
        self.node = node  # the AccumulateGrad node must outlive its hook
        self.handle = handle

    def remove(self):
        self.handle.remove()
        self.node = None


class record_backward_order:  # noqa: N801 (a context manager, used as a function)
    """``with record_backward_order(params) as order: loss.backward()``: afterwards ``order`` holds
    the indices of `params` in the order their gradients were accumulated (each once; parameters
    without a gradient are left out)."""

    def __init__(self, params):
        self.params = list(params)
        self.order = []
        self._handles = []

    def __enter__(self):
        seen = set()
        lock = threading.Lock()

        def note(i):
            with lock:
                if i not in seen:
                    seen.add(i)
                    self.order.append(i)
        self._handles = [_on_accumulated(p, lambda i=i: note(i))
                         for i, p in enumerate(self.params) if p.requires_grad]
        return self.order

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles = []


def plan_buckets(order, nbytes, bucket_bytes):
    """Cuts `order` (parameter indices in backward's order) into buckets of at least
    `bucket_bytes` (nbytes[i]: parameter i's bytes). The rest joins the last bucket when it is
    under half of `bucket_bytes`, else makes one of its own; parameters missing from `order` (no
    gradient when the order was recorded) go into the last bucket."""
    n = len(nbytes)
    if bucket_bytes <= 0:
        raise ValueError("bucket_bytes must be positive, got %r" % (bucket_bytes,))
    if len(set(order)) != len(order) or any(not 0 <= i < n for i in order):
        raise ValueError("the backward order must name each of the %d parameters at most once"
                         % n)
    buckets, cur, size = [], [], 0
    for i in order:
        cur.append(i)
        size += nbytes[i]
        if size >= bucket_bytes:
            buckets.append(cur)
            cur, size = [], 0
    if cur and buckets and size < bucket_bytes / 2:
        buckets[-1].extend(cur)
    elif cur:
        buckets.append(cur)
    seen = set(order)
    missing = [i for i in range(n) if i not in seen]
    if missing and buckets:
        buckets[-1].extend(missing)
    elif missing:
        buckets.append(missing)
    return buckets


class BucketSignals:
    """Calls ``on_ready(k)`` when every parameter of ``buckets[k]`` has had its gradient
    accumulated during this step's armed backward. Disarmed (``armed = False``: the micro-batches
    of gradient accumulation before the last), nothing is counted. ``reset()`` starts a step;
    ``pending()`` lists the buckets not signalled yet (for the parameters that got no gradient).
    ``on_ready`` runs on the autograd thread that finished the bucket."""

    def __init__(self, params, buckets, on_ready):
        self.params = list(params)
        self.buckets = [list(b) for b in buckets]
        self.on_ready = on_ready
        self.armed = True
        where = {}
        for k, b in enumerate(self.buckets):
            for i in b:
                if i in where or not 0 <= i < len(self.params):
                    raise ValueError("parameter %d is in two buckets or out of range" % i)
                where[i] = k
        if len(where) != len(self.params):
            raise ValueError("%d of %d parameters are in no bucket"
                             % (len(self.params) - len(where), len(self.params)))
        self._bucket_of = where
        self._lock = threading.Lock()
        self.reset()
        self._handles = [_on_accumulated(p, lambda i=i: self._accumulated(i))
                         for i, p in enumerate(self.params) if p.requires_grad]

    def reset(self):
        with self._lock:
            self._left = [len(b) for b in self.buckets]
            self._done_params = set()
            self._signalled = [False] * len(self.buckets)

    def _accumulated(self, i):
        if not self.armed:
            return
        with self._lock:
            if i in self._done_params:
                return  # a parameter used twice in the graph accumulates twice
            self._done_params.add(i)
            k = self._bucket_of[i]
            self._left[k] -= 1
            ready = self._left[k] == 0
            if ready:
                self._signalled[k] = True
        if ready:
            self.on_ready(k)

    def pending(self):
        with self._lock:
            return [k for k, s in enumerate(self._signalled) if not s]

    def without_grad(self):
        """Parameters of this step with no gradient accumulated yet."""
        with self._lock:
            return [i for i in range(len(self.params)) if i not in self._done_params]

    def remove(self):
        for h in self._handles:
            h.remove()
        self._handles = []


class LayerWaits:
    """Forward pre-hooks on every module of `model` that directly owns parameters of `buckets`
    (indices into `params`): before such a module runs, ``wait(k)`` for each of its buckets not
    yet waited for this step. ``reset()`` starts a step; ``enabled = False`` turns the waits off
    (the first, recording step)."""

    def __init__(self, model, params, buckets, wait):
        index = {id(p): i for i, p in enumerate(params)}
        bucket_of = {i: k for k, b in enumerate(buckets) for i in b}
        self.wait = wait
        self.enabled = True
        self._lock = threading.Lock()
        self._waited = set()
        self._handles = []
        for module in model.modules():
            ks = sorted({bucket_of[index[id(p)]] for p in module.parameters(recurse=False)
                         if id(p) in index and index[id(p)] in bucket_of})
            if ks:
                self._handles.append(
                    module.register_forward_pre_hook(lambda m, a, ks=tuple(ks): self._before(ks)))

    def reset(self):
        with self._lock:
            self._waited = set()

    def _before(self, ks):
        if not self.enabled:
            return
        for k in ks:
            with self._lock:
                if k in self._waited:
                    continue
                self._waited.add(k)
            self.wait(k)

    def remove(self):
        for h in self._handles:
            h.remove()
        self._handles = []
