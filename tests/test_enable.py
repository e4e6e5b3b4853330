"""hookkit.enable / disable on tiny pipelines: exact restoration, independence, per-call state."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import hookkit
from hookkit.tools import zoo
from hookkit.errors import EnableError, HookError, SpecError
from hookkit.core.feature import BaseFeature, FeatureTable
from hookkit.core.listeners import SchedulerListener
from hookkit.core.registry import ModelHook, registry_names
from hookkit.core.plan import Attachment, add_hook


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


def test_disabling_twice_says_it_was_already_disabled() -> None:
    pipe = zoo.tiny_pipeline("flux")
    hookkit.enable(pipe)
    hookkit.disable(pipe)
    with pytest.raises(EnableError, match=r"^hookkit.disable: expected a FluxPipeline hookkit is enabled on, got one "
                                          r"it is not enabled on \(never enabled, or already disabled\)"):
        hookkit.disable(pipe)


def test_two_pipelines_of_one_class_stay_independent() -> None:
    a, b = zoo.tiny_pipeline("flux"), zoo.tiny_pipeline("flux")
    class_methods = [vars(type(a.scheduler))[m] for m in ("set_timesteps", "step")]
    handle = hookkit.enable(a)
    assert registry_names(b.transformer) == ()
    assert "set_timesteps" not in b.scheduler.__dict__
    assert type(a) is type(b) and type(a).__call__ is type(b).__call__
    assert [vars(type(a.scheduler))[m] for m in ("set_timesteps", "step")] == class_methods
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

    from hookkit.core.registry import HookRegistry

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
    pipe = zoo.tiny_pipeline("flux")
    before = snapshot(pipe)

    def refuse(ctx, attachment):
        raise HookError("cannot attach here")

    spec = _with_features(monkeypatch, _Feature("memo", ["transformer_blocks.0"], refuse))
    with pytest.raises(HookError, match="cannot attach here"):
        hookkit.enable(pipe, spec)
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


def test_enable_rejects_things_it_cannot_hook() -> None:
    with pytest.raises(EnableError, match="expected a diffusers pipeline with a `transformer` or a transformer nn.Module, got str"):
        hookkit.enable("flux")
    with pytest.raises(EnableError, match="^hookkit.disable: expected a diffusers pipeline .* got str"):
        hookkit.disable("flux")


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
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("hookkit")]
    assert len(lines) == 2
    assert "enabled on FluxTransformer2DModel" in lines[0] and "disabled on FluxTransformer2DModel" in lines[1]
    # once each: loguru's default handler must not print them a second time
    assert (err.count("enabled on FluxTransformer2DModel"), err.count("disabled on FluxTransformer2DModel")) == (1, 1)


def test_set_verbosity_level_filters_what_is_printed(capfd: pytest.CaptureFixture[str]) -> None:
    pipe = zoo.tiny_pipeline("flux")
    hookkit.set_verbosity("WARNING")  # attach/detach lines are INFO and DEBUG
    try:
        hookkit.enable(pipe)
        hookkit.disable(pipe)
    finally:
        hookkit.set_verbosity(None)
    assert "hookkit" not in capfd.readouterr().err


def test_set_verbosity_rejects_unknown_levels() -> None:
    with pytest.raises(SpecError, match=r"set_verbosity.level: expected one of"):
        hookkit.set_verbosity("LOUD")


class _Feature(BaseFeature):
    """A stand-in technique for attach-failure tests, registered under a real bool `Spec` field (`memo` or
    `sync_free`) in place of the shipped feature: attaches what `attach_one` does, one per target."""

    spec_class = bool

    def __init__(self, name: str, targets: list[str], attach_one) -> None:
        self.name, self.targets, self.attach_one = name, targets, attach_one  # type: ignore[misc]

    def plan(self, ctx) -> list[Attachment]:
        return [Attachment(feature=self.name, target=t, name=f"test.{self.name}") for t in self.targets]

    def attach(self, handle, attachment):
        return self.attach_one(handle, attachment)


def _with_features(monkeypatch: pytest.MonkeyPatch, *stand_ins: _Feature) -> hookkit.Spec:
    """Register `stand_ins` as hookkit's features; returns the Spec that turns them all on."""
    import hookkit.features

    monkeypatch.setattr(hookkit.features, "FEATURES", FeatureTable(hookkit.Spec, list(stand_ins)))
    return hookkit.Spec(**{f.name: True for f in stand_ins})


def test_a_feature_whose_add_hook_fails_leaves_no_wrapper_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    """add_hook creates the block's registry first; the refused hook must take it away again."""
    pipe = zoo.tiny_pipeline("flux")
    before = snapshot(pipe)
    spec = _with_features(monkeypatch, _Feature("memo", ["transformer_blocks.0"], lambda h, a: add_hook(
        h.transformer.get_submodule(a.target), a.name, object())))  # type: ignore[arg-type]
    with pytest.raises(HookError, match="expected a hookkit.core.registry.ModelHook, got object"):
        hookkit.enable(pipe, spec)
    assert snapshot(pipe) == before


def test_keyboard_interrupt_mid_attach_leaves_the_pipeline_untouched(monkeypatch: pytest.MonkeyPatch) -> None:
    pipe = zoo.tiny_pipeline("flux")
    before = snapshot(pipe)

    def attach_one(handle, attachment):
        if attachment.target == "transformer_blocks.1":
            raise KeyboardInterrupt
        return add_hook(handle.transformer.get_submodule(attachment.target), attachment.name, ModelHook())

    spec = _with_features(monkeypatch, _Feature("memo", ["transformer_blocks.0", "transformer_blocks.1"], attach_one))
    with pytest.raises(KeyboardInterrupt):
        hookkit.enable(pipe, spec)
    assert snapshot(pipe) == before
    assert hookkit.handle_of(pipe) is None


def test_a_rollback_that_fails_keeps_the_original_error(monkeypatch: pytest.MonkeyPatch) -> None:
    class Stuck:
        def remove(self) -> None:
            raise RuntimeError("stuck")

    def refuse(handle, attachment):
        raise HookError("cannot attach here")

    spec = _with_features(monkeypatch, _Feature("memo", [""], lambda h, a: Stuck()),
                          _Feature("sync_free", [""], refuse))
    pipe = zoo.tiny_pipeline("flux")
    with pytest.raises(HookError, match="cannot attach here") as info:
        hookkit.enable(pipe, spec)
    assert info.value.__notes__ == ["hookkit: undoing the partial attach also failed: RuntimeError: stuck"]
    assert registry_names(pipe.transformer) == () and "step" not in pipe.scheduler.__dict__


def test_listeners_whose_before_step_ran_are_undone_when_a_later_one_raises() -> None:
    pipe = zoo.tiny_pipeline("flux")
    handle = hookkit.enable(pipe)
    log: list[str] = []

    class Swaps(SchedulerListener):
        def before_step(self, scheduler, args, kwargs):
            log.append("swaps.before")
            return args, kwargs

        def after_step(self, scheduler) -> None:
            log.append("swaps.after")

    class Raises(SchedulerListener):
        def before_step(self, scheduler, args, kwargs):
            raise RuntimeError("listener failed")

        def after_step(self, scheduler) -> None:
            log.append("raises.after")

    handle.scheduler_listeners.extend([Swaps(), Raises()])
    with pytest.raises(RuntimeError, match="listener failed"):
        run(pipe, "flux", steps=2)
    assert log == ["swaps.before", "swaps.after"]


def test_summary_after_remove_still_names_the_pipeline() -> None:
    handle = hookkit.enable(zoo.tiny_pipeline("flux"))
    handle.remove()
    summary = handle.summary()
    assert summary.pipeline == "FluxPipeline"
    assert str(summary).splitlines()[0] == "hookkit summary: FluxTransformer2DModel in FluxPipeline"


def test_generations_do_not_nest() -> None:
    transformer = zoo.tiny_transformer("wan")
    handle = hookkit.enable(transformer)
    x = torch.randn(1, 16, 1, 4, 4)
    kw = dict(timestep=torch.tensor([500]), encoder_hidden_states=torch.randn(1, 4, 16))
    with handle.generation(calls_per_step=1) as outer:
        with pytest.raises(HookError, match=r"expected no generation in progress, got a nested .*end the outer block"):
            with handle.generation():
                pass
        transformer(x, **kw)
        transformer(x, **kw)
        assert handle.state is outer and (outer.generation, outer.step, outer.calls) == (1, 1, 2)
    with handle.generation() as state:  # wan's default again: two calls per step
        transformer(x, **kw)
        transformer(x, **kw)
        assert (state.generation, state.step, state.branch) == (2, 0, 1)


def test_replacing_the_scheduler_after_enable_is_a_clear_error() -> None:
    """The new scheduler is unpatched: state would never reset and steps never advance. Disable still undoes all."""
    pipe = zoo.tiny_pipeline("flux")
    old = pipe.scheduler
    hookkit.enable(pipe)
    pipe.scheduler = type(old).from_config(old.config)
    with pytest.raises(HookError, match=r"FluxPipeline.scheduler: expected the FlowMatchEulerDiscreteScheduler hookkit "
                                        r"patched at enable, got another .*Call hookkit.disable\(pipe\) before"):
        run(pipe, "flux")
    hookkit.disable(pipe)
    assert {"set_timesteps", "step"} & set(old.__dict__) == set()
    assert registry_names(pipe.transformer) == ()


def test_img2img_num_steps_counts_only_the_steps_that_run() -> None:
    """With strength 0.5 the pipeline starts half-way (`set_begin_index`): 2 of the 4 scheduled steps run."""
    from diffusers import FluxImg2ImgPipeline

    pipe = FluxImg2ImgPipeline(**zoo.tiny_pipeline("flux").components)
    handle = hookkit.enable(pipe)
    kw = zoo.call_kwargs("flux", steps=4)
    pipe(image=torch.rand(1, 3, kw["height"], kw["width"]), strength=0.5, **kw)
    assert (handle.state.num_steps, handle.state.step, handle.state.calls) == (2, 2, 2)


def test_disable_finds_a_transformer_compiled_after_enable() -> None:
    pipe = zoo.tiny_pipeline("flux")
    handle = hookkit.enable(pipe)
    transformer = pipe.transformer
    pipe.transformer = torch.compile(transformer, backend="eager")
    assert hookkit.handle_of(pipe) is handle
    hookkit.disable(pipe)
    assert registry_names(transformer) == () and "forward" not in transformer.__dict__


def test_a_scheduler_shared_with_an_enabled_pipeline_is_refused_and_nothing_is_left() -> None:
    a, b = zoo.tiny_pipeline("flux"), zoo.tiny_pipeline("flux")
    b.scheduler = a.scheduler
    hookkit.enable(a)
    with pytest.raises(HookError, match=r"set_timesteps: expected a method hookkit has not patched, .*shared with a "
                                        r"pipeline hookkit is enabled on. Give each pipeline its own"):
        hookkit.enable(b)
    assert registry_names(b.transformer) == () and "forward" not in b.transformer.__dict__


def test_a_scheduler_method_the_user_set_on_the_instance_comes_back() -> None:
    pipe = zoo.tiny_pipeline("flux")
    stock = pipe.scheduler.step
    calls: list[int] = []

    def step(*args, **kwargs):
        calls.append(1)
        return stock(*args, **kwargs)

    pipe.scheduler.step = step
    handle = hookkit.enable(pipe)
    run(pipe, "flux", steps=2)
    assert (len(calls), handle.state.step) == (2, 2)
    hookkit.disable(pipe)
    assert pipe.scheduler.__dict__["step"] is step


def test_a_disabled_pipeline_is_collected_while_its_handle_lives() -> None:
    pipe = zoo.tiny_pipeline("flux")
    handle = hookkit.enable(pipe, hookkit.Spec(cache=hookkit.DBCache(warmup_steps=1)))
    run(pipe, "flux")
    hookkit.disable(pipe)
    refs = [weakref.ref(o) for o in (pipe, pipe.transformer, pipe.scheduler)]
    del pipe
    gc.collect()  # diffusers pipelines hold reference cycles of their own
    assert [r() for r in refs] == [None, None, None]
    assert handle.summary().generations == 1


# --- living with other libraries' forward wrappers (accelerate offload, diffusers hooks) ------------------


def test_a_forward_wrapper_added_after_enable_keeps_working_through_and_after_disable() -> None:
    """accelerate's offload and diffusers' hooks capture `module.forward` and put it back when they detach."""
    pipe = zoo.tiny_pipeline("flux")
    reference = run(pipe, "flux")
    hookkit.enable(pipe, hookkit.Spec(cache=hookkit.DBCache(steps_mask="fast", mask_policy="static")))
    transformer = pipe.transformer
    captured, calls = transformer.forward, []

    def other_library(*args, **kwargs):
        calls.append(1)
        return captured(*args, **kwargs)

    transformer.forward = other_library
    hookkit.disable(pipe)
    assert transformer.__dict__["forward"] is other_library  # not removed from under the other library
    assert torch.equal(run(pipe, "flux", steps=3), reference) and len(calls) == 3
    transformer.forward = captured  # the other library detaches: hookkit's wrapper now passes straight through
    assert torch.equal(run(pipe, "flux", steps=3), reference)


def test_disable_does_not_revive_a_wrapper_its_library_removed_while_hookkit_was_enabled() -> None:
    pipe = zoo.tiny_pipeline("flux")
    reference = run(pipe, "flux")
    transformer = pipe.transformer
    captured, calls = transformer.forward, []
    transformer.forward = lambda *args, **kwargs: calls.append(1) or captured(*args, **kwargs)
    hookkit.enable(pipe, hookkit.Spec())
    del transformer.forward  # the other library detaches, restoring what it captured (the class's forward)
    hookkit.disable(pipe)
    assert "forward" not in transformer.__dict__
    assert torch.equal(run(pipe, "flux"), reference) and calls == []


def test_diffusers_first_block_cache_enabled_after_hookkit_survives_hookkit_disable() -> None:
    from diffusers.hooks import FirstBlockCacheConfig

    pipe = zoo.tiny_pipeline("flux")
    stock = run(zoo.tiny_pipeline("flux"), "flux")
    hookkit.enable(pipe, hookkit.Spec(cache=hookkit.DBCache(steps_mask="fast", mask_policy="static")))
    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=1e9))  # caches every step after the first
    hookkit.disable(pipe)
    assert not torch.equal(run(pipe, "flux"), stock)  # diffusers' cache still on, and no HookError
    pipe.transformer.disable_cache()
    assert torch.equal(run(pipe, "flux"), stock)


# --- copies of hooked objects -----------------------------------------------------------------------------


def test_a_deepcopy_of_the_hooked_scheduler_is_independent_and_unpatched() -> None:
    """LTX-2 and SkyReels-V2 deepcopy `self.scheduler` inside `__call__`: the copy must not drive the original."""
    import copy

    pipe = zoo.tiny_pipeline("flux")
    handle = hookkit.enable(pipe, hookkit.Spec(sync_free=True))
    twin = copy.deepcopy(pipe.scheduler)
    pipe.scheduler.set_timesteps(4)
    generations = handle.state.generation
    twin.set_timesteps(10)
    assert len(pipe.scheduler.timesteps) == 4 and len(twin.timesteps) == 10
    assert handle.state.generation == generations  # the copy's calls are not hookkit's
    assert all(not getattr(twin.__dict__.get(name), "__hookkit_patch__", False) for name in twin.__dict__)
    hookkit.disable(pipe)
    hookkit.enable(type(pipe)(**{**pipe.components, "scheduler": twin}), hookkit.Spec())  # not "shared"


def test_pickling_a_hooked_transformer_or_scheduler_is_refused_with_the_fix() -> None:
    import pickle

    pipe = zoo.tiny_pipeline("flux")
    hookkit.enable(pipe, hookkit.Spec())
    with pytest.raises(HookError, match=r"^pickle of FluxTransformer2DModel: expected a module without hookkit "
                                        r"hooks, .*Save its weights instead \(module.state_dict\(\), save_pretrained\)"):
        pickle.dumps(pipe.transformer)
    with pytest.raises(HookError, match=r"^pickle of FlowMatchEulerDiscreteScheduler: expected an object without "
                                        r"hookkit patches"):
        pickle.dumps(pipe.scheduler)
    hookkit.disable(pipe)
    pickle.dumps(pipe.scheduler)
    pickle.dumps(pipe.transformer)


def test_replacing_the_transformer_after_enable_is_refused_at_the_next_call_and_disable_still_undoes_all() -> None:
    pipe = zoo.tiny_pipeline("flux")
    run(pipe, "flux")  # a call sets the pipeline's own call attributes (_guidance_scale, ...): not hookkit's
    before = snapshot(pipe)
    old = pipe.transformer
    hookkit.enable(pipe, hookkit.Spec(sync_free=True))
    pipe.transformer = zoo.tiny_pipeline("flux").transformer  # e.g. another fine-tune loaded in its place
    with pytest.raises(HookError, match=r"^FluxPipeline.transformer: expected the FluxTransformer2DModel hookkit "
                                        r"hooked at enable, got another FluxTransformer2DModel \(the transformer was "
                                        r"replaced after hookkit.enable\)"):
        run(pipe, "flux")
    with pytest.raises(EnableError, match=r"^hookkit is already enabled on this FluxPipeline \(on the transformer it had then"):
        hookkit.enable(pipe, hookkit.Spec())
    hookkit.disable(pipe)  # found through the scheduler's patch: the old transformer and the scheduler are restored
    assert registry_names(old) == () and "forward" not in old.__dict__
    pipe.transformer = old
    assert snapshot(pipe) == before
    hookkit.enable(pipe, hookkit.Spec())


def test_appending_a_block_to_a_hooked_block_list_after_enable_is_refused_at_the_next_call() -> None:
    """An appended block carries no hooks: on a cached step it would run inside DBCache's cached region and its
    work would be counted twice (once in the reused residual, once run)."""
    pipe = zoo.tiny_pipeline("flux")
    hookkit.enable(pipe, hookkit.Spec(cache=hookkit.DBCache(steps_mask="fast", mask_policy="static")))
    blocks = pipe.transformer.single_transformer_blocks
    blocks.append(zoo.tiny_pipeline("flux").transformer.single_transformer_blocks[0])
    with pytest.raises(HookError, match=r"^FluxTransformer2DModel.single_transformer_blocks: expected the 3 blocks "
                                        r"it held at hookkit.enable, got 4 \(blocks added or removed after "
                                        r"hookkit.enable\).* Call hookkit.disable, change the block list, then "
                                        r"hookkit.enable again"):
        run(pipe, "flux")
    del blocks[-1]
    run(pipe, "flux")
    hookkit.disable(pipe)


def test_a_block_appended_to_transformer_blocks_under_dynamic_dbcache_is_refused_before_any_step_runs() -> None:
    """Flux's double-stream list, between the first block and the single-stream blocks: inside the cached region."""
    pipe = zoo.tiny_pipeline("flux")
    handle = hookkit.enable(pipe, hookkit.Spec(cache=hookkit.DBCache(warmup_steps=0)))
    pipe.transformer.transformer_blocks.append(zoo.tiny_pipeline("flux", seed=1).transformer.transformer_blocks[0])
    calls: list[int] = []
    counting = pipe.transformer.register_forward_pre_hook(lambda *_: calls.append(1))
    with pytest.raises(HookError, match=r"^FluxTransformer2DModel.transformer_blocks: expected the 2 blocks it held at "
                                        r"hookkit.enable, got 3 \(blocks added or removed after hookkit.enable\)"):
        run(pipe, "flux")
    counting.remove()
    assert (calls, handle.state.generation) == ([], 0)


def test_replacing_a_hooked_block_after_enable_is_refused_at_the_next_call() -> None:
    pipe = zoo.tiny_pipeline("flux")
    hookkit.enable(pipe, hookkit.Spec(cache=hookkit.DBCache(steps_mask="fast", mask_policy="static")))
    old = pipe.transformer.transformer_blocks[1]
    pipe.transformer.transformer_blocks[1] = zoo.tiny_pipeline("flux").transformer.transformer_blocks[1]
    with pytest.raises(HookError, match=r"^FluxTransformer2DModel.transformer_blocks.1: expected the "
                                        r"FluxTransformerBlock hookkit hooked at enable, got FluxTransformerBlock "
                                        r"\(replaced after hookkit.enable\); its hooks no longer run"):
        run(pipe, "flux")
    pipe.transformer.transformer_blocks[1] = old
    run(pipe, "flux")
    hookkit.disable(pipe)
