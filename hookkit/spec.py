"""`Spec`: everything to turn on for one transformer, composed of the techniques' own specs.

Specs are pure data. Hooks read them and never change them; per-call state lives in `CallState`.
A bad value raises `hookkit.errors.SpecError` naming the field, the value and what is allowed. Every spec
round-trips through a plain dict: `Spec.from_dict(spec.to_dict()) == spec`.
"""

from __future__ import annotations

import typing
from typing import Any

import attrs

from hookkit.core.validate import boolean, callable_name, closest, instance_of, resolve_callable, strict_init
from hookkit.errors import SpecError, field_error
from hookkit.techniques.attention.spec import Attention
from hookkit.techniques.cache.spec import DBCache
from hookkit.techniques.compile.spec import Compile
from hookkit.techniques.parallel.spec import ContextParallel
from hookkit.techniques.quantize import filters
from hookkit.techniques.quantize.spec import Quantize

@strict_init
@attrs.frozen(kw_only=True)
class Spec:
    """Everything to turn on for one transformer. Every feature is optional; `Spec()` turns on nothing
    but the per-call bookkeeping (and is still a valid, removable attachment). Which features combine is
    in `hookkit.core.compat`.

    Args:
        cache: DBCache residual caching (`hookkit.DBCache`), or None (default).
        quantize: torchao quantization of the Linear layers (`hookkit.Quantize`), or None (default).
        compile: regional or whole torch.compile, CUDA graphs (`hookkit.Compile`), or None (default).
        sync_free: keep the denoising loop free of host syncs (default False; needs a pipeline).
        memo: memoize index tensors built from Python data in the adapter's `memo_scope` (default False).
        parallel: context parallelism through diffusers' `enable_parallelism` (`hookkit.ContextParallel`, under
            torchrun), or None (default: one process, or a transformer the user parallelised themselves).
        attention: the attention kernel per block and denoising step, low precision between full-precision first and
            last steps (`hookkit.Attention`), or None (default: the processors' own kernel).
    """

    cache: DBCache | None = attrs.field(default=None, validator=instance_of(DBCache, "a hookkit.DBCache"))
    quantize: Quantize | None = attrs.field(default=None, validator=instance_of(Quantize, "a hookkit.Quantize"))
    compile: Compile | None = attrs.field(default=None, validator=instance_of(Compile, "a hookkit.Compile"))
    sync_free: bool = attrs.field(default=False, validator=boolean)
    memo: bool = attrs.field(default=False, validator=boolean)
    parallel: ContextParallel | None = attrs.field(default=None,
                                                   validator=instance_of(ContextParallel, "a hookkit.ContextParallel"))
    attention: Attention | None = attrs.field(default=None, validator=instance_of(Attention, "a hookkit.Attention"))

    def to_dict(self) -> dict[str, Any]:
        """A plain, JSON-safe dict (lists for tuples), the inverse of `Spec.from_dict`.

        A nested record (`DBCache.calibration`) is written by its own `to_dict`. A callable field (`Quantize.filter_fn`)
        is written by `validate.callable_name`: a hookkit.filters predicate as its text, which `from_dict` builds back;
        a module-level function as 'module:qualname', which `from_dict` imports only with `trust_code`; a lambda or
        local function as its repr, which `from_dict` refuses.
        """
        out: dict[str, Any] = {}
        for field in attrs.fields(Spec):
            value = getattr(self, field.name)
            if attrs.has(type(value)):
                value = {k: v.to_dict() if attrs.has(type(v)) else list(v) if isinstance(v, tuple)
                         else callable_name(v) if callable(v) else v
                         for k, v in attrs.asdict(value, recurse=False).items()}
            out[field.name] = value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, trust_code: bool = False) -> Spec:
        """Build a Spec from a plain dict; unknown keys raise `SpecError` naming them.

        Args:
            data: feature name -> settings, as `to_dict()` writes them.
            trust_code: resolve a callable field written as 'module:qualname' (`Quantize.filter_fn`): that imports
                the module, running its code, so a dict from a file or a request must not do it unasked (as diffusers'
                `trust_remote_code`). Default False: such a name is a `SpecError`. A hookkit.filters predicate written
                as text (`"all_of(is_linear(), by_name('*.ff.*'))"`) is data and needs no trust.
        """
        if not isinstance(data, dict):
            raise field_error("Spec", "<dict>", data, "a dict of feature name -> settings")
        if any(not isinstance(key, str) for key in data):
            bad = next(key for key in data if not isinstance(key, str))
            raise field_error("Spec", "<dict>", bad, "string keys (feature names)")
        kwargs: dict[str, Any] = {}
        names = {f.name for f in attrs.fields(Spec)}
        for key, value in data.items():
            if key not in names:
                raise field_error("Spec", key, value, f"a known feature: {sorted(names)}",
                                  f"Remove or rename the key.{closest(key, names)}")
            feature = _spec_class(key)
            if feature is not None and isinstance(value, dict):
                value = _build(feature, value, trust_code)
            kwargs[key] = value
        return cls(**kwargs)


def _spec_class(field: str) -> type | None:
    """The attrs spec class a `Spec` field holds (`cache` -> `DBCache`), or None for a plain value (`memo`)."""
    hint = typing.get_type_hints(Spec)[field]
    return next((t for t in typing.get_args(hint) or (hint,) if attrs.has(t)), None)


def _build(cls: type, data: dict[str, Any], trust_code: bool = False) -> Any:
    names = {f.name for f in attrs.fields(cls)}
    if any(not isinstance(key, str) for key in data):
        raise field_error(cls.__name__, "<dict>", next(k for k in data if not isinstance(k, str)), "string keys (field names)")
    for key, value in data.items():
        if key not in names:
            raise field_error(cls.__name__, key, value, f"a known field: {sorted(names)}",
                              f"Remove or rename the key.{closest(key, names)}")
    for field in attrs.fields(cls):
        if field.default is attrs.NOTHING and field.name not in data:
            raise SpecError(f"{cls.__name__}.{field.name}: expected a value (the field is required), got none in "
                            f"{data!r}. Add the key {field.name!r}.")
    data = {k: _callable_field(cls.__name__, k, v, trust_code) if k == "filter_fn" and isinstance(v, str) else v
            for k, v in data.items()}
    # a dict `to_dict` wrote before a field existed (every other field present) keeps the behaviour it was written
    # with: a tuned Spec saved then must run as it was measured, not under a default chosen later
    added = getattr(cls, "FIELDS_ADDED_LATER", {})
    if set(names) - set(data) <= set(added) and not set(added) <= set(data):
        data = {**{k: v for k, v in added.items() if k not in data}, **data}
    return cls(**data)


def _callable_field(owner: str, field: str, text: str, trust_code: bool) -> Any:
    """A callable field written as text: a hookkit.filters predicate (data: built without importing anything), else a
    'module:qualname' resolved only with `trust_code`."""
    if filters.is_expression(text):
        return filters.parse(text, f"{owner}.{field}")
    return resolve_callable(owner, field, text, trust_code)
