"""DBCache(extrapolate="output"): a cached call runs nothing of the transformer and returns the Taylor extrapolation of
the branch's last computed outputs, in the structure the transformer returned.

On the stub of test_dbcache (every block adds `scale * temb` to both streams, so a computed call returns
`(encoder + 15 temb, hidden + 15 temb)`) the extrapolated outputs are known exactly; the tiny diffusers pipelines
check the structures they return, CFG branches, the CUDA-graph stand-in and removal.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import hookkit
from hookkit.core.graphs import EagerCalls
from hookkit.core.registry import HookRegistry, registry_names
from hookkit.errors import SpecError, UnsupportedError
from hookkit.techniques.cache.calibration import CacheCalibration, predict_weights
from hookkit.techniques.cache.hooks import OUTPUT_HOOK, _rebuild, _split_output
from hookkit.techniques.cache.spec import resolved_extrapolate
from hookkit.tools import zoo
from hookkit.tools.tune import candidates
from tests.test_dbcache import StubTransformer, stub

#: computes steps 0, 1 and 3; steps 2, 4 and 5 are cached
MASK = (1, 1, 0, 1, 0, 0)
TEMBS = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]


def output_cache(order: int, mask: tuple[int, ...] = MASK) -> hookkit.DBCache:
    return hookkit.DBCache(fn_blocks=0, warmup_steps=0, steps_mask=mask, mask_policy="static",
                           taylorseer_order=order, extrapolate="output")


def drive(model: torch.nn.Module, handle: hookkit.Handle, tembs: list[float],
          hidden: torch.Tensor | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    hidden = torch.arange(6, dtype=torch.float64).reshape(2, 3) if hidden is None else hidden
    encoder = torch.ones(2, 2, dtype=torch.float64)
    with handle.generation(num_steps=len(tembs)):
        return [model(hidden, encoder, torch.tensor(t, dtype=torch.float64)) for t in tembs]


def counting(model: torch.nn.Module) -> list[int]:
    """How many times the blocks ran (one entry per block call)."""
    calls: list[int] = []
    for block in model.blocks:
        block.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


# --- the spec ---------------------------------------------------------------------------------------------------


def test_output_with_blocks_running_on_cached_steps_is_refused_with_the_fix() -> None:
    with pytest.raises(SpecError, match=r"DBCache.extrapolate: 'output' .* got fn_blocks=1, bn_blocks=0\. Use "
                                        r"fn_blocks=0 and bn_blocks=0"):
        hookkit.DBCache(threshold=0.1, extrapolate="output")


def test_an_unknown_extrapolate_is_refused_naming_the_choices() -> None:
    with pytest.raises(SpecError, match=r"^DBCache\.extrapolate: expected one of \('residual', 'output', None\), got 'outputs'\.$"):
        hookkit.DBCache(extrapolate="outputs")


def test_the_whole_step_schedule_leaves_the_choice_to_the_model() -> None:
    assert hookkit.DBCache().extrapolate is None
    assert hookkit.DBCache(speedup=3.0, fn_blocks=0).extrapolate is None


@pytest.mark.parametrize(("name", "between", "expected"), [("wan", (), "output"),
                                                         ("flux", ("controlnet_block_samples",), "residual")])
def test_by_default_the_output_is_reused_unless_the_model_may_be_given_controls(name: str, between: tuple[str, ...],
                                                                                expected: str) -> None:
    pipe = zoo.tiny_pipeline(name)
    assert hookkit.resolve_adapter(pipe.transformer).between_block_args[:1] == between
    handle = hookkit.enable(pipe, hookkit.Spec(cache=hookkit.DBCache()))
    assert (OUTPUT_HOOK in registry_names(pipe.transformer)) == (expected == "output")
    assert resolved_extrapolate(hookkit.DBCache(), between) == expected
    handle.remove()


@pytest.mark.parametrize("spec", [dict(fn_blocks=1), dict(threshold=0.1),
                                  dict(rule="magnitude", calibration=CacheCalibration(steps=3, ratios=(1.0,) * 3))],
                         ids=["schedule-F1", "threshold", "magnitude"])
def test_every_other_rule_or_split_reuses_the_residual_by_default(spec: dict[str, Any]) -> None:
    assert hookkit.DBCache(**spec).extrapolate == "residual"


def test_a_spec_file_written_before_the_field_existed_keeps_the_residual() -> None:
    written = hookkit.Spec(cache=hookkit.DBCache()).to_dict()
    del written["cache"]["extrapolate"]  # every other field present: a file `to_dict` wrote before
    assert hookkit.Spec.from_dict(written).cache.extrapolate == "residual"
    assert hookkit.Spec.from_dict({"cache": {"speedup": 3.0}}).cache.extrapolate is None  # a hand-written one


# --- what a cached call returns -------------------------------------------------------------------------------


@pytest.mark.parametrize("order", [0, 1, 2])
def test_a_cached_call_returns_the_taylor_extrapolation_of_the_computed_outputs(order: int) -> None:
    model, handle = stub(output_cache(order))
    out = drive(model, handle, TEMBS)
    uncached = drive(*stub(None), TEMBS)
    computed = [t for t, m in enumerate(MASK) if m]
    for t in range(len(TEMBS)):
        if MASK[t]:
            assert all(torch.equal(a, b) for a, b in zip(out[t], uncached[t]))
            continue
        weights = predict_weights(tuple(c for c in computed if c < t), t, order)
        for stream in (0, 1):
            expected = sum(w * uncached[c][stream] for c, w in weights.items())
            torch.testing.assert_close(out[t][stream], expected, rtol=1e-12, atol=1e-12)


def test_a_cached_call_runs_no_block() -> None:
    model, handle = stub(output_cache(1))
    calls = counting(model)
    drive(model, handle, TEMBS)
    assert len(calls) == 3 * 5  # steps 0, 1, 3 of 6, five blocks each
    data = handle.summary().features["cache"].data
    assert (data["block_calls"], data["branches"][0]["cached"]) == (15, [2, 4, 5])


def test_the_cached_output_is_a_new_tensor_the_caller_may_change() -> None:
    model, handle = stub(output_cache(0))
    out = drive(model, handle, TEMBS[:3])
    out[2][0].add_(100.0)  # reused (order 0) as returned at step 1, but not the kept copy itself
    assert not torch.equal(out[2][0], out[1][0])
    again = drive(model, handle, TEMBS[:3])
    assert torch.equal(again[2][0], again[1][0])


def test_a_call_of_other_input_shapes_computes_and_starts_the_trajectory_over() -> None:
    model, handle = stub(output_cache(0, mask=(1, 0, 0, 0)))
    encoder = torch.ones(2, 2, dtype=torch.float64)
    with handle.generation(num_steps=4):
        model(torch.zeros(2, 3, dtype=torch.float64), encoder, torch.tensor(1.0, dtype=torch.float64))
        model(torch.zeros(2, 3, dtype=torch.float64), encoder, torch.tensor(2.0, dtype=torch.float64))
        wide = model(torch.zeros(2, 4, dtype=torch.float64), encoder, torch.tensor(3.0, dtype=torch.float64))
        reused = model(torch.zeros(2, 4, dtype=torch.float64), encoder, torch.tensor(4.0, dtype=torch.float64))
    assert torch.equal(wide[0], torch.full((2, 4), 45.0, dtype=torch.float64))  # hidden + 15 temb, computed
    assert torch.equal(reused[0], wide[0])
    data = handle.summary().features["cache"].data["branches"][0]
    assert (data["computed"], data["cached"]) == ([0, 2], [1, 3])


@pytest.mark.parametrize(("output", "kind"), [
    (torch.ones(2), "tensor"),
    ((torch.ones(2), None, torch.zeros(1, dtype=torch.long)), "tuple"),
    ([torch.ones(2), torch.zeros(3)], "list"),
])
def test_the_rebuilt_output_has_the_structure_of_the_computed_one(output: Any, kind: str) -> None:
    tensors, template = _split_output(output, "Model")
    rebuilt = _rebuild(template, [t + 1 for t in tensors])
    assert template[0] == kind and type(rebuilt) is type(output)
    if kind == "tensor":
        assert torch.equal(rebuilt, output + 1)
    else:
        assert [None if v is None else v.tolist() for v in rebuilt] == [
            None if v is None else (v + 1 if v.is_floating_point() else v).tolist() for v in output]


def test_an_output_without_floating_tensors_is_refused_with_the_fix() -> None:
    with pytest.raises(UnsupportedError, match=r"DBCache\(extrapolate='output'\) on Model: expected the "
                                               r"transformer's output to hold floating tensors .* got dict\. Use "
                                               r"extrapolate='residual'"):
        _split_output({"mask": torch.zeros(2, dtype=torch.long)}, "Model")


def test_a_diffusers_output_comes_back_as_the_same_class() -> None:
    pipe = zoo.tiny_pipeline("flux")
    hookkit.enable(pipe, hookkit.Spec(cache=output_cache(1, mask=(1, 1, 0))))
    seen: list[Any] = []
    pipe.transformer.transformer_blocks[0].register_forward_pre_hook(lambda *_: seen.append(1))
    results: list[Any] = []
    wrapped = pipe.transformer.forward

    def as_dict(*args: Any, **kwargs: Any) -> Any:
        results.append(wrapped(*args, **{**kwargs, "return_dict": True}))
        return results[-1]

    pipe.transformer.forward = as_dict
    try:
        pipe(**zoo.call_kwargs("flux", steps=3))
    finally:
        pipe.transformer.forward = wrapped
    assert [type(r).__name__ for r in results] == ["Transformer2DModelOutput"] * 3
    assert len(seen) == 2  # the cached step never entered the model
    assert results[2].sample.shape == results[1].sample.shape


# --- pipelines: branches, graphs, removal ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["wan", "hunyuanvideo15"])  # CFG in the pipeline's loop, and through its guider
def test_each_cfg_branch_extrapolates_its_own_outputs(name: str) -> None:
    pipe = zoo.tiny_pipeline(name)
    handle = hookkit.enable(pipe, hookkit.Spec(cache=output_cache(1, mask=(1, 1, 0, 1))))
    outputs: dict[tuple[int, int], torch.Tensor] = {}
    wrapped = pipe.transformer.forward  # hookkit's wrapper: its output is what the pipeline sees

    def record(*args: Any, **kwargs: Any) -> Any:
        out = wrapped(*args, **kwargs)
        outputs[(handle.state.step, handle.state.branch)] = (out[0] if isinstance(out, tuple) else out.sample).clone()
        return out

    pipe.transformer.forward = record
    try:
        pipe(**zoo.call_kwargs(name, steps=4))
    finally:
        pipe.transformer.forward = wrapped
    assert sorted({b for _, b in outputs}) == [0, 1]
    for b in (0, 1):  # order 1 at step 2 from steps 0 and 1: 2 out_1 - out_0
        torch.testing.assert_close(outputs[(2, b)], outputs[(1, b)] * 2 - outputs[(0, b)], rtol=1e-6, atol=1e-6)
    assert not torch.equal(outputs[(2, 0)], outputs[(2, 1)])
    data = handle.summary().features["cache"].data["branches"]
    assert {i: (d["computed"], d["cached"]) for i, d in data.items()} == {0: ([0, 1, 3], [2]), 1: ([0, 1, 3], [2])}


def test_under_the_transformer_graph_stand_in_only_computed_calls_are_replayed_and_outputs_match_eager() -> None:
    from hookkit.techniques.compile.cuda_graphs import GraphRunner
    from hookkit.techniques.compile.hooks import GRAPH, GraphHook
    from tests.test_compile import ReplayBackend, run

    cache = hookkit.DBCache(rule="schedule", speedup=1.6, taylorseer_order=2, extrapolate="output",
                            calibration=CacheCalibration(steps=8, gram=_smooth_gram(8)))
    eager_pipe = zoo.tiny_pipeline("flux")
    hookkit.enable(eager_pipe, hookkit.Spec(cache=cache))
    reference = run(eager_pipe, steps=8)
    pipe = zoo.tiny_pipeline("flux")
    handle = hookkit.enable(pipe, hookkit.Spec(cache=cache))
    assert handle.service(hookkit.core.graphs.GraphDecisions) is None  # a cached call never reaches the graphs
    backend = ReplayBackend()
    HookRegistry.of(pipe.transformer).register(GRAPH, GraphHook(GraphRunner(backend), None,
                                                                eager=handle.service(EagerCalls)))
    for _ in range(2):  # the second call: replays only
        assert torch.equal(run(pipe, steps=8), reference)
    assert backend.captures == 1
    assert len(handle.summary().features["cache"].data["branches"][0]["cached"]) == 3


def test_removal_leaves_the_transformer_bitwise_stock() -> None:
    pipe = zoo.tiny_pipeline("flux")
    reference = pipe(**zoo.call_kwargs("flux", steps=4)).images
    handle = hookkit.enable(pipe, hookkit.Spec(cache=output_cache(2, mask=(1, 1, 0, 0))))
    assert OUTPUT_HOOK in registry_names(pipe.transformer)
    assert not torch.equal(pipe(**zoo.call_kwargs("flux", steps=4)).images, reference)
    handle.remove()
    assert registry_names(pipe.transformer) == () and "forward" not in pipe.transformer.__dict__
    assert torch.equal(pipe(**zoo.call_kwargs("flux", steps=4)).images, reference)


def test_the_summary_says_the_output_is_reused() -> None:
    model, handle = stub(output_cache(1))
    drive(model, handle, TEMBS)
    data = handle.summary().features["cache"].data
    assert data["extrapolate"] == "output"
    assert data["block_calls"] == 15
    assert handle.summary().features["cache"].text.splitlines()[0] == (
        "DBCache F0B0 (middle 5 of 5 blocks), threshold 0.24, mask [1, 1, 0, 1, 0, 0] (static); cached steps reuse the "
        "transformer's output")


def test_no_block_hook_is_attached_in_output_mode() -> None:
    pipe = zoo.tiny_pipeline("flux")
    plan = hookkit.build_plan(pipe, hookkit.Spec(cache=output_cache(1)))
    assert plan.targets("cache") == [("", OUTPUT_HOOK)]


# --- the tuner ---------------------------------------------------------------------------------------------------


def test_the_tuner_tries_output_extrapolation_on_its_planned_schedules_of_order_1_and_2() -> None:
    calibration = CacheCalibration(steps=8, gram=_smooth_gram(8))
    tried = candidates(calibration, speedup=2.0)
    schedules = [c for c in tried if c.rule == "schedule"]
    output = [c for c in schedules if c.extrapolate == "output"]
    assert sorted({c.taylorseer_order for c in output}) == [1, 2]
    assert len(output) == 2 * len([c for c in schedules if c.extrapolate == "residual" and c.taylorseer_order == 1])
    assert all(c.extrapolate == "residual" for c in tried if c.rule != "schedule")


def _smooth_gram(n: int) -> tuple[tuple[float, ...], ...]:
    from tests.test_cache_rules import random_gram

    return random_gram(n, seed=3)

