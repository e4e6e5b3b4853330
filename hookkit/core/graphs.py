"""The protocol between whole-transformer CUDA graphs (compile) and a feature that decides per call (cache).

A replayed graph runs no Python, so hooks inside the transformer cannot decide anything on replay. A
feature whose hooks change what a call computes provides `GraphDecisions` through its attach context;
the graph runner then asks it *before* each call which graph to run, forces that decision while a graph
is being warmed up and captured, and reports every replayed call back so that statistics stay right.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import ContextManager, Protocol, runtime_checkable


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

    def replayed(self, decision: Hashable, shapes: Hashable = None) -> None:
        """Account for one transformer call served by a graph with `decision`."""
        ...
