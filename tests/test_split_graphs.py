"""Dynamic DBCache under whole-transformer CUDA graphs: each call split at the decision.

CUDA capture is GPU-only, so the logic is tested on the CPU with `RecordingBackend`, a stand-in that keeps
what matters about CUDA graphs: a captured segment is the list of aten ops it ran, and a replay re-runs those
ops on the *same* tensors (writing results into the recorded outputs' memory), running no Python at all: no
hook, no decision, no bookkeeping. A host read inside a captured segment raises, as stream capture does.
The decisions must be exactly eager dynamic DBCache's, and the images bitwise equal.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import pytest
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import hookkit
from hookkit.core.graphs import EagerCalls
from hookkit.core.registry import HookRegistry, registry_names
from hookkit.errors import SpecError
from hookkit.techniques.cache.hooks import graph_bridge
from hookkit.core import compat
from hookkit.techniques.compile.hooks import GRAPH, GraphHook, GraphRunner, SplitGraphHook
from hookkit.tools import trained, zoo


class _Recorder(TorchDispatchMode):
    """Records every aten op with its arguments and outputs; refuses host reads (stream capture would)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, tuple[Any, ...], dict[str, Any], Any]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            raise RuntimeError("host read inside a captured segment (.item() during stream capture)")
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


def _replayer(ops: list[tuple[Any, tuple[Any, ...], dict[str, Any], Any]]) -> Callable[[], None]:
    def replay() -> None:
        for func, args, kwargs, out in ops:
            fresh = func(*args, **kwargs)
            for old, new in zip(pytree.tree_leaves(out), pytree.tree_leaves(fresh)):
                # views and in-place results alias what they came from: the op already wrote there
                if isinstance(old, torch.Tensor) and old.untyped_storage().data_ptr() != new.untyped_storage().data_ptr():
                    old.copy_(new)
    return replay


class _Segments:
    def __init__(self) -> None:
        self.recorders: list[_Recorder] = []

    def begin(self) -> None:
        self._start()

    def _start(self) -> None:
        recorder = _Recorder()
        recorder.__enter__()
        self.recorders.append(recorder)

    def cut(self) -> None:
        self.recorders[-1].__exit__(None, None, None)
        self._start()

    def end(self) -> list[Callable[[], None]]:
        self.recorders[-1].__exit__(None, None, None)
        return [_replayer(r.ops) for r in self.recorders]


class RecordingBackend:
    """CPU stand-in for `CudaSegmentBackend`: warm-up runs the call, capture records its ops per segment."""

    def __init__(self, warmup: int = 1) -> None:
        self.warmup = warmup
        self.captures = 0

    def warm(self, fn: Callable[[], Any]) -> None:
        for _ in range(self.warmup):
            fn()

    def segments(self) -> _Segments:
        self.captures += 1
        return _Segments()


def test_a_replayed_segment_recomputes_from_new_input_values_into_the_same_output_memory() -> None:
    x = torch.ones(3)
    segments = RecordingBackend().segments()
    segments.begin()
    y = x * 2
    segments.cut()
    z = y + 1
    head, tail = segments.end()
    x.copy_(torch.tensor([1.0, 2.0, 3.0]))
    head()
    tail()
    assert torch.equal(y, torch.tensor([2.0, 4.0, 6.0])) and torch.equal(z, torch.tensor([3.0, 5.0, 7.0]))


def test_the_stand_in_refuses_a_host_read_while_capturing() -> None:
    segments = RecordingBackend().segments()
    segments.begin()
    try:
        with pytest.raises(RuntimeError, match="host read inside a captured segment"):
            torch.ones(1).sum().item()
    finally:
        segments.end()


# --- the trained tiny Flux (dynamic caching needs trained weights) ---------------------------------------------

CACHE = hookkit.DBCache(fn_blocks=1, bn_blocks=0, threshold=0.2, warmup_steps=2, max_continuous_cached_steps=2,
                        taylorseer_order=0)
STEPS = 10


def _kwargs(label: int = 3, seed: int = 0) -> dict[str, Any]:
    return trained.call_kwargs([label], [seed], steps=STEPS)


def _steps(handle: hookkit.Handle) -> dict[int, tuple[list[int], list[int], dict[int, float]]]:
    data = handle.summary().features["cache"].data
    return {i: (b["computed"], b["cached"], b["diffs"]) for i, b in data["branches"].items()}


def _split_pipeline(cache: hookkit.DBCache = CACHE, adapter: hookkit.AdapterSpec | None = None,
                    ) -> tuple[Any, hookkit.Handle, SplitGraphHook, RecordingBackend]:
    """The trained pipeline with DBCache and a SplitGraphHook on the stand-in backend (as
    `Compile(cuda_graphs="transformer")` installs it on a GPU, minus the regional compile)."""
    pipe = trained.load_pipeline()
    handle = hookkit.enable(pipe, hookkit.Spec(cache=cache), adapter=adapter)
    backend = RecordingBackend()
    # as Compile(cuda_graphs="transformer") attaches it: the first-call check's call runs uncaptured
    hook = SplitGraphHook(backend, graph_bridge(handle), eager=handle.service(EagerCalls))
    HookRegistry.of(pipe.transformer).register(GRAPH, hook)
    return pipe, handle, hook, backend


@pytest.fixture(scope="module")
def eager() -> tuple[torch.Tensor, dict]:
    pipe = trained.load_pipeline()
    handle = hookkit.enable(pipe, hookkit.Spec(cache=CACHE))
    images = pipe(**_kwargs()).images
    return images, _steps(handle)


def test_split_graphs_decide_exactly_like_eager_dynamic_dbcache_and_match_it_bitwise(eager) -> None:
    reference, eager_steps = eager
    computed, cached, diffs = eager_steps[0]
    assert cached and len(computed) > 3  # the threshold caches some steps and not others: decisions are tested
    pipe, handle, hook, _ = _split_pipeline()
    assert torch.equal(pipe(**_kwargs()).images, reference)
    assert _steps(handle) == eager_steps  # same computed and cached steps, the same diffs to the last bit


def test_slots_are_allocated_outside_the_capture_even_without_backend_warm_up(eager) -> None:
    """Regression: a reference slot first allocated inside the capture had its zeroing replayed with the head,
    so every statistic read inf and no step was ever cached."""
    reference, eager_steps = eager
    pipe, handle, hook, backend = _split_pipeline()
    backend.warmup = 0
    assert torch.equal(pipe(**_kwargs()).images, reference)
    assert _steps(handle) == eager_steps


def test_a_second_generation_is_served_by_replays_alone(eager) -> None:
    reference, eager_steps = eager
    pipe, handle, hook, backend = _split_pipeline()
    pipe(**_kwargs())
    captures = backend.captures
    assert captures == 2 == len(hook.captured)  # one pair for computed steps, one for cached steps
    assert torch.equal(pipe(**_kwargs()).images, reference)
    assert backend.captures == captures and _steps(handle) == eager_steps


def test_the_statistic_is_read_once_per_step_that_the_threshold_decides(eager) -> None:
    _, eager_steps = eager
    pipe, handle, hook, _ = _split_pipeline()
    pipe(**_kwargs())
    assert hook.reads == len(eager_steps[0][2])  # one host read per measured diff, none for the other steps
    # a head is replayed twice exactly when the decision differs from the branch's previous one
    decisions = [step in set(eager_steps[0][1]) for step in range(STEPS)]
    measured = sorted(eager_steps[0][2])
    assert hook.switches == sum(decisions[s] != decisions[s - 1] for s in measured)


def test_another_input_reuses_the_graphs_and_still_decides_like_eager() -> None:
    eager_pipe = trained.load_pipeline()
    eager_handle = hookkit.enable(eager_pipe, hookkit.Spec(cache=CACHE))
    pipe, handle, hook, backend = _split_pipeline()
    pipe(**_kwargs(label=3, seed=0))
    for label, seed in ((7, 1), (0, 2)):
        reference = eager_pipe(**_kwargs(label, seed)).images
        assert torch.equal(pipe(**_kwargs(label, seed)).images, reference)
        assert _steps(handle) == _steps(eager_handle)
    assert backend.captures == 2


def test_a_static_mask_still_uses_the_unsplit_graphs() -> None:
    from hookkit.techniques.cache.hooks import graph_bridge as bridge_of

    pipe = zoo.tiny_pipeline("flux")
    handle = hookkit.enable(pipe, hookkit.Spec(cache=hookkit.DBCache(steps_mask="fast", mask_policy="static",
                                                                     taylorseer_order=0)))
    assert bridge_of(handle).dynamic is False
    dynamic = hookkit.enable(zoo.tiny_pipeline("flux"), hookkit.Spec(cache=CACHE))
    assert graph_bridge(dynamic).dynamic is True


def test_transformer_graphs_accept_a_threshold_and_refuse_taylorseer_with_the_alternative() -> None:
    compat.check(hookkit.Spec(cache=CACHE, compile=hookkit.Compile(cuda_graphs="transformer")),
                 hookkit.get_adapter("flux"))  # no error
    spec = hookkit.Spec(cache=hookkit.DBCache(threshold=0.1, taylorseer_order=1),
                        compile=hookkit.Compile(cuda_graphs="transformer"))
    with pytest.raises(SpecError, match=r"DBCache.taylorseer_order: expected 0 with Compile\(cuda_graphs='transformer'\)"
                                        r".*got 1\. Use DBCache\(taylorseer_order=0\)"):
        hookkit.build_plan(zoo.tiny_pipeline("flux"), spec)


def test_removal_leaves_the_transformer_as_it_was() -> None:
    pipe, handle, hook, _ = _split_pipeline()
    pipe(**_kwargs())
    HookRegistry.of(pipe.transformer).remove(GRAPH)
    handle.remove()
    assert registry_names(pipe.transformer) == ()
    assert all("forward" not in m.__dict__ and "_hookkit_registry" not in m.__dict__ for m in pipe.transformer.modules())


@pytest.mark.gpu
def test_gpu_split_graphs_decide_like_eager_dynamic_dbcache() -> None:
    """On CUDA with real segmented capture: same steps as eager DBCache (bf16 trained model, compiled blocks)."""
    device, dtype = torch.device("cuda"), torch.bfloat16

    def kwargs() -> dict[str, Any]:
        return trained.call_kwargs([3], [0], steps=STEPS, device=device, dtype=dtype)

    eager_pipe = trained.load_pipeline(device=device, dtype=dtype)
    eager_handle = hookkit.enable(eager_pipe, hookkit.Spec(cache=CACHE, compile=hookkit.Compile()))
    reference = eager_pipe(**kwargs()).images
    pipe = trained.load_pipeline(device=device, dtype=dtype)
    handle = hookkit.enable(pipe, hookkit.Spec(cache=CACHE, compile=hookkit.Compile(cuda_graphs="transformer")))
    for _ in range(2):
        images = pipe(**kwargs()).images
        assert _steps(handle) == _steps(eager_handle)
        torch.testing.assert_close(images, reference, rtol=0, atol=2e-2)
    # step 0 ran eagerly under the first-call check, step 1 (warm-up) captured the computed pair: one pair per
    # decision taken, head + tail each, never dropped
    data = handle.summary().features["compile"].data
    pairs = 1 + bool(_steps(handle)[0][1])
    assert (data["graphs_captured"], data["eager_calls"], data["graph_invalidations"]) == (2 * pairs, 1, 0)
    assert handle.summary().first_call == "confirmed"


def test_cfg_branches_keep_their_own_pairs_references_and_decisions() -> None:
    """Qwen-Image with true CFG: two transformer calls per step, each its own branch (random weights: a threshold
    of 10 caches whenever the other rules allow, so max_continuous_cached_steps=1 makes the pattern)."""
    cache = hookkit.DBCache(threshold=10.0, warmup_steps=1, max_continuous_cached_steps=1, taylorseer_order=0)

    def call(pipe: Any) -> torch.Tensor:
        args = zoo.call_kwargs("qwenimage", steps=5, true_cfg_scale=4.0)  # a fresh generator every call
        args.update(negative_prompt_embeds=torch.full_like(args["prompt_embeds"], 0.5),
                    negative_prompt_embeds_mask=args["prompt_embeds_mask"])
        return pipe(**args).images

    eager_pipe = zoo.tiny_pipeline("qwenimage")
    eager_handle = hookkit.enable(eager_pipe, hookkit.Spec(cache=cache))
    reference = call(eager_pipe)
    pipe = zoo.tiny_pipeline("qwenimage")
    handle = hookkit.enable(pipe, hookkit.Spec(cache=cache))
    backend = RecordingBackend()
    # as Compile(cuda_graphs="transformer") attaches it: the first-call check's call runs uncaptured
    hook = SplitGraphHook(backend, graph_bridge(handle), eager=handle.service(EagerCalls))
    HookRegistry.of(pipe.transformer).register(GRAPH, hook)
    assert torch.equal(call(pipe), reference)
    steps = _steps(handle)
    assert steps == _steps(eager_handle)
    assert {i: (c, k) for i, (c, k, _) in steps.items()} == {0: ([0, 2, 4], [1, 3]), 1: ([0, 2, 4], [1, 3])}
    assert backend.captures == 4  # (branch 0, 1) x (computed, cached)


def test_the_compile_summary_counts_pairs_host_reads_and_switches(eager) -> None:
    import types

    from hookkit.techniques.compile.hooks import FEATURE, CompileState

    pipe, handle, hook, _ = _split_pipeline()
    pipe(**_kwargs())
    # the compile feature's summary of an attach context that kept this hook (on a GPU: Compile(cuda_graphs=...))
    fake = types.SimpleNamespace(spec=hookkit.Spec(compile=hookkit.Compile(cuda_graphs="transformer")),
                                 attachments=lambda: [], transformer=pipe.transformer,
                                 kept=lambda: CompileState(runner=hook))
    data = FEATURE.summarize(fake).data
    # the first call ran eagerly (the first-call check observed it): every later one replayed a pair
    assert (data["graphs_captured"], data["graph_replays"], data["eager_calls"]) == (4, STEPS - 1, 1)
    assert (data["decision_reads"], data["head_switches"]) == (hook.reads, hook.switches)
    assert hook.reads == len(eager[1][0][2]) > 0


def test_split_graphs_refuse_blocks_out_of_execution_order_at_the_first_call_as_eager_mode_does() -> None:
    from hookkit.errors import AdapterError

    flux = hookkit.get_adapter("flux")
    wrong = attrs.evolve(flux, name="flux-reversed", blocks=tuple(reversed(flux.blocks)))
    eager_pipe = trained.load_pipeline()
    hookkit.enable(eager_pipe, hookkit.Spec(cache=CACHE), adapter=wrong)
    with pytest.raises(AdapterError) as eager_error:
        eager_pipe(**_kwargs())
    pipe, handle, hook, backend = _split_pipeline(adapter=wrong)
    with pytest.raises(AdapterError) as error:
        pipe(**_kwargs())
    assert str(error.value) == str(eager_error.value)
    assert (backend.captures, hook.eager_calls, handle.summary().first_call) == (0, 1, "pending")
    bridge = graph_bridge(handle)
    assert (bridge.forced, bridge.on_decision) == (None, None)  # the forced decision ends with the refused call


def test_a_statistic_right_after_the_eager_first_call_is_read_from_the_cached_pairs_head() -> None:
    """warmup_steps=1: step 1 is decided by the statistic, but step 0 (the checked call) ran uncaptured, so no pair
    of the branch exists; the cached pair (its path writes no residual or reference) is captured for its head."""
    cache = attrs.evolve(CACHE, warmup_steps=1)
    eager_pipe = trained.load_pipeline()
    eager_handle = hookkit.enable(eager_pipe, hookkit.Spec(cache=cache))
    reference = eager_pipe(**_kwargs()).images
    pipe, handle, hook, _ = _split_pipeline(cache)
    hook.backend = backend = PoolRecordingBackend()
    assert torch.equal(pipe(**_kwargs()).images, reference)
    assert _steps(handle) == _steps(eager_handle)
    assert 1 in _steps(handle)[0][2]  # step 1's statistic was read
    assert [cached for _, _, cached in hook.captured] == [True, False]  # the cached pair first, each pair once
    assert backend.events == ["release", "capture", "capture"]  # the first capture starts a pool, as every first one


def test_a_model_change_between_calls_drops_the_pairs_and_the_next_call_matches_eager_on_the_changed_model() -> None:
    """The split graphs watch the model like the unsplit ones (`ModelWatch`): stale pairs are never replayed."""
    pipe, handle, hook, backend = _split_pipeline()
    pipe(**_kwargs())
    with torch.no_grad():
        pipe.transformer.proj_out.bias.add_(0.01)
    out = pipe(**_kwargs()).images
    assert hook.invalidations == ["proj_out: parameters and buffers changed since capture"]
    assert backend.captures == 4  # both pairs captured again
    reference = trained.load_pipeline()
    with torch.no_grad():
        reference.transformer.proj_out.bias.add_(0.01)
    hookkit.enable(reference, hookkit.Spec(cache=CACHE))
    assert torch.equal(out, reference(**_kwargs()).images)


class PoolRecordingBackend(RecordingBackend):
    """Records pair captures and pool releases in order, as `CudaSegmentBackend` sees them."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[str] = []

    def release_pool(self) -> None:
        self.events.append("release")

    def segments(self) -> _Segments:
        self.events.append("capture")
        return super().segments()


def test_the_first_pair_captured_after_an_invalidation_starts_a_new_memory_pool() -> None:
    """Capturing into a pool no graph holds any more trips the CUDA allocator's `use_count > 0` assert (H200)."""
    pipe = trained.load_pipeline()
    handle = hookkit.enable(pipe, hookkit.Spec(cache=CACHE))
    backend = PoolRecordingBackend()
    HookRegistry.of(pipe.transformer).register(GRAPH, SplitGraphHook(backend, graph_bridge(handle),
                                                                     eager=handle.service(EagerCalls)))
    pipe(**_kwargs())
    with torch.no_grad():
        pipe.transformer.proj_out.bias.add_(0.01)
    pipe(**_kwargs())
    assert backend.events == ["release", "capture", "capture", "release", "capture", "capture"]


# --- attention processors and backends set after capture ---------------------------------------------------------


def _halving_processor(transformer: torch.nn.Module) -> Any:
    """A processor of the transformer's own class whose attention output is halved: another result, same shapes."""
    base = type(transformer.transformer_blocks[0].attn.processor)

    class Halving(base):  # type: ignore[misc, valid-type]
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return pytree.tree_map_only(torch.Tensor, lambda t: t * 0.5, super().__call__(*args, **kwargs))

    return Halving()


def test_set_attn_processor_after_capture_drops_the_pairs_and_the_next_call_matches_eager_with_it() -> None:
    """A replay runs no Python: without re-capture the pairs would go on running the processor captured first."""
    pipe, handle, hook, backend = _split_pipeline()
    pipe(**_kwargs())
    pipe.transformer.set_attn_processor(_halving_processor(pipe.transformer))
    out = pipe(**_kwargs()).images
    assert hook.invalidations == ["transformer_blocks.0.attn: attention processor changed since capture"]
    reference = trained.load_pipeline()
    reference.transformer.set_attn_processor(_halving_processor(reference.transformer))
    hookkit.enable(reference, hookkit.Spec(cache=CACHE))
    assert torch.equal(out, reference(**_kwargs()).images)


def test_set_attention_backend_after_capture_drops_the_pairs_and_the_next_call_matches_eager_with_it() -> None:
    """`set_attention_backend` changes no module and no processor object, only which kernel each processor runs."""
    pipe, handle, hook, backend = _split_pipeline()
    pipe(**_kwargs())
    reference = trained.load_pipeline()
    hookkit.enable(reference, hookkit.Spec(cache=CACHE))
    with _active_attention_backend_restored():
        pipe.transformer.set_attention_backend("_native_math")
        out = pipe(**_kwargs()).images
        reference.transformer.set_attention_backend("_native_math")
        expected = reference(**_kwargs()).images
    assert hook.invalidations == ["transformer_blocks.0.attn: attention backend changed since capture"]
    assert torch.equal(out, expected)


class OpReplayBackend:
    """CPU stand-in for `CudaGraphBackend` (`GraphHook`'s unsplit graphs): capture records the call's aten ops, a
    replay re-runs them on the same tensors and runs no Python, as a CUDA graph does."""

    def __init__(self) -> None:
        self.captures = 0

    def capture(self, fn: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
        self.captures += 1
        with _Recorder() as recorder:
            output = fn()
        return _replayer(recorder.ops), output


def _graphed_flux() -> tuple[Any, GraphRunner, OpReplayBackend]:
    pipe = zoo.tiny_pipeline("flux")
    handle = hookkit.enable(pipe, hookkit.Spec())
    runner = GraphRunner(OpReplayBackend())
    # as Compile(cuda_graphs="transformer") attaches it: the first-call check's call runs uncaptured
    HookRegistry.of(pipe.transformer).register(GRAPH, GraphHook(runner, eager=handle.service(EagerCalls)))
    return pipe, runner, runner.backend


def _flux_images(pipe: Any) -> torch.Tensor:
    with torch.no_grad():
        return pipe(**zoo.call_kwargs("flux", steps=2)).images


def test_transformer_graphs_are_captured_anew_after_set_attn_processor_and_match_a_fresh_run() -> None:
    pipe, runner, backend = _graphed_flux()
    _flux_images(pipe)
    pipe.transformer.set_attn_processor(_halving_processor(pipe.transformer))
    out = _flux_images(pipe)
    assert (backend.captures, runner.invalidations) == (
        2, ["transformer_blocks.0.attn: attention processor changed since capture"])
    reference = zoo.tiny_pipeline("flux")
    reference.transformer.set_attn_processor(_halving_processor(reference.transformer))
    assert torch.equal(out, _flux_images(reference))


def test_transformer_graphs_are_captured_anew_after_set_attention_backend_and_match_a_fresh_run() -> None:
    pipe, runner, backend = _graphed_flux()
    _flux_images(pipe)
    reference = zoo.tiny_pipeline("flux")
    with _active_attention_backend_restored():
        pipe.transformer.set_attention_backend("_native_math")
        _flux_images(pipe)
        out = _flux_images(pipe)
        reference.transformer.set_attention_backend("_native_math")
        expected = _flux_images(reference)
    assert (backend.captures, runner.invalidations) == (
        2, ["transformer_blocks.0.attn: attention backend changed since capture"])
    assert torch.equal(out, expected)


@contextlib.contextmanager
def _active_attention_backend_restored() -> Iterator[None]:
    """`set_attention_backend` also sets diffusers' process-wide active backend: give it back for the other tests."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    saved = _AttentionBackendRegistry._active_backend
    try:
        yield
    finally:
        _AttentionBackendRegistry.set_active_backend(saved)
