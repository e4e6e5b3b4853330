"""Property tests (hypothesis): any input to a spec or adapter constructor either builds or raises a
`hookkit.errors` exception; never a bare TypeError, KeyError, IndexError... from deep inside.

The inputs mix the valid field names with misspellings and arbitrary keys, and the valid values with
JSON-like data of every shape (nested lists and dicts, NaN and infinities, huge ints, numpy scalars).
"""

from __future__ import annotations

import attrs
import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import hookkit  # noqa: E402
from hookkit.adapters import AdapterSpec  # noqa: E402
from hookkit.errors import HookkitError  # noqa: E402
from hookkit.techniques.cache.spec import MASK_POLICIES, resolve_steps_mask  # noqa: E402

# the same examples at every run (CI is reproducible), no example database on disk (the repository stays clean),
# no timing health checks (the CI machine is shared); a failure prints its example
settings.register_profile("hookkit", database=None, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("hookkit")

SPEC_CLASSES = (hookkit.DBCache, hookkit.Quantize, hookkit.Compile, hookkit.Spec)

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70), st.floats(allow_nan=True),
    st.text(max_size=12), st.sampled_from(["fp8_row", "static", "dynamic", "fast", "transformer", "reduce-overhead",
                                           "all", "cpu", "batched", "prologue", "hidden_states", "encoder_hidden_states"]),
    st.builds(np.int64, st.integers(min_value=-5, max_value=40)), st.builds(np.float32, st.floats(width=32)),
    st.builds(np.bool_, st.booleans()),
)
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.dictionaries(st.one_of(st.text(max_size=8), st.integers()), inner, max_size=4)),
    max_leaves=12)


def field_names(cls: type) -> list[str]:
    names = [a.alias for a in attrs.fields(cls) if a.init]
    return names + [n[:-1] for n in names] + [n + "s" for n in names] + ["treshold", "", "scheme "]


def kwargs_for(cls: type) -> st.SearchStrategy:
    return st.dictionaries(st.sampled_from(field_names(cls)), values, max_size=6)


def builds_or_refuses(build) -> None:
    try:
        build()
    except HookkitError:
        pass


@settings(max_examples=150)
@given(st.sampled_from(SPEC_CLASSES).flatmap(lambda cls: st.tuples(st.just(cls), kwargs_for(cls))))
def test_spec_classes_build_or_raise_a_hookkit_error(case) -> None:
    cls, kwargs = case
    builds_or_refuses(lambda: cls(**kwargs))


@settings(max_examples=60)
@given(st.sampled_from(SPEC_CLASSES), st.lists(values, min_size=1, max_size=3))
def test_positional_arguments_raise_a_hookkit_error(cls, args) -> None:
    builds_or_refuses(lambda: cls(*args))


spec_dicts = st.one_of(values, st.dictionaries(
    st.sampled_from(["cache", "quantize", "compile", "sync_free", "memo", "caching", "memos"]),
    st.one_of(values, kwargs_for(hookkit.DBCache), kwargs_for(hookkit.Quantize), kwargs_for(hookkit.Compile)),
    max_size=4))


@settings(max_examples=150)
@given(spec_dicts)
def test_spec_from_dict_builds_or_raises_a_hookkit_error(data) -> None:
    builds_or_refuses(lambda: hookkit.Spec.from_dict(data))


@settings(max_examples=60)
@given(st.one_of(st.none(), st.sampled_from(sorted(MASK_POLICIES)), st.lists(st.sampled_from([0, 1]), max_size=8),
                 values), values.filter(lambda v: not isinstance(v, int) or v <= 500))  # a mask is as long as the run
def test_resolve_steps_mask_returns_a_mask_or_raises_a_hookkit_error(mask, num_steps) -> None:
    builds_or_refuses(lambda: resolve_steps_mask(mask, num_steps))


block_dicts = st.dictionaries(
    st.sampled_from(["attr", "class", "classes", "hidden_arg", "encoder_arg", "returns", "retuns", "klass"]),
    st.one_of(values, st.sampled_from(["transformer_blocks", "FluxTransformerBlock", "hidden_states"]),
              st.lists(st.sampled_from(["hidden_states", "encoder_hidden_states"]), max_size=3)),
    max_size=6)
adapter_dicts = st.one_of(values, st.dictionaries(
    st.sampled_from(["name", "transformer", "blocks", "repeated_blocks", "quant_exclude", "cfg", "memo_scope",
                     "pipelines", "source", "nmae"]),
    st.one_of(values, st.lists(block_dicts, max_size=3), st.sampled_from(["flux", "FluxTransformer2DModel"])),
    max_size=8))


@settings(max_examples=200)
@given(adapter_dicts)
def test_adapter_from_dict_builds_or_raises_a_hookkit_error(data) -> None:
    builds_or_refuses(lambda: AdapterSpec.from_dict(data))
