"""Pareto fronts: hookkit's caching against every peer rule installed, at equal executed work.

Every row runs through `hookkit.tools.quality.run_quality` on a trained model (`--model`), so every method's work
is counted alike, in executed transformer-block FLOPs (`BlockCounter`); speed-up = the uncached reference's
FLOPs / the row's. Families: hookkit `Spec`s (plus any from a JSON file, `load_specs`), the uncached pipeline
at fewer steps, and each installed peer's main knob swept: diffusers' FirstBlockCache, MagCache (FLUX ratios,
and ratios calibrated on the model itself), TaylorSeerCache (default and lite), FasterCache,
PyramidAttentionBroadcast, SeaCache; cache-dit's DBCache with and without TaylorSeer, and its step masks.
A peer whose package does not import is a skipped row with the reason.

Seeds: 0-99 are the tuning range (hookkit's defaults were chosen on seeds 0-3; MagCache calibrates on
`CALIBRATION_SEEDS`); evaluation seeds start at `FIRST_EVALUATION_SEED` (100) and must not meet calibration seeds.

    report = front.run_front(model="tiny", steps=28)          # classes 0-9 x seeds 100, 101
    report.write("out/front-tiny-28")       # front.md, front.json, front-tiny-28.png, quality.md

or `python -m hookkit.tools.front --model tiny --steps 28 --out DIR`.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
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
from hookkit.core.summary import table
from hookkit.diagnostics.plot import pyplot, save_png
from hookkit.errors import HookkitError, SpecError, UnsupportedError
from hookkit.tools.bench import DTYPES, resolve_device
from hookkit.tools.quality import (
    PSNR_CAP_DB,
    model_label,
    QualityConfig,
    QualityReport,
    QualityRow,
    TrainedModel,
    cache_dit_config,
    diffusers_cache_setup,
    fbcache_config,
    hookkit_config,
    leave_stock,
    run_quality,
)

__all__ = [
    "CALIBRATION_SEEDS",
    "EVALUATION_SEEDS",
    "FIRST_EVALUATION_SEED",
    "FRONT_THRESHOLDS",
    "FrontReport",
    "MagCacheCalibration",
    "best_at",
    "fastercache_config",
    "fewer_steps_configs",
    "front_configs",
    "front_main",
    "load_specs",
    "magcache_config",
    "merge_fronts",
    "pab_config",
    "pareto_front",
    "run_front",
    "seacache_config",
    "taylorseer_config",
]

FIRST_EVALUATION_SEED = 100
#: default evaluation seeds (with classes 0-9): held out from every seed a default or a tuner was chosen on
EVALUATION_SEEDS: tuple[int, ...] = (100, 101)
#: seeds of MagCache's calibration runs (with classes 0-9), in the tuning range
CALIBRATION_SEEDS: tuple[int, ...] = (0,)
TARGETS: tuple[float, ...] = (1.5, 2.0, 3.0)
#: the PNG's PSNR axis ends here: rows that cache almost nothing sit near `PSNR_CAP_DB` and would squash the rest
Y_CUT_DB = 65.0
#: thresholds of the threshold-driven block caches (hookkit, FirstBlockCache, cache-dit)
FRONT_THRESHOLDS: tuple[float, ...] = (0.04, 0.08, 0.12, 0.16, 0.2, 0.24, 0.3, 0.4, 0.6)
#: MagCache: (threshold, most skipped steps in a row); past 0.24 its default limit of 3 decides alone, so the
#: sweep's top end lifts it
MAGCACHE_SWEEP: tuple[tuple[float, int], ...] = ((0.02, 3), (0.04, 3), (0.06, 3), (0.12, 3), (0.24, 3), (0.24, 6),
                                                 (0.5, 6))
TAYLORSEER_INTERVALS: tuple[int, ...] = (2, 3, 4, 5, 6, 8)
ATTENTION_SKIP_RANGES: tuple[int, ...] = (2, 3, 4, 6)
#: step counts of the "fewer steps" family; other schedules take the same shares of their steps
FEWER_STEPS: dict[int, tuple[int, ...]] = {28: (21, 18, 14, 11, 9), 14: (10, 7, 5)}
MASKS: tuple[str, ...] = ("slow", "medium", "fast", "ultra")


# --- peers and baselines --------------------------------------------------------------------------------------


def fewer_steps_configs(steps: int, counts: Sequence[int] | None = None) -> list[QualityConfig]:
    """The uncached pipeline at fewer steps (`FEWER_STEPS[steps]`, else 3/4, 2/3, 1/2, 2/5, 1/3 of `steps`), each
    compared with the full-step reference: the baseline every cache has to beat."""
    if counts is None:
        counts = FEWER_STEPS.get(steps) or sorted({max(1, round(steps * f)) for f in (3 / 4, 2 / 3, 1 / 2, 2 / 5, 1 / 3)}
                                                  - {steps}, reverse=True)
    return [QualityConfig(name=f"steps-{n}", family="fewer steps", steps=n, x=n,
                          description=f"uncached pipeline at {n} instead of {steps} steps") for n in counts]


class MagCacheCalibration:
    """Magnitude ratios recorded by diffusers' MagCache calibrate mode (`MagCacheConfig(calibrate=True)`: one
    uncached run per sample prints the ratios), averaged over `samples` (class, seed) at `steps` steps; measured
    on the first pipeline that asks (`ratios(pipe)`) and shared by every threshold of the sweep."""

    def __init__(self, source: TrainedModel, samples: Sequence[tuple[int, int]], steps: int) -> None:
        if not samples:
            raise SpecError("MagCacheCalibration.samples: expected at least one (class, seed), got none.")
        self.source, self.samples, self.steps = source, list(samples), steps
        self._ratios: list[float] | None = None

    def ratios(self, pipe: Any) -> list[float]:
        if self._ratios is None:
            self._ratios = self._calibrate(pipe)
        return self._ratios

    def _calibrate(self, pipe: Any) -> list[float]:
        from diffusers.hooks import MagCacheConfig

        restore = leave_stock(pipe.transformer)
        pipe.transformer.enable_cache(MagCacheConfig(calibrate=True, num_inference_steps=self.steps))
        runs: list[list[float]] = []
        try:
            for label, seed in self.samples:
                printed = io.StringIO()
                with contextlib.redirect_stdout(printed):
                    pipe(**self.source.call_kwargs(label, seed, steps=self.steps))
                runs += _printed_ratios(printed.getvalue())
        finally:
            pipe.transformer.disable_cache()
            restore()
        if not runs or any(len(r) != self.steps for r in runs):
            raise UnsupportedError(
                f"MagCacheCalibration: expected diffusers' MagCache calibrate mode to print {self.steps} ratios per "
                f"run, got {[len(r) for r in runs]}; this diffusers may print them differently.")
        return [sum(r[i] for r in runs) / len(runs) for i in range(self.steps)]


def _printed_ratios(text: str) -> list[list[float]]:
    """Every ratio list diffusers' MagCache printed after 'Calibration Complete'."""
    lines = text.splitlines()
    found = []
    for i, line in enumerate(lines):
        if "Calibration Complete" in line:
            following = next((l for l in lines[i + 1:] if l.strip()), "")
            found.append([float(v) for v in ast.literal_eval(following.strip())])
    return found


def magcache_config(threshold: float, steps: int, calibration: MagCacheCalibration | None = None,
                    max_skip_steps: int = 3) -> QualityConfig:
    """diffusers' MagCache at `threshold`, at most `max_skip_steps` skipped steps in a row (diffusers' default 3;
    the first 20% of steps kept, as diffusers defaults), with diffusers' shipped FLUX.1 ratios (`FLUX_MAG_RATIOS`,
    interpolated to `steps`) or, with `calibration`, ratios calibrated on the model itself."""

    def make(pipe: Any) -> Any:
        from diffusers.hooks import MagCacheConfig
        from diffusers.hooks.mag_cache import FLUX_MAG_RATIOS

        ratios = FLUX_MAG_RATIOS if calibration is None else torch.tensor(calibration.ratios(pipe))
        return MagCacheConfig(threshold=threshold, num_inference_steps=steps, mag_ratios=ratios,
                              max_skip_steps=max_skip_steps)

    which = "FLUX ratios" if calibration is None else "calibrated"
    skips = "" if max_skip_steps == 3 else f"-K{max_skip_steps}"
    return QualityConfig(
        name=f"magcache-{'flux' if calibration is None else 'calibrated'}-R{threshold:g}{skips}",
        family=f"diffusers MagCache ({which})", setup=diffusers_cache_setup(make), requires="diffusers.hooks.mag_cache",
        batched=True,
        x=threshold if not skips else f"{threshold:g} K{max_skip_steps}",
        description=f"diffusers MagCache, {which}, threshold {threshold:g}, at most {max_skip_steps} skips in a row"
        + ("" if calibration is None else f" (calibrated on {len(calibration.samples)} samples)"),
    )


#: Wan's attention modules (`blocks.N.attn1`, `attn2`): diffusers' TaylorSeerCache default patterns must match a
#: whole name and end in "attn", so by default they hook none of them and the cache computes every step
WAN_ATTENTION_IDENTIFIERS: tuple[str, ...] = (r"^blocks\.\d+\.attn[12]$",)


def taylorseer_config(cache_interval: int, lite: bool = False,
                      identifiers: Sequence[str] | None = None) -> QualityConfig:
    """diffusers' TaylorSeerCache with `cache_interval` (3 warm-up steps, order 1, as diffusers defaults). Default
    mode predicts every block's attention, lite mode every whole block plus the output projection; `identifiers`
    names the attention modules where diffusers' default patterns miss them (`cache_identifiers`; Wan:
    `WAN_ATTENTION_IDENTIFIERS`). The Taylor factors are kept in the model's dtype (diffusers' default bfloat16
    would add rounding a float32 run lacks)."""

    def make(pipe: Any) -> Any:
        from diffusers.hooks import TaylorSeerCacheConfig

        named = {} if identifiers is None else {"cache_identifiers": list(identifiers)}
        return TaylorSeerCacheConfig(cache_interval=cache_interval, use_lite_mode=lite,
                                     taylor_factors_dtype=pipe.transformer.dtype, **named)

    mode = " lite" if lite else ""
    named = "" if identifiers is None else " (Wan attention names)"
    return QualityConfig(
        name=f"taylorseer{'-lite' if lite else ''}{'-named' if identifiers else ''}-N{cache_interval}",
        family=f"diffusers TaylorSeerCache{mode}{named}", setup=diffusers_cache_setup(make),
        requires="diffusers.hooks.taylorseer_cache", x=cache_interval, batched=True,
        description=f"diffusers TaylorSeerCache{mode}, cache_interval {cache_interval}"
        + ("" if identifiers is None else f", cache_identifiers {list(identifiers)}"),
    )


def fastercache_config(skip_range: int) -> QualityConfig:
    """diffusers' FasterCache: each block's attention is computed every `skip_range`-th step within its timestep
    range (diffusers' default (-1, 681)) and extrapolated in between; `is_guidance_distilled=True`, as FluxPipeline
    runs no batched CFG branch to skip; the timestep comes from `pipe.current_timestep`."""

    def make(pipe: Any) -> Any:
        from diffusers.hooks import FasterCacheConfig

        return FasterCacheConfig(spatial_attention_block_skip_range=skip_range, is_guidance_distilled=True,
                                 current_timestep_callback=lambda: pipe.current_timestep,
                                 attention_weight_callback=lambda module: 0.5, tensor_format="BCHW")

    return QualityConfig(name=f"fastercache-N{skip_range}", family="diffusers FasterCache",
                         setup=diffusers_cache_setup(make), requires="diffusers.hooks.faster_cache", x=skip_range,
                         batched=True,
                         description=f"diffusers FasterCache, attention every {skip_range} steps in t < 681")


def pab_config(skip_range: int) -> QualityConfig:
    """diffusers' PyramidAttentionBroadcast: each block's attention output is reused for `skip_range` - 1 steps
    within its timestep range (diffusers' default (100, 800)); the timestep comes from `pipe.current_timestep`."""

    def make(pipe: Any) -> Any:
        from diffusers.hooks import PyramidAttentionBroadcastConfig

        return PyramidAttentionBroadcastConfig(spatial_attention_block_skip_range=skip_range,
                                               current_timestep_callback=lambda: pipe.current_timestep)

    return QualityConfig(name=f"pab-N{skip_range}", family="diffusers PyramidAttentionBroadcast",
                         setup=diffusers_cache_setup(make), requires="diffusers.hooks.pyramid_attention_broadcast",
                         x=skip_range, batched=True,
                         description=f"diffusers PAB, attention every {skip_range} steps in 100 < t < 800")


#: SeaCache on the video model: (threshold, most cached steps in a row); diffusers' default is (0.25, 2)
SEACACHE_SWEEP: tuple[tuple[float, int], ...] = ((0.1, 2), (0.25, 2), (0.5, 2), (0.5, 4), (1.0, 4), (2.0, 6))


def seacache_config(threshold: float = 0.25, max_cached: int = 2, video: bool = False) -> QualityConfig:
    """diffusers' SeaCache at `threshold`, at most `max_cached` cached steps in a row. It reads the step index,
    sigma and step count WanPipeline passes to `cache_context` and has a built-in Wan text-to-video adapter, so it
    runs on the `video` model; on FluxPipeline (neither) it is listed with the reason and skipped."""

    def make(pipe: Any) -> Any:
        from diffusers.hooks import SeaCacheConfig

        return SeaCacheConfig(threshold=threshold, max_consecutive_cached=max_cached)

    default = (threshold, max_cached) == (0.25, 2)
    return QualityConfig(
        name="seacache" if default else f"seacache-R{threshold:g}-K{max_cached}", family="diffusers SeaCache",
        setup=diffusers_cache_setup(make), requires="diffusers.hooks.sea_cache", x=f"{threshold:g} K{max_cached}",
        unsupported=None if video else (
            "FluxPipeline enters cache_context without the step index, sigma and step count SeaCache needs, "
            "and SeaCache has no image adapter for Flux: it runs fail-open (computes every step)"),
        description=f"diffusers SeaCache, threshold {threshold:g}, at most {max_cached} cached steps in a row",
    )


def hookkit_configs(thresholds: Sequence[float] = FRONT_THRESHOLDS) -> list[QualityConfig]:
    """hookkit's DBCache F1B0 with and without TaylorSeer (order 1, the default) over `thresholds`, and its static
    masks with and without TaylorSeer; everything else at its default (warm-up scaled to the step count)."""
    out = []
    for order in (1, 0):
        out += [hookkit_config(hookkit.DBCache(threshold=t, taylorseer_order=order)) for t in thresholds]
    for order in (0, 1):
        out += [hookkit_config(hookkit.DBCache(steps_mask=m, mask_policy="static", taylorseer_order=order))
                for m in MASKS]
    return out


#: speed-ups the "schedule" rule is planned for in the front (executed block work)
SCHEDULE_SPEEDUPS: tuple[float, ...] = (1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0)
#: (threshold, K) of the "magnitude" rule in the front: MagCache's own sweep
MAGNITUDE_SWEEP: tuple[tuple[float, int], ...] = ((0.03, 3), (0.06, 3), (0.12, 3), (0.24, 3), (0.5, 3), (0.5, 6))


def hookkit_rule_configs(model: str, steps: int) -> list[QualityConfig]:
    """hookkit's calibrated rules on the trained model's shipped calibration (`trained.calibration`, made on seeds
    50-59, disjoint from the evaluation seeds): "schedule" at `SCHEDULE_SPEEDUPS` with TaylorSeer 0, 1, 2, and
    "magnitude" (MagCache's rule on hookkit's own ratios) with TaylorSeer 0 and 1; the schedules of TaylorSeer 1 and 2
    also with `extrapolate="output"`. None without a shipped calibration at `steps`."""
    from hookkit.tools import trained

    try:
        calibration = trained.calibration(model, steps)
    except SpecError:
        return []
    out = []
    for order in (0, 1, 2):
        for s in SCHEDULE_SPEEDUPS:
            if s < steps:
                cache = hookkit.DBCache(rule="schedule", calibration=calibration, speedup=s, taylorseer_order=order,
                                        extrapolate="residual")
                out.append(hookkit_config(cache, family=f"hookkit schedule TaylorSeer-{order}",
                                          name=f"hookkit-schedule-{s:g}x-TS{order}", x=s))
                if order:  # the same plan, the transformer's output extrapolated instead of the blocks' residual
                    cache = attrs.evolve(cache, extrapolate="output")
                    out.append(hookkit_config(cache, family=f"hookkit schedule output TaylorSeer-{order}",
                                              name=f"hookkit-schedule-{s:g}x-TS{order}-output", x=s))
    for order in (0, 1):
        for t, k in MAGNITUDE_SWEEP:
            cache = hookkit.DBCache(rule="magnitude", calibration=calibration, threshold=t,
                                    max_continuous_cached_steps=k, taylorseer_order=order)
            out.append(hookkit_config(cache, family=f"hookkit magnitude TaylorSeer-{order}",
                                      name=f"hookkit-magnitude-{t:g}-K{k}-TS{order}", x=t))
    return out


def default_rule_configs(steps: int) -> list[QualityConfig]:
    """`hookkit.DBCache()` as it comes (the calibration-free schedule at 2x), and the same rule at the other
    `SCHEDULE_SPEEDUPS`, each reusing the blocks' residual and the transformer's output (`DBCache.extrapolate`; the
    default takes the output where the model takes no ControlNet residuals or VACE hints): what a user gets without
    calibrating or tuning."""
    out = [hookkit_config(hookkit.DBCache(), family="hookkit DBCache()", name="hookkit-DBCache()", x=2.0)]
    for s in SCHEDULE_SPEEDUPS:
        if s < steps:
            out.append(hookkit_config(hookkit.DBCache(speedup=s, extrapolate="residual"),
                                      family="hookkit schedule no calibration TaylorSeer-2",
                                      name=f"hookkit-schedule-{s:g}x-no-calibration", x=s))
            out.append(hookkit_config(hookkit.DBCache(speedup=s, extrapolate="output"),
                                      family="hookkit schedule no calibration output TaylorSeer-2",
                                      name=f"hookkit-schedule-{s:g}x-no-calibration-output", x=s))
    return out


def cache_dit_configs(steps: int, thresholds: Sequence[float] = FRONT_THRESHOLDS) -> list[QualityConfig]:
    """cache-dit's DBCache F1B0 with and without its TaylorSeer calibrator (order 1) over `thresholds`, and its
    four static step masks for `steps`; warm-up as hookkit's default at `steps` (cache-dit's 8 at 28)."""
    from hookkit.techniques.cache.spec import auto_warmup_steps

    warmup = auto_warmup_steps(steps)
    out = []
    for order in (0, 1):
        out += [cache_dit_config(t, warmup_steps=warmup, taylorseer_order=order) for t in thresholds]
    out += [cache_dit_config(0.08, warmup_steps=warmup, steps_mask=m, steps=steps) for m in MASKS]
    return out


def load_specs(path: str | Path) -> list[QualityConfig]:
    """Extra hookkit rows from a JSON file: a list of {"name", "spec": Spec.to_dict(), optional "family", "x",
    "description"}, or an object {name: Spec.to_dict()}. New caching rules are compared without code changes."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise SpecError(f"--specs: expected a readable JSON file of hookkit Specs, got {str(p)!r} ({exc}).") from exc
    if isinstance(data, dict):
        data = [{"name": name, "spec": spec} for name, spec in data.items()]
    if not isinstance(data, list):
        raise SpecError(f"--specs {p}: expected a list of {{'name', 'spec'}} objects or an object name -> spec, "
                        f"got {type(data).__name__}.")
    out = []
    for i, entry in enumerate(data):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not isinstance(entry.get("spec"), dict):
            raise SpecError(f"--specs {p}[{i}]: expected {{'name': str, 'spec': Spec.to_dict()}}, got {entry!r}.")
        unknown = sorted(set(entry) - {"name", "spec", "family", "x", "description"})
        if unknown:
            raise SpecError(f"--specs {p}[{i}]: unknown key {unknown[0]!r}; expected name, spec, family, x, description.")
        out.append(QualityConfig(name=entry["name"], family=entry.get("family", "hookkit extra"),
                                 spec=hookkit.Spec.from_dict(entry["spec"]), x=entry.get("x"),
                                 description=entry.get("description", f"hookkit Spec from {p.name}")))
    return out


def front_configs(steps: int, source: TrainedModel, calibration: Sequence[tuple[int, int]],
                  extra: Iterable[QualityConfig] = ()) -> list[QualityConfig]:
    """Every family's sweep for a run at `steps` steps: hookkit, fewer steps, diffusers' peers, cache-dit's, then
    `extra`. MagCache calibrates on the `calibration` (class, seed) samples of `source`; SeaCache is swept on the
    video model (`SEACACHE_SWEEP`) and listed as skipped on the image models."""
    from hookkit.tools import trained

    calibrated = MagCacheCalibration(source, calibration, steps)
    video = trained.is_video(source.name)
    return [
        *hookkit_configs(),
        *hookkit_rule_configs(source.name, steps),
        *default_rule_configs(steps),
        *fewer_steps_configs(steps),
        *[fbcache_config(t) for t in FRONT_THRESHOLDS],
        *[magcache_config(t, steps, max_skip_steps=k) for t, k in MAGCACHE_SWEEP],
        *[magcache_config(t, steps, calibrated, max_skip_steps=k) for t, k in MAGCACHE_SWEEP],
        *[taylorseer_config(n) for n in TAYLORSEER_INTERVALS],
        *[taylorseer_config(n, lite=True) for n in TAYLORSEER_INTERVALS],
        *([taylorseer_config(n, identifiers=WAN_ATTENTION_IDENTIFIERS) for n in TAYLORSEER_INTERVALS] if video else []),
        *[fastercache_config(n) for n in ATTENTION_SKIP_RANGES],
        *[pab_config(n) for n in ATTENTION_SKIP_RANGES],
        *([seacache_config(t, k, video=True) for t, k in SEACACHE_SWEEP] if video else [seacache_config()]),
        *cache_dit_configs(steps),
        *extra,
    ]


# --- the front ------------------------------------------------------------------------------------------------


def _psnr(row: QualityRow) -> float:
    return PSNR_CAP_DB if row.psnr_mean_db is None else row.psnr_mean_db


def _min_psnr(row: QualityRow) -> float:
    return PSNR_CAP_DB if row.psnr_min_db is None else min(row.psnr_min_db, PSNR_CAP_DB)


def pareto_front(rows: Iterable[QualityRow]) -> list[QualityRow]:
    """The rows no other row beats on both FLOP speed-up and mean PSNR (higher is better on both), by rising
    speed-up. Rows that did not run or have no FLOP count are left out; of equal points the first is kept."""
    ok = [r for r in rows if r.status == "ok" and r.flops_speedup is not None and r.kind != "reference"]
    ranked = sorted(ok, key=lambda r: (-r.flops_speedup, -_psnr(r)))  # stable: the first of equal points leads
    front, best = [], -math.inf
    for r in ranked:
        if _psnr(r) > best:
            front.append(r)
            best = _psnr(r)
    return front[::-1]


def best_at(front: Sequence[QualityRow], target: float) -> QualityRow | None:
    """The front's row with the highest mean PSNR among those at a FLOP speed-up >= `target`, or None."""
    reached = [r for r in front if r.flops_speedup is not None and r.flops_speedup >= target]
    return max(reached, key=_psnr, default=None)


@attrs.frozen(kw_only=True)
class FrontReport:
    """Every row of a run (`quality`), each family's Pareto front and the table at `targets` speed-ups."""

    quality: QualityReport
    targets: tuple[float, ...] = TARGETS

    @property
    def families(self) -> list[str]:
        """Method families in the order their first row came."""
        return list(dict.fromkeys(r.family for r in self.quality.rows if r.kind != "reference"))

    def fronts(self) -> dict[str, list[QualityRow]]:
        return {f: pareto_front(r for r in self.quality.rows if r.family == f) for f in self.families}

    def table_rows(self) -> dict[str, dict[str, Any]]:
        """Per family: for each target, the best row at >= that speed-up (None if unreached), the highest
        speed-up reached, and why it has no row at all (skipped or failed)."""
        out: dict[str, dict[str, Any]] = {}
        for family, front in self.fronts().items():
            members = [r for r in self.quality.rows if r.family == family]
            entry: dict[str, Any] = {"max_speedup": max((r.flops_speedup for r in front), default=None)}
            for target in self.targets:
                best = best_at(front, target)
                entry[f"{target:g}"] = None if best is None else dict(
                    name=best.name, x=best.x, flops_speedup=best.flops_speedup, psnr_mean_db=_psnr(best),
                    psnr_min_db=_min_psnr(best))
            if not front:
                notes = sorted({f"{r.status}: {r.note}" for r in members if r.status != "ok"})
                entry["note"] = "; ".join(notes) or "no row with a FLOP count"
            out[family] = entry
        return out

    def markdown(self) -> str:
        m = self.quality.meta
        head = (f"Best mean PSNR (dB) at >= each speed-up in executed transformer-block FLOPs, per method family: "
                f"trained {model_label(m)}, {m['steps']} steps"
                + (f" with CFG {m['cfg_scale']:g}" if m.get("cfg_scale", 1.0) > 1 else "")
                + f", {len(m['classes'])} classes x seeds "
                f"{m['seeds']}, {m['device']} {m['dtype']}. Cell: mean PSNR (worst sample) @ speed-up [knob]; "
                f"a bitwise-equal sample counts {PSNR_CAP_DB:g} dB.\n\n")
        lines = []
        for family, entry in self.table_rows().items():
            cells = []
            for target in self.targets:
                best = entry[f"{target:g}"]
                cells.append("—" if best is None else
                             f"{best['psnr_mean_db']:.2f} ({best['psnr_min_db']:.2f}) @ {best['flops_speedup']:.2f}x"
                             + ("" if best["x"] is None else f" [{best['x']}]"))
            top = entry["max_speedup"]
            lines.append([family, *cells, "—" if top is None else f"{top:.2f}x", entry.get("note", "")])
        return head + table(["family", *[f">= {t:g}x" for t in self.targets], "max speed-up", "notes"], lines)

    def to_dict(self) -> dict[str, Any]:
        return dict(meta=dict(self.quality.meta, targets=list(self.targets)),
                    fronts={f: [r.name for r in front] for f, front in self.fronts().items()},
                    table=self.table_rows(), rows=[r.to_dict() for r in self.quality.rows])

    def plot(self, path: str | Path) -> Path:
        """Mean PSNR against FLOP speed-up: each family's rows as dots, its front as a line (needs matplotlib)."""
        plt = pyplot("FrontReport.plot", ", or skip the plot (--no-plot)")
        fig, ax = plt.subplots(figsize=(12, 6.5))
        colours = plt.get_cmap("tab20")
        for i, (family, front) in enumerate(self.fronts().items()):
            if not front:
                continue
            members = [r for r in self.quality.rows if r.family == family and r.status == "ok" and r.flops_speedup]
            marker = "o" if family.startswith("hookkit") else "D" if family == "fewer steps" else \
                "^" if family.startswith("cache-dit") else "s"
            colour = "black" if family == "fewer steps" else colours(i % 20)
            ax.scatter([r.flops_speedup for r in members], [_psnr(r) for r in members], s=12, alpha=0.35,
                       color=colour, marker=marker)
            ax.plot([r.flops_speedup for r in front], [_psnr(r) for r in front], marker=marker, color=colour,
                    linewidth=2.2 if family.startswith("hookkit") or family == "fewer steps" else 1.2, label=family)
        for target in self.targets:
            ax.axvline(target, color="grey", linewidth=0.6, linestyle=":")
        ax.set_xscale("log", base=2)
        ticks = [t for t in (1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8) if t <= max(ax.get_xlim()[1], 1)]
        ax.set_xticks(ticks, [f"{t:g}x" for t in ticks])
        ax.minorticks_off()
        top = min(ax.get_ylim()[1], Y_CUT_DB)
        ax.set_ylim(top=top)
        ax.text(0.01, 0.99, f"axis cut at {top:g} dB (rows near 1x reach {PSNR_CAP_DB:g} dB)", transform=ax.transAxes,
                fontsize=7, va="top", color="grey")
        ax.set_xlabel("speed-up in executed transformer-block FLOPs (uncached / method)")
        ax.set_ylabel(f"mean PSNR vs uncached {self.quality.meta['steps']} steps (dB)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
        m = self.quality.meta
        ax.set_title(f"Pareto fronts on the trained {model_label(m)}, {m['steps']} steps, "
                     f"{len(m['classes'])} classes x seeds {m['seeds']}", fontsize=10)
        return save_png(fig, path)

    def write(self, out_dir: str | Path, plot: bool = True) -> dict[str, Path]:
        """front.md, front.json (every row), quality.md (every row's table) and front-MODEL-STEPS.png."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = {"markdown": out / "front.md", "json": out / "front.json", "rows": out / "quality.md"}
        paths["markdown"].write_text(self.markdown() + "\n")
        paths["json"].write_text(json.dumps(self.to_dict(), indent=1, allow_nan=False, default=str) + "\n")
        paths["rows"].write_text(self.quality.markdown() + "\n")
        if plot:
            m = self.quality.meta
            paths["plot"] = self.plot(out / f"front-{m['model_name']}-{m['steps']}.png")
        return paths


def run_front(model: str = "tiny", steps: int = 28, classes: Iterable[int | str] | None = None,
              seeds: Iterable[int] = EVALUATION_SEEDS, calibration_seeds: Iterable[int] = CALIBRATION_SEEDS,
              configs: Iterable[QualityConfig] | None = None, extra: Iterable[QualityConfig] = (),
              device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, weights: str | Path | None = None,
              classifier_weights: str | Path | None = None, log: Callable[[str], None] | None = print,
              cfg_scale: float = 1.0) -> FrontReport:
    """Run every family's sweep (`front_configs`, or `configs`) and the fronts over classes x `seeds`; `cfg_scale`
    > 1 guides every call against the null class (two transformer calls per step, each branch cached on its own).

    Evaluation seeds must be >= `FIRST_EVALUATION_SEED` and disjoint from `calibration_seeds`: a number measured
    on the seeds a default, tuner or calibration was chosen on would flatter it. MagCache calibrates on
    classes x `calibration_seeds`.
    """
    from hookkit.tools import trained

    seed_list, calibration_list = [int(s) for s in seeds], [int(s) for s in calibration_seeds]
    tuned = [s for s in seed_list if s < FIRST_EVALUATION_SEED]
    if tuned:
        raise SpecError(f"run_front.seeds: expected evaluation seeds >= {FIRST_EVALUATION_SEED} (0-{FIRST_EVALUATION_SEED - 1} "
                        f"are where defaults and tuners were chosen), got {tuned}. Use e.g. seeds 100, 101.")
    shared = sorted(set(seed_list) & set(calibration_list))
    if shared:
        raise SpecError(f"run_front.calibration_seeds: expected seeds disjoint from the evaluation seeds, got {shared} "
                        "in both. Calibrate on seeds below 100.")
    labels = [trained.class_index(c) for c in (classes if classes is not None else range(trained.NUM_CLASSES))]
    source = TrainedModel(name=model, weights=weights, device=torch.device(device), dtype=dtype, cfg_scale=cfg_scale)
    source.check()
    if configs is None:
        configs = front_configs(steps, source, [(l, s) for l in labels for s in calibration_list], extra)
    else:
        configs = [*configs, *extra]
    report = run_quality(configs, classes=labels, seeds=seed_list, steps=steps, device=device, dtype=dtype,
                         weights=weights, classifier_weights=classifier_weights, log=log, model=model,
                         cfg_scale=cfg_scale)
    return FrontReport(quality=attrs.evolve(report, meta=dict(report.meta, calibration_seeds=calibration_list)))


def merge_fronts(paths: Sequence[str | Path]) -> FrontReport:
    """One report from the `front.json` files of runs that split one front's families among processes (each run
    with its own `--only` / `--skip`): the same model, steps, classes, seeds and device, each family from one run.
    The reference row is the first run's (every run makes the same one)."""
    if not paths:
        raise SpecError("merge_fronts.paths: expected at least one front.json (or its folder), got none.")
    keys = ("model_name", "steps", "cfg_scale", "classes", "seeds", "device", "dtype")
    meta: dict[str, Any] | None = None
    rows: list[QualityRow] = []
    seen: dict[str, str] = {}
    for item in paths:
        path = Path(item) / "front.json" if Path(item).is_dir() else Path(item)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise SpecError(f"merge_fronts: expected a readable front.json, got {str(path)!r} ({exc}).") from None
        these = [QualityRow(**r) for r in data["rows"]]
        if meta is None:
            meta = {k: v for k, v in data["meta"].items() if k != "targets"}
            rows.append(these[0])
        else:
            differ = [k for k in keys if data["meta"].get(k) != meta.get(k)]
            if differ:
                raise SpecError(f"merge_fronts: {path} ran with other {differ[0]} ({data['meta'].get(differ[0])!r}) "
                                f"than the first ({meta.get(differ[0])!r}); merge runs of one front only.")
        for row in these[1:]:
            if row.family in seen and seen[row.family] != str(path):
                raise SpecError(f"merge_fronts: family {row.family!r} is in {seen[row.family]} and {path}; split "
                                "runs by family (--only / --skip) so that each family comes from one run.")
            seen[row.family] = str(path)
            rows.append(row)
    assert meta is not None
    return FrontReport(quality=QualityReport(rows=tuple(rows), meta=meta))


# --- command line -------------------------------------------------------------------------------------------------


def _ints(text: str, option: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise SpecError(f"{option}: expected comma-separated integers, got {text!r}.") from exc


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hookkit bench --quality --front",
        description="Pareto fronts of hookkit's caching and every installed peer (diffusers, cache-dit, fewer steps) "
                    "on a trained model, at equal executed transformer-block FLOPs.",
    )
    p.add_argument("--model", default="tiny", help="hookkit.tools.trained's model: tiny (default), deep or video (a "
                                                   "Wan video model)")
    p.add_argument("--steps", type=int, default=28)
    p.add_argument("--cfg-scale", type=float, default=1.0,
                   help="> 1: guide every call against the null class (FluxPipeline's true CFG, WanPipeline's "
                        "guidance_scale; default 1, no guidance)")
    p.add_argument("--classes", default=None, help="comma-separated class indices or names (default: all 10)")
    p.add_argument("--seeds", default=",".join(map(str, EVALUATION_SEEDS)),
                   help=f"evaluation seeds, each >= {FIRST_EVALUATION_SEED} (default: 100,101)")
    p.add_argument("--calibration-seeds", default=",".join(map(str, CALIBRATION_SEEDS)),
                   help="seeds MagCache calibrates on, disjoint from --seeds (default: 0)")
    p.add_argument("--specs", default=None, help="JSON file of extra hookkit Specs (hookkit.tools.front.load_specs)")
    p.add_argument("--only", default=None, help="comma-separated substrings: run only families containing one")
    p.add_argument("--skip", default=None, help="comma-separated substrings: skip families containing one")
    p.add_argument("--merge", nargs="+", default=None, metavar="FRONT_JSON",
                   help="merge the front.json files (or folders) of runs that split the families, write, and exit")
    p.add_argument("--list", action="store_true", help="list the configurations and exit")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when visible)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--weights", default=None, help="a model.safetensors other than the shipped one")
    p.add_argument("--classifier", default=None, help="a classifier.safetensors other than the shipped one")
    p.add_argument("--out", default=None, help="output folder (default: $OUT/front-MODEL-STEPS or ./out/...)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG (no matplotlib needed)")
    return p


def front_main(argv: Sequence[str] | None = None) -> int:
    """`python -m hookkit.tools.front ...` (or `hookkit bench --quality --front ...`): run the fronts (or `--merge`
    split runs), print the table, write front.md/.json/.png and quality.md. Exit code 0, or 2 with hookkit's message
    when something is missing or misnamed."""
    args = _parser().parse_args(list(argv) if argv is not None else None)
    os.environ.setdefault("CACHE_DIT_LOG_LEVEL", "error")
    try:
        if args.merge:
            report = merge_fronts(args.merge)
            return _print_and_write(report, args.out, not args.no_plot)
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.set_verbosity_error()  # FasterCache warns at every enable
        from hookkit.tools import trained

        classes = None
        if args.classes:
            classes = [int(c) if c.strip().isdigit() else c.strip() for c in args.classes.split(",")]
        labels = [trained.class_index(c) for c in (classes if classes is not None else range(trained.NUM_CLASSES))]
        calibration = _ints(args.calibration_seeds, "--calibration-seeds")
        device = resolve_device(args.device)
        source = TrainedModel(name=args.model, weights=args.weights, device=torch.device(device),
                              dtype=DTYPES[args.dtype], cfg_scale=args.cfg_scale)
        extra = load_specs(args.specs) if args.specs else []
        configs = front_configs(args.steps, source, [(l, s) for l in labels for s in calibration], extra)
        if args.only:
            wanted = [w.strip() for w in args.only.split(",") if w.strip()]
            configs = [c for c in configs if any(w in c.family for w in wanted)]
        if args.skip:
            unwanted = [w.strip() for w in args.skip.split(",") if w.strip()]
            configs = [c for c in configs if not any(w in c.family for w in unwanted)]
        if args.list:
            print(table(["config", "family", "notes"], [[c.name, c.family, c.description] for c in configs]))
            return 0
        if not args.no_plot:
            pyplot("hookkit bench --quality --front (the PNG)", ", or add --no-plot")
        report = run_front(model=args.model, steps=args.steps, classes=labels, seeds=_ints(args.seeds, "--seeds"),
                           calibration_seeds=calibration, configs=configs, device=str(device),
                           dtype=DTYPES[args.dtype], weights=args.weights, classifier_weights=args.classifier,
                           cfg_scale=args.cfg_scale)
        print()
        return _print_and_write(report, args.out, not args.no_plot)
    except HookkitError as exc:
        print(f"hookkit bench --quality --front: error: {exc}", file=sys.stderr)
        return 2


def _print_and_write(report: FrontReport, out: str | None, plot: bool) -> int:
    """Print the table and write the report to `out` (default $OUT/front-MODEL-STEPS or ./out/...)."""
    m = report.quality.meta
    folder = Path(out) if out else Path(os.environ.get("OUT", "out")) / f"front-{m['model_name']}-{m['steps']}"
    print(report.markdown())
    paths = report.write(folder, plot=plot)
    print("\nwrote " + ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(front_main())
