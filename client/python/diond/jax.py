"""diond for JAX: the daemon's optimizers over a pytree of parameters.

    import diond.jax
    labels = jax.tree_util.tree_map(lambda p: "matrix" if p.ndim >= 2 else "other", params)
    opt = diond.jax.Optimizer(params, labels=labels, groups={
        "matrix": dict(algorithm="muon", lr=0.02),
        "other": dict(algorithm="adamw", lr=3e-3, weight_decay=0.0)})
    for batch in data:
        grads = jax.grad(loss)(params, batch)
        params = opt.step(grads)                 # new parameters, same structure
    ckpt = opt.state_dict()                      # a pytree of numpy arrays (orbax, pickle, ...)

Groups are chosen by label as in ``optax.multi_transform``: ``labels`` is a pytree of strings of
the parameters' structure (or a function of the parameters returning one); ``groups`` maps each
label to a group's options (the same names, defaults and checks as diond.torch: diond.options).
Without labels, matrices (>= 2 dims) go to the constructor's ``algorithm`` (default "muon") and
every other leaf to AdamW. The parameters live in the daemon's arena (shared memory on a Unix
socket: a memfd, else POSIX shm; ``remote=True`` for TCP); ``step`` copies the gradients in and
the new parameters out, so nothing here runs inside ``jit``: call it between jitted steps.
Leaves must be float32, bfloat16 or float16.
"""
import os

import jax
import jax.numpy as jnp
import numpy as np

from . import fdchannel, host_arena
from .client import Client, pb
from .options import MATRIX_ALGORITHMS, _NONFINITE

__all__ = ["Optimizer", "as_optax"]

_SEGMENT_ALIGN = 4096
_DTYPES = {np.dtype(np.float32): (pb.DTYPE_F32, np.float32),
           np.dtype(jnp.bfloat16): (pb.DTYPE_BF16, np.uint16),
           np.dtype(np.float16): (pb.DTYPE_F16, np.float16)}


def _align(n, a):
    return (n + a - 1) // a * a


class Optimizer:
    """A diond session over the leaves of `params` (a pytree of arrays).

    Args:
      params: the initial parameters (a pytree of jax or numpy arrays).
      labels: a pytree of group labels with the structure of `params`, or a function
        params -> such a pytree; None: "matrix" for leaves with >= 2 dims, "vector" otherwise.
      groups: {label: options of that group (algorithm, lr, ...)}; every label used must have
        an entry, except the default labels ("matrix": the constructor's algorithm, "vector":
        AdamW).
      target, remote, arena ("memfd" | "shm" | None), fp32_master_weights, non_finite_policy,
      timeout, client_name: as diond.torch.Optimizer.
      **options: the defaults of every group (diond.options.OptionSchema.defaults: the
        daemon's DescribeOptions).
    """

    def __init__(self, params, labels=None, groups=None, *, target=None, remote=None, arena=None,
                 fp32_master_weights=False, non_finite_policy="skip", timeout=60.0,
                 client_name="diond.jax", **options):
        if non_finite_policy not in _NONFINITE:
            raise ValueError("non_finite_policy must be 'skip' or 'error', got %r"
                             % (non_finite_policy,))
        if arena not in (None, "memfd", "shm"):
            raise ValueError("arena must be 'memfd', 'shm' or None, got %r" % (arena,))
        # The options' defaults, ranges and algorithms are the daemon's (DescribeOptions).
        self.client = target if isinstance(target, Client) else Client(target, timeout=timeout)
        self._owns_client = not isinstance(target, Client)
        try:
            protos, names, leaves = self._setup(params, labels, groups, options)
        except BaseException:
            if self._owns_client:
                self.client.close()
            raise
        self.remote = (not self.client.is_unix) if remote is None else bool(remote)
        self._pid = os.getpid()  # a forked child never closes its parent's session
        self.step_count = 0  # steps of the run (restored by load_state_dict)
        self._rpc_index = 0  # steps of this session
        self._arena = None
        self.session_id = None
        self._pushed = False  # remote mode: gradients uploaded to the session at least once
        try:
            resp = self.client.create_session(
                parameters=self._specs, groups=protos,
                fp32_master_weights=bool(fp32_master_weights),
                non_finite_policy=_NONFINITE[non_finite_policy], client_name=client_name)
            self.session_id = resp.session_id
            if self.remote:
                self.client.set_state(self.session_id, {
                    n: self._wire(np.asarray(x), i) for i, (n, x) in enumerate(zip(names,
                                                                                  leaves))})
            else:
                self._attach(resp, leaves, arena)
        except BaseException:
            self.close()
            raise

    def _setup(self, params, labels, groups, options):
        schema = self.option_schema = self.client.option_schema()
        defaults, explicit = schema.check_options(options, "diond.jax.Optimizer")
        leaves, self._treedef = jax.tree_util.tree_flatten(params)
        paths = [jax.tree_util.keystr(p) for p, _ in
                 jax.tree_util.tree_flatten_with_path(params)[0]]
        if not leaves:
            raise ValueError("params has no leaves")
        if labels is None:
            labels = jax.tree_util.tree_map(lambda p: "matrix" if np.ndim(p) >= 2 else "vector",
                                            params)
        elif callable(labels):
            labels = labels(params)
        label_leaves, label_def = jax.tree_util.tree_flatten(labels)
        if label_def != self._treedef:
            raise ValueError("labels must have the structure of params: %s vs. %s"
                             % (label_def, self._treedef))
        groups = dict(groups or {})
        groups.setdefault("matrix", {})
        groups.setdefault("vector", dict(algorithm="adamw"))
        self._specs, self._group_names, self.param_groups = [], [], []
        by_label = {}
        for i, (path, leaf, label) in enumerate(zip(paths, leaves, label_leaves)):
            if not isinstance(label, str):
                raise ValueError("label of %s must be a string, got %r" % (path, label))
            if label not in groups:
                raise ValueError("label %r (of %s) has no entry in groups (labels: %s)"
                                 % (label, path, ", ".join(sorted(groups))))
            by_label.setdefault(label, []).append(i)
        self._paths = paths
        self._shapes = [tuple(np.shape(x)) for x in leaves]
        self._dtypes = []
        for path, x in zip(paths, leaves):
            dt = np.dtype(getattr(x, "dtype", np.asarray(x).dtype))
            if dt not in _DTYPES:
                raise TypeError("%s: dtype %s is not supported (float32, bfloat16, float16)"
                                % (path, dt))
            self._dtypes.append(dt)
        names = ["p%d" % i for i in range(len(leaves))]
        self._names = names
        protos = []
        for gi, (label, idx) in enumerate(by_label.items()):
            algo, g = schema.check_group(dict(groups[label]), gi, defaults["algorithm"])
            opts = {k: (v if k in explicit else schema.algorithm_default(algo, k))
                    for k, v in defaults.items() if k in schema.applies[algo]}
            opts.update({k: v for k, v in g.items() if k in schema.defaults})
            opts["algorithm"] = algo
            schema.validate(opts, algo, "group %r: " % label)
            for i in idx:
                if algo in MATRIX_ALGORITHMS and len(self._shapes[i]) < 2:
                    raise ValueError("%s (label %r, shape %s): algorithm %r needs matrices; "
                                     "label vectors for an 'adamw' or 'lion' group"
                                     % (paths[i], label, list(self._shapes[i]), algo))
                if int(np.prod(self._shapes[i])) == 0:
                    raise ValueError("%s: empty parameters are not supported" % paths[i])
            protos.append(schema.group_proto(label, opts))
            self._group_names.append(label)
            self.param_groups.append(dict(opts, label=label, params=[paths[i] for i in idx]))
            for i in idx:
                self._specs.append(pb.ParameterSpec(
                    name=names[i], shape=list(self._shapes[i]),
                    dtype=_DTYPES[self._dtypes[i]][0], group=label))
        schema.unused(explicit, defaults, [g["algorithm"] for g in self.param_groups])
        # The session lists the parameters group by group, not in leaf order: a Step's
        # params_without_grad takes the session's indices.
        at = {spec.name: k for k, spec in enumerate(self._specs)}
        self._session_index = [at[n] for n in names]
        return protos, names, leaves

    # -- arenas -------------------------------------------------------------------------------
    def _wire(self, a, i):
        """Leaf i as the daemon stores it (bfloat16 as its bits)."""
        a = np.ascontiguousarray(a, dtype=self._dtypes[i]).reshape(self._shapes[i])
        return a.view(_DTYPES[self._dtypes[i]][1])

    def _attach(self, resp, leaves, choice):
        layout = {t.name: t for t in resp.layout}
        grad_base = _align(resp.param_arena_bytes, _SEGMENT_ALIGN)
        size = grad_base + resp.grad_arena_bytes
        fd_path, kinds = resp.fd_channel_socket, list(resp.region_kinds)
        memfd_ok = (bool(fd_path) and pb.REGION_KIND_MEMFD in kinds and fdchannel.supported()
                    and os.access(fd_path, os.W_OK))
        kind = choice or ("memfd" if memfd_ok else "shm")
        if kind == "memfd" and not memfd_ok:
            raise ValueError("arena='memfd': the daemon at %s offers no usable fd channel"
                             % self.client.target)
        self._arena = (fdchannel.MemfdArena(size, name="diond-jax-%d" % os.getpid())
                       if kind == "memfd" else host_arena.ShmArena(size, prefix="diond-jax"))
        self.arena = kind
        buf = np.frombuffer(self._arena.buf, dtype=np.uint8)
        self._pviews, self._gviews = [], []
        for i, (n, x) in enumerate(zip(self._names, leaves)):
            t = layout[n]
            dt = _DTYPES[self._dtypes[i]][1]
            count = int(np.prod(self._shapes[i]))
            nbytes = count * np.dtype(dt).itemsize
            pv = buf[t.param_offset_bytes:t.param_offset_bytes + nbytes].view(dt)
            gv = buf[grad_base + t.grad_offset_bytes:
                     grad_base + t.grad_offset_bytes + nbytes].view(dt)
            pv[...] = self._wire(np.asarray(x), i).reshape(-1)
            gv[...] = 0
            self._pviews.append(pv.reshape(self._shapes[i]))
            self._gviews.append(gv.reshape(self._shapes[i]))
        if kind == "memfd":
            regions = [(pb.REGION_ROLE_PARAMETERS, 0, resp.param_arena_bytes),
                       (pb.REGION_ROLE_GRADIENTS, grad_base, resp.grad_arena_bytes)]
            for role, off, n in regions:
                self.client.register_memfd_region(self.session_id, role,
                                                  self._arena.send(fd_path), off, n)
        else:
            self.client.register_region(self.session_id, pb.REGION_ROLE_PARAMETERS,
                                        self._arena.name, 0, resp.param_arena_bytes)
            self.client.register_region(self.session_id, pb.REGION_ROLE_GRADIENTS,
                                        self._arena.name, grad_base, resp.grad_arena_bytes)

    # -- stepping -----------------------------------------------------------------------------
    def _leaves(self, tree, what, none_ok=False):
        """The leaves of `tree`, which must have the parameters' structure; none_ok: a None
        leaf stands for its parameter (jax flattens None away unless it is taken as a leaf)."""
        is_leaf = (lambda x: x is None) if none_ok else None
        leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=is_leaf)
        if treedef != self._treedef:
            raise ValueError("%s must have the structure of the parameters: %s vs. %s"
                             % (what, treedef, self._treedef))
        for i, x in enumerate(leaves):
            if x is not None and tuple(np.shape(x)) != self._shapes[i]:
                raise ValueError("%s %s has shape %s, the parameter %s" % (
                    what, self._paths[i], list(np.shape(x)), list(self._shapes[i])))
        return leaves

    def _unwire(self, a, i):
        return jnp.asarray(np.array(a, copy=True).view(self._dtypes[i]).reshape(self._shapes[i]))

    def step(self, grads, lr=None):
        """One step on `grads` (the parameters' structure); returns the new parameters (jax
        arrays). lr: an optional {label: lr} for this step (a schedule). A None leaf is a
        parameter without a gradient in this step: it and its optimizer state stay as they are
        (torch.optim's rule for a None .grad, docs/ALGORITHMS.md §2.6)."""
        self._check_open()
        leaves = self._leaves(grads, "grads", none_ok=True)
        without = sorted(self._session_index[i] for i, g in enumerate(leaves) if g is None)
        if self.remote:
            wire = {n: self._wire(np.asarray(g), i)
                    for i, (n, g) in enumerate(zip(self._names, leaves)) if g is not None}
            if not wire and not self._pushed:
                # A Step needs gradients uploaded once; these zeros are not read (masked).
                wire = {self._names[0]: self._wire(np.zeros(self._shapes[0]), 0)}
            if wire:
                self.client.push_gradients(self.session_id, wire)
                self._pushed = True
        else:
            for i, (gv, g) in enumerate(zip(self._gviews, leaves)):
                if g is not None:
                    gv[...] = self._wire(np.asarray(g), i)
        steps = {name: self.step_count + 1 for name in self._group_names}
        # The session's Step index counts this session's steps; the groups' step numbers (bias
        # correction, Dion's warm-up) count the run's, restored by load_state_dict.
        self.last_step = self.client.step(self.session_id, self._rpc_index + 1,
                                          lr_override=dict(lr or {}), group_step=steps,
                                          params_without_grad=without)
        self._rpc_index += 1
        self.step_count += 1
        return self.params()

    def params(self):
        """The current parameters (copies as jax arrays, the parameters' structure)."""
        self._check_open()
        if self.remote:
            new = self.client.pull_parameters(self.session_id)
            out = [self._unwire(np.frombuffer(new[n].data, dtype=_DTYPES[self._dtypes[i]][1]), i)
                   for i, n in enumerate(self._names)]
        else:
            out = [self._unwire(pv, i) for i, pv in enumerate(self._pviews)]
        return jax.tree_util.tree_unflatten(self._treedef, out)

    def set_params(self, params):
        """Replaces the parameters (e.g. restored from a checkpoint); the state is kept."""
        self._check_open()
        leaves = self._leaves(params, "params")
        self.client.set_state(self.session_id, {
            n: self._wire(np.asarray(x), i) for i, (n, x) in enumerate(zip(self._names, leaves))})

    # -- state --------------------------------------------------------------------------------
    def state_dict(self):
        """{"step": int64 array, "state": {leaf path: {state name: float32 array}}}: a pytree of
        numpy arrays a JAX checkpointer can save (the parameters are saved by the trainer)."""
        self._check_open()
        raw = self.client.get_state(self.session_id)
        index = {n: i for i, n in enumerate(self._names)}
        state = {}
        for name, t in raw.items():
            pname, _, sname = name.partition("/state.")
            state.setdefault(self._paths[index[pname]], {})[sname] = t.numpy().copy()
        return {"step": np.asarray(self.step_count, dtype=np.int64), "state": state}

    def load_state_dict(self, state_dict):
        """Restores what state_dict() returned (arrays of any framework)."""
        self._check_open()
        by_path = {p: n for p, n in zip(self._paths, self._names)}
        tensors = {}
        for path, st in state_dict["state"].items():
            if path not in by_path:
                raise ValueError("state for %s, which is not a parameter of this optimizer"
                                 % path)
            for sname, v in st.items():
                tensors["%s/state.%s" % (by_path[path], sname)] = np.ascontiguousarray(
                    np.asarray(v, dtype=np.float32))
        self.client.set_state(self.session_id, tensors)
        self.step_count = int(np.asarray(state_dict["step"]))

    # -- lifetime -----------------------------------------------------------------------------
    def _check_open(self):
        if self.session_id is None:
            raise RuntimeError("diond.jax.Optimizer is closed")
        if self._pid != os.getpid():
            raise RuntimeError("diond.jax.Optimizer: this session belongs to process %d (this is "
                               "a forked child); build a new Optimizer here" % self._pid)

    def close(self):
        """Ends the session. The arrays step() returned are the caller's (copies)."""
        if self.session_id is not None and getattr(self, "_pid", None) == os.getpid():
            try:
                self.client.close_session(self.session_id, timeout=5.0)
            except Exception:
                pass
            self.session_id = None
        if self._arena is not None:
            self._pviews = self._gviews = []
            self._arena.close()
            self._arena = None
        if self._owns_client and getattr(self, "_pid", None) == os.getpid():
            self.client.close()
        self._owns_client = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def as_optax(optimizer):
    """An ``optax.GradientTransformation`` over `optimizer` (a diond.jax.Optimizer), for code
    written against optax: ``updates, state = tx.update(grads, state, params)`` steps the daemon
    and returns ``new - params``. Two limits, by construction:
      * it cannot run inside ``jit`` (nor ``pmap``/``scan``): update talks to the daemon and
        copies host memory; call it from Python between jitted functions;
      * ``optax.apply_updates(params, updates)`` computes ``params + (new - params)``, which may
        differ from the daemon's ``new`` in the last bit (float rounding of the delta); use
        ``optimizer.step(grads)`` for the daemon's exact weights.
    The optax state is empty: the optimizer state lives in the daemon (optimizer.state_dict())."""
    import optax

    def init(params):
        del params
        return optax.EmptyState()

    def update(grads, state, params=None):
        if params is None:
            raise ValueError("diond's optax adapter needs params (the current parameters) to "
                             "return updates as new - params")
        new = optimizer.step(grads)
        return jax.tree_util.tree_map(lambda n, p: (n - p).astype(n.dtype), new, params), state

    return optax.GradientTransformation(init, update)
