"""Feature specs: frozen, keyword-only attrs classes that say *what* to turn on.

Specs are pure data. Hooks read them and never change them; per-call state lives in the handle.
A bad value raises `hookkit.errors.SpecError` naming the field, the value and what is allowed. Every spec
round-trips through a plain dict: `Spec.from_dict(spec.to_dict()) == spec`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from fractions import Fraction
from typing import Any, ClassVar

import attrs

from hookkit.errors import SpecError, spec_error

# --- validators --------------------------------------------------------------------------------------


def _owner(inst: Any) -> str:
    return type(inst).__name__


def _int(minimum: int, maximum: int | None = None) -> Callable[[Any, attrs.Attribute, Any], None]:
    def check(inst: Any, attr: attrs.Attribute, value: Any) -> None:
        bound = f"an int >= {minimum}" + (f" and <= {maximum}" if maximum is not None else "")
        if isinstance(value, bool) or not isinstance(value, int):
            raise spec_error(_owner(inst), attr.name, value, bound)
        if value < minimum or (maximum is not None and value > maximum):
            raise spec_error(_owner(inst), attr.name, value, bound)

    return check


def _float(minimum: float, allow_none: bool = False, strict: bool = False) -> Callable[[Any, attrs.Attribute, Any], None]:
    def check(inst: Any, attr: attrs.Attribute, value: Any) -> None:
        bound = f"a number {'>' if strict else '>='} {minimum}" + (" or None" if allow_none else "")
        if value is None and allow_none:
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise spec_error(_owner(inst), attr.name, value, bound)
        if value < minimum or (strict and value == minimum) or value != value:
            raise spec_error(_owner(inst), attr.name, value, bound)

    return check


def _choice(*allowed: Any) -> Callable[[Any, attrs.Attribute, Any], None]:
    def check(inst: Any, attr: attrs.Attribute, value: Any) -> None:
        # `0 == False` and `1 == True`: an int must not pass for a bool choice, nor a bool for an int one
        if not any(value == a and isinstance(value, bool) == isinstance(a, bool) for a in allowed):
            raise spec_error(_owner(inst), attr.name, value, f"one of {allowed}")

    return check


def _bool(inst: Any, attr: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, bool):
        raise spec_error(_owner(inst), attr.name, value, "True or False")


def _str_tuple(inst: Any, attr: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, tuple) or not all(isinstance(v, str) and v for v in value):
        raise spec_error(_owner(inst), attr.name, value, "a list of non-empty strings")


def _to_tuple(value: Any) -> Any:
    """Lists (from TOML/JSON/dicts) become tuples so that frozen specs stay hashable; anything else passes."""
    return tuple(value) if isinstance(value, list) else value


def _instance_of(cls: type | tuple[type, ...], what: str) -> Callable[[Any, attrs.Attribute, Any], None]:
    def check(inst: Any, attr: attrs.Attribute, value: Any) -> None:
        if value is not None and not isinstance(value, cls):
            raise spec_error(_owner(inst), attr.name, value, f"{what} or None")

    return check


# --- DBCache ---------------------------------------------------------------------------------------------

#: Named step masks, defined for 28 steps as alternating (compute, cache) bins and scaled to other step
#: counts. 1 = compute, 0 = may cache. Every policy covers exactly 28 steps; computed steps: slow 18,
#: medium 15, fast 11, ultra 8.
MASK_POLICIES: dict[str, tuple[tuple[int, int], ...]] = {
    # cache-dit's predefined 28-step policies, bin for bin (cache_dit.steps_mask): the same name computes the
    # same steps in both libraries, so results compare directly
    "slow": ((8, 1), (3, 2), (3, 2), (2, 2), (1, 3), (1, 0)),      # 18 of 28 steps computed
    "medium": ((6, 1), (2, 3), (2, 3), (2, 3), (2, 3), (1, 0)),    # 15 of 28
    "fast": ((6, 1), (1, 3), (1, 4), (1, 5), (1, 4), (1, 0)),      # 11 of 28
    "ultra": ((4, 2), (1, 5), (1, 6), (1, 7), (1, 0)),             # 8 of 28
}


def _is_int(value: Any) -> bool:
    """An integer (numpy's included) that is not a bool; 1.0 is no step flag."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_steps_mask(inst: Any, attr: attrs.Attribute, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, str):
        if value not in MASK_POLICIES:
            raise spec_error(_owner(inst), attr.name, value, f"one of {tuple(MASK_POLICIES)} or a list of 0/1")
        return
    if not isinstance(value, tuple) or not value or any(not _is_int(v) or v not in (0, 1) for v in value):
        raise spec_error(_owner(inst), attr.name, value, "a non-empty list of 0 (may cache) / 1 (compute), a policy name, or None")


@attrs.frozen(kw_only=True)
class DBCache:
    """DBCache-style residual caching (Fn first blocks always run, Bn last blocks always run).

    On a step that may be cached, the first `fn_blocks` run; if the relative L1 change of their residual
    against the last computed step is below `threshold`, the middle blocks are skipped and their cached
    residual is added instead; the last `bn_blocks` always run.
    """

    NAME: ClassVar[str] = "cache"
    fn_blocks: int = attrs.field(default=1, validator=_int(1))
    bn_blocks: int = attrs.field(default=0, validator=_int(0))
    #: defaults (F1B0, threshold 0.24, TaylorSeer order 1, 8 warm-up steps) measured on hookkit's trained tiny
    #: Flux: 1.91x fewer block calls at 41.2 dB PSNR against uncached (BENCHMARKS.md, quality table)
    threshold: float = attrs.field(default=0.24, validator=_float(0.0))
    warmup_steps: int = attrs.field(default=8, validator=_int(0))
    warmup_interval: int = attrs.field(default=1, validator=_int(1))
    max_cached_steps: int = attrs.field(default=-1, validator=_int(-1))
    max_continuous_cached_steps: int = attrs.field(default=-1, validator=_int(-1))
    max_accumulated_diff: float | None = attrs.field(default=None, validator=_float(0.0, allow_none=True, strict=True))
    steps_mask: tuple[int, ...] | str | None = attrs.field(default=None, converter=_to_tuple, validator=_check_steps_mask)
    mask_policy: str = attrs.field(default="dynamic", validator=_choice("dynamic", "static"))
    taylorseer_order: int = attrs.field(default=1, validator=_int(0, 2))

    @mask_policy.validator
    def _check_static_has_mask(self, attr: attrs.Attribute, value: str) -> None:
        # "static" follows the mask alone; without one it would silently cache like "dynamic"
        if value == "static" and self.steps_mask is None:
            raise SpecError("DBCache.mask_policy: 'static' follows steps_mask alone, but steps_mask is None. "
                            "Give a mask (steps_mask='fast' or a 0/1 list) or use mask_policy='dynamic'.")


def resolve_steps_mask(mask: tuple[int, ...] | str | None, num_steps: int) -> tuple[int, ...] | None:
    """The 0/1 mask for `num_steps` steps: a named policy scaled from 28 steps, or an explicit list.

    An explicit list shorter than `num_steps` computes the remaining steps (1); a longer one is cut.
    """
    if mask is None:
        return None
    if isinstance(mask, str):
        base: list[int] = []
        for compute, cache in MASK_POLICIES[mask]:
            base += [1] * compute + [0] * cache
        if num_steps == len(base):
            return tuple(base)
        return _scale_mask(base, num_steps)
    return tuple(mask[:num_steps]) + (1,) * max(0, num_steps - len(mask))


def _scale_mask(base: list[int], n: int) -> tuple[int, ...]:
    """`base` (28 steps) stretched to `n` steps: the same share of computed steps, spread as in `base`.

    The cumulative count of computed steps along the schedule is what scales: `base`'s (linear between steps)
    read at the same relative positions and multiplied by the new total; step i computes where the rounded
    count goes up. So "fast" stays denser early and sparser late at any step count, and a faster policy never
    computes more steps than a slower one (sampling single steps of `base` did: "fast" computed 3 of 9 steps
    but 7 of 10). The first and last steps always compute.
    """
    m, total = len(base), sum(base)
    prefix = [0]
    for b in base:
        prefix.append(prefix[-1] + b)

    def computed_before(x: Fraction) -> Fraction:
        j = int(x)
        return Fraction(prefix[m]) if j >= m else prefix[j] + base[j] * (x - j)

    target = max(1, math.floor(Fraction(total * n, m) + Fraction(1, 2)))
    counts = [math.floor(computed_before(Fraction(i * m, n)) * target / total + Fraction(1, 2)) for i in range(n + 1)]
    scaled = [1 if counts[i + 1] > counts[i] else 0 for i in range(n)]
    scaled[0] = scaled[-1] = 1
    return tuple(scaled)


# --- Quantize --------------------------------------------------------------------------------------------

QUANT_SCHEMES = ("fp8_row", "fp8_tensor", "fp8_weight_only", "int8_dynamic", "int8_weight_only", "nvfp4", "mxfp8")


@attrs.frozen(kw_only=True)
class Quantize:
    """torchao weight quantization of the transformer's Linear layers, selected by the adapter and rules."""

    NAME: ClassVar[str] = "quantize"
    scheme: str = attrs.field(validator=_choice(*QUANT_SCHEMES))
    region: str = attrs.field(default="repeated_blocks", validator=_choice("repeated_blocks", "all"))
    exclude: tuple[str, ...] = attrs.field(default=(), converter=_to_tuple, validator=_str_tuple)
    include: tuple[str, ...] = attrs.field(default=(), converter=_to_tuple, validator=_str_tuple)
    min_features: int = attrs.field(default=0, validator=_int(0))
    filter_fn: Callable[..., bool] | None = attrs.field(default=None, eq=False)
    keep_original: str | None = attrs.field(default=None, validator=_choice(None, "cpu", "device"))

    @filter_fn.validator
    def _check_filter(self, attr: attrs.Attribute, value: Any) -> None:
        if value is not None and not callable(value):
            raise spec_error("Quantize", "filter_fn", value, "a callable (module, fqn) -> bool or None")


# --- Compile ---------------------------------------------------------------------------------------------

COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@attrs.frozen(kw_only=True)
class Compile:
    """torch.compile of the adapter's repeated blocks (`regional=True`) or of the whole transformer.

    `cuda_graphs="transformer"` captures one CUDA graph per transformer call signature on top of
    regional compilation (GPU only).
    """

    NAME: ClassVar[str] = "compile"
    regional: bool = attrs.field(default=True, validator=_bool)
    mode: str | None = attrs.field(default=None, validator=_choice(*COMPILE_MODES))
    fullgraph: bool = attrs.field(default=True, validator=_bool)
    dynamic: bool | None = attrs.field(default=None, validator=_choice(None, True, False))
    cuda_graphs: str = attrs.field(default="none", validator=_choice("none", "transformer"))
    #: torch.compile backend; "inductor" for speed, "eager"/"aot_eager" to debug tracing without codegen
    backend: str = attrs.field(default="inductor", validator=_choice("inductor", "eager", "aot_eager", "cudagraphs"))


# --- Spec ------------------------------------------------------------------------------------------------

_FEATURES: dict[str, type] = {"cache": DBCache, "quantize": Quantize, "compile": Compile}


@attrs.frozen(kw_only=True)
class Spec:
    """Everything to turn on for one transformer. Every feature is optional; `Spec()` turns on nothing
    but the per-call bookkeeping (and is still a valid, removable attachment)."""

    cache: DBCache | None = attrs.field(default=None, validator=_instance_of(DBCache, "a hookkit.DBCache"))
    quantize: Quantize | None = attrs.field(default=None, validator=_instance_of(Quantize, "a hookkit.Quantize"))
    compile: Compile | None = attrs.field(default=None, validator=_instance_of(Compile, "a hookkit.Compile"))
    sync_free: bool = attrs.field(default=False, validator=_bool)
    memo: bool = attrs.field(default=False, validator=_bool)

    def to_dict(self) -> dict[str, Any]:
        """A plain dict (lists for tuples), the inverse of `Spec.from_dict`."""
        out: dict[str, Any] = {}
        for field in attrs.fields(Spec):
            value = getattr(self, field.name)
            if attrs.has(type(value)):
                value = {k: list(v) if isinstance(v, tuple) else v for k, v in attrs.asdict(value, recurse=False).items()}
            out[field.name] = value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Spec:
        """Build a Spec from a plain dict; unknown keys raise `SpecError` naming them."""
        if not isinstance(data, dict):
            raise spec_error("Spec", "<dict>", data, "a dict of feature name -> settings")
        kwargs: dict[str, Any] = {}
        names = {f.name for f in attrs.fields(Spec)}
        for key, value in data.items():
            if key not in names:
                raise spec_error("Spec", key, value, f"a known feature: {sorted(names)}", "Remove or rename the key.")
            feature = _FEATURES.get(key)
            if feature is not None and isinstance(value, dict):
                value = _build(feature, value)
            kwargs[key] = value
        return cls(**kwargs)


def _build(cls: type, data: dict[str, Any]) -> Any:
    names = {f.name for f in attrs.fields(cls)}
    for key, value in data.items():
        if key not in names:
            raise spec_error(cls.__name__, key, value, f"a known field: {sorted(names)}", "Remove or rename the key.")
    for field in attrs.fields(cls):
        if field.default is attrs.NOTHING and field.name not in data:
            raise SpecError(f"{cls.__name__}.{field.name}: expected a value (the field is required), got none in "
                            f"{data!r}. Add the key {field.name!r}.")
    return cls(**data)
