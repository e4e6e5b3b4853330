"""Regional compilation, CUDA-graph safety hooks and the whole-transformer graph runner (logic on CPU)."""

from __future__ import annotations

import contextlib
import gc
import weakref
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

import hookkit
from hookkit.tools import zoo
from hookkit.errors import EnableError, HookError, SpecError, UnsupportedError
from hookkit.core.graphs import EagerCalls
from hookkit.core.registry import HookRegistry, registry_names
from hookkit.techniques.compile.hooks import (
    GraphRunner,
    RegionCompiler,
    compile_kwargs,
    regional_paths,
    signature,
)

FAST = dict(backend="aot_eager")


def run(pipe, name: str = "flux", steps: int = 3, **extra) -> torch.Tensor:
    out = pipe(**zoo.call_kwargs(name, steps=steps, **extra))
    return out.images if hasattr(out, "images") else out.frames


def test_regional_plan_compiles_every_repeated_block_and_nothing_else() -> None:
    pipe = zoo.tiny_pipeline("flux")
    plan = hookkit.build_plan(pipe, hookkit.Spec(compile=hookkit.Compile(**FAST)))
    assert plan.targets("compile") == [
        ("transformer_blocks.0", "hookkit.compile.inner"),
        ("transformer_blocks.1", "hookkit.compile.inner"),
        ("single_transformer_blocks.0", "hookkit.compile.inner"),
        ("single_transformer_blocks.1", "hookkit.compile.inner"),
        ("single_transformer_blocks.2", "hookkit.compile.inner"),
    ]


def test_cogvideox_compiles_regionally_although_its_class_lacks_repeated_blocks() -> None:
    transformer = zoo.tiny_transformer("cogvideox")
    assert regional_paths(hookkit.get_adapter("cogvideox"), transformer) == [
        "transformer_blocks.0", "transformer_blocks.1", "transformer_blocks.2"]


def test_regional_reduce_overhead_adds_a_step_mark_outside_the_regions() -> None:
    pipe = zoo.tiny_pipeline("qwenimage")
    plan = hookkit.build_plan(pipe, hookkit.Spec(compile=hookkit.Compile(mode="reduce-overhead")))
    assert plan.targets("compile") == [("", "hookkit.compile.step_mark")] + [
        (f"transformer_blocks.{i}", "hookkit.compile.inner") for i in range(3)
    ]


def test_whole_reduce_overhead_also_clones_the_transformer_output() -> None:
    pipe = zoo.tiny_pipeline("qwenimage")
    plan = hookkit.build_plan(pipe, hookkit.Spec(compile=hookkit.Compile(regional=False, mode="reduce-overhead")))
    assert plan.targets("compile") == [
        ("", "hookkit.compile.step_mark"), ("", "hookkit.compile.inner"), ("", "hookkit.compile.clone")]


def test_regional_cudagraphs_backend_adds_the_step_mark_like_reduce_overhead() -> None:
    """torch's "cudagraphs" backend replays cudagraph trees too, so it needs the same boundary mark."""
    pipe = zoo.tiny_pipeline("qwenimage")
    plan = hookkit.build_plan(pipe, hookkit.Spec(compile=hookkit.Compile(backend="cudagraphs")))
    assert plan.targets("compile") == [("", "hookkit.compile.step_mark")] + [
        (f"transformer_blocks.{i}", "hookkit.compile.inner") for i in range(3)
    ]


def test_whole_cudagraphs_backend_also_clones_the_transformer_output() -> None:
    pipe = zoo.tiny_pipeline("qwenimage")
    plan = hookkit.build_plan(pipe, hookkit.Spec(compile=hookkit.Compile(regional=False, backend="cudagraphs")))
    assert plan.targets("compile") == [
        ("", "hookkit.compile.step_mark"), ("", "hookkit.compile.inner"), ("", "hookkit.compile.clone")]


def test_step_mark_hook_marks_a_cudagraph_step_at_every_transformer_call(monkeypatch: pytest.MonkeyPatch) -> None:
    marks: list[int] = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    pipe = zoo.tiny_pipeline("flux")
    hookkit.enable(pipe, hookkit.Spec(compile=hookkit.Compile(mode="reduce-overhead", backend="aot_eager")))
    run(pipe, steps=3)
    assert len(marks) == 3


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU's summary")
def test_reduce_overhead_on_the_cpu_says_in_the_summary_that_no_cuda_graphs_run() -> None:
    pipe = zoo.tiny_pipeline("flux")
    handle = hookkit.enable(pipe, hookkit.Spec(compile=hookkit.Compile(mode="reduce-overhead", backend="aot_eager")))
    feature = handle.summary().features["compile"]
    assert feature.data["cudagraph_trees"] is False
    assert "| CUDA graph trees | no: the transformer is on cpu, where torch.compile runs without CUDA graphs |" \
        in feature.text


def test_clone_hook_returns_fresh_tensors_with_equal_values() -> None:
    from hookkit.techniques.compile.hooks import CloneOutputsHook

    out = (torch.ones(2), torch.zeros(1))
    cloned = CloneOutputsHook().post_forward(torch.nn.Identity(), out)
    assert all(torch.equal(a, b) and a.data_ptr() != b.data_ptr() for a, b in zip(cloned, out))


@pytest.mark.parametrize("name", ["flux", "cogvideox"])
def test_regional_compile_matches_eager_and_removal_restores_the_blocks(name: str) -> None:
    pipe = zoo.tiny_pipeline(name)
    reference = run(pipe, name)
    handle = hookkit.enable(pipe, hookkit.Spec(compile=hookkit.Compile(**FAST)))
    compiled = run(pipe, name)
    handle.remove()
    torch.testing.assert_close(compiled, reference, rtol=1e-5, atol=1e-5)
    assert all("forward" not in m.__dict__ and "_hookkit_registry" not in m.__dict__
               for m in pipe.transformer.modules())
    assert torch.equal(run(pipe, name), reference)


def test_regional_compile_puts_a_compiled_callable_inside_each_blocks_hooks() -> None:
    pipe = zoo.tiny_pipeline("flux")
    handle = hookkit.enable(pipe, hookkit.Spec(compile=hookkit.Compile(**FAST)))
    for path in regional_paths(handle.adapter, pipe.transformer):
        registry = HookRegistry.of(pipe.transformer.get_submodule(path), create=False)
        # `_inner` is what the hook chain calls last: torch.compile's wrapper of the block's own forward, inside the
        # one that names a graph break (fullgraph)
        assert registry._inner is not registry.original_forward
        assert registry._inner.__wrapped__._torchdynamo_orig_callable == registry.original_forward


def test_without_fullgraph_the_compiled_callable_is_torch_compiles_own() -> None:
    pipe = zoo.tiny_pipeline("flux")
    handle = hookkit.enable(pipe, hookkit.Spec(compile=hookkit.Compile(**FAST, fullgraph=False)))
    for path in regional_paths(handle.adapter, pipe.transformer):
        registry = HookRegistry.of(pipe.transformer.get_submodule(path), create=False)
        assert registry._inner._torchdynamo_orig_callable == registry.original_forward


def test_the_first_call_builds_three_graphs_and_later_calls_none() -> None:
    """Dynamo really compiles: one graph for the double block, two for the single block (its first instance
    gets a contiguous hidden_states, later ones a view of the concatenated stream with another stride)."""
    pipe = zoo.tiny_pipeline("flux")
    hookkit.enable(pipe, hookkit.Spec(compile=hookkit.Compile(**FAST)))
    torch._dynamo.reset()
    counters.clear()
    run(pipe, steps=1)
    assert counters["stats"]["unique_graphs"] == 3
    run(pipe, steps=4)
    run(pipe, steps=3)
    assert counters["stats"]["unique_graphs"] == 3  # no step or call recompiles


@pytest.mark.slow  # one inductor compile of three block graphs on the CPU (about a minute on two cores)
def test_enabling_the_same_inductor_compile_ten_times_compiles_the_blocks_once() -> None:
    """A server toggling hookkit: every enable of one configuration reuses its graph passes, hence an equal inductor
    backend, so dynamo keeps the blocks it compiled; new passes at each enable recompiled every block until torch's
    recompile limit failed the 8th enable (and every later compile of the class)."""
    pipe = zoo.tiny_pipeline("flux")
    torch._dynamo.reset()
    counters.clear()
    graphs = []
    for _ in range(10):
        with hookkit.enable(pipe, hookkit.Spec(compile=hookkit.Compile(regional=True))):
            run(pipe, steps=1)
        graphs.append(counters["stats"]["unique_graphs"])
    fresh = zoo.tiny_pipeline("flux")  # another pipeline of the class reuses them too
    with hookkit.enable(fresh, hookkit.Spec(compile=hookkit.Compile(regional=True))):
        run(fresh, steps=1)
    graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == [3] * 11


def _backend_of(pipe, compile_spec: hookkit.Compile):
    """The backend object dynamo compiles the regions of one enable of `compile_spec` with."""
    with hookkit.enable(pipe, hookkit.Spec(compile=compile_spec)) as handle:
        return handle._slots["compile"].compiler.backend


def test_enables_of_equal_compile_specs_share_one_backend_and_other_specs_get_their_own() -> None:
    """Dynamo keeps a compiled block for the backend that compiled it: one backend object per configuration is what
    lets a second enable reuse the blocks (torch.compile would build a new one at every call)."""
    pipe = zoo.tiny_pipeline("flux")
    first = _backend_of(pipe, hookkit.Compile())
    assert _backend_of(pipe, hookkit.Compile()) is first
    assert _backend_of(zoo.tiny_pipeline("flux"), hookkit.Compile()) is first  # another pipeline of the class too
    others = [_backend_of(pipe, c) for c in (hookkit.Compile(mode="max-autotune-no-cudagraphs"),
                                             hookkit.Compile(real_rope=False), hookkit.Compile(**FAST))]
    assert len({id(b) for b in [first, *others]}) == 4


def test_a_dynamo_reset_gives_the_next_enable_a_new_backend() -> None:
    # torch._dynamo.reset() forgets (and resets) every backend it lists: hookkit's is built anew, as torch.compile's is
    pipe = zoo.tiny_pipeline("flux")
    before = _backend_of(pipe, hookkit.Compile(**FAST))
    torch._dynamo.reset()
    after = _backend_of(pipe, hookkit.Compile(**FAST))
    assert after is not before and _backend_of(pipe, hookkit.Compile(**FAST)) is after


def test_an_enable_call_disable_cycle_leaves_nothing_alive_and_no_backend_in_dynamo() -> None:
    """A server toggling hookkit: after the first cycle, a cycle adds nothing to dynamo's process-wide table of
    backends (torch.compile added one per region and enable, kept until torch._dynamo.reset()), and the handle, its
    hooks, registries and compiled callables are freed at disable."""
    from torch._dynamo.eval_frame import cached_backends

    pipe = zoo.tiny_pipeline("flux")
    spec = hookkit.Spec(compile=hookkit.Compile(**FAST))

    def cycle() -> list[weakref.ref]:
        handle = hookkit.enable(pipe, spec)
        run(pipe, steps=2)
        registries = [r for m in pipe.transformer.modules() if (r := HookRegistry.of(m, create=False)) is not None]
        hooks = [hook for r in registries for hook in r._hooks.values()]
        compiled = [HookRegistry.of(pipe.transformer.get_submodule(path), create=False)._inner
                    for path in regional_paths(handle.adapter, pipe.transformer)]
        assert (len(registries), len(hooks), len(compiled)) == (6, 1, 5)  # the clock's registry and hook, 5 blocks
        refs = [weakref.ref(o) for o in (handle, *registries, *hooks, *compiled)]
        handle.remove()
        return refs

    cycle()
    backends = len(cached_backends)
    refs = [cycle() for _ in range(3)]
    gc.collect()
    assert len(cached_backends) == backends
    assert [sum(r() is not None for r in cycle_refs) for cycle_refs in refs] == [0, 0, 0]


def test_whole_transformer_compile_wraps_the_transformer_inside_the_clock() -> None:
    pipe = zoo.tiny_pipeline("flux")
    reference = run(pipe)
    handle = hookkit.enable(pipe, hookkit.Spec(compile=hookkit.Compile(regional=False, **FAST)))
    assert handle.plan.targets("compile") == [("", "hookkit.compile.inner")]
    torch.testing.assert_close(run(pipe), reference, rtol=1e-5, atol=1e-5)
    assert handle.state.calls == 3  # the clock hook still runs outside the compiled transformer
    handle.remove()
    assert registry_names(pipe.transformer) == () and "forward" not in pipe.transformer.__dict__


def test_a_failing_torch_compile_leaves_every_module_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    pipe = zoo.tiny_pipeline("flux")

    def snapshot() -> dict[str, list[tuple[str, int]]]:
        return {path: [(k, id(v)) for k, v in m.__dict__.items()] for path, m in pipe.transformer.named_modules()}

    before = snapshot()
    real_compile, calls = RegionCompiler.__call__, []

    def compile_failing_on_the_third_region(self, fn):
        calls.append(fn)
        if len(calls) == 3:
            raise RuntimeError("torch.compile failed on the 3rd region")
        return real_compile(self, fn)

    monkeypatch.setattr(RegionCompiler, "__call__", compile_failing_on_the_third_region)
    with pytest.raises(RuntimeError, match="torch.compile failed on the 3rd region"):
        hookkit.enable(pipe, hookkit.Spec(compile=hookkit.Compile(**FAST)))
    assert len(calls) == 3
    assert snapshot() == before  # the rollback removed the 2 compiled regions and the clock; the 3rd was never touched


def test_compile_on_a_bare_transformer_is_one_enable_so_a_later_enable_is_refused() -> None:
    pipe = zoo.tiny_pipeline("flux")
    handle = hookkit.enable(pipe.transformer, hookkit.Spec(compile=hookkit.Compile(**FAST)))
    assert hookkit.handle_of(pipe.transformer) is handle
    assert registry_names(pipe.transformer) == ("hookkit.clock",)
    with pytest.raises(EnableError, match="hookkit is already enabled on this FluxTransformer2DModel"):
        hookkit.enable(pipe, hookkit.Spec(cache=hookkit.DBCache()))
    handle.remove()
    assert all("forward" not in m.__dict__ and "_hookkit_registry" not in m.__dict__
               for m in pipe.transformer.modules())


def test_cache_needs_regional_compilation() -> None:
    spec = hookkit.Spec(cache=hookkit.DBCache(), compile=hookkit.Compile(regional=False))
    with pytest.raises(SpecError, match=r"Compile.regional: expected True with DBCache"):
        hookkit.build_plan(zoo.tiny_pipeline("flux"), spec)


def test_transformer_graphs_refuse_cudagraph_modes() -> None:
    spec = hookkit.Spec(compile=hookkit.Compile(mode="reduce-overhead", cuda_graphs="transformer"))
    with pytest.raises(SpecError, match=r"Compile.mode: expected None, 'default' or 'max-autotune-no-cudagraphs'"):
        hookkit.build_plan(zoo.tiny_pipeline("flux"), spec)


def test_transformer_graphs_refuse_the_cudagraphs_backend() -> None:
    spec = hookkit.Spec(compile=hookkit.Compile(backend="cudagraphs", cuda_graphs="transformer"))
    with pytest.raises(SpecError) as err:
        hookkit.build_plan(zoo.tiny_pipeline("flux"), spec)
    assert str(err.value) == (
        "Compile.backend: expected 'inductor', 'eager' or 'aot_eager' with cuda_graphs='transformer' (hookkit "
        "captures the whole transformer itself; the 'cudagraphs' backend would capture graphs inside that capture), "
        "got 'cudagraphs'. Use Compile(cuda_graphs='transformer') or Compile(backend='cudagraphs') alone.")


def test_transformer_graphs_need_memo_where_the_prologue_builds_tensors() -> None:
    spec = hookkit.Spec(compile=hookkit.Compile(cuda_graphs="transformer"))
    with pytest.raises(SpecError, match=r"Spec.memo: expected True with Compile\(cuda_graphs='transformer'\) on "
                                        r"'qwenimage'.*Use Spec\(memo=True"):
        hookkit.build_plan(zoo.tiny_pipeline("qwenimage"), spec)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error")
def test_transformer_graphs_need_cuda() -> None:
    spec = hookkit.Spec(compile=hookkit.Compile(cuda_graphs="transformer"))
    with pytest.raises(UnsupportedError) as err:
        hookkit.enable(zoo.tiny_pipeline("flux"), spec)
    assert str(err.value) == ("Compile.cuda_graphs='transformer' needs a CUDA device; none is available (the "
                              "transformer is on cpu). Use cuda_graphs='none' on this machine.")


def test_transformer_graphs_refuse_a_transformer_left_on_the_cpu_of_a_cuda_machine(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA device is not enough: a graph captured around CPU work would replay stale output."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    spec = hookkit.Spec(compile=hookkit.Compile(cuda_graphs="transformer"))
    with pytest.raises(UnsupportedError) as err:
        hookkit.build_plan(zoo.tiny_pipeline("flux"), spec)
    assert str(err.value) == (
        "Compile.cuda_graphs='transformer' needs a CUDA device: expected every parameter and buffer of "
        "FluxTransformer2DModel on cuda, got cpu. Move the pipeline first (pipe.to(\"cuda\")), then call "
        "hookkit.enable.")


# --- GraphRunner bookkeeping with a stand-in capture backend ---------------------------------------------


class ReplayBackend:
    """Stands in for CUDA graph capture: 'capture' runs fn once; 'replay' re-runs it on the static buffers,
    taking the same path as at capture (a DBCache decision forced then is forced again), as a graph would."""

    def __init__(self, bridge=None) -> None:
        self.captures = 0
        self.bridge = bridge

    def capture(self, fn):
        self.captures += 1
        forced = self.bridge.forced if self.bridge is not None else None
        holder = {"out": fn()}

        def replay() -> None:
            if self.bridge is not None:
                self.bridge.forced = forced
            try:
                fresh = fn()
            finally:
                if self.bridge is not None:
                    self.bridge.forced = None
            for static, new in zip(torch.utils._pytree.tree_leaves(holder["out"]),
                                   torch.utils._pytree.tree_leaves(fresh)):
                static.copy_(new)  # a real replay writes into the same output memory

        return replay, holder["out"]


def double(x: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
    return x * scale


def test_runner_captures_once_per_signature_and_replays_with_new_values() -> None:
    backend = ReplayBackend()
    runner = GraphRunner(backend)
    a, b = torch.ones(2), torch.full((2,), 3.0)
    assert torch.equal(runner(double, (a,), {}), a * 2)
    assert torch.equal(runner(double, (b,), {}), b * 2)  # same signature: inputs copied into the static buffer
    assert backend.captures == 1
    runner(double, (torch.ones(3),), {})  # new shape: new graph
    runner(double, (a,), {"scale": 3.0})  # new non-tensor value: new graph
    assert backend.captures == 3
    assert [e.replays for e in runner.captured.values()] == [2, 1, 1]


def test_runner_outputs_survive_later_replays() -> None:
    """CFG keeps the conditional output while the unconditional call replays the same graph."""
    runner = GraphRunner(ReplayBackend())
    cond = runner(double, (torch.ones(2),), {})
    uncond = runner(double, (torch.zeros(2),), {})
    assert torch.equal(cond, torch.full((2,), 2.0))
    assert torch.equal(uncond, torch.zeros(2))


def test_runner_never_aliases_the_callers_inputs() -> None:
    runner = GraphRunner(ReplayBackend())
    x = torch.ones(2)
    runner(double, (x,), {})
    static = next(iter(runner.captured.values())).static_leaves[0]
    assert static.data_ptr() != x.data_ptr()


class PoolBackend(ReplayBackend):
    """Records captures and pool releases in order, as CudaGraphBackend sees them."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[str] = []

    def release_pool(self) -> None:
        self.events.append("release")

    def capture(self, fn):
        self.events.append("capture")
        return super().capture(fn)


def test_a_capture_after_an_invalidation_starts_a_new_memory_pool() -> None:
    """Capturing into a pool no graph holds any more trips the CUDA allocator's `use_count > 0` assert (H200)."""
    backend = PoolBackend()
    runner = GraphRunner(backend)
    runner(double, (torch.ones(2),), {})
    runner(double, (torch.ones(3),), {})  # a second graph shares the pool
    runner.invalidate("in-place write")
    runner(double, (torch.ones(2),), {})
    assert backend.events == ["release", "capture", "capture", "release", "capture"]


def test_a_capture_after_the_last_graph_was_evicted_starts_a_new_memory_pool() -> None:
    backend = PoolBackend()
    runner = GraphRunner(backend, max_graphs=1)
    runner(double, (torch.ones(2),), {})
    runner(double, (torch.ones(3),), {})  # evicts the only graph
    assert backend.events == ["release", "capture", "release", "capture"] and runner.evictions == 1


def test_signature_distinguishes_shape_dtype_stride_and_values() -> None:
    x = torch.zeros(2, 3)
    base = signature((x,), {"n": 1})
    assert signature((torch.ones(2, 3),), {"n": 1}) == base  # values of tensors do not matter
    assert signature((x.t(),), {"n": 1}) != base
    assert signature((x.half(),), {"n": 1}) != base
    assert signature((x,), {"n": 2}) != base
    assert signature((x,), {"n": 1, "m": None}) != base


# --- DBCache under whole-transformer graphs (the bridge's bookkeeping, with the stand-in backend) -----------

MASK = (1, 1, 0, 1, 0, 0)


def _graph_cached_pipeline(name: str, cache: hookkit.DBCache):
    """A pipeline with DBCache and a GraphHook driven by the stand-in backend (CUDA capture is GPU-only)."""
    from hookkit.techniques.compile.hooks import GRAPH, GraphHook
    from hookkit.techniques.cache.hooks import graph_bridge

    pipe = zoo.tiny_pipeline(name)
    handle = hookkit.enable(pipe, hookkit.Spec(cache=cache))
    bridge = graph_bridge(handle)
    backend = ReplayBackend(bridge)
    # as Compile(cuda_graphs="transformer") attaches it: the first-call check's call runs uncaptured
    HookRegistry.of(pipe.transformer).register(GRAPH, GraphHook(GraphRunner(backend), bridge,
                                                                eager=handle.service(EagerCalls)))
    return pipe, handle, backend


def _cache_stats(handle) -> tuple:
    data = handle.summary().features["cache"].data
    return data["block_calls"], {i: (b["computed"], b["cached"]) for i, b in data["branches"].items()}


def test_dbcache_under_transformer_graphs_matches_dbcache_eager_bitwise() -> None:
    cache = hookkit.DBCache(fn_blocks=1, steps_mask=MASK, mask_policy="static", taylorseer_order=0)
    eager_pipe = zoo.tiny_pipeline("flux")
    eager = hookkit.enable(eager_pipe, hookkit.Spec(cache=cache))
    reference = run(eager_pipe, steps=6)
    pipe, handle, backend = _graph_cached_pipeline("flux", cache)
    for _ in range(2):  # the second call is served by replays only
        assert torch.equal(run(pipe, steps=6), reference)
        assert _cache_stats(handle) == _cache_stats(eager)
    assert backend.captures == 2  # one computed-step graph, one cached-step graph
    assert _cache_stats(handle)[1] == {0: ([0, 1, 3], [2, 4, 5])}


def test_dbcache_under_transformer_graphs_keeps_cfg_branches_apart() -> None:
    cache = hookkit.DBCache(fn_blocks=1, steps_mask=MASK, mask_policy="static", taylorseer_order=0)
    kw = dict(true_cfg_scale=4.0)

    def cfg_run(pipe) -> torch.Tensor:
        args = zoo.call_kwargs("qwenimage", steps=6, **kw)
        args.update(negative_prompt_embeds=torch.randn_like(args["prompt_embeds"]) * 0 + 0.5,
                    negative_prompt_embeds_mask=args["prompt_embeds_mask"])
        return pipe(**args).images

    eager_pipe = zoo.tiny_pipeline("qwenimage")
    hookkit.enable(eager_pipe, hookkit.Spec(cache=cache))
    reference = cfg_run(eager_pipe)
    pipe, handle, backend = _graph_cached_pipeline("qwenimage", cache)
    assert torch.equal(cfg_run(pipe), reference)
    assert backend.captures == 4  # (branch 0, 1) x (computed, cached)
    assert _cache_stats(handle)[1] == {0: ([0, 1, 3], [2, 4, 5]), 1: ([0, 1, 3], [2, 4, 5])}


# --- the first-call adapter check under whole-transformer graphs (the real attach, CUDA stood in on the CPU) ---

GRAPHS = hookkit.Compile(cuda_graphs="transformer", backend="eager")


def _cpu_graphs(monkeypatch: pytest.MonkeyPatch, backend) -> None:
    """Let `Compile(cuda_graphs="transformer")` attach on the CPU as on a GPU: the CUDA check passes and `backend`
    stands in for CUDA capture (the rest is what a GPU runs: regional compile, `GraphHook`, the core's wiring)."""
    from hookkit.techniques.compile import hooks

    monkeypatch.setattr(hooks, "check_on_cuda", lambda transformer: None)
    monkeypatch.setattr(hooks, "CudaGraphBackend", lambda: backend)


def _reversed_flux() -> hookkit.AdapterSpec:
    import attrs

    flux = hookkit.get_adapter("flux")
    return attrs.evolve(flux, name="flux-reversed", blocks=tuple(reversed(flux.blocks)))


def test_transformer_graphs_refuse_blocks_out_of_execution_order_at_the_first_call_as_eager_mode_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from hookkit.errors import AdapterError

    eager_pipe = zoo.tiny_pipeline("flux")
    hookkit.enable(eager_pipe, hookkit.Spec(), adapter=_reversed_flux())
    with pytest.raises(AdapterError) as eager_error:
        run(eager_pipe, steps=2)
    backend = ReplayBackend()
    _cpu_graphs(monkeypatch, backend)
    pipe = zoo.tiny_pipeline("flux")
    handle = hookkit.enable(pipe, hookkit.Spec(compile=GRAPHS), adapter=_reversed_flux())
    for _ in range(2):  # refused again at the next call: the check stays armed, and nothing was captured
        with pytest.raises(AdapterError) as error:
            run(pipe, steps=2)
        assert str(error.value) == str(eager_error.value)
        assert "expected the blocks to run in the order of its [[blocks]] tables" in str(error.value)
    assert backend.captures == 0
    assert handle.summary().first_call == "pending"
    assert all("hookkit.check" not in registry_names(b) for b in pipe.transformer.transformer_blocks)


def test_transformer_graphs_run_the_checked_first_call_eagerly_and_capture_from_the_next(
        monkeypatch: pytest.MonkeyPatch) -> None:
    eager_pipe = zoo.tiny_pipeline("flux")
    backend = ReplayBackend()
    _cpu_graphs(monkeypatch, backend)
    pipe = zoo.tiny_pipeline("flux")
    handle = hookkit.enable(pipe, hookkit.Spec(compile=GRAPHS))
    assert torch.equal(run(pipe, steps=1), run(eager_pipe, steps=1))  # the checked call alone: nothing captured
    assert (backend.captures, handle.summary().first_call) == (0, "confirmed")
    for _ in range(2):
        assert torch.equal(run(pipe, steps=3), run(eager_pipe, steps=3))
    data = handle.summary().features["compile"].data
    # one capture (no observer in it, so the watch never saw hooks go), replayed by every later call
    assert (backend.captures, data["graph_invalidations"], data["eager_calls"], data["graph_replays"]) == (1, 0, 1, 6)


def test_a_step_cached_right_after_the_eager_first_call_reuses_its_residual() -> None:
    """The first call (computed) ran uncaptured, in the hooks alone: the cache takes over its residual and geometry
    (`adopted`), so step 1 is cached as in eager mode, by a graph captured on that residual."""
    cache = hookkit.DBCache(fn_blocks=1, steps_mask=(1, 0, 1, 0), mask_policy="static", taylorseer_order=0)
    eager_pipe = zoo.tiny_pipeline("flux")
    eager = hookkit.enable(eager_pipe, hookkit.Spec(cache=cache))
    reference = run(eager_pipe, steps=4)
    pipe, handle, backend = _graph_cached_pipeline("flux", cache)
    assert torch.equal(run(pipe, steps=4), reference)
    assert _cache_stats(handle) == _cache_stats(eager)
    assert _cache_stats(handle)[1] == {0: ([0, 2], [1, 3])}
    assert backend.captures == 2


def test_the_graph_hook_asks_the_cores_first_call_check_which_call_runs_eagerly(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from hookkit.techniques.compile.hooks import GRAPH, GraphHook, SplitGraphHook

    _cpu_graphs(monkeypatch, ReplayBackend())
    monkeypatch.setattr("hookkit.techniques.compile.hooks.CudaSegmentBackend", lambda: None)
    for spec, kind in ((hookkit.Spec(compile=GRAPHS), GraphHook),
                       (hookkit.Spec(cache=hookkit.DBCache(threshold=0.1, taylorseer_order=0), compile=GRAPHS),
                        SplitGraphHook)):
        pipe = zoo.tiny_pipeline("flux")
        handle = hookkit.enable(pipe, spec)
        hook = HookRegistry.of(pipe.transformer).get(GRAPH)
        assert type(hook) is kind
        assert hook.eager is handle.service(EagerCalls) is handle.first_call
        assert isinstance(hook.eager, EagerCalls) and hook.eager.eager() is False  # True only inside the checked call
        handle.remove()


def test_transformer_graphs_with_taylorseer_are_refused_with_the_alternative() -> None:
    spec = hookkit.Spec(cache=hookkit.DBCache(threshold=0.1), compile=hookkit.Compile(cuda_graphs="transformer"))
    with pytest.raises(SpecError, match=r"taylorseer_order.*Compile\(mode='reduce-overhead'\)"):
        hookkit.build_plan(zoo.tiny_pipeline("flux"), spec)


BASE = {"fullgraph": True, "dynamic": None}


def test_unquantized_models_pass_the_mode_to_torch_compile() -> None:
    assert compile_kwargs(hookkit.Compile()) == {**BASE, "backend": "inductor"}
    assert compile_kwargs(hookkit.Compile(mode="default")) == {**BASE, "backend": "inductor"}
    assert compile_kwargs(hookkit.Compile(mode="reduce-overhead")) == {
        **BASE, "backend": "inductor", "mode": "reduce-overhead"}


@pytest.mark.parametrize(("mode", "mode_options"), [
    (None, {}),
    ("default", {}),
    ("reduce-overhead", {"triton.cudagraphs": True}),  # hookkit's step mark keeps these cudagraph trees safe
    ("max-autotune", {"max_autotune": True, "triton.cudagraphs": True, "coordinate_descent_tuning": True}),
    ("max-autotune-no-cudagraphs", {"max_autotune": True, "coordinate_descent_tuning": True}),
])
def test_quantized_models_get_the_modes_own_options_plus_torchaos_scoped_to_hookkits_compile(
        mode: str | None, mode_options: dict) -> None:
    """A call takes a mode or options: the mode is spelled as torch's options for it
    (torch._inductor.list_mode_options), then torchao's int-mm fusion is added."""
    assert compile_kwargs(hookkit.Compile(mode=mode), quantized=True) == {
        **BASE, "backend": "inductor", "options": {**mode_options, "force_fuse_int_mm_with_mul": True}}


def test_modes_and_options_are_left_out_for_backends_other_than_inductor() -> None:
    spec = hookkit.Compile(mode="reduce-overhead", backend="aot_eager")
    assert compile_kwargs(spec) == compile_kwargs(spec, quantized=True) == {**BASE, "backend": "aot_eager"}


# --- on a GPU (skipped without CUDA) -------------------------------------------------------------------------


def _cuda_pipeline(name: str = "flux"):
    pipe = zoo.tiny_pipeline(name).to("cuda")
    return pipe


def _cuda_run(pipe, steps: int = 6, **extra) -> torch.Tensor:
    kw = zoo.call_kwargs("flux", steps=steps, **extra)
    kw = {k: v.to("cuda") if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    kw["generator"] = torch.Generator("cuda").manual_seed(0)
    return pipe(**kw).images


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_transformer_graphs_replay_what_eager_computes() -> None:
    pipe = _cuda_pipeline()
    reference = _cuda_run(pipe)
    handle = hookkit.enable(pipe, hookkit.Spec(compile=hookkit.Compile(cuda_graphs="transformer", backend="eager")))
    for _ in range(2):  # the second call is served by replays only
        torch.testing.assert_close(_cuda_run(pipe), reference, rtol=1e-4, atol=1e-4)
    data = handle.summary().features["compile"].data
    # the first call ran eagerly under the first-call check; one capture, never dropped (no observer in it)
    assert (data["graphs_captured"], data["eager_calls"], data["graph_invalidations"]) == (1, 1, 0)
    assert handle.summary().first_call == "confirmed"
    handle.remove()
    assert torch.equal(_cuda_run(pipe), reference)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_dbcache_under_transformer_graphs_matches_dbcache_without_graphs() -> None:
    cache = hookkit.DBCache(fn_blocks=1, steps_mask=MASK, mask_policy="static", taylorseer_order=0)
    pipe = _cuda_pipeline()
    eager = hookkit.enable(pipe, hookkit.Spec(cache=cache))
    reference = _cuda_run(pipe)
    stats = _cache_stats(eager)
    eager.remove()
    handle = hookkit.enable(pipe, hookkit.Spec(cache=cache, compile=hookkit.Compile(cuda_graphs="transformer",
                                                                                      backend="eager")))
    for _ in range(2):
        torch.testing.assert_close(_cuda_run(pipe), reference, rtol=1e-4, atol=1e-4)
        assert _cache_stats(handle) == stats
    data = handle.summary().features["compile"].data
    assert (data["graphs_captured"], data["eager_calls"], data["graph_invalidations"]) == (2, 1, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_transformer_graphs_refuse_blocks_out_of_execution_order_and_capture_nothing() -> None:
    from hookkit.errors import AdapterError

    pipe = _cuda_pipeline()
    handle = hookkit.enable(pipe, hookkit.Spec(compile=GRAPHS), adapter=_reversed_flux())
    with pytest.raises(AdapterError, match=r"expected the blocks to run in the order of its \[\[blocks\]\] tables"):
        _cuda_run(pipe)
    assert handle.summary().features["compile"].data["graphs_captured"] == 0
    assert handle.summary().first_call == "pending"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_regional_reduce_overhead_runs_and_matches_eager() -> None:
    pipe = _cuda_pipeline()
    reference = _cuda_run(pipe)
    hookkit.enable(pipe, hookkit.Spec(compile=hookkit.Compile(mode="reduce-overhead")))
    for _ in range(2):
        torch.testing.assert_close(_cuda_run(pipe), reference, rtol=1e-3, atol=1e-3)


def test_dbcache_under_transformer_graphs_computes_a_step_whose_batch_changed_within_the_call() -> None:
    """SD3's CFG cutoff halves the batch at step 5: no residual of batch 1 exists, so step 5 must be computed
    (a cached-step graph captured then would add the batch-2 residual to batch-1 states)."""
    from diffusers.callbacks import SD3CFGCutoffCallback
    from test_dbcache import _sd3_kwargs, _tiny_sd3_pipeline

    from hookkit.techniques.compile.hooks import GRAPH, GraphHook
    from hookkit.techniques.cache.hooks import graph_bridge

    cache = hookkit.DBCache(steps_mask=[1, 1, 1, 1, 1, 0, 0, 1, 0, 1], mask_policy="static", taylorseer_order=0)

    def call(pipe) -> torch.Tensor:
        cutoff = SD3CFGCutoffCallback(cutoff_step_ratio=None, cutoff_step_index=4)
        with torch.no_grad():
            return pipe(**_sd3_kwargs(10, callback_on_step_end=cutoff))[0]

    eager_pipe = _tiny_sd3_pipeline()
    eager = hookkit.enable(eager_pipe, hookkit.Spec(cache=cache))
    reference = call(eager_pipe)
    pipe = _tiny_sd3_pipeline()
    handle = hookkit.enable(pipe, hookkit.Spec(cache=cache))
    bridge = graph_bridge(handle)
    HookRegistry.of(pipe.transformer).register(GRAPH, GraphHook(GraphRunner(ReplayBackend(bridge)), bridge,
                                                                eager=handle.service(EagerCalls)))
    out = call(pipe)
    assert out.shape == reference.shape == (1, 4, 16, 16)
    assert torch.equal(out, reference)
    assert _cache_stats(handle) == _cache_stats(eager)
    assert _cache_stats(handle)[1] == {0: ([0, 1, 2, 3, 4, 5, 7, 9], [6, 8])}


# --- several features deciding per call: the core combines their GraphDecisions --------------------------------


class _Decider:
    """A GraphDecisions that records what the combination asks of it."""

    def __init__(self, name: str, value: str) -> None:
        self.name, self.value = name, value
        self.events: list[tuple[Any, ...]] = []

    def decision(self, shapes=None) -> str:
        return self.value

    @contextlib.contextmanager
    def forcing(self, decision):
        self.events.append(("enter", decision))
        yield
        self.events.append(("exit", decision))

    def replayed(self, decision, shapes=None, graph=None) -> None:
        self.events.append(("replayed", decision, shapes, graph))

    def adopted(self, shapes=None) -> None:
        self.events.append(("adopted", shapes))


def test_one_provider_is_its_own_combination() -> None:
    from hookkit.core.graphs import GraphDecisions, combine

    only = _Decider("cache", "computed")
    assert combine(GraphDecisions, [only]) is only


def test_two_providers_decide_as_one_key_forced_and_told_together() -> None:
    from hookkit.core.graphs import GraphDecisions, combine

    cache, attention = _Decider("cache", (0, True)), _Decider("attention", "hookkit_fp8")
    both = combine(GraphDecisions, [cache, attention])
    key = both.decision(((2, 3),))
    assert key == ((0, True), "hookkit_fp8")
    with both.forcing(key):
        assert cache.events == [("enter", (0, True))] and attention.events == [("enter", "hookkit_fp8")]
    both.replayed(key, ((2, 3),))
    both.adopted(((2, 3),))
    assert cache.events[1:] == [("exit", (0, True)), ("replayed", (0, True), ((2, 3),), key), ("adopted", ((2, 3),))]
    assert attention.events[1:] == [("exit", "hookkit_fp8"), ("replayed", "hookkit_fp8", ((2, 3),), key),
                                    ("adopted", ((2, 3),))]


def test_two_providers_of_a_protocol_the_core_does_not_combine_are_refused() -> None:
    from hookkit.core.graphs import EagerCalls, combine

    with pytest.raises(HookError, match=r"^EagerCalls: expected one feature to provide it, got 2; the core combines "
                                        r"only GraphDecisions\."):
        combine(EagerCalls, [object(), object()])


def test_a_provider_after_the_first_request_is_refused() -> None:
    from hookkit.core.graphs import GraphDecisions

    pipe = zoo.tiny_pipeline("flux")
    handle = hookkit.enable(pipe, hookkit.Spec(cache=hookkit.DBCache(steps_mask=MASK, mask_policy="static",
                                                                     taylorseer_order=0)))
    ctx = handle._context("late")
    assert handle.service(GraphDecisions) is not None
    with pytest.raises(HookError, match=r"^late: provides GraphDecisions after a feature requested it"):
        ctx.provide(GraphDecisions, lambda: _Decider("late", "x"))


# --- graph breaks under fullgraph ----------------------------------------------------------------------------------


def test_a_block_that_breaks_the_graph_under_fullgraph_is_refused_naming_it_the_line_and_the_fix() -> None:
    import re

    from diffusers_configs import build, inputs

    model = build("HiDreamTransformer")  # its MoE loops over a number of tokens per expert read from a tensor
    handle = hookkit.enable(model, hookkit.Spec(compile=hookkit.Compile(backend="eager")))
    with pytest.raises(UnsupportedError) as err, handle.generation(num_steps=1, calls_per_step=1):
        model(**inputs("HiDreamTransformer"), return_dict=False)
    assert re.fullmatch(
        r"Compile\(fullgraph=True\): expected the forward of double_stream_blocks\.0 \(HiDreamBlock\) to compile as "
        r"one graph, got a graph break at transformer_hidream_image\.py:\d+ in moe_infer: .*data-dependent.*\. Use "
        r"Compile\(fullgraph=False\): torch\.compile then compiles it in pieces around what it cannot trace \(each "
        r"break runs eagerly\)\.", str(err.value))
    assert isinstance(err.value.__cause__, torch._dynamo.exc.UserError)


def test_a_graph_break_is_named_by_dynamos_reason_and_the_innermost_line_of_model_code() -> None:
    from hookkit.techniques.compile.regional import graph_break_error

    dynamo_says = ("Call to `torch._dynamo.graph_break()`\n  Explanation: User-inserted graph break. Message: None\n"
                   "  Hint: Remove the `torch._dynamo.graph_break()` call.\n\nfrom user code:\n"
                   '   File "/site/diffusers/models/transformers/transformer_x.py", line 40, in forward\n'
                   "    out = self.attn(x)\n"
                   '  File "/site/diffusers/models/attention.py", line 7, in attn\n'
                   "    torch._dynamo.graph_break()\n"
                   f'  File "{torch.__file__}", line 1, in polyfill\n')
    error = graph_break_error("blocks.3", "XBlock", torch._dynamo.exc.Unsupported(dynamo_says))
    assert str(error) == (
        "Compile(fullgraph=True): expected the forward of blocks.3 (XBlock) to compile as one graph, got a graph break "
        "at attention.py:7 in attn: Call to `torch._dynamo.graph_break()` (User-inserted graph break. Message: None). "
        "Use Compile(fullgraph=False): torch.compile then compiles it in pieces around what it cannot trace (each "
        "break runs eagerly).")


def test_a_whole_transformer_that_breaks_the_graph_is_named_as_the_transformer() -> None:
    from hookkit.techniques.compile.regional import graph_break_error

    error = graph_break_error("", "FluxTransformer2DModel", torch._dynamo.exc.Unsupported("Unsupported thing"))
    assert str(error).startswith("Compile(fullgraph=True): expected the forward of the transformer "
                                 "(FluxTransformer2DModel) to compile as one graph, got a graph break: Unsupported "
                                 "thing. Use Compile(fullgraph=False)")
