"""Parameter groups' options, without torch: defaults, validation and the group protos.

Shared by diond.torch and diond.jax (and usable from any client that builds CreateSession
requests itself). The options of ``diond.v1.Hyperparameters`` -- their defaults, ranges and the
algorithms that read them -- are the daemon's: ``OptionSchema`` is built from its
``DescribeOptions`` answer (``Client.option_schema()``, one call per connection), so this module
keeps no copy of them. What it keeps is their spelling as microsoft/dion's constructors take
them (``betas`` for beta1 and beta2, ``use_polar_express`` for the orthogonalizer,
``adjust_lr=None``, ``rcqr_oversample`` for oversample) and the fields of ``ParameterGroup``
that are not hyperparameters (num_heads, split_sizes, flatten, precision, seed, bf16_matmul).

``OptionSchema``: ``defaults`` are the constructor's defaults, ``applies[algorithm]`` the
options an algorithm has, ``check_options`` the constructor keywords, ``check_group`` one
group's keys, ``validate`` the ranges (ValueError, as the reference raises), ``group_proto`` the
``diond.v1.ParameterGroup`` of a validated group, ``unused`` the constructor options no group
uses.
"""
import math

from .client import pb

__all__ = ["ALGORITHMS", "MATRIX_ALGORITHMS", "OptionSchema", "same_option"]

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
MATRIX_ALGORITHMS = frozenset(_MATRIX)

# The reference's spelling of a Hyperparameters field, where it differs from the field's name.
_SPELLING = {"beta1": "betas", "beta2": "betas", "orthogonalizer": "use_polar_express"}

# The fields of ParameterGroup that are options of the reference's groups: default, and the
# algorithms that have them (not hyperparameters, so not in the daemon's option table).
_MEGABATCH = {"muon", "normuon", "dion2", "dion3", "nordion2"}
_GROUP_FIELDS = {
    "flatten": (False, _MEGABATCH),
    "num_heads": (None, _MEGABATCH),
    "split_sizes": (None, {"muon", "normuon"}),
    "precision": ("fp32", set(ALGORITHMS)),
    "seed": (0, {"dion"}),
    "bf16_matmul": ("auto", _MEGABATCH),
}
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

_PRECISION = {"fp32": pb.PRECISION_FP32, "bf16_reference": pb.PRECISION_BF16_REFERENCE}
_BF16_MATMUL = {"auto": pb.BF16_MATMUL_AUTO, "float32_gemm": pb.BF16_MATMUL_FLOAT32_GEMM,
                "onednn": pb.BF16_MATMUL_ONEDNN}
_NONFINITE = {"skip": pb.NON_FINITE_POLICY_SKIP, "error": pb.NON_FINITE_POLICY_ERROR}
_GRADIENT_SYNC = {"replicated": pb.GRADIENT_SYNC_REPLICATED, "average": pb.GRADIENT_SYNC_AVERAGE,
                  "dion_compressed": pb.GRADIENT_SYNC_DION_COMPRESSED}
# Reference spellings of an option: dion's constructor takes rcqr_oversample and stores it in
# each group as "oversample".
_ALIASES = {"rcqr_oversample": "oversample"}
# Constructor arguments of _COMPAT that the reference also reads per group.
_GROUP_COMPAT = {"selection_scope"}


def _is_num(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _is_scalar_array(v):
    """A one-element tensor or array of any framework (torch, numpy, jax)."""
    shape = getattr(v, "shape", None)
    return shape is not None and hasattr(v, "item") and math.prod(tuple(shape)) == 1


def _check_range(name, v, row, where=""):
    if _is_scalar_array(v):
        v = v.item()
    if not _is_num(v) or not math.isfinite(v):
        raise ValueError("%s%s must be a finite number, got %r" % (where, name, v))
    lo, hi = row.min, row.max
    if (v < lo or (row.min_exclusive and v == lo)) or v > hi or (row.max_exclusive and v == hi):
        rng = "%s%g, %g%s" % ("(" if row.min_exclusive else "[", lo, hi,
                              ")" if row.max_exclusive or math.isinf(hi) else "]")
        raise ValueError("%s%s = %r is out of range %s" % (where, name, v, rng))
    return float(v)


def _norm(v):
    if isinstance(v, list):
        return tuple(v)
    return v


same_option = _norm


def _choices(row):
    """The values an enum option takes, as messages list them ('a', 'b' or 'c')."""
    names = ["None" if (row.name == "adjust_lr" and n == "none") else "'%s'" % n
             for n in row.enum_values]
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]


class OptionSchema:
    """The daemon's option table (a DescribeOptionsResponse) in the reference's spelling."""

    def __init__(self, response):
        self.rows = list(response.options)
        self._by_name = {r.name: r for r in self.rows}
        by_enum = {}
        for a in response.defaults:
            by_enum[a.algorithm] = a.hyperparameters
        self._algo_defaults = {}
        self.applies = {}
        for algo, number in ALGORITHMS.items():
            if number not in by_enum:
                raise ValueError("the daemon's DescribeOptions has no defaults for %r" % algo)
            self._algo_defaults[algo] = self._spell(by_enum[number])
            use = {k for k, (_, algos) in _GROUP_FIELDS.items() if algo in algos}
            use |= {_SPELLING.get(r.name, r.name) for r in self.rows if number in r.algorithms}
            self.applies[algo] = use
        # The constructor's defaults: those of its default algorithm, which every option has
        # (the daemon serves every field for every algorithm).
        self.defaults = dict(algorithm="muon")
        self.defaults.update(self._algo_defaults["muon"])
        self.defaults.update({k: d for k, (d, _) in _GROUP_FIELDS.items()})

    def _spell(self, h):
        """A Hyperparameters message as the reference's group options."""
        out = {}
        for r in self.rows:
            v = getattr(h, r.name)
            if r.type == pb.OPTION_TYPE_ENUM:
                v = r.enum_values[v - 1] if 0 < v <= len(r.enum_values) else r.enum_values[0]
            if r.name == "orthogonalizer":
                out["use_polar_express"] = v == r.enum_values[0]
            elif r.name in ("beta1", "beta2"):
                b = list(out.get("betas", (None, None)))
                b[r.name == "beta2"] = v
                out["betas"] = tuple(b)
            else:
                out[r.name] = v
        return out

    def algorithm_default(self, algo, k):
        """Option k's default for a group of algorithm `algo`."""
        if k in self._algo_defaults[algo]:
            return self._algo_defaults[algo][k]
        return self.defaults[k]

    def check_options(self, options, what="Optimizer"):
        """The constructor's group defaults: ``defaults`` updated with `options` (the keyword
        arguments), after aliases are resolved and the compatibility arguments of the reference's
        constructors are checked and dropped. TypeError for an unknown option, ValueError for an
        unsupported compatibility value. Returns (defaults, the set of options given
        explicitly)."""
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
            elif k not in self.defaults:
                raise TypeError("%s got an unexpected option %r; group options are: %s"
                                % (what, k, ", ".join(sorted(self.defaults))))
        defaults = dict(self.defaults)
        defaults.update(options)
        return defaults, set(options)

    def check_group(self, param_group, gi, default_algorithm):
        """Checks the keys of parameter group `gi` (a dict) and returns (algorithm, a cleaned
        copy): aliases resolved, per-group compatibility keys checked and dropped. ValueError for
        an unknown algorithm or option, an option the group's algorithm does not have, or a bad
        name. The defaults are not filled in and the values are not range-checked
        (validate)."""
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
            if k not in self.defaults:
                raise ValueError("%sunknown option %r; options are: %s"
                                 % (where, k, ", ".join(sorted(self.defaults))))
            if k not in self.applies[algo]:
                raise ValueError("%soption %r does not apply to algorithm %r (it uses: %s)"
                                 % (where, k, algo, ", ".join(sorted(self.applies[algo]))))
        if "name" in param_group and (not isinstance(param_group["name"], str)
                                      or not param_group["name"]):
            raise ValueError("%sname must be a non-empty string" % where)
        param_group["algorithm"] = algo
        return algo, param_group

    def validate(self, opts, algo, where):
        """Range checks of every option the algorithm uses (the reference's ValueErrors), with
        the daemon's ranges."""
        number = ALGORITHMS[algo]
        for r in self.rows:
            if number not in r.algorithms:
                continue
            if r.name in ("beta1", "beta2"):
                b = opts["betas"]
                if not isinstance(b, (tuple, list)) or len(b) != 2:
                    raise ValueError("%sbetas must be a pair (beta1, beta2), got %r" % (where, b))
                i = int(r.name == "beta2")
                _check_range("betas[%d]" % i, b[i], r, where=where)
                continue
            name = _SPELLING.get(r.name, r.name)
            v = opts[name]
            label = r.name if r.checkpoint_key == r.name else "%s (%s)" % (r.name, r.checkpoint_key)
            if r.name == "orthogonalizer" or r.type == pb.OPTION_TYPE_BOOL:
                if not isinstance(v, bool):
                    raise ValueError("%s%s must be a bool, got %r" % (where, name, v))
            elif r.type == pb.OPTION_TYPE_DOUBLE:
                _check_range(label, v, r, where=where)
            elif r.type == pb.OPTION_TYPE_INT64:
                if not _is_int(v) or v < r.min:
                    raise ValueError("%s%s must be an int >= %d, got %r"
                                     % (where, label, r.min, v))
                if v > r.max:
                    raise ValueError("%s%s must be an int <= %d, got %r"
                                     % (where, label, r.max, v))
            elif r.type == pb.OPTION_TYPE_ENUM:
                ok = v in r.enum_values or (r.name == "adjust_lr" and v is None)
                if not ok:
                    raise ValueError("%s%s must be %s, got %r" % (where, name, _choices(r), v))
        self._validate_group_fields(opts, algo, where)

    def _validate_group_fields(self, opts, algo, where):
        use = self.applies[algo]
        if "flatten" in use and not isinstance(opts["flatten"], bool):
            raise ValueError("%sflatten must be a bool, got %r" % (where, opts["flatten"]))
        if "seed" in use:
            s = opts["seed"]
            if not _is_int(s) or not 0 <= s < 2 ** 64:
                raise ValueError("%sseed must be an int in [0, 2**64), got %r" % (where, s))
        if opts["precision"] not in _PRECISION:
            raise ValueError("%sprecision must be 'fp32' or 'bf16_reference', got %r"
                             % (where, opts["precision"]))
        if "bf16_matmul" in use and opts["bf16_matmul"] not in _BF16_MATMUL:
            raise ValueError("%sbf16_matmul must be 'auto', 'float32_gemm' or 'onednn', got %r"
                             % (where, opts["bf16_matmul"]))
        if "num_heads" in use and opts["num_heads"] is not None:
            h = opts["num_heads"]
            if not _is_int(h) or h < 1:
                raise ValueError("%snum_heads must be a positive int or None, got %r" % (where, h))
            if h > 1 and opts.get("flatten"):
                raise ValueError("%snum_heads cannot be combined with flatten=True" % where)
        if "split_sizes" in use and opts["split_sizes"] is not None:
            s = opts["split_sizes"]
            if (not isinstance(s, (tuple, list)) or len(s) < 2
                    or any(not _is_int(x) or x < 1 for x in s)):
                raise ValueError("%ssplit_sizes must be a list of >= 2 positive ints, got %r"
                                 % (where, s))
            if opts.get("num_heads") not in (None, 1):
                raise ValueError("%ssplit_sizes cannot be combined with num_heads" % where)
            if opts.get("flatten"):
                raise ValueError("%ssplit_sizes cannot be combined with flatten=True" % where)

    def group_proto(self, name, g):
        """The diond.v1.ParameterGroup of a validated group: every hyperparameter its algorithm
        reads, and its group fields."""
        algo = g["algorithm"]
        number = ALGORITHMS[algo]
        h = pb.Hyperparameters()
        for r in self.rows:
            if number not in r.algorithms:
                continue
            if r.name in ("beta1", "beta2"):
                v = g["betas"][int(r.name == "beta2")]
            elif r.name == "orthogonalizer":
                v = r.enum_values[0 if g["use_polar_express"] else 1]
            else:
                v = g[r.name]
            if r.type == pb.OPTION_TYPE_DOUBLE:
                setattr(h, r.name, float(v))
            elif r.type == pb.OPTION_TYPE_INT64:
                setattr(h, r.name, int(v))
            elif r.type == pb.OPTION_TYPE_BOOL:
                setattr(h, r.name, bool(v))
            else:
                setattr(h, r.name, list(r.enum_values).index("none" if v is None else v) + 1)
        use = self.applies[algo]
        pg = pb.ParameterGroup(name=name, algorithm=number, hyperparameters=h,
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

    def unused(self, explicit, defaults, algorithms):
        """ValueError when an explicitly given, non-default constructor option is used by none
        of the groups' algorithms (it would silently do nothing)."""
        used = set()
        for a in algorithms:
            used |= self.applies[a]
        for k in set(explicit) - {"algorithm"}:
            if k not in used and _norm(defaults[k]) != _norm(self.defaults[k]):
                raise ValueError("option %s=%r is used by no parameter group (algorithms: %s)"
                                 % (k, defaults[k], ", ".join(sorted(set(algorithms)))))
