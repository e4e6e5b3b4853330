"""Find the host syncs of a denoising loop: how many, in which step, and where (file:line).

`profile_syncs(pipe, **call_kwargs)` runs the pipeline once with `torch.cuda.set_sync_debug_mode("warn")` on
for the denoising steps after the first `skip_first_steps` (one-off setup copies are not what a sync-free
loop is about); a scheduler listener switches it at `scheduler.step`, and the caller's mode is restored at
the end. Each "called a synchronizing CUDA operation" warning is attributed to the first frame outside torch
and counted per step and per place (`SyncReport`, a table of count, file:line, function and code).

Step k runs from the end of step k-1's `scheduler.step` to the end of step k's. GPU only; the bookkeeping
(`SyncRecorder`: warning capture -> attribution -> aggregation) runs anywhere, which is what the CPU tests
feed with synthetic warnings. `hookkit.diagnostics.testing.assert_no_host_sync` asserts on it.

The debug mode sees what PyTorch routes through its sync check: `.item()`, `.cpu()`/`.tolist()` of device
tensors, `nonzero`, `bool()` of a device tensor, pageable host-to-device copies. It does not see
`torch.cuda.synchronize()` or event waits (PyTorch calls the feature a prototype).
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch

from hookkit.errors import SpecError, UnsupportedError
from hookkit.core.listeners import SchedulerListener
from hookkit.core.summary import table

if TYPE_CHECKING:
    from hookkit.core.handle import Handle

#: the start of the warning PyTorch emits in sync debug mode "warn"
SYNC_WARNING = "called a synchronizing CUDA operation"
_PROTOTYPE_WARNING = "Synchronization debug mode is a prototype feature"
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_SKIPPED_FILES = frozenset({os.path.abspath(warnings.__file__), os.path.abspath(__file__)})

__all__ = ["SYNC_WARNING", "SyncEvent", "SyncLocation", "SyncRecorder", "SyncReport", "profile_syncs"]


@attrs.frozen(kw_only=True)
class SyncLocation:
    """Where a sync came from: the first frame outside torch."""

    file: str
    line: int
    function: str
    code: str = ""

    @property
    def where(self) -> str:
        """`file.py:line`: short enough for a table column, enough to open the line."""
        return f"{os.path.basename(self.file)}:{self.line}"


@attrs.frozen(kw_only=True)
class SyncEvent:
    step: int
    location: SyncLocation


@attrs.frozen(kw_only=True)
class SyncReport:
    """The syncs of one profiled pipeline call. `events` are in the order they happened."""

    pipeline: str
    #: the denoising steps profiled (those after the first `skip_first_steps`)
    steps: tuple[int, ...]
    events: tuple[SyncEvent, ...]
    skip_first_steps: int = 1
    #: the pipeline's return value (not compared, not printed)
    output: Any = attrs.field(default=None, eq=False, repr=False)

    @property
    def total(self) -> int:
        return len(self.events)

    def per_step(self) -> dict[int, int]:
        """Syncs per profiled step, zeros included."""
        counts = {step: 0 for step in self.steps}
        for event in self.events:
            counts[event.step] = counts.get(event.step, 0) + 1
        return counts

    def per_location(self) -> list[tuple[int, SyncLocation]]:
        """(count, location), most frequent first, then by place."""
        counts = collections.Counter(event.location for event in self.events)
        return sorted(((n, loc) for loc, n in counts.items()), key=lambda item: (-item[0], item[1].where))

    def table(self) -> str:
        """A "count | where" table (with the function and the source line): the syncs worth removing first on top."""
        rows = [[n, loc.where, loc.function, _clip(loc.code)] for n, loc in self.per_location()]
        return table(["count", "where", "function", "code"], rows)

    def render(self) -> str:
        if not self.steps:
            return (f"host syncs in {self.pipeline}: no denoising step after the first {self.skip_first_steps} ran, "
                    "nothing was profiled")
        first, last = self.steps[0], self.steps[-1]
        head = (f"host syncs in {self.pipeline}, denoising steps {first}..{last} (the first {self.skip_first_steps} "
                f"not profiled): {self.total} in total, {self.total / len(self.steps):.4g} per step")
        per_step = self.per_step()
        steps = table(["step", *map(str, per_step)], [["syncs", *per_step.values()]])
        return "\n".join([head, steps] + ([self.table()] if self.events else []))

    def __str__(self) -> str:
        return self.render()

    def to_dict(self) -> dict[str, Any]:
        return {
            "pipeline": self.pipeline, "skip_first_steps": self.skip_first_steps, "steps": list(self.steps),
            "total": self.total, "per_step": {str(k): v for k, v in self.per_step().items()},
            "per_location": [{"count": n, "where": loc.where, "file": loc.file, "line": loc.line,
                              "function": loc.function, "code": loc.code} for n, loc in self.per_location()],
        }


def _clip(code: str, width: int = 72) -> str:
    return code if len(code) <= width else code[: width - 3] + "..."


class SyncRecorder:
    """Sync warnings -> events: `capture()` catches them with their stack, `attribute` finds the place,
    `report` aggregates. `active` gates recording, so that only the profiled steps count."""

    def __init__(self, step_of: Callable[[], int]) -> None:
        self._step_of = step_of
        self.active = False
        self.events: list[SyncEvent] = []

    @staticmethod
    def attribute(stack: Sequence[traceback.FrameSummary]) -> SyncLocation:
        """The innermost frame outside torch, `warnings`, this module and torch-function modes' pass-through."""
        for frame in reversed(stack):
            path = os.path.abspath(frame.filename)
            if path.startswith(_TORCH_DIR) or path in _SKIPPED_FILES or frame.name == "__torch_function__":
                continue
            return SyncLocation(file=frame.filename, line=frame.lineno or 0, function=frame.name,
                                code=(frame.line or "").strip())
        return SyncLocation(file="<torch>", line=0, function="?", code="")

    def record(self, stack: Sequence[traceback.FrameSummary]) -> None:
        """Count one sync at `stack` in the current step (when active)."""
        if self.active:
            self.events.append(SyncEvent(step=self._step_of(), location=self.attribute(stack)))

    @contextlib.contextmanager
    def capture(self) -> Iterator[SyncRecorder]:
        """Within: every sync warning is recorded (never shown, never deduplicated); others are shown as usual."""
        with warnings.catch_warnings():
            warnings.filterwarnings("always", message=re.escape(SYNC_WARNING))
            warnings.filterwarnings("ignore", message=re.escape(_PROTOTYPE_WARNING))
            show = warnings.showwarning

            def showwarning(message: Any, category: Any, filename: str, lineno: int, file: Any = None,
                            line: str | None = None) -> None:
                if str(message).startswith(SYNC_WARNING):
                    self.record(traceback.extract_stack(sys._getframe(1)))
                else:
                    show(message, category, filename, lineno, file, line)

            warnings.showwarning = showwarning
            yield self

    def report(self, pipeline: str, steps: Sequence[int], skip_first_steps: int, output: Any = None) -> SyncReport:
        wanted = set(steps)
        return SyncReport(pipeline=pipeline, steps=tuple(steps), skip_first_steps=skip_first_steps,
                          events=tuple(e for e in self.events if e.step in wanted), output=output)


class _ProfileListener(SchedulerListener):
    """Switches the debug mode from the clock: on after step `skip - 1`, off after the last step."""

    def __init__(self, handle: Handle, recorder: SyncRecorder, skip: int, switch: Callable[[bool], None]) -> None:
        self.handle = handle
        self.recorder = recorder
        self.skip = skip
        self.switch = switch
        #: denoising steps finished in the profiled call; None until its `set_timesteps` (the only steps that were
        #: profiled: the handle's state may be a stale one if the clock never saw this call)
        self.steps_done: int | None = None

    def _set(self, on: bool) -> None:
        if self.recorder.active != on:
            self.recorder.active = on
            self.switch(on)

    def after_set_timesteps(self, scheduler: Any) -> None:
        self.steps_done = 0
        self._set(self.skip == 0)

    def after_step(self, scheduler: Any) -> None:
        done = self.handle.state.step + 1  # steps finished once this one returns (the clock advances next)
        if self.steps_done is not None:
            self.steps_done = done
        if done == self.skip:
            self._set(True)
        num_steps = self.handle.state.num_steps
        if num_steps is not None and done >= num_steps:
            self._set(False)


def _profile(pipe: Any, skip_first_steps: int, call_kwargs: dict[str, Any],
             set_mode: Callable[[Any], None], get_mode: Callable[[], Any]) -> SyncReport:
    """`profile_syncs` with the debug-mode switch injected (the CPU tests pass a fake one)."""
    from hookkit.core.handle import handle_of
    from hookkit.features import enable
    from hookkit.spec import Spec

    if isinstance(skip_first_steps, bool) or not isinstance(skip_first_steps, int) or skip_first_steps < 0:
        raise SpecError(f"profile_syncs.skip_first_steps: expected an int >= 0, got {skip_first_steps!r}. Pass 0 to "
                        "profile every step, or 1 (the default) to leave out step 0's one-off setup copies.")
    handle = handle_of(pipe)
    temporary = None
    if handle is None:
        temporary = handle = enable(pipe, Spec())  # the clock only; removed again below
    if handle.pipeline is None:
        raise UnsupportedError(
            f"profile_syncs: hookkit is enabled on the bare {handle.plan.transformer_class}, so it sees no denoising "
            "steps. Disable it and enable it on the pipeline (hookkit.enable(pipe, spec)).")
    previous = get_mode()
    recorder = SyncRecorder(step_of=lambda: handle.state.step)
    # off (0) outside the profiled steps whatever the caller had set: "error" would raise at step 0's setup copies
    listener = _ProfileListener(handle, recorder, skip_first_steps, lambda on: set_mode("warn" if on else 0))
    handle.scheduler_listeners.append(listener)
    try:
        if previous != 0:
            set_mode(0)
        with recorder.capture():
            output = pipe(**call_kwargs)
    finally:
        recorder.active = False
        set_mode(previous)
        handle.scheduler_listeners.remove(listener)
        if temporary is not None:
            temporary.remove()
    if listener.steps_done is None:  # the debug mode was never switched on: a report would claim a sync-free loop
        scheduler = getattr(pipe, "scheduler", None)
        raise UnsupportedError(
            f"profile_syncs: expected {type(pipe).__name__}'s call to start its loop with pipe.scheduler.set_timesteps "
            f"(where hookkit's clock starts counting steps), got a call that never did (pipe.scheduler: "
            f"{type(scheduler).__name__}), so no step was profiled. Profile a pipeline whose denoising loop uses "
            "pipe.scheduler (set_timesteps, then step once per step).")
    return recorder.report(type(pipe).__name__, range(skip_first_steps, listener.steps_done), skip_first_steps, output)


def profile_syncs(pipe: Any, skip_first_steps: int = 1, **call_kwargs: Any) -> SyncReport:
    """Run `pipe(**call_kwargs)` once and report its host syncs per denoising step and per place.

    Works on a stock pipeline (hookkit's clock is attached for the call and removed after) and on one
    hookkit is enabled on. The report's `output` is what the pipeline returned. GPU only.
    """
    if not torch.cuda.is_available():
        raise UnsupportedError("profile_syncs: expected a CUDA device (sync debug mode is a CUDA feature), found none. "
                               "Run it on a GPU machine; SyncRecorder's bookkeeping works on the CPU.")
    transformer = getattr(pipe, "transformer", None)
    param = next(transformer.parameters(), None) if isinstance(transformer, torch.nn.Module) else None
    if param is None or param.device.type != "cuda":
        where = param.device if param is not None else "nowhere (no transformer parameters)"
        raise UnsupportedError(f"profile_syncs: expected the pipeline's transformer on a CUDA device, found it on "
                               f"{where}. Move the pipeline first: pipe.to('cuda').")
    return _profile(pipe, skip_first_steps, call_kwargs, torch.cuda.set_sync_debug_mode, torch.cuda.get_sync_debug_mode)
