"""The rows that are not hookkit's: stock diffusers (eager, regional and full compile, FirstBlockCache, MagCache)
and cache-dit when installed, each set up through its own public API."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

import hookkit
from hookkit.errors import UnsupportedError
from hookkit.tools.bench.models import call_kwargs, output_type_for
from hookkit.tools.bench.row import RunContext


def _eager(ctx: RunContext) -> None:
    """Stock diffusers, nothing changed."""


def transformers_of(pipe: Any) -> list[torch.nn.Module]:
    """The pipeline's transformers: `transformer`, and `transformer_2` where it has one (Wan 2.2 A14B's low-noise
    expert). A stock row sets each up, as hookkit's rows do, so that both experts' steps are what is measured."""
    second = getattr(pipe, "transformer_2", None)
    return [pipe.transformer] + ([second] if second is not None else [])


def _stock_regional_compile(mode: str | None) -> Callable[[RunContext], None]:
    def setup(ctx: RunContext) -> None:
        for transformer in transformers_of(ctx.pipe):
            if not getattr(transformer, "_repeated_blocks", None):
                raise UnsupportedError(f"{type(transformer).__name__} has no _repeated_blocks: stock regional compile "
                                       "is unavailable (hookkit-compile uses the adapter's repeated_blocks)")
            kwargs: dict[str, Any] = {"fullgraph": True}
            if mode is not None:
                kwargs["mode"] = mode
            transformer.compile_repeated_blocks(**kwargs)
    return setup


def _stock_full_compile(mode: str | None) -> Callable[[RunContext], None]:
    def setup(ctx: RunContext) -> None:
        kwargs: dict[str, Any] = {"fullgraph": True}
        if mode is not None:
            kwargs["mode"] = mode
        for transformer in transformers_of(ctx.pipe):
            transformer.compile(**kwargs)
    return setup


def _first_block_cache(ctx: RunContext) -> None:
    from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache

    for transformer in transformers_of(ctx.pipe):
        apply_first_block_cache(transformer, FirstBlockCacheConfig(threshold=0.12))


def _mag_cache(ctx: RunContext) -> None:
    """diffusers' MagCache with its defaults (threshold 0.06, at most 3 skipped steps in a row, the first 20 %
    computed) and the only magnitude ratios diffusers ships, `FLUX_MAG_RATIOS`, interpolated to the step count.
    Ratios are a trained checkpoint's statistic: random weights have none worth calibrating, so the row's skip
    schedule is the one Flux-dev's ratios give (as the image rows' masks come from a trained model)."""
    from diffusers.hooks import MagCacheConfig, apply_mag_cache
    from diffusers.hooks.mag_cache import FLUX_MAG_RATIOS

    for transformer in transformers_of(ctx.pipe):
        apply_mag_cache(transformer, MagCacheConfig(mag_ratios=FLUX_MAG_RATIOS,
                                                    num_inference_steps=ctx.opts.num_steps()))


def separate_cfg_calls(pipe: Any, kwargs: dict[str, Any]) -> bool:
    """Whether a pipeline call with `kwargs` runs the transformer twice per step (conditional, then
    unconditional). cache-dit must be told (`enable_separate_cfg`): its Qwen-Image default assumes it, and on
    a call without true CFG it then pairs consecutive steps as two branches and follows the wrong mask."""
    from hookkit.adapters import resolve_adapter

    if resolve_adapter(pipe.transformer).cfg != "separate":
        return False
    if kwargs.get("negative_prompt_embeds") is None and kwargs.get("negative_prompt") is None:
        return False
    guider = getattr(pipe, "guider", None)  # HunyuanVideo 1.5: CFG is the pipeline's guider, not a call argument
    default = getattr(guider, "guidance_scale", 1.0) if guider is not None else 1.0
    return float(kwargs.get("true_cfg_scale", kwargs.get("guidance_scale", default))) > 1.0


def tuned_2x_mask(steps: int = 28) -> tuple[int, ...]:
    """The steps `hookkit.tune(..., speedup=2)` computes on the trained tiny Flux at `steps` steps: DBCache's
    "schedule" rule, TaylorSeer 2, planned from the shipped calibration (14 of 28 steps computed, no block on a
    cached step). Random weights never tell a rule anything, so speed is measured on the rule's decisions."""
    from hookkit.techniques.cache.spec import rule_mask
    from hookkit.tools import trained

    spec = hookkit.DBCache(rule="schedule", calibration=trained.calibration("tiny", steps), speedup=2.0,
                           taylorseer_order=2)
    return rule_mask(spec, steps, num_blocks=1)  # fn_blocks 0: the plan does not depend on the model's depth


def _cache_dit(ctx: RunContext, quant_type: str | None = None, mask: Sequence[int] | None = None) -> None:
    """cache-dit DBCache F1B0 with the static "fast" step mask: the configuration DESIGN.md measured, told
    whether this call's CFG runs as separate transformer calls. `quant_type`: cache-dit's own torchao
    quantization (`QuantizeConfig(quant_type=...)`, applied by `enable_cache` after the cache hooks).

    The mask is hookkit's `resolve_steps_mask("fast", steps)`, the one hookkit's "cache-fast" rows compute: cache-dit's
    own `steps_mask("fast", ...)` is the same at 28 steps but not at others (at 6 steps it computes steps 0, 1, 2, 5,
    hookkit's 0, 3, 5), and rows compared on different steps would measure different work."""
    import cache_dit  # type: ignore[import-not-found]

    from hookkit.techniques.cache.spec import resolve_steps_mask

    steps = ctx.opts.num_steps()
    separate = separate_cfg_calls(ctx.pipe, call_kwargs(ctx.pipe, ctx.opts, output_type_for(ctx.opts)))
    extra: dict[str, Any] = {}
    if quant_type is not None:
        extra["quantize_config"] = cache_dit.QuantizeConfig(quant_type=quant_type)
    cache_dit.enable_cache(ctx.pipe, cache_config=cache_dit.DBCacheConfig(
        Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=0.12, max_warmup_steps=0,
        enable_separate_cfg=separate,
        steps_computation_mask=list(mask if mask is not None else resolve_steps_mask("fast", steps)),
        steps_computation_policy="static",
    ), **extra)
    ctx.features = lambda: {"cache": cache_dit_steps(cache_dit.summary(ctx.pipe, logging=False))}
    if getattr(ctx.pipe, "transformer_2", None) is not None:  # Wan 2.2: the second entry is transformer_2's blocks
        ctx.companion_features = lambda: {"transformer_2": {"cache": cache_dit_steps(
            cache_dit.summary(ctx.pipe, logging=False)[1:2])}}


def _cache_dit_compile(ctx: RunContext) -> None:
    """cache-dit as above, then stock regional compilation of the blocks inside cache-dit's wrapper (DESIGN.md's
    "cache-dit + regional compile"): the peer's fastest configuration on the same mask."""
    _cache_dit(ctx)
    _stock_regional_compile(None)(ctx)


def _cache_dit_fp8_compile(ctx: RunContext) -> None:
    """The strongest peer configuration, the one hookkit's fastest rows are measured against: cache-dit DBCache on the "fast" mask with cache-dit's own
    fp8 (`QuantizeConfig(quant_type="float8_per_row")`: torchao dynamic per-row on every Linear of the
    repeated blocks, the AdaLN modulation Linears included), then stock regional compilation."""
    _cache_dit(ctx, quant_type="float8_per_row")
    _stock_regional_compile(None)(ctx)


def _cache_dit_fp8_compile_sage(ctx: RunContext) -> None:
    """The strongest peer configuration with cache-dit's SageAttention backend (`cache_dit.set_attn_backend(pipe,
    "sage")`: the `sageattention` package's int8 Q.K^T kernel in every attention), as cache-dit users run video."""
    import cache_dit  # type: ignore[import-not-found]

    _cache_dit(ctx, quant_type="float8_per_row")
    cache_dit.set_attn_backend(ctx.pipe, attention_backend="sage")
    _stock_regional_compile(None)(ctx)


def _cache_dit_fp8_compile_2x(ctx: RunContext) -> None:
    """The strongest peer configuration on the tuned 2x rule's computed steps (`tuned_2x_mask`): cache-dit F1B0 (its
    smallest Fn) with that mask, its fp8 per-row, stock regional compile."""
    _cache_dit(ctx, quant_type="float8_per_row", mask=tuned_2x_mask(ctx.opts.num_steps()))
    _stock_regional_compile(None)(ctx)


def cache_dit_steps(stats: Sequence[Any]) -> dict[str, Any]:
    """cache-dit's `CacheStats` of the last call in the shape of hookkit's DBCache summary data (cached and
    computed step indices per CFG branch), so that the table's notes read the same for both. The indices are of the
    stats' own blocks (Wan 2.2's `transformer_2` counts its steps from 0)."""
    branches: dict[str, dict[str, list[int]]] = {}
    for stat in stats[:1]:  # one entry per cached block list; the first carries the step decisions
        for name, cached, executed in (("cond", stat.cached_steps, stat.accumulated_executed_steps),
                                       ("uncond", stat.cfg_cached_steps, stat.accumulated_executed_steps)):
            if name == "uncond" and not stat.cache_options["cache_config"].enable_separate_cfg:
                continue
            cached = sorted(cached)
            branches[name] = {"cached": cached, "computed": [i for i in range(executed) if i not in set(cached)]}
    return {"source": "cache-dit", "branches": branches}
