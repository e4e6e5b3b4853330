"""Specs: frozen, keyword-only, validated with errors that name the field; round-trip through dicts."""

from __future__ import annotations

import attrs
import pytest

import hookkit
from hookkit.errors import SpecError
from hookkit.techniques.cache.spec import resolve_steps_mask


def test_specs_are_frozen() -> None:
    spec = hookkit.DBCache()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        spec.threshold = 0.5  # type: ignore[misc]


def test_specs_are_keyword_only() -> None:
    with pytest.raises(SpecError, match=r"^DBCache: expected keyword arguments only, got 2 positional \(\(1, 0\)\)\. "
                                        r"Name each one, e.g. DBCache\(rule=\.\.\.\); valid fields: rule, fn_blocks, "):
        hookkit.DBCache(1, 0)  # type: ignore[misc]


def test_a_misspelled_field_names_the_closest_valid_one_and_lists_them_all() -> None:
    with pytest.raises(SpecError) as info:
        hookkit.DBCache(treshold=0.1)
    assert str(info.value).startswith("DBCache.treshold: expected one of the fields of DBCache, got the unknown field "
                                      "'treshold'. Did you mean 'threshold'? Valid fields: rule, fn_blocks, bn_blocks, threshold,")


def test_a_missing_required_field_is_a_spec_error() -> None:
    with pytest.raises(SpecError, match=r"^Quantize.scheme: expected a value \(the field is required\), got none\. "
                                        r"Pass it, e.g. Quantize\(scheme=\.\.\.\); valid fields: scheme, region,"):
        hookkit.Quantize()


@pytest.mark.parametrize("cls", [hookkit.Spec, hookkit.DBCache, hookkit.Compile, hookkit.Quantize])
def test_every_spec_class_refuses_positional_arguments_with_a_spec_error(cls) -> None:
    with pytest.raises(SpecError, match=rf"^{cls.__name__}: expected keyword arguments only"):
        cls(None)


def test_numpy_scalars_are_taken_as_python_values_in_every_field() -> None:
    np = pytest.importorskip("numpy")
    cache = hookkit.DBCache(fn_blocks=np.int64(2), threshold=np.float32(0.5), warmup_steps=np.int32(3),
                            max_accumulated_diff=np.float64(1.5), steps_mask=np.array([1, 0, 1]), mask_policy="static")
    assert cache == hookkit.DBCache(fn_blocks=2, threshold=0.5, warmup_steps=3, max_accumulated_diff=1.5,
                                    steps_mask=(1, 0, 1), mask_policy="static")
    assert [type(v) for v in (cache.fn_blocks, cache.threshold, *cache.steps_mask)] == [int, float, int, int, int]
    assert hookkit.Spec(memo=np.bool_(True)).memo is True
    assert hookkit.DBCache(steps_mask=[np.int64(1), np.int64(0)]).steps_mask == (1, 0)


def test_to_dict_is_json_with_a_numpy_mask_and_a_filter_fn() -> None:
    import json

    np = pytest.importorskip("numpy")
    from hookkit.techniques.quantize.filters import by_name

    spec = hookkit.Spec(cache=hookkit.DBCache(steps_mask=np.array([1, 0, 1])),
                        quantize=hookkit.Quantize(scheme="fp8_row", filter_fn=_keep_attention))
    data = json.loads(json.dumps(spec.to_dict()))
    assert data["cache"]["steps_mask"] == [1, 0, 1]
    assert data["quantize"]["filter_fn"] == "test_specs:_keep_attention"
    assert hookkit.Spec.from_dict(data, trust_code=True).quantize.filter_fn is _keep_attention
    lam = hookkit.Spec(quantize=hookkit.Quantize(scheme="fp8_row", filter_fn=lambda m, fqn: True)).to_dict()
    assert json.dumps(lam) and lam["quantize"]["filter_fn"].startswith("<<function ")
    with pytest.raises(SpecError, match=r"^Quantize.filter_fn: expected a callable or a 'module:qualname' string"):
        hookkit.Spec.from_dict(lam)
    named = hookkit.Spec(quantize=hookkit.Quantize(scheme="fp8_row", filter_fn=by_name("*.attn.*"))).to_dict()
    assert json.dumps(named) and named["quantize"]["filter_fn"] == "by_name('*.attn.*')"


def _keep_attention(module, fqn: str) -> bool:
    return ".attn." in fqn


@pytest.mark.parametrize("module", ["filter_named_by_a_dict", "hookkit.filter_named_by_a_dict"])
def test_a_filter_fn_named_as_module_and_qualname_is_imported_only_with_trust_code(module: str, tmp_path,
                                                                                 monkeypatch) -> None:
    import sys

    marker = tmp_path / "imported"
    code = (f"open({str(marker)!r}, 'w').close()  # importing runs this file\n\n"
            "def keep(module, fqn):\n    return True\n")
    (tmp_path / "filter_named_by_a_dict.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    if module.startswith("hookkit."):  # a module inside hookkit is code too: named by a dict, it is not imported
        hookkit_dir = tmp_path / "hookkit_extra"
        hookkit_dir.mkdir()
        (hookkit_dir / "filter_named_by_a_dict.py").write_text(code)
        monkeypatch.syspath_prepend(str(hookkit_dir))
        monkeypatch.setattr(hookkit, "__path__", [*hookkit.__path__, str(hookkit_dir)])
    data = {"quantize": {"scheme": "int8_weight_only", "filter_fn": f"{module}:keep"}}
    with pytest.raises(SpecError) as info:
        hookkit.Spec.from_dict(data)
    assert str(info.value) == (
        "Quantize.filter_fn: expected a hookkit.filters predicate as text (e.g. \"all_of(is_linear(), "
        "by_name('*.ff.*'))\"), or a 'module:qualname' with trust_code=True, got "
        f"'{module}:keep'. Resolving it would import '{module}' and run its code; nothing was imported. If you "
        "trust where the dict came from, pass Spec.from_dict(data, trust_code=True), or pass the callable itself "
        "(Quantize(filter_fn=my_function)).")
    assert (marker.exists(), module in sys.modules) == (False, False)
    try:
        assert hookkit.Spec.from_dict(data, trust_code=True).quantize.filter_fn.__module__ == module
        assert marker.exists()  # the marker does record an import
    finally:
        sys.modules.pop(module, None)


def test_a_filters_predicate_round_trips_through_json_without_trust_code() -> None:
    import json

    from hookkit import filters
    from hookkit.techniques.quantize.torchao import select_layers

    predicate = filters.all_of(filters.is_linear(), filters.not_(filters.by_name("*.ff.*", "*.attn.to_out.0")),
                               filters.any_of(filters.min_features(8), filters.divisible_by(16)))
    spec = hookkit.Spec(quantize=hookkit.Quantize(scheme="int8_weight_only", filter_fn=predicate))
    text = json.dumps(spec.to_dict())
    assert json.loads(text)["quantize"]["filter_fn"] == (
        "all_of(is_linear(), not_(by_name('*.ff.*', '*.attn.to_out.0')), any_of(min_features(8), divisible_by(16)))")
    back = hookkit.Spec.from_dict(json.loads(text))
    assert repr(back.quantize.filter_fn) == repr(predicate)
    transformer = zoo_flux()
    assert [d.path for d in select_layers(transformer, back.quantize).chosen] == [
        d.path for d in select_layers(transformer, spec.quantize).chosen]


def zoo_flux():
    from hookkit.tools import zoo

    return zoo.tiny_transformer("flux")


@pytest.mark.parametrize(("text", "part"), [
    ("by_name(__import__('os').getcwd())", "__import__('os').getcwd()"),
    ("not_(is_linear)", "is_linear"),
    ("all_of(is_linear(), by_name(pattern='x'))", "by_name(pattern='x')"),
    ("min_features(-1)", "-1"),
])
def test_a_predicate_text_with_anything_but_builders_and_literals_is_refused_unevaluated(text: str, part: str) -> None:
    with pytest.raises(SpecError) as info:
        hookkit.Spec.from_dict({"quantize": {"scheme": "int8_weight_only", "filter_fn": text}})
    assert str(info.value) == (
        "Quantize.filter_fn: expected a predicate of hookkit.filters as text: calls of is_linear, by_name, "
        "min_features, divisible_by, all_of, any_of, not_ on string and int literals, e.g. \"all_of(is_linear(), "
        f"by_name('*.ff.*'))\"; got {text!r}, which has {part!r} there. Write it with those builders only, or pass "
        "the callable itself.")


def test_a_predicate_combining_a_lambda_is_written_as_its_repr_and_refused_when_read() -> None:
    from hookkit import filters

    predicate = filters.all_of(filters.is_linear(), lambda module, fqn: True)
    data = hookkit.Spec(quantize=hookkit.Quantize(scheme="int8_weight_only", filter_fn=predicate)).to_dict()
    assert data["quantize"]["filter_fn"] == f"<{predicate!r}>"
    with pytest.raises(SpecError, match=r"^Quantize.filter_fn: expected a callable or a 'module:qualname' string"):
        hookkit.Spec.from_dict(data)


def test_a_filter_fn_that_cannot_take_module_and_fqn_is_refused_when_the_spec_is_built() -> None:
    import os

    with pytest.raises(SpecError) as info:
        hookkit.Spec.from_dict({"quantize": {"scheme": "int8_weight_only", "filter_fn": "os:getcwd"}}, trust_code=True)
    assert str(info.value) == (
        f"Quantize.filter_fn: expected a callable taking (module, fqn) and returning a bool, got {os.getcwd!r}. It "
        "takes (). Pass a function of the module and its path, e.g. "
        "hookkit.techniques.quantize.filters.by_name('*.attn.*').")


@pytest.mark.parametrize("num_steps", [0, -3, 2.0, "4", True])
def test_resolve_steps_mask_refuses_a_step_count_that_is_not_a_positive_int(num_steps) -> None:
    with pytest.raises(SpecError, match=rf"^resolve_steps_mask.num_steps: expected an int >= 1, got {num_steps!r}\."):
        resolve_steps_mask("fast", num_steps)


@pytest.mark.parametrize(
    ("build", "field", "value"),
    [
        (lambda: hookkit.DBCache(threshold=-0.1), "DBCache.threshold", "-0.1"),
        (lambda: hookkit.DBCache(rule="threshold", fn_blocks=0), "DBCache.fn_blocks", "0"),
        (lambda: hookkit.DBCache(warmup_steps=True), "DBCache.warmup_steps", "True"),
        (lambda: hookkit.DBCache(max_cached_steps=-2), "DBCache.max_cached_steps", "-2"),
        (lambda: hookkit.DBCache(steps_mask="turbo"), "DBCache.steps_mask", "'turbo'"),
        (lambda: hookkit.DBCache(steps_mask=[1, 2]), "DBCache.steps_mask", r"\(1, 2\)"),
        (lambda: hookkit.DBCache(mask_policy="sometimes"), "DBCache.mask_policy", "'sometimes'"),
        (lambda: hookkit.DBCache(taylorseer_order=3), "DBCache.taylorseer_order", "3"),
        (lambda: hookkit.Quantize(scheme="fp4"), "Quantize.scheme", "'fp4'"),
        (lambda: hookkit.Quantize(scheme="fp8_row", exclude="proj_out"), "Quantize.exclude", "'proj_out'"),
        (lambda: hookkit.Compile(mode="fast"), "Compile.mode", "'fast'"),
        (lambda: hookkit.Compile(regional="yes"), "Compile.regional", "'yes'"),
        (lambda: hookkit.Spec(sync_free=1), "Spec.sync_free", "1"),
        (lambda: hookkit.Spec(cache=hookkit.Compile()), "Spec.cache", "Compile"),
    ],
)
def test_bad_values_raise_spec_error_naming_the_field_and_value(build, field: str, value: str) -> None:
    with pytest.raises(SpecError, match=rf"^{field}: expected .*, got {value}"):
        build()


def test_error_message_says_what_is_allowed() -> None:
    with pytest.raises(SpecError) as info:
        hookkit.DBCache(mask_policy="sometimes")
    assert str(info.value) == "DBCache.mask_policy: expected one of ('dynamic', 'static'), got 'sometimes'."


def test_a_static_mask_policy_needs_a_mask() -> None:
    with pytest.raises(SpecError, match=r"DBCache.mask_policy: 'static' follows steps_mask alone, but steps_mask "
                                        r"is None. Give a mask"):
        hookkit.DBCache(mask_policy="static")


def test_spec_round_trips_through_a_plain_dict() -> None:
    spec = hookkit.Spec(
        cache=hookkit.DBCache(fn_blocks=2, bn_blocks=1, threshold=0.1, steps_mask=[1, 0, 1], mask_policy="static"),
        quantize=hookkit.Quantize(scheme="int8_weight_only", exclude=["proj_out"]),
        compile=hookkit.Compile(mode="reduce-overhead"),
        sync_free=True,
    )
    data = spec.to_dict()
    assert data["cache"]["steps_mask"] == [1, 0, 1]
    assert data["quantize"]["exclude"] == ["proj_out"]
    assert data["sync_free"] is True
    assert hookkit.Spec.from_dict(data) == spec


def test_from_dict_rejects_unknown_keys_by_name() -> None:
    with pytest.raises(SpecError, match=r"^Spec.caching: expected a known feature"):
        hookkit.Spec.from_dict({"caching": {}})
    with pytest.raises(SpecError, match=r"^DBCache.thresh: expected a known field"):
        hookkit.Spec.from_dict({"cache": {"thresh": 0.1}})


def test_lists_become_tuples_so_specs_stay_hashable() -> None:
    assert hash(hookkit.DBCache(steps_mask=[1, 0])) == hash(hookkit.DBCache(steps_mask=(1, 0)))


def test_named_masks_at_28_steps_are_cache_dits_bin_for_bin() -> None:
    # cache_dit.steps_mask(mask_policy=..., total_steps=28) of cache-dit 1.5.3, written out
    expected = {"slow": "1111111101110011100110010001", "medium": "1111110110001100011000110001",
                "fast": "1111110100010000100000100001", "ultra": "1111001000001000000100000001"}
    assert {name: "".join(map(str, resolve_steps_mask(name, 28))) for name in expected} == expected


def test_named_masks_scale_to_other_step_counts_and_keep_first_and_last() -> None:
    mask = resolve_steps_mask("fast", 50)
    assert len(mask) == 50 and mask[0] == 1 and mask[-1] == 1
    assert 17 <= sum(mask) <= 22  # about 11/28 of the steps


def test_explicit_masks_pad_with_compute_and_cut() -> None:
    assert resolve_steps_mask((1, 0), 4) == (1, 0, 1, 1)
    assert resolve_steps_mask((1, 0, 0, 0, 1), 3) == (1, 0, 0)


def test_an_int_does_not_pass_for_a_bool_choice() -> None:
    """`0 == False`: without a type check, Compile(dynamic=0) would slip through as 'not dynamic'."""
    with pytest.raises(SpecError) as info:
        hookkit.Compile(dynamic=0)
    assert str(info.value) == "Compile.dynamic: expected one of (None, True, False), got 0."
    assert hookkit.Compile(dynamic=False).dynamic is False


@pytest.mark.parametrize("mask", [[1.0, 0.0], [True, False]])
def test_step_mask_flags_are_the_ints_0_and_1(mask: list) -> None:
    with pytest.raises(SpecError, match=r"^DBCache.steps_mask: expected a non-empty list of 0 \(may cache\) / 1 \(compute\)"):
        hookkit.DBCache(steps_mask=mask)


def test_from_dict_names_a_missing_required_field() -> None:
    with pytest.raises(SpecError) as info:
        hookkit.Spec.from_dict({"quantize": {"region": "all"}})
    assert str(info.value) == ("Quantize.scheme: expected a value (the field is required), got none in "
                               "{'region': 'all'}. Add the key 'scheme'.")


def test_every_field_round_trips_through_json() -> None:
    import json

    spec = hookkit.Spec(
        cache=hookkit.DBCache(fn_blocks=2, bn_blocks=1, threshold=0.3, warmup_steps=2, warmup_interval=2,
                              max_cached_steps=5, max_continuous_cached_steps=2, max_accumulated_diff=0.5,
                              steps_mask="fast", mask_policy="static", taylorseer_order=2),
        quantize=hookkit.Quantize(scheme="fp8_row", region="all", exclude=["proj_out"], include=["x_embedder"],
                                  min_features=64, keep_original="cpu"),
        compile=hookkit.Compile(regional=False, mode="max-autotune", fullgraph=False, dynamic=True,
                                cuda_graphs="transformer", backend="aot_eager"),
        sync_free=True, memo=True,
    )
    data = json.loads(json.dumps(spec.to_dict()))
    assert data["quantize"]["include"] == ["x_embedder"]
    assert hookkit.Spec.from_dict(data) == spec


def test_a_named_mask_at_half_the_steps_keeps_its_share_and_spread_of_computed_steps() -> None:
    # "fast" over 28 steps computes 0-5, 7, 11, 16, 22, 27 (11); at 14 steps: 6 (11 x 14/28 = 5.5, rounded up),
    # dense first and sparse later, the last step computed
    assert "".join(map(str, resolve_steps_mask("fast", 14))) == "11110000100001"


@pytest.mark.parametrize("num_steps", range(2, 61))
def test_a_faster_named_mask_never_computes_more_steps_than_a_slower_one(num_steps: int) -> None:
    computed = [sum(resolve_steps_mask(name, num_steps)) for name in ("slow", "medium", "fast", "ultra")]
    assert computed == sorted(computed, reverse=True)
    for name, share in (("slow", 18), ("medium", 15), ("fast", 11), ("ultra", 8)):
        mask = resolve_steps_mask(name, num_steps)
        assert mask[0] == mask[-1] == 1
        assert abs(sum(mask) - share * num_steps / 28) <= 2  # the 28-step share, plus the forced first/last
