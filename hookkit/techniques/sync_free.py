"""Sync-free denoising loop: the scheduler reads its schedule from the host, not back from the GPU.

Why: a pipeline iterates `scheduler.timesteps`, which lives on the GPU, and hands each `t` back to the
scheduler. Wherever the scheduler (or the pipeline) turns that `t` into a host value, the CPU waits until the
GPU has drained its queue. CogVideoX with its DDIM scheduler does it four times a step: 79 stalls in 20 steps
(seed 003). No pipeline or scheduler is edited here; three patches, each exact:

1. Step-index search. A scheduler whose begin index is not set finds its step index by value
   (`_init_step_index` -> `index_for_timestep`: `(timesteps == t).nonzero()` ... `.item()`), on the device.
   hookkit runs the scheduler's own `index_for_timestep` on host tensors instead, hands the result to
   `_init_step_index` as the begin index and clears it again: the same step index, the same scheduler state
   afterwards, no device read. Unlike a blanket `set_begin_index(0)`, this is also right for a pipeline that
   starts mid-schedule without telling the scheduler, and keeps the "second match" rule for repeated values.
2. CPU tables. Schedulers that index CPU tables (`alphas_cumprod[timestep]`) in `step()`
   (`CPU_TABLE_SCHEDULERS`) get, during `step()`, the host view of each timestep argument and of
   `scheduler.timesteps`. Same values, so the same table entries; nothing is copied back from the GPU.
3. Pipeline reads of `t`. Between the transformer's exit and `scheduler.step` (where CogVideoX's dynamic
   CFG calls `t.item()`), a `TorchFunctionMode` answers `t.item()`, `float(t)`, `int(t)` and `t.tolist()`
   from the host copy. Outside that window nothing is intercepted.

How a device timestep is mapped without reading the device: at `set_timesteps` hookkit records
`scheduler.timesteps` (and keeps it alive). Every timestep a pipeline iterates is a view of that tensor's
storage (`for t in timesteps`, `timesteps[i - 1]`, `timesteps[t_start:]`). `HostSchedule.map(t)` accepts `t`
only if it is such a view (same storage, dtype, device) and the storage is unmodified since (version
counter), and returns the same view (size, stride, offset) of a host copy of the storage, read from the
device once per call. Anything else (a tensor computed from a timestep, a Python number) is left alone,
which is stock behaviour. On a CPU pipeline there is nothing to save; the mapping still runs (that is what
the CPU tests check).

Reading the schedule costs one device read per call: right after `set_timesteps`, before the loop, for the
CPU-table schedulers (they need it every step); at first need otherwise. Limits: the window of (3) covers
the code between the transformer and `scheduler.step` only; a read elsewhere in the loop (e.g. before the
transformer call) is not mapped. An exception raised inside that window leaves a pass-through mode on the
thread's mode stack until the next transformer call, `set_timesteps`, or removal.

    handle = hookkit.enable(pipe, hookkit.Spec(sync_free=True))   # or apply_sync_free(pipe)
    video = pipe(prompt_embeds=..., use_dynamic_cfg=True).frames
    print(handle.summary())
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
import torch
from loguru import logger
from torch.overrides import TorchFunctionMode

from hookkit.errors import SpecError
from hookkit.core.handle import SchedulerListener
from hookkit.techniques.memo import ModeScope
from hookkit.core.methods import MethodPatch
from hookkit.core.registry import Args, Kwargs, ModelHook
from hookkit.core.plan import Attachment, PlanContext, Removable, add_hook
from hookkit.spec import Spec
from hookkit.core.summary import FeatureSummary, table

if TYPE_CHECKING:
    from hookkit.core.handle import Handle

NAME = "sync"
LISTENER = "hookkit.sync.scheduler"
STEP_INDEX = "hookkit.sync.step_index"
READS_HOOK = "hookkit.sync.reads"

#: Schedulers (exact class names) whose `step()` indexes CPU tables with the timestep it is given, or reads
#: `self.timesteps` back to do so. The other diffusers schedulers index by step (sigmas on the device).
CPU_TABLE_SCHEDULERS: frozenset[str] = frozenset({
    "DDIMScheduler", "DDIMInverseScheduler", "DDIMParallelScheduler", "CogVideoXDDIMScheduler",
    "CogVideoXDPMScheduler", "DDPMScheduler", "DDPMParallelScheduler", "LCMScheduler", "TCDScheduler",
    "UnCLIPScheduler",
})

#: Tensor methods that read a value to the host and are answered from the host copy in the read window.
READS: frozenset[Any] = frozenset({torch.Tensor.item, torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.tolist})

__all__ = ["CPU_TABLE_SCHEDULERS", "FEATURE", "HostSchedule", "apply_sync_free"]


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
    """Per-call state (in `handle.state.features["sync"]`)."""

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

    def __init__(self, handle: Handle, cpu_tables: bool) -> None:
        self.handle = handle
        self.cpu_tables = cpu_tables
        self.stats = SyncStats()
        self.window = ModeScope(TimestepReadMode(self._map, self._count_read))

    # -- per call ---------------------------------------------------------------------------------------
    def _call(self) -> _CallSync:
        return self.handle.state.feature(NAME, _CallSync)

    def _map(self, value: Any) -> torch.Tensor | None:
        schedule = self._call().schedule
        return schedule.map(value) if schedule is not None else None

    def _count_read(self) -> None:
        self.stats.host_reads += 1

    def _count_copy(self) -> None:
        self.stats.host_copies += 1

    def in_loop(self) -> bool:
        """True between `set_timesteps` and the last `step()` of a pipeline call with a recorded schedule."""
        state = self.handle.state
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
        call: _CallSync | None = self.handle.state.features.get(NAME)
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


class _ListenerRemoval:
    def __init__(self, handle: Handle, listener: SyncListener) -> None:
        self.handle: Handle | None = handle
        self.listener = listener

    def remove(self) -> None:
        if self.handle is None:
            return
        self.listener.window.close()
        if self.listener in self.handle.scheduler_listeners:
            self.handle.scheduler_listeners.remove(self.listener)
        self.handle = None


# --- feature ---------------------------------------------------------------------------------------------------


class _SyncFeature:
    """Plugs the sync-free loop into `hookkit.enable`: `Spec.sync_free`."""

    name = NAME
    fields = ("sync_free",)

    def enabled(self, spec: Spec) -> bool:
        return spec.sync_free

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
        return out

    def attach(self, handle: Handle, attachment: Attachment) -> Removable:
        if attachment.name == LISTENER:
            listener = handle.resources[NAME] = SyncListener(handle, cpu_tables=attachment.param("cpu_tables", False))
            handle.scheduler_listeners.append(listener)
            logger.info("sync: {} (CPU tables mapped: {})", type(handle.pipeline.scheduler).__name__, listener.cpu_tables)
            return _ListenerRemoval(handle, listener)
        listener = handle.resources.get(NAME) or handle.primary.resources[NAME]
        if attachment.name == READS_HOOK:
            # right after the clock: the window closes before, and opens after, every other transformer hook
            return add_hook(handle.transformer, READS_HOOK, SyncReadsHook(listener), position=1)
        scheduler = handle.pipeline.scheduler

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

    def summarize(self, handle: Handle) -> FeatureSummary | None:
        listener: SyncListener | None = handle.resources.get(NAME)
        if listener is None:
            return None
        stats = attrs.asdict(listener.stats)
        data = {"scheduler": type(handle.pipeline.scheduler).__name__, "cpu_tables": listener.cpu_tables,
                "step_index_search": any(a.name == STEP_INDEX for a in handle.plan.attachments), **stats}
        text = table(
            ["scheduler", "CPU tables", "schedule reads", "args mapped", "steps on host schedule", "step index on host",
             "t reads on host"],
            [[data["scheduler"], "mapped" if listener.cpu_tables else "-", stats["host_copies"], stats["mapped_args"],
              stats["host_schedule_steps"], stats["host_step_index"], stats["host_reads"]]],
        )
        return FeatureSummary(name=NAME, data=data, text=text)


FEATURE = _SyncFeature()


def apply_sync_free(pipe: Any) -> Handle:
    """Make `pipe`'s denoising loop sync-free; returns the handle (`.remove()` undoes it).

    Same as `hookkit.enable(pipe, hookkit.Spec(sync_free=True))`: the feature needs the per-call clock and the
    scheduler patches that `enable` installs.
    """
    from hookkit.core.handle import enable

    return enable(pipe, Spec(sync_free=True))
