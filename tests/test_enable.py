"""hookkit.enable / disable on tiny pipelines: exact restoration, independence, per-call state."""

from __future__ import annotations

import pytest
import torch

import hookkit
from hookkit import zoo
from hookkit.errors import EnableError, HookError, SpecError
from hookkit.hooks import ModelHook, registry_names
from hookkit.plan import Attachment


def run(pipe, name: str, steps: int = 3, **extra) -> torch.Tensor:
    return pipe(**zoo.call_kwargs(name, steps=steps, **extra)).images


def snapshot(pipe) -> dict[str, dict]:
    """Every component's instance __dict__ keys and every module's __dict__ keys: what a hook could leave."""
    out = {"scheduler": set(pipe.scheduler.__dict__), "pipe": set(pipe.__dict__)}
    for path, module in pipe.transformer.named_modules():
        out[f"transformer.{path}"] = set(module.__dict__)
    return out


@pytest.mark.parametrize("name", ["flux", "qwenimage"])
def test_output_after_disable_is_bitwise_equal_to_never_hooked(name: str) -> None:
    pipe = zoo.tiny_pipeline(name)
    reference = run(pipe, name)
    before = snapshot(pipe)
    hookkit.enable(pipe, hookkit.Spec())
    hooked = run(pipe, name)
    hookkit.disable(pipe)
    assert torch.equal(hooked, reference)
    assert torch.equal(run(pipe, name), reference)
    assert snapshot(pipe) == before


def test_enabling_twice_raises_and_says_what_to_do() -> None:
    pipe = zoo.tiny_pipeline("flux")
    hookkit.enable(pipe)
    with pytest.raises(EnableError, match=r"already enabled .*call hookkit.disable"):
        hookkit.enable(pipe)
    with pytest.raises(EnableError, match="already enabled"):
        hookkit.enable(pipe.transformer)


def test_disable_without_enable_raises() -> None:
    with pytest.raises(EnableError, match="not enabled"):
        hookkit.disable(zoo.tiny_pipeline("flux"))


def test_two_pipelines_of_one_class_stay_independent() -> None:
    a, b = zoo.tiny_pipeline("flux"), zoo.tiny_pipeline("flux")
    handle = hookkit.enable(a)
    assert registry_names(b.transformer) == ()
    assert "set_timesteps" not in b.scheduler.__dict__
    assert type(a) is type(b) and type(a).__call__ is type(b).__call__
    run(b, "flux")
    assert handle.state.generation == 0  # b's call did not touch a's state
    run(a, "flux")
    assert handle.state.generation == 1


def test_steps_are_counted_per_call_without_num_inference_steps_at_enable() -> None:
    pipe = zoo.tiny_pipeline("flux")
    handle = hookkit.enable(pipe)
    run(pipe, "flux", steps=4)
    assert (handle.state.generation, handle.state.num_steps, handle.state.calls, handle.state.step) == (1, 4, 4, 4)
    run(pipe, "flux", steps=2)
    assert (handle.state.generation, handle.state.num_steps, handle.state.calls, handle.state.step) == (2, 2, 2, 2)


def test_separate_cfg_calls_are_branches_of_one_step() -> None:
    pipe = zoo.tiny_pipeline("qwenimage")
    handle = hookkit.enable(pipe)
    seen: list[tuple[int, int]] = []

    class Spy(ModelHook):
        def pre_forward(self, module, args, kwargs):
            seen.append((handle.state.step, handle.state.branch))
            return args, kwargs

    from hookkit.hooks import HookRegistry

    HookRegistry.of(pipe.transformer).register("spy", Spy())
    kw = zoo.call_kwargs("qwenimage", steps=2, true_cfg_scale=4.0)
    kw.update(negative_prompt_embeds=torch.randn_like(kw["prompt_embeds"]), negative_prompt_embeds_mask=kw["prompt_embeds_mask"])
    pipe(**kw)
    HookRegistry.of(pipe.transformer).remove("spy")
    assert seen == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_an_exception_inside_a_call_leaves_no_stale_state() -> None:
    pipe = zoo.tiny_pipeline("flux")
    handle = hookkit.enable(pipe)

    def explode(pipe_, step, t, kwargs):
        if step == 1:
            raise RuntimeError("boom")
        return {}

    with pytest.raises(RuntimeError, match="boom"):
        run(pipe, "flux", steps=4, callback_on_step_end=explode)
    handle.state.features["probe"] = object()  # anything a feature left behind
    run(pipe, "flux", steps=4)
    assert (handle.state.generation, handle.state.step, handle.state.calls) == (2, 4, 4)
    assert handle.state.features == {}


def test_bare_transformer_marks_generations_explicitly() -> None:
    transformer = zoo.tiny_transformer("wan")
    handle = hookkit.enable(transformer)
    x = torch.randn(1, 16, 1, 4, 4)
    kw = dict(timestep=torch.tensor([500]), encoder_hidden_states=torch.randn(1, 4, 16))
    with handle.generation(num_steps=2, calls_per_step=2) as state:
        for _ in range(4):
            transformer(x, **kw)
        assert (state.step, state.branch, state.calls) == (1, 1, 4)
    with handle.generation() as state:  # wan's adapter says separate CFG: two calls per step
        transformer(x, **kw)
        assert (state.generation, state.step, state.calls) == (2, 0, 1)
    handle.remove()
    assert "forward" not in transformer.__dict__


def test_calls_per_step_is_for_bare_transformers_only() -> None:
    handle = hookkit.enable(zoo.tiny_pipeline("flux"))
    with pytest.raises(SpecError, match="calls_per_step: expected None with a pipeline"):
        with handle.generation(calls_per_step=2):
            pass


def test_failed_attach_detaches_everything_in_reverse(monkeypatch: pytest.MonkeyPatch) -> None:
    from hookkit import handle as handle_mod

    pipe = zoo.tiny_pipeline("flux")
    before = snapshot(pipe)

    class Broken:
        name = "broken"
        fields: tuple[str, ...] = ()

        def enabled(self, spec):
            return True

        def plan(self, ctx):
            return [Attachment(feature="broken", target="transformer_blocks.0", name="x")]

        def attach(self, handle, attachment):
            raise HookError("cannot attach here")

    real = handle_mod.features
    monkeypatch.setattr(handle_mod, "features", lambda: [*real(), Broken()])
    with pytest.raises(HookError, match="cannot attach here"):
        hookkit.enable(pipe)
    assert snapshot(pipe) == before
    assert hookkit.handle_of(pipe) is None


def test_plan_is_data_and_attaches_nothing() -> None:
    pipe = zoo.tiny_pipeline("flux")
    plan = hookkit.build_plan(pipe)
    assert plan.targets() == [
        ("", "hookkit.clock"),
        ("pipeline.scheduler.set_timesteps", "hookkit.generation"),
        ("pipeline.scheduler.step", "hookkit.step"),
    ]
    assert registry_names(pipe.transformer) == ()


def test_summary_is_structured_and_renders_as_a_table() -> None:
    pipe = zoo.tiny_pipeline("flux")
    handle = hookkit.enable(pipe)
    run(pipe, "flux")
    summary = handle.summary()
    assert summary.adapter == "flux"
    assert summary.pipeline == "FluxPipeline"
    assert summary.generations == 1
    assert [(h.module, h.name) for h in summary.hooks] == [
        ("", "hookkit.clock"),
        ("pipeline.scheduler.set_timesteps", "hookkit.generation"),
        ("pipeline.scheduler.step", "hookkit.step"),
    ]
    text = str(summary)
    assert "hookkit summary: FluxTransformer2DModel in FluxPipeline" in text
    assert "| core    | hookkit.clock      | <transformer>" in text


def test_remove_is_idempotent_and_drops_references() -> None:
    pipe = zoo.tiny_pipeline("flux")
    handle = hookkit.enable(pipe)
    handle.remove()
    handle.remove()
    assert handle.transformer is None and handle.pipeline is None
    assert hookkit.handle_of(pipe) is None


def test_two_transformer_pipelines_are_refused_with_the_workaround() -> None:
    pipe = zoo.tiny_pipeline("wan")
    pipe.transformer_2 = zoo.tiny_transformer("wan")
    with pytest.raises(EnableError, match=r"two transformers .*hookkit.enable\(pipe.transformer_2, spec\)"):
        hookkit.enable(pipe)


def test_enable_rejects_things_it_cannot_hook() -> None:
    with pytest.raises(EnableError, match="expected a diffusers pipeline with a `transformer` or a transformer nn.Module, got str"):
        hookkit.enable("flux")


def test_library_is_silent_by_default(capfd: pytest.CaptureFixture[str]) -> None:
    pipe = zoo.tiny_pipeline("flux")
    hookkit.enable(pipe)
    hookkit.disable(pipe)
    assert "hookkit" not in capfd.readouterr().err


def test_set_verbosity_logs_attach_and_detach_only(capfd: pytest.CaptureFixture[str]) -> None:
    pipe = zoo.tiny_pipeline("flux")
    hookkit.set_verbosity("INFO")
    try:
        hookkit.enable(pipe)
        run(pipe, "flux")
        hookkit.disable(pipe)
    finally:
        hookkit.set_verbosity(None)
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("hookkit")]
    assert len(lines) == 2
    assert "enabled on FluxTransformer2DModel" in lines[0] and "disabled on FluxTransformer2DModel" in lines[1]


def test_set_verbosity_rejects_unknown_levels() -> None:
    with pytest.raises(SpecError, match=r"set_verbosity.level: expected one of"):
        hookkit.set_verbosity("LOUD")


def test_every_pipeline_call_resets_the_hooks_on_hooked_modules() -> None:
    pipe = zoo.tiny_pipeline("flux")
    resets: list[int] = []

    class Stateful(ModelHook):
        def reset(self) -> None:
            resets.append(1)

    hookkit.enable(pipe, hookkit.Spec(cache=hookkit.DBCache(steps_mask=[1, 0], mask_policy="static")))
    from hookkit.hooks import HookRegistry

    HookRegistry.of(pipe.transformer.transformer_blocks[1]).register("stateful", Stateful())
    run(pipe, "flux")
    run(pipe, "flux")
    assert len(resets) == 2
