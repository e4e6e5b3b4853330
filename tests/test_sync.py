"""Sync-free loop: step() and the pipeline get host timesteps, outputs do not change, nothing is left behind.

On the CPU the schedule already lives on the host, so there is no sync to save; the mapping runs anyway
(a host copy, views of it handed to the scheduler), and these tests check that it runs exactly where it
should (counts) and changes nothing (bitwise-equal latents against stock).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import diffusers
import pytest
import torch

import hookkit
from hookkit.tools import zoo
from hookkit.errors import SpecError
from hookkit.core.registry import registry_names
from hookkit.techniques.sync_free import (
    CPU_TABLE_SCHEDULERS,
    HostSchedule,
    TimestepReadMode,
)


def cog_kwargs(steps: int = 4, **extra: Any) -> dict[str, Any]:
    return zoo.call_kwargs("cogvideox", steps=steps, **extra)


def cog_with(scheduler_cls: type | None = None) -> Any:
    pipe = zoo.tiny_pipeline("cogvideox")
    if scheduler_cls is not None:
        pipe.scheduler = scheduler_cls.from_config(pipe.scheduler.config)
    return pipe


def stock_and_hooked(pipe: Any, kwargs: Callable[[], dict[str, Any]],
                     spec: hookkit.Spec | None = None) -> tuple[Any, Any, dict[str, Any]]:
    """Latents of a stock run and of a hooked run, and the sync feature's summary data."""
    stock = _latents(pipe(**kwargs()))
    handle = hookkit.enable(pipe, spec or hookkit.Spec(sync_free=True))
    try:
        hooked = _latents(pipe(**kwargs()))
        data = handle.summary().features["sync_free"].data
    finally:
        handle.remove()
    return stock, hooked, data


def _latents(output: Any) -> torch.Tensor:
    return output.frames if hasattr(output, "frames") else output.images


def read_window_open() -> bool:
    return any(isinstance(m, TimestepReadMode) for m in torch.overrides._get_current_function_mode_stack())


def dict_snapshot(obj: Any) -> dict[str, Any]:
    return dict(obj.__dict__)


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Same keys, equal values (tensors bitwise)."""
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


# --- HostSchedule --------------------------------------------------------------------------------------------


def test_host_schedule_maps_views_to_equal_host_views() -> None:
    timesteps = torch.tensor([999, 749, 499, 249])
    schedule = HostSchedule(timesteps)
    for view in (timesteps[2], timesteps[1:], timesteps[3].expand(2), timesteps[::2]):
        host = schedule.map(view)
        assert host is not None and host.untyped_storage().data_ptr() != timesteps.untyped_storage().data_ptr()
        assert torch.equal(host, view) and host.shape == view.shape and host.dtype == view.dtype


def test_host_schedule_reads_the_device_once() -> None:
    timesteps = torch.tensor([3.0, 2.0, 1.0])
    copies = []
    schedule = HostSchedule(timesteps, on_copy=lambda: copies.append(1))
    for t in timesteps:
        schedule.map(t)
    assert copies == [1]


def test_host_schedule_leaves_everything_else_alone() -> None:
    timesteps = torch.tensor([999, 749, 499])
    schedule = HostSchedule(timesteps)
    assert schedule.map(timesteps[0].clone()) is None          # equal value, other storage
    assert schedule.map(timesteps[0].to(torch.int32)) is None  # computed from a timestep
    assert schedule.map(999) is None and schedule.map(None) is None
    timesteps.add_(0)  # modified in place since set_timesteps: its version moved
    assert schedule.map(timesteps[0]) is None


# --- CPU-table schedulers: bitwise equal, mapped exactly where expected -----------------------------------------


def test_cogvideox_dynamic_cfg_is_bitwise_equal_and_every_read_is_on_the_host() -> None:
    pipe = cog_with()
    stock, hooked, data = stock_and_hooked(pipe, lambda: cog_kwargs(use_dynamic_cfg=True))
    assert torch.equal(stock, hooked)
    assert data["scheduler"] == "CogVideoXDDIMScheduler" and data["cpu_tables"] is True
    # 4 steps: step(noise_pred, t, ...) gets t on the host 4 times, runs 4 times with the host schedule;
    # the pipeline's t.item() (dynamic CFG) is answered from the host copy 4 times; one schedule read
    assert (data["host_copies"], data["mapped_args"], data["host_schedule_steps"], data["host_reads"]) == (1, 4, 4, 4)
    assert data["host_step_index"] == 0


def test_ddim_pipeline_is_bitwise_equal() -> None:
    pipe = cog_with(diffusers.DDIMScheduler)
    stock, hooked, data = stock_and_hooked(pipe, cog_kwargs)
    assert torch.equal(stock, hooked)
    assert (data["scheduler"], data["mapped_args"], data["host_schedule_steps"], data["host_reads"]) == ("DDIMScheduler", 4, 4, 0)


def test_cogvideox_dpm_gets_both_timesteps_on_the_host() -> None:
    pipe = cog_with(diffusers.CogVideoXDPMScheduler)
    stock, hooked, data = stock_and_hooked(pipe, cog_kwargs)
    assert torch.equal(stock, hooked)
    # step(..., t, timesteps[i - 1] if i > 0 else None, ...): 4 current + 3 previous timesteps
    assert data["mapped_args"] == 7


@pytest.mark.parametrize("scheduler_cls", [
    diffusers.DDPMScheduler, diffusers.DDPMParallelScheduler, diffusers.DDIMParallelScheduler,
    diffusers.DDIMInverseScheduler, diffusers.LCMScheduler, diffusers.TCDScheduler,
])
def test_other_cpu_table_schedulers_are_bitwise_equal(scheduler_cls: type) -> None:
    assert scheduler_cls.__name__ in CPU_TABLE_SCHEDULERS
    stock, hooked, data = stock_and_hooked(cog_with(scheduler_cls), cog_kwargs)
    assert torch.equal(stock, hooked)
    assert data["mapped_args"] == 4 and data["host_schedule_steps"] == 4


def test_unclip_scheduler_driven_by_hand_is_bitwise_equal() -> None:
    # UnCLIPScheduler has no `order`, which CogVideoXPipeline reads: drive the hooked scheduler directly
    def loop(scheduler: Any) -> torch.Tensor:
        g = torch.Generator().manual_seed(0)
        sample = torch.randn(1, 4, generator=g)
        scheduler.set_timesteps(4)
        for t in scheduler.timesteps:
            sample = scheduler.step(torch.sin(sample * t), t, sample, generator=g).prev_sample
        return sample

    pipe = cog_with(diffusers.UnCLIPScheduler)
    stock = loop(pipe.scheduler)
    handle = hookkit.enable(pipe, hookkit.Spec(sync_free=True))
    try:
        hooked = loop(pipe.scheduler)
        data = handle.summary().features["sync_free"].data
    finally:
        handle.remove()
    assert torch.equal(stock, hooked)
    assert data["mapped_args"] == 4


def test_step_gets_back_the_device_schedule_after_each_step() -> None:
    pipe = cog_with(diffusers.LCMScheduler)  # step() reads self.timesteps[step_index + 1]
    handle = hookkit.enable(pipe, hookkit.Spec(sync_free=True))
    seen: list[bool] = []

    def callback(p: Any, i: int, t: torch.Tensor, kw: dict[str, Any]) -> dict[str, Any]:
        seen.append(p.scheduler.timesteps is handle.state.features["sync_free"].schedule.source)
        return {}

    try:
        pipe(**cog_kwargs(callback_on_step_end=callback))
    finally:
        handle.remove()
    assert seen == [True] * 4


# --- step-index search ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheduler_cls", [diffusers.DPMSolverMultistepScheduler, diffusers.EulerDiscreteScheduler,
                                           diffusers.UniPCMultistepScheduler])
def test_step_index_search_is_answered_on_the_host_and_bitwise_equal(scheduler_cls: type) -> None:
    pipe = cog_with(scheduler_cls)  # CogVideoXPipeline does not call set_begin_index
    stock, hooked, data = stock_and_hooked(pipe, cog_kwargs)
    assert torch.equal(stock, hooked)
    assert data["cpu_tables"] is False and data["host_step_index"] == 1 and data["mapped_args"] == 0
    # the search ran on the host copy of the schedule (on the CPU too: the path a GPU takes)
    assert data["host_copies"] == 1
    assert pipe.scheduler.begin_index is None  # as stock leaves it


def test_pipeline_that_sets_the_begin_index_itself_is_left_to_it() -> None:
    pipe = zoo.tiny_pipeline("flux")  # FluxPipeline calls scheduler.set_begin_index(0)
    stock, hooked, data = stock_and_hooked(pipe, lambda: zoo.call_kwargs("flux", steps=3))
    assert torch.equal(stock, hooked)
    assert data["host_step_index"] == 0 and data["host_copies"] == 0


def _first_step_index(scheduler: Any, first: int, sigmas: list[float] | None = None) -> int:
    if sigmas is None:
        scheduler.set_timesteps(4)
    else:
        scheduler.set_timesteps(sigmas=sigmas)
    sample = torch.zeros(1, 2)
    scheduler.step(torch.zeros(1, 2), scheduler.timesteps[first], sample)
    return scheduler.step_index


@pytest.mark.parametrize(("first", "sigmas", "expected"), [
    (0, None, 1),                  # stock: first step at timesteps[0]; step_index is 1 after it
    (2, None, 3),                  # starts mid-schedule without set_begin_index: set_begin_index(0) would be wrong
    (0, [1.0, 1.0, 0.5, 0.25], 2),  # repeated first timestep: stock takes the second match
])
def test_host_search_finds_what_the_device_search_finds(first: int, sigmas: list[float] | None, expected: int) -> None:
    stock_pipe, hooked_pipe = zoo.tiny_pipeline("flux"), zoo.tiny_pipeline("flux")
    handle = hookkit.enable(hooked_pipe, hookkit.Spec(sync_free=True))
    try:
        assert _first_step_index(stock_pipe.scheduler, first, sigmas) == expected
        assert _first_step_index(hooked_pipe.scheduler, first, sigmas) == expected
        data = handle.summary().features["sync_free"].data
        assert (data["host_step_index"], data["host_copies"]) == (1, 1)
        assert hooked_pipe.scheduler.begin_index is None
    finally:
        handle.remove()


# --- other pipelines, memo together ----------------------------------------------------------------------------


def test_qwenimage_with_memo_and_sync_free_is_bitwise_equal() -> None:
    pipe = zoo.tiny_pipeline("qwenimage", zero_cond_t=True)
    stock, hooked, data = stock_and_hooked(pipe, lambda: zoo.call_kwargs("qwenimage", steps=3),
                                           hookkit.Spec(memo=True, sync_free=True))
    assert torch.equal(stock, hooked)
    assert data["scheduler"] == "FlowMatchEulerDiscreteScheduler" and data["host_copies"] == 0


# --- scope and removal -------------------------------------------------------------------------------------------


def test_read_window_is_closed_after_the_call_and_outside_the_loop() -> None:
    pipe = cog_with()
    handle = hookkit.enable(pipe, hookkit.Spec(sync_free=True))
    try:
        pipe(**cog_kwargs(use_dynamic_cfg=True))
        assert read_window_open() is False
        kw = cog_kwargs()
        latents = torch.zeros(1, 3, 4, 4, 4)
        pipe.transformer(hidden_states=latents, encoder_hidden_states=kw["prompt_embeds"],
                         timestep=torch.tensor([999]), return_dict=False)  # a call outside any loop
        assert read_window_open() is False
    finally:
        handle.remove()


def test_plan_of_a_cpu_table_scheduler_and_of_a_searching_scheduler() -> None:
    cog = hookkit.build_plan(cog_with(), hookkit.Spec(sync_free=True))
    assert cog.targets("sync_free") == [("pipeline.scheduler", "hookkit.sync_free.scheduler"), ("", "hookkit.sync_free.reads"),
                                        ("pipeline.progress_bar", "hookkit.sync_free.loop_exit")]
    assert [a.params for a in cog.attachments if a.feature == "sync_free"][0] == (("cpu_tables", True),)
    flux = hookkit.build_plan(zoo.tiny_pipeline("flux"), hookkit.Spec(sync_free=True))
    assert flux.targets("sync_free") == [("pipeline.scheduler", "hookkit.sync_free.scheduler"),
                                         ("pipeline.scheduler._init_step_index", "hookkit.sync_free.step_index"),
                                         ("", "hookkit.sync_free.reads"),
                                         ("pipeline.progress_bar", "hookkit.sync_free.loop_exit")]


def test_removal_restores_the_scheduler_and_transformer_exactly() -> None:
    pipe = cog_with(diffusers.EulerDiscreteScheduler)
    scheduler_before = dict_snapshot(pipe.scheduler)
    transformer_before = dict_snapshot(pipe.transformer)
    handle = hookkit.enable(pipe, hookkit.Spec(sync_free=True))
    handle.remove()
    assert dict_snapshot(pipe.scheduler).keys() == scheduler_before.keys()
    assert all(pipe.scheduler.__dict__[k] is v for k, v in scheduler_before.items())
    assert dict_snapshot(pipe.transformer).keys() == transformer_before.keys()
    assert registry_names(pipe.transformer) == ()


def test_scheduler_after_a_hooked_call_is_in_the_state_a_stock_call_leaves() -> None:
    stock_pipe, hooked_pipe = cog_with(diffusers.EulerDiscreteScheduler), cog_with(diffusers.EulerDiscreteScheduler)
    stock_pipe(**cog_kwargs())
    handle = hookkit.enable(hooked_pipe, hookkit.Spec(sync_free=True))
    hooked_pipe(**cog_kwargs())
    handle.remove()
    assert_same_state(dict_snapshot(stock_pipe.scheduler), dict_snapshot(hooked_pipe.scheduler))


def test_bare_transformer_is_refused() -> None:
    with pytest.raises(SpecError, match=r"Spec.sync_free: expected a pipeline with a scheduler"):
        hookkit.enable(zoo.tiny_transformer("cogvideox"), hookkit.Spec(sync_free=True))
