"""DBCache's statistics and how they are shown: why no step was cached (`_no_cache_reason`, known before a call;
`_no_cached_reason` and `_no_cache_brief`, after it), the names a pipeline gives its transformer calls
(`branch_names`), the feature's `FeatureSummary` (`_summary`; its text: `_render`) and `plot_cache_diffs`.

Split from `hooks.py` (which re-exports `plot_cache_diffs`, `branch_names` and what its hooks call) because none of
it takes part in a decision: it reads the per-call state (`state.py`) and formats it; only `_no_cache_reason` runs
at a call's start, for its one warning. It imports no hooks, so `hooks.py` imports it without a circle.
"""

from __future__ import annotations

import functools
import inspect
import math
import re
import textwrap
from pathlib import Path
from typing import Any

from hookkit.core.summary import SUMMARY_WIDTH, FeatureSummary, Summary, table
from hookkit.errors import UnsupportedError
from hookkit.techniques.cache.state import NAME, _CallState, _Layout

PERCENTILES = (("P00", 0.0), ("P25", 25.0), ("P50", 50.0), ("P75", 75.0), ("P95", 95.0))


# --- statistics ---------------------------------------------------------------------------------------------


def _percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _diff_stats(diffs: list[float]) -> dict[str, float] | None:
    if not diffs:
        return None
    stats = {name: _percentile(diffs, q) for name, q in PERCENTILES}
    stats["min"] = min(diffs)
    stats["max"] = max(diffs)
    return stats


def _no_cache_cause(layout: _Layout, cs: _CallState) -> tuple[str, str] | None:
    """Why no step of this call can be cached, known before it runs, as (the reason with its fix, a few words);
    None when some step may be. Only what the spec and the step count decide: that the threshold rejected every
    step is said by `_no_cached_reason` once the call ran."""
    spec, n = layout.spec, cs.num_steps
    if n is None:
        return None
    if cs.mask is not None and not any(m == 0 for m in cs.mask):
        if spec.rule != "threshold":
            return (f"rule {spec.rule!r} plans all {n} steps of this call computed (speedup {spec.speedup}). Raise "
                    "DBCache(speedup=...) above 1 to cache.", f"the {spec.rule} rule computes all {n} steps")
        return (f"steps_mask computes all {n} steps of this call: no step may be cached. "
                "Give a mask with 0s (or a named policy).", f"the steps mask computes all {n} steps")
    if cs.static:
        return None
    if spec.threshold <= 0:
        return (f"threshold {spec.threshold} caches no step. Set DBCache(threshold=...) above 0 (default 0.24).",
                f"threshold {spec.threshold:g} caches no step")
    if spec.max_cached_steps == 0:
        return "max_cached_steps=0 caches no step. Set it to -1 (no limit) or above 0.", "max_cached_steps=0"
    if spec.max_continuous_cached_steps == 0:
        return ("max_continuous_cached_steps=0 caches no step. Set it to -1 (no limit) or above 0.",
                "max_continuous_cached_steps=0")
    if len(cs.warmup_steps()) >= n:
        return (f"warmup_steps={cs.warmup_given} covers all {n} steps of this call: no step may be cached. "
                f"Set DBCache(warmup_steps=...) below {n}, or leave it None (scaled to the step count).",
                f"warm-up covered all {n} (warmup_steps={cs.warmup_given})")
    return None


def _no_cache_reason(layout: _Layout, cs: _CallState) -> str | None:
    """Why no step of this call can be cached, known before it runs (None when some step may be)."""
    cause = _no_cache_cause(layout, cs)
    return None if cause is None else cause[0]


def _no_cached_reason(layout: _Layout, cs: _CallState | None) -> str | None:
    """Why a call that ran cached nothing: `_no_cache_reason`, or every measured diff at or above the threshold."""
    if cs is None or cs.transformer_calls == 0 or any(b.cached for b in cs.branches.values()):
        return None
    before = _no_cache_reason(layout, cs)
    if before is not None:
        return before
    diffs = [d for b in cs.branches.values() for d in b.diffs.values()]
    threshold = layout.spec.threshold
    if diffs:
        return (f"every measured diff ({len(diffs)} of them, smallest {min(diffs):.3g}) was at or above threshold "
                f"{threshold:g}. Random weights rarely cache (judge with trained weights); a higher threshold "
                "caches more steps at lower fidelity.")
    return None


def branch_names(pipeline: Any | None) -> tuple[str, ...]:
    """The names the pipeline gives its transformer calls within a step, in order: the literal names of its
    `transformer.cache_context("cond")` / `("uncond")` blocks in its `__call__` ("cond_uncond" where one call
    carries both halves of the CFG batch). Empty when it names none (or its source cannot be read): branches are
    then "branch 0", "branch 1"."""
    return () if pipeline is None else _cache_context_names(type(pipeline))


@functools.lru_cache(maxsize=64)
def _cache_context_names(pipeline_class: type) -> tuple[str, ...]:
    """`branch_names` of a pipeline class (read once per class: `summary()` may be called every generation)."""
    try:
        source = inspect.getsource(pipeline_class.__call__)
    except (OSError, TypeError):
        return ()
    names: list[str] = []
    for name in re.findall(r"""cache_context\(\s*["']([^"']+)["']""", source):
        if name not in names:
            names.append(name)
    return tuple(names)


def _branch_label(index: int, names: tuple[str, ...] | list[str]) -> str:
    return names[index] if index < len(names) else f"branch {index}"


def _no_cache_brief(layout: _Layout, cs: _CallState | None) -> str | None:
    """`_no_cached_reason` in a few words, for one line of `hookkit generate`'s output and the `-v` log: e.g.
    "warm-up covered 8, threshold 0.24 never reached (smallest diff 0.31)"."""
    if _no_cached_reason(layout, cs) is None or cs is None:
        return None
    cause = _no_cache_cause(layout, cs)
    if cause is not None:
        return cause[1]
    diffs = [d for b in cs.branches.values() for d in b.diffs.values()]
    warmup = len(cs.warmup_steps())
    return (f"warm-up covered {warmup}, " if warmup else "") + \
        f"threshold {layout.spec.threshold:g} never reached (smallest diff {min(diffs):.3g})"


def _summary(layout: _Layout, cs: _CallState | None, generation: int,
             names: tuple[str, ...] = ()) -> FeatureSummary:
    spec = layout.spec
    branches: dict[int, dict[str, Any]] = {}
    if cs is not None:
        for index in sorted(cs.branches):
            b = cs.branches[index]
            branches[index] = {
                "computed": list(b.computed), "cached": list(b.cached), "diffs": dict(b.diffs),
                "percentiles": _diff_stats(list(b.diffs.values())),
            }
    calls = cs.transformer_calls if cs is not None else 0
    data: dict[str, Any] = {
        "generation": generation,
        "threshold": spec.threshold,
        "steps_mask": list(spec.steps_mask) if isinstance(spec.steps_mask, tuple) else spec.steps_mask,
        "mask": list(cs.mask) if cs is not None and cs.mask is not None else None,
        "mask_policy": spec.mask_policy,
        "blocks": layout.num_blocks, "fn_blocks": spec.fn_blocks, "middle_blocks": layout.num_middle,
        "bn_blocks": spec.bn_blocks,
        "transformer_calls": calls,
        "block_calls": cs.block_calls if cs is not None else 0,
        "block_calls_uncached": calls * layout.num_blocks,
        "parallel": cs.parallel.describe() if cs is not None and cs.parallel is not None else None,
        "collectives": cs.collectives if cs is not None else 0,
        "branches": branches,
        "warmup_steps": cs.warmup_steps() if cs is not None else None,
        "rule": spec.rule,
        "speedup": spec.speedup, "spacing": spec.spacing, "last_computed": spec.last_computed,
        "calibrated": spec.calibration is not None,
        #: what a cached step reuses on this model ("residual" or "output": `DBCache.extrapolate`)
        "extrapolate": layout.extrapolate,
        "no_cache_reason": _no_cached_reason(layout, cs),
        "no_cache_brief": _no_cache_brief(layout, cs),
        #: denoising steps of the call (each branch runs them all): what "0 of N steps cached" counts
        "steps": max((len(b["computed"]) + len(b["cached"]) for b in branches.values()), default=0),
        #: each branch's name: the pipeline's `cache_context` name (cond, uncond) or "branch i"
        "branch_names": {index: _branch_label(index, names) for index in branches},
    }
    return FeatureSummary(name=NAME, data=data, text=_render(data), brief=_render(data, brief=True))


def _render(data: dict[str, Any], brief: bool = False) -> str:
    """The summary's text; `brief`: fitted to `SUMMARY_WIDTH` columns (diff percentiles as "P50" rather than
    "Diffs P50", long step lists wrapped)."""
    if data.get("rule", "threshold") == "threshold":
        mask = "no mask" if data["steps_mask"] is None else f"mask {data['steps_mask']!r} ({data['mask_policy']})"
        decides = f"threshold {data['threshold']}, {mask}"
    elif data["rule"] == "magnitude":
        decides = f"rule 'magnitude', threshold {data['threshold']}, planned before the call"
    else:
        plan = ("planned from its calibration" if data.get("calibrated")
                else f"no calibration (spacing {data.get('spacing'):g}, last {data.get('last_computed'):g})")
        decides = f"schedule {data.get('speedup'):g}x, {plan}"
    head = (f"DBCache F{data['fn_blocks']}B{data['bn_blocks']} (middle {data['middle_blocks']} of {data['blocks']} "
            f"blocks), {decides}")
    if data.get("extrapolate") == "output":
        head += "; cached steps reuse the transformer's output"
    if not data["branches"]:
        return head + "\nno transformer call in this generation yet"
    names = data.get("branch_names") or {}
    measured = any(b["percentiles"] for b in data["branches"].values())  # a rule deciding on diffs measured some
    rows = []
    for index, b in data["branches"].items():
        p = b["percentiles"]
        stats = [p[k] for k in ("P00", "P25", "P50", "P75", "P95", "min", "max")] if p else ["-"] * 7
        name = names.get(index, index)
        rows.append([index if name == f"branch {index}" else name, len(b["computed"]) + len(b["cached"]),
                     len(b["cached"]), *(stats if measured else [])])
    if brief:
        headers = ["Branch", "Steps", "Cached"] + (["Diff P00", "P25", "P50", "P75", "P95", "Min", "Max"] if measured
                                                    else [])
        lines = [head, table(headers, rows, width=SUMMARY_WIDTH)]
    else:
        headers = ["Branch", "Steps", "Cached Steps"] + (["Diffs P00", "Diffs P25", "Diffs P50", "Diffs P75",
                                                          "Diffs P95", "Diffs Min", "Diffs Max"] if measured else [])
        lines = [head, table(headers, rows)]
    for index, b in data["branches"].items():
        label = f"{names[index]} (branch {index})" if index in names and names[index] != f"branch {index}" \
            else f"branch {index}"
        line = f"{label} cached steps: {b['cached']}"
        lines.extend(textwrap.wrap(line, SUMMARY_WIDTH) if brief else [line])
    parallel = data.get("parallel")
    if parallel is not None:
        lines.append(f"context parallel: ulysses {parallel['ulysses']} x ring {parallel['ring']} over "
                     f"{parallel['world_size']} ranks; decisions global ({data['collectives']} all-reduces)")
    total = data["block_calls_uncached"]
    share = f" ({100.0 * data['block_calls'] / total:.1f}%)" if total else ""
    lines.append(f"block calls run: {data['block_calls']} of {total}{share}")
    if data["no_cache_reason"]:
        if brief and data.get("no_cache_brief"):
            lines.append(f"no step cached: {data['no_cache_brief']}")
        else:
            lines.append(f"no step cached: {data['no_cache_reason']}")
    return "\n".join(lines)


def plot_cache_diffs(source: Any | Summary | FeatureSummary | dict[str, Any], path: str | Path) -> Path:
    """Write a PNG of each branch's diff per step against the threshold, cached steps shaded. The "magnitude" and
    "schedule" rules (`DBCache()`) measure no diff: their plot shades the cached steps only.

    `source`: a handle, its `summary()`, the DBCache `FeatureSummary`, or that summary's `data`.
    """
    data = _plot_data(source)
    from hookkit.diagnostics.plot import pyplot

    plt = pyplot("plot_cache_diffs")
    branches = data["branches"]
    measured = data.get("rule", "threshold") == "threshold"  # the other rules decide before the call
    fig, axes = plt.subplots(max(1, len(branches)), 1, figsize=(8, 3 * max(1, len(branches))), squeeze=False)
    for ax, (index, b) in zip(axes[:, 0], branches.items() or [(0, None)]):
        if measured and data["threshold"] is not None:
            ax.axhline(data["threshold"], color="tab:red", linestyle="--", label=f"threshold {data['threshold']}")
        if b is not None:
            for i, step in enumerate(b["cached"]):
                ax.axvspan(step - 0.5, step + 0.5, color="tab:green", alpha=0.2, linewidth=0,
                           label="cached" if i == 0 and not measured else None)
            steps = sorted(b["diffs"])
            if measured:
                ax.plot(steps, [b["diffs"][s] for s in steps], marker="o", label="Fn residual diff")
                cached = [s for s in steps if s in set(b["cached"])]
                ax.scatter(cached, [b["diffs"][s] for s in cached], color="tab:green", zorder=3, label="cached")
            ax.set_xlim(-0.5, len(b["computed"]) + len(b["cached"]) - 0.5)
        ax.set_xlabel("step")
        if measured:
            ax.set_title(f"DBCache branch {index}: cached steps shaded")
            ax.set_ylabel("relative L1 diff")
        else:
            ax.set_title(f"DBCache branch {index}, rule {data['rule']!r} (decided before the call, no diff measured): "
                         "cached steps shaded", fontsize="medium")
            ax.set_yticks([])
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper right")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, format="png")
    plt.close(fig)
    return out


def _plot_data(source: Any) -> dict[str, Any]:
    if isinstance(source, dict):
        return source
    if isinstance(source, FeatureSummary):
        return source.data
    summary = source.summary() if hasattr(source, "summary") and callable(source.summary) else source
    if isinstance(summary, Summary) and NAME in summary.features:
        return summary.features[NAME].data
    raise UnsupportedError(
        f"plot_cache_diffs: expected a handle with DBCache enabled, its summary(), the DBCache FeatureSummary or "
        f"its data, got {type(source).__name__} without DBCache statistics. "
        "Enable hookkit.Spec(cache=hookkit.DBCache(...))."
    )
