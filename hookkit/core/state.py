"""Per-call state: which generation, which denoising step, which CFG branch.

A `CallState` is created fresh at the start of every pipeline call (when the pipeline calls
`scheduler.set_timesteps`) or every `with handle.generation():` block, so nothing leaks from one call
into the next, not even after an exception halfway through. Features keep their per-call data in
`CallState.features`, keyed by feature name; specs and hooks hold none.

A state stays readable after its call (the summary reads it), so it says whether that call is over
(`finished`): a transformer call made after it, outside any call, must not continue it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import attrs

T = TypeVar("T")


@attrs.define
class CallState:
    """Bookkeeping of one generation (one pipeline call)."""

    generation: int = 0
    #: denoising step index, counted from 0 (advanced by `scheduler.step`, or by calls in bare mode)
    step: int = 0
    #: transformer call within the current step: 0 for the first (conditional) branch, 1 for the second
    branch: int = 0
    #: transformer calls made in this generation
    calls: int = 0
    #: number of denoising steps, when the pipeline told the scheduler (None in bare mode unless given)
    num_steps: int | None = None
    _calls_in_step: int = 0
    features: dict[str, Any] = attrs.field(factory=dict)
    #: asks whether the pipeline call this state belongs to has returned (the handle's; None: a loop hookkit
    #: cannot see end, or a `with handle.generation():` block, which `end()` marks)
    _call_returned: Callable[[], bool] | None = attrs.field(default=None, repr=False)
    _ended: bool = attrs.field(default=False, repr=False)

    @property
    def ended(self) -> bool:
        """Whether this generation's pipeline call (or `with handle.generation():` block) has returned: at its last
        step, or early (`pipe._interrupt = True` from a callback, an exception). Asked of the call when read, since
        nothing runs when a pipeline call returns."""
        if not self._ended and self._call_returned is not None and self._call_returned():
            self._ended = True
            self._call_returned = None  # once over, always over: nothing left to ask
        return self._ended

    def end(self) -> None:
        """Mark the generation over (its `with handle.generation():` block was left)."""
        self._ended = True

    @property
    def finished(self) -> bool:
        """Whether this generation takes no more transformer calls: its call returned (`ended`), or it ran all its
        `num_steps`. A transformer call after that belongs to no generation the per-call state could serve."""
        return self.ended or (self.num_steps is not None and self.step >= self.num_steps)

    def feature(self, name: str, factory: Callable[[], T]) -> T:
        """The per-call state of feature `name`, created by `factory()` on first use in this call."""
        value = self.features.get(name)
        if value is None:
            value = self.features[name] = factory()
        return value


class Clock:
    """Advances a `CallState` from transformer calls and scheduler steps.

    With a pipeline, `scheduler.step` ends a step, so the branch is the number of transformer calls since
    the last scheduler step: correct for batched CFG (one call), separate CFG (two calls) and no CFG, with
    no configuration. A bare transformer has no scheduler: `calls_per_step` (1 for batched CFG, 2 for
    separate CFG, from the adapter or `handle.generation(calls_per_step=...)`) splits calls into steps.
    """

    def __init__(self, calls_per_step: int | None) -> None:
        self.calls_per_step = calls_per_step
        self.state = CallState()
        self._generations = 0

    @property
    def generations(self) -> int:
        return self._generations

    def new_generation(self, num_steps: int | None = None,
                       call_returned: Callable[[], bool] | None = None) -> CallState:
        self._generations += 1
        self.state = CallState(generation=self._generations, num_steps=num_steps, call_returned=call_returned)
        return self.state

    def on_transformer_call(self) -> CallState:
        state = self.state
        if self.calls_per_step is not None and state._calls_in_step >= self.calls_per_step:
            state.step += 1
            state._calls_in_step = 0
        state.branch = state._calls_in_step
        state._calls_in_step += 1
        state.calls += 1
        return state

    def on_scheduler_step(self) -> None:
        if self.calls_per_step is None:
            self.state.step += 1
            self.state._calls_in_step = 0
