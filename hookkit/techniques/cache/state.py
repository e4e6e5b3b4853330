"""DBCache's layout and per-call state: where Fn / M / Bn are (`_Layout`), each CFG branch's residuals and their
TaylorSeer differences (`_Branch`), and the rules that decide which steps are cached, per CFG branch
(`_CallState.rules`). All of it is per pipeline call (`CallState.features["cache"]`).

Host syncs: only a threshold decision reads the device, one `.item()` per step and branch (under context
parallelism after one all-reduce of its two sums, so every rank decides alike); a static mask needs none.
Everything kept across steps is computed outside any compiled region, so outputs of compiled regions or CUDA
graphs are never held across calls.

A module of its own, split from `hooks.py` (which re-exports its names), because the hooks, the graph bridge
(`graph_bridge.py`) and the summary (`summary.py`) all read this state while `hooks.py` imports the other two:
kept below all three, it lets none of them import another in a circle (tests/test_architecture.py counts
type-only imports too). No hooks live here.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any

import attrs
import torch

from hookkit.core.parallel import ParallelInfo, global_sums
from hookkit.errors import SpecError
from hookkit.techniques.cache.spec import (
    DBCache,
    effective_warmup_steps,
    resolve_steps_mask,
    resolved_extrapolate,
    rule_mask,
)

#: the feature's name: its `Spec` field, its `CallState.features` key and its summary key
NAME = "cache"


# --- layout (fixed at attach time) -------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class _Layout:
    """Where Fn / M / Bn are, and whether decisions ever need the Fn residual. Immutable."""

    spec: DBCache
    num_blocks: int
    #: True unless no decision can ever reach the threshold (static mask, or threshold 0)
    needs_diff: bool
    #: what a cached step reuses on this model: "residual" or "output" (`spec.resolved_extrapolate`)
    extrapolate: str = "residual"

    @property
    def num_middle(self) -> int:
        return self.num_blocks - self.spec.fn_blocks - self.spec.bn_blocks

    @property
    def always_run(self) -> int:
        return self.spec.fn_blocks + self.spec.bn_blocks


def _layout(spec: DBCache, num_blocks: int, between_block_args: tuple[str, ...] = ()) -> _Layout:
    if spec.fn_blocks + spec.bn_blocks >= num_blocks:
        raise SpecError(
            f"DBCache.fn_blocks + DBCache.bn_blocks: expected fewer than the {num_blocks} blocks of the model so "
            f"that at least one middle block can be cached, got fn_blocks={spec.fn_blocks} + "
            f"bn_blocks={spec.bn_blocks} = {spec.fn_blocks + spec.bn_blocks}. Lower one of them."
        )
    static_mask = spec.steps_mask is not None and spec.mask_policy == "static"
    needs_diff = spec.rule == "threshold" and not static_mask and spec.threshold > 0
    return _Layout(spec=spec, num_blocks=num_blocks, needs_diff=needs_diff,
                   extrapolate=resolved_extrapolate(spec, between_block_args))


# --- per-call state -----------------------------------------------------------------------------------------


class _Branch:
    """Cache state of one CFG branch during one pipeline call."""

    def __init__(self) -> None:
        self.computed: list[int] = []
        self.cached: list[int] = []
        self.diffs: dict[int, float] = {}
        self.accumulated = 0.0
        #: cached steps in a row just before the current one
        self.run = 0
        #: Fn residual of the last computed step (the reference for the diff)
        self.fn_ref: torch.Tensor | None = None
        #: middle residual of the last computed step, and its divided differences (TaylorSeer), per stream
        self.residual: list[torch.Tensor | None] = [None, None]
        self.d1: list[torch.Tensor | None] = [None, None]
        self.d2: list[torch.Tensor | None] = [None, None]
        #: the last computed steps, oldest first (at most 2 kept)
        self.times: list[int] = []
        #: `extrapolate="output"`: the input shapes the kept outputs belong to, and the last computed output (whose
        #: structure a cached call returns; `hooks.DBCacheOutputHook`)
        self.signature: Hashable | None = None
        self.template: Any = None

    def restart(self, signature: Hashable) -> None:
        """Forget the kept residuals (or outputs) and their differences: the call's geometry changed, nothing kept
        fits it. The computed and cached steps stay recorded (the summary counts them)."""
        n = len(self.residual)
        self.residual, self.d1, self.d2 = [None] * n, [None] * n, [None] * n
        self.times = []
        self.signature, self.template = signature, None

    def store(self, step: int, residuals: tuple[torch.Tensor | None, torch.Tensor | None], order: int) -> None:
        """Keep the middle residuals of computed step `step` and, for TaylorSeer, their derivative estimates in
        the paper's form: each difference taken against the previous computed step and divided by the gap. Two
        streams (hidden, encoder) for "residual"; one per floating tensor of the output for "output"."""
        if len(residuals) > len(self.residual):
            grow = [None] * (len(residuals) - len(self.residual))
            self.residual, self.d1, self.d2 = self.residual + grow, self.d1 + grow, self.d2 + grow
        for s, y in enumerate(residuals):
            if y is None:
                continue
            previous = self.residual[s]
            if previous is not None and previous.shape != y.shape:  # a new geometry: start the trajectory over
                previous = self.d1[s] = self.d2[s] = None
            if order >= 1 and previous is not None:
                gap = step - self.times[-1]
                d1 = (y - previous).div_(gap)
                old_d1 = self.d1[s]
                if order >= 2 and old_d1 is not None:
                    self.d2[s] = (d1 - old_d1).div_(gap)
                self.d1[s] = d1
            self.residual[s] = y
        self.times = [*self.times[-1:], step]

    def predict(self, stream: int, step: int, base: torch.Tensor) -> torch.Tensor:
        """`base` + the middle residual at `step`: the stored one, or its Taylor extrapolation y + d1 k + d2 k^2 / 2
        (k: steps since the last computed one). `calibration.predict_weights` is the same sum, for planning."""
        if self.d1[stream] is None:
            return base + self.residual[stream]
        return self.extrapolate(stream, step).add_(base)

    def value(self, stream: int, step: int) -> torch.Tensor:
        """The kept tensor of `stream` at `step` alone (no base): its extrapolation, or a copy of it before a first
        difference exists. A new tensor either way, so the caller may change it in place."""
        if self.d1[stream] is None:
            return self.residual[stream].clone()
        return self.extrapolate(stream, step)

    def extrapolate(self, stream: int, step: int) -> torch.Tensor:
        """The Taylor extrapolation of the middle residual at `step` (needs a first difference), a new tensor."""
        dt = step - self.times[-1]
        out = torch.add(self.residual[stream], self.d1[stream], alpha=dt)
        d2 = self.d2[stream]
        if d2 is not None:
            out.add_(d2, alpha=dt * dt / 2)
        return out

    def record(self, step: int, cached: bool) -> None:
        if cached:
            self.cached.append(step)
            self.run += 1
        else:
            self.computed.append(step)
            self.run = 0


def _fits(branch: _Branch, middle: tuple[torch.Tensor, Any]) -> bool:
    """Whether the branch's stored residuals have the shapes of this call's middle inputs."""
    hidden, encoder = middle
    if branch.residual[0] is None or branch.residual[0].shape != hidden.shape:
        return False
    stored = branch.residual[1]
    return stored is None or not isinstance(encoder, torch.Tensor) or stored.shape == encoder.shape


class _CallState:
    """Everything DBCache keeps during one pipeline call (lives in `CallState.features["cache"]`)."""

    def __init__(self, layout: _Layout, num_steps: int | None, parallel: ParallelInfo | None = None) -> None:
        spec = layout.spec
        self.layout = layout
        #: the context-parallel group the transformer runs under in this call (None: one process); the diff is
        #: then reduced over it so that every rank takes the same decision (`hookkit.core.parallel`)
        self.parallel = parallel
        #: all-reduces made for decisions in this call (one per decided step under context parallelism)
        self.collectives = 0
        if isinstance(spec.steps_mask, str) and num_steps is None:
            raise SpecError(
                f"DBCache.steps_mask: the named policy {spec.steps_mask!r} is scaled to the number of steps, which "
                "is unknown here (a bare transformer without it). Use `with handle.generation(num_steps=N):`, or "
                "pass an explicit list of 0/1."
            )
        if spec.rule != "threshold":
            if num_steps is None:
                raise SpecError(
                    f"DBCache(rule={spec.rule!r}): the rule plans the call's steps before it starts, and the number of "
                    "steps is unknown here (a bare transformer without it). Use `with handle.generation(num_steps=N):`.")
            mask: tuple[int, ...] | None = rule_mask(spec, num_steps, layout.num_blocks)
        else:
            mask = spec.steps_mask if num_steps is None else resolve_steps_mask(spec.steps_mask, num_steps)
        self.mask = mask
        warmup = effective_warmup_steps(spec, num_steps)
        self.num_steps = num_steps
        #: steps of the warm-up as given (before a mask cuts it), for the summary's "why nothing was cached"
        self.warmup_given = warmup
        if mask is not None:
            leading = next((i for i, m in enumerate(mask) if m != 1), len(mask))
            warmup = min(warmup, leading)
        #: the warm-up computes steps 0, interval, 2 interval, ... below `warmup_end` (kept as two ints: a huge
        #: warmup_steps costs nothing)
        self.warmup_end = warmup
        self.warmup_interval = spec.warmup_interval
        self.static = mask is not None and (spec.mask_policy == "static" or spec.rule != "threshold")
        self.branches: dict[int, _Branch] = {}
        #: decision of the current transformer call, and its branch and step
        self.skip = False
        self.branch = _Branch()
        self.branch_index = 0
        self.step = 0
        #: the hidden input of block 0 (only when diffs are needed) and of the first middle block, and the
        #: transformer call (`handle.state.calls`) block 0 ran in and the one the current decision is for
        self.block0_hidden: torch.Tensor | None = None
        self.block0_call = -1
        self.decided_call = -1
        #: under whole-transformer graphs: input shapes of each branch's last computed step
        self.graph_shapes: dict[int, Hashable] = {}
        self.middle_in: tuple[torch.Tensor, Any] = (None, None)  # type: ignore[assignment]
        #: the transformer call given ControlNet residuals or VACE control (an adapter `between_block_args`
        #: argument), and on a computed step of such a call: the last middle block's (hidden, encoder) output and
        #: what the model added between middle blocks since the first one, per stream
        self.between_call = -1
        self.track_between = False
        self.prev_out: tuple[Any, Any] = (None, None)
        self.between: list[torch.Tensor | None] = [None, None]
        self.block_calls = 0
        self.transformer_calls = 0
        #: under graphs with TaylorSeer: the bridge's copies of each branch's computed residuals (`GraphBridge`)
        self.graph_taylor: dict[int, _Branch] = {}

    def decide(self, step: int, branch_index: int, fn_residual: torch.Tensor | None,
               middle: tuple[torch.Tensor, Any] | None = None) -> bool:
        """Whether this call (step, branch) reuses the middle residual. Records the outcome.

        `fn_residual`: Fn output minus the input of block 0, or None when no rule can need it. `middle`: the
        first middle block's (hidden, encoder) inputs, whose shapes the stored residuals must have.
        """
        branch = self.branch_at(branch_index)
        self.branch, self.branch_index, self.step = branch, branch_index, step
        cached = self.rules(step, branch, fn_residual, middle)
        if not cached and fn_residual is not None:
            branch.fn_ref = fn_residual
        branch.record(step, cached)
        layout = self.layout
        self.block_calls += layout.always_run if cached else layout.num_blocks
        self.transformer_calls += 1
        self.skip = cached
        return cached

    def branch_at(self, index: int) -> _Branch:
        branch = self.branches.get(index)
        if branch is None:
            branch = self.branches[index] = _Branch()
        return branch

    def force(self, step: int, branch_index: int, cached: bool) -> None:
        """Take a decision made elsewhere (a CUDA graph being warmed up or captured); records nothing."""
        self.branch, self.branch_index, self.step = self.branch_at(branch_index), branch_index, step
        self.skip = cached

    def rules(self, step: int, branch: _Branch, residual: torch.Tensor | None,
              middle: tuple[torch.Tensor, Any] | None = None) -> bool:
        """Whether this call (step, branch) may reuse the middle residual; records nothing (`decide` records).

        Checked in this order; the first rule that applies decides:
          1. no computed step yet in this branch             -> compute (nothing to reuse)
          2. warmup: step in range(0, warmup, warmup_interval) -> compute; with a `steps_mask` the warmup is cut
             to the mask's leading run of 1s, so the mask is the schedule (as in cache-dit)
          3. `steps_mask`: a 1 computes; a 0 with mask_policy="static" caches (nothing below is consulted);
             a 0 with "dynamic" goes on to the rules below
          4. `max_cached_steps` cached steps already         -> compute
          5. `max_continuous_cached_steps` cached in a row   -> compute (the run restarts at every computed step)
          6. the diffs so far sum to `max_accumulated_diff`  -> compute (for the rest of the call)
          7. threshold <= 0                                   -> compute
          8. diff = mean|r - r_ref| / mean|r_ref| of the Fn residual r against r_ref, the Fn residual of this
             branch's last computed step: cache iff diff < threshold (the one `.item()` of a decision).
             Under context parallelism each rank holds a sequence shard: the sums are reduced first (`_diff`).
        """
        host = self.host_rules(step, branch, middle)
        if host is not None:
            return host
        ref = branch.fn_ref
        if residual is None or ref is None or ref.shape != residual.shape:
            return False
        # The one device-to-host read of a dynamic decision (after one all-reduce under context parallelism).
        return self.judge(step, branch, self._diff(residual, ref))

    def host_rules(self, step: int, branch: _Branch, middle: tuple[torch.Tensor, Any] | None = None) -> bool | None:
        """Rules 1-7 of `rules`, which read nothing from the device: cached (True), computed (False), or None
        when rule 8, the diff against the threshold, decides."""
        spec = self.layout.spec
        if branch.residual[0] is None or self.in_warmup(step):
            return False
        if middle is not None and not _fits(branch, middle):
            return False  # the batch or geometry changed within the call (e.g. CFG cut off part-way): compute
        mask = self.mask
        if mask is not None:
            if step >= len(mask) or mask[step] == 1:
                return False
            if self.static:
                return True
        if 0 <= spec.max_cached_steps <= len(branch.cached):
            return False
        if 0 <= spec.max_continuous_cached_steps <= branch.run:
            return False
        if spec.max_accumulated_diff is not None and branch.accumulated >= spec.max_accumulated_diff:
            return False
        if spec.threshold <= 0:
            return False
        return None

    def in_warmup(self, step: int) -> bool:
        return step < self.warmup_end and step % self.warmup_interval == 0

    def warmup_steps(self) -> list[int]:
        """The warm-up's steps within the call (at most `num_steps` of them, for the summary)."""
        end = min(self.warmup_end, self.step + 1 if self.num_steps is None else self.num_steps)
        return list(range(0, end, self.warmup_interval))

    def judge(self, step: int, branch: _Branch, diff: float) -> bool:
        """Rule 8 for a diff read from the device: records it, and caches iff it is below the threshold."""
        branch.diffs[step] = diff
        branch.accumulated += diff
        return diff < self.layout.spec.threshold

    def _diff(self, residual: torch.Tensor, ref: torch.Tensor) -> float:
        """mean|r - r_ref| / mean|r_ref|: the one device-to-host read of a dynamic decision (accumulated in float32
        at least). Under context parallelism each rank holds a sequence shard: the two sums are all-reduced over the
        group first (sums, not per-rank means, so uneven shards stay exact), and every rank reads the same value."""
        if self.parallel is None:
            return relative_l1(residual, ref).item()
        acc = torch.promote_types(residual.dtype, torch.float32)
        local = torch.stack(((residual - ref).abs().sum(dtype=acc), ref.abs().sum(dtype=acc)))
        num, den = global_sums(local, self.parallel.group).tolist()
        self.collectives += 1
        return num / den if den > 0 else math.inf


def relative_l1(residual: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """mean|r - r_ref| / mean|r_ref| as a 0-d device tensor (means accumulated in float32 at least): the
    decision statistic, the same ops eagerly and inside a captured graph, so both decide bitwise alike."""
    acc = torch.promote_types(residual.dtype, torch.float32)
    return (residual - ref).abs().mean(dtype=acc) / ref.abs().mean(dtype=acc)
