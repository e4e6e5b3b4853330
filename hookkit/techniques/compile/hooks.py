"""Regional compilation, CUDA-graph safety by hooks, and whole-transformer CUDA graphs.

Regional (`Compile(regional=True)`): every instance of the adapter's repeated block classes gets
`torch.compile(block.forward)` as the *inner* callable of its hook registry, so the hooks on those blocks
(cache decisions, clones) run outside the compiled region and never become graph breaks.

CUDA-graph safety (inductor's CUDA-graph modes or `backend="cudagraphs"`): a graph output lives in memory
that the next replay overwrites, and the cudagraph tree never learns where one transformer call ends.
hookkit marks that boundary (`cudagraph_mark_step_begin`) in a pre hook on the transformer, outside every
compiled region; with regional compilation nothing that outlives a call is graph memory. A wholly compiled
transformer's outputs are, so they are also cloned.

Whole-transformer CUDA graphs (`cuda_graphs="transformer"`, GPU only): blocks compiled regionally, then each
transformer call captured once per input signature with `torch.cuda.CUDAGraph` and replayed while the
signature holds (inputs copied into static buffers, outputs cloned out). Hooks inside the transformer do not
run on replay, so a feature that decides per call provides `hookkit.core.graphs.GraphDecisions` (the cache
with a static mask: the decision becomes part of the graph key) or `SplitDecisions` (the cache with a
threshold: each call is split at the decision into a head graph ending with the statistic, one host read,
and the computed or cached tail graph, `SplitGraphHook`).
"""

from __future__ import annotations

import contextlib
import itertools
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, ContextManager

import attrs
import torch
import torch.utils._pytree as pytree

from hookkit.core.compat import CUDA_GRAPH_MODES
from hookkit.core.feature import AttachContext, BaseFeature
from hookkit.core.graphs import GraphDecisions, SplitDecisions
from hookkit.core.plan import Attachment, PlanContext, add_hook, module_at
from hookkit.core.registry import HookRegistry, ModelHook
from hookkit.core.removal import Removable, Removal
from hookkit.core.summary import FeatureSummary, table
from hookkit.errors import HookError, SpecError, UnsupportedError
from hookkit.techniques.compile.spec import Compile

if TYPE_CHECKING:
    from hookkit.adapters import AdapterSpec

NAME = "compile"
INNER = "hookkit.compile.inner"
CLONE = "hookkit.compile.clone"
STEP_MARK = "hookkit.compile.step_mark"
GRAPH = "hookkit.compile.graph"


def _clone_tensors(tree: Any) -> Any:
    return pytree.tree_map_only(torch.Tensor, lambda t: t.clone(), tree)


class CloneOutputsHook(ModelHook):
    """Clones a compiled callable's tensor outputs outside it, so a CUDA-graph replay cannot overwrite them."""

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        return _clone_tensors(output)


class StepMarkHook(ModelHook):
    """Marks a cudagraph-tree iteration boundary at every transformer call."""

    def pre_forward(self, module: torch.nn.Module, args: Any, kwargs: Any) -> Any:
        torch.compiler.cudagraph_mark_step_begin()
        return args, kwargs


# --- whole-transformer CUDA graphs ----------------------------------------------------------------------


def signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
    """What must match for a captured graph to be replayed: tensor metadata and every non-tensor value."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    key: list[Hashable] = [str(spec)]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            key.append(("T", tuple(leaf.shape), leaf.dtype, leaf.device, leaf.stride(), leaf.requires_grad))
        else:
            try:
                hash(leaf)
                key.append(("V", type(leaf).__name__, leaf))
            except TypeError:
                key.append(("O", type(leaf).__name__, id(leaf)))
    return tuple(key)


@attrs.define
class CapturedCall:
    """One captured signature: static input buffers, the replay callable, the static outputs."""

    static_leaves: list[Any]
    replay: Callable[[], None]
    static_output: Any
    replays: int = 0
    #: device memory the capture (warm-up included) added, as the backend reports it (0 where it cannot)
    memory_bytes: int = 0


class CudaGraphBackend:
    """Captures with `torch.cuda.CUDAGraph` on a side stream after warm-up, sharing one memory pool."""

    def __init__(self, warmup: int = 2) -> None:
        self.warmup = warmup
        self.pool: Any = None

    def memory_in_use(self) -> int:
        """Reserved device memory: what a capture adds to it is the memory its graph keeps."""
        return torch.cuda.memory_reserved()

    def capture(self, fn: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(self.warmup):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = fn()
        return graph.replay, output


class GraphRunner:
    """Replays one captured graph per input signature; copies inputs in and clones outputs out.

    `backend.capture(fn) -> (replay, static_output)` is injectable so that the bookkeeping is tested on
    the CPU with a stand-in backend.
    """

    def __init__(self, backend: Any, max_graphs: int | None = None) -> None:
        self.backend = backend
        #: at most `max_graphs` entries, least recently replayed first (None: no bound)
        self.max_graphs = max_graphs
        self.captured: OrderedDict[Hashable, CapturedCall] = OrderedDict()
        self.captures = 0
        self.evictions = 0

    def __call__(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                 extra_key: Hashable = None, capturing: Callable[[], ContextManager[Any]] = contextlib.nullcontext) -> Any:
        """Run `fn(*args, **kwargs)` from the graph of this signature (+ `extra_key`), capturing it first if new.

        `capturing()` is entered around warm-up and capture only (DBCache forces its decision there).
        """
        key = (signature(args, kwargs), extra_key)
        entry = self.captured.get(key)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if entry is None:
            while self.max_graphs is not None and len(self.captured) >= self.max_graphs:
                self.captured.popitem(last=False)  # the least recently replayed graph; its memory returns to the pool
                self.evictions += 1
            memory = getattr(self.backend, "memory_in_use", None)
            before = memory() if memory is not None else 0
            static = [leaf.clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
            static_args, static_kwargs = pytree.tree_unflatten(static, spec)
            with capturing():
                replay, output = self.backend.capture(lambda: fn(*static_args, **static_kwargs))
            used = max(0, memory() - before) if memory is not None else 0
            entry = self.captured[key] = CapturedCall(static_leaves=static, replay=replay, static_output=output,
                                                      memory_bytes=used)
            self.captures += 1
        else:
            self.captured.move_to_end(key)
            for buffer, leaf in zip(entry.static_leaves, leaves):
                if isinstance(leaf, torch.Tensor) and leaf.data_ptr() != buffer.data_ptr():
                    buffer.copy_(leaf)
        entry.replay()
        entry.replays += 1
        return _clone_tensors(entry.static_output)


class GraphHook(ModelHook):
    """Innermost hook on the transformer: runs the rest of the call through a `GraphRunner`.

    With a feature that decides per call (`cache`: the `GraphDecisions` DBCache provides) the decision is part
    of the graph key: a computed step and a cached step are two graphs, and the cache is told about every call
    that a graph served.
    """

    replaces_forward = True

    def __init__(self, runner: GraphRunner, cache: GraphDecisions | None = None) -> None:
        self.runner = runner
        self.cache = cache

    def new_forward(self, module: torch.nn.Module, call_next: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        if self.cache is None:
            return self.runner(call_next, args, kwargs)
        shapes = tuple(v.shape for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor))
        decision = self.cache.decision(shapes)
        output = self.runner(call_next, args, kwargs, extra_key=decision,
                             capturing=lambda: self.cache.forcing(decision))
        self.cache.replayed(decision, shapes)
        return output


# --- whole-transformer CUDA graphs split at a dynamic DBCache decision --------------------------------------


class CudaGraphSegments:
    """One Python execution captured as consecutive CUDA graphs on one side stream and one memory pool, cut
    wherever `cut()` is called (inside a hook, mid-forward). Tensors allocated by an earlier segment and read by
    a later one stay at their addresses: the later graph reads what the earlier one's replay wrote."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.graphs: list[Any] = []
        self.stream = torch.cuda.Stream()
        self._stream_ctx: Any = None

    def begin(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream())
        self._stream_ctx = torch.cuda.stream(self.stream)
        self._stream_ctx.__enter__()
        self._start()

    def _start(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(self.pool)
        self.graphs.append(graph)

    def cut(self) -> None:
        self.graphs[-1].capture_end()
        self._start()

    def end(self) -> list[Callable[[], None]]:
        """End the last segment; the replay callables, in capture order."""
        try:
            self.graphs[-1].capture_end()
        finally:
            self._stream_ctx.__exit__(None, None, None)
            torch.cuda.current_stream().wait_stream(self.stream)
        return [g.replay for g in self.graphs]


class CudaSegmentBackend:
    """`SplitGraphHook`'s capture backend on CUDA: side-stream warm-up, then segmented capture, one pool."""

    def __init__(self, warmup: int = 2) -> None:
        self.warmup = warmup
        self.pool: Any = None

    def warm(self, fn: Callable[[], Any]) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(self.warmup):
                fn()
        torch.cuda.current_stream().wait_stream(stream)

    def segments(self) -> CudaGraphSegments:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        return CudaGraphSegments(self.pool)


@attrs.define
class SplitPair:
    """The two graphs of one (signature, branch, decision): `head` runs the transformer up to and including the
    decision statistic (`stat`), `tail` the computed or the cached rest of the call, on `head`'s tensors."""

    static_leaves: list[Any]
    head: Callable[[], None]
    tail: Callable[[], None]
    stat: torch.Tensor
    static_output: Any
    replays: int = 0


class SplitGraphHook(ModelHook):
    """Innermost hook on the transformer with dynamic DBCache: each call is a head graph, one host read of the
    decision statistic, then the computed-step or the cached-step tail graph.

    One Python execution can only follow one path, so a head and a tail are captured together, as a pair per
    (input signature, CFG branch, decision). A call replays the head of the pair its branch used last (the
    decision rarely changes from one step to the next), reads the statistic, and when the decision differs,
    replays the other pair's head (so its tail reads its own head's tensors) before that tail. A pair is only
    captured once its decision is known (rules that need no statistic, or a statistic read from another pair's
    head): warming a pair up runs its path, and the computed path writes the residual and reference slots. Same
    rules, same statistic ops as eager DBCache, so the same decisions (tested bitwise on the CPU with a
    recording stand-in for capture).

    `backend`: `warm(fn)` and `segments()` (`CudaSegmentBackend` on a GPU; injectable for CPU tests).
    """

    replaces_forward = True

    def __init__(self, backend: Any, cache: Any) -> None:
        self.backend = backend
        self.cache = cache
        self.captured: dict[Hashable, SplitPair] = {}
        #: host reads of the decision statistic, and heads replayed a second time (the decision changed)
        self.reads = 0
        self.switches = 0

    def new_forward(self, module: torch.nn.Module, call_next: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        sig = signature(args, kwargs)
        branch, cached = self.cache.host_decision(sig)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if cached is None:  # the statistic decides: try the pair the branch used last
            guess = self.cache.last_cached.get(branch, False)
            pair = self.captured.get((sig, branch, guess))
            if pair is None:  # the computed pair of this signature exists: it served the step that set the reference
                guess, pair = False, self.captured.get((sig, branch, False))
            if pair is None:
                raise HookError(
                    f"SplitGraphHook: expected the computed-step graphs of branch {branch} for this input signature "
                    "(the branch's last computed step had it), found none. Report this to hookkit; "
                    "Compile(cuda_graphs='none') runs this cache without graphs meanwhile."
                )
            self._load(pair, leaves)
            pair.head()
            self.reads += 1
            cached = self.cache.judge(branch, float(pair.stat.item()))  # the one host read of the step
            if cached != guess:
                self.switches += 1
                pair = self._pair(call_next, leaves, spec, sig, branch, cached, head=True)
        else:
            pair = self._pair(call_next, leaves, spec, sig, branch, cached, head=True)
        pair.tail()
        pair.replays += 1
        self.cache.finish(branch, cached, sig)
        return _clone_tensors(pair.static_output)

    def _pair(self, call_next: Callable[..., Any], leaves: list[Any], spec: Any, sig: Hashable, branch: int,
              cached: bool, head: bool) -> SplitPair:
        """The pair of this decision with this call's inputs loaded and (when `head`) its head replayed."""
        pair = self.captured.get((sig, branch, cached))
        if pair is None:
            pair = self.captured[(sig, branch, cached)] = self._capture(call_next, leaves, spec, branch, cached)
        self._load(pair, leaves)
        if head:
            pair.head()
        return pair

    @staticmethod
    def _load(pair: SplitPair, leaves: list[Any]) -> None:
        for buffer, leaf in zip(pair.static_leaves, leaves):
            if isinstance(leaf, torch.Tensor) and leaf.data_ptr() != buffer.data_ptr():
                buffer.copy_(leaf)

    def _capture(self, call_next: Callable[..., Any], leaves: list[Any], spec: Any, branch: int,
                 cached: bool) -> SplitPair:
        static = [leaf.clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        static_args, static_kwargs = pytree.tree_unflatten(static, spec)
        run = lambda: call_next(*static_args, **static_kwargs)  # noqa: E731
        stats: list[torch.Tensor] = []
        with self.cache.forcing((branch, cached)):
            # One plain call first, whatever the backend's warm-up: the residual and reference slots this path
            # uses are allocated (and zeroed) here, outside any capture; allocated inside one, their zeroing
            # would be part of the graph and wipe them at every replay.
            run()
            self.backend.warm(run)
            segments = self.backend.segments()

            def cut(stat: torch.Tensor) -> None:
                if stats:
                    raise HookError("SplitGraphHook: expected one DBCache decision per transformer call, got a "
                                    "second one in the same call. Use Compile(cuda_graphs='none') with this model.")
                stats.append(stat)
                segments.cut()

            self.cache.on_decision = cut
            segments.begin()
            try:
                output = run()
            finally:
                self.cache.on_decision = None
                replays = segments.end()
        if not stats or len(replays) != 2:
            raise HookError("SplitGraphHook: expected the DBCache decision inside the transformer call, the call "
                            "ended without reaching it (no middle block ran). Use Compile(cuda_graphs='none').")
        return SplitPair(static_leaves=static, head=replays[0], tail=replays[1], stat=stats[0], static_output=output)


# --- plan / attach ----------------------------------------------------------------------------------------


def regional_paths(adapter: AdapterSpec, transformer: torch.nn.Module) -> list[str]:
    """Module paths of every instance of the adapter's repeated block classes, in module order."""
    return adapter.repeated_block_paths(transformer)


#: From torchao's recommended inductor settings for quantized models (`recommended_inductor_config_setter`),
#: passed to *hookkit's own* `torch.compile` calls instead of changing the process-wide config. Its
#: coordinate-descent tuning is not added: with it, fp8 Flux-dev compilation (default mode) took far too
#: long (BENCHMARKS.md). A mode that turns it on itself (max-autotune*) keeps it, as
#: it would without quantization: the chosen mode means the same for quantized and unquantized models.
QUANTIZED_INDUCTOR_OPTIONS: dict[str, Any] = {"force_fuse_int_mm_with_mul": True}


def compile_kwargs(spec: Compile, quantized: bool = False) -> dict[str, Any]:
    """torch.compile arguments; a quantized model also gets torchao's inductor options, scoped to this call.

    A torch.compile call takes a mode or options, not both, so for a quantized model the mode is spelled
    as torch's own options for it (`torch._inductor.list_mode_options(mode)`, e.g. reduce-overhead's
    `triton.cudagraphs=True`, which keeps the cudagraph trees that hookkit's step mark is planned for).
    """
    kwargs: dict[str, Any] = {"fullgraph": spec.fullgraph, "dynamic": spec.dynamic, "backend": spec.backend}
    if spec.backend != "inductor":  # modes and options are inductor's
        return kwargs
    mode = None if spec.mode in (None, "default") else spec.mode
    if quantized:
        # imported here: importing inductor is slow, and only quantized models need it
        from torch._inductor import list_mode_options

        kwargs["options"] = {**list_mode_options(mode or "default"), **QUANTIZED_INDUCTOR_OPTIONS}
    elif mode is not None:
        kwargs["mode"] = mode
    return kwargs


def uses_cudagraph_trees(spec: Compile) -> bool:
    """Whether torch.compile replays cudagraph trees: inductor's CUDA-graph modes, or the "cudagraphs"
    backend (torch/_dynamo/backends/cudagraphs.py runs `torch._inductor.cudagraph_trees` too). Their
    outputs are graph memory, so they need hookkit's step mark (and output clone when whole)."""
    return spec.backend == "cudagraphs" or spec.mode in CUDA_GRAPH_MODES


def check_spec(c: Compile) -> None:
    """Settings of `Compile` that cannot work together, refused before anything is attached (the rules that
    involve other features are in `hookkit.core.compat`)."""
    if c.cuda_graphs == "transformer":
        if c.mode in CUDA_GRAPH_MODES:
            raise SpecError(
                f"Compile.mode: expected None, 'default' or 'max-autotune-no-cudagraphs' with "
                f"cuda_graphs='transformer' (hookkit captures the graph itself), got {c.mode!r}."
            )
        if c.backend == "cudagraphs":
            raise SpecError(
                "Compile.backend: expected 'inductor', 'eager' or 'aot_eager' with cuda_graphs='transformer' "
                "(hookkit captures the whole transformer itself; the 'cudagraphs' backend would capture graphs "
                "inside that capture), got 'cudagraphs'. Use Compile(cuda_graphs='transformer') or "
                "Compile(backend='cudagraphs') alone."
            )


def check_on_cuda(transformer: torch.nn.Module) -> None:
    """`cuda_graphs="transformer"` captures the transformer's kernels: every parameter and buffer must be on
    a CUDA device, or the captured graph would miss the CPU work and every replay return stale output."""
    devices = sorted({str(t.device) for t in itertools.chain(transformer.parameters(), transformer.buffers())})
    if devices and all(d.startswith("cuda") for d in devices):
        return
    found = ", ".join(devices) or "no parameters"
    if not torch.cuda.is_available():
        raise UnsupportedError(
            f"Compile.cuda_graphs='transformer' needs a CUDA device; none is available (the transformer is on "
            f"{found}). Use cuda_graphs='none' on this machine."
        )
    raise UnsupportedError(
        f"Compile.cuda_graphs='transformer' needs a CUDA device: expected every parameter and buffer of "
        f"{type(transformer).__name__} on cuda, got {found}. Move the pipeline first (pipe.to(\"cuda\")), then "
        "call hookkit.enable."
    )


class _CompileFeature(BaseFeature):
    """Plugs compilation into `hookkit.enable`: `Spec.compile`."""

    name = NAME
    spec_class = Compile

    def plan(self, ctx: PlanContext) -> list[Attachment]:
        spec: Compile = ctx.spec.compile  # type: ignore[assignment]  # planned only when set
        check_spec(spec)
        if spec.cuda_graphs == "transformer":
            check_on_cuda(ctx.transformer)
        out: list[Attachment] = []
        cuda_graph_trees = uses_cudagraph_trees(spec)
        targets = regional_paths(ctx.adapter, ctx.transformer) if spec.regional else [""]
        if cuda_graph_trees:
            out.append(Attachment(feature=NAME, target="", name=STEP_MARK))
        for path in targets:
            out.append(Attachment(feature=NAME, target=path, name=INNER))
        if cuda_graph_trees and not spec.regional:  # the whole transformer's output is graph memory
            out.append(Attachment(feature=NAME, target="", name=CLONE))
        if spec.cuda_graphs == "transformer":
            out.append(Attachment(feature=NAME, target="", name=GRAPH))
        return out

    def attach(self, ctx: AttachContext, attachment: Attachment) -> Removable:
        spec: Compile = ctx.spec.compile  # type: ignore[assignment]
        module = module_at(ctx.transformer, attachment.target)
        if attachment.name == INNER:
            return _InnerCompile(module, compile_kwargs(spec, quantized=ctx.spec.quantize is not None))
        if attachment.name == CLONE:
            return add_hook(module, CLONE, CloneOutputsHook())
        if attachment.name == STEP_MARK:
            return add_hook(module, STEP_MARK, StepMarkHook())
        split = ctx.request(SplitDecisions)
        if split is not None and split.dynamic:  # a threshold decides: each call split at the decision
            return add_hook(module, GRAPH, ctx.keep(SplitGraphHook(CudaSegmentBackend(), split)))
        runner = ctx.keep(GraphRunner(CudaGraphBackend(), max_graphs=spec.max_graphs))
        return add_hook(module, GRAPH, GraphHook(runner, ctx.request(GraphDecisions)))

    def summarize(self, ctx: AttachContext) -> FeatureSummary | None:
        spec: Compile = ctx.spec.compile  # type: ignore[assignment]
        regions = [a.target for a in ctx.attachments() if a.name == INNER]
        data: dict[str, Any] = {
            "regional": spec.regional, "mode": spec.mode or "default", "regions": len(regions),
            "cuda_graphs": spec.cuda_graphs,
        }
        rows = [["regions compiled", len(regions) if spec.regional else "whole transformer"],
                ["mode", data["mode"]], ["fullgraph", spec.fullgraph]]
        if uses_cudagraph_trees(spec):
            # torch accepts reduce-overhead on the CPU and compiles without CUDA graphs: say so, once, here
            device = next(ctx.transformer.parameters()).device
            data["cudagraph_trees"] = device.type == "cuda"
            rows.append(["CUDA graph trees", "yes" if data["cudagraph_trees"] else
                         f"no: the transformer is on {device.type}, where torch.compile runs without CUDA graphs"])
        runner: GraphRunner | SplitGraphHook | None = ctx.kept()
        if isinstance(runner, GraphRunner):
            data["graphs_captured"] = runner.captures
            data["graphs_kept"] = len(runner.captured)
            data["graph_evictions"] = runner.evictions
            data["max_graphs"] = runner.max_graphs
            data["graph_replays"] = sum(e.replays for e in runner.captured.values())
            data["graph_memory_bytes"] = [e.memory_bytes for e in runner.captured.values()]
            memory = ", ".join(f"{b / 2**20:.1f}" for b in data["graph_memory_bytes"]) or "-"
            rows += [["transformer graphs captured", data["graphs_captured"]],
                     ["graphs kept / max", f"{data['graphs_kept']} / {runner.max_graphs}"],
                     ["graphs evicted", data["graph_evictions"]], ["graph replays (kept graphs)", data["graph_replays"]],
                     ["MiB per kept graph", memory]]
        elif isinstance(runner, SplitGraphHook):  # pairs of graphs split at a dynamic DBCache decision
            data["graphs_captured"] = 2 * len(runner.captured)
            data["graph_replays"] = sum(e.replays for e in runner.captured.values())
            data["decision_reads"], data["head_switches"] = runner.reads, runner.switches
            rows += [["transformer graphs captured", f"{data['graphs_captured']} (head + tail per decision)"],
                     ["graph replays", data["graph_replays"]], ["decision statistic host reads", runner.reads],
                     ["heads replayed twice (decision changed)", runner.switches]]
        return FeatureSummary(name=NAME, data=data, text=table(["setting", "value"], rows))


class _InnerCompile(Removal):
    """Installs `torch.compile(original forward)` as a module's inner callable; removal restores it."""

    def __init__(self, module: torch.nn.Module, kwargs: dict[str, Any]) -> None:
        # Compile before `HookRegistry.of` creates a registry: if torch.compile raises, the module's
        # `__dict__` is untouched (enable's rollback never sees this attachment).
        existing = HookRegistry.of(module, create=False)
        compiled = torch.compile(existing.original_forward if existing is not None else module.forward, **kwargs)
        HookRegistry.of(module).set_inner(compiled)
        self.module: torch.nn.Module | None = module

    def _undo(self) -> None:
        registry = HookRegistry.of(self.module, create=False)
        if registry is not None:
            registry.set_inner(None)
        self.module = None


FEATURE = _CompileFeature()
