"""DBCache: which steps are cached, what a cached step returns, and what it leaves behind.

The decision rules are tested on a stub transformer whose residuals the test controls: every block adds
`scale * temb` to both streams, so the Fn residual is `temb` (block 0 has scale 1) and the relative L1 diff
between two steps is `|temb_now - temb_ref| / |temb_ref|`. A constant `temb` gives diff 0 (cache whenever
allowed); values are dyadic so that every diff is exact.
"""

from __future__ import annotations

import sys
import tracemalloc

import pytest
import torch
from torch import nn

import hookkit
from hookkit import AdapterSpec, BlockListSpec
from hookkit.tools import zoo
from hookkit.errors import HookError, SpecError, UnsupportedError
from hookkit.core.graphs import EagerCalls
from hookkit.core.registry import HookRegistry, registry_names
from hookkit.techniques.cache.hooks import plot_cache_diffs
from hookkit.core.plan import flat_blocks
from hookkit.techniques.cache.spec import MASK_POLICIES

# --- the stub ---------------------------------------------------------------------------------------------


class StubBlock(nn.Module):
    """Adds `scale * temb` to both streams; returns them as Flux does: (encoder, hidden)."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, temb: torch.Tensor):
        return encoder_hidden_states + self.scale * temb, hidden_states + self.scale * temb


class StubTransformer(nn.Module):
    def __init__(self, num_blocks: int = 5) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(StubBlock(float(i + 1)) for i in range(num_blocks))

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, temb: torch.Tensor):
        for block in self.blocks:  # streams by position, temb by keyword
            encoder_hidden_states, hidden_states = block(hidden_states, encoder_hidden_states, temb=temb)
        return hidden_states, encoder_hidden_states


STUB_ADAPTER = AdapterSpec(
    name="stub-dbcache", transformer=("StubTransformer",),
    blocks=(BlockListSpec(attr="blocks", classes=("StubBlock",), encoder_arg="encoder_hidden_states",
                         returns=("encoder_hidden_states", "hidden_states")),),
)


def stub(spec: hookkit.DBCache | None, num_blocks: int = 5):
    model = StubTransformer(num_blocks).double()
    handle = hookkit.enable(model, hookkit.Spec(cache=spec), adapter=STUB_ADAPTER)
    return model, handle


def drive(model: nn.Module, handle: hookkit.Handle, tembs: list[float]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One generation: one transformer call per step with the given temb."""
    hidden = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    encoder = torch.ones(2, 2, dtype=torch.float64)
    outputs = []
    with handle.generation(num_steps=len(tembs)):
        for t in tembs:
            outputs.append(model(hidden, encoder, torch.tensor(t, dtype=torch.float64)))
    return outputs


def branch(handle: hookkit.Handle, index: int = 0) -> dict:
    return handle.summary().features["cache"].data["branches"][index]


def steps(handle: hookkit.Handle, index: int = 0) -> tuple[list[int], list[int]]:
    b = branch(handle, index)
    return b["computed"], b["cached"]


def count_executions(blocks: list[nn.Module]) -> list[int]:
    """Counts real executions of each block: wraps the innermost callable, which a cached block never reaches."""
    counts = [0] * len(blocks)
    for i, block in enumerate(blocks):
        registry = HookRegistry.of(block)
        original = registry.original_forward

        def counted(*args, _i=i, _f=original, **kwargs):
            counts[_i] += 1
            return _f(*args, **kwargs)

        registry.set_inner(counted)
    return counts


# --- decision rules on the stub -----------------------------------------------------------------------------


def test_warmup_steps_always_compute() -> None:
    model, handle = stub(hookkit.DBCache(threshold=0.5, warmup_steps=3))
    drive(model, handle, [1.0] * 7)
    assert steps(handle) == ([0, 1, 2], [3, 4, 5, 6])


def test_warmup_interval_computes_every_nth_warmup_step_only() -> None:
    model, handle = stub(hookkit.DBCache(threshold=0.5, warmup_steps=6, warmup_interval=2))
    drive(model, handle, [1.0] * 8)
    assert steps(handle) == ([0, 2, 4], [1, 3, 5, 6, 7])


def test_threshold_caches_only_strictly_below_it_against_the_last_computed_step() -> None:
    model, handle = stub(hookkit.DBCache(threshold=0.2, warmup_steps=1))
    drive(model, handle, [1.0, 1.125, 1.25, 1.5, 1.5])
    # step 1: |1.125-1|/1 = .125 -> cache; step 2: .25 (ref still step 0) -> compute; step 3: .25/1.25 = .2 -> compute
    assert steps(handle) == ([0, 2, 3], [1, 4])
    assert branch(handle)["diffs"] == {1: 0.125, 2: 0.25, 3: 0.2, 4: 0.0}


def test_max_cached_steps_limits_cached_steps_per_call() -> None:
    model, handle = stub(hookkit.DBCache(threshold=0.5, warmup_steps=1, max_cached_steps=2))
    drive(model, handle, [1.0] * 6)
    assert steps(handle) == ([0, 3, 4, 5], [1, 2])


def test_max_continuous_cached_steps_forces_a_compute_after_a_run() -> None:
    model, handle = stub(hookkit.DBCache(threshold=0.5, warmup_steps=1, max_continuous_cached_steps=2))
    drive(model, handle, [1.0] * 8)
    assert steps(handle) == ([0, 3, 6], [1, 2, 4, 5, 7])


def test_max_accumulated_diff_stops_caching_once_the_sum_of_diffs_reaches_it() -> None:
    model, handle = stub(hookkit.DBCache(threshold=0.5, warmup_steps=1, max_accumulated_diff=0.5))
    drive(model, handle, [1.0, 1.125, 1.25, 1.375, 1.0, 1.0, 1.0])
    # diffs .125, .25, .375 (sum .75 >= .5 after step 3): steps 4.. compute whatever their diff
    assert steps(handle) == ([0, 4, 5, 6], [1, 2, 3])
    assert branch(handle)["diffs"] == {1: 0.125, 2: 0.25, 3: 0.375}


MASK = [1, 1, 0, 0, 1, 0, 0, 1]
JUMP = [1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0, 2.0]  # step 3's Fn residual doubles


def test_dynamic_mask_computes_ones_and_still_checks_the_threshold_on_zeros() -> None:
    model, handle = stub(hookkit.DBCache(threshold=0.2, steps_mask=MASK, mask_policy="dynamic"))
    drive(model, handle, JUMP)
    assert steps(handle) == ([0, 1, 3, 4, 7], [2, 5, 6])
    assert branch(handle)["diffs"] == {2: 0.0, 3: 1.0, 5: 0.0, 6: 0.0}


def test_static_mask_caches_every_zero_whatever_the_diff_and_limits() -> None:
    spec = hookkit.DBCache(threshold=0.2, steps_mask=MASK, mask_policy="static", max_cached_steps=1)
    model, handle = stub(spec)
    drive(model, handle, JUMP)
    assert steps(handle) == ([0, 1, 4, 7], [2, 3, 5, 6])
    assert branch(handle)["diffs"] == {}


def test_static_mask_needs_no_host_read_and_a_dynamic_decision_exactly_one(monkeypatch: pytest.MonkeyPatch) -> None:
    reads = []
    item = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda self: reads.append(1) or item(self))
    model, handle = stub(hookkit.DBCache(steps_mask=MASK, mask_policy="static"))
    drive(model, handle, JUMP)
    assert (len(reads), len(branch(handle)["cached"])) == (0, 4)
    handle.remove()
    model, handle = stub(hookkit.DBCache(threshold=0.2, steps_mask=MASK, mask_policy="dynamic"))
    drive(model, handle, JUMP)
    assert len(reads) == len(branch(handle)["diffs"]) == 4  # one per mask-0 step, none on the 1s


def test_static_mask_has_no_hook_on_block_zero() -> None:
    model, handle = stub(hookkit.DBCache(steps_mask=MASK, mask_policy="static"))
    assert handle.plan.targets("cache") == [(f"blocks.{i}", "hookkit.cache.middle") for i in range(1, 5)]


def test_counters_and_block_executions_follow_the_decisions() -> None:
    model, handle = stub(hookkit.DBCache(fn_blocks=2, bn_blocks=1, steps_mask=[1, 0, 0, 1], mask_policy="static"))
    counts = count_executions(list(model.blocks))
    drive(model, handle, [1.0] * 4)
    assert counts == [4, 4, 2, 2, 4]  # Fn = blocks 0-1 and Bn = block 4 always run; the middle on 2 of 4 steps
    data = handle.summary().features["cache"].data
    assert (data["block_calls"], data["block_calls_uncached"]) == (2 * 5 + 2 * 3, 4 * 5)


# --- what a cached step returns -----------------------------------------------------------------------------


def test_a_cached_step_adds_the_stored_residual_to_both_streams() -> None:
    model, handle = stub(hookkit.DBCache(steps_mask=[1, 0], mask_policy="static"))
    out = drive(model, handle, [1.0, 3.0])
    # step 1: Fn (block 0) runs with temb 3, the middle's residual from step 0 (temb 1, scales 2+3+4+5) is added
    hidden = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    assert torch.equal(out[1][0], hidden + 1 * 3.0 + 14 * 1.0)
    assert torch.equal(out[1][1], torch.ones(2, 2, dtype=torch.float64) + 1 * 3.0 + 14 * 1.0)


def test_taylorseer_order_1_reproduces_a_linear_residual_trajectory_exactly() -> None:
    tembs = [1.0 + k for k in range(6)]  # residuals linear in the step
    model, handle = stub(None)
    reference = drive(model, handle, tembs)
    handle.remove()
    for order, exact in ((1, True), (0, False)):
        handle = hookkit.enable(model, hookkit.Spec(cache=hookkit.DBCache(
            steps_mask=[1, 1, 0, 1, 0, 0], mask_policy="static", taylorseer_order=order)), adapter=STUB_ADAPTER)
        out = drive(model, handle, tembs)
        assert branch(handle)["cached"] == [2, 4, 5]
        same = all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(out, reference))
        assert same is exact
        handle.remove()


def test_taylorseer_order_2_extrapolates_in_the_papers_taylor_form() -> None:
    # middle residual 14 * temb, temb = 1 + k^2: 14, 28, 70, (140), 238, (364), (518); steps 3, 5, 6 cached.
    # step 3 after 0, 1, 2: y 70, d1 = (70 - 28) / 1 = 42, d2 = (42 - (28 - 14)) / 1 = 28 -> 70 + 42 + 28 / 2 = 126
    # step 4 computed: d1 = (238 - 70) / 2 = 84, d2 = (84 - 42) / 2 = 21; step 5 (k = 1): 238 + 84 + 21 / 2 = 332.5;
    # step 6 (k = 2): 238 + 168 + 21 * 4 / 2 = 448
    tembs = [1.0 + k * k for k in range(7)]
    model, handle = stub(hookkit.DBCache(steps_mask=[1, 1, 1, 0, 1, 0, 0], mask_policy="static", taylorseer_order=2))
    out = drive(model, handle, tembs)
    assert branch(handle)["cached"] == [3, 5, 6]
    hidden = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    for step, residual in ((3, 126.0), (5, 332.5), (6, 448.0)):
        assert torch.equal(out[step][0], hidden + tembs[step] + residual)  # block 0 (scale 1) runs, then the residual


def test_taylorseer_order_2_with_only_two_computed_steps_extrapolates_linearly() -> None:
    tembs = [1.0 + k for k in range(5)]  # linear: exact only if the two points give a first-order extrapolation
    model, handle = stub(None)
    reference = drive(model, handle, tembs)
    handle.remove()
    handle = hookkit.enable(model, hookkit.Spec(cache=hookkit.DBCache(
        steps_mask=[1, 1, 0, 0, 0], mask_policy="static", taylorseer_order=2)), adapter=STUB_ADAPTER)
    out = drive(model, handle, tembs)
    assert steps(handle) == ([0, 1], [2, 3, 4])
    for a, b in zip(out, reference):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# --- errors -------------------------------------------------------------------------------------------------


def test_fn_plus_bn_must_leave_a_middle_block() -> None:
    expected = r"DBCache.fn_blocks \+ DBCache.bn_blocks: expected fewer than the 5 blocks.*=3 \+ bn_blocks=2 = 5"
    with pytest.raises(SpecError, match=expected):
        stub(hookkit.DBCache(fn_blocks=3, bn_blocks=2))


def test_a_named_mask_needs_the_number_of_steps_on_a_bare_transformer() -> None:
    model, handle = stub(hookkit.DBCache(steps_mask="fast"))
    with pytest.raises(SpecError, match=r"DBCache.steps_mask: .*'fast'.*handle.generation\(num_steps=N\)"):
        with handle.generation():
            model(torch.zeros(1, 3), torch.zeros(1, 2), torch.tensor(1.0))


def test_an_explicit_mask_needs_no_number_of_steps() -> None:
    model, handle = stub(hookkit.DBCache(steps_mask=[1, 0], mask_policy="static"))
    with handle.generation():
        for _ in range(3):
            model(torch.zeros(1, 3, dtype=torch.float64), torch.zeros(1, 2, dtype=torch.float64), torch.tensor(1.0))
    assert steps(handle) == ([0, 2], [1])  # beyond the mask: compute


def test_a_bare_transformer_call_outside_a_generation_is_refused() -> None:
    # without `handle.generation()` nothing resets the cache: a second generation would reuse the first's residual
    model, _handle = stub(hookkit.DBCache(threshold=100.0, warmup_steps=0))
    hidden, encoder = torch.zeros(1, 3, dtype=torch.float64), torch.zeros(1, 2, dtype=torch.float64)
    with pytest.raises(SpecError, match=r"DBCache on StubTransformer: hookkit was enabled on the bare transformer, "
                                        r"and it was called outside any generation.*hookkit.enable\(pipe, spec\).*"
                                        r"handle.generation\(num_steps=N\)"):
        model(hidden, encoder, torch.tensor(1.0, dtype=torch.float64))


def test_a_bare_transformer_call_after_its_generation_block_is_refused_too() -> None:
    # the finished generation's state stays readable (summary), but a call outside a block must not continue it
    model, handle = stub(hookkit.DBCache(threshold=100.0, warmup_steps=0))
    drive(model, handle, [1.0, 2.0])
    hidden, encoder = torch.zeros(1, 3, dtype=torch.float64), torch.zeros(1, 2, dtype=torch.float64)
    with pytest.raises(SpecError, match=r"DBCache on StubTransformer: hookkit was enabled on the bare transformer, "
                                        r"and it was called outside any generation"):
        model(hidden, encoder, torch.tensor(1.0, dtype=torch.float64))
    assert steps(handle) == ([0], [1])


def test_more_calls_than_the_generation_has_steps_are_refused() -> None:
    model, handle = stub(hookkit.DBCache(threshold=100.0, warmup_steps=0))
    hidden, encoder = torch.zeros(1, 3, dtype=torch.float64), torch.zeros(1, 2, dtype=torch.float64)
    with handle.generation(num_steps=2):
        for _ in range(2):
            model(hidden, encoder, torch.tensor(1.0, dtype=torch.float64))
        with pytest.raises(HookError, match=r"expected a transformer call inside the denoising loop, got one after "
                                            r"its last step \(2 of 2 done\)"):
            model(hidden, encoder, torch.tensor(1.0, dtype=torch.float64))


def test_spec_cache_refuses_a_value_that_is_not_a_dbcache() -> None:
    with pytest.raises(SpecError, match=r"Spec.cache: expected a hookkit.DBCache or None, got 'fast'."):
        hookkit.Spec(cache="fast")


def test_cache_works_on_a_bare_transformer_and_remove_undoes_it() -> None:
    model = StubTransformer().double()
    spec = hookkit.Spec(cache=hookkit.DBCache(steps_mask=[1, 0], mask_policy="static"))
    handle = hookkit.enable(model, spec, adapter=STUB_ADAPTER)
    drive(model, handle, [1.0, 1.0])
    assert steps(handle) == ([0], [1])
    handle.remove()
    assert all(registry_names(m) == () for m in model.modules())


def test_named_masks_cover_exactly_28_steps() -> None:
    lengths = {name: sum(compute + cache for compute, cache in bins) for name, bins in MASK_POLICIES.items()}
    assert lengths == dict.fromkeys(MASK_POLICIES, 28)


# --- pipelines ----------------------------------------------------------------------------------------------


def run(pipe, name: str, steps: int = 4, **extra) -> torch.Tensor:
    out = pipe(**zoo.call_kwargs(name, steps=steps, **extra))
    return out.frames if name in ("cogvideox", "wan") else out.images


@pytest.mark.parametrize("name, branches", [("flux", {0}), ("qwenimage", {0}), ("cogvideox", {0}), ("wan", {0, 1})])
def test_threshold_zero_is_bitwise_equal_to_uncached(name: str, branches: set[int]) -> None:
    pipe = zoo.tiny_pipeline(name)
    reference = run(pipe, name)
    handle = hookkit.enable(pipe, hookkit.Spec(cache=hookkit.DBCache(threshold=0.0, warmup_steps=0)))
    assert torch.equal(run(pipe, name), reference)
    data = handle.summary().features["cache"].data
    assert set(data["branches"]) == branches  # batched CFG (CogVideoX) is one branch, Wan's two calls two
    assert all(b["cached"] == [] and b["computed"] == [0, 1, 2, 3] for b in data["branches"].values())


def recorded_transformer_call(pipe, name: str) -> tuple[tuple, dict]:
    """The arguments of the pipeline's first transformer call (one 1-step generation)."""
    calls = []
    hook = pipe.transformer.register_forward_pre_hook(lambda m, a, k: calls.append((a, dict(k))), with_kwargs=True)
    run(pipe, name, steps=1)
    hook.remove()
    return calls[0]


@pytest.mark.parametrize("name", ["flux", "qwenimage", "cogvideox", "wan"])
def test_a_cached_step_on_unchanged_inputs_reproduces_the_computed_step(name: str) -> None:
    # Same inputs twice: the stored middle residual is exactly what the middle blocks would add again, so the
    # cached call equals the computed one up to rounding, with both streams handed to the Bn block in the
    # block's own return order. (Dropping the encoder residual moves Flux/Qwen/CogVideoX by 1e-3 to 1e-2.)
    pipe = zoo.tiny_pipeline(name)
    args, kwargs = recorded_transformer_call(pipe, name)
    handle = hookkit.enable(pipe.transformer, hookkit.Spec(cache=hookkit.DBCache(
        fn_blocks=1, bn_blocks=1, steps_mask=[1, 0], mask_policy="static")))
    with torch.no_grad(), handle.generation(num_steps=2, calls_per_step=1):
        computed = pipe.transformer(*args, **kwargs)[0]
        cached = pipe.transformer(*args, **kwargs)[0]
    assert steps(handle) == ([0], [1])
    torch.testing.assert_close(cached, computed, rtol=0, atol=1e-5)


def test_static_mask_on_flux_runs_exactly_the_masked_steps() -> None:
    pipe = zoo.tiny_pipeline("flux")
    reference = run(pipe, "flux", steps=6)
    handle = hookkit.enable(pipe, hookkit.Spec(cache=hookkit.DBCache(
        fn_blocks=1, bn_blocks=1, steps_mask=[1, 1, 0, 1, 0, 1], mask_policy="static")))
    blocks = [b for _, _, b in flat_blocks(handle.adapter, pipe.transformer)]  # 2 double + 3 single blocks
    counts = count_executions(blocks)
    out = run(pipe, "flux", steps=6)
    assert counts == [6, 4, 4, 4, 6]
    assert steps(handle) == ([0, 1, 3, 5], [2, 4])
    assert handle.summary().features["cache"].data["block_calls"] == 4 * 5 + 2 * 2
    assert not torch.equal(out, reference)


def test_cfg_branches_keep_separate_state() -> None:
    pipe = zoo.tiny_pipeline("qwenimage")
    spec = hookkit.DBCache(threshold=100.0, warmup_steps=1, max_cached_steps=1)
    handle = hookkit.enable(pipe, hookkit.Spec(cache=spec))
    kw = zoo.call_kwargs("qwenimage", steps=4, true_cfg_scale=4.0)
    kw.update(negative_prompt_embeds=torch.randn_like(kw["prompt_embeds"]),
              negative_prompt_embeds_mask=kw["prompt_embeds_mask"])
    pipe(**kw)
    cond, uncond = branch(handle, 0), branch(handle, 1)
    # one cached step each: a shared counter would have let only one branch cache
    assert (cond["computed"], cond["cached"]) == (uncond["computed"], uncond["cached"]) == ([0, 2, 3], [1])
    # each branch measured its own Fn residual against its own reference
    assert cond["diffs"].keys() == uncond["diffs"].keys() == {1} and cond["diffs"] != uncond["diffs"]


def test_state_resets_at_every_pipeline_call() -> None:
    # a threshold no diff reaches caches every step that has a residual to reuse: had the first call's residual
    # survived, the second call would cache its step 0 too
    pipe = zoo.tiny_pipeline("flux")
    handle = hookkit.enable(pipe, hookkit.Spec(cache=hookkit.DBCache(threshold=100.0, warmup_steps=0)))
    first = run(pipe, "flux", steps=3)
    second = run(pipe, "flux", steps=3)
    assert torch.equal(first, second)
    assert steps(handle) == ([0], [1, 2])


def test_two_pipelines_interleaved_keep_their_own_cache_state() -> None:
    spec = hookkit.DBCache(threshold=100.0, warmup_steps=1)  # step 0 computes, every later step caches
    pipe, other = zoo.tiny_pipeline("flux"), zoo.tiny_pipeline("flux", seed=1)
    handle = hookkit.enable(pipe, hookkit.Spec(cache=spec))
    other_handle = hookkit.enable(other, hookkit.Spec(cache=spec))
    alone = run(pipe, "flux", steps=4)

    def run_other(_pipe, i, t, kwargs):  # a whole generation of the other pipeline after each of this one's steps
        run(other, "flux", steps=3)
        return {}

    interleaved = run(pipe, "flux", steps=4, callback_on_step_end=run_other)
    assert torch.equal(interleaved, alone)
    assert steps(handle) == ([0], [1, 2, 3])
    assert steps(other_handle) == ([0], [1, 2])


def test_removal_restores_every_block_exactly() -> None:
    pipe = zoo.tiny_pipeline("flux")
    reference = run(pipe, "flux")
    before = {path: set(m.__dict__) for path, m in pipe.transformer.named_modules()}
    handle = hookkit.enable(pipe, hookkit.Spec(cache=hookkit.DBCache(threshold=100.0, steps_mask=[1, 0, 0, 1])))
    assert registry_names(pipe.transformer.transformer_blocks[0]) == ("hookkit.cache.entry",)
    assert registry_names(pipe.transformer.transformer_blocks[1]) == ("hookkit.cache.middle",)
    assert not torch.equal(run(pipe, "flux"), reference)
    assert steps(handle) == ([0, 3], [1, 2])
    handle.remove()
    assert {path: set(m.__dict__) for path, m in pipe.transformer.named_modules()} == before
    assert torch.equal(run(pipe, "flux"), reference)


# --- statistics and plot ------------------------------------------------------------------------------------


def test_summary_has_per_branch_steps_diffs_and_percentiles() -> None:
    model, handle = stub(hookkit.DBCache(threshold=0.2, warmup_steps=1))
    drive(model, handle, [1.0, 1.125, 1.25, 1.5, 1.5])
    summary = handle.summary().features["cache"]
    assert summary.data["branches"][0]["percentiles"] == {
        "P00": 0.0, "P25": 0.09375, "P50": 0.1625, "P75": pytest.approx(0.2125), "P95": pytest.approx(0.2425),
        "min": 0.0, "max": 0.25}
    assert "| Branch | Steps | Cached Steps | Diffs P00 |" in summary.text
    assert "branch 0 cached steps: [1, 4]" in summary.text
    assert "block calls run: 17 of 25 (68.0%)" in summary.text


def test_summary_before_any_transformer_call_is_empty() -> None:
    _model, handle = stub(hookkit.DBCache(threshold=0.2))
    summary = handle.summary().features["cache"]
    assert (summary.data["branches"], summary.data["transformer_calls"], summary.data["block_calls"]) == ({}, 0, 0)
    assert summary.text.endswith("\nno transformer call in this generation yet")


def test_plot_without_matplotlib_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    model, handle = stub(hookkit.DBCache(threshold=0.2, warmup_steps=1))
    drive(model, handle, [1.0, 1.125])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    with pytest.raises(UnsupportedError, match=r"needs matplotlib.*pip install hookkit\[plot\]"):
        plot_cache_diffs(handle, "never.png")


def test_plot_writes_a_png(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    model, handle = stub(hookkit.DBCache(threshold=0.2, warmup_steps=1))
    drive(model, handle, [1.0, 1.125, 1.25, 1.5, 1.5])
    path = plot_cache_diffs(handle, tmp_path / "diffs.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_of_the_planned_default_shades_the_cached_steps_and_draws_no_diff(tmp_path, monkeypatch) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to read its axes
    model, handle = stub(hookkit.DBCache())
    drive(model, handle, [1.0, 1.125, 1.25, 1.5, 1.5, 1.625, 1.75, 1.875])
    assert steps(handle) == ([0, 1, 4, 7], [2, 3, 5, 6])
    path = hookkit.plot_cache_diffs(handle.summary(), tmp_path / "planned.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (ax,) = figures[0].axes
    assert ax.get_lines() == []  # the planned rule measures no diff and has no threshold
    assert ax.get_legend_handles_labels()[1] == ["cached"]
    assert [(p.get_x(), p.get_width()) for p in ax.patches] == [(1.5, 1.0), (2.5, 1.0), (4.5, 1.0), (5.5, 1.0)]


def test_plot_cache_diffs_is_public() -> None:
    assert hookkit.plot_cache_diffs is plot_cache_diffs and "plot_cache_diffs" in hookkit.__all__


# --- regional compilation -----------------------------------------------------------------------------------


def test_regional_compile_matches_eager_and_never_recompiles_after_the_first_step() -> None:
    from torch._dynamo.utils import counters

    pipe = zoo.tiny_pipeline("flux")
    # dynamic decisions (one .item() per step) that alternate: compute, cache, compute, ...
    spec = hookkit.DBCache(threshold=10.0, warmup_steps=1, max_continuous_cached_steps=1)
    handle = hookkit.enable(pipe, hookkit.Spec(cache=spec))
    eager = run(pipe, "flux", steps=5)
    assert steps(handle) == ([0, 2, 4], [1, 3])
    compiled = []
    for _, _, block in flat_blocks(handle.adapter, pipe.transformer):
        registry = HookRegistry.of(block)
        registry.set_inner(torch.compile(registry.original_forward, fullgraph=True, backend="aot_eager"))
        compiled.append(registry)
    torch._dynamo.reset()
    counters.clear()
    seen = []

    def snapshot(pipe, i, t, kwargs):
        seen.append({k: dict(v) for k, v in counters.items()})
        return {}

    out = run(pipe, "flux", steps=5, callback_on_step_end=snapshot)
    out_again = run(pipe, "flux", steps=5, callback_on_step_end=snapshot)
    assert seen[0]["stats"]["unique_graphs"] >= 2  # both block classes compiled in step 0
    assert all(s == seen[0] for s in seen)  # nothing compiled or recompiled afterwards, nor in a second call
    assert steps(handle) == ([0, 2, 4], [1, 3])
    torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-5)
    assert torch.equal(out_again, out)
    for registry in compiled:
        registry.set_inner(None)


def test_runs_inside_hookkit_compile_with_the_same_decisions_and_outputs() -> None:
    pipe = zoo.tiny_pipeline("flux")
    cache = hookkit.DBCache(threshold=10.0, warmup_steps=1, max_continuous_cached_steps=1)
    handle = hookkit.enable(pipe, hookkit.Spec(cache=cache))
    eager = run(pipe, "flux", steps=5)
    handle.remove()
    torch._dynamo.reset()
    handle = hookkit.enable(pipe, hookkit.Spec(cache=cache, compile=hookkit.Compile(backend="aot_eager")))
    compiled = run(pipe, "flux", steps=5)
    assert steps(handle) == ([0, 2, 4], [1, 3])
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)
    handle.remove()


# --- whole-transformer CUDA graphs (the bridge, with a CPU stand-in for capture and replay) ----------------


class GraphLikeBackend:
    """Stands in for CUDA graph capture on the CPU. 'capture' runs fn once (hooks run, the decision forced);
    'replay' re-runs it on the same static buffers, writing the same slots, but like a real replay, which runs
    no Python, it leaves no trace in the bridge's bookkeeping."""

    def __init__(self, bridge) -> None:
        self.bridge = bridge
        self.captures = 0

    def capture(self, fn):
        self.captures += 1
        forced = self.bridge.forced
        output = fn()

        def replay() -> None:
            last = {index: list(slots) for index, slots in self.bridge.last.items()}
            self.bridge.forced = forced
            try:
                fresh = fn()
            finally:
                self.bridge.forced, self.bridge.last = None, last
            for static, new in zip(torch.utils._pytree.tree_leaves(output), torch.utils._pytree.tree_leaves(fresh)):
                static.copy_(new)

        return replay, output


def test_transformer_graphs_capture_a_cached_step_on_the_residual_of_its_own_resolution() -> None:
    from hookkit.techniques.compile.hooks import GRAPH, GraphHook, GraphRunner
    from hookkit.techniques.cache.hooks import graph_bridge

    cache = hookkit.DBCache(steps_mask=[1, 1, 0, 1, 0, 0], mask_policy="static", taylorseer_order=0)
    eager_pipe = zoo.tiny_pipeline("flux")
    hookkit.enable(eager_pipe, hookkit.Spec(cache=cache))
    reference = run(eager_pipe, "flux", steps=6)
    pipe = zoo.tiny_pipeline("flux")
    handle = hookkit.enable(pipe, hookkit.Spec(cache=cache))
    bridge = graph_bridge(handle)
    backend = GraphLikeBackend(bridge)
    HookRegistry.of(pipe.transformer).register(GRAPH, GraphHook(GraphRunner(backend), bridge,
                                                                eager=handle.service(EagerCalls)))
    run(pipe, "flux", steps=2)  # a short warm-up call: the 32x32 computed-step graph only (mask [1, 1])
    run(pipe, "flux", steps=6, height=48, width=48)  # 48x48: its own two graphs, its slots written last
    # back at 32x32: the computed step replays, then the cached-step graph is captured; it must read the
    # 32x32 slot (the 48x48 one raised a shape error before)
    assert torch.equal(run(pipe, "flux", steps=6), reference)
    assert backend.captures == 4
    assert steps(handle) == ([0, 1, 3], [2, 4, 5])


def test_a_pipeline_sharing_the_transformer_with_its_own_scheduler_is_refused_not_silently_cached() -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler

    pipe = zoo.tiny_pipeline("flux")
    hookkit.enable(pipe, hookkit.Spec(cache=hookkit.DBCache(steps_mask="fast", mask_policy="static")))
    other = type(pipe)(**{**pipe.components, "scheduler": FlowMatchEulerDiscreteScheduler.from_config(
        pipe.scheduler.config)})
    run(pipe, "flux", steps=6)
    with pytest.raises(HookError, match=r"got one after its last step \(6 of 6 done\) with no new "
                                        r"scheduler.set_timesteps on the scheduler hookkit patched"):
        run(other, "flux", steps=6)
    run(pipe, "flux", steps=6)  # the hooked pipeline itself goes on working


def _tiny_sd3_pipeline():
    """SD3 (no tiny SD3 pipeline ships in the zoo): the tiny transformer, a tiny VAE, no text encoders."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    vae = zoo._tiny_vae_kl(4)
    vae.register_to_config(shift_factor=0.0, scaling_factor=1.0)
    pipe = StableDiffusion3Pipeline(transformer=zoo.tiny_transformer("sd3"), scheduler=FlowMatchEulerDiscreteScheduler(),
                                    vae=vae, text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None,
                                    text_encoder_3=None, tokenizer_3=None)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _sd3_kwargs(steps: int, **extra) -> dict:
    g = torch.Generator().manual_seed(0)
    embeds = {k: torch.randn(*shape, generator=g) for k, shape in (
        ("prompt_embeds", (1, 8, 16)), ("negative_prompt_embeds", (1, 8, 16)),
        ("pooled_prompt_embeds", (1, 16)), ("negative_pooled_prompt_embeds", (1, 16)))}
    return dict(embeds, height=32, width=32, num_inference_steps=steps, guidance_scale=5.0, output_type="latent",
                generator=torch.Generator().manual_seed(0), **extra)


def test_sd3_skip_layer_guidance_skipping_the_first_middle_block_decides_at_the_next_one() -> None:
    # the extra guidance call skips block 1, DBCache's first middle block with fn_blocks=1: it is its own branch
    slg = dict(skip_guidance_layers=[1], skip_layer_guidance_start=0.0, skip_layer_guidance_stop=1.0)
    pipe = _tiny_sd3_pipeline()
    with torch.no_grad():
        reference = pipe(**_sd3_kwargs(6, **slg))[0]
        handle = hookkit.enable(pipe, hookkit.Spec(cache=hookkit.DBCache(rule="threshold", fn_blocks=1, warmup_steps=8)))  # computes all
        assert torch.equal(pipe(**_sd3_kwargs(6, **slg))[0], reference)
        assert branch(handle, 1)["computed"] == [1, 2, 3, 4, 5]  # SLG starts at step 1 in diffusers
        hookkit.disable(pipe)
        mask = [1, 0, 0, 0, 0, 1]
        handle = hookkit.enable(pipe, hookkit.Spec(cache=hookkit.DBCache(fn_blocks=1, steps_mask=mask,
                                                                           mask_policy="static")))
        out = pipe(**_sd3_kwargs(6, **{**slg, "skip_layer_guidance_stop": 0.8}))[0]
    assert out.shape == reference.shape
    assert steps(handle, 0) == ([0, 5], [1, 2, 3, 4]) and steps(handle, 1) == ([1], [2, 3, 4])


def test_a_static_mask_computes_a_step_whose_batch_changed_since_the_stored_residual() -> None:
    """diffusers' SD3CFGCutoffCallback turns CFG off part-way: the batch halves within one call."""
    from diffusers.callbacks import SD3CFGCutoffCallback

    pipe = _tiny_sd3_pipeline()
    cutoff = dict(callback_on_step_end=SD3CFGCutoffCallback(cutoff_step_ratio=None, cutoff_step_index=4))
    with torch.no_grad():
        reference = pipe(**_sd3_kwargs(10, **cutoff))[0]
        mask = [1, 1, 1, 1, 1, 0, 0, 1, 0, 1]  # step 5 is the first batch-1 step: nothing of that shape is stored
        handle = hookkit.enable(pipe, hookkit.Spec(cache=hookkit.DBCache(steps_mask=mask, mask_policy="static")))
        out = pipe(**_sd3_kwargs(10, **cutoff))[0]
    assert out.shape == reference.shape == (1, 4, 16, 16)
    assert steps(handle) == ([0, 1, 2, 3, 4, 5, 7, 9], [6, 8])


def test_video_to_video_sizes_the_mask_for_the_steps_that_run() -> None:
    """WanVideoToVideoPipeline slices `scheduler.timesteps` without `set_begin_index`: strength 0.5 of 20 steps
    runs 10, and a 20-step mask would cache the last step that runs."""
    import numpy as np
    from diffusers import WanVideoToVideoPipeline
    from PIL import Image

    tiny = zoo.tiny_pipeline("wan")
    pipe = WanVideoToVideoPipeline(**{k: v for k, v in tiny.components.items()
                                      if k in ("tokenizer", "text_encoder", "vae", "scheduler", "transformer")})
    pipe.set_progress_bar_config(disable=True)
    video = [Image.fromarray((np.random.RandomState(i).rand(16, 16, 3) * 255).astype("uint8")) for i in range(5)]
    kwargs = zoo.call_kwargs("wan", steps=20)
    kwargs.pop("num_frames")
    handle = hookkit.enable(pipe, hookkit.Spec(cache=hookkit.DBCache(steps_mask="fast", mask_policy="static")))
    with torch.no_grad():
        pipe(**kwargs, video=video, strength=0.5)
    mask = hookkit.techniques.cache.spec.resolve_steps_mask("fast", 10)
    assert handle.state.num_steps == 10
    assert handle.summary().features["cache"].data["mask"] == list(mask)
    assert steps(handle) == ([i for i, m in enumerate(mask) if m], [i for i, m in enumerate(mask) if not m])


def test_a_huge_warmup_costs_nothing_and_computes_every_step() -> None:
    model, handle = stub(hookkit.DBCache(rule="threshold", warmup_steps=10**12))
    drive(model, handle, [1.0, 1.0, 1.0])  # a set of the warm-up's steps would take terabytes
    data = handle.summary().features["cache"].data
    assert (data["warmup_steps"], data["branches"][0]["cached"]) == ([0, 1, 2], [])


def test_huge_counts_on_a_pipeline_compute_every_step_without_a_large_allocation() -> None:
    """Every count a user gives (warm-up, its interval, the cached-step limits) is kept as a bound, never expanded
    into the steps it covers: a set of a 10**9-step warm-up was 9+ GB or a MemoryError at every call."""
    pipe = zoo.tiny_pipeline("flux")
    huge = 10**9
    handle = hookkit.enable(pipe, hookkit.Spec(cache=hookkit.DBCache(
        rule="threshold", warmup_steps=huge, max_cached_steps=huge, max_continuous_cached_steps=huge)))
    tracemalloc.start()
    try:
        pipe(**zoo.call_kwargs("flux", steps=4))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    data = handle.summary().features["cache"].data
    assert (data["warmup_steps"], data["branches"][0]["computed"], data["branches"][0]["cached"]) == (
        [0, 1, 2, 3], [0, 1, 2, 3], [])
    assert peak < 8 * 2**20  # Python objects alive at once during the call (tensors are not traced): under 8 MiB
