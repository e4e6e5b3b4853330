"""DBCache: skip the middle transformer blocks on steps where they would change little.

The adapter's blocks, flattened in execution order, are split into Fn (the first `fn_blocks`, always run;
their residual is the change detector), M (the middle blocks, skipped on cached steps) and Bn (the last
`bn_blocks`, always run). On a computed step the middle blocks run and their residuals (output minus input,
per stream) are stored; on a cached step every middle block returns its inputs untouched and the last one
adds the stored residual (or, with `taylorseer_order`, its extrapolation). Which steps are cached is decided
per CFG branch by the rules in `_CallState.rules`; all state is per pipeline call (`CallState.features`).

Host syncs: only a threshold decision reads the device, one `.item()` per step and branch (under context
parallelism after one all-reduce of its two sums, so every rank decides alike); a static mask needs none. Everything kept across steps is computed outside any
compiled region, so outputs of compiled regions or CUDA graphs are never held across calls. Hooks run around
the block's compiled callable (`HookRegistry.set_inner`), so a decision never becomes a graph break. Under
whole-transformer graphs it provides `hookkit.core.graphs.GraphDecisions` and `SplitDecisions` (`GraphBridge`).

    handle = hookkit.enable(pipe, hookkit.Spec(cache=hookkit.DBCache(steps_mask="fast", mask_policy="static")))
    image = pipe(prompt_embeds=..., num_inference_steps=28).images[0]
    print(handle.summary())           # per branch: computed and cached steps, diffs; plot_cache_diffs draws them
ControlNet residuals the model adds between blocks (adapter `between_block_args`) count once: `DBCacheBetweenHook`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import re
import textwrap
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path
from typing import Any

import attrs
import torch
from loguru import logger

from hookkit.adapters import BlockListSpec
from hookkit.core.feature import AttachContext, BaseFeature
from hookkit.core.graphs import GraphDecisions, SplitDecisions
from hookkit.core.parallel import ParallelInfo, global_sums, parallel_info
from hookkit.core.plan import Attachment, PlanContext, add_hook, flat_blocks, module_at
from hookkit.core.registry import Args, Kwargs, ModelHook
from hookkit.core.removal import Removable
from hookkit.core.summary import SUMMARY_WIDTH, FeatureSummary, Summary, table
from hookkit.errors import AdapterError, HookError, SpecError, UnsupportedError
from hookkit.techniques.cache.spec import DBCache, effective_warmup_steps, resolve_steps_mask, rule_mask

NAME = "cache"
ENTRY_HOOK = "hookkit.cache.entry"
MIDDLE_HOOK = "hookkit.cache.middle"
BETWEEN_HOOK = "hookkit.cache.between"
PERCENTILES = (("P00", 0.0), ("P25", 25.0), ("P50", 50.0), ("P75", 75.0), ("P95", 95.0))

__all__ = ["FEATURE", "NAME", "graph_bridge", "plot_cache_diffs"]


# --- layout (fixed at attach time) -------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class _Layout:
    """Where Fn / M / Bn are, and whether decisions ever need the Fn residual. Immutable."""

    spec: DBCache
    num_blocks: int
    #: True unless no decision can ever reach the threshold (static mask, or threshold 0)
    needs_diff: bool

    @property
    def num_middle(self) -> int:
        return self.num_blocks - self.spec.fn_blocks - self.spec.bn_blocks

    @property
    def always_run(self) -> int:
        return self.spec.fn_blocks + self.spec.bn_blocks


def _layout(spec: DBCache, num_blocks: int) -> _Layout:
    if spec.fn_blocks + spec.bn_blocks >= num_blocks:
        raise SpecError(
            f"DBCache.fn_blocks + DBCache.bn_blocks: expected fewer than the {num_blocks} blocks of the model so "
            f"that at least one middle block can be cached, got fn_blocks={spec.fn_blocks} + "
            f"bn_blocks={spec.bn_blocks} = {spec.fn_blocks + spec.bn_blocks}. Lower one of them."
        )
    static_mask = spec.steps_mask is not None and spec.mask_policy == "static"
    needs_diff = spec.rule == "threshold" and not static_mask and spec.threshold > 0
    return _Layout(spec=spec, num_blocks=num_blocks, needs_diff=needs_diff)


# --- block inputs and outputs --------------------------------------------------------------------------------

_NO_DEFAULT = inspect.Parameter.empty


class _BlockIO:
    """Reads a block's streams from its arguments (positional or keyword) and builds its return value.

    The argument positions come from `inspect.signature` of the block class's `forward`, once, at attach.
    """

    def __init__(self, block: torch.nn.Module, spec: BlockListSpec, path: str) -> None:
        params = list(inspect.signature(type(block).forward).parameters.values())[1:]  # drop self
        names = [p.name for p in params]

        def locate(arg: str | None) -> tuple[str | None, int, Any]:
            if arg is None:
                return None, -1, None
            if arg not in names:
                raise AdapterError(
                    f"{path} ({type(block).__name__}): the adapter names argument {arg!r}, but forward takes {names}. "
                    "Fix hidden_arg/encoder_arg of this [[blocks]] table."
                )
            param = params[names.index(arg)]
            return arg, names.index(arg), None if param.default is _NO_DEFAULT else param.default

        self.hidden_name, self.hidden_pos, self.hidden_default = locate(spec.hidden_arg)
        self.encoder_name, self.encoder_pos, self.encoder_default = locate(spec.encoder_arg)
        self.hidden_index: int = spec.hidden_index
        self.encoder_index: int | None = spec.encoder_index
        self.num_returns = len(spec.returns)

    def hidden(self, args: Args, kwargs: Kwargs) -> Any:
        if self.hidden_name in kwargs:
            return kwargs[self.hidden_name]
        return args[self.hidden_pos] if self.hidden_pos < len(args) else self.hidden_default

    def encoder(self, args: Args, kwargs: Kwargs) -> Any:
        if self.encoder_name is None:
            return None
        if self.encoder_name in kwargs:
            return kwargs[self.encoder_name]
        return args[self.encoder_pos] if self.encoder_pos < len(args) else self.encoder_default

    def pack(self, hidden: Any, encoder: Any) -> Any:
        """The block's return value for these streams, in its return order."""
        if self.num_returns == 1:
            return hidden
        return (hidden, encoder) if self.hidden_index == 0 else (encoder, hidden)

    def identity(self, args: Args, kwargs: Kwargs) -> Any:
        """What the block returns if it changes nothing: its inputs."""
        if self.num_returns == 1:
            return self.hidden(args, kwargs)
        return self.pack(self.hidden(args, kwargs), self.encoder(args, kwargs))

    def unpack(self, output: Any) -> tuple[torch.Tensor, Any]:
        if self.num_returns == 1:
            return output, None
        return output[self.hidden_index], output[self.encoder_index] if self.encoder_index is not None else None


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

    def store(self, step: int, residuals: tuple[torch.Tensor | None, torch.Tensor | None], order: int) -> None:
        """Keep the middle residuals of computed step `step` and, for TaylorSeer, their derivative estimates in
        the paper's form: each difference taken against the previous computed step and divided by the gap."""
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
        #: the transformer call given ControlNet residuals (an adapter `between_block_args` argument), and on a
        #: computed step of such a call: the last middle block's (hidden, encoder) output and what the model added
        #: between middle blocks since the first one, per stream
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



# --- hooks --------------------------------------------------------------------------------------------------


class _Shared:
    """What all DBCache hooks of one handle share: the attach context (for the clock and state) and the layout."""

    def __init__(self, ctx: AttachContext, layout: _Layout) -> None:
        #: the cache's attach context: the transformer, the pipeline and the per-call state the hooks read
        self.handle = ctx
        self.layout = layout
        #: set by `hookkit.Compile(cuda_graphs="transformer")`: the transformer call is replayed from graphs
        self.graph: GraphBridge | None = None
        #: reasons why no step could be cached, already logged (each once per handle)
        self.logged: set[str] = set()

    def call_state(self) -> _CallState:
        handle = self.handle
        state = handle.state
        outside = not handle.in_generation if handle.pipeline is None else state.generation == 0
        if outside:
            # Nothing would reset the cache: one generation's residuals (and step count) would carry into the next.
            name = type(handle.transformer).__name__
            if handle.pipeline is None:
                raise SpecError(
                    f"DBCache on {name}: hookkit was enabled on the bare transformer, and it was called outside any "
                    "generation. With a diffusers pipeline, enable hookkit on the pipeline instead: "
                    "hookkit.disable(pipe.transformer); hookkit.enable(pipe, spec) (it then follows every pipe(...) "
                    "call by itself). Only for your own denoising loop over a bare transformer, wrap each loop in "
                    "`with handle.generation(num_steps=N):`."
                )
            raise SpecError(
                f"DBCache on {name}: expected every transformer call inside a generation (a pipeline call), got "
                "pipe.transformer called before any pipeline call. Call the pipeline, or enable hookkit on the bare "
                "transformer and wrap your loop in `with handle.generation(num_steps=N):`."
            )
        if state.finished:  # the core's: all its steps ran, or its call returned early (an interrupt, an exception)
            # The loop ended, yet the transformer runs on: its caller's scheduler never told hookkit a new call began
            raise HookError(
                f"DBCache on {type(handle.transformer).__name__}: expected a transformer call inside the denoising loop, "
                f"got one after its last step ({state.step} of {state.num_steps} done) with no new "
                "scheduler.set_timesteps on the scheduler hookkit patched. The caller is another pipeline sharing this "
                "transformer with its own scheduler (e.g. Pipeline(**pipe.components, scheduler=...), or from_pipe "
                "followed by a scheduler swap), or pipe.transformer called directly after a pipeline call; the cache "
                "would reuse the finished generation's residuals. Call the pipeline hookkit is enabled on, or disable "
                "it there and enable it on the pipeline you call."
            )
        cs = state.features.get(NAME)
        if cs is None:
            _refuse_diffusers_cache(handle.transformer)  # once per call: enable_cache may come after hookkit.enable
            # a new generation: whether the transformer runs under context parallelism is looked up here, so that
            # `enable_parallelism` may come before or after `hookkit.enable`
            cs = state.feature(NAME, functools.partial(_CallState, self.layout, state.num_steps,
                                                       parallel_info(handle.transformer)))
            reason = _no_cache_reason(self.layout, cs)
            if reason is not None and reason not in self.logged:
                self.logged.add(reason)  # once per handle and reason: a call is no attach, but this is no per-call log
                logger.warning("cache: {}", reason)
        return cs


class DBCacheEntryHook(ModelHook):
    """On block 0: keeps its hidden input, from which the Fn residual is measured. Only attached when some
    decision may need a diff (not with a static mask)."""

    def __init__(self, shared: _Shared, io: _BlockIO) -> None:
        self.shared = shared
        self.io = io

    def pre_forward(self, module: torch.nn.Module, args: Args, kwargs: Kwargs) -> tuple[Args, Kwargs]:
        cs = self.shared.call_state()
        cs.block0_hidden, cs.block0_call = self.io.hidden(args, kwargs), self.shared.handle.state.calls
        return args, kwargs


class DBCacheBetweenHook(ModelHook):
    """On the transformer, when the adapter names `between_block_args`: marks a call given any of them.

    Why: Flux (`controlnet_block_samples`, `controlnet_single_block_samples`) and Qwen-Image
    (`controlnet_block_samples`) add ControlNet residuals into the hidden stream after blocks. On a cached step the
    middle blocks return their inputs and the model still adds the *current* step's residuals between them, so a
    stored residual that contained the computed step's residuals would count them twice. On a computed step of a
    marked call the middle hooks measure what the model added between consecutive middle blocks (the next block's
    input minus the previous block's output: exact whatever the model adds, `controlnet_blocks_repeat` or several
    ControlNets summed) and subtract it from the stored residual. A cached step then returns Fn output + the current
    residuals + the blocks' cached contribution, as an uncached step adds them: once. Unmarked calls pay nothing.
    """

    def __init__(self, shared: _Shared, names: tuple[str, ...], positions: tuple[int, ...]) -> None:
        self.shared = shared
        self.names = names
        self.positions = positions

    def pre_forward(self, module: torch.nn.Module, args: Args, kwargs: Kwargs) -> tuple[Args, Kwargs]:
        given = any(kwargs.get(n) is not None for n in self.names) or any(
            p < len(args) and args[p] is not None for p in self.positions)
        if given:
            self.shared.call_state().between_call = self.shared.handle.state.calls
        return args, kwargs


class DBCacheMiddleHook(ModelHook):
    """On every middle block. Runs the block or returns its inputs; the first one that runs in a transformer call
    decides for the call (its inputs are the Fn output), the last one stores the residuals (computed step) or adds
    them (cached step).

    "The first one that runs", not the first by position: SD3's skip-layer guidance makes an extra transformer
    call that skips some blocks (`skip_layers`); when the first middle block is among them, that call decides
    (as its own CFG branch) at the next middle block instead of inheriting the previous call's decision.
    """

    replaces_forward = True

    def __init__(self, shared: _Shared, io: _BlockIO, last: bool) -> None:
        self.shared = shared
        self.io = io
        self.last = last

    def new_forward(self, module: torch.nn.Module, call_next: Callable[..., Any], args: Args, kwargs: Kwargs) -> Any:
        cs = self.shared.call_state()
        call = self.shared.handle.state.calls
        if cs.decided_call != call:
            cs.decided_call = call
            self._decide(cs, args, kwargs)
        if self.last:
            # a pass through the middle blocks ends here; the next decides again (graph warm-up and capture run
            # one transformer call more than once)
            cs.decided_call = -1
        if cs.skip:
            output = self.io.identity(args, kwargs)
            return self._apply(cs, output) if self.last else output
        if cs.track_between:
            self._add_between(cs, args, kwargs)
        output = call_next(*args, **kwargs)
        if self.last:
            self._store(cs, output)
        elif cs.track_between:
            cs.prev_out = self.io.unpack(output)
        return output

    def _add_between(self, cs: _CallState, args: Args, kwargs: Kwargs) -> None:
        """Accumulate what the model added to each stream since the previous middle block returned."""
        previous = cs.prev_out
        if previous[0] is None:
            return
        for stream, now in enumerate((self.io.hidden(args, kwargs), self.io.encoder(args, kwargs))):
            before = previous[stream]
            if before is None or now is before or not isinstance(now, torch.Tensor) or now.shape != before.shape:
                continue  # passed on untouched (the same tensor): nothing was added
            added = now - before
            total = cs.between[stream]
            cs.between[stream] = added if total is None else total.add_(added)

    def _decide(self, cs: _CallState, args: Args, kwargs: Kwargs) -> None:
        hidden, encoder = self.io.hidden(args, kwargs), self.io.encoder(args, kwargs)
        state = self.shared.handle.state
        graph = self.shared.graph
        if graph is not None and graph.forced is not None:
            cs.force(state.step, state.branch, graph.forced)
            cached = graph.forced
            if graph.dynamic:  # the decision statistic, then (capture) the cut between the two graphs
                block0 = cs.block0_hidden if cs.block0_call == state.calls else None
                graph.at_decision(state.branch, hidden, block0)
            if cached:  # the graph being captured must read the slots of this geometry
                graph.use_slots(cs.branch, state.branch, hidden, encoder)
        else:
            block0 = cs.block0_hidden if cs.block0_call == state.calls else None
            fn_residual = hidden - block0 if block0 is not None and block0.shape == hidden.shape else None
            cached = cs.decide(state.step, state.branch, fn_residual, (hidden, encoder))
        if not cached:
            cs.middle_in = (hidden, encoder)
        cs.track_between = not cached and cs.between_call == state.calls
        cs.prev_out, cs.between = (None, None), [None, None]
        cs.block0_hidden = None

    def _store(self, cs: _CallState, output: Any) -> None:
        hidden_in, encoder_in = cs.middle_in
        hidden_out, encoder_out = self.io.unpack(output)
        encoder_res = None
        if encoder_out is not None and isinstance(encoder_in, torch.Tensor) and encoder_in.shape == encoder_out.shape:
            encoder_res = encoder_out - encoder_in
        residuals = (hidden_out - hidden_in, encoder_res)
        if cs.track_between:  # keep the blocks' own contribution: the model adds the ControlNet residuals itself
            between = cs.between
            residuals = tuple(r if r is None or between[s] is None else r.sub_(between[s])  # type: ignore[assignment]
                              for s, r in enumerate(residuals))
            cs.track_between, cs.prev_out, cs.between = False, (None, None), [None, None]
        order = self.shared.layout.spec.taylorseer_order
        if self.shared.graph is not None:  # the slots a replay writes; TaylorSeer's state is the bridge's (eager)
            residuals = self.shared.graph.persist(cs.branch_index, residuals)
            order = 0
        cs.branch.store(cs.step, residuals, order)
        cs.middle_in = (None, None)

    def _apply(self, cs: _CallState, output: Any) -> Any:
        branch, step = cs.branch, cs.step
        graph = self.shared.graph
        if graph is not None and graph.forced is None:  # an eager call under graphs: extrapolate into the slots first
            graph.prepare_cached(cs.branch_index, step)
        hidden, encoder = self.io.unpack(output)
        hidden = branch.predict(0, step, hidden)
        if encoder is not None and branch.residual[1] is not None:
            encoder = branch.predict(1, step, encoder)
        return self.io.pack(hidden, encoder)


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

    def replayed(self, decision: tuple[int, bool], shapes: Hashable = None) -> None:
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
    """Install (once) and return the bridge of a `hookkit.Handle` with DBCache, or None without DBCache."""
    return handle.service(GraphDecisions)


def _install_bridge(shared: _Shared) -> GraphBridge:
    if shared.graph is None:
        shared.graph = GraphBridge(shared)
    return shared.graph


def _refuse_diffusers_cache(transformer: torch.nn.Module) -> None:
    """Refuse hookkit's DBCache on a transformer with diffusers' own cache on (`enable_cache`: FirstBlockCache,
    FasterCache, PAB, MagCache, ...).

    Refused rather than warned: both skip block computations on their own decisions, so a step one cache skips
    feeds the other's reference and the errors compound into a worse image with no sign why; and hookkit's log is
    silent by default, so a warning would not be seen.
    """
    config = getattr(transformer, "_cache_config", None)
    if config is not None:
        raise UnsupportedError(
            f"DBCache on {type(transformer).__name__}: diffusers' {type(config).__name__} is enabled on it too "
            "(transformer.enable_cache); two caches skipping blocks on their own decisions compound their errors. "
            "Call pipe.transformer.disable_cache() first, or drop Spec.cache."
        )


# --- feature ------------------------------------------------------------------------------------------------


class _CacheFeature(BaseFeature):
    """Plugs DBCache into `hookkit.enable`: `Spec.cache`."""

    name = NAME
    spec_class = DBCache

    def plan(self, ctx: PlanContext) -> list[Attachment]:
        spec = ctx.spec.cache
        if spec is None:
            return []
        _refuse_diffusers_cache(ctx.transformer)
        blocks = flat_blocks(ctx.adapter, ctx.transformer)
        layout = _layout(spec, len(blocks))
        _check_long_skips(spec, blocks, type(ctx.transformer).__name__)
        out: list[Attachment] = []
        if ctx.adapter.between_block_args:
            out.append(Attachment(feature=NAME, target="", name=BETWEEN_HOOK))
        if layout.needs_diff:
            out.append(Attachment(feature=NAME, target=blocks[0][0], name=ENTRY_HOOK))
        first, last = spec.fn_blocks, len(blocks) - spec.bn_blocks - 1
        for i in range(first, last + 1):
            out.append(Attachment(feature=NAME, target=blocks[i][0], name=MIDDLE_HOOK,
                                  params=(("last", i == last),)))
        return out

    def attach(self, ctx: AttachContext, attachment: Attachment) -> Removable:
        shared, specs = self._shared(ctx)
        module = module_at(ctx.transformer, attachment.target)
        if attachment.name == BETWEEN_HOOK:
            names = ctx.adapter.between_block_args
            params = list(inspect.signature(type(module).forward).parameters)[1:]
            positions = tuple(params.index(n) for n in names if n in params)
            return add_hook(module, BETWEEN_HOOK, DBCacheBetweenHook(shared, names, positions))
        io = _BlockIO(module, specs[attachment.target], attachment.target)
        if attachment.name == ENTRY_HOOK:
            return add_hook(module, ENTRY_HOOK, DBCacheEntryHook(shared, io))
        hook = DBCacheMiddleHook(shared, io, last=attachment.param("last"))
        return add_hook(module, MIDDLE_HOOK, hook)

    def _shared(self, ctx: AttachContext) -> tuple[_Shared, dict[str, BlockListSpec]]:
        """The hooks' shared object, made at the first attachment and kept in the feature's slot."""
        found: _Slot | None = ctx.kept()
        if found is None:
            blocks = flat_blocks(ctx.adapter, ctx.transformer)
            layout = _layout(ctx.spec.cache, len(blocks))  # type: ignore[arg-type]
            shared = _Shared(ctx, layout)
            found = ctx.keep(_Slot(shared=shared, blocks={path: spec for path, spec, _ in blocks}))
            ctx.provide(GraphDecisions, lambda: _install_bridge(shared))
            ctx.provide(SplitDecisions, lambda: _install_bridge(shared))
            # heard once, at the first call; the listener goes with the handle
            ctx.add_first_call_listener(functools.partial(_refuse_split_across_changes, ctx))
            logger.info(
                "cache: {} blocks = Fn {} + middle {} + Bn {}; {}", layout.num_blocks, layout.spec.fn_blocks,
                layout.num_middle, layout.spec.bn_blocks,
                "one host read per decided step and branch" if layout.needs_diff else "no host read (no diff needed)",
            )
        return found.shared, found.blocks

    def summarize(self, ctx: AttachContext) -> FeatureSummary | None:
        found: _Slot | None = ctx.kept()
        if found is None:
            return None
        cs: _CallState | None = ctx.state.features.get(NAME)
        summary = _summary(found.shared.layout, cs, ctx.state.generation, branch_names(ctx.pipeline))
        brief = summary.data["no_cache_brief"]
        if brief is not None:
            # summary time, not per call: once per handle and reason (what `generate`'s default output also says)
            line = f"{summary.data['steps']} steps cached 0: {brief}"
            if line not in found.shared.logged:
                found.shared.logged.add(line)
                logger.info("cache: 0 of {} steps cached: {}", summary.data["steps"], brief)
        return summary


@attrs.define
class _Slot:
    """What the cache keeps per handle: the hooks' shared state and each hooked block's list spec."""

    shared: _Shared
    blocks: dict[str, BlockListSpec]


FEATURE = _CacheFeature()


def _refuse_split_across_changes(ctx: AttachContext, report: Any) -> None:
    """Refuse a split whose middle blocks the forward changes the hidden stream between (seen at the first call).

    On a cached step the middle blocks return their inputs and the last adds the stored residual, which already
    holds what the forward added between them on the computed step: it would be added twice.
    """
    spec = ctx.spec.cache
    cs: _CallState | None = ctx.state.features.get(NAME)
    if ctx.adapter.between_block_args and cs is not None and cs.between_call >= 0:
        # the call passed ControlNet residuals: what the forward added between middle blocks was measured and is
        # kept out of the stored residual (`DBCacheBetweenHook`), so a cached step adds the current ones once
        return
    model = type(ctx.transformer).__name__
    last = len(report.paths) - spec.bn_blocks - 1
    inside = [i for i in report.gaps if spec.fn_blocks <= i < last]
    if inside:
        i = inside[0]
        raise UnsupportedError(
            f"DBCache F{spec.fn_blocks}B{spec.bn_blocks} on {model}: expected the middle blocks "
            f"({report.paths[spec.fn_blocks]} .. {report.paths[last]}) to pass the hidden stream straight from one to "
            f"the next, got {model}.forward changing it between {report.paths[i]} and {report.paths[i + 1]} at the "
            f"first call (a hint, adapter or residual added there); a cached step would add it twice. Raise "
            f"fn_blocks to {i + 1} or bn_blocks so that no middle block follows such a point, or leave cache off."
        )


def _check_long_skips(spec: DBCache, blocks: list[tuple[str, Any, torch.nn.Module]], model: str) -> None:
    """A list with long skips (block k feeds block n-1-k of it) must have both ends of each skip in the middle or
    both outside: a cached step would otherwise feed a skipped block's input (its identity output) to a block that
    runs, or skip a block whose skip input was computed."""
    first, last = spec.fn_blocks, len(blocks) - spec.bn_blocks - 1
    start = 0
    while start < len(blocks):
        block_spec = blocks[start][1]
        end = start
        while end < len(blocks) and blocks[end][1] is block_spec:
            end += 1
        if block_spec.long_skips:
            n = end - start
            for k in range(n // 2):
                a, b = start + k, end - 1 - k
                if (first <= a <= last) != (first <= b <= last):
                    raise SpecError(
                        f"DBCache.fn_blocks/bn_blocks: expected a split that keeps both ends of each long skip of "
                        f"{model}.{block_spec.attr} (block k feeds block {n - 1}-k; adapter long_skips = true) in the "
                        f"middle or both outside it, got F{spec.fn_blocks}B{spec.bn_blocks}, which cuts the skip "
                        f"{blocks[a][0]} -> {blocks[b][0]}. Use fn_blocks == bn_blocks (e.g. "
                        f"DBCache(fn_blocks={spec.fn_blocks}, bn_blocks={spec.fn_blocks}))."
                    )
        start = end


# --- statistics ---------------------------------------------------------------------------------------------


def _percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _diff_stats(diffs: list[float]) -> dict[str, float] | None:
    if not diffs:
        return None
    stats = {name: _percentile(diffs, q) for name, q in PERCENTILES}
    stats["min"] = min(diffs)
    stats["max"] = max(diffs)
    return stats


def _no_cache_reason(layout: _Layout, cs: _CallState) -> str | None:
    """Why no step of this call can be cached, known before it runs (None when some step may be).

    Only what the spec and the step count decide: that the threshold rejected every step is said by
    `_no_cached_reason` once the call ran.
    """
    spec, n = layout.spec, cs.num_steps
    if n is None:
        return None
    if cs.mask is not None and not any(m == 0 for m in cs.mask):
        return (f"steps_mask computes all {n} steps of this call: no step may be cached. "
                "Give a mask with 0s (or a named policy).")
    if cs.static:
        return None
    if spec.threshold <= 0:
        return f"threshold {spec.threshold} caches no step. Set DBCache(threshold=...) above 0 (default 0.24)."
    if spec.max_cached_steps == 0:
        return "max_cached_steps=0 caches no step. Set it to -1 (no limit) or above 0."
    if spec.max_continuous_cached_steps == 0:
        return "max_continuous_cached_steps=0 caches no step. Set it to -1 (no limit) or above 0."
    if len(cs.warmup_steps()) >= n:
        return (f"warmup_steps={cs.warmup_given} covers all {n} steps of this call: no step may be cached. "
                f"Set DBCache(warmup_steps=...) below {n}, or leave it None (scaled to the step count).")
    return None


def _no_cached_reason(layout: _Layout, cs: _CallState | None) -> str | None:
    """Why a call that ran cached nothing: `_no_cache_reason`, or every measured diff at or above the threshold."""
    if cs is None or cs.transformer_calls == 0 or any(b.cached for b in cs.branches.values()):
        return None
    before = _no_cache_reason(layout, cs)
    if before is not None:
        return before
    diffs = [d for b in cs.branches.values() for d in b.diffs.values()]
    threshold = layout.spec.threshold
    if diffs:
        return (f"every measured diff ({len(diffs)} of them, smallest {min(diffs):.3g}) was at or above threshold "
                f"{threshold:g}. Random weights rarely cache (judge with trained weights); a higher threshold "
                "caches more steps at lower fidelity.")
    return None


def branch_names(pipeline: Any | None) -> tuple[str, ...]:
    """The names the pipeline gives its transformer calls within a step, in order: the literal names of its
    `transformer.cache_context("cond")` / `("uncond")` blocks in its `__call__` ("cond_uncond" where one call
    carries both halves of the CFG batch). Empty when it names none (or its source cannot be read): branches are
    then "branch 0", "branch 1"."""
    return () if pipeline is None else _cache_context_names(type(pipeline))


@functools.lru_cache(maxsize=64)
def _cache_context_names(pipeline_class: type) -> tuple[str, ...]:
    """`branch_names` of a pipeline class (read once per class: `summary()` may be called every generation)."""
    try:
        source = inspect.getsource(pipeline_class.__call__)
    except (OSError, TypeError):
        return ()
    names: list[str] = []
    for name in re.findall(r"""cache_context\(\s*["']([^"']+)["']""", source):
        if name not in names:
            names.append(name)
    return tuple(names)


def _branch_label(index: int, names: tuple[str, ...] | list[str]) -> str:
    return names[index] if index < len(names) else f"branch {index}"


def _no_cache_brief(layout: _Layout, cs: _CallState | None) -> str | None:
    """`_no_cached_reason` in a few words, for one line of `hookkit generate`'s output and the `-v` log: e.g.
    "warm-up covered 8, threshold 0.24 never reached (smallest diff 0.31)"."""
    if _no_cached_reason(layout, cs) is None or cs is None:
        return None
    spec, n = layout.spec, cs.num_steps
    if n is not None:
        if cs.mask is not None and not any(m == 0 for m in cs.mask):
            return f"the steps mask computes all {n} steps"
        if spec.threshold <= 0:
            return f"threshold {spec.threshold:g} caches no step"
        if spec.max_cached_steps == 0:
            return "max_cached_steps=0"
        if spec.max_continuous_cached_steps == 0:
            return "max_continuous_cached_steps=0"
        if len(cs.warmup_steps()) >= n:
            return f"warm-up covered all {n} (warmup_steps={cs.warmup_given})"
    diffs = [d for b in cs.branches.values() for d in b.diffs.values()]
    warmup = len(cs.warmup_steps())
    return (f"warm-up covered {warmup}, " if warmup else "") + \
        f"threshold {spec.threshold:g} never reached (smallest diff {min(diffs):.3g})"


def _summary(layout: _Layout, cs: _CallState | None, generation: int,
             names: tuple[str, ...] = ()) -> FeatureSummary:
    spec = layout.spec
    branches: dict[int, dict[str, Any]] = {}
    if cs is not None:
        for index in sorted(cs.branches):
            b = cs.branches[index]
            branches[index] = {
                "computed": list(b.computed), "cached": list(b.cached), "diffs": dict(b.diffs),
                "percentiles": _diff_stats(list(b.diffs.values())),
            }
    calls = cs.transformer_calls if cs is not None else 0
    data: dict[str, Any] = {
        "generation": generation,
        "threshold": spec.threshold,
        "steps_mask": list(spec.steps_mask) if isinstance(spec.steps_mask, tuple) else spec.steps_mask,
        "mask": list(cs.mask) if cs is not None and cs.mask is not None else None,
        "mask_policy": spec.mask_policy,
        "blocks": layout.num_blocks, "fn_blocks": spec.fn_blocks, "middle_blocks": layout.num_middle,
        "bn_blocks": spec.bn_blocks,
        "transformer_calls": calls,
        "block_calls": cs.block_calls if cs is not None else 0,
        "block_calls_uncached": calls * layout.num_blocks,
        "parallel": cs.parallel.describe() if cs is not None and cs.parallel is not None else None,
        "collectives": cs.collectives if cs is not None else 0,
        "branches": branches,
        "warmup_steps": cs.warmup_steps() if cs is not None else None,
        "rule": spec.rule,
        "speedup": spec.speedup, "spacing": spec.spacing, "last_computed": spec.last_computed,
        "calibrated": spec.calibration is not None,
        "no_cache_reason": _no_cached_reason(layout, cs),
        "no_cache_brief": _no_cache_brief(layout, cs),
        #: denoising steps of the call (each branch runs them all): what "0 of N steps cached" counts
        "steps": max((len(b["computed"]) + len(b["cached"]) for b in branches.values()), default=0),
        #: each branch's name: the pipeline's `cache_context` name (cond, uncond) or "branch i"
        "branch_names": {index: _branch_label(index, names) for index in branches},
    }
    return FeatureSummary(name=NAME, data=data, text=_render(data), brief=_render(data, brief=True))


def _render(data: dict[str, Any], brief: bool = False) -> str:
    """The summary's text; `brief`: fitted to `SUMMARY_WIDTH` columns (diff percentiles as "P50" rather than
    "Diffs P50", long step lists wrapped)."""
    if data.get("rule", "threshold") == "threshold":
        mask = "no mask" if data["steps_mask"] is None else f"mask {data['steps_mask']!r} ({data['mask_policy']})"
        decides = f"threshold {data['threshold']}, {mask}"
    elif data["rule"] == "magnitude":
        decides = f"rule 'magnitude', threshold {data['threshold']}, planned before the call"
    else:
        plan = ("planned from its calibration" if data.get("calibrated")
                else f"no calibration (spacing {data.get('spacing'):g}, last {data.get('last_computed'):g})")
        decides = f"schedule {data.get('speedup'):g}x, {plan}"
    head = (f"DBCache F{data['fn_blocks']}B{data['bn_blocks']} (middle {data['middle_blocks']} of {data['blocks']} "
            f"blocks), {decides}")
    if not data["branches"]:
        return head + "\nno transformer call in this generation yet"
    names = data.get("branch_names") or {}
    measured = any(b["percentiles"] for b in data["branches"].values())  # a rule deciding on diffs measured some
    rows = []
    for index, b in data["branches"].items():
        p = b["percentiles"]
        stats = [p[k] for k in ("P00", "P25", "P50", "P75", "P95", "min", "max")] if p else ["-"] * 7
        name = names.get(index, index)
        rows.append([index if name == f"branch {index}" else name, len(b["computed"]) + len(b["cached"]),
                     len(b["cached"]), *(stats if measured else [])])
    if brief:
        headers = ["Branch", "Steps", "Cached"] + (["Diff P00", "P25", "P50", "P75", "P95", "Min", "Max"] if measured
                                                    else [])
        lines = [head, table(headers, rows, width=SUMMARY_WIDTH)]
    else:
        headers = ["Branch", "Steps", "Cached Steps"] + (["Diffs P00", "Diffs P25", "Diffs P50", "Diffs P75",
                                                          "Diffs P95", "Diffs Min", "Diffs Max"] if measured else [])
        lines = [head, table(headers, rows)]
    for index, b in data["branches"].items():
        label = f"{names[index]} (branch {index})" if index in names and names[index] != f"branch {index}" \
            else f"branch {index}"
        line = f"{label} cached steps: {b['cached']}"
        lines.extend(textwrap.wrap(line, SUMMARY_WIDTH) if brief else [line])
    parallel = data.get("parallel")
    if parallel is not None:
        lines.append(f"context parallel: ulysses {parallel['ulysses']} x ring {parallel['ring']} over "
                     f"{parallel['world_size']} ranks; decisions global ({data['collectives']} all-reduces)")
    total = data["block_calls_uncached"]
    share = f" ({100.0 * data['block_calls'] / total:.1f}%)" if total else ""
    lines.append(f"block calls run: {data['block_calls']} of {total}{share}")
    if data["no_cache_reason"]:
        if brief and data.get("no_cache_brief"):
            lines.append(f"no step cached: {data['no_cache_brief']}")
        else:
            lines.append(f"no step cached: {data['no_cache_reason']}")
    return "\n".join(lines)


def plot_cache_diffs(source: Any | Summary | FeatureSummary | dict[str, Any], path: str | Path) -> Path:
    """Write a PNG of each branch's diff per step against the threshold, cached steps shaded. The "magnitude" and
    "schedule" rules (`DBCache()`) measure no diff: their plot shades the cached steps only.

    `source`: a handle, its `summary()`, the DBCache `FeatureSummary`, or that summary's `data`.
    """
    data = _plot_data(source)
    from hookkit.diagnostics.plot import pyplot

    plt = pyplot("plot_cache_diffs")
    branches = data["branches"]
    measured = data.get("rule", "threshold") == "threshold"  # the other rules decide before the call
    fig, axes = plt.subplots(max(1, len(branches)), 1, figsize=(8, 3 * max(1, len(branches))), squeeze=False)
    for ax, (index, b) in zip(axes[:, 0], branches.items() or [(0, None)]):
        if measured and data["threshold"] is not None:
            ax.axhline(data["threshold"], color="tab:red", linestyle="--", label=f"threshold {data['threshold']}")
        if b is not None:
            for i, step in enumerate(b["cached"]):
                ax.axvspan(step - 0.5, step + 0.5, color="tab:green", alpha=0.2, linewidth=0,
                           label="cached" if i == 0 and not measured else None)
            steps = sorted(b["diffs"])
            if measured:
                ax.plot(steps, [b["diffs"][s] for s in steps], marker="o", label="Fn residual diff")
                cached = [s for s in steps if s in set(b["cached"])]
                ax.scatter(cached, [b["diffs"][s] for s in cached], color="tab:green", zorder=3, label="cached")
            ax.set_xlim(-0.5, len(b["computed"]) + len(b["cached"]) - 0.5)
        ax.set_xlabel("step")
        if measured:
            ax.set_title(f"DBCache branch {index}: cached steps shaded")
            ax.set_ylabel("relative L1 diff")
        else:
            ax.set_title(f"DBCache branch {index}, rule {data['rule']!r} (decided before the call, no diff measured): "
                         "cached steps shaded", fontsize="medium")
            ax.set_yticks([])
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper right")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, format="png")
    plt.close(fig)
    return out


def _plot_data(source: Any) -> dict[str, Any]:
    if isinstance(source, dict):
        return source
    if isinstance(source, FeatureSummary):
        return source.data
    summary = source.summary() if hasattr(source, "summary") and callable(source.summary) else source
    if isinstance(summary, Summary) and NAME in summary.features:
        return summary.features[NAME].data
    raise UnsupportedError(
        f"plot_cache_diffs: expected a handle with DBCache enabled, its summary(), the DBCache FeatureSummary or "
        f"its data, got {type(source).__name__} without DBCache statistics. "
        "Enable hookkit.Spec(cache=hookkit.DBCache(...))."
    )
