"""DBCache's planned rules: "magnitude" (MagCache's), "schedule" planned from one uncached run, and "schedule"
without a calibration (`DBCache()`, the default).

All decide the call's steps before it starts: the planning arithmetic is tested exactly
(hand-computed masks, a brute force over every mask), then what the hooks do with it: the extrapolation the plan
assumes is the one that runs, the same steps under the CPU stand-in for CUDA graphs, per CFG branch, per
transformer of a two-transformer pipeline, against diffusers' own MagCache.
"""

from __future__ import annotations

import itertools
import math
import random
from typing import Any

import attrs
import pytest
import torch

import hookkit
from hookkit.errors import SpecError
from hookkit.techniques.cache.calibration import (
    CacheCalibration,
    generic_schedule,
    magnitude_mask,
    plan_schedule,
    predict_weights,
    schedule_cost,
    step_weights,
)
from hookkit.techniques.cache.spec import rule_mask, schedule_computed_steps
from hookkit.tools import zoo

#: ratios whose MagCache decisions, from step 2 on with threshold 0.05 and no K, are (1, 1, 0, 1, 0, 0):
#: step 2 err 0.02 (cache), step 3 err 0.02 + 0.069 (compute, restart), step 4 err 0, step 5 err 0.01
RATIOS = (1.0, 1.0, 0.98, 0.95, 1.0, 1.01)
MASK = (1, 1, 0, 1, 0, 0)


def magnitude(**kw: Any) -> hookkit.DBCache:
    base = dict(rule="magnitude", calibration=CacheCalibration(steps=6, ratios=RATIOS), threshold=0.05,
                warmup_steps=2, taylorseer_order=0)
    return hookkit.DBCache(**{**base, **kw})


def random_gram(n: int, seed: int) -> tuple[tuple[float, ...], ...]:
    """<r_i, r_j> of a smooth random trajectory r_t (so extrapolation helps and the plan is not trivial)."""
    g = torch.Generator().manual_seed(seed)
    a, b, c = (torch.randn(32, generator=g, dtype=torch.float64) for _ in range(3))
    rows = torch.stack([a + b * (t / n) + c * (t / n) ** 2 + 0.05 * torch.randn(32, generator=g, dtype=torch.float64)
                        for t in range(n)])
    return tuple(tuple(r) for r in (rows @ rows.T / 32).tolist())


# --- the arithmetic ---------------------------------------------------------------------------------------------


def test_magnitude_mask_follows_magcaches_accumulated_error() -> None:
    assert magnitude_mask(RATIOS, threshold=0.05, max_skip=-1, retention=2) == MASK


def test_magnitude_mask_computes_after_k_cached_steps_in_a_row() -> None:
    assert magnitude_mask((1.0,) * 6, threshold=1.0, max_skip=2, retention=1) == (1, 0, 0, 1, 0, 0)


def test_magnitude_ratios_are_nearest_interpolated_to_another_step_count() -> None:
    calibration = CacheCalibration(steps=4, ratios=(1.0, 2.0, 3.0, 4.0))
    assert calibration.ratios_for(7) == (1.0, 1.0, 2.0, 3.0, 3.0, 3.0, 4.0)  # torch.round: half to even


@pytest.mark.parametrize(("order", "history", "step", "weights"), [
    (0, (0, 2), 3, {2: 1.0}),
    (1, (0, 2), 5, {2: 2.5, 0: -1.5}),  # r2 + (r2 - r0) / 2 * 3
    # r3 + d1 k + d2 k^2 / 2, k = 2, d1 = r3 - r2, d2 = (d1 - (r2 - r0) / 2) / 1
    (2, (0, 2, 3), 5, {3: 1 + 2 + 2, 2: -2 - 2 * (1 + 0.5), 0: 2 * 0.5}),
])
def test_predict_weights_are_the_taylor_sum_over_computed_residuals(order: int, history: tuple[int, ...], step: int,
                                                                    weights: dict[int, float]) -> None:
    assert predict_weights(history, step, order) == weights


@pytest.mark.parametrize("order", [0, 1, 2])
def test_plan_schedule_finds_the_least_cost_mask_of_a_brute_force(order: int) -> None:
    n, k = 9, 4
    calibration = CacheCalibration(steps=n, gram=random_gram(n, seed=order),
                                   weights=tuple(random.Random(order).uniform(0.5, 1.5) for _ in range(n)))
    masks = [tuple(1 if t in chosen or t == 0 else 0 for t in range(n))
             for chosen in itertools.combinations(range(1, n), k - 1)]
    best = min(schedule_cost(calibration, m, order) for m in masks)
    planned = plan_schedule(calibration, n, k, order)
    assert sum(planned) == k and planned[0] == 1
    assert math.isclose(schedule_cost(calibration, planned, order), best, rel_tol=1e-12)


def test_with_gains_the_planner_weighs_each_step_by_the_geometric_mean_of_weight_and_gain() -> None:
    cal = CacheCalibration(steps=3, gram=((1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0)),
                           weights=(1.0, 2.0, 8.0), gains=(4.0, 8.0, 2.0))
    assert step_weights(cal) == (2.0, 4.0, 4.0)
    assert step_weights(attrs.evolve(cal, gains=None)) == (1.0, 2.0, 8.0)


def test_gains_that_amplify_early_errors_move_the_computed_steps_early() -> None:
    n = 8
    gram = tuple(tuple(0.8 ** abs(i - j) for j in range(n)) for i in range(n))  # a reuse errs more the farther back
    flat = CacheCalibration(steps=n, gram=gram)
    early = attrs.evolve(flat, gains=(64.0, 64.0, 16.0, 4.0, 1.0, 1.0, 1.0, 1.0))
    assert plan_schedule(flat, n, 3, order=0) == (1, 0, 1, 0, 0, 1, 0, 0)
    assert plan_schedule(early, n, 3, order=0) == (1, 1, 1, 0, 0, 0, 0, 0)


def test_gains_round_trip_through_json_and_a_file_without_them_loads(tmp_path: Any) -> None:
    cal = CacheCalibration(steps=2, ratios=(1.0, 0.9), gains=(0.5, 0.5))
    assert CacheCalibration.from_dict(cal.to_dict()) == cal
    data = cal.to_dict()
    del data["gains"]  # written before gains existed
    assert CacheCalibration.from_dict(data).gains is None


def test_gains_of_the_wrong_length_are_refused() -> None:
    with pytest.raises(SpecError, match=r"CacheCalibration.gains: expected 2 finite numbers >= 0 \(one per step\) or None"):
        CacheCalibration(steps=2, ratios=(1.0, 0.9), gains=(0.5,))


def test_plan_schedule_keeps_the_forced_warm_up_steps() -> None:
    calibration = CacheCalibration(steps=8, gram=random_gram(8, seed=5))
    assert plan_schedule(calibration, 8, 4, order=1, forced=3)[:3] == (1, 1, 1)


def test_schedule_computes_as_many_steps_as_the_speedup_allows() -> None:
    calibration = CacheCalibration(steps=28, gram=random_gram(28, seed=0))
    spec = hookkit.DBCache(rule="schedule", calibration=calibration, speedup=2.0)
    assert (spec.fn_blocks, schedule_computed_steps(spec, 28, num_blocks=6)) == (0, 14)
    # one of six blocks still runs on a cached step: k + (28 - k) / 6 <= 14 -> k <= 11.2
    one = hookkit.DBCache(rule="schedule", calibration=calibration, speedup=2.0, fn_blocks=1)
    assert schedule_computed_steps(one, 28, num_blocks=6) == 11
    assert sum(rule_mask(one, 28, 6)) == 11


def test_an_unreachable_schedule_speedup_names_the_bound() -> None:
    calibration = CacheCalibration(steps=4, gram=random_gram(4, seed=0))
    spec = hookkit.DBCache(rule="schedule", calibration=calibration, speedup=3.0, fn_blocks=1)
    with pytest.raises(SpecError, match=r"DBCache.speedup: expected at most 2 for 4 steps with fn_blocks=1"):
        rule_mask(spec, 4, 3)


def test_a_schedule_calibrated_at_another_step_count_is_refused_with_the_fix() -> None:
    spec = hookkit.DBCache(rule="schedule", calibration=CacheCalibration(steps=4, gram=random_gram(4, 0)), speedup=2.0)
    with pytest.raises(SpecError, match=r"expected a calibration at the call's 6 steps, got one at 4. Calibrate at 6"):
        rule_mask(spec, 6, 5)


# --- the spec ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(rule="magnitude"), r"DBCache.calibration: expected a hookkit.CacheCalibration with rule='magnitude', got None"),
    (dict(rule="schedule", calibration=CacheCalibration(steps=4, ratios=(1.0,) * 4), speedup=2.0),
     r"DBCache.calibration: expected a gram matrix with rule='schedule', got ratios only"),
    (dict(rule="schedule", speedup=0.5), r"DBCache.speedup: expected a number >= 1.0 or None, got 0.5"),
    (dict(rule="magnitude", calibration=CacheCalibration(steps=4, ratios=(1.0,) * 4), steps_mask="fast"),
     r"DBCache.steps_mask: expected None with rule='magnitude'"),
    (dict(threshold=0.24, speedup=2.0), r"DBCache.speedup: expected None with rule='threshold'"),
    (dict(threshold=0.24, fn_blocks=0), r"DBCache.fn_blocks: expected >= 1 with rule='threshold'"),
    (dict(rule="schedule", threshold=0.3), r"DBCache.threshold: expected None with rule='schedule'"),
    (dict(rule="schedule", max_accumulated_diff=1.0),
     r"DBCache.max_accumulated_diff: expected None with rule='schedule'"),
    (dict(spacing=1.5, calibration=CacheCalibration(steps=4, gram=((1.0,) * 4,) * 4)),
     r"DBCache.spacing: expected None with rule='schedule' and a calibration"),
    (dict(threshold=0.24, last_computed=0.5), r"DBCache.last_computed: expected None with rule='threshold'"),
    (dict(last_computed=1.5), r"DBCache.last_computed: expected a share of the steps, 0 < x <= 1, got 1.5"),
])
def test_rule_fields_are_checked_when_the_spec_is_made(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        hookkit.DBCache(**kwargs)


def test_the_default_is_the_calibration_free_schedule_at_2x_with_taylorseer_2() -> None:
    cache = hookkit.DBCache()
    assert (cache.rule, cache.fn_blocks, cache.bn_blocks, cache.speedup, cache.taylorseer_order) == (
        "schedule", 0, 0, 2.0, 2)
    assert (cache.calibration, cache.threshold, cache.spacing, cache.last_computed) == (None, None, 1.7, 1.0)


@pytest.mark.parametrize("kwargs", [dict(threshold=0.12), dict(steps_mask="fast", mask_policy="static"),
                                    dict(max_accumulated_diff=1.0)])
def test_a_setting_only_the_threshold_rule_reads_picks_it_with_its_defaults(kwargs: dict[str, Any]) -> None:
    cache = hookkit.DBCache(**kwargs)
    assert (cache.rule, cache.fn_blocks, cache.taylorseer_order, cache.speedup, cache.spacing) == (
        "threshold", 1, 1, None, None)
    assert cache.threshold == kwargs.get("threshold", 0.24)


def test_the_resolved_default_equals_its_explicit_spelling() -> None:
    assert hookkit.DBCache() == hookkit.DBCache(rule="schedule", fn_blocks=0, taylorseer_order=2, speedup=2.0,
                                                spacing=1.7, last_computed=1.0)


@pytest.mark.parametrize(("steps", "computed", "kwargs", "expected"), [
    (28, 14, {}, [0, 1, 2, 3, 4, 5, 7, 9, 12, 14, 17, 20, 24, 27]),  # j-th of 13 at 27 * (j / 13) ** 1.7
    (28, 9, {}, [0, 1, 3, 5, 8, 12, 17, 22, 27]),
    (14, 4, {}, [0, 2, 7, 13]),
    (14, 4, dict(spacing=1.3, last=0.7), [0, 2, 5, 9]),  # the last computed step at round(0.7 * 13) = 9
    (14, 4, dict(spacing=1.0), [0, 4, 9, 13]),  # even spacing
    (28, 14, dict(forced=5), [0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 19, 23, 27]),  # 0-4, then 9 from 4 to 27
    (6, 6, {}, [0, 1, 2, 3, 4, 5]),
    (6, 1, {}, [0]),
])
def test_generic_schedule_spaces_the_computed_steps_by_a_power_of_their_rank(
        steps: int, computed: int, kwargs: dict[str, Any], expected: list[int]) -> None:
    mask = generic_schedule(steps, computed, **kwargs)
    assert [t for t, m in enumerate(mask) if m] == expected


def test_the_default_computes_the_steps_its_speedup_allows_spaced_by_the_generic_plan() -> None:
    assert rule_mask(hookkit.DBCache(), 28, 57) == generic_schedule(28, 14)
    assert rule_mask(hookkit.DBCache(speedup=3.0, spacing=1.3, last_computed=0.7), 14, 6) == generic_schedule(
        14, 4, 1.3, 0.7)


def test_a_calibrated_spec_round_trips_through_a_json_dict() -> None:
    import json

    spec = hookkit.Spec(cache=hookkit.DBCache(rule="schedule", calibration=CacheCalibration(
        model="FluxTransformer2DModel", steps=4, ratios=(1.0, 0.9, 0.95, 1.0), gram=random_gram(4, 1)), speedup=1.5))
    assert hookkit.Spec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


def test_a_calibration_saves_and_loads(tmp_path: Any) -> None:
    calibration = CacheCalibration(model="M", steps=3, ratios=(1.0, 0.5, 0.25), weights=(0.1, 0.2, 0.3))
    assert CacheCalibration.load(calibration.save(tmp_path / "c.json")) == calibration


def test_an_asymmetric_gram_is_refused() -> None:
    with pytest.raises(SpecError, match=r"CacheCalibration.gram: expected a symmetric matrix"):
        CacheCalibration(steps=2, gram=((1.0, 0.5), (0.4, 1.0)))


# --- the hooks -----------------------------------------------------------------------------------------------


def _steps(handle: hookkit.Handle) -> dict[int, tuple[list[int], list[int]]]:
    branches = handle.summary().features["cache"].data["branches"]
    return {i: (b["computed"], b["cached"]) for i, b in branches.items()}


def test_magnitude_caches_its_planned_steps_and_skips_every_block() -> None:
    pipe = zoo.tiny_pipeline("flux")
    handle = hookkit.enable(pipe, hookkit.Spec(cache=magnitude()))
    pipe(**zoo.call_kwargs("flux", steps=6))
    data = handle.summary().features["cache"].data
    assert _steps(handle) == {0: ([0, 1, 3], [2, 4, 5])}
    assert (data["rule"], data["fn_blocks"], data["collectives"]) == ("magnitude", 0, 0)
    assert data["block_calls"] == 3 * data["blocks"]  # a cached step runs no block


def test_the_default_caches_its_planned_steps_and_skips_every_block() -> None:
    pipe = zoo.tiny_pipeline("flux")
    handle = hookkit.enable(pipe, hookkit.Spec(cache=hookkit.DBCache()))
    pipe(**zoo.call_kwargs("flux", steps=6))
    data = handle.summary().features["cache"].data
    assert _steps(handle) == {0: ([0, 2, 5], [1, 3, 4])}  # 3 of 6 steps at 2x: 5 * (j / 2) ** 1.7 -> 0, 2, 5
    assert (data["rule"], data["fn_blocks"], data["collectives"]) == ("schedule", 0, 0)
    assert data["block_calls"] == 3 * data["blocks"]
    assert data["block_calls_uncached"] == 2 * data["block_calls"]


def test_a_rule_at_zero_budget_is_bitwise_stock() -> None:
    stock = zoo.tiny_pipeline("flux")(**zoo.call_kwargs("flux", steps=6)).images
    pipe = zoo.tiny_pipeline("flux")
    hookkit.enable(pipe, hookkit.Spec(cache=magnitude(threshold=0.0, calibration=CacheCalibration(
        steps=6, ratios=(1.0, 2.0, 2.0, 2.0, 2.0, 2.0)))))
    assert torch.equal(pipe(**zoo.call_kwargs("flux", steps=6)).images, stock)


@pytest.mark.parametrize("calibrated", [False, True], ids=["default", "calibrated"])
def test_the_schedule_at_zero_budget_is_bitwise_stock(calibrated: bool) -> None:
    stock = zoo.tiny_pipeline("flux")(**zoo.call_kwargs("flux", steps=6)).images
    pipe = zoo.tiny_pipeline("flux")
    calibration = CacheCalibration(steps=6, gram=random_gram(6, 3)) if calibrated else None
    handle = hookkit.enable(pipe, hookkit.Spec(cache=hookkit.DBCache(rule="schedule", calibration=calibration,
                                                                     speedup=1.0)))
    assert torch.equal(pipe(**zoo.call_kwargs("flux", steps=6)).images, stock)
    assert _steps(handle) == {0: ([0, 1, 2, 3, 4, 5], [])}
    data = handle.summary().features["cache"].data
    assert (data["no_cache_reason"], data["no_cache_brief"]) == (
        "rule 'schedule' plans all 6 steps of this call computed (speedup 1.0). Raise DBCache(speedup=...) above 1 to "
        "cache.", "the schedule rule computes all 6 steps")


def test_the_schedule_adds_exactly_the_extrapolation_it_planned_with() -> None:
    # the stub of test_dbcache: every block adds scale * temb, so the residual of all 5 blocks is 15 * temb
    from tests.test_dbcache import STUB_ADAPTER, StubTransformer

    tembs = [1.0, 3.0, 4.0, 8.0, 9.0, 15.0, 16.0, 30.0]
    n = len(tembs)
    residual = [15.0 * t for t in tembs]
    gram = tuple(tuple(a * b for b in residual) for a in residual)
    spec = hookkit.DBCache(rule="schedule", calibration=CacheCalibration(steps=n, gram=gram), speedup=2.0,
                           taylorseer_order=2)
    model = StubTransformer(5).double()
    handle = hookkit.enable(model, hookkit.Spec(cache=spec), adapter=STUB_ADAPTER)
    hidden = torch.zeros(1, 1, dtype=torch.float64)
    with handle.generation(num_steps=n):
        out = [model(hidden, hidden, torch.tensor(t, dtype=torch.float64))[0].item() for t in tembs]
    mask = rule_mask(spec, n, 5)
    computed = [t for t in range(n) if mask[t]]
    assert _steps(handle)[0] == (computed, [t for t in range(n) if not mask[t]])
    for t in range(n):
        if mask[t]:
            assert out[t] == residual[t]
        else:
            weights = predict_weights(tuple(c for c in computed if c < t), t, 2)
            assert out[t] == pytest.approx(sum(w * residual[c] for c, w in weights.items()), rel=1e-12)


@pytest.mark.parametrize(("spec", "steps"), [(magnitude(), {0: ([0, 1, 3], [2, 4, 5])}),
                                           (hookkit.DBCache(), {0: ([0, 2, 5], [1, 3, 4])})],
                         ids=["magnitude", "default"])
def test_rules_under_transformer_graphs_cache_the_same_steps_and_match_eager_bitwise(
        spec: hookkit.DBCache, steps: dict[int, tuple[list[int], list[int]]]) -> None:
    from tests.test_compile import _cache_stats, _graph_cached_pipeline, run

    eager_pipe = zoo.tiny_pipeline("flux")
    eager = hookkit.enable(eager_pipe, hookkit.Spec(cache=spec))
    reference = run(eager_pipe, steps=6)
    pipe, handle, backend = _graph_cached_pipeline("flux", spec)
    for _ in range(2):
        assert torch.equal(run(pipe, steps=6), reference)
        assert _cache_stats(handle) == _cache_stats(eager)
    assert backend.captures == 2
    assert _cache_stats(handle)[1] == steps


@pytest.mark.parametrize(("spec", "branch"), [(magnitude(), ([0, 1, 3], [2, 4, 5])),
                                            (hookkit.DBCache(), ([0, 2, 5], [1, 3, 4]))], ids=["magnitude", "default"])
def test_cfg_branches_each_follow_the_rule(spec: hookkit.DBCache, branch: tuple[list[int], list[int]]) -> None:
    pipe = zoo.tiny_pipeline("qwenimage")
    handle = hookkit.enable(pipe, hookkit.Spec(cache=spec))
    args = zoo.call_kwargs("qwenimage", steps=6, true_cfg_scale=4.0)
    args.update(negative_prompt_embeds=torch.full_like(args["prompt_embeds"], 0.5),
                negative_prompt_embeds_mask=args["prompt_embeds_mask"])
    pipe(**args)
    assert _steps(handle) == {0: branch, 1: branch}


def test_each_transformer_of_a_two_expert_pipeline_follows_the_rule() -> None:
    from tests.test_pipelines import run as run_variant

    pipe = zoo.tiny_variant("wan22")
    calibration = CacheCalibration(steps=4, ratios=(1.0, 1.0, 1.0, 1.0))
    handle = hookkit.enable(pipe, hookkit.Spec(cache=hookkit.DBCache(
        rule="magnitude", calibration=calibration, threshold=0.5, warmup_steps=1, max_continuous_cached_steps=1,
        taylorseer_order=0)))
    run_variant(pipe, "wan22")  # mask (1, 0, 1, 0): steps 0, 1 on the first expert, 2, 3 on the second
    summary = handle.summary()
    first = summary.features["cache"].data["branches"]
    second = summary.companions[0].features["cache"].data["branches"]
    assert {b: (d["computed"], d["cached"]) for b, d in first.items()} == {0: ([0], [1]), 1: ([0], [1])}
    assert {b: (d["computed"], d["cached"]) for b, d in second.items()} == {0: ([2], [3]), 1: ([2], [3])}


def test_each_expert_follows_the_default_plan_and_computes_a_step_it_has_no_residual_for() -> None:
    from tests.test_pipelines import run as run_variant

    pipe = zoo.tiny_variant("wan22")
    handle = hookkit.enable(pipe, hookkit.Spec(cache=hookkit.DBCache()))
    run_variant(pipe, "wan22")  # 4 steps at 2x: plan (1, 0, 0, 1); steps 0, 1 on the first expert, 2, 3 on the second
    summary = handle.summary()
    first = summary.features["cache"].data["branches"]
    second = summary.companions[0].features["cache"].data["branches"]
    assert {b: (d["computed"], d["cached"]) for b, d in first.items()} == {0: ([0], [1]), 1: ([0], [1])}
    # the plan caches step 2, but the second expert has computed nothing yet: it computes (nothing to reuse)
    assert {b: (d["computed"], d["cached"]) for b, d in second.items()} == {0: ([2, 3], []), 1: ([2, 3], [])}


def test_magnitude_with_diffusers_ratios_matches_diffusers_magcache() -> None:
    """The same ratios, threshold and K: the same steps skipped and the same image as diffusers' MagCache."""
    from diffusers import MagCacheConfig
    from diffusers.hooks.mag_cache import FLUX_MAG_RATIOS

    steps = 12
    ours = zoo.tiny_pipeline("flux")
    handle = hookkit.enable(ours, hookkit.Spec(cache=hookkit.DBCache(
        rule="magnitude", calibration=CacheCalibration(steps=28, ratios=tuple(FLUX_MAG_RATIOS.tolist())),
        threshold=0.06, max_continuous_cached_steps=3, warmup_steps=None, taylorseer_order=0)))
    image = ours(**zoo.call_kwargs("flux", steps=steps)).images
    theirs = zoo.tiny_pipeline("flux")
    theirs.transformer.enable_cache(MagCacheConfig(threshold=0.06, max_skip_steps=3, retention_ratio=0.2,
                                                   num_inference_steps=steps, mag_ratios=FLUX_MAG_RATIOS))
    reference = theirs(**zoo.call_kwargs("flux", steps=steps)).images
    assert _steps(handle)[0][1] == [t for t, m in enumerate(rule_mask(handle.spec.cache, steps, 1)) if m == 0]
    assert _steps(handle)[0][1]  # some step was skipped
    assert torch.equal(image, reference)


@pytest.mark.parametrize("order", [1, 2])
def test_taylorseer_under_transformer_graphs_with_a_planned_rule_matches_eager_bitwise(order: int) -> None:
    from tests.test_compile import _cache_stats, _graph_cached_pipeline, run

    spec = hookkit.DBCache(rule="schedule", speedup=1.6, taylorseer_order=order, extrapolate="residual",
                           calibration=CacheCalibration(steps=8, gram=random_gram(8, seed=3)))
    from hookkit.core import compat

    compat.check(hookkit.Spec(cache=spec, compile=hookkit.Compile(cuda_graphs="transformer")),
                 hookkit.get_adapter("flux"))  # allowed: decided before the call
    eager_pipe = zoo.tiny_pipeline("flux")
    eager = hookkit.enable(eager_pipe, hookkit.Spec(cache=spec))
    reference = run(eager_pipe, steps=8)
    pipe, handle, backend = _graph_cached_pipeline("flux", spec)
    for _ in range(2):  # the second call is served by replays only
        assert torch.equal(run(pipe, steps=8), reference)
        assert _cache_stats(handle) == _cache_stats(eager)
    assert backend.captures == 2
    assert len(_cache_stats(handle)[1][0][1]) == 3  # 3 of 8 steps cached


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("extrapolate", ["residual", "output"])  # output: only computed calls reach the graphs
def test_gpu_taylorseer_under_transformer_graphs_with_a_planned_rule_matches_eager(extrapolate: str) -> None:
    from tests.test_compile import _cache_stats, _cuda_pipeline, _cuda_run

    cache = hookkit.DBCache(rule="schedule", speedup=1.6, taylorseer_order=2, extrapolate=extrapolate,
                            calibration=CacheCalibration(steps=8, gram=random_gram(8, seed=3)))
    pipe = _cuda_pipeline()
    eager = hookkit.enable(pipe, hookkit.Spec(cache=cache))
    reference = _cuda_run(pipe, steps=8)
    stats = _cache_stats(eager)
    eager.remove()
    handle = hookkit.enable(pipe, hookkit.Spec(cache=cache, compile=hookkit.Compile(cuda_graphs="transformer",
                                                                                      backend="eager")))
    for _ in range(2):  # the second call is served by replays only
        torch.testing.assert_close(_cuda_run(pipe, steps=8), reference, rtol=1e-4, atol=1e-4)
        assert _cache_stats(handle) == stats
