"""What `hookkit bench` prints and writes: the markdown table (medians, spread, speed-up, PSNR, notes), the JSON
report with the environment it ran in, and the merge of reports run in groups."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import hookkit
from hookkit.core.summary import table
from hookkit.errors import SpecError
from hookkit.tools.bench.metrics import device_description
from hookkit.tools.bench.models import ModelOptions, available_fields, output_type_for, resolve_device, resolve_dtype


def cache_stats(features: dict[str, Any]) -> tuple[int, int] | None:
    """(cached, total) transformer steps from the DBCache summary data, summed over CFG branches."""
    data = features.get("cache") or features.get("dbcache")  # "dbcache": result files written before 0.1
    if not isinstance(data, dict) or not isinstance(data.get("branches"), dict):
        return None
    cached = total = 0
    for branch in data["branches"].values():
        cached += len(branch.get("cached", ()))
        total += len(branch.get("cached", ())) + len(branch.get("computed", ()))
    return cached, total


def _cached_steps(features: dict[str, Any]) -> str | None:
    stats = cache_stats(features)
    return None if stats is None else f"cached {stats[0]}/{stats[1]} steps"


def attention_fallbacks(features: dict[str, Any]) -> str | None:
    """A note when the row's attention kernel left SDPA calls to "native": per-call fallbacks (eager blocks) and call
    sites traced into compiled blocks that fall back, each with its reason. A row that claims a kernel must say
    where it did not run."""
    data = features.get("attention")
    if not isinstance(data, dict):
        return None
    reasons: dict[str, int] = {}
    for key, n in (data.get("fallbacks") or {}).items():  # "phase/kernel/reason"
        reason = key.split("/", 2)[-1]
        reasons[reason] = reasons.get(reason, 0) + n
    for key, n in (data.get("compiled_call_sites") or {}).items():  # "kernel" or "kernel/reason"
        if "/" in key:
            reason = key.split("/", 1)[1]
            reasons[reason] = reasons.get(reason, 0) + n
    if not reasons:
        return None
    return "attention fell back to SDPA: " + ", ".join(f"{r} ({n}x)" for r, n in sorted(reasons.items()))


def attention_rows(features: dict[str, Any]) -> str | None:
    """A note when the row's attention kernel took padding masks as their validity rows (`outer_masks`: the S x S
    mask neither classified nor, compiled, built), counted as the summary counts them: eager calls and call sites
    traced into compiled blocks. What the kernel ran is part of what the row measures."""
    data = features.get("attention")
    rows = data.get("padding_masks_as_rows") if isinstance(data, dict) else None
    if not isinstance(rows, dict):
        return None
    calls = sum((rows.get("calls") or {}).values())
    sites = sum((rows.get("compiled_call_sites") or {}).values())
    taken = [f"{n} {what}{'s' if n != 1 else ''}" for n, what in ((calls, "call"), (sites, "compiled call site")) if n]
    return "padding masks taken as validity rows: " + ", ".join(taken) if taken else None


def spread(row: dict[str, Any]) -> tuple[float, float] | None:
    """(min, max) of a row's timed runs, None without them (a skipped row, or an older JSON)."""
    latencies = row.get("latencies_s") or []
    return (min(latencies), max(latencies)) if row.get("status") == "ok" and latencies else None


def unresolved(row: dict[str, Any], reference: dict[str, Any]) -> str | None:
    """A note when the row's or the reference's spread (max - min) is larger than the latency difference the
    row claims against the reference: on a busy host the speed-up (or slow-down) is then noise."""
    if row is reference or row.get("status") != "ok" or reference.get("status") != "ok":
        return None
    mine, theirs = spread(row), spread(reference)
    if mine is None or theirs is None:
        return None
    width = max(mine[1] - mine[0], theirs[1] - theirs[0])
    diff = abs(reference["latency_s"] - row["latency_s"])
    if width <= diff:
        return None
    return (f"not resolved: spread {width:.4f} s > the {diff:.4f} s difference to {reference['config']} "
            "(a busy host? more --runs)")


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """The results as a markdown table (also readable in a terminal): the median of the timed runs and their
    spread (min-max), and a note on rows whose spread is larger than the difference they claim to the first row.

    Rows measured with a timing caveat (`metrics.timing_caveat`: a tiny model on the CPU) say so in a note above the
    table and under it, their median and speed-up marked ¹: a newcomer's first `hookkit bench` must not read as a
    performance claim."""
    caveats = list(dict.fromkeys(row["timing_caveat"] for row in rows
                                 if row["status"] == "ok" and row.get("timing_caveat")))
    out = []
    for i, row in enumerate(rows):
        ok = row["status"] == "ok"
        notes = [] if ok else [f"{row['status']}: {row['note']}"]
        if ok and row["note"]:
            notes.append(row["note"])
        flag = unresolved(row, rows[0]) if rows else None
        if flag:
            notes.append(flag)
        cached = _cached_steps(row.get("features") or {})
        if cached:
            notes.append(cached)
        for component, features in (row.get("companion_features") or {}).items():
            cached = _cached_steps(features)
            if cached:
                notes.append(f"{component}: {cached}")
        fallbacks = attention_fallbacks(row.get("features") or {})
        if fallbacks:
            notes.append(fallbacks)
        as_rows = attention_rows(row.get("features") or {})
        if as_rows:
            notes.append(as_rows)
        if ok and row.get("cold") is not None and row.get("time_to_first_image_s") is not None:
            notes.append(f"cold caches: first image {row['time_to_first_image_s']:.1f} s after enable")
        if ok and row.get("graphs_compiled_while_timed"):
            notes.append(f"{row['graphs_compiled_while_timed']} graph(s) compiled during the timed runs: add warm-up")
        if row.get("nonfinite"):
            plural = "s" if row["nonfinite"] != 1 else ""
            notes.append(f"{row['nonfinite']} non-finite output value{plural}: no PSNR")
        if i == 0 and ok and row["config"] == "eager":
            psnr_cell = "reference (non-finite)" if row.get("nonfinite") else "reference"
        elif row["identical"]:
            psnr_cell = "inf (bitwise equal)"
        elif row["psnr_db"] is not None:
            psnr_cell = f"{row['psnr_db']:.2f}"
        else:
            psnr_cell = "—"
        bounds = spread(row)
        mark = " ¹" if ok and row.get("timing_caveat") else ""
        out.append([
            row["config"],
            f"{row['latency_s']:.4f}{mark}" if ok else "—",
            f"{bounds[0]:.4f}–{bounds[1]:.4f}" if bounds else "—",
            f"{row['warmup_s']:.2f}" if ok and row["warmup_s"] is not None else "—",
            f"{row['peak_memory_gb']:.3f}" if ok else "—",
            speedup_cell(row, mark, reference=i == 0 and row["config"] == "eager") if ok else "—",
            psnr_cell,
            "; ".join(notes),
        ])
    text = table(["config", "median latency (s)", "spread min–max (s)", "warm-up (s)", "peak mem (GB)", "speed-up",
                  "PSNR vs eager (dB)", "notes"], out)
    if not caveats:
        return text
    above = "\n".join(f"Note: {caveat}." for caveat in caveats)
    below = "\n".join(f"¹ {caveat}." for caveat in caveats)
    return f"{above}\n\n{text}\n\n{below}"


def speedup_cell(row: dict[str, Any], mark: str, reference: bool) -> str:
    """The table's speed-up of an ok row: none for a row whose output holds non-finite values (a wrong answer is no
    speed-up; the eager reference keeps its 1.00x), none without an eager row."""
    if row["speedup"] is None:
        return "—"
    if row.get("nonfinite") and not reference:
        return "— (non-finite output)"
    return f"{row['speedup']:.2f}x{mark}"


def environment(device: torch.device) -> dict[str, Any]:
    """Versions, the device and the installed features: what a reader needs to place a measurement."""
    import platform

    import diffusers

    return dict(hookkit=hookkit.__version__, torch=torch.__version__, diffusers=diffusers.__version__,
                python=platform.python_version(), device=device_description(device),
                hookkit_features=sorted(available_fields()))


def report(rows: list[dict[str, Any]], notes: list[str], opts: ModelOptions, runs: int, warmup: int,
           argv: Sequence[str]) -> dict[str, Any]:
    """The JSON document `hookkit bench --json` writes."""
    device = resolve_device(opts.device)
    memory = "CUDA max_memory_allocated" if device.type == "cuda" else "CPU peak RSS of the process"
    return dict(
        command=["hookkit", *argv], environment=environment(device),
        model=dict(name=opts.name, full=opts.full, model_path=opts.model_path, steps=opts.num_steps(),
                   height=opts.height, width=opts.width, batch=opts.batch, seed=opts.seed,
                   dtype=str(resolve_dtype(opts.dtype, device)).removeprefix("torch."),
                   output=output_type_for(opts)),
        runs=runs, warmup=warmup, memory=memory, notes=notes, rows=rows,
    )


def read_report(path: Path) -> dict[str, Any]:
    """A `hookkit bench --json` file, or a SpecError that says what is wrong with it."""
    expected = "expected a JSON file written by `hookkit bench --json`"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise SpecError(f"--merge {path}: no such file; {expected}.") from None
    except (OSError, ValueError) as exc:
        raise SpecError(f"--merge {path}: {expected}, could not read it ({exc}).") from None
    missing = [k for k in ("command", "environment", "model", "runs", "warmup", "notes", "rows")
               if not isinstance(data, dict) or k not in data]
    if missing:
        raise SpecError(f"--merge {path}: {expected}, but it has no {missing[0]!r} key.")
    return data


#: the note of a run without its eager row (`hookkit bench --no-eager`), and what `merge_reports` says of its rows
NO_EAGER_NOTE = ("no eager row (--no-eager): no speed-up or PSNR here; `hookkit bench --merge` with a run that has "
                 "one gives speed-ups against it")
MERGED_NO_EAGER_NOTE = "rows of a run without its eager row (--no-eager): speed-up against file 1's eager row, no PSNR"


def merge_reports(reports: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One report from several `hookkit bench --json` files of the same model, settings and machine.

    Long matrices are run in groups (one command each, each group starting with its own eager row, or none with
    `--no-eager`). The first file's eager row is the reference: later rows get their speed-up recomputed against it
    and keep the PSNR measured against their own group's eager run, where it had one (same seed, so the same weights
    and inputs).
    A configuration already present is not repeated.
    """
    if not reports:
        raise SpecError("--merge: expected at least one JSON file written by `hookkit bench --json`.")
    first = reports[0]
    for i, other in enumerate(reports[1:], 2):
        for key in ("model", "runs", "warmup"):
            if other.get(key) != first.get(key):
                raise SpecError(f"--merge: file {i} has {key}={other.get(key)!r}, file 1 has {first.get(key)!r}; "
                                "merge only runs of the same model and settings.")
        if other["environment"]["device"] != first["environment"]["device"]:
            raise SpecError(f"--merge: file {i} ran on {other['environment']['device']!r}, file 1 on "
                            f"{first['environment']['device']!r}; merge only runs of one machine.")
    rows = [dict(row) for row in first["rows"]]
    reference = rows[0]
    if reference["config"] != "eager":
        raise SpecError("--merge: expected file 1 to start with its eager row (the reference of every speed-up), "
                        f"got {reference['config']!r} first; put a run without --no-eager first.")
    seen = {row["config"] for row in rows}
    notes = list(first["notes"])
    for other in reports[1:]:
        for row in other["rows"]:
            if row["config"] in seen:
                continue
            row = dict(row)
            if row["status"] == "ok" and reference["status"] == "ok":
                row["speedup"] = reference["latency_s"] / row["latency_s"]
            rows.append(row)
            seen.add(row["config"])
        other_notes = [MERGED_NO_EAGER_NOTE if n == NO_EAGER_NOTE else n for n in other["notes"]]
        notes += [n for n in other_notes if n not in notes]
    return {**first, "command": [r["command"] for r in reports], "notes": notes, "rows": rows}


def _finite(value: Any) -> Any:
    """`value` with every NaN/Infinity float (e.g. in a feature's statistics) replaced by its string."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def to_json(data: Any, indent: int | None = None) -> str:
    """Strict JSON (no NaN/Infinity: strict parsers reject them). Bitwise-equal outputs have
    `psnr_db: null`, `identical: true`; anything that is not JSON becomes its string."""
    return json.dumps(_finite(data), indent=indent, allow_nan=False, default=str)


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_json(data, indent=2) + "\n")
