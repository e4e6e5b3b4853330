"""Quality harness: caching methods judged on the real denoising trajectories of a trained model.

For each class and seed, a shipped trained model (`hookkit.tools.trained`: a stock FluxPipeline, or WanPipeline for
the video model) runs once uncached (the reference) and once per configuration, reported against the reference:

- the work that ran, counted alike for every method: forward pre-hooks on the descendants of each block's
  children see which children computed in each transformer call (a skipped block runs none, a reused
  attention no projection), credited with each child's FLOPs measured once on the reference; speed-up in
  executed block FLOPs, in block calls and in wall time;
- PSNR and SSIM of the final images (in [0, 1]; a clip's SSIM per frame) against the reference of that class and seed;
- the fraction of samples the shipped classifier still recognises as the class asked for.

A configuration is a hookkit `Spec`, a peer's `setup(pipe) -> undo` (skipped with the reason when its package
does not import), or the uncached pipeline at fewer steps; each gets a freshly loaded pipeline.

    report = quality.run_quality(quality.default_configs(), classes=range(10), seeds=range(4))
    report.write("out/quality")          # quality.md, quality.json, quality.png

or `python -m hookkit.tools.quality --out out/quality` (behind `hookkit bench --quality`; `hookkit bench --quality
--front` runs `hookkit.tools.front` instead, the Pareto fronts against every peer, which builds on this module).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import inspect
import json
import math
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

import hookkit
from hookkit.diagnostics.plot import pyplot, save_png
from hookkit.tools.bench import DTYPES, environment, psnr_from_mse, resolve_device, timed
from hookkit.tools.local import check_folder
from hookkit.errors import HookkitError, SpecError
from hookkit.core.summary import table

__all__ = [
    "DEFAULT_THRESHOLDS",
    "PSNR_CAP_DB",
    "BlockCounter",
    "BlockFlops",
    "QualityConfig",
    "QualityReport",
    "QualityRow",
    "TrainedModel",
    "cache_dit_config",
    "default_configs",
    "diffusers_cache_setup",
    "fbcache_config",
    "hookkit_config",
    "leave_stock",
    "measure_block_flops",
    "model_label",
    "quality_main",
    "run_quality",
    "ssim",
]

DEFAULT_THRESHOLDS: tuple[float, ...] = (0.04, 0.08, 0.12, 0.16, 0.2, 0.24, 0.3)
MASK_POLICIES: tuple[str, ...] = tuple(hookkit.techniques.cache.spec.MASK_POLICIES)

#: `setup(pipe)` applies a method to a freshly loaded pipeline and returns the callable that undoes it.
Setup = Callable[[Any], Callable[[], None]]


# --- metrics ------------------------------------------------------------------------------------------------


def _gaussian_window(size: int, sigma: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    coords = torch.arange(size, dtype=dtype, device=device) - (size - 1) / 2
    g = torch.exp(-(coords**2) / (2 * sigma**2))
    g = g / g.sum()
    return torch.outer(g, g)


def ssim(x: torch.Tensor, y: torch.Tensor, data_range: float = 1.0, window: int = 11, sigma: float = 1.5) -> torch.Tensor:
    """SSIM (Wang et al. 2004) per image of two batches (B, C, H, W): gaussian window 11, sigma 1.5, K1 0.01,
    K2 0.03, computed per channel over the valid region (no padding), averaged over channels and positions.
    Clips (B, F, C, H, W): each frame's SSIM, averaged over the clip's frames.

    Computed in float64. Returns (B,).
    """
    if x.shape == y.shape and x.ndim == 5:
        return ssim(x.flatten(0, 1), y.flatten(0, 1), data_range, window, sigma).view(x.shape[:2]).mean(dim=1)
    if x.shape != y.shape or x.ndim != 4:
        raise SpecError(f"ssim: expected two (B, C, H, W) or (B, F, C, H, W) tensors of one shape, got "
                        f"{tuple(x.shape)} and {tuple(y.shape)}.")
    if min(x.shape[-2:]) < window:
        raise SpecError(f"ssim: images must be at least {window}x{window} (the window), got {tuple(x.shape[-2:])}.")
    x, y = x.double(), y.double()
    c = x.shape[1]
    kernel = _gaussian_window(window, sigma, x.dtype, x.device).expand(c, 1, window, window)

    def blur(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.conv2d(t, kernel, groups=c)

    mu_x, mu_y = blur(x), blur(y)
    var_x = blur(x * x) - mu_x * mu_x
    var_y = blur(y * y) - mu_y * mu_y
    cov = blur(x * y) - mu_x * mu_y
    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    s = ((2 * mu_x * mu_y + c1) * (2 * cov + c2)) / ((mu_x * mu_x + mu_y * mu_y + c1) * (var_x + var_y + c2))
    return s.mean(dim=(1, 2, 3))


def mse(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean squared error per image (B,), in float64."""
    return (x.double() - y.double()).pow(2).mean(dim=tuple(range(1, x.ndim)))


# --- counting the blocks that ran ---------------------------------------------------------------------------


def _witnesses(child: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules whose call proves that `child` computed: its descendants (a method that skips `child` replaces
    its forward, so `child.__call__` still happens but none of its submodules run), or `child` itself if it has none."""
    return [m for m in child.modules() if m is not child] or [child]


def _sdpa_flops(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, out_shape: Any = None,
                **kwargs: Any) -> int:
    from torch.utils.flop_counter import sdpa_flop_count

    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _flop_counter() -> Any:
    """`FlopCounterMode` that also counts the CPU's fused attention (torch has no formula for it, so attention
    would count 0 FLOPs on the CPU and methods that skip attention would be credited nothing)."""
    from torch.utils.flop_counter import FlopCounterMode

    mapping: dict[Any, Any] = {}
    for name in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_fused_attention_overrideable"):
        packet = getattr(torch.ops.aten, name, None)  # FlopCounterMode looks formulas up by overload packet
        if packet is not None:
            mapping[packet] = _sdpa_flops
    return FlopCounterMode(display=False, custom_mapping=mapping)


@attrs.frozen(kw_only=True)
class BlockFlops:
    """FLOPs of one transformer call's blocks: `children[b][c]` for block b's c-th direct child, `own[b]` for
    what block b computes outside its children. Measured once per geometry (`measure_block_flops`)."""

    children: tuple[tuple[int, ...], ...]
    own: tuple[int, ...]

    @property
    def per_call(self) -> int:
        """Every block's FLOPs in one uncached transformer call."""
        return sum(map(sum, self.children)) + sum(self.own)


def _blocks_of(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    from hookkit.adapters import resolve_adapter
    from hookkit.core.plan import flat_blocks

    return [block for _, _, block in flat_blocks(resolve_adapter(transformer), transformer)]


def measure_block_flops(transformer: torch.nn.Module, run: Callable[[], Any],
                        blocks: Sequence[torch.nn.Module] | None = None) -> BlockFlops:
    """FLOPs of each block child in one transformer call, as torch's `FlopCounterMode` counts them (matrix
    products, convolutions and attention; elementwise ops count 0), measured while `run()` calls the uncached
    `transformer` (any number of calls of one geometry: the sum is divided by the number of calls).

    Blocks are the adapter's block lists unless `blocks` are given. A pre- and a post-hook on each child read
    the counter's running total, so each child gets exactly the FLOPs of the ops run inside it.
    """
    blocks = list(blocks) if blocks is not None else _blocks_of(transformer)
    children = [list(block.children()) or [block] for block in blocks]
    child_totals = [[0] * len(c) for c in children]
    block_totals = [0] * len(blocks)
    calls = [0]
    counter = _flop_counter()
    handles: list[Any] = []

    def add_to(cell: list[int], index: int) -> tuple[Callable[..., None], Callable[..., None]]:
        start = [0]

        def pre(module: torch.nn.Module, args: Any) -> None:
            start[0] = counter.get_total_flops()

        def post(module: torch.nn.Module, args: Any, output: Any) -> None:
            cell[index] += counter.get_total_flops() - start[0]

        return pre, post

    def count_call(module: torch.nn.Module, args: Any) -> None:
        calls[0] += 1

    handles.append(transformer.register_forward_pre_hook(count_call))
    for b, block in enumerate(blocks):
        pre, post = add_to(block_totals, b)
        handles += [block.register_forward_pre_hook(pre), block.register_forward_hook(post)]
        for c, child in enumerate(children[b] if children[b] != [block] else ()):
            pre, post = add_to(child_totals[b], c)
            handles += [child.register_forward_pre_hook(pre), child.register_forward_hook(post)]
    try:
        with torch.no_grad(), counter:
            run()
    finally:
        for handle in handles:
            handle.remove()
    if calls[0] == 0:
        raise SpecError("measure_block_flops.run: expected it to call the transformer at least once, got no call.")
    n = calls[0]
    for b, block in enumerate(blocks):
        if children[b] == [block]:  # a block without children is its own only child
            child_totals[b][0] = block_totals[b]
    child_flops = tuple(tuple(round(t / n) for t in totals) for totals in child_totals)
    own = tuple(round(block_totals[b] / n) - sum(child_flops[b]) for b in range(len(blocks)))
    return BlockFlops(children=child_flops, own=own)


class BlockCounter:
    """Counts, per transformer call, the blocks and the block children that actually ran, and the FLOPs they did.

    A caching method that skips a block still lets the block's `__call__` happen (hookkit and diffusers
    return its inputs from a replaced forward), so a hook on the block itself would count skipped blocks too.
    A block's *submodules* run only when the block computes: a forward pre-hook on each descendant of a direct
    child marks that child (and so its block) as run in the current transformer call. A method that skips only
    attention (PAB, FasterCache, TaylorSeer) replaces the attention module's forward: its submodules do not run,
    the block's other children do. With `flops` (`measure_block_flops`), `executed_flops` credits each child
    that ran with its measured FLOPs, and a block that ran at all with its own: every method is counted alike.
    Blocks are the adapter's block lists (hookkit.adapters) unless `blocks` are given.

    With `per_block=False` (a compiled transformer: the children's hooks would run inside the compiled regions,
    where each block's own hook is a recompile and the set they fill is traced, not filled) only transformer calls
    are counted; `block_calls`, `partial_calls` and `executed_flops` are then None and come from elsewhere (`_run`).
    """

    def __init__(self, transformer: torch.nn.Module, per_block: bool = True, flops: BlockFlops | None = None,
                 blocks: Sequence[torch.nn.Module] | None = None) -> None:
        self.blocks = list(blocks) if blocks is not None else _blocks_of(transformer)
        self.children = [list(block.children()) or [block] for block in self.blocks]
        if flops is not None and [len(c) for c in flops.children] != [len(c) for c in self.children]:
            raise SpecError(f"BlockCounter.flops: expected FLOPs for {[len(c) for c in self.children]} children per "
                            f"block, got {[len(c) for c in flops.children]}; measure them on this transformer.")
        self.flops = flops
        self.calls = 0
        self._ran: set[tuple[int, int, int]] = set()  # (transformer call, block, child)
        self.per_block = per_block
        self._handles = [transformer.register_forward_pre_hook(self._on_call)]
        for b, children in enumerate(self.children if per_block else ()):
            for c, child in enumerate(children):
                for witness in _witnesses(child) if children != [self.blocks[b]] else [child]:
                    self._handles.append(witness.register_forward_pre_hook(self._marker(b, c)))

    def _on_call(self, module: torch.nn.Module, args: Any) -> None:
        self.calls += 1

    def _marker(self, block: int, child: int) -> Callable[[torch.nn.Module, Any], None]:
        def mark(module: torch.nn.Module, args: Any) -> None:
            self._ran.add((self.calls, block, child))

        return mark

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def block_calls(self) -> int | None:
        """Blocks that ran (any of their children), summed over transformer calls (None when not counted per block)."""
        return len({(call, b) for call, b, _ in self._ran}) if self.per_block else None

    @property
    def partial_calls(self) -> int | None:
        """Transformer calls in which some block child did not run: cached steps, and steps whose attention was
        reused (None when not counted per block)."""
        if not self.per_block:
            return None
        total = sum(map(len, self.children))
        per_call: dict[int, int] = {}
        for call, _, _ in self._ran:
            per_call[call] = per_call.get(call, 0) + 1
        return sum(1 for call in range(1, self.calls + 1) if per_call.get(call, 0) < total)

    @property
    def executed_flops(self) -> int | None:
        """FLOPs of the block children that ran, plus each run block's own, summed over transformer calls (None
        without `flops` or when not counted per block)."""
        if self.flops is None or not self.per_block:
            return None
        children = sum(self.flops.children[b][c] for _, b, c in self._ran)
        return children + sum(self.flops.own[b] for _, b in {(call, b) for call, b, _ in self._ran})

    def reset(self) -> None:
        self.calls = 0
        self._ran.clear()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


# --- configurations -----------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class QualityConfig:
    """One row of the harness: a hookkit `spec`, or a peer method's `setup`, or neither (the reference, or the
    uncached pipeline at fewer `steps`).

    `family` is the curve it belongs to in the plot; `x` its position along that curve's sweep (a threshold
    or a mask name); `requires` a module that must import, else the row is skipped with that reason;
    `unsupported` a reason the row cannot run on this pipeline at all (it is skipped with it); `steps` the
    denoising steps of this row when not the run's (the row is still compared with the run's reference);
    `batched` says a peer's decisions are fixed before the call (a step interval, calibrated ratios, a static mask),
    so every sample may run in one batch (`one_batch`; hookkit specs and fewer steps are judged from their spec).
    """

    name: str
    family: str
    spec: hookkit.Spec | None = attrs.field(default=None)
    setup: Setup | None = attrs.field(default=None, eq=False)
    requires: str | None = None
    x: float | str | None = None
    description: str = ""
    steps: int | None = attrs.field(default=None)
    unsupported: str | None = None
    batched: bool = False

    @steps.validator
    def _check_steps(self, attribute: attrs.Attribute, value: Any) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise SpecError(f"QualityConfig.steps: expected an int >= 1 or None (the run's steps), got {value!r}.")

    @spec.validator
    def _check_spec(self, attribute: attrs.Attribute, value: Any) -> None:
        if value is not None and not isinstance(value, hookkit.Spec):
            raise SpecError(f"QualityConfig.spec: expected a hookkit.Spec or None, got {value!r}.")

    @setup.validator
    def _check_setup(self, attribute: attrs.Attribute, value: Any) -> None:
        if value is not None and not callable(value):
            raise SpecError(f"QualityConfig.setup: expected a callable setup(pipe) -> undo or None, got {value!r}.")
        if value is not None and self.spec is not None:
            raise SpecError(f"QualityConfig {self.name!r}: give a hookkit spec or a setup callable, not both.")

    @property
    def kind(self) -> str:
        if self.spec is not None:
            return "hookkit"
        if self.setup is not None:
            return "peer"
        return "steps" if self.steps is not None else "reference"

    @property
    def one_batch(self) -> bool:
        """Whether every sample runs in one pipeline call: only where no decision reads the images, so that a batch
        decides as each sample alone would (a threshold rule decides once for the whole batch, so it runs batch 1).
        The images then equal batch-1 runs up to float rounding, and the row is compared with a batched reference;
        on a GPU this is the difference between minutes and seconds a row (launches, not arithmetic, bound the
        trained models there)."""
        if self.spec is not None:
            cache = self.spec.cache
            return cache is None or cache.rule != "threshold" or cache.mask_policy == "static"
        return self.batched or self.setup is None

    def unavailable(self) -> str | None:
        """Why this row cannot run here, or None."""
        if self.unsupported is not None:
            return self.unsupported
        if self.requires is not None:
            reason = _import_fails(self.requires)
            if reason is not None:
                return reason
        if self.spec is not None:
            from hookkit.tools.bench import available_fields

            wanted = {k for k, v in self.spec.to_dict().items() if v not in (None, False)}
            missing = sorted(wanted - available_fields())
            if missing:
                return f"no installed hookkit feature implements Spec.{missing[0]} (hookkit.core.feature.TECHNIQUES)"
        return None


REFERENCE = QualityConfig(name="reference", family="reference", description="uncached pipeline")


@functools.lru_cache(maxsize=None)
def _import_fails(module: str) -> str | None:
    """Why `import module` fails here, or None (imported once; a package that is installed but breaks on import,
    as a peer built for another diffusers can, is a reason too)."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module.startswith(exc.name):
            return f"`import {module}` fails (not installed)"
        return f"`import {module}` fails (ModuleNotFoundError: {exc})"
    except Exception as exc:  # a broken install is a reason to skip, not a crash
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return f"`import {module}` fails ({type(exc).__name__}: {first})"[:300]
    return None


def _cache_tag(cache: hookkit.DBCache) -> str:
    tag = f"F{cache.fn_blocks}B{cache.bn_blocks}"
    if cache.taylorseer_order:
        tag += f"-TS{cache.taylorseer_order}"
    # everything that changes decisions is in the name, so two configurations of one sweep never share it
    if cache.warmup_steps is not None:  # None: scaled to the step count (8 at 28)
        tag += f"-W{cache.warmup_steps}"
    if cache.max_continuous_cached_steps != -1:
        tag += f"-MC{cache.max_continuous_cached_steps}"
    if cache.rule == "schedule":
        plan = "calibrated" if cache.calibration is not None else f"spacing{cache.spacing:g}-last{cache.last_computed:g}"
        return f"{tag}-schedule{cache.speedup:g}x-{plan}"
    if cache.rule == "magnitude":
        tag += "-magnitude"
    if cache.steps_mask is not None:
        mask = cache.steps_mask if isinstance(cache.steps_mask, str) else "custom"
        tag += f"-mask-{mask}-{cache.mask_policy}"
        return tag + (f"-R{cache.threshold:g}" if cache.mask_policy == "dynamic" else "")
    return f"{tag}-R{cache.threshold:g}"


def hookkit_config(cache: hookkit.DBCache, family: str | None = None, name: str | None = None,
                   x: float | str | None = None) -> QualityConfig:
    """A row for `hookkit.Spec(cache=cache)`."""
    tag = _cache_tag(cache)
    if family is None:
        family = f"hookkit F{cache.fn_blocks}B{cache.bn_blocks}"
        if cache.taylorseer_order:
            family += f" TaylorSeer-{cache.taylorseer_order}"
        if cache.steps_mask is not None:
            family += f" {cache.mask_policy} mask"
    if x is None:
        x = cache.steps_mask if isinstance(cache.steps_mask, str) else (
            cache.speedup if cache.rule == "schedule" else cache.threshold)
    return QualityConfig(
        name=name or f"hookkit-{tag}", family=family, spec=hookkit.Spec(cache=cache), x=x,
        description=(f"hookkit DBCache {tag}, warmup {'auto' if cache.warmup_steps is None else cache.warmup_steps}, max continuous "
                     f"{cache.max_continuous_cached_steps}"),
    )


def leave_stock(module: torch.nn.Module) -> Callable[[], None]:
    """Snapshot the `__dict__` keys of `module` and its submodules; the returned callable deletes every key added
    since. A peer's own undo leaves attributes behind (diffusers' `disable_cache`: `_diffusers_hook`,
    `_cache_config` and a bound `forward` on each hooked module; cache-dit's: `forward`, `_is_patched`); after
    both, the transformer is the stock one again, key for key."""
    before = [(m, frozenset(m.__dict__)) for m in module.modules()]

    def restore() -> None:
        for m, keys in before:
            for key in [k for k in m.__dict__ if k not in keys]:
                del m.__dict__[key]

    return restore


def diffusers_cache_setup(make_config: Callable[[Any], Any]) -> Setup:
    """`setup(pipe)` for a diffusers cache: `pipe.transformer.enable_cache(make_config(pipe))`, undone with
    `disable_cache()` and `leave_stock`. `make_config` gets the pipeline (PAB and FasterCache read its
    `current_timestep`)."""

    def setup(pipe: Any) -> Callable[[], None]:
        restore = leave_stock(pipe.transformer)
        pipe.transformer.enable_cache(make_config(pipe))

        def undo() -> None:
            pipe.transformer.disable_cache()
            restore()

        return undo

    return setup


def fbcache_config(threshold: float) -> QualityConfig:
    """diffusers' FirstBlockCache (`transformer.enable_cache(FirstBlockCacheConfig(threshold))`, undone with
    `disable_cache()`): the first block decides, every other block is cached; no warm-up, no limits."""

    def make(pipe: Any) -> Any:
        from diffusers.hooks import FirstBlockCacheConfig

        return FirstBlockCacheConfig(threshold=threshold)

    return QualityConfig(name=f"fbcache-R{threshold:g}", family="diffusers FirstBlockCache",
                         setup=diffusers_cache_setup(make), requires="diffusers.hooks.first_block_cache",
                         x=threshold, description=f"diffusers FirstBlockCache, threshold {threshold:g}")


def cache_dit_config(threshold: float, fn_blocks: int = 1, bn_blocks: int = 0, warmup_steps: int = 8,
                     taylorseer_order: int = 0, steps_mask: str | None = None, steps: int | None = None,
                     mask_policy: str = "static") -> QualityConfig:
    """cache-dit's DBCache (`cache_dit.enable_cache(pipe, cache_config=DBCacheConfig(...))`, undone with
    `cache_dit.disable_cache(pipe)` and `leave_stock`); skipped where cache-dit does not import.

    Args:
        threshold: `residual_diff_threshold` (with a static mask it decides nothing).
        fn_blocks, bn_blocks: `Fn_compute_blocks`, `Bn_compute_blocks`.
        warmup_steps: `max_warmup_steps` (cache-dit's default 8; cut to a mask's leading 1s by cache-dit).
        taylorseer_order: > 0 adds `TaylorSeerCalibratorConfig(taylorseer_order=...)`.
        steps_mask: one of cache-dit's named policies ("slow", "medium", "fast", "ultra"), made by
            `cache_dit.steps_mask(total_steps=steps, mask_policy=...)`; needs `steps`.
        mask_policy: `steps_computation_policy`, "static" (the mask alone decides) or "dynamic".
    """
    if steps_mask is not None and steps is None:
        raise SpecError(f"cache_dit_config.steps: expected the number of denoising steps with steps_mask={steps_mask!r}, "
                        "got None (cache-dit's masks are made for a step count).")

    def setup(pipe: Any) -> Callable[[], None]:
        import cache_dit  # type: ignore[import-not-found]

        kwargs: dict[str, Any] = {}
        if taylorseer_order:
            kwargs["calibrator_config"] = cache_dit.TaylorSeerCalibratorConfig(taylorseer_order=taylorseer_order)
        mask: dict[str, Any] = {}
        if steps_mask is not None:
            mask = dict(steps_computation_mask=cache_dit.steps_mask(total_steps=steps, mask_policy=steps_mask),
                        steps_computation_policy=mask_policy)
        restore = leave_stock(pipe.transformer)
        cache_dit.enable_cache(pipe, cache_config=cache_dit.DBCacheConfig(
            Fn_compute_blocks=fn_blocks, Bn_compute_blocks=bn_blocks, residual_diff_threshold=threshold,
            max_warmup_steps=warmup_steps, max_continuous_cached_steps=-1, **mask,
        ), **kwargs)

        def undo() -> None:
            cache_dit.disable_cache(pipe)
            restore()

        return undo

    ts = f"-TS{taylorseer_order}" if taylorseer_order else ""
    family = f"cache-dit F{fn_blocks}B{bn_blocks}" + (f" TaylorSeer-{taylorseer_order}" if taylorseer_order else "")
    if steps_mask is not None:
        tail = f"-mask-{steps_mask}-{mask_policy}" + (f"-R{threshold:g}" if mask_policy == "dynamic" else "")
        return QualityConfig(
            name=f"cache-dit-F{fn_blocks}B{bn_blocks}{ts}{tail}", family=f"{family} {mask_policy} mask", setup=setup,
            requires="cache_dit", x=steps_mask, batched=mask_policy == "static",
            description=f"cache-dit DBCache F{fn_blocks}B{bn_blocks}{ts}, {mask_policy} steps mask {steps_mask!r} "
                        f"(cache_dit.steps_mask at {steps} steps)",
        )
    return QualityConfig(
        name=f"cache-dit-F{fn_blocks}B{bn_blocks}{ts}-R{threshold:g}", family=family,
        setup=setup, requires="cache_dit", x=threshold,
        description=f"cache-dit DBCache F{fn_blocks}B{bn_blocks}{ts}, threshold {threshold:g}, warmup {warmup_steps}",
    )


def default_configs(thresholds: Sequence[float] = DEFAULT_THRESHOLDS) -> list[QualityConfig]:
    """The default sweep: `hookkit.DBCache()` as it comes, hookkit DBCache F1B0 / F2B0 / F1B1 and F1B0 with
    TaylorSeer (order 1) over `thresholds` (other DBCache settings at their defaults: warm-up 8 steps, no limit
    on cached steps), hookkit's static masks, diffusers' FirstBlockCache and cache-dit's DBCache F1B0 at the
    same thresholds."""
    out: list[QualityConfig] = [hookkit_config(hookkit.DBCache(), family="hookkit defaults", name="hookkit-defaults",
                                               x=hookkit.DBCache().speedup)]
    for fn, bn, order in ((1, 0, 0), (2, 0, 0), (1, 1, 0), (1, 0, 1)):
        out += [hookkit_config(hookkit.DBCache(fn_blocks=fn, bn_blocks=bn, threshold=t, taylorseer_order=order))
                for t in thresholds]
    out += [hookkit_config(hookkit.DBCache(fn_blocks=1, bn_blocks=0, steps_mask=m, mask_policy="static",
                                           taylorseer_order=0)) for m in MASK_POLICIES]
    out += [fbcache_config(t) for t in thresholds]
    out += [cache_dit_config(t) for t in thresholds]
    return out


# --- running --------------------------------------------------------------------------------------------------


#: a bitwise-equal sample counts as this many dB in mean PSNRs (its PSNR is infinite; an MSE of 1e-10 is 100 dB)
PSNR_CAP_DB = 100.0


@attrs.frozen(kw_only=True)
class QualityRow:
    """One configuration's results against the reference (`status` "ok", "skipped" or "failed")."""

    name: str
    family: str
    kind: str
    description: str
    x: float | str | None
    status: str
    note: str = ""
    samples: int = 0
    #: denoising steps this row ran (the reference's, or fewer)
    steps: int | None = None
    transformer_calls: int | None = None
    #: transformer calls in which some block child did not run
    cached_calls: int | None = None
    block_calls: int | None = None
    block_speedup: float | None = None
    #: block calls as hookkit's own summary reports them (hookkit rows), to cross-check the counter
    reported_block_calls: int | None = None
    #: FLOPs of the block children that ran (`BlockCounter.executed_flops`), summed over all samples
    block_flops: int | None = None
    #: the reference's executed block FLOPs / this row's: the work saved, counted alike for every method
    flops_speedup: float | None = None
    wall_s: float | None = None
    wall_speedup: float | None = None
    #: PSNR (dB) of the mean squared error over all samples; None when every sample is bitwise equal
    psnr_db: float | None = None
    #: mean over samples of each sample's PSNR (dB), a bitwise-equal sample counted as `PSNR_CAP_DB`
    psnr_mean_db: float | None = None
    #: the worst sample's PSNR (dB); None when every sample is bitwise equal
    psnr_min_db: float | None = None
    ssim: float | None = None
    ssim_min: float | None = None
    #: fraction of samples the classifier recognises as the class asked for
    recognised: float | None = None
    identical: bool = False
    #: all samples ran in one call against a reference run the same way (`QualityConfig.one_batch`)
    batched: bool = False
    per_sample: dict[str, list[Any]] = attrs.field(factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


def _hookkit_block_calls(handle: Any) -> int | None:
    summary = handle.summary()
    for feature in summary.features.values():
        if isinstance(feature.data, dict) and "block_calls" in feature.data:
            return int(feature.data["block_calls"])
    return None


@attrs.frozen(kw_only=True)
class TrainedModel:
    """Where the harness gets its pipeline and its calls: `hookkit.tools.trained`'s model `name` (or the weights
    file `weights`). The one place that passes `model=` to `hookkit.tools.trained`."""

    name: str = "tiny"
    weights: str | Path | None = None
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32
    cfg_scale: float = 1.0

    def check(self) -> None:
        """Refuse a model this `hookkit.tools.trained` cannot load, before anything runs."""
        from hookkit.errors import UnsupportedError
        from hookkit.tools import trained

        if self.name != "tiny" and "model" not in inspect.signature(trained.load_pipeline).parameters:
            raise UnsupportedError(
                f"--model: expected 'tiny', got {self.name!r}: this hookkit.tools.trained.load_pipeline takes no "
                "model= argument yet (only the tiny model ships). Use --model tiny, or --weights FILE.")
        models = getattr(trained, "MODELS", {"tiny": None})
        if self.name not in models:
            raise SpecError(f"--model: expected one of {sorted(models)}, got {self.name!r}.")

    def _model_kwargs(self, fn: Callable[..., Any]) -> dict[str, Any]:
        return {"model": self.name} if "model" in inspect.signature(fn).parameters else {}

    @property
    def label(self) -> str:
        """How tables name the model: "tiny Flux", "deep Flux", "video Wan"."""
        from hookkit.tools import trained

        return f"{self.name} {'Wan' if trained.is_video(self.name) else 'Flux'}"

    def images(self, output: Any) -> torch.Tensor:
        """A call's images (B, 3, H, W), or clips (B, F, 3, H, W) for the video model."""
        from hookkit.tools import trained

        return trained.output_images(output)

    def pipeline(self) -> Any:
        """A freshly loaded stock FluxPipeline (the video model: WanPipeline)."""
        from hookkit.tools import trained

        self.check()
        return trained.load_pipeline(device=self.device, dtype=self.dtype, path=self.weights,
                                     **self._model_kwargs(trained.load_pipeline))

    def call_kwargs(self, label: int, seed: int, steps: int) -> dict[str, Any]:
        """The keyword arguments of one pipeline call: class `label` from `seed`, `steps` denoising steps."""
        return self.batch_kwargs([(label, seed)], steps)

    def batch_kwargs(self, samples: Sequence[tuple[int, int]], steps: int) -> dict[str, Any]:
        """One pipeline call generating every (class, seed) of `samples`; each sample draws its own noise, so an
        image does not depend on the batch it is made in (`trained.call_kwargs`)."""
        from hookkit.tools import trained

        return trained.call_kwargs([l for l, _ in samples], [s for _, s in samples], steps=steps,
                                   cfg_scale=self.cfg_scale, device=self.device, dtype=self.dtype, path=self.weights,
                                   **self._model_kwargs(trained.call_kwargs))


def _run(config: QualityConfig, samples: list[tuple[int, int]], steps: int, source: TrainedModel, warmup: int,
         flops: BlockFlops | None = None, one_batch: bool = False) -> dict[str, Any]:
    """Run every sample under `config` on a freshly loaded pipeline, each in its own call (batch 1) or, with
    `one_batch`, all in one; with `flops`, count the block FLOPs that ran. Without (the reference), measure them
    first, on this stock pipeline (one 1-step call)."""
    pipe = source.pipeline()
    steps = config.steps or steps
    if flops is None:
        flops = measure_block_flops(pipe.transformer, lambda: pipe(**source.call_kwargs(*samples[0], steps=1)))
    handle = None
    undo: Callable[[], None] | None = None
    compiled = config.spec is not None and config.spec.compile is not None
    counter = BlockCounter(pipe.transformer, per_block=not compiled, flops=flops)
    try:
        if config.spec is not None:
            handle = hookkit.enable(pipe, config.spec)
        elif config.setup is not None:
            undo = config.setup(pipe)

        for _ in range(warmup):  # untimed: lazy initialisation, allocator, kernels
            pipe(**source.call_kwargs(*samples[0], steps=steps))
        counter.reset()
        images, seconds, reported = [], 0.0, 0
        for batch in ([samples] if one_batch else [[sample] for sample in samples]):
            kwargs = source.batch_kwargs(batch, steps=steps)  # built outside the timed call, as `hookkit bench` does
            dt, out = timed(lambda: source.images(pipe(**kwargs)), source.device)
            seconds += dt
            images.append(out.float().cpu())
            if handle is not None:
                value = _hookkit_block_calls(handle)
                reported = reported + value if value is not None and reported is not None else None
        block_calls, partial, executed = counter.block_calls, counter.partial_calls, counter.executed_flops
        if not counter.per_block:  # compiled: hookkit's cache counts the blocks it ran; without one, every block runs
            cache = config.spec.cache is not None
            block_calls = reported if cache else counter.calls * counter.num_blocks
            partial = None if cache else 0
            executed = None if cache else counter.calls * flops.per_call  # which blocks a cached call ran is unknown
        calls = counter.calls
        if one_batch:  # each call did every sample's work: count it per sample, as batch-1 rows are counted
            n = len(samples)
            block_calls, executed, calls = _times(block_calls, n), _times(executed, n), calls * n
            partial, reported = _times(partial, n), _times(reported, n)
        return dict(images=torch.cat(images), seconds=seconds, block_calls=block_calls, block_flops=executed,
                    transformer_calls=calls, cached_calls=partial, steps=steps, flops=flops,
                    reported_block_calls=reported if handle is not None else None)
    finally:
        counter.remove()
        if handle is not None:
            handle.remove()
        if undo is not None:
            undo()


def _times(value: int | None, n: int) -> int | None:
    return None if value is None else value * n


def only_rows(configs: list[QualityConfig], only: str | None, script: str) -> list[QualityConfig]:
    """The rows of `configs` named in `only` (comma-separated; None or "": all), in their order. A name that is no
    row ends the script (`script`: its name in the message) with the known names."""
    if not only:
        return configs
    wanted = set(only.split(","))
    unknown = wanted - {c.name for c in configs}
    if unknown:
        raise SystemExit(f"{script} --only: unknown rows {sorted(unknown)}; known: {[c.name for c in configs]}")
    return [c for c in configs if c.name in wanted]


def run_quality(configs: Iterable[QualityConfig], classes: Iterable[int | str] | None = None,
                seeds: Iterable[int] = (0, 1, 2, 3), steps: int = 28, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32, cfg_scale: float = 1.0, weights: str | Path | None = None,
                classifier_weights: str | Path | None = None, warmup: int = 1,
                log: Callable[[str], None] | None = print, model: str = "tiny") -> QualityReport:
    """Run the reference and every configuration over classes x seeds; compare each with the reference.

    `classes` default to all of `hookkit.tools.trained.CLASSES`; each (class, seed) is one pipeline call of batch 1.
    `model` is `hookkit.tools.trained`'s model ("tiny"; "deep" where it ships). A configuration that cannot run
    here is a "skipped" row, one that raises a "failed" row, with the reason. The reference run first measures
    each block child's FLOPs (`measure_block_flops`); every row's work is then counted in those FLOPs.
    """
    from hookkit.tools import trained

    log = log or (lambda message: None)
    labels = [trained.class_index(c) for c in (classes if classes is not None else range(trained.NUM_CLASSES))]
    seed_list = [int(s) for s in seeds]
    if not labels or not seed_list:
        raise SpecError(f"run_quality: expected at least one class and one seed, got classes={labels}, seeds={seed_list}.")
    if steps < 1:
        raise SpecError(f"run_quality.steps: expected an int >= 1, got {steps!r}.")
    samples = [(label, seed) for label in labels for seed in seed_list]
    dev = torch.device(device)
    source = TrainedModel(name=model, weights=weights, device=dev, dtype=dtype, cfg_scale=cfg_scale)
    source.check()
    classifier = trained.load_classifier(path=classifier_weights)
    configs = list(configs)
    names = [c.name for c in configs]
    if REFERENCE.name in names or len(set(names)) != len(names):
        raise SpecError(f"run_quality.configs: expected unique names other than {REFERENCE.name!r}, got {names}.")

    def recognised(images: torch.Tensor) -> list[int]:
        return trained.predict(classifier, images)

    log(f"quality: reference ({model}), {len(samples)} samples x {steps} steps on {dev}")
    ref = _run(REFERENCE, samples, steps, source, warmup)
    ref_pred = recognised(ref["images"])
    rows = [_row(REFERENCE, ref, ref, labels=[l for l, _ in samples], predicted=ref_pred)]
    batched_ref: dict[str, Any] | None = None  # the reference for rows run in one batch, made when one needs it
    for i, config in enumerate(configs, 1):
        reason = config.unavailable()
        if reason is not None:
            rows.append(_empty(config, "skipped", reason))
            log(f"[{i}/{len(configs)}] {config.name}: skipped ({reason})")
            continue
        one_batch = config.one_batch and len(samples) > 1
        try:
            if one_batch and batched_ref is None:
                batched_ref = _run(REFERENCE, samples, steps, source, warmup, flops=ref["flops"], one_batch=True)
            result = _run(config, samples, steps, source, warmup, flops=ref["flops"], one_batch=one_batch)
        except Exception as exc:  # a failing method is a result, not a crash
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            rows.append(_empty(config, "failed", f"{type(exc).__name__}: {first}"[:300]))
            log(f"[{i}/{len(configs)}] {config.name}: failed ({rows[-1].note})")
            continue
        rows.append(_row(config, result, batched_ref if one_batch else ref, labels=[l for l, _ in samples],
                         predicted=recognised(result["images"]), one_batch=one_batch))
        r = rows[-1]
        flops = "" if r.flops_speedup is None else f"{r.flops_speedup:.2f}x fewer block FLOPs, "
        log(f"[{i}/{len(configs)}] {config.name}: {flops}{r.block_speedup:.2f}x fewer block calls, "
            f"PSNR {_db(r.psnr_db)}, SSIM {r.ssim:.4f}, recognised {r.recognised:.0%}")
    flops = ref["flops"]
    meta = dict(
        model=str(weights or getattr(trained, "model_file", lambda m: trained.MODEL_FILE)(model)), model_name=model,
        classes=[trained.CLASSES[l] for l in labels], seeds=seed_list, steps=steps, cfg_scale=cfg_scale,
        model_label=source.label, device=str(dev), dtype=str(dtype).removeprefix("torch."), warmup=warmup,
        block_flops_per_call=flops.per_call, block_child_flops=[list(c) for c in flops.children],
        block_own_flops=list(flops.own), environment=environment(dev),
    )
    return QualityReport(rows=tuple(rows), meta=meta)


def _empty(config: QualityConfig, status: str, note: str) -> QualityRow:
    return QualityRow(name=config.name, family=config.family, kind=config.kind, description=config.description,
                      x=config.x, status=status, note=note)


def _ratio(a: int | None, b: int | None) -> float | None:
    return None if a is None or not b else a / b


def _row(config: QualityConfig, result: dict[str, Any], ref: dict[str, Any], labels: list[int],
         predicted: list[int], one_batch: bool = False) -> QualityRow:
    images, ref_images = result["images"], ref["images"]
    errors = mse(images, ref_images).tolist()
    ssims = ssim(images, ref_images).tolist()
    pooled = sum(errors) / len(errors)
    identical = bool(torch.equal(images, ref_images))
    hits = [p == l for p, l in zip(predicted, labels)]
    per_psnr = [psnr_from_mse(e) for e in errors]
    capped = [min(p, PSNR_CAP_DB) for p in per_psnr]
    return QualityRow(
        name=config.name, family=config.family, kind=config.kind, description=config.description, x=config.x,
        status="ok", samples=len(labels), steps=result["steps"], transformer_calls=result["transformer_calls"],
        cached_calls=result["cached_calls"], block_calls=result["block_calls"],
        block_speedup=_ratio(ref["block_calls"], result["block_calls"]),
        reported_block_calls=result["reported_block_calls"], block_flops=result["block_flops"],
        flops_speedup=_ratio(ref["block_flops"], result["block_flops"]),
        wall_s=result["seconds"], wall_speedup=ref["seconds"] / result["seconds"],
        psnr_db=None if pooled == 0 else psnr_from_mse(pooled), psnr_mean_db=sum(capped) / len(capped),
        psnr_min_db=None if pooled == 0 else min(per_psnr),
        ssim=sum(ssims) / len(ssims), ssim_min=min(ssims), recognised=sum(hits) / len(hits), identical=identical,
        batched=one_batch, per_sample=dict(label=labels, predicted=predicted,
                        psnr_db=[None if math.isinf(p) else p for p in per_psnr], ssim=ssims),
    )


def model_label(meta: dict[str, Any]) -> str:
    """The model's name in titles: the report's `model_label`, else (reports from before it) "<name> Flux"."""
    return meta.get("model_label") or f"{meta.get('model_name', 'tiny')} Flux"


def _db(value: float | None) -> str:
    return "inf (bitwise equal)" if value is None else f"{value:.2f} dB"


# --- the report -------------------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class QualityReport:
    """The rows (reference first) and what was run; rendered as markdown, JSON and a plot."""

    rows: tuple[QualityRow, ...]
    meta: dict[str, Any]

    def row(self, name: str) -> QualityRow:
        for r in self.rows:
            if r.name == name:
                return r
        raise SpecError(f"QualityReport.row: no row {name!r}; rows: {[r.name for r in self.rows]}.")

    def to_dict(self) -> dict[str, Any]:
        return dict(meta=self.meta, rows=[r.to_dict() for r in self.rows])

    def markdown(self) -> str:
        """The results table: one line per configuration, reference first."""
        out = []
        for r in self.rows:
            if r.status != "ok":
                out.append([r.name, r.family, *["—"] * 9, f"{r.status}: {r.note}"])
                continue
            is_ref = r.kind == "reference"
            psnr_cell = "reference" if is_ref else ("inf (bitwise equal)" if r.psnr_db is None else f"{r.psnr_db:.2f}")
            out.append([
                r.name, r.family, r.block_calls, f"{r.block_speedup:.2f}x",
                "—" if r.flops_speedup is None else f"{r.flops_speedup:.2f}x", f"{r.wall_speedup:.2f}x",
                f"{'—' if r.cached_calls is None else r.cached_calls}/{r.transformer_calls}", psnr_cell,
                "—" if is_ref or r.psnr_min_db is None else f"{r.psnr_min_db:.2f}",
                "—" if is_ref else f"{r.ssim:.4f}", f"{r.recognised:.0%}", r.description,
            ])
        m = self.meta
        head = (f"Quality vs speed on hookkit's trained {model_label(m)} ({len(m['classes'])} classes x {len(m['seeds'])} "
                f"seeds, {m['steps']} steps, batch 1, {m['device']} {m['dtype']}"
                + (f", true CFG {m['cfg_scale']:g}" if m["cfg_scale"] > 1 else "") + "). PSNR of the pooled MSE over "
                "all samples; min = worst sample; cached calls = transformer calls that skipped block work; speed-up "
                "(FLOPs) = executed block FLOPs of the reference / of the row.\n\n")
        return head + table(["config", "method", "block calls", "speed-up (blocks)", "speed-up (FLOPs)", "speed-up (wall)",
                             "cached calls", "PSNR (dB)", "min PSNR", "SSIM", "recognised", "notes"], out)

    def plot(self, path: str | Path) -> Path:
        """Speed-up in block calls against PSNR and SSIM, one curve per method family (needs matplotlib)."""
        plt = pyplot("QualityReport.plot", ", or skip the plot (--no-plot)")
        rows = [r for r in self.rows if r.status == "ok" and r.kind != "reference"]
        finite = [r.psnr_db for r in rows if r.psnr_db is not None]
        cap = (max(finite) if finite else 40.0) + 5.0  # where bitwise-equal rows are drawn
        fig, (ax_psnr, ax_ssim) = plt.subplots(1, 2, figsize=(13, 5))
        families: dict[str, list[QualityRow]] = {}
        for r in rows:
            families.setdefault(r.family, []).append(r)
        for family, members in families.items():
            members = sorted(members, key=lambda r: r.block_speedup)
            xs = [r.block_speedup for r in members]
            psnrs = [cap if r.psnr_db is None else r.psnr_db for r in members]
            (line,) = ax_psnr.plot(xs, psnrs, marker="o", label=family)
            ax_ssim.plot(xs, [r.ssim for r in members], marker="o", color=line.get_color(), label=family)
            for r, x, y in zip(members, xs, psnrs):
                if r.x is not None:
                    ax_psnr.annotate(f"{r.x:g}" if isinstance(r.x, float) else str(r.x), (x, y), fontsize=7,
                                     textcoords="offset points", xytext=(3, 3))
        if any(r.psnr_db is None for r in rows):
            ax_psnr.axhline(cap, color="grey", linewidth=0.5, linestyle=":")
            ax_psnr.text(1.0, cap, " bitwise equal to the reference", fontsize=7, va="bottom", color="grey")
        ax_psnr.axhline(30.0, color="tab:red", linewidth=0.8, linestyle="--", label="30 dB")
        for ax, label in ((ax_psnr, "PSNR vs uncached (dB)"), (ax_ssim, "SSIM vs uncached")):
            ax.set_xlabel("speed-up in block calls (uncached / cached)")
            ax.set_ylabel(label)
            ax.grid(True, alpha=0.3)
        ax_psnr.legend(fontsize=7, loc="lower left")
        m = self.meta
        fig.suptitle(f"Caching on hookkit's trained {model_label(m)}: {len(m['classes'])} classes x {len(m['seeds'])} seeds, "
                     f"{m['steps']} steps (labels: threshold or mask)", fontsize=10)
        return save_png(fig, path)

    def write(self, out_dir: str | Path, plot: bool = True) -> dict[str, Path]:
        """quality.md, quality.json and (with `plot`) quality.png in `out_dir`; returns their paths."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = {"markdown": out / "quality.md", "json": out / "quality.json"}
        paths["markdown"].write_text(self.markdown() + "\n")
        paths["json"].write_text(json.dumps(self.to_dict(), indent=1, allow_nan=False, default=str) + "\n")
        if plot:
            paths["plot"] = self.plot(out / "quality.png")
        return paths


# --- command line -------------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hookkit bench --quality",
        description="Speed-up vs quality of caching methods on a hookkit trained model (--model; a stock FluxPipeline "
                    "or WanPipeline): "
                    "block calls, wall time, PSNR, SSIM and classifier recognition against the uncached reference.",
    )
    p.add_argument("--configs", default=None, help="comma-separated configuration names (default: the whole sweep; "
                   "--list shows them)")
    p.add_argument("--list", action="store_true", help="list the configurations of the default sweep and exit")
    p.add_argument("--classes", default=None, help="comma-separated class indices or names (default: all 10)")
    p.add_argument("--seeds", type=int, default=4, help="seeds 0..N-1 per class (default 4)")
    p.add_argument("--steps", type=int, default=28)
    p.add_argument("--model", default="tiny", help="hookkit.tools.trained's model: tiny (default), deep or video")
    p.add_argument("--cfg", type=float, default=1.0, help="true CFG scale against the null class (default 1: off)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when visible)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--weights", default=None, help="a model.safetensors other than the shipped one")
    p.add_argument("--classifier", default=None, help="a classifier.safetensors other than the shipped one")
    p.add_argument("--out", default=None, help="output folder (default: $OUT/quality or ./out/quality)")
    p.add_argument("--no-plot", action="store_true", help="skip quality.png (no matplotlib needed)")
    p.add_argument("--quick", action="store_true",
                   help="2 classes x 1 seed, hookkit F1B0 + TaylorSeer 1 at threshold 0.12 and FirstBlockCache "
                        "at 0.12 only: a fast check")
    return p


def quality_main(argv: Sequence[str] | None = None) -> int:
    """`hookkit bench --quality ...`: run the sweep, print the table, write quality.md/.json/.png. Exit code 0,
    or 2 with hookkit's message (not a traceback) when something is missing or misnamed."""
    argv = list(argv) if argv is not None else sys.argv[1:]
    args = _parser().parse_args(argv)
    configs = default_configs()
    if args.list:
        print(table(["config", "method", "notes"], [[c.name, c.family, c.description] for c in configs]))
        return 0
    try:
        classes: list[int | str] | None = None
        if args.classes:
            classes = [int(c) if c.strip().isdigit() else c.strip() for c in args.classes.split(",")]
        seeds: Sequence[int] = range(args.seeds)
        if args.quick:
            classes, seeds = classes or [0, 1], range(1)
            configs = [hookkit_config(hookkit.DBCache(fn_blocks=1, bn_blocks=0, threshold=0.12)), fbcache_config(0.12)]
        if args.configs:
            known = {c.name: c for c in configs}
            wanted = [n.strip() for n in args.configs.split(",") if n.strip()]
            unknown = [n for n in wanted if n not in known]
            if unknown:
                raise SpecError(f"--configs: unknown configuration {unknown[0]!r}; `--list` shows the known ones.")
            configs = [known[n] for n in wanted]
        device = str(resolve_device(args.device))
        dtype = DTYPES[args.dtype]
        if not args.no_plot:  # say so before the sweep, not after it
            pyplot("hookkit bench --quality (quality.png)", ", or add --no-plot")
        out = Path(args.out) if args.out else Path(os.environ.get("OUT", "out")) / "quality"
        check_folder(out, "--out" if args.out else "OUT (the default of --out: $OUT/quality)", str(out))
        report = run_quality(configs, classes=classes, seeds=seeds, steps=args.steps, device=device, dtype=dtype,
                             cfg_scale=args.cfg, weights=args.weights, classifier_weights=args.classifier,
                             model=args.model)
        print()
        print(report.markdown())
        paths = report.write(out, plot=False)
        if not args.no_plot:
            paths["plot"] = report.plot(out / "quality.png")
    except HookkitError as exc:
        print(f"hookkit bench --quality: error: {exc}", file=sys.stderr)
        return 2
    print("\nwrote " + ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(quality_main())
