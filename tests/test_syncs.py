"""Sync detector: warning capture -> attribution -> per-step/per-place counts -> table, and its scope.

Sync debug mode is a CUDA feature, so on the CPU the warnings are synthetic: the same text PyTorch emits,
raised through the real `warnings` machinery (or fed as stacks), with a fake debug-mode switch that
records when hookkit's clock turns it on and off. The GPU tests at the end run the real thing.
"""

from __future__ import annotations

import os
import traceback
import warnings
from typing import Any

import pytest
import torch

import hookkit
from hookkit.tools import zoo
from hookkit.errors import SpecError, UnsupportedError
from hookkit.core.registry import registry_names
from hookkit.diagnostics.host_syncs import (
    SYNC_WARNING,
    SyncEvent,
    SyncLocation,
    SyncRecorder,
    SyncReport,
    _profile,
    profile_syncs,
)
from hookkit.diagnostics.testing import assert_no_host_sync

TORCH_DIR = os.path.dirname(torch.__file__)
MESSAGE = SYNC_WARNING + " (Triggered internally at c10/cuda/CUDAFunctions.cpp:160.)"


def frame(filename: str, lineno: int, name: str, line: str = "") -> traceback.FrameSummary:
    return traceback.FrameSummary(filename, lineno, name, line=line)


def loc(file: str, line: int, function: str, code: str = "") -> SyncLocation:
    return SyncLocation(file=file, line=line, function=function, code=code)


# --- attribution ----------------------------------------------------------------------------------------------


def test_attribution_is_the_first_frame_outside_torch() -> None:
    stack = [
        frame("/app/run.py", 3, "<module>", "pipe(**kw)"),
        frame("/site/diffusers/pipeline_cogvideox.py", 744, "__call__", "t.item()"),
        frame(os.path.join(TORCH_DIR, "_tensor.py"), 1100, "__format__"),
    ]
    assert SyncRecorder.attribute(stack) == loc("/site/diffusers/pipeline_cogvideox.py", 744, "__call__", "t.item()")


def test_attribution_skips_torch_function_pass_through() -> None:
    stack = [
        frame("/site/diffusers/scheduling_ddim.py", 391, "step", "alpha_prod_t = self.alphas_cumprod[timestep]"),
        frame("/site/hookkit/hooks/sync.py", 150, "__torch_function__", "return func(*args, **(kwargs or {}))"),
        frame(os.path.join(TORCH_DIR, "utils", "_device.py"), 104, "__torch_function__"),
    ]
    assert SyncRecorder.attribute(stack).where == "scheduling_ddim.py:391"


def test_attribution_of_a_stack_inside_torch_only() -> None:
    assert SyncRecorder.attribute([frame(os.path.join(TORCH_DIR, "x.py"), 1, "f")]) == loc("<torch>", 0, "?")


# --- capture ---------------------------------------------------------------------------------------------------

# A function whose code object says it lives inside torch, as the frames of torch's Python wrappers do.
_FAKE_TORCH = os.path.join(TORCH_DIR, "_hookkit_fake_sync.py")
_namespace: dict[str, Any] = {}
exec(compile(f"import warnings\ndef torch_op():\n    warnings.warn({MESSAGE!r})\n", _FAKE_TORCH, "exec"), _namespace)
torch_op = _namespace["torch_op"]


def sync_here() -> None:
    torch_op()


SYNC_HERE_LINE = sync_here.__code__.co_firstlineno + 1


def test_capture_records_each_sync_warning_at_its_caller() -> None:
    recorder = SyncRecorder(step_of=lambda: 7)
    recorder.active = True
    with recorder.capture():
        sync_here()
        sync_here()
    assert recorder.events == [SyncEvent(step=7, location=loc(__file__, SYNC_HERE_LINE, "sync_here", "torch_op()"))] * 2


def test_capture_records_nothing_while_inactive() -> None:
    recorder = SyncRecorder(step_of=lambda: 0)
    with recorder.capture():
        torch_op()
    assert recorder.events == []


def test_capture_shows_other_warnings_as_usual_and_restores_the_handler() -> None:
    shown: list[str] = []
    saved = warnings.showwarning

    def show(message: Any, *rest: Any) -> None:
        shown.append(str(message))

    warnings.showwarning = show
    try:
        recorder = SyncRecorder(step_of=lambda: 0)
        recorder.active = True
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            with recorder.capture():
                warnings.warn("something else")
                torch_op()
            assert warnings.showwarning is show
            warnings.warn("after")
    finally:
        warnings.showwarning = saved
    assert shown == ["something else", "after"]
    assert len(recorder.events) == 1


# --- aggregation and the table ----------------------------------------------------------------------------------

ITEM = loc("/site/pipeline_cogvideox.py", 744, "__call__", "t.item()")
PREV = loc("/site/scheduling_ddim_cogvideox.py", 392, "step",
           "alpha_prod_t_prev = self.alphas_cumprod[prev_timestep] if prev_timestep >= 0 else self.final_alpha_cumprod")


def synthetic_report() -> SyncReport:
    events = [SyncEvent(step=1, location=ITEM), SyncEvent(step=1, location=PREV), SyncEvent(step=1, location=PREV),
              SyncEvent(step=2, location=ITEM), SyncEvent(step=2, location=PREV), SyncEvent(step=2, location=PREV)]
    return SyncReport(pipeline="CogVideoXPipeline", steps=(1, 2, 3), events=tuple(events))


def test_report_counts_per_step_with_zeros_and_per_place_most_frequent_first() -> None:
    report = synthetic_report()
    assert report.total == 6
    assert report.per_step() == {1: 3, 2: 3, 3: 0}
    assert report.per_location() == [(4, PREV), (2, ITEM)]


def test_report_table_lists_each_sync_location_by_count_and_render_adds_the_per_step_counts() -> None:
    assert synthetic_report().table().splitlines() == [
        "| count | where                            | function | code                                                                     |",
        "|-------|----------------------------------|----------|--------------------------------------------------------------------------|",
        "| 4     | scheduling_ddim_cogvideox.py:392 | step     | alpha_prod_t_prev = self.alphas_cumprod[prev_timestep] if prev_timest... |",
        "| 2     | pipeline_cogvideox.py:744        | __call__ | t.item()                                                                 |",
    ]
    rendered = synthetic_report().render()
    assert rendered.splitlines()[0] == ("host syncs in CogVideoXPipeline, denoising steps 1..3 (the first 1 not profiled): "
                                        "6 in total, 2 per step")
    assert "| syncs | 3 | 3 | 0 |" in rendered


def test_report_to_dict() -> None:
    data = synthetic_report().to_dict()
    assert data["per_step"] == {"1": 3, "2": 3, "3": 0}
    assert [(d["count"], d["where"]) for d in data["per_location"]] == [(4, "scheduling_ddim_cogvideox.py:392"),
                                                                       (2, "pipeline_cogvideox.py:744")]


# --- scope: the clock switches the mode -----------------------------------------------------------------------


class FakeDebugMode:
    """Stands in for torch.cuda.{get,set}_sync_debug_mode; a block hook 'syncs' once per call while it is on."""

    def __init__(self) -> None:
        self.mode: Any = 0
        self.calls: list[Any] = []

    def set(self, mode: Any) -> None:
        self.calls.append(mode)
        self.mode = mode

    def get(self) -> Any:
        return self.mode

    def hook(self, module: torch.nn.Module, args: Any) -> None:
        if self.mode == "warn":
            torch_op()
        elif self.mode == "error":  # what PyTorch does in sync debug mode "error"
            raise RuntimeError("called a synchronizing CUDA operation")


def profile_flux(pipe: Any, fake: FakeDebugMode, skip: int = 1, steps: int = 4) -> SyncReport:
    hook = pipe.transformer.transformer_blocks[0].register_forward_pre_hook(fake.hook)
    try:
        return _profile(pipe, skip, zoo.call_kwargs("flux", steps=steps), fake.set, fake.get)
    finally:
        hook.remove()


def test_profile_covers_the_steps_after_the_first_and_restores_the_mode() -> None:
    pipe, fake = zoo.tiny_pipeline("flux"), FakeDebugMode()
    report = profile_flux(pipe, fake)
    assert report.steps == (1, 2, 3)
    assert report.per_step() == {1: 1, 2: 1, 3: 1}
    assert [(n, l.file, l.function, l.code) for n, l in report.per_location()] == [(3, __file__, "hook", "torch_op()")]
    assert fake.calls == ["warn", 0, 0]  # on after step 0, off after step 3, and the final restore
    assert registry_names(pipe.transformer) == ()  # the clock attached for the call is gone again


def test_profile_runs_unprofiled_steps_with_the_mode_off_even_if_the_caller_set_error() -> None:
    pipe, fake = zoo.tiny_pipeline("flux"), FakeDebugMode()
    fake.mode = "error"  # e.g. a test suite that fails on any sync; step 0 is not profiled, so it must not raise
    report = profile_flux(pipe, fake)
    assert report.per_step() == {1: 1, 2: 1, 3: 1}
    assert fake.calls == [0, "warn", 0, "error"]  # off for step 0, on for 1..3, off, the caller's mode restored


def test_profiling_does_not_change_the_output() -> None:
    pipe, fake = zoo.tiny_pipeline("flux"), FakeDebugMode()
    stock = pipe(**zoo.call_kwargs("flux", steps=4)).images
    assert torch.equal(profile_flux(pipe, fake).output.images, stock)


def test_profile_with_no_skipped_step_covers_every_step() -> None:
    pipe, fake = zoo.tiny_pipeline("flux"), FakeDebugMode()
    report = profile_flux(pipe, fake, skip=0, steps=3)
    assert report.per_step() == {0: 1, 1: 1, 2: 1}


def test_profile_of_a_hooked_pipeline_keeps_its_handle() -> None:
    pipe, fake = zoo.tiny_pipeline("flux"), FakeDebugMode()
    handle = hookkit.enable(pipe, hookkit.Spec(sync_free=True))
    try:
        listeners = list(handle.scheduler_listeners)
        report = profile_flux(pipe, fake, steps=3)
        assert report.per_step() == {1: 1, 2: 1}
        assert handle.scheduler_listeners == listeners and hookkit.handle_of(pipe) is handle
    finally:
        handle.remove()


def test_profile_refuses_a_handle_on_the_bare_transformer() -> None:
    pipe = zoo.tiny_pipeline("flux")
    handle = hookkit.enable(pipe.transformer, hookkit.Spec())
    try:
        with pytest.raises(UnsupportedError, match="hookkit is enabled on the bare FluxTransformer2DModel"):
            _profile(pipe, 1, zoo.call_kwargs("flux"), FakeDebugMode().set, FakeDebugMode().get)
    finally:
        handle.remove()


class LoopWithoutClock:
    """Pipeline-shaped (`transformer`, `components`) but without a `scheduler`: its loop (another pipeline's) never
    calls a `set_timesteps` hookkit patched, so hookkit sees transformer calls and no denoising steps."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.transformer = inner.transformer
        self.components = {"transformer": inner.transformer}

    def __call__(self, **kwargs: Any) -> Any:
        return self.inner(**kwargs)


def test_profile_refuses_a_loop_whose_steps_hookkit_cannot_see() -> None:
    # a report here would say "0 syncs in steps 1..2" for a loop that was never profiled
    inner, fake = zoo.tiny_pipeline("flux"), FakeDebugMode()
    hook = inner.transformer.transformer_blocks[0].register_forward_pre_hook(fake.hook)
    try:
        with pytest.raises(UnsupportedError, match=r"profile_syncs: expected LoopWithoutClock's call to start its loop "
                                                   r"with pipe.scheduler.set_timesteps .* got a call that never did"):
            _profile(LoopWithoutClock(inner), 1, zoo.call_kwargs("flux", steps=4), fake.set, fake.get)
    finally:
        hook.remove()
    assert fake.calls == [0]  # never switched on; restored
    assert registry_names(inner.transformer) == ()


def test_profile_rejects_a_negative_skip() -> None:
    with pytest.raises(SpecError, match=r"profile_syncs.skip_first_steps: expected an int >= 0, got -1"):
        _profile(zoo.tiny_pipeline("flux"), -1, {}, FakeDebugMode().set, FakeDebugMode().get)


# --- assert_no_host_sync ------------------------------------------------------------------------------------------


def test_assert_no_host_sync_raises_with_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("hookkit.diagnostics.testing.profile_syncs", lambda pipe, skip_first_steps, **kw: synthetic_report())
    with pytest.raises(AssertionError) as info:
        assert_no_host_sync(object())
    assert "6 host syncs in the denoising loop" in str(info.value)
    assert "| 4     | scheduling_ddim_cogvideox.py:392 |" in str(info.value)


def test_assert_no_host_sync_refuses_a_run_with_no_profiled_step(monkeypatch: pytest.MonkeyPatch) -> None:
    empty = SyncReport(pipeline="FluxPipeline", steps=(), events=())
    monkeypatch.setattr("hookkit.diagnostics.testing.profile_syncs", lambda pipe, skip_first_steps, **kw: empty)
    with pytest.raises(AssertionError, match="nothing was profiled; run more than 1 steps"):
        assert_no_host_sync(object())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_profile_syncs_needs_cuda() -> None:
    with pytest.raises(UnsupportedError, match="profile_syncs: expected a CUDA device"):
        profile_syncs(zoo.tiny_pipeline("flux"), **zoo.call_kwargs("flux"))


# --- GPU: the real debug mode -------------------------------------------------------------------------------------


def _cuda_cogvideox() -> Any:
    return zoo.tiny_pipeline("cogvideox").to("cuda")


def _cuda_kwargs() -> dict[str, Any]:
    kw = zoo.call_kwargs("cogvideox", steps=5, use_dynamic_cfg=True)
    kw["prompt_embeds"] = kw["prompt_embeds"].cuda()
    kw["negative_prompt_embeds"] = kw["negative_prompt_embeds"].cuda()
    kw["generator"] = torch.Generator("cuda").manual_seed(0)
    return kw


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_stock_cogvideox_syncs_in_every_step_and_hookkit_in_none() -> None:
    pipe = _cuda_cogvideox()
    stock = profile_syncs(pipe, **_cuda_kwargs())
    assert all(n >= 3 for n in stock.per_step().values())  # t.item(), alphas_cumprod[t], [prev_t] (and prev_t >= 0)
    assert "pipeline_cogvideox.py" in {l.where.split(":")[0] for _, l in stock.per_location()}
    handle = hookkit.enable(pipe, hookkit.Spec(sync_free=True))
    try:
        hooked = assert_no_host_sync(pipe, **_cuda_kwargs())
    finally:
        handle.remove()
    assert torch.equal(stock.output.frames, hooked.output.frames)
