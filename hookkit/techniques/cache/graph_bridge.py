"""DBCache under whole-transformer CUDA graphs (`Compile(cuda_graphs="transformer")`): `GraphBridge`, which the
cache provides to compile's graph runner as `hookkit.core.graphs.GraphDecisions` and `SplitDecisions`, and
`graph_bridge(handle)`, which installs and returns it.

Split from `hooks.py` (which re-exports `GraphBridge` and `graph_bridge`) because it is the one part that matters
only under graphs: decisions taken on the host before a replay, the statistic computed inside a captured head,
persistent residual slots, TaylorSeer state kept eagerly outside the graphs. It imports the per-call state from
`state.py` and never `hooks.py`, which imports it: the hooks' shared object is typed by the `_Shared` protocol
below (the part of `hooks._Shared` the bridge uses), so that no import, type-only ones included, runs in a circle.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator
from typing import Any, Protocol

import torch

from hookkit.core.feature import AttachContext
from hookkit.core.graphs import SplitDecisions
from hookkit.errors import HookError, UnsupportedError
from hookkit.techniques.cache.state import _Branch, _CallState, _Layout, relative_l1


class _Shared(Protocol):
    """What the bridge reads and sets of the DBCache hooks' shared object (`hooks._Shared`)."""

    handle: AttachContext
    layout: _Layout
    graph: GraphBridge | None

    def call_state(self) -> _CallState: ...


class GraphBridge:
    """DBCache under whole-transformer CUDA graphs (`hookkit.Compile(cuda_graphs="transformer")`).

    A replayed graph runs no Python. With dynamic decisions (a threshold), the graph side splits each call at
    the decision (`SplitGraphHook`): `host_decision` applies the rules that read nothing from the device,
    `at_decision` computes the statistic inside the captured head (and marks the cut), the caller reads it
    once and `judge`s it, `finish` keeps the statistics. With a static mask the decision is known *before*
    the call (this and the rest of this docstring). The graph runner keys its graphs
    by `(branch, cached)` besides the input signature, forces that decision while a graph is warmed up and
    captured (hooks then record nothing), and reports every call with `replayed()`, which keeps the
    statistics. Residuals live in persistent slots (one per branch, stream and shape) that the computed-step
    graph writes and the cached-step graph of the same shape reads, so their addresses never change across
    replays or calls.
    """

    def __init__(self, shared: _Shared) -> None:
        self.shared = shared
        self.forced: bool | None = None
        #: TaylorSeer under graphs: each branch's computed residuals and their differences are kept eagerly outside
        #: the graphs (copies of the slots after each computed call, per call: `_CallState.graph_taylor`); before a
        #: cached call their extrapolation is written into the slots the cached-step graph reads (`prepare_cached`),
        #: so a replay adds what eager mode's `_Branch.predict` adds
        self.order = shared.layout.spec.taylorseer_order
        self.slots: dict[tuple[Any, ...], torch.Tensor] = {}
        self.last: dict[int, list[torch.Tensor | None]] = {}
        #: dynamic decisions (a threshold): the call is split at the decision (`SplitGraphHook` in
        #: hookkit.techniques.compile.hooks); below, what that needs
        self.dynamic: bool = shared.layout.needs_diff
        #: Fn residual of each branch's last computed step, per geometry: the reference of the statistic
        self.refs: dict[tuple[Any, ...], torch.Tensor] = {}
        #: set by the graph side while it captures: called with the statistic where the first graph ends
        self.on_decision: Callable[[torch.Tensor], None] | None = None
        #: each branch's last decision (which pair of graphs to try first)
        self.last_cached: dict[int, bool] = {}

    # -- dynamic decisions (threshold) under split graphs ----------------------------------------------------

    def host_decision(self, signature: Hashable) -> tuple[int, bool | None]:
        """(branch, cached) for the transformer call about to run, or (branch, None) when the diff decides.

        `signature`: of the call's inputs. A call whose signature differs from the branch's last computed step
        in this generation is computed (no residual of its geometry exists, or the batch changed).
        """
        state = self.shared.handle.state
        cs = self.shared.call_state()
        branch = cs.branch_at(state.branch)
        if cs.graph_shapes.get(state.branch) != signature:
            return state.branch, False
        return state.branch, cs.host_rules(state.step, branch)

    def judge(self, index: int, diff: float) -> bool:
        """Rule 8 for the statistic the first graph computed (read once on the host by the caller)."""
        cs = self.shared.call_state()
        if cs.parallel is not None:  # the head graph's statistic is this rank's shard only: ranks could disagree
            raise UnsupportedError(
                "DBCache threshold under Compile(cuda_graphs='transformer'): expected one process, got context "
                f"parallelism over {cs.parallel.world_size} ranks (the split graphs' statistic is per shard, so ranks "
                "could decide differently and deadlock). Use a static mask (DBCache(steps_mask=..., "
                "mask_policy='static')) or Compile(cuda_graphs='none') under context parallelism.")
        return cs.judge(self.shared.handle.state.step, cs.branch_at(index), diff)

    def at_decision(self, index: int, hidden: torch.Tensor, block0: torch.Tensor | None) -> None:
        """Inside a forced call (warm-up or capture): compute the statistic from the Fn residual, cut the capture
        there, and on a computed step keep the Fn residual as the branch's new reference (after the cut, so that
        the statistic of the step reads the previous one)."""
        if block0 is None or block0.shape != hidden.shape:
            raise HookError(
                f"DBCache under split transformer graphs: expected the hidden input of block 0 of this call at the "
                f"first middle block (shape {tuple(hidden.shape)}), got "
                f"{'none' if block0 is None else tuple(block0.shape)}. The transformer skipped or reshaped block 0; "
                "use Compile(cuda_graphs='none') with this model."
            )
        residual = hidden - block0
        key = (index, tuple(residual.shape), residual.dtype, residual.device)
        ref = self.refs.get(key)
        if ref is None:
            ref = self.refs[key] = torch.zeros_like(residual)  # read only after a computed step wrote it
        statistic = relative_l1(residual, ref)
        if self.on_decision is not None:
            self.on_decision(statistic)
        if not self.forced:
            ref.copy_(residual)

    def finish(self, index: int, cached: bool, signature: Hashable) -> None:
        """Account for one transformer call served by a pair of graphs (statistics, which residuals exist)."""
        self.replayed((index, cached), signature)
        self.last_cached[index] = cached

    # -- static decisions ---------------------------------------------------------------------------------------

    def decision(self, shapes: Hashable = None) -> tuple[int, bool]:
        """(branch, cached) for the transformer call about to run; never reads the device.

        `shapes`: of the call's tensor inputs. A step whose inputs differ from the branch's last computed step
        (the batch halved by a CFG cutoff within the call) is computed: no residual of its geometry exists.
        """
        state = self.shared.handle.state
        cs = self.shared.call_state()
        cached = cs.rules(state.step, cs.branch_at(state.branch), None)
        cached = cached and cs.graph_shapes.get(state.branch) == shapes
        if cached:
            self.prepare_cached(state.branch, state.step)
        return state.branch, cached

    def prepare_cached(self, index: int, step: int) -> None:
        """TaylorSeer under graphs, before a cached call of branch `index`: write the extrapolation of its residuals at
        `step` into the slots the cached-step graph reads (eager ops on the current stream: no host read)."""
        taylor = self.shared.call_state().graph_taylor.get(index)
        slots = self.last.get(index)
        if taylor is None or slots is None:
            return
        for stream, slot in enumerate(slots):
            if slot is not None and taylor.d1[stream] is not None and taylor.residual[stream] is not None \
                    and taylor.residual[stream].shape == slot.shape:
                slot.copy_(taylor.extrapolate(stream, step))

    def _keep_taylor(self, index: int, step: int) -> None:
        """After a computed call of branch `index`: its slots hold the new residuals; keep copies and differences."""
        if not self.order:
            return
        slots = self.last.get(index, [None, None])
        taylor = self.shared.call_state().graph_taylor.setdefault(index, _Branch())
        taylor.store(step, tuple(s.clone() if s is not None else None for s in slots), self.order)

    @contextlib.contextmanager
    def forcing(self, decision: tuple[int, bool]) -> Iterator[None]:
        self.forced = decision[1]
        try:
            yield
        finally:
            self.forced = None

    def persist(self, branch: int, residuals: tuple[torch.Tensor, Any]) -> tuple[torch.Tensor, Any]:
        """Copy residuals into this branch's persistent slots and return the slots."""
        out: list[torch.Tensor | None] = []
        for stream, y in enumerate(residuals):
            if y is None:
                out.append(None)
                continue
            key = (branch, stream, tuple(y.shape), y.dtype, y.device)
            slot = self.slots.get(key)
            if slot is None:
                slot = self.slots[key] = torch.empty_like(y)
            out.append(slot.copy_(y))
        self.last[branch] = out
        return out[0], out[1]  # type: ignore[return-value]

    def use_slots(self, branch: _Branch, index: int, hidden: torch.Tensor, encoder: Any) -> None:
        """Point `branch` at its slots shaped like this call's streams, for a cached-step graph being captured.

        `replayed` can only point it at the slots written last, and a replayed computed-step graph writes
        the slots of its own geometry without telling Python: after a call at another resolution those
        would be the wrong ones.
        """
        for stream, like in enumerate((hidden, encoder)):
            if isinstance(like, torch.Tensor):
                slot = self.slots.get((index, stream, tuple(like.shape), like.dtype, like.device))
                if slot is not None:
                    branch.residual[stream] = slot

    def adopted(self, shapes: Hashable = None) -> None:
        """Take over a transformer call the hooks decided and recorded themselves, run eagerly under the graphs (the
        first-call check's): keep what a graph-served call leaves for the next ones.

        `shapes`: of the call's tensor inputs (unsplit graphs) or its signature (split graphs), as `replayed` gets
        them. The residual slots are the hooks' already (`persist`); a computed step also sets the geometry of the
        branch's last computed step and, with a threshold, the reference of the statistic (its Fn residual).
        """
        state = self.shared.handle.state
        cs = self.shared.call_state()
        index = state.branch
        branch = cs.branch_at(index)
        if branch.computed and branch.computed[-1] == state.step:
            cached = False
        elif branch.cached and branch.cached[-1] == state.step:
            cached = True
        else:  # no middle block decided in this call: nothing to take over
            return
        self.last_cached[index] = cached
        if cached:
            return
        cs.graph_shapes[index] = shapes
        self._keep_taylor(index, state.step)
        residual = branch.fn_ref
        if self.dynamic and residual is not None:
            key = (index, tuple(residual.shape), residual.dtype, residual.device)
            ref = self.refs.get(key)
            if ref is None:
                ref = self.refs[key] = torch.empty_like(residual)
            # the slot is the reference from now on (pair-served computed steps rewrite it): no second copy is held
            branch.fn_ref = ref.copy_(residual)

    def replayed(self, decision: tuple[int, bool], shapes: Hashable = None, graph: Hashable = None) -> None:
        """Account for one transformer call served by a graph (statistics, and which residuals exist)."""
        index, cached = decision
        state = self.shared.handle.state
        cs = self.shared.call_state()
        branch = cs.branch_at(index)
        branch.record(state.step, cached)
        if not cached:
            branch.residual = list(self.last.get(index, [None, None]))
            cs.graph_shapes[index] = shapes
            self._keep_taylor(index, state.step)
        layout = self.shared.layout
        cs.block_calls += layout.always_run if cached else layout.num_blocks
        cs.transformer_calls += 1


def graph_bridge(handle: Any) -> GraphBridge | None:
    """Install (once) and return the bridge of a `hookkit.Handle` with DBCache, or None without DBCache (read as the
    `SplitDecisions` service, which DBCache alone provides; `GraphDecisions` may combine it with others')."""
    return handle.service(SplitDecisions)


def _install_bridge(shared: _Shared) -> GraphBridge:
    if shared.graph is None:
        shared.graph = GraphBridge(shared)
    return shared.graph
