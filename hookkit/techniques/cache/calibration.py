"""What DBCache's calibrated rules know about a model, and the step masks they plan from it. Data and arithmetic only.

One uncached run of the user's model (`hookkit.calibrate`) records, per denoising step, the residual of the
cacheable blocks (the hidden stream's output of the last block minus the input of the first). Two statistics of
those residuals are kept, small enough to ship as JSON beside an adapter:

- `ratios`: MagCache's magnitude ratio of each step, mean over tokens of |r_t| / |r_{t-1}| (ratios[0] = 1). The
  "magnitude" rule accumulates the error these predict and caches while it stays under the threshold.
- `gram`: the mean inner products <r_i, r_j> / numel of every pair of steps. Any extrapolation hookkit makes of
  a cached step's residual is a linear combination of computed steps' residuals, so its squared error is a
  quadratic form in `gram`: the "schedule" rule evaluates every choice of computed steps exactly (against the
  calibration run) and plans the one with the least predicted error on the final latent (`plan_schedule`).

With `calibrate(..., sensitivity=True)` (what `hookkit.tune` does) a third statistic is measured: `gains`, how much
the final images move per unit of residual error at each step (one extra run per step, only that step cached). An
error early in the schedule is amplified by every later step, one late is not; the step size alone (`weights`)
misses that, and the planner then spends its computed steps late and loses at high speed-ups.

Both rules decide before the call starts: the result is a static 0/1 mask, which needs no host read, replays
under whole-transformer CUDA graphs and is identical on every rank under context parallelism.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path
from typing import Any

import attrs
import torch

from hookkit.core.validate import plain, strict_init
from hookkit.errors import SpecError, field_error

__all__ = ["CacheCalibration", "magnitude_mask", "plan_schedule", "predict_weights", "schedule_cost", "step_weights"]

FORMAT = "hookkit-cache-calibration-v1"


def _floats(value: Any) -> tuple[float, ...] | None:
    value = plain(value)
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        return value  # the validator names it
    return tuple(float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v for v in value)


def _matrix(value: Any) -> tuple[tuple[float, ...], ...] | None:
    value = plain(value)
    if value is None or not isinstance(value, (list, tuple)):
        return value
    return tuple(_floats(row) if isinstance(row, (list, tuple)) else row for row in value)


@strict_init
@attrs.frozen(kw_only=True)
class CacheCalibration:
    """Per-step statistics of a model's uncached denoising, for DBCache's "magnitude" and "schedule" rules.

    Made by `hookkit.calibrate(pipe, calls)` (or `hookkit calibrate` on the command line); saved and loaded as JSON
    (`save`, `load`, `to_dict`, `from_dict`), so a calibration ships with a model as data.

    Args:
        model: the transformer class it was measured on (for messages; a calibration of another model is allowed,
            as diffusers' shipped MagCache ratios are).
        steps: the number of denoising steps it was measured at.
        ratios: MagCache magnitude ratio per step (length `steps`, ratios[0] = 1.0), or None.
        gram: mean inner products of the steps' block residuals (`steps` x `steps`, symmetric), or None; needed
            by the "schedule" rule.
        weights: how much an error at each step moves the final latent (|sigma_t - sigma_t+1| of the scheduler,
            length `steps`); None weighs every step alike.
        calls: how many pipeline calls were averaged.
        gains: measured sensitivity per step (length `steps`), or None: the RMS change of the final images when only
            that step is cached (the previous step's residual reused), per unit of the RMS error that reuse makes in
            the residual (`calibrate(..., sensitivity=True)`). With gains, the "schedule" rule weighs a step's error
            by the geometric mean of its weight and its gain (`step_weights`).
    """

    model: str = attrs.field(default="")
    steps: int = attrs.field()
    ratios: tuple[float, ...] | None = attrs.field(default=None, converter=_floats)
    gram: tuple[tuple[float, ...], ...] | None = attrs.field(default=None, converter=_matrix)
    weights: tuple[float, ...] | None = attrs.field(default=None, converter=_floats)
    calls: int = attrs.field(default=1)
    gains: tuple[float, ...] | None = attrs.field(default=None, converter=_floats)

    def __attrs_post_init__(self) -> None:
        name = "CacheCalibration"
        if not isinstance(self.model, str):
            raise field_error(name, "model", self.model, "a string (the transformer class name)")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 2:
            raise field_error(name, "steps", self.steps, "an int >= 2")
        if isinstance(self.calls, bool) or not isinstance(self.calls, int) or self.calls < 1:
            raise field_error(name, "calls", self.calls, "an int >= 1")
        for field in ("ratios", "weights", "gains"):
            value = getattr(self, field)
            if value is None:
                continue
            if (not isinstance(value, tuple) or len(value) != self.steps
                    or any(not isinstance(v, float) or not math.isfinite(v) or v < 0 for v in value)):
                raise field_error(name, field, value, f"{self.steps} finite numbers >= 0 (one per step) or None")
        gram = self.gram
        if gram is not None:
            ok = (isinstance(gram, tuple) and len(gram) == self.steps
                  and all(isinstance(row, tuple) and len(row) == self.steps for row in gram)
                  and all(isinstance(v, float) and math.isfinite(v) for row in gram for v in row))
            if not ok:
                raise field_error(name, "gram", "<matrix>" if isinstance(gram, tuple) else gram,
                                  f"a {self.steps} x {self.steps} matrix of finite numbers or None")
            if any(abs(gram[i][j] - gram[j][i]) > 1e-6 * (abs(gram[i][j]) + abs(gram[j][i]) + 1e-30)
                   for i in range(self.steps) for j in range(i)):
                raise field_error(name, "gram", "<matrix>", "a symmetric matrix (<r_i, r_j> = <r_j, r_i>)")
        if self.ratios is None and self.gram is None:
            raise SpecError("CacheCalibration: expected ratios, gram or both, got neither. Make one with "
                            "hookkit.calibrate(pipe, calls).")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict (lists for tuples), the inverse of `from_dict`."""
        return {"format": FORMAT, "model": self.model, "steps": self.steps, "calls": self.calls,
                "ratios": None if self.ratios is None else list(self.ratios),
                "gram": None if self.gram is None else [list(r) for r in self.gram],
                "weights": None if self.weights is None else list(self.weights),
                "gains": None if self.gains is None else list(self.gains)}

    @classmethod
    def from_dict(cls, data: Any) -> CacheCalibration:
        if not isinstance(data, dict):
            raise field_error("CacheCalibration", "<dict>", type(data).__name__, "a dict written by to_dict()")
        data = dict(data)
        fmt = data.pop("format", FORMAT)
        if fmt != FORMAT:
            raise field_error("CacheCalibration", "format", fmt, repr(FORMAT),
                              "Calibrate again with this hookkit version (hookkit.calibrate).")
        return cls(**data)

    def save(self, path: str | Path) -> Path:
        out = Path(path)
        out.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return out

    @classmethod
    def load(cls, path: str | Path) -> CacheCalibration:
        source = Path(path)
        try:
            data = json.loads(source.read_text())
        except (OSError, ValueError) as exc:
            raise SpecError(f"CacheCalibration.load: expected a readable JSON file written by CacheCalibration.save, "
                            f"got {str(source)!r} ({type(exc).__name__}: {exc}).") from None
        return cls.from_dict(data)

    def ratios_for(self, num_steps: int) -> tuple[float, ...]:
        """The ratios for a call of `num_steps` steps: as measured, or nearest-interpolated (as diffusers' MagCache)."""
        if self.ratios is None:
            raise SpecError("DBCache(rule='magnitude').calibration: expected a calibration with ratios, got one "
                            "without. Calibrate with hookkit.calibrate(pipe, calls).")
        if num_steps == self.steps:
            return self.ratios
        if num_steps == 1:
            return self.ratios[-1:]
        # diffusers' `nearest_interp`, in its float32 arithmetic and round-half-to-even, so both pick the same ratios
        scale = (self.steps - 1) / (num_steps - 1)
        index = torch.round(torch.arange(num_steps, dtype=torch.float32) * scale).long().tolist()
        return tuple(self.ratios[i] for i in index)


def as_calibration(value: Any) -> Any:
    """DBCache.calibration's converter: a dict (from JSON) becomes a `CacheCalibration`."""
    return CacheCalibration.from_dict(value) if isinstance(value, dict) else value


# --- the magnitude rule ------------------------------------------------------------------------------------


def magnitude_mask(ratios: tuple[float, ...], threshold: float, max_skip: int, retention: int) -> tuple[int, ...]:
    """MagCache's decisions, made before the call: 1 = compute, 0 = reuse the last computed residual.

    From step `retention` on, each step multiplies the accumulated ratio by its magnitude ratio and adds
    |1 - accumulated ratio| to the accumulated error; the step is cached while that error stays <= `threshold`
    and at most `max_skip` steps (-1: no limit) were cached since the last computed one, otherwise computed and
    the accumulation restarts. Exactly diffusers' `MagCacheHeadHook`, with the same ratios the same mask.
    """
    mask: list[int] = []
    acc_ratio, acc_err, acc_steps = 1.0, 0.0, 0
    for step, ratio in enumerate(ratios):
        if step < retention or step == 0:
            mask.append(1)
            continue
        acc_ratio *= ratio
        acc_steps += 1
        acc_err += abs(1.0 - acc_ratio)
        if acc_err <= threshold and (max_skip < 0 or acc_steps <= max_skip):
            mask.append(0)
        else:
            mask.append(1)
            acc_ratio, acc_err, acc_steps = 1.0, 0.0, 0
    return tuple(mask)


# --- the schedule rule -------------------------------------------------------------------------------------


def predict_weights(history: tuple[int, ...], step: int, order: int) -> dict[int, float]:
    """The residual DBCache adds at cached `step`, as weights of the computed steps' residuals.

    `history`: the computed steps so far (ascending). Mirrors `_Branch.store`/`predict`: order 0 reuses the last
    one; order 1 adds the first difference (per step) times the distance; order 2 the paper's Taylor term,
    second difference / 2 times the distance squared, differences taken over the latest gap.
    """
    c = history[-1]
    out = {c: 1.0}
    if order < 1 or len(history) < 2:
        return out
    b = history[-2]
    k, gap = step - c, c - b
    out[c] += k / gap
    out[b] = -k / gap
    if order < 2 or len(history) < 3:
        return out
    a = history[-3]
    gap0 = b - a
    half = k * k / 2.0 / gap
    out[c] += half / gap
    out[b] += half * (-1.0 / gap - 1.0 / gap0)
    out[a] = out.get(a, 0.0) + half / gap0
    return out


def _error(gram: tuple[tuple[float, ...], ...], weights: dict[int, float], step: int) -> float:
    """|sum_i w_i r_i - r_step| under `gram` (root mean square per element)."""
    coef = dict(weights)
    coef[step] = coef.get(step, 0.0) - 1.0
    total = sum(ci * cj * gram[i][j] for i, ci in coef.items() for j, cj in coef.items())
    return math.sqrt(max(total, 0.0))


def schedule_cost(calibration: CacheCalibration, mask: tuple[int, ...], order: int) -> float:
    """The predicted error on the final latent of caching by `mask`: sum over cached steps of the step's weight
    times the RMS error of its extrapolated residual against the calibration run's."""
    gram = _gram(calibration)
    weights = step_weights(calibration)
    history: list[int] = []
    cost = 0.0
    for step, m in enumerate(mask):
        if m or not history:
            history.append(step)
        else:
            cost += weights[step] * _error(gram, predict_weights(tuple(history[-3:]), step, order), step)
    return cost


def step_weights(calibration: CacheCalibration) -> tuple[float, ...]:
    """How much the planner weighs an error of the residual at each step: `weights` (the step size, 1 without), or
    with measured `gains` the geometric mean sqrt(weight * gain).

    Why the mean and not the gain alone: a gain is measured with one step cached, on the uncached trajectory; a
    schedule caches long runs of steps, whose errors compound along a trajectory that has already left it, which
    the single-step gain of a late step understates. On the trained models' tuning seeds (10-12, none of the
    harness's evaluation seeds) the mean planned better schedules than either alone at every speed-up tried
    (BENCHMARKS.md, "Caching at equal quality").
    """
    weights = calibration.weights or (1.0,) * calibration.steps
    if calibration.gains is None:
        return tuple(weights)
    return tuple(math.sqrt(w * g) for w, g in zip(weights, calibration.gains))


def _gram(calibration: CacheCalibration) -> tuple[tuple[float, ...], ...]:
    if calibration.gram is None:
        raise SpecError("DBCache(rule='schedule').calibration: expected a calibration with its gram matrix, got one "
                        "with ratios only (e.g. shipped MagCache ratios). Calibrate with hookkit.calibrate(pipe, calls).")
    return calibration.gram


def plan_schedule(calibration: CacheCalibration, num_steps: int, computed: int, order: int,
                  forced: int = 1) -> tuple[int, ...]:
    """The 0/1 mask of `num_steps` steps with exactly `computed` computed steps (the first `forced` among them)
    whose `schedule_cost` is least: dynamic programming over the last (order + 1) computed steps, exact.

    Deterministic: among equal costs the mask computing earlier steps wins.
    """
    if num_steps != calibration.steps:
        raise SpecError(
            f"DBCache(rule='schedule').calibration: expected a calibration at the call's {num_steps} steps, got one "
            f"at {calibration.steps}. Calibrate at {num_steps} steps (hookkit.calibrate with num_inference_steps="
            f"{num_steps} in the calls), or call the pipeline with {calibration.steps} steps.")
    forced = max(1, min(forced, num_steps))
    computed = max(forced, min(computed, num_steps))
    if computed >= num_steps:
        return (1,) * num_steps
    return _plan(_gram(calibration), step_weights(calibration), num_steps, computed, order, forced)


#: `DBCache(rule="schedule")` without a calibration: computed step j of k at last * (j / (k - 1)) ** spacing
GENERIC_SPACING = 1.7
GENERIC_LAST = 1.0


def generic_schedule(num_steps: int, computed: int, spacing: float = GENERIC_SPACING, last: float = GENERIC_LAST,
                     forced: int = 1) -> tuple[int, ...]:
    """The calibration-free plan: the 0/1 mask of `num_steps` steps with exactly `computed` computed steps, the first
    `forced` steps among them and the others spaced as a power of their rank, dense where a flow-matching trajectory
    bends (the first steps) and sparser later: the j-th of the remaining ones at `(last * (num_steps - 1) - f) *
    (j / m) ** spacing + f` (f = forced - 1, m = the remaining count), rounded, each at least one step after the
    previous. `last` is where the last computed step falls, as a share of the schedule (1.0: the final step).

    Why a power: the plans `plan_schedule` makes from the trained models' calibrations space their computed steps so
    (exponent 1.5-2 at 1.5-3x, on both models and step counts), and so do the best fixed masks on models they were
    not planned on (BENCHMARKS.md, "Caching at equal quality"): the schedule needs no uncached run of the model.
    """
    if not (isinstance(spacing, (int, float)) and spacing > 0 and 0 < last <= 1):
        raise SpecError(f"generic_schedule: expected spacing > 0 and 0 < last <= 1, got spacing={spacing!r}, "
                        f"last={last!r}.")
    forced = max(1, min(forced, num_steps))
    computed = max(forced, min(computed, num_steps))
    end = max(forced - 1, round(last * (num_steps - 1)))
    steps = list(range(forced))
    remaining = computed - forced
    for j in range(1, remaining + 1):
        x = (forced - 1) + (end - (forced - 1)) * (j / remaining) ** spacing
        lowest = steps[-1] + 1
        highest = num_steps - 1 - (remaining - j)  # room for the ones still to place
        steps.append(min(max(round(x), lowest), highest))
    chosen = set(steps)
    return tuple(1 if i in chosen else 0 for i in range(num_steps))


@lru_cache(maxsize=64)
def _plan(gram: tuple[tuple[float, ...], ...], weights: tuple[float, ...], n: int, k: int, order: int,
          forced: int) -> tuple[int, ...]:
    keep = order + 1
    # cost[state][t]: error of cached step t after the computed steps `state` (the last `keep` of them)
    seg_cache: dict[tuple[int, ...], list[float]] = {}

    def prefix(state: tuple[int, ...]) -> list[float]:
        """Cumulative cost of caching steps last+1 .. t after `state` (index t -> sum up to and including t)."""
        found = seg_cache.get(state)
        if found is None:
            last = state[-1]
            found = [0.0] * n
            running = 0.0
            for t in range(last + 1, n):
                running += weights[t] * _error(gram, predict_weights(state, t, order), t)
                found[t] = running
            seg_cache[state] = found
        return found

    # layer j: states after j computed steps -> (cost, previous state); the first `forced` steps compute
    start = tuple(range(forced))[-keep:]
    layer: dict[tuple[int, ...], tuple[float, tuple[int, ...] | None]] = {start: (0.0, None)}
    back: list[dict[tuple[int, ...], tuple[float, tuple[int, ...] | None]]] = [layer]
    for _ in range(k - forced):
        nxt: dict[tuple[int, ...], tuple[float, tuple[int, ...] | None]] = {}
        for state, (cost, _prev) in layer.items():
            last = state[-1]
            pre = prefix(state)
            for c in range(last + 1, n):
                total = cost + (pre[c - 1] if c - 1 > last else 0.0)
                new = (state + (c,))[-keep:]
                best = nxt.get(new)
                if best is None or total < best[0] - 1e-15:
                    nxt[new] = (total, state)
        layer = nxt
        back.append(layer)
    # close: the steps after the last computed one are cached
    final_state, final_cost = None, math.inf
    for state, (cost, _prev) in sorted(layer.items()):
        last = state[-1]
        total = cost + (prefix(state)[n - 1] if last < n - 1 else 0.0)
        if total < final_cost - 1e-15:
            final_state, final_cost = state, total
    assert final_state is not None  # k <= n - 1 leaves at least one state
    # walk back: each layer's state adds its last step
    steps: set[int] = set(range(forced))
    state: tuple[int, ...] | None = final_state
    for j in range(len(back) - 1, 0, -1):
        steps.add(state[-1])  # type: ignore[index]
        state = back[j][state][1]  # type: ignore[index]
    return tuple(1 if t in steps else 0 for t in range(n))
