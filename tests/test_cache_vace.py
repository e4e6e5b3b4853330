"""DBCache on Wan VACE: the control hints the forward adds between middle blocks count once.

`WanVACETransformer3DModel` computes its hints with `vace_blocks` from `control_hidden_states` and the
patch-embedded input before any Wan block runs, then adds `hint * scale` after each block in `vace_layers`. The
adapter names `control_hidden_states` in `between_block_args`, as Flux names its ControlNet residuals. On a computed
step DBCache stores R = (last middle output - first middle input) - (what the forward added between middle blocks);
on a cached step the middle blocks return their inputs, the forward adds this step's hints between them itself and
the last middle block adds R. `cached_oracle` builds that output with plain torch hooks on an unhooked model (no
hookkit code), so a cached step is compared with `torch.equal`.

The model is diffusers' tiny VACE test config (tests/data/diffusers_transformers.json) at 6 blocks with hints after
blocks 0, 2, 3 and 5, each scaled differently: under F1B0 (middle = blocks 1..5) the hint after block 0 is part of
the Fn output, those after blocks 2 and 3 fall between middle blocks, the one after block 5 follows the last middle
block. Each step gets other latents, text and control inputs, so a stale hint could not pass for this step's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import attrs
import pytest
import torch

import hookkit
from diffusers_configs import build, inputs
from hookkit.core.plan import flat_blocks
from hookkit.core.registry import registry_names
from hookkit.errors import UnsupportedError

VACE = "WanVACETransformer3D"
OVERRIDES: dict[str, Any] = dict(num_layers=6, vace_layers=[0, 2, 3, 5])
#: per-hint scales (`control_hidden_states_scale`), powers of two apart from 1: a wrong pairing would show
SCALES = torch.tensor([1.0, 0.5, 2.0, 0.75])
FIRST, LAST = 1, 5  # the middle blocks under F1B0 of 6 blocks


def tiny_vace() -> torch.nn.Module:
    return build(VACE, **OVERRIDES)


def step_inputs(step: int) -> dict[str, Any]:
    """Inputs of denoising step `step`: its own latents, text and control (seeded by the step)."""
    return {**inputs(VACE, seed=step), "control_hidden_states_scale": SCALES}


def run(model: torch.nn.Module, kwargs: dict[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        return model(**kwargs, return_dict=False)[0]


def f1b0(mask: list[int]) -> hookkit.DBCache:
    """F1B0 on a static mask; TaylorSeer off, so a cached step adds the last computed residual as stored."""
    return hookkit.DBCache(fn_blocks=1, bn_blocks=0, steps_mask=mask, mask_policy="static", warmup_steps=0,
                           taylorseer_order=0)


def cached_generation(model: torch.nn.Module, mask: list[int],
                      step_kwargs: Callable[[int], dict[str, Any]] = step_inputs) -> tuple[list[torch.Tensor], Any]:
    """(outputs of each step, the cache summary's data) of one generation of len(mask) steps under F1B0."""
    handle = hookkit.enable(model, hookkit.Spec(cache=f1b0(mask)))
    try:
        with handle.generation(num_steps=len(mask), calls_per_step=1):
            outputs = [run(model, step_kwargs(s)) for s in range(len(mask))]
        summary = handle.summary()
    finally:
        handle.remove()
    return outputs, summary


# --- the oracle: plain torch hooks on an unhooked model -------------------------------------------------------


def _hooked(model: torch.nn.Module, pre: Callable[..., Any] | None, post: Callable[..., Any] | None,
            kwargs: dict[str, Any]) -> torch.Tensor:
    """One call with torch hooks `pre(i, args)` / `post(i, args, output)` on every Wan block, removed after."""
    handles = []
    for i, block in enumerate(model.blocks):
        if pre is not None:
            handles.append(block.register_forward_pre_hook(functools.partial(pre, i)))
        if post is not None:
            handles.append(block.register_forward_hook(functools.partial(post, i)))
    try:
        return run(model, kwargs)
    finally:
        for h in handles:
            h.remove()


def stored_residual(model: torch.nn.Module, kwargs: dict[str, Any]) -> torch.Tensor:
    """The middle blocks' own residual of an uncached call: (block 5's output - block 1's input) minus the sum, in
    block order, of (block j+1's input - block j's output) wherever the forward changed the stream between middle
    blocks (after blocks 2 and 3: their hints, each as the subtraction gives it back)."""
    ins: dict[int, torch.Tensor] = {}
    outs: dict[int, torch.Tensor] = {}
    _hooked(model, lambda i, _m, args: ins.__setitem__(i, args[0]),
            lambda i, _m, _args, out: outs.__setitem__(i, out), kwargs)
    between = None
    for j in range(FIRST, LAST):
        if ins[j + 1] is not outs[j]:
            added = ins[j + 1] - outs[j]
            between = added if between is None else between + added
    assert between is not None  # the test model has hints between middle blocks
    return (outs[LAST] - ins[FIRST]) - between


def cached_oracle(model: torch.nn.Module, kwargs: dict[str, Any], residual: torch.Tensor) -> torch.Tensor:
    """The unhooked model's output with blocks 1..4 returning their input and block 5 its input + `residual`:
    the Fn output plus this step's hints (added by diffusers' own forward, in its order) plus the stored residual."""

    def replace(i: int, _module: torch.nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        if i < FIRST:
            return out
        return args[0] + residual if i == LAST else args[0]

    return _hooked(model, None, replace, kwargs)


# --- tests ----------------------------------------------------------------------------------------------------


def test_the_test_model_has_hints_before_inside_and_after_the_f1b0_middle() -> None:
    # what the tests below rely on, as the core's first-call check reports it: the forward changes the stream after
    # blocks 0, 2 and 3 (the hint after block 5, the last block, is no gap between blocks)
    model = tiny_vace()
    handle = hookkit.enable(model, hookkit.Spec())
    try:
        with handle.generation(num_steps=1, calls_per_step=1):
            run(model, step_inputs(0))
        assert handle.first_call is not None and handle.first_call.report is not None
        assert handle.first_call.report.gaps == (0, 2, 3)
    finally:
        handle.remove()


def test_dbcache_f1b0_attaches_and_caches_on_wan_vace() -> None:
    _, summary = cached_generation(tiny_vace(), [1, 0, 1])
    assert summary.first_call == "confirmed"
    assert summary.features["cache"].data["branches"][0]["cached"] == [1]


def test_a_computed_step_equals_the_unhooked_model_bitwise() -> None:
    model = tiny_vace()
    expected = [run(model, step_inputs(s)) for s in (0, 2)]
    outputs, _ = cached_generation(model, [1, 0, 1])
    assert torch.equal(outputs[0], expected[0])
    assert torch.equal(outputs[2], expected[1])


def test_a_cached_step_equals_fn_output_plus_this_steps_hints_plus_the_stored_residual_bitwise() -> None:
    model = tiny_vace()
    residual = stored_residual(model, step_inputs(0))
    expected = cached_oracle(model, step_inputs(1), residual)
    outputs, _ = cached_generation(model, [1, 0, 1])
    assert torch.equal(outputs[1], expected)


def test_a_cached_step_is_not_the_one_that_adds_the_computed_steps_hints_again() -> None:
    # the oracle distinguishes: the whole residual (hints included) would count step 0's hints a second time
    model = tiny_vace()
    ins: dict[int, torch.Tensor] = {}
    outs: dict[int, torch.Tensor] = {}
    _hooked(model, lambda i, _m, args: ins.__setitem__(i, args[0]),
            lambda i, _m, _args, out: outs.__setitem__(i, out), step_inputs(0))
    twice = cached_oracle(model, step_inputs(1), outs[LAST] - ins[FIRST])
    outputs, _ = cached_generation(model, [1, 0, 1])
    assert (outputs[1] - twice).abs().max() > 1e-2


def test_a_cached_step_on_unchanged_inputs_equals_the_uncached_step_up_to_rounding() -> None:
    # Same inputs at every step: a cache of the blocks' own work reproduces the uncached output. Not bitwise: each
    # hint is added by the forward and measured back by the cache ((x + h) - x is h up to a float32 rounding at x's
    # size), and the residual's subtraction and re-addition round again. |stream| < 8 here, so one ulp is at most
    # 2**-21; the bound allows 8 of them (the last block's output, seen through norm_out and proj_out).
    model = tiny_vace()
    expected = run(model, step_inputs(0))
    outputs, _ = cached_generation(model, [1, 0, 1], step_kwargs=lambda _s: step_inputs(0))
    assert (outputs[1] - expected).abs().max() <= 2.0 ** -18


def test_the_summary_counts_the_wan_blocks_and_the_vace_blocks_run_every_step() -> None:
    # The hints are no block calls: the VACE blocks are left out of the adapter and run on every step (a cached step
    # needs this step's hints), the summary counts Wan blocks: 6 + 1 (block 0 on the cached step) + 6.
    model = tiny_vace()
    vace_calls = [0]
    handles = [b.register_forward_hook(lambda *_: vace_calls.__setitem__(0, vace_calls[0] + 1))
               for b in model.vace_blocks]
    try:
        _, summary = cached_generation(model, [1, 0, 1])
    finally:
        for h in handles:
            h.remove()
    data = summary.features["cache"].data
    assert (data["block_calls"], data["block_calls_uncached"]) == (13, 18)
    assert data["branches"][0]["computed"] == [0, 2]
    assert vace_calls[0] == 3 * len(model.vace_blocks)


def test_removal_restores_the_model_exactly() -> None:
    model = tiny_vace()
    expected = run(model, step_inputs(0))
    before = {path: {k: id(v) for k, v in vars(m).items()} for path, m in model.named_modules()}
    cached_generation(model, [1, 0, 1])
    assert {path: {k: id(v) for k, v in vars(m).items()} for path, m in model.named_modules()} == before
    assert all(registry_names(m) == () for m in model.modules())
    assert torch.equal(run(model, step_inputs(0)), expected)


def test_without_between_block_args_the_hints_inside_the_middle_are_refused() -> None:
    # the adapter field is what makes the hints count once; without it the first call refuses the split rather than
    # add step 0's hints again on cached steps
    model = tiny_vace()
    plain = attrs.evolve(hookkit.resolve_adapter(model), between_block_args=())
    handle = hookkit.enable(model, hookkit.Spec(cache=f1b0([1, 0, 1])), adapter=plain)
    try:
        with pytest.raises(UnsupportedError, match=r"^DBCache F1B0 on WanVACETransformer3DModel: expected the middle "
                                                   r"blocks .* changing it between blocks\.2 and blocks\.3"):
            with handle.generation(num_steps=3, calls_per_step=1):
                run(model, step_inputs(0))
    finally:
        handle.remove()


def test_the_shipped_adapter_names_control_hidden_states_between_blocks() -> None:
    model = tiny_vace()
    adapter = hookkit.resolve_adapter(model)
    assert (adapter.name, adapter.between_block_args) == ("wan_vace", ("control_hidden_states",))
    assert [p for p, _, _ in flat_blocks(adapter, model)] == [f"blocks.{i}" for i in range(6)]


class _ForcedReplay:
    """Stands in for CUDA graph capture (capture is GPU-only): a replay re-runs the captured call with the cache
    decision forced at capture forced again, as a replayed graph runs the captured computed or cached step."""

    def __init__(self, bridge: Any) -> None:
        self.bridge = bridge
        self.captures = 0

    def capture(self, fn: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
        self.captures += 1
        forced = self.bridge.forced
        out = fn()

        def replay() -> None:
            self.bridge.forced = forced
            try:
                fresh = fn()
            finally:
                self.bridge.forced = None
            for static, new in zip(torch.utils._pytree.tree_leaves(out), torch.utils._pytree.tree_leaves(fresh)):
                static.copy_(new)

        return replay, out


def test_under_whole_transformer_graphs_dbcache_on_wan_vace_equals_eager_dbcache_bitwise() -> None:
    """The hints measured between middle blocks on a computed step are subtracted inside the captured graph, and a
    cached-step graph lets the forward add this step's hints: replayed graphs give eager DBCache's outputs."""
    from hookkit.core.graphs import EagerCalls
    from hookkit.core.registry import HookRegistry
    from hookkit.techniques.cache.hooks import graph_bridge
    from hookkit.techniques.compile.cuda_graphs import GraphRunner
    from hookkit.techniques.compile.hooks import GRAPH, GraphHook

    mask = [1, 0, 1, 0, 0]
    expected, _ = cached_generation(tiny_vace(), mask)
    model = tiny_vace()
    handle = hookkit.enable(model, hookkit.Spec(cache=f1b0(mask)))
    bridge = graph_bridge(handle)
    backend = _ForcedReplay(bridge)
    HookRegistry.of(model).register(GRAPH, GraphHook(GraphRunner(backend), bridge, eager=handle.service(EagerCalls)))
    try:
        for _ in range(2):  # the second generation is served by replays only
            with handle.generation(num_steps=len(mask), calls_per_step=1):
                outputs = [run(model, step_inputs(s)) for s in range(len(mask))]
            assert all(torch.equal(a, b) for a, b in zip(outputs, expected))
        assert backend.captures == 2  # one computed-step graph, one cached-step graph
    finally:
        handle.remove()
