"""The compile feature (`Spec.compile`): what it plans and attaches, its summary, and the inductor passes its
compiles share.

The parts live beside it: `regional.py` (blocks compiled as the inner callable of their hook registry, the step mark
and output clone that keep inductor's CUDA-graph modes safe, `compile_kwargs`, one backend per configuration:
`region_compiler`), `cuda_graphs.py` (whole-transformer
CUDA graphs: `GraphRunner`, `GraphHook`), `split_graphs.py` (those graphs split at a dynamic DBCache decision:
`SplitGraphHook`), `model_watch.py` (what a captured graph depends on, checked before every replay) and the graph
passes (`fp8_rows.py`, `real_rope.py`, `norm_rope.py`, `graph_pass.py`). Every name of those modules that callers
used from here is still importable from here. The feature looks up its capture backends and the CUDA-device check
in this module when it attaches, so that CPU tests replace them here (`hooks.CudaGraphBackend`, ...).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import attrs
import torch

from hookkit.core.compat import CUDA_GRAPH_MODES
from hookkit.core.feature import AttachContext, BaseFeature
from hookkit.core.graphs import EagerCalls, GraphDecisions, SplitDecisions
from hookkit.core.plan import Attachment, PlanContext, add_hook, module_at
from hookkit.core.removal import Removable
from hookkit.core.summary import SUMMARY_WIDTH, FeatureSummary, table
from hookkit.errors import SpecError
# the parts' names callers import from here (tests, benchmarks, `hookkit.features`) are re-exported with them
from hookkit.techniques.compile.cuda_graphs import (
    CapturedCall,
    CudaGraphBackend,
    GraphHook,
    GraphRunner,
    check_on_cuda,
    release_pool_if_empty,
    signature,
    warm_on_side_stream,
)
from hookkit.techniques.compile.model_watch import ModelWatch
from hookkit.techniques.compile.regional import (
    QUANTIZED_INDUCTOR_OPTIONS,
    CloneOutputsHook,
    RegionCompiler,
    StepMarkHook,
    _InnerCompile,
    compile_kwargs,
    quiet_subclass_cache_hash_warning,
    region_compiler,
    regional_paths,
    uses_cudagraph_trees,
)
from hookkit.techniques.compile.spec import Compile
from hookkit.techniques.compile.split_graphs import CudaGraphSegments, CudaSegmentBackend, SplitGraphHook, SplitPair


NAME = "compile"
INNER = "hookkit.compile.inner"
CLONE = "hookkit.compile.clone"
STEP_MARK = "hookkit.compile.step_mark"
GRAPH = "hookkit.compile.graph"


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
        state: CompileState = ctx.kept() or ctx.keep(CompileState())
        if attachment.name == INNER:
            quantized = ctx.spec.quantize is not None
            if quantized:
                quiet_subclass_cache_hash_warning()
            if quantized and spec.fuse_fp8_rows != "off" and spec.backend == "inductor" and state.fp8_rows is None:
                state.take("fp8_rows", shared_pass(new_fp8_rows_pass(fast=spec.fuse_fp8_rows == "fast")))
            if spec.fuse_norm_rope and spec.backend == "inductor" and state.norm_rope is None:
                state.take("norm_rope", shared_pass(new_norm_rope_pass()))
            if spec.real_rope and spec.backend == "inductor" and state.real_rope is None:
                state.take("real_rope", shared_pass(new_real_rope_pass(then=state.norm_rope)))
            if state.compiler is None:  # one configuration per handle: its regions share one compiler
                state.compiler = region_compiler(compile_kwargs(
                    spec, quantized=quantized, fp8_rows=state.fp8_rows, real_rope=state.real_rope,
                    norm_rope=state.norm_rope))
            return _InnerCompile(module, state.compiler, path=attachment.target, fullgraph=spec.fullgraph)
        if attachment.name == CLONE:
            return add_hook(module, CLONE, CloneOutputsHook())
        if attachment.name == STEP_MARK:
            return add_hook(module, STEP_MARK, StepMarkHook())
        split = ctx.request(SplitDecisions)
        eager = ctx.request(EagerCalls)  # the core's first-call check: its call runs uncaptured
        if split is not None and split.dynamic:  # a threshold decides: each call split at the decision
            state.runner = SplitGraphHook(CudaSegmentBackend(), split, require_cuda=True, eager=eager,
                                          device_check=check_on_cuda)
            return add_hook(module, GRAPH, state.runner)
        runner = state.runner = GraphRunner(CudaGraphBackend(), max_graphs=spec.max_graphs)
        return add_hook(module, GRAPH, GraphHook(runner, ctx.request(GraphDecisions), require_cuda=True,
                                                   eager=eager, device_check=check_on_cuda))

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
        state: CompileState = ctx.kept() or CompileState()
        # A graph pass's counter is listed when it counted something, or where it could have: a 0 there says the
        # pass found nothing to rewrite; elsewhere (fp8 passes without an fp8 scheme, the CUDA-only norm+RoPE
        # kernel on the CPU) it says nothing and is left to `data`.
        device = next(ctx.transformer.parameters(), torch.empty(0)).device
        scheme = ctx.spec.quantize.scheme if ctx.spec.quantize is not None else ""
        if state.fp8_rows is not None:
            data["fp8_rows_per_graph"] = state.per_graph("fp8_rows")
            data["fp8_rows_fused"] = sum(data["fp8_rows_per_graph"])
            data["fp8_rows_arithmetic"] = "fast" if state.fp8_rows.fast else "exact"
            data["fp8_rows_shared"] = sum(state.per_graph("fp8_rows", "shared_per_graph"))
            fp8 = scheme.startswith("fp8")
            if fp8 or data["fp8_rows_fused"]:
                rows.append(["fp8 row quantizations fused (one pass)",
                             f"{data['fp8_rows_arithmetic']}: {data['fp8_rows_fused']} rewritten by this handle's "
                             "compiles (a region served from inductor's FX graph cache was rewritten when cached)"])
            if state.fp8_rows.share and (fp8 or data["fp8_rows_shared"]):
                rows.append(["fp8 row quantizations shared (same input)",
                             f"{data['fp8_rows_shared']} dropped for an identical one by this handle's compiles"])
        if state.norm_rope is not None:
            data["norm_ropes_per_graph"] = state.per_graph("norm_rope")
            data["norm_ropes_fused"] = sum(data["norm_ropes_per_graph"])
            if data["norm_ropes_fused"] or device.type in getattr(state.norm_rope, "devices", ("cuda",)):
                rows.append(["query/key RMSNorm + RoPE in one pass",
                             f"{data['norm_ropes_fused']} rewritten by this handle's compiles"])
        if state.real_rope is not None:
            data["complex_muls_per_graph"] = state.per_graph("real_rope")
            data["complex_muls_as_real"] = sum(data["complex_muls_per_graph"])
            if data["complex_muls_as_real"] or device.type == "cuda":
                rows.append(["complex products as real arithmetic (RoPE)",
                             f"{data['complex_muls_as_real']} rewritten by this handle's compiles"])
        runner = state.runner
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
                     ["graphs evicted", data["graph_evictions"]],
                     ["graph replays (kept graphs)", data["graph_replays"]],
                     ["MiB per kept graph", memory]]
        elif isinstance(runner, SplitGraphHook):  # pairs of graphs split at a dynamic DBCache decision
            data["graphs_captured"] = 2 * runner.captures
            data["graphs_kept"] = 2 * len(runner.captured)
            data["graph_replays"] = sum(e.replays for e in runner.captured.values())
            data["decision_reads"], data["head_switches"] = runner.reads, runner.switches
            rows += [["transformer graphs captured", f"{data['graphs_captured']} (head + tail per decision)"],
                     ["graphs kept", data["graphs_kept"]], ["graph replays (kept graphs)", data["graph_replays"]],
                     ["decision statistic host reads", runner.reads],
                     ["heads replayed twice (decision changed)", runner.switches]]
        if runner is not None:
            data["graph_invalidations"] = len(getattr(runner, "invalidations", ()))
            data["eager_calls"] = runner.eager_calls
            rows += [["graphs dropped (model changed)", data["graph_invalidations"]],
                     ["calls run eagerly (first-call check)", runner.eager_calls]]
        return FeatureSummary(name=NAME, data=data, text=table(["setting", "value"], rows),
                              brief=table(["setting", "value"], rows, width=SUMMARY_WIDTH))


@attrs.define
class CompileState:
    """What one handle's compilation keeps: the whole-transformer graph runner, the compiler and graph passes its
    compiles share (`region_compiler`, `shared_pass`: the same objects for every enable of one configuration) and where
    the passes' per-graph counts stood when this handle took them, so that its summary counts its own compiles only."""

    runner: GraphRunner | SplitGraphHook | None = None
    #: the backend and dynamo context every region of this handle is compiled with
    compiler: RegionCompiler | None = None
    fp8_rows: Any | None = None
    real_rope: Any | None = None
    norm_rope: Any | None = None
    #: each pass's number of counted graphs when this handle took it, by the field's name
    first_graph: dict[str, int] = attrs.field(factory=dict)

    def take(self, name: str, graph_pass: Any) -> None:
        """Keep `graph_pass` as field `name`, counting its graphs from now on."""
        setattr(self, name, graph_pass)
        self.first_graph[name] = len(graph_pass.per_graph)

    def per_graph(self, name: str, counts: str = "per_graph") -> list[int]:
        """The pass's per-graph `counts` (a list it appends one entry to per graph) since this handle took it."""
        return list(getattr(getattr(self, name), counts)[self.first_graph[name]:])


#: The graph passes of every compile configuration so far, by `_pass_key`, reused by each later enable of it. Dynamo
#: keeps a compiled block for a backend equal to the one that compiled it, and inductor's backends are equal when their
#: options are, pass objects compared by identity: with new passes at each enable, every enable recompiled every block
#: until torch's recompile limit (8 per code object) failed the 8th enable, and every later compile of the class.
_SHARED_PASSES: dict[Hashable, Any] = {}


def _pass_key(graph_pass: Any) -> Hashable:
    """What makes two of hookkit's passes rewrite alike: their class, settings and the pass chained after them (one
    that is not hookkit's by identity: the kept pass holds it, so its id cannot pass to another object)."""
    from hookkit.techniques.compile.graph_pass import CountingPass

    then = graph_pass.then
    return type(graph_pass), graph_pass.settings(), _pass_key(then) if isinstance(then, CountingPass) else id(then)


def shared_pass(graph_pass: Any) -> Any:
    """`graph_pass`, or the pass an earlier enable made with the same key (then `graph_pass` is dropped): one set of
    pass objects, hence one backend, per compile configuration, so that enabling again reuses the compiled blocks."""
    return _SHARED_PASSES.setdefault(_pass_key(graph_pass), graph_pass)


def new_fp8_rows_pass(fast: bool = False) -> Any:
    """A `FusedFp8Rows` pass chained before any `post_grad_custom_post_pass` already set process-wide (hookkit's
    per-call options replace that setting for its own compiles)."""
    import torch._inductor.config as inductor_config

    from hookkit.techniques.compile.fp8_rows import FusedFp8Rows  # imports inductor: only quantized compiles

    return FusedFp8Rows(fast=fast, layer_norm=fast and ADALN_ROWS, share=ADALN_ROWS,
                        then=inductor_config.post_grad_custom_post_pass)


#: On by default: with `fuse_fp8_rows="fast"`, Linears that quantize the same input share one
#: quantization and AdaLN inputs (`layer_norm(h) * (1 + scale) + shift`) are quantized in one pass by hookkit's kernel
#: (rounding to bf16 where eager rounds: its GPU tests pass, and the trained tiny Flux compiled with it
#: keeps 43.1 dB against bf16, BENCHMARKS.md). A module switch, not a `Compile` field: benchmarks turn it off
#: (`step_profile.py`'s `+noadaln`) to measure it against inductor's own quantization.
ADALN_ROWS = True


def new_real_rope_pass(then: Any | None = None) -> Any:
    """A `RealComplexMul` pass chained before `then` (the norm-rope pass, which needs the complex rotations written as
    real arithmetic) or else before any `post_grad_custom_pre_pass` already set process-wide."""
    import torch._inductor.config as inductor_config

    from hookkit.techniques.compile.real_rope import RealComplexMul

    return RealComplexMul(then=then if then is not None else inductor_config.post_grad_custom_pre_pass)


def new_norm_rope_pass() -> Any:
    """A `FusedNormRope` pass chained before any `post_grad_custom_pre_pass` already set process-wide."""
    import torch._inductor.config as inductor_config

    from hookkit.techniques.compile.norm_rope import FusedNormRope

    return FusedNormRope(then=inductor_config.post_grad_custom_pre_pass)


FEATURE = _CompileFeature()
