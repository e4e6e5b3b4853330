"""What hookkit's inductor graph passes share: node helpers, a rewrite count per graph, a chained pass, a cache key.

A pass is passed in the `options` of hookkit's own `torch.compile` calls, never set process-wide, so a pass the user
configured process-wide for the same slot is chained after it (`then`) instead of dropped. Inductor caches compiled
graphs (its FX graph cache) by a key that includes each custom pass's `uuid()`: the key holds the pass's source file
and settings, so a changed pass or setting compiles anew and an unchanged one reuses the cached graph.
"""

from __future__ import annotations

import hashlib
from abc import abstractmethod
from collections.abc import Callable
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass


_TRITON: list[bool] = []


def has_triton() -> bool:
    """Whether hookkit's Triton kernels can be built here (else their ops run their reference arithmetic); checked
    once. libdevice is what the fp8 row kernel's tanh needs, as inductor's does."""
    if not _TRITON:
        try:
            from triton.language.extra import libdevice  # noqa: F401

            _TRITON.append(True)
        except ImportError:
            _TRITON.append(False)
    return _TRITON[0]


def is_call(node: Any, target: Any) -> bool:
    """Whether `node` is an FX call of `target`."""
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target == target


def binary(node: Any, target: Any) -> tuple[Any, Any] | None:
    """The two operands of `node` when it is an FX call of `target` with exactly two positional arguments, else None."""
    if not is_call(node, target) or len(node.args) != 2 or node.kwargs:
        return None
    return node.args[0], node.args[1]


def orders(pair: tuple[Any, Any] | None) -> tuple[tuple[Any, Any], ...]:
    """Both operand orders of a commutative operation's `binary` match (none when it did not match)."""
    return (pair, pair[::-1]) if pair is not None else ()


def last_dim(dim: Any, ndim: int) -> bool:
    """Whether `dim` names the last of `ndim` dimensions (-1 or ndim - 1)."""
    return isinstance(dim, int) and not isinstance(dim, bool) and dim in (-1, ndim - 1)


def fake_call(graph: torch.fx.Graph, fake: Any, target: Any, *args: Any, **kwargs: Any) -> torch.fx.Node:
    """A new FX call of `target` (at the graph's insertion point) with the fake value inductor expects on every node:
    `target` run under the fake mode `fake` on its arguments' fake values."""
    node = graph.call_function(target, args, kwargs)
    vals = torch.utils._pytree.tree_map_only(torch.fx.Node, fake_value, args)
    with fake:
        node.meta["val"] = target(*vals, **kwargs)
    return node


def fake_value(node: Any) -> Any:
    """The fake tensor (or value) inductor recorded for `node`; None for a constant or an unrecorded node."""
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


class CountingPass(CustomGraphPass):
    """An inductor graph pass that rewrites matches in place and counts them per graph (`per_graph`, compile order).

    Subclasses implement `rewrite` (returning how many sites it rewrote) and set `source` (their file's bytes, part of
    the cache key); `settings` adds what else changes the rewrite.

    Args:
        then: a pass already configured for the same slot, run after this one on the rewritten graph.
    """

    source: bytes = b""

    def __init__(self, then: Callable[[torch.fx.Graph], None] | None = None) -> None:
        self.then = then
        self.per_graph: list[int] = []

    @property
    def rewritten(self) -> int:
        """Sites rewritten by this instance's compiles, all graphs together (a graph served from inductor's FX graph
        cache is not rewritten again: it was rewritten when cached)."""
        return sum(self.per_graph)

    @abstractmethod
    def rewrite(self, graph: torch.fx.Graph) -> int:
        """Rewrite the matches in `graph` in place; return how many were rewritten."""

    def settings(self) -> tuple[Any, ...]:
        return ()

    def __call__(self, graph: torch.fx.Graph) -> None:
        found = self.rewrite(graph)
        if found:
            graph.eliminate_dead_code()
            graph.lint()
        self.per_graph.append(found)
        if self.then is not None:
            self.then(graph)

    def uuid(self) -> bytes:
        """Inductor's FX graph cache key: the pass's source, its settings and the chained pass."""
        then = self.then.uuid() if isinstance(self.then, CustomGraphPass) else repr(self.then)
        return hashlib.sha256(self.source + repr((self.settings(), then)).encode()).digest()
