"""The `Handle` that `hookkit.enable` hands out, and the enable / disable machinery over a feature table.

`enable_with`: resolve the adapter (exact class), apply the compat table, build the plan (pure data) from
the features of a `FeatureTable`, attach it all or nothing (`hookkit.enable` passes the shipped table).
The handle owns every removable and the per-call state; `remove()` undoes everything in reverse order,
after which the pipeline is exactly as before (its output bitwise equal to a never-hooked run).

Where a generation starts: a pipeline calls `scheduler.set_timesteps` once per call, before the first transformer
call; hookkit patches that method *on the scheduler instance* (never the class) and starts a fresh `CallState` there,
`ended` once that `__call__` returned, also early (an interrupt, an exception). `scheduler.step` ends a step. A
pipeline that starts part-way (img2img: `set_begin_index`) gets the number of steps that run as `num_steps`, settled
at the first transformer call. A bare transformer has no scheduler: use `with handle.generation(): ...`.

Several transformers (Wan 2.2 `transformer_2`): one handle each, grouped under the first (`enable` returns it),
whose scheduler patches drive every clock of the group: the pipeline's step, the CFG branch per transformer.

One call at a time per handle: a pipeline call that starts (`set_timesteps`) while another call of the same
pipeline (or of one sharing its scheduler) is still running, from another thread or from inside its own loop (a
callback), is refused at once with a `HookError`, and so is a transformer call from another thread while a call runs.
Two pipelines, each with its own handle, run in two threads as stock diffusers does.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import attrs
import torch
from loguru import logger

from hookkit.adapters import AdapterSpec, resolve_adapter
from hookkit.core import compat
from hookkit.core.feature import AttachContext, Feature, FeatureTable, requested
from hookkit.core.listeners import SchedulerListener
from hookkit.core.methods import MethodPatch
from hookkit.core.plan import AnySpec, Attachment, Plan, PlanContext, add_hook, module_at
from hookkit.core.registry import HookRegistry, ModelHook
from hookkit.core.removal import Removable
from hookkit.core import firstcall
from hookkit.core.graphs import EagerCalls
from hookkit.core.state import CallState, Clock
from hookkit.core.validate import is_int
from hookkit.core.summary import FeatureSummary, HookRow, Summary
from hookkit.errors import AdapterError, EnableError, HookError, HookkitError, SpecError, UnsupportedError

__all__ = ["CLOCK_HOOK", "Handle", "SchedulerListener", "disable", "enable_with", "handle_of", "plan_for"]

CLOCK_HOOK = "hookkit.clock"


class _ClockHook(ModelHook):
    """Outermost hook on the transformer: counts calls into steps and branches; marks "enabled"; runs the
    first-call check of the adapter (`hookkit.core.firstcall`) around the calls until it passed."""

    replaces_forward = True

    def __init__(self, handle: Handle) -> None:
        self.handle = handle

    def new_forward(self, module: torch.nn.Module, call_next: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        self.handle._on_transformer_call(args, kwargs)
        check = self.handle.first_call
        if check is not None and check.armed:
            return check.run(call_next, args, kwargs)
        return call_next(*args, **kwargs)


def _start_in_schedule(scheduler: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """Where a loop that sliced `scheduler.timesteps` without `set_begin_index` starts (video-to-video pipelines:
    `timesteps[t_start * order:]`), read without touching the device: the first call's timestep argument is a view
    of the schedule's storage (`t.expand(batch)`), and its offset in that storage is the index."""
    timesteps = getattr(scheduler, "timesteps", None)
    if not isinstance(timesteps, torch.Tensor) or timesteps.dim() != 1 or timesteps.numel() == 0:
        return None
    storage = timesteps.untyped_storage().data_ptr()
    for value in (*args, *kwargs.values()):
        if (isinstance(value, torch.Tensor) and value.device == timesteps.device and value.dtype == timesteps.dtype
                and value.untyped_storage().data_ptr() == storage):
            offset = value.storage_offset() - timesteps.storage_offset()
            return offset if 0 <= offset < timesteps.numel() else None
    return None


def _call_code(pipeline: Any) -> Any:
    """The code object of `type(pipeline).__call__` itself (diffusers wraps it in `torch.no_grad()`)."""
    call = getattr(type(pipeline), "__call__", None)
    try:
        return inspect.unwrap(call).__code__ if call is not None else None
    except (AttributeError, ValueError):
        return None


def _pipeline_frame(pipeline: Any, start: FrameType | None) -> FrameType | None:
    """The innermost frame from `start` outwards that runs `pipeline.__call__` (for that very pipeline), or None."""
    code = _call_code(pipeline)
    frame = start
    while frame is not None and code is not None:
        if frame.f_code is code and frame.f_locals.get("self") is pipeline:
            return frame
        frame = frame.f_back
    return None


def _scheduler_call_frame(pipeline: Any, scheduler: Any, start: FrameType | None) -> tuple[FrameType | None, Any]:
    """The innermost frame from `start` outwards that runs a pipeline's `__call__` on `scheduler`, and that pipeline:
    `pipeline` itself, or another one sharing its scheduler (`Pipeline(**pipe.components)`, `from_pipe`), whose calls
    start generations of the handle as well. (None, None) for a loop outside any pipeline's `__call__`."""
    frame = start
    while frame is not None:
        if frame.f_code.co_name == "__call__":
            caller = frame.f_locals.get("self")
            if ((caller is pipeline or getattr(caller, "__dict__", {}).get("scheduler") is scheduler)
                    and frame.f_code is _call_code(caller)):
                return frame, caller
        frame = frame.f_back
    return None, None


def _on_stack(thread: int, frame_id: int, code: Any, self_id: int | None = None) -> bool:
    """Whether the frame `frame_id` (running `code`) is still on thread `thread`'s stack: its call has not returned.

    `self_id`: also require the frame's `self` to be that object (a later call of the same `__call__` on another
    pipeline, e.g. one sharing the transformer, may get the freed frame's address).
    """
    frame: FrameType | None = sys._getframe() if thread == threading.get_ident() else sys._current_frames().get(thread)
    while frame is not None:
        if id(frame) == frame_id and frame.f_code is code:
            return self_id is None or id(frame.f_locals.get("self")) == self_id
        frame = frame.f_back
    return False


class _CallOwner:
    """Which pipeline call (thread, `__call__` frame) the handle's per-call state belongs to.

    The frame is held by id and code, not by reference: a reference would keep a failed call's locals (its
    latents) alive until the next call.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.thread: int | None = None
        self._frame_id = 0
        self._code: Any = None
        self._pipeline_id = 0

    def running(self) -> bool:
        return self.thread is not None and _on_stack(self.thread, self._frame_id, self._code)

    def claim(self, pipeline: Any, scheduler: Any, start: FrameType | None) -> None:
        """Make the call whose `__call__` frame encloses `start` the owner, or raise when another call still runs.

        The call is `pipeline`'s or another pipeline's sharing `scheduler`: either starts a generation of the handle,
        so either owns its state (and its return, also early, ends that generation)."""
        frame, caller = _scheduler_call_frame(pipeline, scheduler, start)
        with self._lock:
            if frame is not None and self.running() and id(frame) != self._frame_id:
                here = threading.get_ident()
                how = ("from inside its own call (a callback, or a nested call)" if self.thread == here
                       else "from another thread")
                raise HookError(
                    f"{type(caller).__name__}: expected one call at a time on a pipeline hookkit is enabled on (or one "
                    f"sharing its scheduler), got a second call {how} while the first is still running (its per-call "
                    "state, e.g. DBCache residuals, is that call's: sharing it gives wrong output). Wait for the first "
                    "call to return, or give each thread its own pipeline (and transformer) with its own "
                    "hookkit.enable."
                )
            if frame is None:
                self.thread = None
            else:
                self.thread, self._frame_id, self._code = threading.get_ident(), id(frame), frame.f_code
                self._pipeline_id = id(caller)

    def returned_check(self) -> Callable[[], bool] | None:
        """For the call owning the state now: a check whether it has returned (however it ended), for its
        `CallState`; None when `set_timesteps` ran outside any pipeline's `__call__` (a loop hookkit cannot see end).
        Holds ids, not the frame or the pipeline."""
        thread, frame_id, code, pipeline_id = self.thread, self._frame_id, self._code, self._pipeline_id
        if thread is None:
            return None
        return lambda: not _on_stack(thread, frame_id, code, pipeline_id)

    def check_thread(self, what: str) -> None:
        """Refuse a transformer call from a thread other than the running call's."""
        thread = self.thread
        if thread is not None and thread != threading.get_ident() and self.running():
            raise HookError(
                f"{what}: expected transformer calls from the thread running the current pipeline call, got one from "
                "another thread while that call is still running (the per-call state is that call's). Give each "
                "thread its own pipeline (and transformer) with its own hookkit.enable."
            )


class _CoreFeature:
    """Per-call bookkeeping; always on, attached first. Part of the core, so it may use the whole handle."""

    name = "core"

    def plan(self, ctx: PlanContext) -> list[Attachment]:
        out = [Attachment(feature="core", target="", name=CLOCK_HOOK)]

        scheduler = getattr(ctx.pipeline, "scheduler", None) if ctx.pipeline is not None else None
        if not ctx.scheduler_owner:  # a companion transformer: the group's first handle drives its clock
            return out
        if scheduler is not None:
            out.append(Attachment(feature="core", target="pipeline.scheduler.set_timesteps", name="hookkit.generation"))
            out.append(Attachment(feature="core", target="pipeline.scheduler.step", name="hookkit.step"))
        return out

    def attach(self, ctx: AttachContext, attachment: Attachment) -> Removable:
        handle = ctx._handle
        if attachment.name == CLOCK_HOOK:
            compile_spec = getattr(handle.spec, "compile", None)
            if compile_spec is None or getattr(compile_spec, "regional", True):
                # the check observes every block eagerly; a whole-transformer compile would trace its observers
                # into the graph, so there the adapter goes unconfirmed (regional compile keeps hooks outside).
                # Whole-transformer CUDA graphs run the checked call eagerly: the check tells them when (EagerCalls)
                check = handle.first_call = firstcall.install(handle.adapter, handle.transformer,
                                                                handle.first_call_listeners)
                ctx.provide(EagerCalls, lambda: check)
            return add_hook(handle.transformer, CLOCK_HOOK, _ClockHook(handle), position=0)
        scheduler = handle.pipeline.scheduler
        if attachment.name == "hookkit.generation":
            handle._scheduler = scheduler

            def make(original: Callable[..., Any]) -> Callable[..., Any]:
                def set_timesteps(*args: Any, **kwargs: Any) -> Any:
                    handle._owner.claim(handle.pipeline, scheduler, sys._getframe(1))
                    handle._check_components()
                    group = handle.group
                    for member in group:
                        member._check_transformer()
                        member._check_modules()
                    result = original(*args, **kwargs)
                    timesteps = getattr(scheduler, "timesteps", None)
                    returned = handle._owner.returned_check()
                    for member in group:
                        member.new_generation(num_steps=len(timesteps) if timesteps is not None else None,
                                              call_returned=returned)
                    handle._begin_pending = True
                    for listener in handle._group_listeners():
                        listener.after_set_timesteps(scheduler)
                    return result
                return set_timesteps
            return MethodPatch(scheduler, "set_timesteps", make, owner=handle)

        def make_step(original: Callable[..., Any]) -> Callable[..., Any]:
            def step(*args: Any, **kwargs: Any) -> Any:
                entered: list[SchedulerListener] = []
                try:
                    for listener in handle._group_listeners():
                        args, kwargs = listener.before_step(scheduler, args, kwargs)
                        entered.append(listener)
                    result = original(*args, **kwargs)
                finally:  # undo what each listener's before_step did, also when a later one raised
                    for listener in reversed(entered):
                        listener.after_step(scheduler)
                for member in handle.group:
                    member._clock.on_scheduler_step()
                return result
            return step
        return MethodPatch(scheduler, "step", make_step)


_CORE = _CoreFeature()


#: why hookkit refuses UNets (said by `enable` for a UNet pipeline or a bare UNet)
UNET_WHY = ("hookkit's techniques work on a diffusion transformer's list of same-shaped blocks: DBCache skips the "
            "middle blocks of that list and reuses their residual, regional compile compiles its repeated block "
            "class, and adapters describe those lists; a UNet's down, mid and up blocks change resolution and "
            "channels from block to block, so there is no such list to cache or compile")


def _unet_error(what: str, unet: torch.nn.Module, caller: str) -> EnableError:
    return EnableError(f"{caller}: UNets are not supported, because {UNET_WHY}; got {what} "
                       f"({type(unet).__name__}). Use a transformer pipeline (Flux, Qwen-Image, SD3, Wan, ...), or "
                       "diffusers' own tools for UNets (e.g. pipe.unet.compile()).")


def _is_unet(module: Any) -> bool:
    """A diffusers UNet: a model class defined in `diffusers.models.unets` (by module, not by a class-name prefix)."""
    return isinstance(module, torch.nn.Module) and type(module).__module__.startswith("diffusers.models.unets.")


_COMPONENT = re.compile(r"transformer(_[0-9]+)?")


def transformer_components(pipeline: Any) -> list[tuple[str, torch.nn.Module]]:
    """`(attribute, module)` of every transformer a pipeline holds, `transformer` first, then `transformer_2`, ...

    Read from the pipeline's registered components (`pipe.components`), so only what the pipeline itself declares
    counts; an optional one set to None (Wan 2.2 without its low-noise expert) is skipped.
    """
    components = getattr(pipeline, "components", None)
    names = [n for n in (components if isinstance(components, dict) else ()) if _COMPONENT.fullmatch(n)]
    names.sort(key=lambda n: int(n.rsplit("_", 1)[1]) if "_" in n else 1)
    if "transformer" not in names and components is not None:  # a pipeline-like object with an unregistered one
        names.insert(0, "transformer")
    return [(n, m) for n in names if isinstance(m := getattr(pipeline, n, None), torch.nn.Module)]


def _split_target(target: Any, caller: str = "hookkit.enable") -> tuple[Any | None, torch.nn.Module]:
    """(pipeline or None, first transformer) from whatever `enable` (or `caller`) was given."""
    if _is_unet(target):
        raise _unet_error("a bare UNet", target, caller)
    if isinstance(target, torch.nn.Module):
        return None, target
    unet = getattr(target, "unet", None)
    if getattr(target, "transformer", None) is None and _is_unet(unet):
        raise _unet_error(f"{type(target).__name__}, which denoises with a UNet", unet, caller)
    if hasattr(target, "components"):
        found = transformer_components(target)
        if found:
            return target, found[0][1]
    raise EnableError(
        f"{caller}: expected a diffusers pipeline with a `transformer` or a transformer nn.Module, got "
        f"{type(target).__name__}. Pass pipe (e.g. a FluxPipeline) or pipe.transformer."
    )


class Handle:
    """What `hookkit.enable` returns: remove it, summarize it, mark generations on a bare transformer.

    A context manager too: `with hookkit.enable(pipe, spec): ...` removes everything on exit.
    """

    def __init__(self, plan: Plan, transformer: torch.nn.Module, pipeline: Any | None,
                 features: FeatureTable, component: str = "transformer") -> None:
        self.plan = plan
        #: the features this handle was planned with, keyed by Spec field
        self.features = features
        self.transformer: torch.nn.Module = transformer
        self.pipeline = pipeline
        #: the pipeline attribute holding `transformer` ("transformer", "transformer_2", ...)
        self.component = component
        #: the handles of the pipeline's other transformers, which this one's scheduler patches drive
        self.companions: list[Handle] = []
        #: the handle owning the scheduler patches: this one, or the first transformer's for a companion
        self.primary: Handle = self
        #: the pipeline's class name, for the summary (also after `remove()` has let go of the pipeline)
        self._pipeline_class: str | None = type(pipeline).__name__ if pipeline is not None else None
        #: the scheduler whose `set_timesteps`/`step` the core patched (None on a bare transformer)
        self._scheduler: Any | None = None
        self._in_generation = False
        #: the thread that opened the current `with handle.generation():` block
        self._generation_thread: int | None = None
        #: True from `set_timesteps` to the first transformer call, where `num_steps` takes the begin index in
        self._begin_pending = False
        calls_per_step = None if any(a.name == "hookkit.step" for a in plan.attachments) else (
            2 if plan.adapter.cfg == "separate" else 1)
        self._clock = Clock(calls_per_step)
        self._attached: list[tuple[Attachment, Removable]] = []
        #: (path, module) of every module carrying hookkit hooks, checked at each call for replacement
        self._hooked_paths: list[tuple[str, torch.nn.Module]] = []
        #: (list attribute, length) of every adapter block list holding hooked modules, checked at each call
        self._block_counts: list[tuple[str, int]] = []
        #: one attach context per feature (what the feature sees of this handle)
        self._contexts: dict[str, AttachContext] = {}
        #: each feature's long-lived object (`AttachContext.keep`), keyed by feature name
        self._slots: dict[str, Any] = {}
        #: services features provide to later ones (`AttachContext.provide`): protocol -> [factory, instance]
        self._services: dict[type, list[Any]] = {}
        #: called by the core's `set_timesteps`/`step` patches (see `SchedulerListener`)
        self.scheduler_listeners: list[SchedulerListener] = []
        #: confirms the adapter at the first transformer call (`hookkit.core.firstcall`)
        self.first_call: firstcall.FirstCallCheck | None = None
        #: called with the check's report once the first call passed it (see `AttachContext.add_first_call_listener`)
        self.first_call_listeners: list[Callable[[firstcall.FirstCallReport], None]] = []
        self.removed = False
        #: the pipeline call (or bare generation) now running, for refusing a second concurrent one
        self._owner = _CallOwner()

    def __enter__(self) -> Handle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        on = [name for name in self.features if requested(self.spec, name)]
        where = f" on {self._pipeline_class}" if self._pipeline_class else ""
        status = "removed" if self.removed else f"{len(self._attached)} attachments"
        return (f"<hookkit.Handle {self.plan.transformer_class}{where}, adapter {self.adapter.name!r}, features "
                f"[{', '.join(on) or 'none'}], {status}, {self._clock.generations} generations>")

    def service(self, protocol: type) -> Any | None:
        """The service a feature provides for `protocol` (see `AttachContext.provide`), or None."""
        return self._context("core").request(protocol)

    def _context(self, feature: str) -> AttachContext:
        ctx = self._contexts.get(feature)
        if ctx is None:
            ctx = self._contexts[feature] = AttachContext(self, feature)
        return ctx

    # -- state ----------------------------------------------------------------------------------------
    @property
    def adapter(self) -> AdapterSpec:
        return self.plan.adapter

    @property
    def spec(self) -> AnySpec:
        return self.plan.spec

    @property
    def group(self) -> list[Handle]:
        """This handle's group: the first transformer's handle, then its companions."""
        primary = self.primary
        return [primary, *primary.companions]

    def _group_listeners(self) -> list[SchedulerListener]:
        return [listener for member in self.group for listener in member.scheduler_listeners]

    @property
    def in_generation(self) -> bool:
        """Whether a `with handle.generation():` block is open (what a bare transformer's calls need)."""
        return self._in_generation

    @property
    def state(self) -> CallState:
        """The current (or last finished) generation's state."""
        return self._clock.state

    def _check_modules(self) -> None:
        """At every generation: the hooked blocks must still be the transformer's, and their lists as long as at
        enable (a replaced or appended block runs unhooked: DBCache would silently stop skipping it, or run it inside
        its cached region on a cached step and count its work twice; compilation would silently not apply)."""
        for path, module in self._hooked_paths:
            try:
                current: Any = self.transformer.get_submodule(path)
            except AttributeError:
                current = None
            if current is not module:
                found = type(current).__name__ if current is not None else "no module"
                raise HookError(
                    f"{type(self.transformer).__name__}.{path}: expected the {type(module).__name__} hookkit hooked at "
                    f"enable, got {found} (replaced after hookkit.enable); its hooks no longer run. Call "
                    "hookkit.disable before replacing modules of the transformer and hookkit.enable after."
                )
        for attr, count in self._block_counts:
            found = len(getattr(self.transformer, attr, ()))
            if found != count:
                raise HookError(
                    f"{type(self.transformer).__name__}.{attr}: expected the {count} blocks it held at hookkit.enable, "
                    f"got {found} (blocks added or removed after hookkit.enable); an added block carries none of "
                    "hookkit's hooks: it is not compiled or quantized, and on a DBCache cached step it runs inside the "
                    "cached region, its work counted twice. Call hookkit.disable, change the block list, then "
                    "hookkit.enable again."
                )

    def _check_components(self) -> None:
        """At every pipeline call: the pipeline holds no transformer beyond those hooked at enable (Wan 2.2's
        `transformer_2`, None at enable and set after, would run with no hooks while the handle reports the pipeline
        enabled). A hooked one replaced or set to None is `_check_transformer`'s."""
        hooked = {member.component for member in self.group}
        for name, module in transformer_components(self.pipeline):
            if name not in hooked:
                raise HookError(
                    f"{type(self.pipeline).__name__}.{name}: expected None, as at hookkit.enable, got a "
                    f"{type(module).__name__} (set after hookkit.enable); hookkit hooked none of it, so it would run "
                    "plain while the handle reports the pipeline enabled. Call hookkit.disable(pipe) before setting it "
                    "and hookkit.enable(pipe, spec) after: every transformer the pipeline holds then is hooked."
                )

    def _check_transformer(self) -> None:
        """At every pipeline call: the pipeline must still run the transformer hookkit hooked."""
        current = getattr(self.pipeline, self.component, None)
        if current is not self.transformer:
            # the new transformer carries no hooks: the call would run plain while the handle reports enabled
            raise HookError(
                f"{type(self.pipeline).__name__}.{self.component}: expected the {type(self.transformer).__name__} hookkit "
                f"hooked at enable, got another {type(current).__name__} (the transformer was replaced after "
                "hookkit.enable). Call hookkit.disable(pipe) (it still undoes everything on the old one) before "
                "replacing the transformer and hookkit.enable(pipe, spec) after."
            )

    def _on_transformer_call(self, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> None:
        """Clock hook: check the scheduler is still the patched one, settle `num_steps`, count the call."""
        self._owner.check_thread(f"{type(self.transformer).__name__} (hookkit enabled)")
        if self._in_generation and self._generation_thread != threading.get_ident():
            raise HookError(
                f"{type(self.transformer).__name__} (hookkit enabled): expected transformer calls from the thread inside "
                "`with handle.generation():`, got one from another thread while that generation runs (its per-call "
                "state is that generation's). Give each thread its own transformer and handle."
            )
        scheduler = self._scheduler
        if scheduler is not None:
            current = getattr(self.pipeline, "scheduler", None)
            if current is not scheduler:
                # its set_timesteps/step are unpatched: per-call state would never reset and steps never advance
                raise HookError(
                    f"{type(self.pipeline).__name__}.scheduler: expected the {type(scheduler).__name__} hookkit patched "
                    f"at enable, got another {type(current).__name__} (the scheduler was replaced after "
                    "hookkit.enable). Call hookkit.disable(pipe) before replacing the scheduler and "
                    "hookkit.enable(pipe, spec) after."
                )
            primary = self.primary
            if primary._begin_pending and self._clock.state.num_steps is not None:
                # img2img/inpaint pipelines start the loop part-way (`set_begin_index` after `set_timesteps`);
                # settled at the group's first transformer call, whichever transformer makes it
                primary._begin_pending = False
                begin = getattr(scheduler, "begin_index", None)
                if not isinstance(begin, int):
                    begin = _start_in_schedule(scheduler, args, kwargs or {})
                for member in self.group:
                    state = member._clock.state
                    if isinstance(begin, int) and state.num_steps is not None and 0 < begin <= state.num_steps:
                        state.num_steps -= begin
        self._clock.on_transformer_call()

    def new_generation(self, num_steps: int | None = None,
                       call_returned: Callable[[], bool] | None = None) -> CallState:
        """Start a fresh generation: a new `CallState`, so the per-call state of every feature is dropped.

        `call_returned`: says whether the pipeline call it belongs to has returned (`CallState.ended`).
        """
        state = self._clock.new_generation(num_steps, call_returned)
        self._begin_pending = False
        return state

    @contextlib.contextmanager
    def generation(self, num_steps: int | None = None, calls_per_step: int | None = None) -> Iterator[CallState]:
        """Mark one generation on a bare transformer (a pipeline needs none of this).

        `calls_per_step`: transformer calls per denoising step (2 when CFG runs as two calls); defaults
        to the adapter's `cfg` style.
        """
        if self.pipeline is not None and calls_per_step is not None:
            raise SpecError("Handle.generation.calls_per_step: expected None with a pipeline (its scheduler counts "
                            f"steps), got {calls_per_step!r}. Drop the argument.")
        if calls_per_step is not None and (isinstance(calls_per_step, bool) or not isinstance(calls_per_step, int)
                                           or calls_per_step < 1):
            raise SpecError(f"Handle.generation.calls_per_step: expected an int >= 1, got {calls_per_step!r}. Pass 1 "
                            "for batched CFG (or none), 2 for CFG as two transformer calls per step.")
        if num_steps is not None:  # an int (numpy's too, as in every spec field), never a bool, str or float
            if not is_int(num_steps) or num_steps < 1:
                raise SpecError(f"Handle.generation.num_steps: expected an int >= 1 or None, got {num_steps!r}. Pass "
                                "the number of denoising steps the loop runs (e.g. num_steps=28), or leave it out.")
            num_steps = int(num_steps)
        with self._owner._lock:
            if self._in_generation:
                if self._generation_thread != threading.get_ident():
                    raise HookError("Handle.generation: expected one generation at a time on a handle, got a second "
                                    "`with handle.generation():` from another thread while the first runs (the per-call "
                                    "state is one generation's). Give each thread its own transformer and handle.")
                # the inner block would replace the outer one's state, and the outer would go on counting into it
                raise HookError("Handle.generation: expected no generation in progress, got a nested "
                                "`with handle.generation():`. Generations do not nest: end the outer block first.")
            self._in_generation = True
            self._generation_thread = threading.get_ident()
        try:
            self._check_modules()
        except BaseException:
            self._in_generation = False
            raise
        saved = self._clock.calls_per_step
        if calls_per_step is not None:
            self._clock.calls_per_step = calls_per_step
        state: CallState | None = None
        try:
            state = self.new_generation(num_steps)
            yield state
        finally:
            if state is not None:
                state.end()
            self._in_generation = False
            self._clock.calls_per_step = saved

    # -- attach / remove --------------------------------------------------------------------------------
    def _attach(self) -> None:
        try:
            for attachment in self.plan.attachments:
                feature = _CORE if attachment.feature == _CORE.name else self.features[attachment.feature]
                removable = feature.attach(self._context(attachment.feature), attachment)
                self._attached.append((attachment, removable))
                logger.debug("attached {} to {}", attachment.name, attachment.target or "<transformer>")
            targets = dict.fromkeys(a.target for a, _ in self._attached if not a.target.startswith("pipeline."))
            modules = [module_at(self.transformer, t) for t in targets]
            self._hooked_paths = [(t, m) for t, m in zip(targets, modules)
                                  if t and HookRegistry.of(m, create=False) is not None]
            self._block_counts = [(spec.attr, len(blocks)) for spec, blocks in self.adapter.block_lists(self.transformer)
                                  if any(path.startswith(f"{spec.attr}.") for path, _ in self._hooked_paths)]
        except BaseException as exc:
            try:
                self._detach_all()
            except BaseException as cleanup:  # the cause is `exc`: keep it, note what rollback could not undo
                exc.add_note(f"hookkit: undoing the partial attach also failed: {type(cleanup).__name__}: {cleanup}")
            raise

    def _enabled(self) -> list[tuple[str, Feature]]:
        return [(name, f) for name, f in self.features.items() if requested(self.spec, name)]

    def _detach_all(self) -> None:
        errors: list[BaseException] = []
        while self._attached:
            attachment, removable = self._attached.pop()
            try:
                removable.remove()
                logger.debug("detached {} from {}", attachment.name, attachment.target or "<transformer>")
            except BaseException as exc:  # keep going: leave as little behind as possible
                errors.append(exc)
        self._slots.clear()
        self._services.clear()
        self._hooked_paths = []
        self._block_counts = []
        if errors:
            raise errors[0]

    def remove(self) -> None:
        """Detach everything in reverse order; the pipeline is exactly as before. Idempotent.

        On any handle of a several-transformer pipeline it removes the whole group (one pipeline, one enable).
        """
        if self.primary is not self:
            self.primary.remove()
            return
        if self.removed:
            return
        for member in self.group:  # a feature may refuse (weights it cannot restore) before anything goes
            for name, feature in member._enabled():
                feature.check_removable(member._context(name))
        self._detach_group()

    def _detach_group(self) -> None:
        """Detach the companions, then this handle, each in reverse order, and release them (a failed enable's
        rollback: no removability check, what cannot be restored stays as it is, as in `_attach`'s)."""
        errors: list[BaseException] = []
        for member in reversed(self.companions):
            try:
                member._detach_all()
            except BaseException as exc:  # keep going: leave as little behind as possible
                errors.append(exc)
            member._release()
        self._detach_all()
        self._release()
        if errors:
            raise errors[0]

    def _release(self) -> None:
        if self.removed:
            return
        self.removed = True
        logger.info("hookkit disabled on {}", self.plan.transformer_class)
        self.transformer = None  # type: ignore[assignment]
        self.pipeline = None
        self._scheduler = None

    # -- summary ----------------------------------------------------------------------------------------
    def summary(self) -> Summary:
        """The adapter, every hook with its module path, and per-feature statistics."""
        rows = tuple(HookRow(module=a.target, name=a.name, feature=a.feature) for a, _ in self._attached)
        stats: dict[str, FeatureSummary] = {}
        if not self.removed:
            for name, feature in self._enabled():
                result = feature.summarize(self._context(name))
                if result is not None:
                    stats[result.name] = result
        return Summary(
            adapter=self.adapter.name, adapter_source=self.adapter.source, transformer=self.plan.transformer_class,
            pipeline=self._pipeline_class, spec=self.spec.to_dict(), hooks=rows, generations=self._clock.generations,
            features=stats, left_out=self._left_out(),
            first_call=("not checked" if self.first_call is None else
                        "confirmed" if self.first_call.report is not None else "pending"),
            adapter_notes=self.adapter.notes,
            component=self.component if self._pipeline_class is not None else None,
            companions=tuple(c.summary() for c in self.companions) if self.primary is self else (),
        )

    def _left_out(self) -> dict[str, str]:
        """Every non-empty nn.ModuleList child of the transformer the adapter has no [[blocks]] table for, and why."""
        if self.transformer is None:
            return dict(self.adapter.left_out_reasons)
        reasons = self.adapter.left_out_reasons
        listed = {b.attr for b in self.adapter.blocks}
        return {name: reasons.get(name, "not named by the adapter (no reason given)")
                for name, child in self.transformer.named_children()
                if isinstance(child, torch.nn.ModuleList) and len(child) > 0 and name not in listed}


def plan_for(target: Any, spec: AnySpec, adapter: AdapterSpec | None, features: FeatureTable) -> Plan:
    """The plan `enable_with(target, spec, adapter, features)` would attach, as data. Attaches nothing."""
    pipeline, transformer = _split_target(target)
    return _plan(pipeline, transformer, spec, adapter, features)


def _check_not_compiled(transformer: torch.nn.Module) -> None:
    """`torch.compile(transformer)` returns a wrapper (OptimizedModule) whose class no adapter names; the fix is
    the order, not an adapter."""
    inner = getattr(transformer, "_orig_mod", None)
    if isinstance(inner, torch.nn.Module):
        raise EnableError(
            f"hookkit.enable: expected an uncompiled transformer, got {type(transformer).__name__} wrapping "
            f"{type(inner).__name__} (torch.compile was applied before hookkit.enable; hooks cannot reach inside the "
            "compiled module). Enable hookkit on the uncompiled transformer and let it compile "
            "(hookkit.Spec(compile=hookkit.Compile(...))), or call hookkit.enable first and torch.compile after."
        )


def _plan(pipeline: Any | None, transformer: torch.nn.Module, spec: AnySpec, adapter: AdapterSpec | None,
          features: FeatureTable, scheduler_owner: bool = True) -> Plan:
    _check_not_compiled(transformer)
    if not isinstance(spec, features.spec_type):
        raise SpecError(f"hookkit.enable.spec: expected a hookkit.Spec or None, got {spec!r}.")
    if adapter is None:
        adapter = resolve_adapter(transformer)
    elif isinstance(adapter, AdapterSpec):
        adapter.check(transformer)
    else:
        raise AdapterError(f"hookkit.enable.adapter: expected a hookkit.AdapterSpec or None, got {adapter!r}.")
    missing = [name for name in attrs.fields_dict(type(spec)) if requested(spec, name) and name not in features]
    if missing:
        raise UnsupportedError(
            f"Spec.{missing[0]}: no installed hookkit feature implements it in this version. "
            "Leave it unset or upgrade hookkit."
        )
    compat.check(spec, adapter)
    ctx = PlanContext(spec=spec, adapter=adapter, transformer=transformer, pipeline=pipeline,
                      scheduler_owner=scheduler_owner)
    attachments: list[Attachment] = list(_CORE.plan(ctx))
    for name, feature in features.items():
        if requested(spec, name):
            attachments.extend(feature.plan(ctx))
    return Plan(adapter=adapter, spec=spec, transformer_class=type(transformer).__name__,
                has_pipeline=pipeline is not None, attachments=tuple(attachments))


def enable_with(target: Any, spec: AnySpec, adapter: AdapterSpec | None, features: FeatureTable) -> Handle:
    """Attach `features` as `spec` says to a pipeline or a bare transformer. All or nothing; twice raises."""
    pipeline, transformer = _split_target(target)
    if pipeline is not None and _pipeline_frame(pipeline, sys._getframe(1)) is not None:
        # this call's set_timesteps already ran unpatched: hookkit would count its remaining steps as no generation
        raise EnableError(
            f"hookkit.enable: expected to be called between calls of this {type(pipeline).__name__}, got a call from "
            "inside one of its calls (a callback): the running call started before hookkit could see it. Enable "
            "before calling the pipeline; to change features per call, enable once and disable after the call."
        )
    if handle_of(transformer) is not None:
        raise EnableError(
            f"hookkit is already enabled on this {type(transformer).__name__}; call hookkit.disable(...) (or "
            "handle.remove()) before enabling again with another spec."
        )
    if pipeline is not None and handle_of(pipeline) is not None:
        raise EnableError(
            f"hookkit is already enabled on this {type(pipeline).__name__} (on the transformer it had then: "
            "pipe.transformer was replaced since); call hookkit.disable(pipe) first, then enable again."
        )
    if pipeline is None:
        plan = _plan(pipeline, transformer, spec, adapter, features)
        handle = Handle(plan, transformer, pipeline, features)
        handle._attach()
        logger.info("hookkit enabled on {} with adapter {}: {} attachments", plan.transformer_class, plan.adapter.name,
                    len(plan.attachments))
        return handle
    return _enable_pipeline(pipeline, spec, adapter, features)


def _enable_pipeline(pipeline: Any, spec: AnySpec, adapter: AdapterSpec | None, features: FeatureTable) -> Handle:
    """Every transformer of `pipeline` planned first (nothing attached while any plan can still fail), then
    attached in order; a failure detaches what the earlier ones attached."""
    components = transformer_components(pipeline)
    if adapter is not None and len(components) > 1:
        raise EnableError(
            f"hookkit.enable.adapter: expected None for {type(pipeline).__name__}, which holds "
            f"{len(components)} transformers ({', '.join(n for n, _ in components)}), got one adapter for all. "
            "Register the adapter (hookkit.register_adapter) so each transformer resolves its own by class."
        )
    for name, module in components[1:]:
        if handle_of(module) is not None:
            raise EnableError(
                f"{type(pipeline).__name__}.{name}: expected a transformer hookkit is not enabled on, got one with a "
                "live handle (enabled on its own). Call hookkit.disable on it first, then enable the pipeline."
            )
    plans: list[tuple[str, torch.nn.Module, Plan]] = []
    for index, (name, module) in enumerate(components):
        try:
            plans.append((name, module, _plan(pipeline, module, spec, adapter, features, scheduler_owner=index == 0)))
        except HookkitError as exc:
            if len(components) > 1:  # say which transformer it cannot apply to, rather than apply to the others only
                exc.add_note(f"hookkit: raised for {type(pipeline).__name__}.{name} ({type(module).__name__}), one "
                             f"of its {len(components)} transformers; nothing was attached to any of them.")
            raise
    name, module, plan = plans[0]
    primary = Handle(plan, module, pipeline, features, component=name)
    primary._attach()
    try:
        for name, module, plan in plans[1:]:
            companion = Handle(plan, module, pipeline, features, component=name)
            companion.primary = primary
            companion._scheduler = primary._scheduler
            companion._owner = primary._owner  # one pipeline call owns every transformer's calls
            companion._clock.calls_per_step = None  # the pipeline's scheduler counts its steps
            companion._attach()  # rolls itself back if it fails
            primary.companions.append(companion)
    except BaseException as exc:  # undo the transformers attached so far, as a failed `_attach` undoes its own
        try:
            primary._detach_group()
        except BaseException as cleanup:  # the cause is `exc`: keep it, note what rollback could not undo
            exc.add_note(f"hookkit: undoing the other transformers' attach also failed: {type(cleanup).__name__}: "
                         f"{cleanup}")
        raise
    for name, module, plan in plans:
        where = f" (pipe.{name})" if len(plans) > 1 else ""
        logger.info("hookkit enabled on {}{} with adapter {}: {} attachments", plan.transformer_class, where,
                    plan.adapter.name, len(plan.attachments))
    return primary


def handle_of(target: Any) -> Handle | None:
    """The live handle of a hooked pipeline or transformer, or None."""
    _, transformer = _split_target(target, caller="hookkit.handle_of")
    inner = getattr(transformer, "_orig_mod", None)  # `torch.compile(transformer)` after enable: look inside
    if isinstance(inner, torch.nn.Module):
        transformer = inner
    registry = HookRegistry.of(transformer, create=False)
    hook = registry.get(CLOCK_HOOK) if registry is not None else None
    if isinstance(hook, _ClockHook):
        found = hook.handle
        if not isinstance(target, torch.nn.Module) and found.pipeline is not None and found.pipeline is not target:
            return None  # another pipeline sharing the transformer: hookkit is enabled on that one, not on `target`
        return found
    if not isinstance(target, torch.nn.Module):  # a pipeline whose transformer was replaced after enable
        patched = getattr(getattr(target, "scheduler", None), "__dict__", {}).get("set_timesteps")
        owner = getattr(patched, "owner", None)
        if isinstance(owner, Handle) and owner.pipeline is target:
            return owner
    return None


def disable(target: Any) -> None:
    """Remove everything hookkit attached to `target` (pipeline or transformer)."""
    _, transformer = _split_target(target, caller="hookkit.disable")
    handle = handle_of(target)
    shared = handle_of(transformer) if handle is None else None
    if shared is not None and shared.pipeline is not None:
        raise EnableError(
            f"hookkit.disable: expected the {type(target).__name__} hookkit is enabled on, got another one that shares "
            f"its {type(transformer).__name__} (hookkit was enabled on a {type(shared.pipeline).__name__} using the "
            "same transformer; nothing was removed). Call hookkit.disable on that pipeline, or on the transformer."
        )
    if handle is None:
        raise EnableError(
            f"hookkit.disable: expected a {type(target).__name__} hookkit is enabled on, got one it is not enabled on "
            "(never enabled, or already disabled). Nothing to undo: call disable once per enable."
        )
    handle.remove()
