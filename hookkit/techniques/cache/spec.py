"""The `DBCache` spec: which blocks run always, when middle blocks may be skipped, named step masks."""

from __future__ import annotations

import math
import typing
from fractions import Fraction
from typing import Any

import attrs

from hookkit.core.validate import choice, float_field, instance_of, int_field, is_int, owner, plain, strict_init, to_tuple
from hookkit.errors import SpecError, field_error
from hookkit.techniques.cache.calibration import (
    GENERIC_LAST,
    GENERIC_SPACING,
    CacheCalibration,
    as_calibration,
    generic_schedule,
    magnitude_mask,
    plan_schedule,
)

#: how DBCache decides which steps reuse the middle blocks' residual (`DBCache.rule`)
RULES = ("threshold", "magnitude", "schedule")
#: what a cached step reuses (`DBCache.extrapolate`)
EXTRAPOLATE = ("residual", "output")


def resolved_extrapolate(spec: DBCache, between_block_args: tuple[str, ...]) -> str:
    """What a cached step of `spec` reuses on a model whose adapter names `between_block_args`: the spec's value, or
    for None (the whole-step schedule's default) "output" unless the model may be given ControlNet residuals or VACE
    hints, which only the residual form adds on a cached step."""
    if spec.extrapolate is not None:
        return spec.extrapolate
    return "residual" if between_block_args else "output"


#: Named step masks, defined for 28 steps as alternating (compute, cache) bins and scaled to other step
#: counts. 1 = compute, 0 = may cache. Every policy covers exactly 28 steps; computed steps: slow 18,
#: medium 15, fast 11, ultra 8.
MASK_POLICIES: dict[str, tuple[tuple[int, int], ...]] = {
    # cache-dit's predefined 28-step policies, bin for bin (cache_dit.steps_mask): the same name computes the
    # same steps in both libraries, so results compare directly
    "slow": ((8, 1), (3, 2), (3, 2), (2, 2), (1, 3), (1, 0)),      # 18 of 28 steps computed
    "medium": ((6, 1), (2, 3), (2, 3), (2, 3), (2, 3), (1, 0)),    # 15 of 28
    "fast": ((6, 1), (1, 3), (1, 4), (1, 5), (1, 4), (1, 0)),      # 11 of 28
    "ultra": ((4, 2), (1, 5), (1, 6), (1, 7), (1, 0)),             # 8 of 28
}


def _check_steps_mask(inst: Any, attr: attrs.Attribute, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, str):
        if value not in MASK_POLICIES:
            raise field_error(owner(inst), attr.name, value, f"one of {tuple(MASK_POLICIES)} or a list of 0/1")
        return
    if not isinstance(value, tuple) or not value or any(not is_int(v) or v not in (0, 1) for v in value):
        raise field_error(owner(inst), attr.name, value, "a non-empty list of 0 (may cache) / 1 (compute), a policy name, or None")


def _check_share(inst: Any, attr: attrs.Attribute, value: Any) -> None:
    if value is not None and value > 1:
        raise field_error(owner(inst), attr.name, value, "a share of the steps, 0 < x <= 1")


@strict_init
@attrs.frozen(kw_only=True)
class DBCache:
    """DBCache-style residual caching: the first `fn_blocks` and last `bn_blocks` always run, the middle
    blocks are skipped on cached steps and their stored residual (or its TaylorSeer extrapolation) is added
    instead; with every block skipped, the transformer's whole output may be extrapolated instead (`extrapolate`).
    `rule` decides which steps are cached; the order in which the threshold rule's checks decide is in
    `hookkit.techniques.cache.state` (`_CallState.rules`).

    `DBCache()` is the planned rule without a calibration: 2x less block work, every block skipped on a cached step
    (its output or residual extrapolated with TaylorSeer 2: `extrapolate`), the computed steps spaced densely early
    and sparsely late. It needs no uncached run, no host read,
    replays under CUDA graphs and decides alike on every rank; on the trained models it is on the speed-quality front
    at 2x, ahead of every peer rule (BENCHMARKS.md, "Caching at equal quality"). `hookkit.tune` finds a better Spec
    for your model and calls.

    Rules:
      - "schedule" (the default, unless `threshold`, `steps_mask` or `max_accumulated_diff` is given): decided before
        the call, computing as many steps as reach `speedup` in executed block work. With a `calibration` (one
        uncached run of the model: `hookkit.calibrate`) it computes the steps of least predicted error on the final
        latent with this spec's TaylorSeer extrapolation (`calibration.plan_schedule`); without one it spaces them by
        `spacing` and `last_computed` (`calibration.generic_schedule`).
      - "threshold": cache a step when the first blocks' residual changed little since the branch's last computed
        step (one host read per step), within `warmup_steps`, `steps_mask` and the limits below.
      - "magnitude": MagCache's rule, decided before the call from `calibration.ratios`: cache while the error the
        per-step magnitude ratios accumulate stays <= `threshold`, at most `max_continuous_cached_steps` in a row
        (-1: no limit), after `warmup_steps` (None: MagCache's 20 % retention). No host read.
    "magnitude" and "schedule" decide like a static mask: they replay under whole-transformer CUDA graphs and decide
    alike on every rank.

    Args:
        rule: "schedule", "threshold" or "magnitude" (above). Default None: "threshold" when `threshold`,
            `steps_mask` or `max_accumulated_diff` is given (the settings only it reads), else "schedule".
        fn_blocks: blocks at the start that always run (>= 0); their residual detects change. Default: 1 for
            "threshold", 0 for "magnitude" and "schedule" (their decisions need no residual: every block is skipped
            on a cached step). 0 with "threshold" needs a static mask.
        bn_blocks: blocks at the end that always run (default 0), refining the approximated hidden states.
        threshold: "threshold": cache a step when the relative L1 change of the Fn residual against the branch's
            last computed step is below this (default 0.24); 0 never caches dynamically (a mask still may).
            "magnitude": the bound on the accumulated magnitude error (default 0.24; MagCache's is 0.06).
            None with "schedule", which reads no threshold.
        warmup_steps: the first steps, always computed; cut to a `steps_mask`'s leading 1s. Default None: scaled
            to the call's step count by `auto_warmup_steps` (8 at 28 steps and more, the same share rounded up
            below: 2 at 4-7 steps, 3 at 8-10) for "threshold", so 4-8-step models (FLUX.1-schnell, distilled LoRAs)
            cache too; 8 when the step count is unknown; MagCache's 20 % for "magnitude"; the first step for
            "schedule". An int is taken as given, even one that covers every step (the summary then says why nothing
            was cached).
        warmup_interval: within the warm-up, compute every this-many-th step only (default 1: all of them).
        max_cached_steps: at most this many cached steps per branch and call (default -1: no limit).
        max_continuous_cached_steps: at most this many cached steps in a row (default -1: no limit); MagCache's K
            with "magnitude" (MagCache's default is 3).
        max_accumulated_diff: once the measured diffs of a branch sum to this, compute every later step of the
            call (default None: no limit; otherwise > 0).
        steps_mask: which steps may be cached: a list of 1 (compute) / 0 (may cache), or a named policy
            ("slow", "medium", "fast", "ultra") scaled to the step count (default None: no mask). A list
            shorter than the call computes the remaining steps.
        mask_policy: "dynamic" (default): a 0 in the mask still asks the rules and the threshold; "static":
            a 0 caches, no diff is measured and no host sync made (needs `steps_mask`).
        taylorseer_order: 0 reuses the last computed residual; 1 or 2 extrapolates it from the last computed steps
            in the TaylorSeer paper's form: differences over the latest gap between computed steps, divided by it,
            the k-th one times distance^k / k!. Default None: 2 for "schedule", 1 for the others.
        calibration: a `hookkit.CacheCalibration` (or its dict): "magnitude" needs its ratios, "schedule" plans
            from its gram matrix when given. Default None.
        speedup: "schedule" only: the speed-up in executed block work to reach (>= 1; default 2.0); the computed
            steps are as many as it allows (1.0 computes every step: nothing cached).
        spacing: "schedule" without a calibration: the exponent of the computed steps' spacing (default 1.7; 1 is
            even spacing, larger is denser early). None otherwise.
        last_computed: "schedule" without a calibration: where the last computed step falls, as a share of the
            steps (0 < x <= 1; default 1.0, the final step; below, the last steps are extrapolated). None otherwise.
        extrapolate: what a cached step reuses. "residual": the middle blocks' residual, added to the current
            step's hidden stream, which the model's output layers (final norm with the current timestep,
            projection) then turn into the output. "output": the transformer's whole output, extrapolated (or
            reused, order 0) from the branch's last computed calls; a cached call then runs nothing of the
            transformer, so ControlNet residuals or VACE hints of that call are not used. Needs every block skipped
            on cached steps (fn_blocks = bn_blocks = 0). Default None: for "schedule" with fn_blocks = bn_blocks = 0
            (`DBCache()`) "output" on a model whose adapter names no `between_block_args` (Wan, HunyuanVideo, ...),
            "residual" on one that may be given ControlNet residuals or VACE hints (Flux, Qwen-Image, Wan VACE: the
            residual form adds the current ones on a cached step); "residual" for every other rule or split. Why:
            on the trained models the output varies more smoothly over the steps than the residual, so the same
            computed steps give better images on held-out seeds (BENCHMARKS.md, "What a cached step reuses").
    """

    rule: str | None = attrs.field(default=None, validator=choice(*RULES, None))
    fn_blocks: int | None = attrs.field(default=None, validator=int_field(0, allow_none=True))
    bn_blocks: int = attrs.field(default=0, validator=int_field(0))
    threshold: float | None = attrs.field(default=None, validator=float_field(0.0, allow_none=True))
    warmup_steps: int | None = attrs.field(default=None, validator=int_field(0, allow_none=True))
    warmup_interval: int = attrs.field(default=1, validator=int_field(1))
    max_cached_steps: int = attrs.field(default=-1, validator=int_field(-1))
    max_continuous_cached_steps: int = attrs.field(default=-1, validator=int_field(-1))
    max_accumulated_diff: float | None = attrs.field(default=None, validator=float_field(0.0, allow_none=True, strict=True))
    steps_mask: tuple[int, ...] | str | None = attrs.field(default=None, converter=to_tuple, validator=_check_steps_mask)
    mask_policy: str = attrs.field(default="dynamic", validator=choice("dynamic", "static"))
    taylorseer_order: int | None = attrs.field(default=None, validator=int_field(0, 2, allow_none=True))
    calibration: CacheCalibration | None = attrs.field(
        default=None, converter=as_calibration, validator=instance_of(CacheCalibration, "a hookkit.CacheCalibration"))
    speedup: float | None = attrs.field(default=None, validator=float_field(1.0, allow_none=True))
    spacing: float | None = attrs.field(default=None, validator=float_field(0.0, allow_none=True, strict=True))
    last_computed: float | None = attrs.field(default=None, validator=[float_field(0.0, allow_none=True, strict=True),
                                                                       _check_share])
    extrapolate: str | None = attrs.field(default=None, validator=choice(*EXTRAPOLATE, None))

    #: fields added after Spec files were first written, with the value such a file means (`Spec.from_dict`): a
    #: complete DBCache dict without `extrapolate` was written when cached steps always reused the residual
    FIELDS_ADDED_LATER: typing.ClassVar[dict[str, Any]] = {"extrapolate": "residual"}

    @mask_policy.validator
    def _check_static_has_mask(self, attr: attrs.Attribute, value: str) -> None:
        # "static" follows the mask alone; without one it would silently cache like "dynamic"
        if value == "static" and self.steps_mask is None:
            raise SpecError("DBCache.mask_policy: 'static' follows steps_mask alone, but steps_mask is None. "
                            "Give a mask (steps_mask='fast' or a 0/1 list) or use mask_policy='dynamic'.")

    def __attrs_post_init__(self) -> None:
        self._resolve_defaults()
        rule = self.rule
        if self.extrapolate == "output" and (self.fn_blocks or self.bn_blocks):
            raise SpecError(
                f"DBCache.extrapolate: 'output' reuses the transformer's whole output, so no block may run on a cached "
                f"step; got fn_blocks={self.fn_blocks}, bn_blocks={self.bn_blocks}. Use fn_blocks=0 and bn_blocks=0 "
                "(rule='schedule' or 'magnitude', or a static mask), or extrapolate='residual'.")
        if not (rule == "schedule" and self.calibration is None):
            for name in ("spacing", "last_computed"):
                if getattr(self, name) is not None:
                    raise SpecError(
                        f"DBCache.{name}: expected None with rule={rule!r}"
                        + (" and a calibration (the plan comes from it)" if rule == "schedule" else "")
                        + f", got {getattr(self, name)!r}. It spaces the computed steps of rule='schedule' without "
                        "a calibration; drop it" + (" or the calibration." if rule == "schedule" else "."))
        if rule == "threshold":
            if self.fn_blocks == 0 and not (self.steps_mask is not None and self.mask_policy == "static"):
                raise SpecError(
                    "DBCache.fn_blocks: expected >= 1 with rule='threshold' (the first blocks' residual is what it "
                    "measures), got 0. Use fn_blocks=1, or a static mask (steps_mask=..., mask_policy='static'), or "
                    "rule='magnitude'/'schedule', which decide before the call and may skip every block.")
            for name in ("calibration", "speedup"):
                if getattr(self, name) is not None:
                    raise SpecError(f"DBCache.{name}: expected None with rule='threshold' (it is read by the "
                                    f"'magnitude' and 'schedule' rules), got {getattr(self, name)!r:.80}. Drop it or "
                                    "set rule='magnitude' / 'schedule'.")
            return
        if self.steps_mask is not None:
            raise SpecError(f"DBCache.steps_mask: expected None with rule={rule!r} (the rule makes the mask), got "
                            f"{self.steps_mask!r}. Drop steps_mask, or use rule='threshold' with it.")
        if self.max_accumulated_diff is not None:
            raise SpecError(f"DBCache.max_accumulated_diff: expected None with rule={rule!r} (only the threshold rule "
                            f"measures diffs), got {self.max_accumulated_diff!r}. Drop it, or use rule='threshold'.")
        if rule == "magnitude":
            if self.calibration is None:
                raise SpecError("DBCache.calibration: expected a hookkit.CacheCalibration with rule='magnitude', got "
                                "None. Make one from an uncached run of your model: hookkit.calibrate(pipe, calls).")
            if self.calibration.ratios is None:
                raise SpecError("DBCache.calibration: expected ratios with rule='magnitude', got a calibration without. "
                                "Calibrate with hookkit.calibrate(pipe, calls).")
            if self.speedup is not None:
                raise SpecError(f"DBCache.speedup: expected None with rule='magnitude' (its threshold sets the speed), "
                                f"got {self.speedup!r}. Drop it, or use rule='schedule'.")
        if rule == "schedule":
            if self.threshold is not None:
                raise SpecError(f"DBCache.threshold: expected None with rule='schedule' (it plans the steps before the "
                                f"call and measures nothing), got {self.threshold!r}. Drop it, or use "
                                "rule='threshold' to cache on a measured change.")
            if self.calibration is not None and self.calibration.gram is None:
                raise SpecError("DBCache.calibration: expected a gram matrix with rule='schedule', got ratios only. "
                                "Calibrate with hookkit.calibrate(pipe, calls), or drop the calibration for the "
                                "calibration-free plan.")

    def _resolve_defaults(self) -> None:
        """Fill the defaults that depend on the rule (frozen: set once, here). `rule=None` is "threshold" when a
        setting only that rule reads is given, else "schedule"."""
        rule = self.rule
        if rule is None:
            given = [n for n in ("threshold", "steps_mask", "max_accumulated_diff") if getattr(self, n) is not None]
            rule = "threshold" if given else "schedule"
        values: dict[str, Any] = {"rule": rule}
        if self.fn_blocks is None:
            values["fn_blocks"] = 1 if rule == "threshold" else 0
        if self.taylorseer_order is None:
            values["taylorseer_order"] = 2 if rule == "schedule" else 1
        whole_step = values.get("fn_blocks", self.fn_blocks) == 0 and self.bn_blocks == 0
        if self.extrapolate is None and not (rule == "schedule" and whole_step):
            values["extrapolate"] = "residual"  # None stays for the model to decide (`resolved_extrapolate`)
        if self.threshold is None and rule != "schedule":
            values["threshold"] = DEFAULT_THRESHOLD
        if rule == "schedule":
            if self.speedup is None:
                values["speedup"] = DEFAULT_SPEEDUP
            if self.calibration is None:
                if self.spacing is None:
                    values["spacing"] = GENERIC_SPACING
                if self.last_computed is None:
                    values["last_computed"] = GENERIC_LAST
        for name, value in values.items():
            object.__setattr__(self, name, value)


#: `DBCache.threshold`'s default for the "threshold" and "magnitude" rules
DEFAULT_THRESHOLD = 0.24
#: `DBCache.speedup`'s default for the "schedule" rule: 2x less executed block work
DEFAULT_SPEEDUP = 2.0


#: warm-up of `DBCache(warmup_steps=None)` at `WARMUP_REFERENCE_STEPS` steps and more (cache-dit's default)
WARMUP_REFERENCE = 8
WARMUP_REFERENCE_STEPS = 28


def auto_warmup_steps(num_steps: int | None) -> int:
    """Warm-up of `DBCache(warmup_steps=None)` for a call of `num_steps` steps.

    8 steps at 28 (the measured default) are kept at more steps; below, the same share of the schedule,
    rounded up: 4-7 steps warm up 2, 8-10 warm up 3. A fixed 8 would leave nothing to cache on FLUX.1-schnell's
    4 steps or the tiny demo's 6. Unknown step count: 8.
    """
    if num_steps is None or num_steps >= WARMUP_REFERENCE_STEPS:
        return WARMUP_REFERENCE
    return max(1, -(-WARMUP_REFERENCE * num_steps // WARMUP_REFERENCE_STEPS))


def effective_warmup_steps(spec: DBCache, num_steps: int | None) -> int:
    """The warm-up a call of `num_steps` steps gets: the spec's int, or `auto_warmup_steps` for None."""
    return auto_warmup_steps(num_steps) if spec.warmup_steps is None else spec.warmup_steps


def resolve_steps_mask(mask: tuple[int, ...] | str | None, num_steps: int) -> tuple[int, ...] | None:
    """The 0/1 mask for `num_steps` steps: a named policy scaled from 28 steps, or an explicit list.

    An explicit list shorter than `num_steps` computes the remaining steps (1); a longer one is cut.
    """
    if not is_int(num_steps) or num_steps < 1:
        raise SpecError(f"resolve_steps_mask.num_steps: expected an int >= 1, got {num_steps!r}. Pass the number of "
                        "denoising steps of the generation (e.g. 28).")
    num_steps = int(num_steps)
    mask = to_tuple(plain(mask))
    if isinstance(mask, str) and mask not in MASK_POLICIES or not isinstance(mask, (str, tuple, type(None))) or (
            isinstance(mask, tuple) and (not mask or any(not is_int(v) or v not in (0, 1) for v in mask))):
        raise field_error("resolve_steps_mask", "mask", mask, f"one of {tuple(MASK_POLICIES)}, a non-empty 0/1 list or None")
    if mask is None:
        return None
    if isinstance(mask, str):
        base: list[int] = []
        for compute, cache in MASK_POLICIES[mask]:
            base += [1] * compute + [0] * cache
        if num_steps == len(base):
            return tuple(base)
        return _scale_mask(base, num_steps)
    return tuple(mask[:num_steps]) + (1,) * max(0, num_steps - len(mask))


def _scale_mask(base: list[int], n: int) -> tuple[int, ...]:
    """`base` (28 steps) stretched to `n` steps: the same share of computed steps, spread as in `base`.

    The cumulative count of computed steps along the schedule is what scales: `base`'s (linear between steps)
    read at the same relative positions and multiplied by the new total; step i computes where the rounded
    count goes up. So "fast" stays denser early and sparser late at any step count, and a faster policy never
    computes more steps than a slower one (sampling single steps of `base` did: "fast" computed 3 of 9 steps
    but 7 of 10). The first and last steps always compute.
    """
    m, total = len(base), sum(base)
    prefix = [0]
    for b in base:
        prefix.append(prefix[-1] + b)

    def computed_before(x: Fraction) -> Fraction:
        j = int(x)
        return Fraction(prefix[m]) if j >= m else prefix[j] + base[j] * (x - j)

    target = max(1, math.floor(Fraction(total * n, m) + Fraction(1, 2)))
    counts = [math.floor(computed_before(Fraction(i * m, n)) * target / total + Fraction(1, 2)) for i in range(n + 1)]
    scaled = [1 if counts[i + 1] > counts[i] else 0 for i in range(n)]
    scaled[0] = scaled[-1] = 1
    return tuple(scaled)


#: MagCache's retention: the first 20 % of the steps are always computed (`MagCacheConfig.retention_ratio`)
MAGNITUDE_RETENTION = 0.2


def rule_mask(spec: DBCache, num_steps: int, num_blocks: int) -> tuple[int, ...]:
    """The static 0/1 mask the "magnitude" or "schedule" rule (calibrated or not) decides for a call of `num_steps`
    steps.

    `num_blocks`: of the model (with `fn_blocks` + `bn_blocks` they give what a cached step still costs, which sets
    how many steps "schedule" may compute to reach `speedup`).
    """
    calibration = spec.calibration
    if spec.rule == "threshold":
        raise SpecError(f"rule_mask: expected a DBCache with rule 'magnitude' or 'schedule', got rule={spec.rule!r}.")
    # DBCache validated and resolved these: magnitude has its calibration and threshold, a calibration-free
    # schedule its spacing and last_computed, every rule its TaylorSeer order (not user input)
    if spec.rule == "magnitude":
        assert calibration is not None and spec.threshold is not None
        retention = (int(MAGNITUDE_RETENTION * num_steps + 0.5) if spec.warmup_steps is None
                     else min(spec.warmup_steps, num_steps))
        return magnitude_mask(calibration.ratios_for(num_steps), spec.threshold, spec.max_continuous_cached_steps,
                              retention)
    computed = schedule_computed_steps(spec, num_steps, num_blocks)
    forced = 1 if spec.warmup_steps is None else max(1, min(spec.warmup_steps, computed))
    if calibration is None:
        assert spec.spacing is not None and spec.last_computed is not None
        return generic_schedule(num_steps, computed, spec.spacing, spec.last_computed, forced)
    assert spec.taylorseer_order is not None
    return plan_schedule(calibration, num_steps, computed, spec.taylorseer_order, forced)


def schedule_computed_steps(spec: DBCache, num_steps: int, num_blocks: int) -> int:
    """How many of `num_steps` steps "schedule" computes: the most that keep the speed-up in executed block work
    (uncached block calls / block calls run) >= `spec.speedup`, a cached step running `fn_blocks + bn_blocks`."""
    speedup = float(spec.speedup or 1.0)
    share = (spec.fn_blocks + spec.bn_blocks) / num_blocks
    best = num_steps / (1 + (num_steps - 1) * share)  # one computed step, every other one cached
    if speedup > best + 1e-9:
        raise SpecError(
            f"DBCache.speedup: expected at most {best:.3g} for {num_steps} steps with fn_blocks={spec.fn_blocks} + "
            f"bn_blocks={spec.bn_blocks} of {num_blocks} blocks running on every cached step, got {speedup:g}. Lower "
            "the speed-up, or fn_blocks / bn_blocks (0 skips every block on a cached step).")
    # k computed steps cost k + (n - k) * share block-steps; the speed-up is n over that
    k = math.floor((num_steps / speedup - num_steps * share) / (1 - share) + 1e-9)
    return max(1, min(num_steps, k))
