"""Calibrate DBCache's rules on the user's own model and calls, and tune a caching Spec for a speed or quality target.

    cal = hookkit.calibrate(pipe, calls)                  # one uncached run: ratios and gram matrix
    spec = hookkit.tune(pipe, calls, speedup=2.0)         # the best mean PSNR at >= 2x executed block work
    spec = hookkit.tune(pipe, calls, min_psnr=40.0)       # the fastest Spec whose every image stays >= 40 dB
    image = hookkit.enable(pipe, spec) and pipe(**calls[0])

`calls` is a list of keyword dicts for `pipe(**kw)`: the user's own calibration prompts and seeds. Each must be
reproducible (a `generator` or `latents`): every run restores the generators' states, so a candidate and the
reference see the same noise. Speed-up is counted as hookkit's summary counts it: uncached block calls over block
calls run. PSNR is of the output images in [0, 1] against the uncached ones.

Tuning on some seeds and judging on others is the caller's business (the quality harness and the tests judge the
tuned Spec on seeds it did not see); `tune` picks among its candidates on the calls it is given.
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
import torch

from hookkit.core.handle import Handle, handle_of
from hookkit.features import enable
from hookkit.spec import Spec
from hookkit.techniques.cache.spec import DBCache
from hookkit.core.summary import table
from hookkit.errors import SpecError
from hookkit.techniques.cache.calibration import GENERIC_SPACING, CacheCalibration
from hookkit.techniques.cache.hooks import _BlockIO
from hookkit.core.plan import flat_blocks

__all__ = ["TuneResult", "TuneRow", "calibrate", "candidates", "search", "tune"]


# --- calls ----------------------------------------------------------------------------------------------------


def _check_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, (list, tuple)) or not calls or not all(isinstance(c, dict) for c in calls):
        raise SpecError(f"{where}.calls: expected a non-empty list of keyword dicts for pipe(**kw), got "
                        f"{type(calls).__name__ if not isinstance(calls, (list, tuple)) else calls!r:.80}. E.g. "
                        "[dict(prompt=..., num_inference_steps=28, generator=torch.Generator().manual_seed(0))].")
    for i, call in enumerate(calls):
        if not _generators(call) and call.get("latents") is None:
            raise SpecError(f"{where}.calls[{i}]: expected a `generator` (or `latents`) so that every run of the call "
                            "draws the same noise, got neither. Add generator=torch.Generator().manual_seed(seed).")
    steps = {c.get("num_inference_steps") for c in calls}
    if len(steps) > 1:
        raise SpecError(f"{where}.calls: expected one num_inference_steps for all calls (a calibration and a tuned "
                        f"schedule are per step count), got {sorted(map(str, steps))}. Tune once per step count.")
    return list(calls)


def _generators(value: Any) -> list[torch.Generator]:
    if isinstance(value, torch.Generator):
        return [value]
    if isinstance(value, dict):
        return [g for v in value.values() for g in _generators(v)]
    if isinstance(value, (list, tuple)):
        return [g for v in value for g in _generators(v)]
    return []


class _Replay:
    """Runs each call as if for the first time: the generators' states are restored before every run."""

    def __init__(self, pipe: Any, calls: list[dict[str, Any]]) -> None:
        self.pipe = pipe
        self.calls = calls
        self.states = [[(g, g.get_state()) for g in _generators(c)] for c in calls]
        params = inspect.signature(type(pipe).__call__).parameters
        self.output_type = "output_type" in params

    def images(self, index: int) -> torch.Tensor:
        """The call's images as float32 (B, C, H, W) in [0, 1] on the CPU."""
        for generator, state in self.states[index]:
            generator.set_state(state)
        kwargs = dict(self.calls[index])
        if self.output_type:
            kwargs["output_type"] = "pt"
        with torch.no_grad():
            out = self.pipe(**kwargs)
        images = getattr(out, "images", None)
        if images is None:
            images = getattr(out, "frames", out[0] if isinstance(out, tuple) else out)
        if not isinstance(images, torch.Tensor):
            raise SpecError(f"hookkit.tune: expected the pipeline to return tensors with output_type='pt', got "
                            f"{type(images).__name__}. Pass calls to a diffusers pipeline that takes output_type.")
        return images.detach().float().cpu()


def _psnrs(images: torch.Tensor, reference: torch.Tensor) -> list[float]:
    """PSNR in dB of each image (or video) against the reference, peak 1."""
    diff = (images.double() - reference.double()).pow(2)
    mse = diff.reshape(diff.shape[0], -1).mean(dim=1).tolist()
    return [math.inf if m == 0 else 10.0 * math.log10(1.0 / m) for m in mse]


def _progress(total: int, desc: str, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, leave=False)


# --- calibration ----------------------------------------------------------------------------------------------


class _Recorder:
    """Plain torch hooks on the first and last block of each transformer: the hidden stream's residual across
    every block, per (step, branch) of the handle's clock. Removed with their torch handles."""

    def __init__(self, handle: Handle) -> None:
        self.handle = handle
        self.residuals: dict[tuple[int, int], torch.Tensor] = {}
        self._inputs: dict[int, torch.Tensor] = {}
        self._hooks: list[Any] = []
        for member in handle.group:
            blocks = flat_blocks(member.adapter, member.transformer)
            if not blocks:
                continue
            first_path, first_spec, first = blocks[0]
            last_path, last_spec, last = blocks[-1]
            first_io = _BlockIO(first, first_spec, first_path)
            last_io = _BlockIO(last, last_spec, last_path)
            self._hooks.append(first.register_forward_pre_hook(self._pre(member, first_io), with_kwargs=True))
            self._hooks.append(last.register_forward_hook(self._post(member, last_io), with_kwargs=True))

    def _pre(self, member: Handle, io: _BlockIO) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self._inputs[id(member)] = io.hidden(args, kwargs)
        return hook

    def _post(self, member: Handle, io: _BlockIO) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            hidden_in = self._inputs.pop(id(member), None)
            hidden_out, _ = io.unpack(output)
            if hidden_in is None or hidden_in.shape != hidden_out.shape:
                return
            state = member.state
            self.residuals[(state.step, state.branch)] = (hidden_out - hidden_in).detach()
        return hook

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def _stats(residuals: dict[tuple[int, int], torch.Tensor], steps: int) -> tuple[list[list[float]], list[float]]:
    """(gram, ratios) of one call: gram summed over branches, ratios averaged over them."""
    gram = [[0.0] * steps for _ in range(steps)]
    ratio_sum = [0.0] * steps
    ratio_count = [0] * steps
    for branch in sorted({b for _, b in residuals}):
        rows = [residuals.get((t, branch)) for t in range(steps)]
        present = [t for t in range(steps) if rows[t] is not None]
        if not present:
            continue
        flat = torch.stack([rows[t].reshape(-1).double() for t in present])
        g = (flat @ flat.T / flat.shape[1]).tolist()
        for a, i in enumerate(present):
            for b, j in enumerate(present):
                gram[i][j] += g[a][b]
        for t in present:
            prev = rows[t - 1] if t > 0 else None
            if prev is None or prev.shape != rows[t].shape:
                ratio = 1.0
            else:
                now = torch.linalg.norm(rows[t].float(), dim=-1)
                before = torch.linalg.norm(prev.float(), dim=-1)
                ratio = (now / (before + 1e-8)).mean().item()
            ratio_sum[t] += ratio
            ratio_count[t] += 1
    ratios = [ratio_sum[t] / ratio_count[t] if ratio_count[t] else 1.0 for t in range(steps)]
    return gram, ratios


def _sigma_weights(pipe: Any, steps: int) -> list[float] | None:
    sigmas = getattr(getattr(pipe, "scheduler", None), "sigmas", None)
    if not isinstance(sigmas, torch.Tensor) or sigmas.ndim != 1 or sigmas.numel() != steps + 1:
        return None
    s = sigmas.double().cpu()
    return (s[:-1] - s[1:]).abs().tolist()


def _calibrate(replay: _Replay, progress: bool,
               sensitivity: bool = False) -> tuple[CacheCalibration, list[torch.Tensor]]:
    """Run every call uncached once: its images (the reference) and the calibration; with `sensitivity`, also once per
    step with only that step cached (`_gains`)."""
    pipe = replay.pipe
    if handle_of(pipe) is not None:
        raise SpecError("hookkit.calibrate/tune: expected a pipeline without hookkit enabled (the calibration is of the "
                        "uncached model), got one with a handle. Call hookkit.disable(pipe) first.")
    handle = enable(pipe, Spec())  # the clock only: steps and branches
    recorder = _Recorder(handle)
    images: list[torch.Tensor] = []
    grams: list[list[list[float]]] = []
    ratios: list[list[float]] = []
    steps = 0
    bar = _progress(len(replay.calls), "hookkit calibrate", progress)
    try:
        for i in range(len(replay.calls)):
            recorder.residuals.clear()
            images.append(replay.images(i))
            steps = handle.state.num_steps or (1 + max((t for t, _ in recorder.residuals), default=0))
            g, r = _stats(recorder.residuals, steps)
            grams.append(g)
            ratios.append(r)
            if bar is not None:
                bar.update()
    finally:
        recorder.remove()
        handle.remove()
        if bar is not None:
            bar.close()
    if steps < 2:
        raise SpecError(f"hookkit.calibrate: expected calls of at least 2 denoising steps, got {steps}.")
    n = len(grams)
    gram = [[sum(g[i][j] for g in grams) / n for j in range(steps)] for i in range(steps)]
    gram = [[(gram[i][j] + gram[j][i]) / 2 for j in range(steps)] for i in range(steps)]  # exact symmetry
    mean_ratios = [sum(r[t] for r in ratios) / n for t in range(steps)]
    calibration = CacheCalibration(model=type(pipe.transformer).__name__, steps=steps, ratios=mean_ratios, gram=gram,
                                   weights=_sigma_weights(pipe, steps), calls=n)
    if sensitivity:
        calibration = attrs.evolve(calibration, gains=_gains(replay, calibration, images, progress))
    return calibration, images


def _gains(replay: _Replay, calibration: CacheCalibration, reference: list[torch.Tensor],
           progress: bool) -> list[float]:
    """Per step t >= 1: the RMS change of every call's images when only step t is cached (step t-1's residual reused,
    every block skipped), over the RMS error of that reuse in the residual (from the gram matrix). Step 0, never
    cached, gets step 1's gain."""
    steps, gram = calibration.steps, calibration.gram
    assert gram is not None  # _calibrate always measures it
    gains = [0.0] * steps
    bar = _progress(steps - 1, "hookkit calibrate: sensitivity", progress)
    try:
        for t in range(1, steps):
            mask = [1] * steps
            mask[t] = 0
            cache = DBCache(fn_blocks=0, warmup_steps=0, steps_mask=mask, mask_policy="static", taylorseer_order=0)
            handle = enable(replay.pipe, Spec(cache=cache))
            total = count = 0.0
            try:
                for i in range(len(replay.calls)):
                    diff = replay.images(i).double() - reference[i].double()
                    total += diff.pow(2).sum().item()
                    count += diff.numel()
            finally:
                handle.remove()
            error = math.sqrt(max(gram[t][t] - 2.0 * gram[t][t - 1] + gram[t - 1][t - 1], 0.0))
            gains[t] = math.sqrt(total / count) / error if error > 0 and count else 0.0
            if bar is not None:
                bar.update()
    finally:
        if bar is not None:
            bar.close()
    gains[0] = gains[1] if steps > 1 else 0.0
    return gains


def calibrate(pipe: Any, calls: Sequence[dict[str, Any]], *, sensitivity: bool = False,
              progress: bool = False) -> CacheCalibration:
    """One uncached run of each call: the per-step statistics DBCache's "magnitude" and "schedule" rules need.

    Args:
        pipe: a diffusers pipeline without hookkit enabled; left as it was.
        calls: keyword dicts for `pipe(**kw)`, each with a `generator` (or `latents`), all at one step count.
        sensitivity: also measure `CacheCalibration.gains` (how much the images move per unit of residual error at
            each step), from one more run of each call per step with only that step cached: steps - 1 times the
            cost of the uncached run, for schedules that put their computed steps where errors are amplified.
        progress: show a progress bar on stderr.
    """
    replay = _Replay(pipe, _check_calls(calls, "hookkit.calibrate"))
    if not isinstance(sensitivity, bool):
        raise SpecError(f"hookkit.calibrate.sensitivity: expected True or False, got {sensitivity!r}.")
    return _calibrate(replay, progress, sensitivity)[0]


# --- tuning ---------------------------------------------------------------------------------------------------


@attrs.frozen
class TuneRow:
    """One candidate as measured on the calls: its cache spec, speed-up in executed block work, PSNR mean and min."""

    name: str
    cache: DBCache
    speedup: float
    psnr_mean: float
    psnr_min: float


@attrs.frozen
class TuneResult:
    """What `search` found: the chosen row, every row tried, the calibration made on the way."""

    chosen: TuneRow
    rows: tuple[TuneRow, ...]
    calibration: CacheCalibration
    target: str

    @property
    def spec(self) -> Spec:
        return Spec(cache=self.chosen.cache)

    def table(self) -> str:
        ordered = sorted(self.rows, key=lambda r: (-r.speedup, -r.psnr_mean))
        body = [[("* " if r is self.chosen else "  ") + r.name, f"{r.speedup:.2f}", _db(r.psnr_mean), _db(r.psnr_min)]
                for r in ordered]
        return f"hookkit tune: {self.target}\n" + table(["candidate", "speed-up", "PSNR mean dB", "PSNR min dB"], body)


def _db(value: float) -> str:
    return "inf" if math.isinf(value) else f"{value:.2f}"


def _name(cache: DBCache) -> str:
    ts = f" TS{cache.taylorseer_order}" if cache.taylorseer_order else ""
    if cache.extrapolate == "output":
        ts += " output"
    if cache.rule == "schedule" and cache.calibration is None:
        return f"schedule {cache.speedup:g}x F{cache.fn_blocks}{ts} spacing {cache.spacing:g} last {cache.last_computed:g}"
    if cache.rule == "schedule":
        plan = "" if cache.calibration.gains is not None else " step-size plan"
        return f"schedule {cache.speedup:g}x F{cache.fn_blocks}{ts}{plan}"
    if cache.rule == "magnitude":
        k = cache.max_continuous_cached_steps
        return f"magnitude {cache.threshold:g} K{k if k >= 0 else 'inf'} F{cache.fn_blocks}{ts}"
    if cache.steps_mask is not None and cache.mask_policy == "static":
        mask = cache.steps_mask if isinstance(cache.steps_mask, str) else "custom"
        return f"mask {mask} F{cache.fn_blocks}{ts}"
    return f"threshold {cache.threshold:g} F{cache.fn_blocks}{ts}"


#: the calibration-free plans `candidates` tries: spacings at a speed-up target (one at a quality target's ladder)
GENERIC_SPACINGS: tuple[float, ...] = (1.3, 1.5, 1.7, 2.0)
#: ... and where their last computed step falls
GENERIC_LASTS: tuple[float, ...] = (1.0, 0.7)
#: what the planned schedules reuse, per TaylorSeer order: the transformer's output is tried where it extrapolates
#: (orders 1 and 2: better in 29 of 30 cells on the trained models, BENCHMARKS.md "What a cached step reuses")
SCHEDULE_EXTRAPOLATES: dict[int, tuple[str, ...]] = {0: ("residual",), 1: ("residual", "output"),
                                                     2: ("residual", "output")}


def candidates(calibration: CacheCalibration, speedup: float | None = None) -> list[DBCache]:
    """The caching specs `tune` tries, deterministic: the planned schedule (orders 0-2) at the target speed-up (or at
    a ladder of speed-ups for a quality target), planned from the calibration and calibration-free (`spacing` and
    `last_computed` swept: a plan that stops computing early wins at 3.5x on 14 steps), MagCache's rule on the
    calibrated ratios, the threshold rule and the named static masks, each with TaylorSeer orders that measured
    useful."""
    out: list[DBCache] = []
    n = calibration.steps
    ladder = [speedup] if speedup is not None else [1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0]
    spacings = GENERIC_SPACINGS if speedup is not None else (GENERIC_SPACING,)
    for s in ladder:
        if s >= n:
            continue
        for order in (0, 1, 2):
            for extrapolate in SCHEDULE_EXTRAPOLATES[order]:
                out.append(DBCache(rule="schedule", calibration=calibration, speedup=float(s),
                                   taylorseer_order=order, extrapolate=extrapolate))
                for spacing in spacings:
                    for last in GENERIC_LASTS:
                        out.append(DBCache(rule="schedule", speedup=float(s), taylorseer_order=order, spacing=spacing,
                                           last_computed=last, extrapolate=extrapolate))
                if calibration.gains is not None:  # the plan by step size alone, which wins at some speed-ups
                    out.append(DBCache(rule="schedule", calibration=attrs.evolve(calibration, gains=None),
                                       speedup=float(s), taylorseer_order=order, extrapolate=extrapolate))
    if calibration.ratios is not None:
        for threshold in (0.06, 0.12, 0.24, 0.5):
            for k in (2, 3, 6):
                for order in (0, 1):
                    out.append(DBCache(rule="magnitude", calibration=calibration, threshold=threshold,
                                       max_continuous_cached_steps=k, taylorseer_order=order))
    for threshold in (0.08, 0.16, 0.24):
        for order in (0, 1):
            out.append(DBCache(threshold=threshold, taylorseer_order=order))
    for mask in ("slow", "medium", "fast", "ultra"):
        for order in (1, 2):
            out.append(DBCache(steps_mask=mask, mask_policy="static", taylorseer_order=order))
    return out


def _speedup(handle: Handle) -> tuple[int, int]:
    """(uncached block calls, block calls run) of the handle's last generation, over its transformers."""
    total = run = 0
    summary = handle.summary()
    for part in (summary, *summary.companions):
        data = part.features.get("cache")
        if data is not None:
            total += data.data["block_calls_uncached"]
            run += data.data["block_calls"]
    return total, run


def _measure(replay: _Replay, cache: DBCache, reference: list[torch.Tensor]) -> tuple[float, list[float]]:
    handle = enable(replay.pipe, Spec(cache=cache))
    total = run = 0
    psnrs: list[float] = []
    try:
        for i in range(len(replay.calls)):
            images = replay.images(i)
            t, r = _speedup(handle)
            total, run = total + t, run + r
            psnrs += _psnrs(images, reference[i])
    finally:
        handle.remove()
    return (total / run if run else 1.0), psnrs


def search(pipe: Any, calls: Sequence[dict[str, Any]], *, speedup: float | None = None,
           min_psnr: float | None = None, specs: Iterable[DBCache] | None = None,
           progress: bool = False) -> TuneResult:
    """`tune`, returning every candidate it measured (`TuneResult.rows`, `.table()`) besides the chosen one.

    Args:
        specs: the caching specs to try instead of `candidates(calibration, speedup)`; each may be a callable
            `calibration -> DBCache` for specs that need this model's calibration.
    """
    if speedup is None and min_psnr is None:
        raise SpecError("hookkit.tune: expected a target, speedup=... (e.g. 2.0) or min_psnr=... (dB), got neither.")
    if speedup is not None and (isinstance(speedup, bool) or not isinstance(speedup, (int, float))
                                or not speedup > 1.0 or not math.isfinite(speedup)):
        raise SpecError(f"hookkit.tune.speedup: expected a number > 1 (executed block work, uncached / cached), got "
                        f"{speedup!r}.")
    if min_psnr is not None and (isinstance(min_psnr, bool) or not isinstance(min_psnr, (int, float))
                                 or not math.isfinite(min_psnr)):
        raise SpecError(f"hookkit.tune.min_psnr: expected a finite number of dB, got {min_psnr!r}.")
    replay = _Replay(pipe, _check_calls(calls, "hookkit.tune"))
    calibration, reference = _calibrate(replay, progress, sensitivity=True)
    n = calibration.steps
    if speedup is not None and speedup > n:
        raise SpecError(f"hookkit.tune.speedup: expected at most {n} (every step but one cached, no block run on a "
                        f"cached step) for calls of {n} steps, got {speedup:g}. Ask for less, or run more steps.")
    tried = list(specs) if specs is not None else candidates(calibration, None if speedup is None else float(speedup))
    bar = _progress(len(tried), "hookkit tune", progress)
    rows: list[TuneRow] = []
    try:
        for item in tried:
            cache = item(calibration) if callable(item) and not isinstance(item, DBCache) else item
            try:
                achieved, psnrs = _measure(replay, cache, reference)
            except SpecError:
                continue  # a candidate this model or step count cannot take (e.g. a speed-up out of reach)
            finally:
                if bar is not None:
                    bar.update()
            rows.append(TuneRow(name=_name(cache), cache=cache, speedup=achieved,
                                psnr_mean=sum(psnrs) / len(psnrs), psnr_min=min(psnrs)))
    finally:
        if bar is not None:
            bar.close()
    target = " and ".join(t for t in (f"speed-up >= {speedup:g}" if speedup is not None else "",
                                      f"every PSNR >= {min_psnr:g} dB" if min_psnr is not None else "") if t)
    eligible = [r for r in rows if (speedup is None or r.speedup >= speedup - 1e-9)
                and (min_psnr is None or r.psnr_min >= min_psnr)]
    if not eligible:
        best_speed = max((r.speedup for r in rows), default=1.0)
        best_psnr = max((r.psnr_min for r in rows), default=-math.inf)
        raise SpecError(f"hookkit.tune: expected a candidate with {target}, got none among {len(rows)} (fastest "
                        f"{best_speed:.2f}x, best min PSNR {_db(best_psnr)} dB). Lower the speed-up or the PSNR.")
    if speedup is not None:  # the best quality at the speed-up; ties: the faster, then the earlier candidate
        chosen = max(eligible, key=lambda r: (r.psnr_mean, r.speedup))
    else:  # the fastest above the quality; ties: the better
        chosen = max(eligible, key=lambda r: (r.speedup, r.psnr_mean))
    return TuneResult(chosen=chosen, rows=tuple(rows), calibration=calibration, target=target)


def tune(pipe: Any, calls: Sequence[dict[str, Any]], *, speedup: float | None = None,
         min_psnr: float | None = None, progress: bool = True) -> Spec:
    """The caching Spec for this model and these calls: the best mean PSNR at >= `speedup`, or the fastest whose
    every image stays >= `min_psnr` dB (both: the best mean PSNR among those meeting both).

    Runs each call uncached once (reference images and `calibrate`), then every candidate of `candidates`
    (planned schedules, MagCache's rule, the threshold rule, static masks), and leaves `pipe` as it was.
    Deterministic: the same calls give the same Spec. Refuses a target no candidate meets (SpecError).

    Args:
        pipe: a diffusers pipeline without hookkit enabled.
        calls: keyword dicts for `pipe(**kw)`, each with a `generator` (or `latents`), all at one step count.
        speedup: the speed-up in executed block work to reach (> 1).
        min_psnr: the PSNR (dB, images in [0, 1], against uncached) every call's images must keep.
        progress: a progress bar on stderr and, at the end, the table of candidates tried.
    """
    result = search(pipe, calls, speedup=speedup, min_psnr=min_psnr, progress=progress)
    if progress:
        print(result.table(), file=sys.stderr)
    return result.spec
