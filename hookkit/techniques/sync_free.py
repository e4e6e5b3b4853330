"""Sync-free denoising loop: the scheduler reads its schedule from the host, not back from the GPU.

Why: a pipeline iterates `scheduler.timesteps` on the GPU and hands each `t` back to the scheduler; wherever
that `t` becomes a host value, the CPU waits for the GPU to drain its queue (CogVideoX's DDIM loop does it
four times a step). Three exact patches, no pipeline or scheduler edited:

1. Step-index search: the scheduler's own `index_for_timestep` runs on host tensors and its result is
   handed to `_init_step_index` as the begin index (and cleared again): the same step index, no device read.
2. CPU tables (`CPU_TABLE_SCHEDULERS`): during `step()` the timestep arguments and `scheduler.timesteps` are
   their host views, so `alphas_cumprod[timestep]` needs no device read.
3. Pipeline reads of `t` between the transformer's exit and `scheduler.step`: a `TorchFunctionMode` answers
   `t.item()`, `float(t)`, `int(t)`, `t.tolist()` from the host copy. It is also closed when the pipeline's
   `with self.progress_bar(...)` block exits (patched on the instance): an exception leaves no mode behind.

A device timestep is mapped only if it is a view of the recorded schedule's storage, unmodified since
(`HostSchedule`), and becomes the same view of a host copy read once per call; anything else is left alone
(stock behaviour). On a CPU pipeline the same mapping runs, which is what the CPU tests check.

    handle = hookkit.enable(pipe, hookkit.Spec(sync_free=True))
    video = pipe(prompt_embeds=..., use_dynamic_cfg=True).frames
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import attrs
import torch
from loguru import logger
from torch.overrides import TorchFunctionMode

from hookkit.core.feature import AttachContext, BaseFeature
from hookkit.core.listeners import SchedulerListener
from hookkit.core.methods import MethodPatch
from hookkit.core.modes import ModeScope
from hookkit.core.plan import Attachment, PlanContext, add_hook
from hookkit.core.registry import Args, Kwargs, ModelHook
from hookkit.core.removal import Removable
from hookkit.core.summary import FeatureSummary, table
from hookkit.errors import SpecError

NAME = "sync_free"
LISTENER = "hookkit.sync_free.scheduler"
STEP_INDEX = "hookkit.sync_free.step_index"
READS_HOOK = "hookkit.sync_free.reads"
LOOP_EXIT = "hookkit.sync_free.loop_exit"

#: Schedulers (exact class names) whose `step()` indexes CPU tables with the timestep it is given, or reads
#: `self.timesteps` back to do so. The other diffusers schedulers index by step (sigmas on the device).
CPU_TABLE_SCHEDULERS: frozenset[str] = frozenset({
    "DDIMScheduler", "DDIMInverseScheduler", "DDIMParallelScheduler", "CogVideoXDDIMScheduler",
    "CogVideoXDPMScheduler", "DDPMScheduler", "DDPMParallelScheduler", "LCMScheduler", "TCDScheduler",
    "UnCLIPScheduler",
})

#: Tensor methods that read a value to the host and are answered from the host copy in the read window.
READS: frozenset[Any] = frozenset({torch.Tensor.item, torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.tolist})

__all__ = ["CPU_TABLE_SCHEDULERS", "FEATURE", "HostSchedule"]


def _version(tensor: torch.Tensor) -> int | None:
    return None if tensor.is_inference() else tensor._version


class HostSchedule:
    """A host copy of the storage behind `scheduler.timesteps` that maps any view of it to the same view on
    the host, exactly, without reading the device (see the module docstring)."""

    def __init__(self, timesteps: torch.Tensor, on_copy: Callable[[], None] | None = None) -> None:
        #: held so that its storage (and so its address) stays this schedule's for the whole call
        self.source = timesteps
        storage = timesteps.untyped_storage()
        self._ptr = storage.data_ptr()
        self._numel = storage.nbytes() // timesteps.element_size()
        self._version = _version(timesteps)
        self._host: torch.Tensor | None = None
        self._on_copy = on_copy

    def host(self) -> torch.Tensor:
        """The whole storage as a 1-D host tensor, read from the device on first use only."""
        if self._host is None:
            whole = torch.as_strided(self.source, (self._numel,), (1,), 0)
            self._host = whole.to("cpu", copy=True)
            if self._on_copy is not None:
                self._on_copy()
        return self._host

    def owns(self, value: Any) -> bool:
        """True iff `value` is a view of the schedule's storage, unmodified since `set_timesteps`."""
        source = self.source
        return (
            isinstance(value, torch.Tensor) and self._numel > 0 and value.dtype == source.dtype
            and value.device == source.device and value.untyped_storage().data_ptr() == self._ptr
            and _version(value) == self._version
        )

    def map(self, value: Any) -> torch.Tensor | None:
        """The host view equal to `value`, or None when `value` is not a view of the schedule."""
        if not self.owns(value):
            return None
        return self.host().as_strided(value.size(), value.stride(), value.storage_offset())


@attrs.define
class SyncStats:
    """Counts since enable (all calls)."""

    #: schedules read to the host (at most one per call)
    host_copies: int = 0
    #: timestep arguments of `step()` given as host views
    mapped_args: int = 0
    #: `step()` calls that saw the host schedule as `scheduler.timesteps`
    host_schedule_steps: int = 0
    #: step-index searches answered on the host
    host_step_index: int = 0
    #: `t.item()` / `float(t)` / `int(t)` / `t.tolist()` answered from the host copy
    host_reads: int = 0


@attrs.define
class _CallSync:
    """Per-call state (in `CallState.features["sync_free"]`)."""

    schedule: HostSchedule | None = None
    #: (device schedule, host view) while `step()` runs with the host schedule
    swapped: tuple[Any, torch.Tensor] | None = None


class TimestepReadMode(TorchFunctionMode):
    """Answers host reads of schedule views (`READS`) from the host copy; everything else passes on."""

    def __init__(self, resolve: Callable[[Any], torch.Tensor | None], on_read: Callable[[], None]) -> None:
        super().__init__()
        self._resolve = resolve
        self._on_read = on_read

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if func in READS and args:
            host = self._resolve(args[0])
            if host is not None:
                self._on_read()
                return func(host, *args[1:], **(kwargs or {}))
        return func(*args, **(kwargs or {}))


class SyncListener(SchedulerListener):
    """The scheduler side: records the schedule, maps `step()` arguments, answers step-index searches."""

    def __init__(self, ctx: AttachContext, cpu_tables: bool) -> None:
        self.ctx = ctx
        self.cpu_tables = cpu_tables
        self.stats = SyncStats()
        self.window = ModeScope(TimestepReadMode(self._map, self._count_read))

    # -- per call ---------------------------------------------------------------------------------------
    def _call(self) -> _CallSync:
        return self.ctx.state.feature(NAME, _CallSync)

    def _map(self, value: Any) -> torch.Tensor | None:
        schedule = self._call().schedule
        return schedule.map(value) if schedule is not None else None

    def _count_read(self) -> None:
        self.stats.host_reads += 1

    def _count_copy(self) -> None:
        self.stats.host_copies += 1

    def in_loop(self) -> bool:
        """True between `set_timesteps` and the last `step()` of a pipeline call with a recorded schedule."""
        state = self.ctx.state
        call: _CallSync | None = state.features.get(NAME)
        return (call is not None and call.schedule is not None and state.num_steps is not None
                and state.step < state.num_steps)

    def host_value(self, value: Any) -> Any:
        """`value` as the host sees it without a device read (a number, a host tensor), or None.

        A view of the schedule is mapped before a CPU tensor is taken as it is, so that a CPU pipeline runs
        the same path (and the same host copy) as a GPU one: the CPU tests check what runs on the GPU.
        """
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
        mapped = self._map(value)
        if mapped is not None:
            return mapped
        if isinstance(value, torch.Tensor) and value.device.type == "cpu":
            return value
        return None

    # -- SchedulerListener ------------------------------------------------------------------------------
    def after_set_timesteps(self, scheduler: Any) -> None:
        self.window.close()
        call = self._call()
        timesteps = getattr(scheduler, "timesteps", None)
        if isinstance(timesteps, torch.Tensor) and timesteps.numel() > 0:
            call.schedule = HostSchedule(timesteps, on_copy=self._count_copy)
            if self.cpu_tables:  # every step needs it: read it now, before the loop has queued GPU work
                call.schedule.host()

    def before_step(self, scheduler: Any, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        self.window.close()
        call = self._call()
        if not self.cpu_tables or call.schedule is None:
            return args, kwargs
        args = tuple(self._host_arg(call.schedule, a) for a in args)
        kwargs = {k: self._host_arg(call.schedule, v) for k, v in kwargs.items()}
        device_schedule = scheduler.__dict__.get("timesteps")
        host_schedule = call.schedule.map(device_schedule)
        if host_schedule is not None:
            scheduler.timesteps = host_schedule
            call.swapped = (device_schedule, host_schedule)
            self.stats.host_schedule_steps += 1
        return args, kwargs

    def after_step(self, scheduler: Any) -> None:
        call: _CallSync | None = self.ctx.state.features.get(NAME)
        if call is not None and call.swapped is not None:
            device_schedule, host_schedule = call.swapped
            call.swapped = None
            if scheduler.__dict__.get("timesteps") is host_schedule:
                scheduler.timesteps = device_schedule

    def _host_arg(self, schedule: HostSchedule, value: Any) -> Any:
        host = schedule.map(value)
        if host is None:
            return value
        self.stats.mapped_args += 1
        return host

    # -- step-index search ------------------------------------------------------------------------------
    def host_step_index(self, scheduler: Any, timestep: Any) -> int | None:
        """The index `_init_step_index` would search for, found on the host; None to let it search itself."""
        if scheduler.begin_index is not None:
            return None
        value = self.host_value(timestep)
        schedule = self.host_value(getattr(scheduler, "timesteps", None))
        if value is None or schedule is None:
            return None
        self.stats.host_step_index += 1
        return int(scheduler.index_for_timestep(value, schedule_timesteps=schedule))


def searches_step_index(scheduler: Any) -> bool:
    """True when the scheduler finds its step index by value (`_init_step_index` + `index_for_timestep` that
    takes `schedule_timesteps`) and has a settable begin index."""
    init = getattr(scheduler, "_init_step_index", None)
    find = getattr(scheduler, "index_for_timestep", None)
    if not callable(init) or not callable(find) or not callable(getattr(scheduler, "set_begin_index", None)):
        return False
    if not isinstance(getattr(type(scheduler), "begin_index", None), property):
        return False
    try:
        return "schedule_timesteps" in inspect.signature(find).parameters
    except (TypeError, ValueError):
        return False


class SyncReadsHook(ModelHook):
    """On the transformer: closes the read window at entry, opens it at exit while a denoising loop runs."""

    def __init__(self, listener: SyncListener) -> None:
        self.listener = listener

    def pre_forward(self, module: torch.nn.Module, args: Args, kwargs: Kwargs) -> tuple[Args, Kwargs]:
        self.listener.window.close()
        return args, kwargs

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        if self.listener.in_loop() and not torch.compiler.is_compiling():
            self.listener.window.open()
        return output

    def on_detach(self, module: torch.nn.Module) -> None:
        self.listener.window.close()


class _LoopBar:
    """The pipeline's progress bar, unchanged, whose `with` exit (the end of the denoising loop, also by an
    exception) closes the read window first."""

    def __init__(self, bar: Any, on_exit: Callable[[], None]) -> None:
        self._bar = bar
        self._on_exit = on_exit

    def __enter__(self) -> Any:
        return self._bar.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        try:
            self._on_exit()
        finally:
            return self._bar.__exit__(*exc)

    def __iter__(self) -> Any:
        return iter(self._bar)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bar, name)


# --- feature ---------------------------------------------------------------------------------------------------


class _SyncFreeFeature(BaseFeature):
    """Plugs the sync-free loop into `hookkit.enable`: `Spec.sync_free`."""

    name = NAME
    spec_class = bool

    def plan(self, ctx: PlanContext) -> list[Attachment]:
        scheduler = getattr(ctx.pipeline, "scheduler", None) if ctx.pipeline is not None else None
        if scheduler is None:
            got = f"a bare {type(ctx.transformer).__name__}" if ctx.pipeline is None else \
                f"a {type(ctx.pipeline).__name__} without a scheduler"
            raise SpecError(f"Spec.sync_free: expected a pipeline with a scheduler (the feature acts on the scheduler "
                            f"and the denoising loop), got {got}. Enable hookkit on the pipeline, or leave sync_free off.")
        if not ctx.scheduler_owner:
            # a pipeline's second transformer (Wan 2.2): the scheduler is the first one's to patch; this one only
            # closes the listener's read window around its own calls
            return [Attachment(feature=NAME, target="", name=READS_HOOK)]
        cpu_tables = type(scheduler).__name__ in CPU_TABLE_SCHEDULERS and type(scheduler).__module__.startswith("diffusers.")
        out = [Attachment(feature=NAME, target="pipeline.scheduler", name=LISTENER, params=(("cpu_tables", cpu_tables),))]
        if searches_step_index(scheduler):
            out.append(Attachment(feature=NAME, target="pipeline.scheduler._init_step_index", name=STEP_INDEX))
        out.append(Attachment(feature=NAME, target="", name=READS_HOOK))
        if callable(getattr(ctx.pipeline, "progress_bar", None)):
            out.append(Attachment(feature=NAME, target="pipeline.progress_bar", name=LOOP_EXIT))
        return out

    def attach(self, ctx: AttachContext, attachment: Attachment) -> Removable:
        if attachment.name == LISTENER:
            listener = ctx.keep(SyncListener(ctx, cpu_tables=attachment.param("cpu_tables", False)))
            logger.info("sync_free: {} (CPU tables mapped: {})", type(ctx.pipeline.scheduler).__name__,
                        listener.cpu_tables)
            return _SyncListenerRemoval(ctx.add_listener(listener), listener)
        # a pipeline's second transformer uses the listener of the first (which patched the scheduler)
        listener = ctx.kept() or ctx.owner_kept()
        if attachment.name == READS_HOOK:
            # right after the clock: the window closes before, and opens after, every other transformer hook
            return add_hook(ctx.transformer, READS_HOOK, SyncReadsHook(listener), position=1)
        if attachment.name == LOOP_EXIT:
            def make_bar(original: Callable[..., Any]) -> Callable[..., Any]:
                def progress_bar(*args: Any, **kwargs: Any) -> Any:
                    return _LoopBar(original(*args, **kwargs), listener.window.close)
                return progress_bar
            return MethodPatch(ctx.pipeline, "progress_bar", make_bar)
        scheduler = ctx.pipeline.scheduler

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def _init_step_index(timestep: Any, *args: Any, **kwargs: Any) -> Any:
                index = listener.host_step_index(scheduler, timestep)
                if index is None:
                    return original(timestep, *args, **kwargs)
                scheduler.set_begin_index(index)
                try:
                    return original(timestep, *args, **kwargs)
                finally:
                    scheduler.set_begin_index(None)
            return _init_step_index

        return MethodPatch(scheduler, "_init_step_index", make)

    def summarize(self, ctx: AttachContext) -> FeatureSummary | None:
        listener: SyncListener | None = ctx.kept()
        if listener is None:
            return None
        stats = attrs.asdict(listener.stats)
        data = {"scheduler": type(ctx.pipeline.scheduler).__name__, "cpu_tables": listener.cpu_tables,
                "step_index_search": any(a.name == STEP_INDEX for a in ctx.attachments()), **stats}
        text = table(
            ["scheduler", "CPU tables", "schedule reads", "args mapped", "steps on host schedule", "step index on host",
             "t reads on host"],
            [[data["scheduler"], "mapped" if listener.cpu_tables else "-", stats["host_copies"], stats["mapped_args"],
              stats["host_schedule_steps"], stats["host_step_index"], stats["host_reads"]]],
        )
        return FeatureSummary(name=NAME, data=data, text=text)


class _SyncListenerRemoval:
    """Closes the read window, then takes the listener out of the scheduler patches."""

    def __init__(self, removal: Removable, listener: SyncListener) -> None:
        self._removal = removal
        self._listener = listener

    def remove(self) -> None:
        self._listener.window.close()
        self._removal.remove()


FEATURE = _SyncFreeFeature()
