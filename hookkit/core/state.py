"""Per-call state: which generation, which denoising step, which CFG branch.

A `CallState` is created fresh at the start of every pipeline call (when the pipeline calls
`scheduler.set_timesteps`) or every `with handle.generation():` block, so nothing leaks from one call
into the next, not even after an exception halfway through. Features keep their per-call data in
`CallState.features`, keyed by feature name; specs and hooks hold none.
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

    def new_generation(self, num_steps: int | None = None) -> CallState:
        self._generations += 1
        self.state = CallState(generation=self._generations, num_steps=num_steps)
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
