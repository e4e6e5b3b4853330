"""DBCache: skip the middle transformer blocks on steps where they would change little.

The adapter's blocks, flattened in execution order, are split into Fn (the first `fn_blocks`, always run; their
residual is the change detector), M (the middle blocks, skipped on cached steps) and Bn (the last `bn_blocks`, always
run). On a computed step the middle blocks run and their residuals (output minus input, per stream) are stored; on a
cached step every middle block returns its inputs untouched and the last one adds the stored residual (or, with
`taylorseer_order`, its extrapolation). Hooks run around the block's compiled callable (`HookRegistry.set_inner`), so
a decision never becomes a graph break. ControlNet residuals and VACE hints the model adds between blocks (adapter
`between_block_args`) count once: `DBCacheBetweenHook`. When cached steps reuse the output (`DBCache.extrapolate`) one
hook on the transformer replaces all of these: a cached call runs nothing, returns the extrapolation (`DBCacheOutputHook`).

This module holds the hooks and `FEATURE`; the parts live beside it and none imports this module (no import cycle):
`state.py` (the layout, the per-call state and its decision rules: `_CallState`), `graph_bridge.py` (`GraphBridge`:
`GraphDecisions` and `SplitDecisions` under whole-transformer graphs) and `summary.py` (statistics, the summary's
text, `plot_cache_diffs`). Every name callers imported from here is still importable from here.

    handle = hookkit.enable(pipe, hookkit.Spec(cache=hookkit.DBCache(steps_mask="fast", mask_policy="static")))
    image = pipe(prompt_embeds=..., num_inference_steps=28).images[0]; print(handle.summary())
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch
from loguru import logger

from hookkit.adapters import BlockListSpec
from hookkit.core.feature import AttachContext, BaseFeature
from hookkit.core.graphs import GraphDecisions, SplitDecisions
from hookkit.core.parallel import parallel_info
from hookkit.core.plan import Attachment, PlanContext, add_hook, flat_blocks, module_at
from hookkit.core.registry import Args, Kwargs, ModelHook
from hookkit.core.removal import Removable
from hookkit.core.summary import FeatureSummary
from hookkit.errors import AdapterError, HookError, SpecError, UnsupportedError
from hookkit.techniques.cache.spec import DBCache
# the parts' names callers import from here (tests, benchmarks, tools, `hookkit`) are re-exported with them
from hookkit.techniques.cache.graph_bridge import GraphBridge, _install_bridge, graph_bridge
from hookkit.techniques.cache.state import NAME, _CallState, _Layout, _layout, relative_l1
from hookkit.techniques.cache.summary import PERCENTILES, _no_cache_reason, _summary, branch_names, plot_cache_diffs

ENTRY_HOOK = "hookkit.cache.entry"
MIDDLE_HOOK = "hookkit.cache.middle"
BETWEEN_HOOK = "hookkit.cache.between"
OUTPUT_HOOK = "hookkit.cache.output"

__all__ = ["FEATURE", "NAME", "graph_bridge", "plot_cache_diffs"]


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
    (`controlnet_block_samples`) add ControlNet residuals into the hidden stream after blocks; Wan VACE
    (`control_hidden_states`) adds `hint * scale` after each block in `vace_layers`, its hints made by `vace_blocks`
    before the first block runs. On a cached step the middle blocks return their inputs and the model still adds the
    *current* step's residuals between them, so a stored residual that contained the computed step's residuals
    would count them twice. On a computed step of a marked call the middle hooks measure what the model added
    between consecutive middle blocks (the next block's input minus the previous block's output: whatever the model
    adds, `controlnet_blocks_repeat`, several ControlNets summed or VACE's per-layer scales) and subtract it from the
    stored residual. A cached step then returns Fn output + the current residuals + the blocks' cached contribution,
    as an uncached step adds them: once. Unmarked calls pay nothing.
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
        if cs.track_between:  # keep the blocks' own contribution: the model adds the residuals and hints itself
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


class DBCacheOutputHook(ModelHook):
    """On the transformer, when cached steps reuse the output (`DBCache.extrapolate`; the only DBCache hook then):
    decides each call before it runs. A computed call runs and a copy of its output's floating tensors is kept per
    branch (with TaylorSeer's differences); a cached call runs nothing of the transformer and returns, in the
    structure of the last computed output, their extrapolation to the current step.

    Kept outputs belong to the call's input shapes (`_signature`): a call of other shapes in the same branch (a new
    resolution, CFG dropped part-way) computes and starts the branch's trajectory over.
    """

    replaces_forward = True

    def __init__(self, shared: _Shared) -> None:
        self.shared = shared

    def new_forward(self, module: torch.nn.Module, call_next: Callable[..., Any], args: Args, kwargs: Kwargs) -> Any:
        cs = self.shared.call_state()
        state = self.shared.handle.state
        branch = cs.branch_at(state.branch)
        signature = _signature(args, kwargs)
        if branch.signature != signature:
            branch.restart(signature)
        if cs.decide(state.step, state.branch, None):
            step = state.step
            return _rebuild(branch.template, [branch.value(i, step) for i in range(len(branch.template[1]))])
        output = call_next(*args, **kwargs)
        tensors, template = _split_output(output, type(module).__name__)
        branch.store(state.step, tuple(t.detach().clone() for t in tensors), self.shared.layout.spec.taylorseer_order)
        branch.template = template
        return output


def _signature(args: Args, kwargs: Kwargs) -> tuple[Any, ...]:
    """The shapes, dtypes and devices of a call's tensor arguments (top level and in lists or tuples), by position or
    keyword: what a kept output belongs to."""
    def describe(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return (tuple(value.shape), value.dtype, value.device)
        if isinstance(value, (list, tuple)):
            return tuple(describe(v) for v in value)
        return None
    return (tuple(describe(a) for a in args), tuple(sorted((k, describe(v)) for k, v in kwargs.items())))


#: an output's structure: (its kind, the positions or keys of its floating tensors, the output itself)
_Template = tuple[str, tuple[Any, ...], Any]


def _split_output(output: Any, model: str) -> tuple[list[torch.Tensor], _Template]:
    """The floating tensors of a transformer's output (a tensor, a tuple or list, or a diffusers `BaseOutput` or other
    mapping) and the template `_rebuild` puts new ones into. Other entries (None, integer tensors) are kept as
    they came."""
    if isinstance(output, torch.Tensor):
        if not output.is_floating_point():
            raise _no_float_output(model, output)
        return [output], ("tensor", (None,), None)
    if isinstance(output, (tuple, list)):
        keys = tuple(i for i, v in enumerate(output) if isinstance(v, torch.Tensor) and v.is_floating_point())
        kind = "tuple" if isinstance(output, tuple) else "list"
        rest = tuple(v.clone() if isinstance(v, torch.Tensor) else v for v in output)
        if keys:
            return [output[i] for i in keys], (kind, keys, rest)
    elif isinstance(output, Mapping):
        keys = tuple(k for k, v in output.items() if isinstance(v, torch.Tensor) and v.is_floating_point())
        if keys:
            rest = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in output.items()}
            return [output[k] for k in keys], ("mapping", keys, (type(output), rest))
    raise _no_float_output(model, output)


def _rebuild(template: _Template, tensors: list[torch.Tensor]) -> Any:
    """An output of the template's structure holding `tensors` (in `_split_output`'s order)."""
    kind, keys, rest = template
    if kind == "tensor":
        return tensors[0]
    if kind in ("tuple", "list"):
        values = list(rest)
        for key, tensor in zip(keys, tensors):
            values[key] = tensor
        return tuple(values) if kind == "tuple" else values
    cls, fields = rest
    return cls(**{**fields, **dict(zip(keys, tensors))})


def _no_float_output(model: str, output: Any) -> UnsupportedError:
    return UnsupportedError(
        f"DBCache(extrapolate='output') on {model}: expected the transformer's output to hold floating tensors (a "
        f"tensor, a tuple or a diffusers output), got {type(output).__name__}. Use extrapolate='residual' on this "
        "model.")


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
        layout = _layout(spec, len(blocks), ctx.adapter.between_block_args)
        if layout.extrapolate == "output":  # the whole call is skipped: no block hook, nothing added between blocks
            return [Attachment(feature=NAME, target="", name=OUTPUT_HOOK)]
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
        if attachment.name == OUTPUT_HOOK:
            return add_hook(module, OUTPUT_HOOK, DBCacheOutputHook(shared))
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
            layout = _layout(ctx.spec.cache, len(blocks), ctx.adapter.between_block_args)  # type: ignore[arg-type]
            shared = _Shared(ctx, layout)
            found = ctx.keep(_Slot(shared=shared, blocks={path: spec for path, spec, _ in blocks}))
            if layout.extrapolate == "residual":  # "output": a cached call never reaches the graphs, and
                # nothing added between blocks can count twice (no block is skipped on its own)
                ctx.provide(GraphDecisions, lambda: _install_bridge(shared))
                ctx.provide(SplitDecisions, lambda: _install_bridge(shared))
                # heard once, at the first call; the listener goes with the handle
                ctx.add_first_call_listener(functools.partial(_refuse_split_across_changes, ctx))
            logger.info(
                "cache: {} blocks = Fn {} + middle {} + Bn {}, cached steps reuse the {}; {}", layout.num_blocks,
                layout.spec.fn_blocks, layout.num_middle, layout.spec.bn_blocks, layout.extrapolate,
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
        # the call passed ControlNet residuals or VACE control: what the forward added between middle blocks was
        # measured and is kept out of the stored residual (`DBCacheBetweenHook`), so a cached step adds the current
        # ones once
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
            f"fn_blocks to {i + 1} or bn_blocks so that no middle block follows such a point, or leave cache off "
            f"(or, if what is added there is computed from the call's inputs before the first block, name that forward "
            f"argument in the adapter's between_block_args)."
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
