"""The protocols between whole-transformer CUDA graphs (compile) and what must not end up in a graph.

A replayed graph runs no Python, so hooks inside the transformer cannot decide anything on replay. A
feature whose hooks change what a call computes provides `GraphDecisions` through its attach context;
the graph runner then asks it *before* each call which graph to run, forces that decision while a graph
is being warmed up and captured, and reports every replayed call back so that statistics stay right.
When several features decide (the cache's computed or cached step, the attention kernel of the step's
phase), `combine` makes them one: the graph key holds every feature's decision.
The core provides `EagerCalls`: the calls the first-call check of the adapter observes run uncaptured.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator
from typing import Any, ContextManager, Protocol, TypeVar, runtime_checkable

from hookkit.errors import HookError

T = TypeVar("T")


@runtime_checkable
class GraphDecisions(Protocol):
    """Per-call decisions known before the call, for a graph runner keyed by them."""

    def decision(self, shapes: Hashable = None) -> Hashable:
        """The decision for the transformer call about to run (part of the graph key); never reads the device.

        `shapes`: the shapes of the call's tensor inputs.
        """
        ...

    def forcing(self, decision: Hashable) -> ContextManager[None]:
        """Make the hooks take `decision` (and record nothing) while a graph is warmed up and captured."""
        ...

    def replayed(self, decision: Hashable, shapes: Hashable = None, graph: Hashable = None) -> None:
        """Account for one transformer call served by a graph with `decision`.

        `graph`: the graph's whole decision key (every deciding feature's decision, `combine`; None when this
        feature alone decides): for a feature whose accounting depends on what the others decided."""
        ...

    def adopted(self, shapes: Hashable = None) -> None:
        """Account for one transformer call run eagerly (`EagerCalls`), which the hooks decided and recorded."""
        ...


@runtime_checkable
class SplitDecisions(Protocol):
    """Per-call decisions that need a device statistic (a threshold), for a runner that splits each call into
    a head graph ending with the statistic, one host read of it, and the tail graph of the decision.

    The runner captures a head and a tail together (one Python execution) per (signature, branch, decision),
    while the hooks run `forcing(decision)`; inside, the feature computes the statistic and calls
    `on_decision(statistic)` exactly once, where the runner cuts the capture.
    """

    #: False when every decision is known before the call (then `GraphDecisions` serves)
    dynamic: bool
    #: set by the runner while it captures; the feature calls it with the statistic at the decision point
    on_decision: Callable[[Any], None] | None
    #: each branch's last decision: which pair the runner replays first
    last_cached: dict[int, bool]

    def host_decision(self, signature: Hashable) -> tuple[int, bool | None]:
        """(branch, decision) from what the host knows, or (branch, None) when the statistic decides."""
        ...

    def judge(self, branch: int, statistic: float) -> bool:
        """The decision for the statistic read after the head replayed (recorded in the statistics)."""
        ...

    def forcing(self, decision: Hashable) -> ContextManager[None]:
        """Make the hooks take `decision` (a `(branch, cached)` pair) and record nothing."""
        ...

    def finish(self, branch: int, cached: bool, signature: Hashable) -> None:
        """Account for one transformer call served by a head and a tail."""
        ...

    def adopted(self, signature: Hashable) -> None:
        """Account for one transformer call run eagerly (`EagerCalls`), which the hooks decided (the statistic read
        eagerly) and recorded: keep what a pair-served call leaves (the statistic's reference among it)."""
        ...


@runtime_checkable
class EagerCalls(Protocol):
    """Transformer calls that a graph runner must run eagerly, neither capturing nor replaying (the core provides it).

    The first-call check of the adapter (`hookkit.core.firstcall`) observes its call with hooks on every block: a
    graph captured then would hold them (and be dropped when they go, a second capture), and the check's host reads
    cannot run inside a capture. So the runner runs that call as eager mode does (a feature that decides per call
    decides it in its hooks and is told with `adopted`), captures nothing, and captures from the next call on: no
    graph ever contains an observer, and the call's output and errors are eager mode's.
    """

    def eager(self) -> bool:
        """Whether the transformer call now running must run eagerly (True only inside it)."""
        ...


class CombinedDecisions:
    """Several features' `GraphDecisions` as one: the decision is the tuple of theirs (in attach order), forcing
    forces each feature's part, and each replayed or adopted call is reported to every feature."""

    def __init__(self, parts: list[GraphDecisions]) -> None:
        self.parts = parts

    def decision(self, shapes: Hashable = None) -> tuple[Hashable, ...]:
        return tuple(part.decision(shapes) for part in self.parts)

    @contextlib.contextmanager
    def forcing(self, decision: tuple[Hashable, ...]) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for part, value in zip(self.parts, decision, strict=True):
                stack.enter_context(part.forcing(value))
            yield

    def replayed(self, decision: tuple[Hashable, ...], shapes: Hashable = None, graph: Hashable = None) -> None:
        for part, value in zip(self.parts, decision, strict=True):
            part.replayed(value, shapes, graph=decision)

    def adopted(self, shapes: Hashable = None) -> None:
        for part in self.parts:
            part.adopted(shapes)


def combine(protocol: type[T], services: list[T]) -> T:
    """The one service of `protocol` that `services` (each a feature's, in attach order) make: the only one, or
    their `CombinedDecisions` for `GraphDecisions`; other protocols have one provider."""
    if len(services) == 1:
        return services[0]
    if protocol is GraphDecisions:
        return CombinedDecisions(services)  # type: ignore[return-value]
    raise HookError(f"{protocol.__name__}: expected one feature to provide it, got {len(services)}; the core combines "
                    "only GraphDecisions. Report this to hookkit.")
