"""The pipelines people run: Wan 2.2's two experts, ControlNet, image editing and img2img, LoRA, changing shapes.

Every pipeline is tiny and built from config (`zoo.tiny_variant`), random weights, CPU. "Bitwise" is `torch.equal`
against a stock run of the same pipeline with the same seed; "skipped" is counted on a leaf module inside the
last block of each transformer (it runs once per transformer call that runs its block).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import hookkit
from hookkit.errors import UnsupportedError
from hookkit import AdapterSpec, BlockListSpec
from hookkit.core.registry import registry_names
from hookkit.tools import zoo

STEPS = 4


def run(pipe: Any, name: str, steps: int = STEPS, **extra: Any) -> torch.Tensor:
    out = pipe(**zoo.variant_call_kwargs(name, steps=steps, **extra))
    return out.frames if hasattr(out, "frames") else out.images


@contextlib.contextmanager
def count_calls(*modules: nn.Module) -> Iterator[list[Counter[str]]]:
    """Counters that go up by one at every call of each module (plain torch forward hooks, removed at exit)."""
    counters: list[Counter[str]] = [Counter() for _ in modules]
    hooks = [m.register_forward_hook(lambda *_, c=c: c.update(["calls"])) for m, c in zip(modules, counters)]
    try:
        yield counters
    finally:
        for hook in hooks:
            hook.remove()


def leaf_of_last_block(transformer: nn.Module) -> nn.Module:
    """A Linear inside the transformer's last block: its call count is the number of times that block ran."""
    block = transformer.blocks[-1] if hasattr(transformer, "blocks") else transformer.single_transformer_blocks[-1]
    return next(m for m in block.modules() if isinstance(m, nn.Linear))


def static(mask: tuple[int, ...]) -> hookkit.DBCache:
    return hookkit.DBCache(fn_blocks=1, bn_blocks=0, steps_mask=mask, mask_policy="static", warmup_steps=0,
                           taylorseer_order=0)


# --- Wan 2.2: two transformers ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wan22() -> Any:
    return zoo.tiny_variant("wan22")


@pytest.fixture(scope="module")
def wan22_stock(wan22: Any) -> torch.Tensor:
    return run(wan22, "wan22")


def test_wan22_steps_switch_experts_at_the_boundary(wan22: Any) -> None:
    # the premise of every Wan 2.2 test below: with 4 steps and boundary_ratio 0.8 each expert runs 2 steps x 2 CFG
    with count_calls(leaf_of_last_block(wan22.transformer), leaf_of_last_block(wan22.transformer_2)) as counters:
        run(wan22, "wan22")
    assert [c["calls"] for c in counters] == [4, 4]


@pytest.mark.parametrize("spec", [hookkit.Spec(), hookkit.Spec(cache=hookkit.DBCache(threshold=0.0))],
                         ids=["Spec()", "threshold0"])
def test_wan22_bitwise_equal_to_stock(wan22: Any, wan22_stock: torch.Tensor, spec: hookkit.Spec) -> None:
    handle = hookkit.enable(wan22, spec)
    try:
        assert torch.equal(run(wan22, "wan22"), wan22_stock)
    finally:
        handle.remove()


def test_wan22_enable_hooks_every_transformer_with_its_own_handle(wan22: Any) -> None:
    handle = hookkit.enable(wan22, hookkit.Spec(cache=static((1, 0, 1, 0))))
    try:
        assert [h.component for h in handle.group] == ["transformer", "transformer_2"]
        companion = handle.companions[0]
        assert companion.transformer is wan22.transformer_2 and companion.adapter.name == "wan"
        assert hookkit.handle_of(wan22.transformer_2) is companion and hookkit.handle_of(wan22) is handle
        # the scheduler is patched once, by the first handle; each transformer has its own clock hook and cache hooks
        assert [t for t, _ in companion.plan.targets("core")] == [""]
        assert "hookkit.cache.middle" in registry_names(wan22.transformer_2.blocks[1])
    finally:
        hookkit.disable(wan22)


def test_wan22_static_mask_skips_the_middle_blocks_of_every_transformer(wan22: Any, wan22_stock: torch.Tensor) -> None:
    # steps 0, 1 on transformer (high noise), 2, 3 on transformer_2: mask (1, 0, 1, 0) caches one step of each
    handle = hookkit.enable(wan22, hookkit.Spec(cache=static((1, 0, 1, 0))))
    try:
        with count_calls(leaf_of_last_block(wan22.transformer), leaf_of_last_block(wan22.transformer_2)) as counters:
            out = run(wan22, "wan22")
        summary = handle.summary()
    finally:
        hookkit.disable(wan22)
    assert [c["calls"] for c in counters] == [2, 2]  # 2 of 4 calls each: the cached step's CFG pair skipped
    first = summary.features["cache"].data["branches"]
    second = summary.companions[0].features["cache"].data["branches"]
    assert {b: (d["computed"], d["cached"]) for b, d in first.items()} == {0: ([0], [1]), 1: ([0], [1])}
    assert {b: (d["computed"], d["cached"]) for b, d in second.items()} == {0: ([2], [3]), 1: ([2], [3])}
    assert not torch.equal(out, wan22_stock)
    text = str(summary)
    assert "(pipe.transformer)" in text and "(pipe.transformer_2)" in text


def test_wan22_the_output_form_reuses_each_experts_own_output(wan22: Any) -> None:
    # mask (1, 0, 1, 0), order 0: each expert computes its first step and returns that output again on its second
    cache = hookkit.DBCache(fn_blocks=0, steps_mask=(1, 0, 1, 0), mask_policy="static", warmup_steps=0,
                            taylorseer_order=0, extrapolate="output")
    handle = hookkit.enable(wan22, hookkit.Spec(cache=cache))
    outputs: list[tuple[str, torch.Tensor]] = []
    wrapped = [wan22.transformer.forward, wan22.transformer_2.forward]  # hookkit's wrappers: what the pipeline sees

    def recorder(name: str, forward: Any) -> Any:
        def record(*args: Any, **kwargs: Any) -> Any:
            out = forward(*args, **kwargs)
            outputs.append((name, (out[0] if isinstance(out, tuple) else out.sample).clone()))
            return out
        return record

    wan22.transformer.forward = recorder("transformer", wrapped[0])
    wan22.transformer_2.forward = recorder("transformer_2", wrapped[1])
    try:
        with count_calls(leaf_of_last_block(wan22.transformer), leaf_of_last_block(wan22.transformer_2)) as counters:
            run(wan22, "wan22")
        summary = handle.summary()
    finally:
        wan22.transformer.forward, wan22.transformer_2.forward = wrapped
        hookkit.disable(wan22)
    assert [c["calls"] for c in counters] == [2, 2]  # each expert's cached step (its CFG pair) ran nothing
    assert [name for name, _ in outputs] == ["transformer"] * 4 + ["transformer_2"] * 4
    for first in (0, 4):  # calls: (step, cond), (step, uncond), (step + 1, cond), (step + 1, uncond)
        assert torch.equal(outputs[first + 2][1], outputs[first][1])
        assert torch.equal(outputs[first + 3][1], outputs[first + 1][1])
    second = summary.companions[0].features["cache"].data["branches"]
    assert {b: (d["computed"], d["cached"]) for b, d in second.items()} == {0: ([2], [3]), 1: ([2], [3])}


def test_wan22_disable_is_bitwise_and_leaves_nothing(wan22: Any, wan22_stock: torch.Tensor) -> None:
    before = [dict(t.__dict__) for t in (wan22.transformer, wan22.transformer_2)]
    handle = hookkit.enable(wan22, hookkit.Spec(cache=static((1, 0, 1, 0)), sync_free=True))
    run(wan22, "wan22")
    handle.companions[0].remove()  # any handle of the group removes the whole group
    assert handle.removed and hookkit.handle_of(wan22) is None and hookkit.handle_of(wan22.transformer_2) is None
    assert [set(t.__dict__) for t in (wan22.transformer, wan22.transformer_2)] == [set(b) for b in before]
    assert "set_timesteps" not in wan22.scheduler.__dict__ and "step" not in wan22.scheduler.__dict__
    assert torch.equal(run(wan22, "wan22"), wan22_stock)


def test_wan22_sync_free_and_memo_on_both_experts_are_bitwise(wan22: Any, wan22_stock: torch.Tensor) -> None:
    handle = hookkit.enable(wan22, hookkit.Spec(sync_free=True, memo=True))
    try:
        assert torch.equal(run(wan22, "wan22"), wan22_stock)
        assert "hookkit.sync_free" in " ".join(registry_names(wan22.transformer_2))
    finally:
        handle.remove()


def test_wan22_cache_and_regional_compile_on_both_experts_are_bitwise_at_threshold0(wan22: Any,
                                                                                     wan22_stock: torch.Tensor) -> None:
    torch._dynamo.reset()
    handle = hookkit.enable(wan22, hookkit.Spec(cache=hookkit.DBCache(threshold=0.0),
                                                compile=hookkit.Compile(backend="eager")))
    try:
        assert torch.equal(run(wan22, "wan22"), wan22_stock)
        assert [s.features["compile"].data["regions"] for s in (handle.summary(), *handle.summary().companions)] == [3, 3]
    finally:
        handle.remove()


def test_wan22_one_adapter_for_two_transformers_is_refused(wan22: Any) -> None:
    with pytest.raises(hookkit.errors.EnableError, match=r"expected None for WanPipeline, which holds 2 transformers"):
        hookkit.enable(wan22, adapter=hookkit.get_adapter("wan"))
    assert hookkit.handle_of(wan22) is None


def test_wan22_second_transformer_enabled_alone_first_is_refused(wan22: Any) -> None:
    alone = hookkit.enable(wan22.transformer_2)
    try:
        with pytest.raises(hookkit.errors.EnableError, match=r"WanPipeline.transformer_2: expected a transformer hookkit "
                                                             r"is not enabled on"):
            hookkit.enable(wan22)
        assert registry_names(wan22.transformer) == ()
    finally:
        alone.remove()


def test_wan22_a_spec_that_cannot_apply_to_one_transformer_attaches_nothing(wan22: Any) -> None:
    wan22.transformer_2 = zoo.tiny_transformer("wan", num_layers=1)  # one block: nothing to cache there
    try:
        with pytest.raises(hookkit.errors.SpecError, match="fewer than the 1 blocks") as info:
            hookkit.enable(wan22, hookkit.Spec(cache=hookkit.DBCache(threshold=0.24)))
        assert "WanPipeline.transformer_2" in "".join(info.value.__notes__)
        assert hookkit.handle_of(wan22) is None and registry_names(wan22.transformer) == ()
    finally:
        wan22.transformer_2 = zoo.tiny_variant("wan22").transformer_2


def test_wan22_replacing_the_second_transformer_is_refused_at_the_next_call(wan22: Any) -> None:
    handle = hookkit.enable(wan22, hookkit.Spec())
    original = wan22.transformer_2
    wan22.transformer_2 = zoo.tiny_transformer("wan", seed=5)
    try:
        with pytest.raises(hookkit.errors.HookError, match=r"WanPipeline.transformer_2: expected the"):
            run(wan22, "wan22")
    finally:
        wan22.transformer_2 = original
        handle.remove()


def test_wan22_an_expert_set_after_an_enable_without_it_is_refused_at_the_next_call(wan22: Any) -> None:
    expert = wan22.transformer_2
    wan22.transformer_2 = None
    handle = hookkit.enable(wan22, hookkit.Spec(cache=static((1, 0, 1, 0))))
    try:
        assert [h.component for h in handle.group] == ["transformer"]
        wan22.transformer_2 = expert  # it would run with none of hookkit's hooks while the handle reports enabled
        with count_calls(wan22.transformer, expert) as counters, pytest.raises(
                hookkit.errors.HookError, match=r"^WanPipeline.transformer_2: expected None, as at hookkit.enable, got "
                                                r"a WanTransformer3DModel .* Call hookkit.disable\(pipe\) before "
                                                r"setting it and hookkit.enable\(pipe, spec\) after"):
            run(wan22, "wan22")
        # refused before the loop: neither expert ran, no generation started
        assert ([c["calls"] for c in counters], handle.state.generation) == ([0, 0], 0)
        assert registry_names(expert) == ()
    finally:
        wan22.transformer_2 = expert
        handle.remove()


# --- ControlNet: residuals added between blocks are counted once --------------------------------------------


class DeltaBlock(nn.Module):
    """Adds its own constant `delta` to the hidden stream (and 1 to the encoder stream): the block's contribution is
    known exactly, whatever its input."""

    def __init__(self, delta: float) -> None:
        super().__init__()
        self.delta = delta

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor):
        return encoder_hidden_states + 1.0, hidden_states + self.delta


class ControlStub(nn.Module):
    """Flux's loop in miniature: after block i it adds `controlnet_block_samples[i // interval]`."""

    def __init__(self, num_blocks: int = 6) -> None:
        super().__init__()
        self.transformer_blocks = nn.ModuleList(DeltaBlock(float(2 ** i)) for i in range(num_blocks))

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                controlnet_block_samples: list[torch.Tensor] | None = None) -> torch.Tensor:
        for i, block in enumerate(self.transformer_blocks):
            encoder_hidden_states, hidden_states = block(hidden_states=hidden_states,
                                                         encoder_hidden_states=encoder_hidden_states)
            if controlnet_block_samples is not None:
                interval = -(-len(self.transformer_blocks) // len(controlnet_block_samples))
                hidden_states = hidden_states + controlnet_block_samples[i // interval]
        return hidden_states


CONTROL_ADAPTER = AdapterSpec(
    name="control-stub", transformer=("ControlStub",), between_block_args=("controlnet_block_samples",),
    blocks=(BlockListSpec(attr="transformer_blocks", classes=("DeltaBlock",), encoder_arg="encoder_hidden_states",
                          returns=("encoder_hidden_states", "hidden_states")),),
)


def control_samples(step: int, n: int) -> list[torch.Tensor]:
    """Integer-valued residuals that differ per step and per sample: every sum below is exact in float64."""
    return [torch.full((1, 2, 3), float(100 * (step + 1) + 10 * k)) for k in range(n)]


def control_loop(model: ControlStub, steps: int, n: int) -> list[torch.Tensor]:
    return [model(torch.zeros(1, 2, 3), torch.zeros(1, 4, 3), controlnet_block_samples=control_samples(s, n))
            for s in range(steps)]


def cached_control_loop(cache: hookkit.DBCache, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[str, Any]]:
    """(uncached outputs, outputs with `cache`, the cache summary's data) of 4 steps of the stub with n residuals."""
    model = ControlStub().double()
    expected = control_loop(model, 4, n)
    handle = hookkit.enable(model, hookkit.Spec(cache=cache), adapter=CONTROL_ADAPTER)
    try:
        with handle.generation(num_steps=4):
            got = control_loop(model, 4, n)
        data = handle.summary().features["cache"].data
    finally:
        handle.remove()
    return expected, got, data


@pytest.mark.parametrize("n", [1, 2, 3, 6], ids=lambda n: f"{n}-samples")
@pytest.mark.parametrize("fn,bn", [(0, 0), (1, 0), (2, 1)], ids=["F0B0", "F1B0", "F2B1"])
def test_controlnet_cached_step_equals_the_uncached_step_exactly(n: int, fn: int, bn: int) -> None:
    # Blocks add constants, so an uncached step's output is sum(deltas) + sum(this step's control residuals), and a
    # correct cache reproduces it exactly: the cached residual holds the blocks' deltas, the model adds the controls.
    expected, got, data = cached_control_loop(hookkit.DBCache(
        fn_blocks=fn, bn_blocks=bn, steps_mask=(1, 0, 0, 1), mask_policy="static", taylorseer_order=0), n)
    assert data["branches"][0]["cached"] == [1, 2]
    for step in range(4):
        assert torch.equal(got[step], expected[step]), step


@pytest.mark.parametrize("n", [1, 6], ids=lambda n: f"{n}-samples")
def test_controlnet_the_defaults_cached_steps_equal_the_uncached_steps_exactly(n: int) -> None:
    # DBCache(): 2 of 4 steps planned (0 and 3), every block skipped on steps 1 and 2; the controls counted once
    expected, got, data = cached_control_loop(hookkit.DBCache(), n)
    assert (data["branches"][0]["cached"], data["block_calls"]) == ([1, 2], 2 * 6)
    for step in range(4):
        assert torch.equal(got[step], expected[step]), step


def test_controlnet_without_the_adapter_field_is_refused_at_the_first_call_not_double_counted() -> None:
    # Without `between_block_args` the hooks cannot subtract the controls: the cached residual would still hold step
    # 0's controls and the cached step would add them twice. The first-call check sees the forward change the hidden
    # stream between middle blocks and refuses the split instead of returning that output.
    model = ControlStub().double()
    plain = attr_evolve(CONTROL_ADAPTER, between_block_args=())
    handle = hookkit.enable(model, hookkit.Spec(cache=static((1, 0)), ), adapter=plain)
    try:
        with pytest.raises(UnsupportedError, match=r"changing it between transformer_blocks\.1 and transformer_blocks\.2"):
            with handle.generation(num_steps=2):
                control_loop(model, 2, 6)
    finally:
        handle.remove()


def test_controlnet_calls_without_residuals_store_the_plain_residual() -> None:
    # the same model called with no ControlNet input: nothing between blocks, nothing subtracted
    model = ControlStub().double()
    expected = [model(torch.zeros(1, 2, 3), torch.zeros(1, 4, 3)) for _ in range(3)]
    handle = hookkit.enable(model, hookkit.Spec(cache=static((1, 0, 0))), adapter=CONTROL_ADAPTER)
    try:
        with handle.generation(num_steps=3):
            got = [model(torch.zeros(1, 2, 3), torch.zeros(1, 4, 3)) for _ in range(3)]
    finally:
        handle.remove()
    assert all(torch.equal(g, e) for g, e in zip(got, expected))


def attr_evolve(adapter: AdapterSpec, **changes: Any) -> AdapterSpec:
    import attrs

    return attrs.evolve(adapter, **changes)


def test_adapter_between_block_args_must_name_forward_arguments() -> None:
    bad = attr_evolve(CONTROL_ADAPTER, between_block_args=("controlnet_samples",))
    with pytest.raises(hookkit.errors.AdapterError, match=r"between_block_args.*'controlnet_samples'"):
        bad.check(ControlStub())


CONTROLNETS = ["flux_controlnet", "flux_multicontrolnet", "qwenimage_controlnet"]


@pytest.mark.parametrize("name", CONTROLNETS)
def test_controlnet_pipelines_bitwise_with_spec_and_threshold0(name: str) -> None:
    pipe = zoo.tiny_variant(name)
    stock = run(pipe, name)
    for spec in (hookkit.Spec(), hookkit.Spec(cache=hookkit.DBCache(threshold=0.0))):
        handle = hookkit.enable(pipe, spec)
        try:
            assert torch.equal(run(pipe, name), stock)
        finally:
            handle.remove()
    assert torch.equal(run(pipe, name), stock)


def assert_cached_step_adds_the_current_residuals_once(pipe: Any, kw: dict[str, Any]) -> None:
    """The oracle on a real pipeline, in float64: spies on the middle blocks record, on the computed step, each block's
    own contribution (output - input); on the cached step, the first middle block's input and what the model adds
    between middle blocks. The last middle block's output must be exactly their sum, up to float64 rounding."""
    pipe = pipe.to(torch.float64)
    transformer = pipe.transformer
    blocks = [b for lst in ("transformer_blocks", "single_transformer_blocks") for b in getattr(transformer, lst, [])]
    middle = blocks[1:]
    records: list[list[tuple[torch.Tensor, torch.Tensor]]] = []

    def spy(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        records[-1].append((kwargs["hidden_states"], output[1]))

    handles = [b.register_forward_hook(spy, with_kwargs=True) for b in middle]
    handles.append(transformer.register_forward_pre_hook(lambda *_: records.append([])))
    h = hookkit.enable(pipe, hookkit.Spec(cache=static((1, 0))))
    try:
        kw = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in kw.items()}
        pipe(**kw, num_inference_steps=2)
        assert h.summary().features["cache"].data["branches"][0]["cached"] == [1]
    finally:
        h.remove()
        for x in handles:
            x.remove()
    computed, cached = records
    assert len(computed) == len(cached) == len(middle)
    own = sum(out - inp for inp, out in computed)
    between_now = sum(cached[i + 1][0] - cached[i][1] for i in range(len(cached) - 1))
    between_then = sum(computed[i + 1][0] - computed[i][1] for i in range(len(computed) - 1))
    assert between_now.abs().max() > 1e-3  # the ControlNet really adds something between middle blocks
    expected = cached[0][0] + between_now + own
    torch.testing.assert_close(cached[-1][1], expected, rtol=0, atol=1e-12)
    # the old behaviour (residual with step 0's controls inside) is far from it
    assert (cached[-1][1] - (expected + between_then)).abs().max() > 1e-3


@pytest.mark.parametrize("name", CONTROLNETS)
def test_controlnet_pipelines_cached_step_adds_the_current_residuals_once(name: str) -> None:
    kw = zoo.variant_call_kwargs(name)
    del kw["num_inference_steps"]
    assert_cached_step_adds_the_current_residuals_once(zoo.tiny_variant(name), kw)


@pytest.mark.parametrize("layers", [(4, 10), (5, 0), (2, 4)], ids=lambda t: f"controlnet-{t[0]}+{t[1]}")
def test_full_structure_flux_controlnet_cached_step_adds_the_current_residuals_once(layers: tuple[int, int]) -> None:
    # Flux-dev's 19 double + 38 single blocks at tiny widths, the real 8x VAE, a ControlNet with fewer blocks than the
    # transformer: its samples are spread over the blocks (interval ceil(19 / 4) = 5, ...), 5 + 0 gives no single
    # samples at all. The benchmark's H200 run failed here, before any hook ran: the full-size pipeline's small VAE
    # had no `shift_factor`, which FluxControlNetPipeline subtracts from the encoded control image.
    pipe = zoo.full_controlnet_pipeline(*layers, narrow=True)
    kw = zoo.full_call_kwargs("flux", height=64, width=64, device="cpu", dtype=torch.float32, narrow=True)
    del kw["num_inference_steps"]
    kw.update(control_image=torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(7)),
              controlnet_conditioning_scale=0.7)
    assert_cached_step_adds_the_current_residuals_once(pipe, kw)


def test_benchmark_controlnet_part_runs_on_the_full_structure_on_the_cpu(benchmark_script: Callable[[str], Any]) -> None:
    # benchmarks/pipelines.py --cpu-smoke --parts controlnet, in process: the GPU's code path at tiny widths
    import argparse

    bench = benchmark_script("pipelines")
    opts = argparse.Namespace(cpu_smoke=True, quick=False, steps=4, runs=1, backend="eager")
    [record] = bench.part_controlnet(opts, torch.device("cpu"))
    assert record["cached_steps"] == {"transformer": {0: [1]}}
    assert (record["block_calls"], record["block_calls_uncached"]) == (4 * 57 - 56, 4 * 57)


# --- image editing and img2img ------------------------------------------------------------------------------

EDITS = ["qwenimage_edit", "qwenimage_edit_plus", "flux_kontext", "flux_img2img", "flux_fill"]


@pytest.fixture
def small_edit_area(monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen-Image-Edit resizes the reference image to ~1024^2 pixels (65536 tokens at the tiny VAE's scale): cap the
    area at 32^2 so the tiny pipelines stay tiny. Only the size changes; the code path is the pipeline's."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as edit
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus

    for module in (edit, plus):
        original = module.calculate_dimensions
        monkeypatch.setattr(module, "calculate_dimensions", lambda area, ratio, f=original: f(32 * 32, ratio))
    monkeypatch.setattr(plus, "CONDITION_IMAGE_SIZE", 32 * 32)
    monkeypatch.setattr(plus, "VAE_IMAGE_SIZE", 32 * 32)


def edit_run(pipe: Any, name: str, steps: int = STEPS) -> torch.Tensor:
    kw = zoo.variant_call_kwargs(name, steps=steps)
    if name.startswith("qwenimage_edit"):
        from PIL import Image

        g = torch.Generator().manual_seed(5)
        pixels = (torch.rand(32, 32, 3, generator=g) * 255).to(torch.uint8).numpy()
        kw["image"] = Image.fromarray(pixels) if name == "qwenimage_edit" else [Image.fromarray(pixels)]
    return pipe(**kw).images


@pytest.mark.parametrize("name", EDITS)
def test_edit_and_img2img_bitwise_with_spec_threshold0_memo_sync_free_and_compile(name: str, small_edit_area: None) -> None:
    pipe = zoo.tiny_variant(name)
    stock = edit_run(pipe, name)
    specs = [hookkit.Spec(), hookkit.Spec(cache=hookkit.DBCache(threshold=0.0)), hookkit.Spec(memo=True, sync_free=True),
             hookkit.Spec(compile=hookkit.Compile(backend="eager"), cache=hookkit.DBCache(threshold=0.0))]
    for spec in specs:
        handle = hookkit.enable(pipe, spec)
        try:
            assert torch.equal(edit_run(pipe, name), stock), spec
        finally:
            handle.remove()
    assert torch.equal(edit_run(pipe, name), stock)


def test_qwenimage_edit_2511_layout_memoizes_modulate_index_once_per_call(small_edit_area: None) -> None:
    # zero_cond_t=True (Qwen-Image-Edit-2511): the prologue rebuilds modulate_index from Python data every step;
    # memo builds it at the first step and serves the other 3 from its table
    pipe = zoo.tiny_variant("qwenimage_edit_plus", zero_cond_t=True)
    stock = edit_run(pipe, "qwenimage_edit_plus")
    handle = hookkit.enable(pipe, hookkit.Spec(memo=True))
    try:
        assert torch.equal(edit_run(pipe, "qwenimage_edit_plus"), stock)
        stats = handle.summary().features["memo"].data
    finally:
        handle.remove()
    assert (stats["misses"], stats["hits"], stats["entries"]) == (1, STEPS - 1, 1)


@pytest.mark.parametrize("name", EDITS)
def test_edit_and_img2img_static_mask_skips_middle_blocks_and_fits_the_steps_that_run(name: str,
                                                                                        small_edit_area: None) -> None:
    # img2img at strength 0.6 runs 3 of 5 steps: the named mask is scaled to those 3; the others run all 5. The
    # reference image tokens (edit, Kontext) ride along in the hidden stream: the cached residual has their length.
    pipe = zoo.tiny_variant(name)
    steps = 5
    runs = 3 if name == "flux_img2img" else steps
    handle = hookkit.enable(pipe, hookkit.Spec(cache=hookkit.DBCache(steps_mask=(1, 0, 1, 0, 1)[:runs] if runs == 5
                                                                     else (1, 0, 1), mask_policy="static",
                                                                     warmup_steps=0, taylorseer_order=0)))
    leaf = next(m for m in pipe.transformer.transformer_blocks[-1].modules() if isinstance(m, nn.Linear)) \
        if name.startswith("qwenimage") else leaf_of_last_block(pipe.transformer)
    try:
        with count_calls(leaf) as (counter,):
            edit_run(pipe, name, steps=steps)
        data = handle.summary().features["cache"].data
    finally:
        handle.remove()
    cached = [1, 3] if runs == 5 else [1]
    assert data["branches"][0]["cached"] == cached
    assert counter["calls"] == runs - len(cached)
    assert data["transformer_calls"] == runs


def test_img2img_named_mask_is_scaled_to_the_steps_that_run() -> None:
    pipe = zoo.tiny_variant("flux_img2img")
    handle = hookkit.enable(pipe, hookkit.Spec(cache=hookkit.DBCache(steps_mask="fast", mask_policy="static")))
    try:
        run(pipe, "flux_img2img", steps=28)  # strength 0.6: the last 17 of 28 steps run (t_start = int(28 - 16.8))
        data = handle.summary().features["cache"].data
    finally:
        handle.remove()
    from hookkit.techniques.cache.spec import resolve_steps_mask

    assert data["transformer_calls"] == 17
    assert tuple(data["mask"]) == resolve_steps_mask("fast", 17)
    assert data["branches"][0]["cached"] == [i for i, m in enumerate(resolve_steps_mask("fast", 17)) if m == 0]


# --- LoRA -----------------------------------------------------------------------------------------------------

LORA_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v")


def lora_state_dict(transformer: nn.Module, seed: int, rank: int = 4) -> dict[str, torch.Tensor]:
    """A peft-format LoRA for every attention projection of the tiny Flux, random A and B (B nonzero, so it matters)."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for path, module in transformer.named_modules():
        if isinstance(module, nn.Linear) and path.endswith(LORA_TARGETS):
            out[f"transformer.{path}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=g) * 0.3
            out[f"transformer.{path}.lora_B.weight"] = torch.randn(module.out_features, rank, generator=g) * 0.3
    return out


def hotswap_pipelines() -> tuple[Any, Any, dict[str, torch.Tensor]]:
    """(hooked, fresh, b): `hooked` prepared for peft's hotswap with LoRA `a` loaded, a fresh tiny Flux, and LoRA
    `b` to swap in (dynamo's caches reset, so compile counts start from nothing)."""
    torch._dynamo.reset()
    hooked, fresh = zoo.tiny_pipeline("flux"), zoo.tiny_pipeline("flux")
    a, b = lora_state_dict(hooked.transformer, 1), lora_state_dict(hooked.transformer, 2)
    hooked.enable_lora_hotswap(target_rank=4)
    hooked.load_lora_weights(dict(a), adapter_name="default_0")
    return hooked, fresh, b


def lora_steps(pipe: Any) -> list[tuple[str, Any]]:
    """The LoRA operations users run, each applied the same way to the hooked and to the fresh pipeline."""
    a, b = lora_state_dict(pipe.transformer, 1), lora_state_dict(pipe.transformer, 2)
    return [
        ("load a", lambda p: p.load_lora_weights(dict(a), adapter_name="a")),
        ("load b and switch to it", lambda p: (p.load_lora_weights(dict(b), adapter_name="b"), p.set_adapters("b"))),
        ("mix a and b", lambda p: p.set_adapters(["a", "b"], adapter_weights=[0.5, 1.0])),
        ("fuse", lambda p: p.fuse_lora(lora_scale=0.7)),
        ("unfuse", lambda p: p.unfuse_lora()),
        ("unload", lambda p: p.unload_lora_weights()),
    ]


@pytest.mark.parametrize("compile_spec", [None, hookkit.Compile(backend="eager"),
                                          hookkit.Compile(backend="eager", mode="reduce-overhead")],
                         ids=["eager", "regional-compile", "regional-reduce-overhead"])
def test_lora_load_switch_fuse_unload_equal_a_fresh_pipeline(compile_spec: hookkit.Compile | None) -> None:
    # on the CPU reduce-overhead compiles without CUDA graphs (the summary says so); whole-transformer CUDA graphs:
    # test_lora_under_transformer_graphs_equals_a_fresh_pipeline_and_recaptures_once_per_change
    pytest.importorskip("peft")
    torch._dynamo.reset()
    hooked, fresh = zoo.tiny_pipeline("flux"), zoo.tiny_pipeline("flux")
    handle = hookkit.enable(hooked, hookkit.Spec(cache=hookkit.DBCache(threshold=0.0), compile=compile_spec))
    try:
        for (what, apply), (_, apply_fresh) in zip(lora_steps(hooked), lora_steps(fresh)):
            apply(hooked)
            apply_fresh(fresh)
            got = hooked(**zoo.call_kwargs("flux", steps=2)).images
            want = fresh(**zoo.call_kwargs("flux", steps=2)).images
            assert torch.equal(got, want), what
    finally:
        handle.remove()
    assert torch.equal(hooked(**zoo.call_kwargs("flux", steps=2)).images, fresh(**zoo.call_kwargs("flux", steps=2)).images)


def test_lora_hotswap_under_regional_compile_does_not_recompile() -> None:
    from torch._dynamo.utils import counters

    pytest.importorskip("peft")
    hooked, fresh, b = hotswap_pipelines()
    handle = hookkit.enable(hooked, hookkit.Spec(compile=hookkit.Compile(backend="eager")))
    try:
        counters.clear()
        hooked(**zoo.call_kwargs("flux", steps=2))
        assert counters["stats"]["unique_graphs"] >= 2  # the check can fail: compiling is counted (both block classes)
        counters.clear()
        hooked.load_lora_weights(dict(b), adapter_name="default_0", hotswap=True)
        got = hooked(**zoo.call_kwargs("flux", steps=2)).images
        assert counters["stats"]["unique_graphs"] == 0 and sum(counters["recompiles"].values()) == 0
    finally:
        handle.remove()
    fresh.load_lora_weights(dict(b), adapter_name="default_0")
    assert torch.equal(got, fresh(**zoo.call_kwargs("flux", steps=2)).images)


class RecordingGraphBackend:
    """CPU stand-in for `CudaGraphBackend`: a warm-up call, then the capture records the call's aten ops; a replay
    re-runs those ops on the same tensors and runs no Python (tests/test_split_graphs.py's recorder), as a CUDA
    graph replays its kernels. So a replay after a LoRA change the watch missed returns the *old* LoRA state's
    output (a Python-side `scaling`, the adapters active at capture, the modules peft replaced): a wrong image."""

    def capture(self, fn: Any) -> tuple[Any, Any]:
        from test_split_graphs import _Recorder, _replayer

        fn()
        recorder = _Recorder()
        with recorder:
            output = fn()
        return _replayer(recorder.ops), output


@pytest.fixture
def graph_stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """`Compile(cuda_graphs="transformer")` on the CPU: the real feature, hooks, watch and summary, with the
    recording stand-ins for capture (whole calls and, for a dynamic cache, calls split at the decision) and the
    CUDA-device check switched off."""
    from test_split_graphs import RecordingBackend

    from hookkit.techniques.compile import hooks

    monkeypatch.setattr(hooks, "CudaGraphBackend", RecordingGraphBackend)
    monkeypatch.setattr(hooks, "CudaSegmentBackend", RecordingBackend)
    monkeypatch.setattr(hooks, "check_on_cuda", lambda transformer: None)


#: the caches under graphs, the graphs one generation (3 steps) captures with each: one (no cache), the
#: computed-step and the cached-step graph (static mask), or a head + tail pair per decision (dynamic: a threshold
#: that caches steps 1 and 2 of the random weights, split graphs); and the graphs the first generation captures:
#: its step 0 runs eagerly under the first-call adapter check, so with dynamic decisions only the cached pair
#: (step 1's statistic is read from its head) is captured then, the computed pair at the next generation's step 0
GRAPH_CACHES = {
    "no-cache": (None, 1, 1),
    "static-mask": (static((1, 0, 1)), 2, 2),
    "dynamic-split": (hookkit.DBCache(threshold=100.0, warmup_steps=1, taylorseer_order=0), 4, 2),
}
#: whole-transformer graphs as on the GPU; fullgraph=False only because Dynamo does not trace under the recorder's
#: TorchDispatchMode (it runs those frames eagerly; a CUDA stream capture records the compiled kernels instead)
CPU_GRAPHS = hookkit.Compile(cuda_graphs="transformer", backend="eager", fullgraph=False)


@pytest.mark.parametrize("name", list(GRAPH_CACHES))
def test_lora_under_transformer_graphs_equals_a_fresh_pipeline_and_recaptures_once_per_change(
        name: str, graph_stand_in: None) -> None:
    # load, switch, mix weights, fuse, unfuse, unload while enabled: every change drops the graphs once (the watch)
    # and the next call captures them again, giving bitwise the output of a fresh pipeline with the same LoRA state
    # (with eager DBCache on it when cached: the graphs must replay what eager DBCache computes)
    pytest.importorskip("peft")
    cache, per_generation, first = GRAPH_CACHES[name]
    torch._dynamo.reset()
    hooked, fresh = zoo.tiny_pipeline("flux"), zoo.tiny_pipeline("flux")
    handle = hookkit.enable(hooked, hookkit.Spec(cache=cache, compile=CPU_GRAPHS))
    reference = hookkit.enable(fresh, hookkit.Spec(cache=cache)) if cache is not None else None

    def both() -> tuple[torch.Tensor, torch.Tensor]:
        return hooked(**zoo.call_kwargs("flux", steps=3)).images, fresh(**zoo.call_kwargs("flux", steps=3)).images

    def counts() -> tuple[int, int]:
        data = handle.summary().features["compile"].data
        return data["graphs_captured"], data["graph_invalidations"]

    try:
        got, want = both()
        assert torch.equal(got, want)
        assert counts() == (first, 0)
        for i, ((what, apply), (_, apply_fresh)) in enumerate(zip(lora_steps(hooked), lora_steps(fresh)), start=1):
            apply(hooked)
            apply_fresh(fresh)
            got, want = both()
            assert torch.equal(got, want), what
            assert counts() == (first + i * per_generation, i), what
        got, want = both()  # nothing changed: replays only
        assert torch.equal(got, want) and counts() == (first + 6 * per_generation, 6)
        if reference is not None:
            assert handle.summary().features["cache"].data["branches"] == (
                reference.summary().features["cache"].data["branches"])
    finally:
        handle.remove()
        if reference is not None:
            reference.remove()


def test_lora_hotswap_under_transformer_graphs_replays_the_new_weights_without_a_capture(graph_stand_in: None) -> None:
    # peft's hotswap copies the new LoRA weights into the old ones' memory (`.data.copy_`, same rank and alpha): a
    # replay reads that memory, so the graphs stay valid (the watch sees nothing to drop) and give the new LoRA's output
    pytest.importorskip("peft")
    hooked, fresh, b = hotswap_pipelines()
    handle = hookkit.enable(hooked, hookkit.Spec(compile=CPU_GRAPHS))
    try:
        hooked(**zoo.call_kwargs("flux", steps=2))
        hooked.load_lora_weights(dict(b), adapter_name="default_0", hotswap=True)
        got = hooked(**zoo.call_kwargs("flux", steps=2)).images
        data = handle.summary().features["compile"].data
    finally:
        handle.remove()
    fresh.load_lora_weights(dict(b), adapter_name="default_0")
    assert torch.equal(got, fresh(**zoo.call_kwargs("flux", steps=2)).images)
    assert (data["graphs_captured"], data["graph_invalidations"]) == (1, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GRAPH_CACHES))
def test_gpu_lora_under_transformer_graphs_equals_a_fresh_pipeline_and_recaptures_once_per_change(name: str) -> None:
    # the CPU test above with real CUDA graphs (Compile(cuda_graphs="transformer")), tiny Flux in bf16
    pytest.importorskip("peft")
    cache, per_generation, first = GRAPH_CACHES[name]
    torch._dynamo.reset()
    hooked, fresh = (zoo.tiny_pipeline("flux").to("cuda", torch.bfloat16) for _ in range(2))
    handle = hookkit.enable(hooked, hookkit.Spec(cache=cache, compile=hookkit.Compile(cuda_graphs="transformer",
                                                                                     backend="eager")))
    if cache is not None:
        hookkit.enable(fresh, hookkit.Spec(cache=cache))

    def call(pipe: Any) -> torch.Tensor:
        kw = {k: v.to("cuda", torch.bfloat16) if isinstance(v, torch.Tensor) else v
              for k, v in zoo.call_kwargs("flux", steps=3).items()}
        kw["generator"] = torch.Generator("cuda").manual_seed(0)
        with torch.no_grad():
            return pipe(**kw).images.float()

    torch.testing.assert_close(call(hooked), call(fresh), rtol=2e-2, atol=2e-2)
    for i, ((what, apply), (_, apply_fresh)) in enumerate(zip(lora_steps(hooked), lora_steps(fresh)), start=1):
        apply(hooked)
        apply_fresh(fresh)
        torch.testing.assert_close(call(hooked), call(fresh), rtol=2e-2, atol=2e-2, msg=what)
        data = handle.summary().features["compile"].data
        assert (data["graphs_captured"], data["graph_invalidations"]) == (first + i * per_generation, i), what


# --- resolutions and batch sizes that change between calls ----------------------------------------------------


def test_regional_compile_over_five_resolutions_compiles_twice_per_region() -> None:
    # automatic dynamic shapes (Compile(dynamic=None), the default): the first resolution compiles static, the
    # second recompiles with the sequence length symbolic, the other three reuse that graph
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    pipe = zoo.tiny_pipeline("flux")
    handle = hookkit.enable(pipe, hookkit.Spec(compile=hookkit.Compile(backend="eager"),
                                               cache=hookkit.DBCache(threshold=0.0)))
    graphs = []
    try:
        for size in (16, 24, 32, 40, 48):
            counters.clear()
            pipe(**zoo.call_kwargs("flux", steps=1, height=size, width=size))
            graphs.append(counters["stats"]["unique_graphs"])
    finally:
        handle.remove()
    assert graphs[0] >= 2 and graphs[1] >= 2  # both block classes compile at the first two sizes
    assert graphs[2:] == [0, 0, 0]


def test_regional_compile_batch_size_change_recompiles_once() -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    pipe = zoo.tiny_pipeline("flux")
    handle = hookkit.enable(pipe, hookkit.Spec(compile=hookkit.Compile(backend="eager")))
    graphs = []
    try:
        for batch in (1, 2, 3):
            counters.clear()
            pipe(**zoo.call_kwargs("flux", steps=1, batch=batch))
            graphs.append(counters["stats"]["unique_graphs"])
    finally:
        handle.remove()
    assert graphs[0] >= 2 and graphs[1] >= 1 and graphs[2:] == [0]


class CountingBackend:
    """Stands in for CUDA graph capture on the CPU: 'capture' runs fn once and 'replay' re-runs it into the same
    output memory; `memory_in_use` grows by the bytes of each capture's output (a stand-in for pool memory)."""

    def __init__(self) -> None:
        self.in_use = 0

    def memory_in_use(self) -> int:
        return self.in_use

    def capture(self, fn: Any) -> tuple[Any, Any]:
        out = fn()
        self.in_use += out.numel() * out.element_size()

        def replay() -> None:
            out.copy_(fn())

        return replay, out


def test_graph_cache_is_an_lru_of_the_size_the_user_sets() -> None:
    from hookkit.techniques.compile.hooks import GraphRunner

    runner = GraphRunner(CountingBackend(), max_graphs=2)
    double = lambda x: x * 2  # noqa: E731
    for n in (1, 2, 1, 3, 1, 2):  # 1 stays recent; 2 is evicted by 3, then 3 by 2
        assert torch.equal(runner(double, (torch.ones(n),), {}), torch.full((n,), 2.0))
    assert (runner.captures, runner.evictions) == (4, 2)
    assert [key[0][1][1] for key in runner.captured] == [(1,), (2,)]  # the kept shapes, least recent first
    assert [e.memory_bytes for e in runner.captured.values()] == [4, 8]


def test_compile_max_graphs_is_validated() -> None:
    with pytest.raises(hookkit.errors.SpecError, match=r"Compile.max_graphs: expected an int >= 1, got 0"):
        hookkit.Compile(cuda_graphs="transformer", max_graphs=0)
