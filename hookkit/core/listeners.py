"""Scheduler listeners: how features act around `scheduler.set_timesteps` and `scheduler.step`.

A scheduler method carries one hookkit patch, the core's (two patches on one method would each have to
know the other). Features that need the scheduler (the sync-free loop, the sync profiler) add a listener
through their attach context instead; the core's patches call every listener in order.
"""

from __future__ import annotations

from typing import Any


class SchedulerListener:
    """Callbacks run by the core's scheduler patches. Override what you need; the defaults do nothing."""

    def after_set_timesteps(self, scheduler: Any) -> None:
        """After the pipeline's `set_timesteps` and the start of a fresh `CallState`."""

    def before_step(self, scheduler: Any, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Before `step`; may replace its arguments. Listeners run in registration order."""
        return args, kwargs

    def after_step(self, scheduler: Any) -> None:
        """After `step` (also when it or a later listener's `before_step` raised), before the clock advances; in
        reverse registration order, for every listener whose `before_step` returned."""
