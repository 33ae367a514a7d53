"""Run microsoft/dion (written for PyTorch >= 2.7) on Debian's PyTorch 1.13, eagerly, on a CPU.

Written for this project (no upstream code). `install()` must run before `import dion`; it
provides the few 2.x entry points the optimizer classes touch, and `Torch2Rounding` is a
function mode that gives bfloat16 arithmetic PyTorch 2.x's eager rounding (vectors README,
"How the reference was run"):

1. `torch.compile` / `torch._inductor.config.patch`: identity decorators (eager execution).
2. `torch.distributed.tensor` (DTensor, DeviceMesh, Placement, Shard, Replicate, randn) and
   `torch.distributed._functional_collectives`: inert stand-ins; no DTensor is ever created,
   so `isinstance(x, DTensor)` is false and no collective runs.
3. `torch.optim.optimizer.ParamsT`: a typing alias.
4. `torch._foreach_*`: a Python loop of the single-tensor operation (what 2.x does on CPU).
5. `Tensor.all(dim=<tuple>)`: successive one-dimension reductions.
6. `torch._fused_adamw_`: the float32 path of 2.x's CPU kernel (only the scalar groups use it).

`Torch2Rounding` (a `TorchFunctionMode`): a bfloat16 tensor multiplied, divided, added to or
subtracted from a Python number or a 0-d tensor of another dtype is computed in float32 with
the scalar kept in float32 and rounded once (1.13 rounds the scalar to bf16 first; 2.x reads
the CPU scalar's original value in float32, `original_scalar_value<opmath_t>`); a matmul with bfloat16
inputs is a float32 matmul of the exactly widened inputs rounded once to bf16; the 2-norm of
a bfloat16 tensor (`Tensor.norm`, `torch.norm`, `torch.linalg.vector_norm`) accumulates the
squares in float32, takes the square root in float32 and rounds once to bf16, as 2.x's CPU
kernel does (`acc_t = opmath_type<BFloat16> = float`). 1.13 instead rounds the sum of squares
to bf16 before the square root, which can move Polar Express's normaliser by a bf16 ulp; the
first public vectors were made that way (`torch2_norm=False` reproduces them). Options used
to measure the reference's own rounding spread and its float64 twin:
  * `promote`: None, or a dtype every `.to(bfloat16)` / `.bfloat16()` cast is redirected to;
    float64 also redirects the casts to float32 (the "exact" float64 twin of a run).
  * In float64 runs a 0-d `lerp` weight of another dtype is cast to the data's dtype (upstream
    forms the weight in float32 while the data follows the parameters' dtype; 1.13 refuses).
  * `torch2_norm`: False keeps 1.13's bf16 norm (only to replay the first public vectors).
  * `matmul_split`: > 1 splits every bf16 matmul's inner dimension into that many float32
    partial products summed in float32 (another accumulation order, as a multi-threaded or
    blocked BLAS uses).
"""

import contextlib
import math
import sys
import types
import typing

import torch
from torch.overrides import TorchFunctionMode

_INSTALLED = False


def _identity_decorator(*args, **kwargs):
    """@torch.compile and @torch.compile(...) both leave the function as it is."""
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0]
    return lambda fn: fn


class _InertPatch:
    """torch._inductor.config.patch(...): usable as a decorator and as a context manager."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, fn):
        return fn

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _module(name):
    mod = types.ModuleType(name)
    sys.modules[name] = mod
    return mod


def _install_distributed_stubs():
    dt = _module("torch.distributed.tensor")

    class DTensor(torch.Tensor):  # never instantiated
        pass

    class DeviceMesh:  # never instantiated
        pass

    class Placement:
        pass

    class Shard(Placement):
        def __init__(self, dim=0):
            self.dim = dim

    class Replicate(Placement):
        pass

    class Partial(Placement):
        pass

    dt.DTensor = DTensor
    dt.DeviceMesh = DeviceMesh
    dt.Placement = Placement
    dt.Shard = Shard
    dt.Replicate = Replicate
    dt.Partial = Partial
    dt.randn = torch.randn
    dt.distribute_tensor = lambda *a, **k: (_ for _ in ()).throw(
        NotImplementedError("no DTensor in the compatibility layer"))
    torch.distributed.tensor = dt
    placement_types = _module("torch.distributed.tensor.placement_types")
    for n in ("Placement", "Shard", "Replicate", "Partial"):
        setattr(placement_types, n, getattr(dt, n))
    fc = _module("torch.distributed._functional_collectives")
    torch.distributed._functional_collectives = fc


def _foreach(op, inplace):
    def run(tensors, *others, **kwargs):
        out = []
        for i, t in enumerate(tensors):
            args = [o[i] if isinstance(o, (list, tuple)) else o for o in others]
            r = getattr(t, op + ("_" if inplace else ""))(*args, **kwargs)
            out.append(r)
        return None if inplace else out
    return run


def _foreach_copy_(dst, src, non_blocking=False):
    for d, s in zip(dst, src):
        d.copy_(s, non_blocking=non_blocking)


def _foreach_minimum(tensors, other):
    out = []
    for i, t in enumerate(tensors):
        o = other[i] if isinstance(other, (list, tuple)) else other
        if not isinstance(o, torch.Tensor):
            o = torch.tensor(o, dtype=t.dtype)
        out.append(torch.minimum(t, o))
    return out


def _fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *,
                  lr, beta1, beta2, weight_decay, eps, amsgrad, maximize, grad_scale=None,
                  found_inf=None):
    """Float32 path of PyTorch 2.x's CPU fused AdamW (scalars as doubles, cast to f32 at use)."""
    assert not amsgrad and grad_scale is None and found_inf is None
    f32 = torch.float32
    lr_v = float(lr.item()) if isinstance(lr, torch.Tensor) else float(lr)
    lr_v = float(torch.tensor(lr_v, dtype=f32)) if isinstance(lr, torch.Tensor) else lr_v
    for p, g, m, v, st in zip(params, grads, exp_avgs, exp_avg_sqs, state_steps):
        step = float(st.item())
        g = -g if maximize else g
        bc1 = 1.0 - beta1 ** step
        bc2 = 1.0 - beta2 ** step
        p.mul_(torch.tensor(1.0 - lr_v * weight_decay, dtype=f32))
        # m = fma(1 - beta1, g - m, m): evaluated in float64 and rounded once.
        w1 = float(torch.tensor(1.0 - beta1, dtype=f32))
        m.copy_((w1 * (g.double() - m.double()) + m.double()).to(f32))
        v.mul_(torch.tensor(beta2, dtype=f32)).add_(
            (torch.tensor(1.0 - beta2, dtype=f32) * g) * g)
        denom = v.sqrt() / torch.tensor(math.sqrt(bc2), dtype=f32) + torch.tensor(eps, dtype=f32)
        p.add_((torch.tensor(-lr_v / bc1, dtype=f32) * m) / denom)


def install():
    """Installs the 2.x stand-ins (idempotent). Call before importing `dion`."""
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    torch.set_num_threads(1)
    torch.compile = _identity_decorator
    try:
        import torch._inductor.config as inductor_config  # noqa: F401
    except Exception:  # 1.13 has no usable inductor package
        ind = sys.modules.get("torch._inductor") or _module("torch._inductor")
        cfg = _module("torch._inductor.config")
        ind.config = cfg
        torch._inductor = ind
        inductor_config = cfg
    inductor_config.patch = _InertPatch
    import torch.distributed as _dist  # noqa: F401
    _install_distributed_stubs()
    import torch.optim.optimizer as optmod
    optmod.ParamsT = typing.Union[typing.Iterable[torch.Tensor], typing.Iterable[dict]]
    for name in ("add", "sub", "mul", "lerp", "sign", "div", "neg", "sqrt", "abs", "clamp_min",
                 "maximum"):
        setattr(torch, "_foreach_" + name, _foreach(name, False))
        setattr(torch, "_foreach_" + name + "_", _foreach(name, True))
    torch._foreach_copy_ = _foreach_copy_
    torch._foreach_minimum = _foreach_minimum
    torch._fused_adamw_ = _fused_adamw_
    orig_all = torch.Tensor.all

    def tensor_all(self, dim=None, keepdim=False):
        if isinstance(dim, (tuple, list)):
            r = self
            for d in sorted((d % self.ndim for d in dim), reverse=True):
                r = orig_all(r, d, keepdim)
            return r
        return orig_all(self) if dim is None else orig_all(self, dim, keepdim)
    torch.Tensor.all = tensor_all


_MUL = {"mul", "mul_", "__mul__", "__rmul__", "__imul__"}
_DIV = {"div", "div_", "__truediv__", "__itruediv__", "true_divide"}
_ADD = {"add", "add_", "__add__", "__radd__", "__iadd__"}
_SUB = {"sub", "sub_", "__sub__", "__isub__", "subtract"}
_RSUB = {"__rsub__"}
_MATMUL = {"matmul", "__matmul__", "mm", "bmm", "__rmatmul__"}
_CASTS = {"to", "bfloat16", "float"}
_NORMS = {"norm", "vector_norm", "linalg_vector_norm", "frobenius_norm"}


def _is_scalar_operand(x, tensor):
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return True
    return isinstance(x, torch.Tensor) and x.dim() == 0 and x.dtype != tensor.dtype


def _as_f32(x):
    if isinstance(x, torch.Tensor):
        return x.to(torch.float32)
    return torch.tensor(float(x), dtype=torch.float32)


class Torch2Rounding(TorchFunctionMode):
    """bf16 rounding of PyTorch 2.x eager mode on 1.13 (see the module docstring)."""

    def __init__(self, promote=None, matmul_split=1, torch2_norm=True, topk_sorted=False):
        super().__init__()
        self.topk_sorted = topk_sorted
        self.promote = promote
        self.matmul_split = matmul_split
        self.torch2_norm = torch2_norm

    @staticmethod
    def _norm(name, args, kwargs):
        x = args[0]
        rest = dict(kwargs)
        pos = list(args[1:])
        if name == "frobenius_norm":
            p, dim = 2, (pos[0] if pos else rest.pop("dim", None))
            keepdim = pos[1] if len(pos) > 1 else rest.pop("keepdim", False)
        else:
            key = "ord" if name != "norm" else "p"
            p = pos.pop(0) if pos else rest.pop(key, 2)
            dim = pos.pop(0) if pos else rest.pop("dim", None)
            keepdim = pos.pop(0) if pos else rest.pop("keepdim", False)
        if p in ("fro", None):
            p = 2
        if p != 2 or rest.get("dtype") is not None or pos:
            return None
        r = torch.linalg.vector_norm(x.to(torch.float32), 2, dim=dim, keepdim=keepdim)
        return r.to(torch.bfloat16)

    def _matmul(self, a, b):
        a32, b32 = a.to(torch.float32), b.to(torch.float32)
        if self.matmul_split <= 1 or a32.shape[-1] < 2:
            return torch.matmul(a32, b32).to(torch.bfloat16)
        k = a32.shape[-1]
        edges = [round(i * k / self.matmul_split) for i in range(self.matmul_split + 1)]
        acc = None
        for lo, hi in zip(edges[:-1], edges[1:]):
            if hi <= lo:
                continue
            part = torch.matmul(a32[..., lo:hi], b32[..., lo:hi, :])
            acc = part if acc is None else acc + part
        return acc.to(torch.bfloat16)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if self.promote is not None and name in _CASTS and args:
            lowered = {torch.bfloat16}
            if self.promote == torch.float64:
                lowered.add(torch.float32)
            if name == "bfloat16" or (name == "float" and torch.float32 in lowered):
                return args[0].to(self.promote)
            if name == "to":
                a = list(args)
                if kwargs.get("dtype") in lowered:
                    kwargs = dict(kwargs, dtype=self.promote)
                a = [self.promote if (isinstance(x, torch.dtype) and x in lowered) else x
                     for x in a]
                return func(*a, **kwargs)
        if (name in ("lerp", "lerp_") and len(args) == 3 and isinstance(args[0], torch.Tensor)
                and args[0].dtype == torch.float64 and isinstance(args[2], torch.Tensor)
                and args[2].dim() == 0 and args[2].dtype != args[0].dtype):
            return func(args[0], args[1], args[2].to(args[0].dtype), **kwargs)
        if self.topk_sorted and name == "topk" and kwargs.get("sorted") is False:
            kwargs = dict(kwargs, sorted=True)
            return func(*args, **kwargs)
        if (self.torch2_norm and name in _NORMS and args and isinstance(args[0], torch.Tensor)
                and args[0].dtype == torch.bfloat16):
            r = self._norm(name, args, kwargs)
            if r is not None:
                return r
        if name in _MATMUL and len(args) == 2 and not kwargs:
            a, b = args
            if (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                    and a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16):
                return self._matmul(a, b)
        arith = name in _MUL or name in _DIV or name in _ADD or name in _SUB or name in _RSUB
        if arith and len(args) == 2 and not kwargs:
            a, b = args
            t, s = (a, b) if isinstance(a, torch.Tensor) else (b, a)
            if (isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16
                    and _is_scalar_operand(s, t)):
                x, y = (t, s) if t is a else (s, t)
                if name in _RSUB:  # s - t, with `t` the tensor the method was called on
                    x, y = s, t
                x32 = x.to(torch.float32) if isinstance(x, torch.Tensor) else _as_f32(x)
                y32 = y.to(torch.float32) if isinstance(y, torch.Tensor) else _as_f32(y)
                if name in _MUL:
                    r = x32 * y32
                elif name in _DIV:
                    r = x32 / y32
                elif name in _ADD:
                    r = x32 + y32
                else:
                    r = x32 - y32
                r = r.to(torch.bfloat16)
                if name.endswith("_") or name.startswith("__i"):
                    t.copy_(r)
                    return t
                return r
        return func(*args, **kwargs)


@contextlib.contextmanager
def reference_semantics(**options):
    """`with reference_semantics(): opt.step()` runs one step under `Torch2Rounding`."""
    with Torch2Rounding(**options):
        yield


def load_dion(checkout):
    """Installs the layer and imports `dion` from a checkout directory."""
    install()
    if checkout not in sys.path:
        sys.path.insert(0, checkout)
    import dion  # noqa: F401
    return dion


__all__ = ["install", "Torch2Rounding", "reference_semantics", "load_dion"]
