"""Parameter groups' options, without torch: defaults, validation and the group protos.

Shared by diond.torch and diond.jax (and usable from any client that builds CreateSession
requests itself). The names, defaults and ranges are microsoft/dion's (docs/ALGORITHMS.md):
``DEFAULTS`` are the reference constructors' defaults, ``APPLIES[algorithm]`` the options an
algorithm has, ``check_options`` the constructor keywords, ``check_group`` one group's keys,
``validate_options`` the ranges (ValueError, as the reference raises), ``group_proto`` the
``diond.v1.ParameterGroup`` of a validated group.
"""
import math

from .client import pb

__all__ = ["ALGORITHMS", "DEFAULTS", "APPLIES", "MATRIX_ALGORITHMS", "check_options",
           "check_group", "validate_options", "group_proto", "same_option"]

ALGORITHMS = {
    "muon": pb.ALGORITHM_MUON,
    "normuon": pb.ALGORITHM_NORMUON,
    "dion": pb.ALGORITHM_DION,
    "dion2": pb.ALGORITHM_DION2,
    "dion3": pb.ALGORITHM_DION3,
    "nordion2": pb.ALGORITHM_DION3,
    "adamw": pb.ALGORITHM_ADAMW,
    "lion": pb.ALGORITHM_LION,
}
_MATRIX = {"muon", "normuon", "dion", "dion2", "dion3", "nordion2"}

# The reference's constructor defaults (ALGORITHMS.md §5.1, §6.1, §7.1, §8.1, §9.1, §13).
DEFAULTS = dict(
    algorithm="muon", lr=0.01, mu=0.95, betas=(0.9, 0.95), weight_decay=0.01, epsilon=1e-8,
    nesterov=False, cautious_wd=False, adjust_lr="spectral_norm", flatten=False,
    use_polar_express=True, muon_beta2=0.95, rank_fraction=1.0, rank_multiple_of=1,
    fraction=0.25, ef_decay=0.95, num_heads=None, split_sizes=None, precision="fp32", seed=0,
    qr_method="rcqr", cqr_warmup_steps=150, oversample=1.25, bf16_matmul="auto",
)
_COMMON = {"lr", "weight_decay", "precision"}
# Which options each algorithm has (anything else set on a group of that algorithm is an error).
APPLIES = {
    "muon": _COMMON | {"mu", "epsilon", "nesterov", "cautious_wd", "adjust_lr", "flatten",
                       "use_polar_express", "num_heads", "split_sizes", "bf16_matmul"},
    "normuon": _COMMON | {"mu", "epsilon", "nesterov", "cautious_wd", "adjust_lr", "flatten",
                          "use_polar_express", "num_heads", "split_sizes", "muon_beta2",
                          "bf16_matmul"},
    "dion": _COMMON | {"mu", "epsilon", "rank_fraction", "rank_multiple_of", "seed",
                       "qr_method", "cqr_warmup_steps", "oversample"},
    "dion2": _COMMON | {"fraction", "ef_decay", "epsilon", "adjust_lr", "flatten",
                        "use_polar_express", "num_heads", "bf16_matmul"},
    "dion3": _COMMON | {"fraction", "mu", "muon_beta2", "epsilon", "adjust_lr", "flatten",
                        "use_polar_express", "num_heads", "bf16_matmul"},
    "adamw": _COMMON | {"betas", "epsilon", "cautious_wd"},
    "lion": _COMMON | {"betas", "cautious_wd"},
}
APPLIES["nordion2"] = APPLIES["dion3"]
# Keys a group may carry besides the options (params, a name for logs and metrics, the
# reference's host step counter, what LR schedulers add).
_GROUP_META = {"params", "param_names", "algorithm", "name", "step", "initial_lr"}

# Constructor arguments of the reference classes that select implementations diond does not
# need: accepted with the values that compute the same numbers, refused otherwise.
_COMPAT = {
    "use_triton": (lambda v: True, "Triton kernels compute the same functions"),
    "triton_post_ortho": (lambda v: True, "a fused kernel of the same computation"),
    "use_gram_newton_schulz": (lambda v: not v, "Gram Newton-Schulz is not implemented"),
    "newton_schulz_func": (lambda v: v is None, "custom orthogonalizers cannot run in the daemon"),
    "distributed_mesh": (lambda v: v is None, "the daemon world replaces device meshes"),
    "replicate_mesh": (lambda v: v is None, "the daemon world replaces device meshes"),
    "outer_shard_mesh": (lambda v: v is None, "the daemon world replaces device meshes"),
    "inner_shard_mesh": (lambda v: v is None, "the daemon world replaces device meshes"),
    "replicate_mesh_grad_sync": (lambda v: True, "single trainer"),
    "selection_scope": (lambda v: v in ("local", "global"), "must be 'local' or 'global'"),
    "verbose": (lambda v: True, ""),
    "power_iters": (lambda v: v == 1, "Dion supports power_iters=1 only"),
    "mixed_precision_config": (lambda v: v is None, "state is float32 in the daemon"),
}

_ADJUST = {"spectral_norm": pb.ADJUST_LR_SPECTRAL_NORM, "rms_norm": pb.ADJUST_LR_RMS_NORM,
           None: pb.ADJUST_LR_NONE, "none": pb.ADJUST_LR_NONE}
_PRECISION = {"fp32": pb.PRECISION_FP32, "bf16_reference": pb.PRECISION_BF16_REFERENCE}
_BF16_MATMUL = {"auto": pb.BF16_MATMUL_AUTO, "float32_gemm": pb.BF16_MATMUL_FLOAT32_GEMM,
                "onednn": pb.BF16_MATMUL_ONEDNN}
_NONFINITE = {"skip": pb.NON_FINITE_POLICY_SKIP, "error": pb.NON_FINITE_POLICY_ERROR}
_GRADIENT_SYNC = {"replicated": pb.GRADIENT_SYNC_REPLICATED, "average": pb.GRADIENT_SYNC_AVERAGE,
                  "dion_compressed": pb.GRADIENT_SYNC_DION_COMPRESSED}
_QR_METHOD = {"rcqr": pb.QR_METHOD_RCQR, "qr": pb.QR_METHOD_QR, "cqr": pb.QR_METHOD_CQR}
# Reference spellings of an option: dion's constructor takes rcqr_oversample and stores it in
# each group as "oversample".
_ALIASES = {"rcqr_oversample": "oversample"}
# Constructor arguments of _COMPAT that the reference also reads per group.
_GROUP_COMPAT = {"selection_scope"}


def _is_num(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_range(name, v, lo, hi, lo_open=False, hi_open=False, where=""):
    if _is_scalar_array(v):
        v = v.item()
    if not _is_num(v) or not math.isfinite(v):
        raise ValueError("%s%s must be a finite number, got %r" % (where, name, v))
    if (v < lo or (lo_open and v == lo)) or (hi is not None and (v > hi or (hi_open and v == hi))):
        rng = "%s%g, %s%s" % ("(" if lo_open else "[", lo, "inf" if hi is None else "%g" % hi,
                              ")" if hi_open or hi is None else "]")
        raise ValueError("%s%s = %r is out of range %s" % (where, name, v, rng))
    return float(v)


def _validate_options(opts, algo, where):
    """Range checks of every option the algorithm uses (the reference's ValueErrors)."""
    use = APPLIES[algo]
    _check_range("lr", opts["lr"], 0, None, where=where)
    _check_range("weight_decay", opts["weight_decay"], 0, None, where=where)
    if "mu" in use:
        _check_range("mu", opts["mu"], 0, 1, hi_open=True, where=where)
    if "betas" in use:
        b = opts["betas"]
        if not isinstance(b, (tuple, list)) or len(b) != 2:
            raise ValueError("%sbetas must be a pair (beta1, beta2), got %r" % (where, b))
        for i, x in enumerate(b):
            _check_range("betas[%d]" % i, x, 0, 1, hi_open=True, where=where)
    if "epsilon" in use:
        _check_range("epsilon", opts["epsilon"], 0, None, where=where)
    if "muon_beta2" in use:
        _check_range("muon_beta2", opts["muon_beta2"], 0, 1, hi_open=True, where=where)
    if "fraction" in use:
        _check_range("fraction", opts["fraction"], 0, 1, lo_open=True, where=where)
    if "ef_decay" in use:
        _check_range("ef_decay", opts["ef_decay"], 0, 1, where=where)
    if "rank_fraction" in use:
        _check_range("rank_fraction", opts["rank_fraction"], 0, 1, lo_open=True, where=where)
    if "rank_multiple_of" in use:
        r = opts["rank_multiple_of"]
        if not isinstance(r, int) or isinstance(r, bool) or r < 1:
            raise ValueError("%srank_multiple_of must be an int >= 1, got %r" % (where, r))
    if "seed" in use:
        s = opts["seed"]
        if not isinstance(s, int) or isinstance(s, bool) or not 0 <= s < 2 ** 64:
            raise ValueError("%sseed must be an int in [0, 2**64), got %r" % (where, s))
    if "qr_method" in use and opts["qr_method"] not in _QR_METHOD:
        raise ValueError("%sqr_method must be 'rcqr', 'qr' or 'cqr', got %r"
                         % (where, opts["qr_method"]))
    if "cqr_warmup_steps" in use:
        w = opts["cqr_warmup_steps"]
        if not isinstance(w, int) or isinstance(w, bool) or w < 0:
            raise ValueError("%scqr_warmup_steps must be an int >= 0, got %r" % (where, w))
    if "oversample" in use:
        _check_range("oversample (rcqr_oversample)", opts["oversample"], 0, 16, lo_open=True,
                     where=where)
    for flag in ("nesterov", "cautious_wd", "flatten", "use_polar_express"):
        if flag in use and not isinstance(opts[flag], bool):
            raise ValueError("%s%s must be a bool, got %r" % (where, flag, opts[flag]))
    if "adjust_lr" in use and opts["adjust_lr"] not in _ADJUST:
        raise ValueError("%sadjust_lr must be 'spectral_norm', 'rms_norm' or None, got %r"
                         % (where, opts["adjust_lr"]))
    if opts["precision"] not in _PRECISION:
        raise ValueError("%sprecision must be 'fp32' or 'bf16_reference', got %r"
                         % (where, opts["precision"]))
    if "bf16_matmul" in use and opts["bf16_matmul"] not in _BF16_MATMUL:
        raise ValueError("%sbf16_matmul must be 'auto', 'float32_gemm' or 'onednn', got %r"
                         % (where, opts["bf16_matmul"]))
    if "num_heads" in use and opts["num_heads"] is not None:
        h = opts["num_heads"]
        if not isinstance(h, int) or isinstance(h, bool) or h < 1:
            raise ValueError("%snum_heads must be a positive int or None, got %r" % (where, h))
        if h > 1 and opts.get("flatten"):
            raise ValueError("%snum_heads cannot be combined with flatten=True" % where)
    if "split_sizes" in use and opts["split_sizes"] is not None:
        s = opts["split_sizes"]
        if (not isinstance(s, (tuple, list)) or len(s) < 2
                or any(not isinstance(x, int) or isinstance(x, bool) or x < 1 for x in s)):
            raise ValueError("%ssplit_sizes must be a list of >= 2 positive ints, got %r"
                             % (where, s))
        if opts.get("num_heads") not in (None, 1):
            raise ValueError("%ssplit_sizes cannot be combined with num_heads" % where)
        if opts.get("flatten"):
            raise ValueError("%ssplit_sizes cannot be combined with flatten=True" % where)


def _group_proto(name, g):
    algo = g["algorithm"]
    use = APPLIES[algo]
    h = pb.Hyperparameters(lr=float(g["lr"]), weight_decay=float(g["weight_decay"]))
    if "mu" in use:
        h.mu = float(g["mu"])
    if "betas" in use:
        h.beta1, h.beta2 = float(g["betas"][0]), float(g["betas"][1])
    if "epsilon" in use:
        h.epsilon = float(g["epsilon"])
    if "nesterov" in use:
        h.nesterov = bool(g["nesterov"])
    if "cautious_wd" in use:
        h.cautious_wd = bool(g["cautious_wd"])
    if "adjust_lr" in use:
        h.adjust_lr = _ADJUST[g["adjust_lr"]]
    if "use_polar_express" in use:
        h.orthogonalizer = (pb.ORTHOGONALIZER_POLAR_EXPRESS if g["use_polar_express"]
                            else pb.ORTHOGONALIZER_NEWTON_SCHULZ)
    if "muon_beta2" in use:
        h.muon_beta2 = float(g["muon_beta2"])
    if "rank_fraction" in use:
        h.rank_fraction = float(g["rank_fraction"])
        h.rank_multiple_of = int(g["rank_multiple_of"])
    if "fraction" in use:
        h.fraction = float(g["fraction"])
    if "ef_decay" in use:
        h.ef_decay = float(g["ef_decay"])
    if "qr_method" in use:
        h.qr_method = _QR_METHOD[g["qr_method"]]
        h.cqr_warmup_steps = int(g["cqr_warmup_steps"])
        h.oversample = float(g["oversample"])
    pg = pb.ParameterGroup(name=name, algorithm=ALGORITHMS[algo], hyperparameters=h,
                           precision=_PRECISION[g["precision"]])
    if "num_heads" in use and g["num_heads"] is not None:
        pg.num_heads = int(g["num_heads"])
    if "split_sizes" in use and g["split_sizes"] is not None:
        pg.split_sizes.extend(int(x) for x in g["split_sizes"])
    if "flatten" in use:
        pg.flatten = bool(g["flatten"])
    if "seed" in use:
        pg.seed = int(g["seed"])
    if "bf16_matmul" in use:
        pg.bf16_matmul = _BF16_MATMUL[g["bf16_matmul"]]
    return pg


def _norm(v):
    if isinstance(v, list):
        return tuple(v)
    return v



MATRIX_ALGORITHMS = frozenset(_MATRIX)
validate_options = _validate_options
group_proto = _group_proto
same_option = _norm


def _is_scalar_array(v):
    """A one-element tensor or array of any framework (torch, numpy, jax)."""
    shape = getattr(v, "shape", None)
    return shape is not None and hasattr(v, "item") and math.prod(tuple(shape)) == 1


def check_options(options, what="Optimizer"):
    """The constructor's group defaults: DEFAULTS updated with `options` (the keyword arguments),
    after aliases are resolved and the compatibility arguments of the reference's constructors
    are checked and dropped. TypeError for an unknown option, ValueError for an unsupported
    compatibility value. Returns (defaults, the set of options given explicitly)."""
    options = dict(options)
    for alias, name in _ALIASES.items():
        if alias in options:
            if name in options:
                raise ValueError("give %s or %s, not both" % (alias, name))
            options[name] = options.pop(alias)
    for k in list(options):
        if k in _COMPAT:
            ok, why = _COMPAT[k]
            v = options.pop(k)
            if not ok(v):
                raise ValueError("%s=%r is not supported by diond (%s)" % (k, v, why))
        elif k not in DEFAULTS:
            raise TypeError("%s got an unexpected option %r; group options are: %s"
                            % (what, k, ", ".join(sorted(DEFAULTS))))
    defaults = dict(DEFAULTS)
    defaults.update(options)
    return defaults, set(options)


def check_group(param_group, gi, default_algorithm):
    """Checks the keys of parameter group `gi` (a dict) and returns (algorithm, a cleaned copy):
    aliases resolved, per-group compatibility keys checked and dropped. ValueError for an unknown
    algorithm or option, an option the group's algorithm does not have, or a bad name. The
    defaults are not filled in and the values are not range-checked (validate_options)."""
    if not isinstance(param_group, dict):
        raise TypeError("param group must be a dict, got %s" % type(param_group).__name__)
    where = "param group %d: " % gi
    algo = param_group.get("algorithm", default_algorithm)
    if algo not in ALGORITHMS:
        raise ValueError("%sunknown algorithm %r; expected one of %s"
                         % (where, algo, ", ".join(ALGORITHMS)))
    param_group = dict(param_group)
    for alias, name in _ALIASES.items():
        if alias in param_group:
            if name in param_group:
                raise ValueError("%sgive %s or %s, not both" % (where, alias, name))
            param_group[name] = param_group.pop(alias)
    for k in list(param_group):
        if k in _GROUP_META:
            continue
        if k in _GROUP_COMPAT:
            ok, why = _COMPAT[k]
            if not ok(param_group[k]):
                raise ValueError("%s%s=%r is not supported by diond (%s)"
                                 % (where, k, param_group[k], why))
            del param_group[k]  # diond never shards a matrix: both scopes select alike
            continue
        if k in _COMPAT:
            raise ValueError("%s%r is a constructor argument, not a group option" % (where, k))
        if k not in DEFAULTS:
            raise ValueError("%sunknown option %r; options are: %s"
                             % (where, k, ", ".join(sorted(DEFAULTS))))
        if k not in APPLIES[algo]:
            raise ValueError("%soption %r does not apply to algorithm %r (it uses: %s)"
                             % (where, k, algo, ", ".join(sorted(APPLIES[algo]))))
    if "name" in param_group and (not isinstance(param_group["name"], str)
                                  or not param_group["name"]):
        raise ValueError("%sname must be a non-empty string" % where)
    param_group["algorithm"] = algo
    return algo, param_group


def unused_options(explicit, defaults, algorithms):
    """ValueError when an explicitly given, non-default constructor option is used by none of
    the groups' algorithms (it would silently do nothing)."""
    used = set()
    for a in algorithms:
        used |= APPLIES[a]
    for k in set(explicit) - {"algorithm"}:
        if k not in used and _norm(defaults[k]) != _norm(DEFAULTS[k]):
            raise ValueError("option %s=%r is used by no parameter group (algorithms: %s)"
                             % (k, defaults[k], ", ".join(sorted(set(algorithms)))))
