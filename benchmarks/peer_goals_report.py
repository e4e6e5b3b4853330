"""The peer goals on one lease: one markdown table and one JSON document from the suites of `benchmarks/queue.sh`.

Reads, under the queue's result folder, the `hookkit bench-one` rows of the peers-* suites
(`<res>/<suite>/<config>.json`), the step profile (`step-profile/` or `fp8-rows/`), the fp8 quality
(`quality-fp8/` or `quality-fp8-compiled/`) and `held-memory/held_memory.json`, whatever of them exists (a suite the
lease did not reach is listed as such), and checks each goal (Flux-dev and Qwen-Image latency and memory beside the
strongest peer, cache-dit, in the same run; the uncached fp8 step) against the numbers. `queue.sh collect` runs it:

    python benchmarks/peer_goals_report.py /tmp/hkqueue/res --out "$OUT"     # writes peer_goals.md, peer_goals.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

#: the rows' configurations (benchmarks/suite_lib.sh sets them, QUICK=1 to CPU-runnable ones; the queue records them)
FAST = os.environ.get("FAST", "hookkit-fp8+cache-fast+cuda-graphs")
MOD = os.environ.get("MOD", "hookkit-fp8-mod+cache-fast+cuda-graphs")
DYN = os.environ.get("DYN", "hookkit-fp8+cache-dyn+cuda-graphs")
PEER = os.environ.get("PEER", "cache-dit+fp8+compile")
AUTOTUNE = os.environ.get("AUTOTUNE", "hookkit-fp8-mod+cache-fast+cuda-graphs+autotune")
UNCACHED = os.environ.get("UNCACHED", "hookkit-fp8-mod+cuda-graphs")
FASTEST = (FAST, MOD, AUTOTUNE)


def _steps(runs: str) -> int:
    """The step count of the queue's `RUNS` arguments (`--steps N`; 28 when absent)."""
    words = runs.split()
    return int(words[words.index("--steps") + 1]) if "--steps" in words[:-1] else 28


#: denoising steps per pipeline call (the uncached row's time / STEPS is its step)
STEPS = _steps(os.environ.get("RUNS", ""))
#: group -> (model, size, cold, configs in table order)
GROUPS: dict[str, tuple[str, int, bool, tuple[str, ...]]] = {
    "flux-1024-cold": ("flux", 1024, True, (FAST, MOD, PEER)),
    "flux-1024": ("flux", 1024, False, (FAST, MOD, AUTOTUNE, UNCACHED, PEER)),
    "flux-512": ("flux", 512, False, (FAST, DYN, MOD, PEER)),
    "qwen-1024": ("qwenimage", 1024, False, (FAST, MOD, PEER)),
    "flux-256": ("flux", 256, False, (FAST, MOD, PEER)),
}
#: group -> the suites (benchmarks/suites/NAME.sh) whose folders hold its rows, first found wins
GROUP_SUITES: dict[str, tuple[str, ...]] = {
    "flux-1024-cold": ("peers-flux-1024-cold",),
    "flux-1024": ("peers-flux-1024", "autotune-flux-1024"),
    "flux-512": ("peers-flux-512",),
    "qwen-1024": ("peers-qwen-1024",),
    "flux-256": ("peers-flux-256",),
}


def _load(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _spread(row: dict[str, Any]) -> float | None:
    lat = row.get("latencies_s") or []
    return 100.0 * (max(lat) - min(lat)) / statistics.median(lat) if len(lat) > 1 else None


def _cached(row: dict[str, Any]) -> str:
    data = (row.get("features") or {}).get("dbcache") or (row.get("features") or {}).get("cache") or {}
    branches = data.get("branches") or {}
    cached = sum(len(b.get("cached", [])) for b in branches.values())
    total = sum(len(b.get("cached", [])) + len(b.get("computed", [])) for b in branches.values())
    return f"{cached}/{total}" if total else "—"


def _f(value: Any, fmt: str) -> str:
    return format(value, fmt) if isinstance(value, (int, float)) else "—"


def _first(res: Path, suites: tuple[str, ...], name: str) -> Any:
    """The JSON document `name` of the first of these suites' folders that holds one (None when none does)."""
    return next((doc for suite in suites if (doc := _load(res / suite / name)) is not None), None)


def collect(res: Path) -> dict[str, Any]:
    """Every group's rows (a missing row: "not reached"), the step profile, the quality and the held memory."""
    groups: dict[str, Any] = {}
    for name, (model, size, cold, configs) in GROUPS.items():
        rows = []
        for config in configs:
            row = _first(res, GROUP_SUITES[name], f"{config}.json")
            rows.append(row if isinstance(row, dict) else {"config": config, "status": "not reached", "note": ""})
        groups[name] = dict(model=model, size=size, cold=cold, rows=rows)
    return dict(groups=groups, step_profile=_first(res, ("step-profile", "fp8-rows"), "step_profile.json"),
                quality=_first(res, ("quality-fp8", "quality-fp8-compiled"), "quality.json"),
                held_memory=_first(res, ("held-memory",), "held_memory.json"))


def _ok(rows: list[dict[str, Any]], config: str) -> dict[str, Any] | None:
    """The row of `config` where it ran and its output held no non-finite value (a fast NaN row meets no goal)."""
    row = next((r for r in rows if r.get("config") == config), None)
    return row if row is not None and row.get("status") == "ok" and not row.get("nonfinite") else None


def goals(doc: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(goal, measured, verdict) for every goal that the numbers can answer."""
    out: list[tuple[str, str, str]] = []

    def verdict(ok: bool | None) -> str:
        return "not measured" if ok is None else "met" if ok else "missed"

    for name in ("flux-1024-cold", "flux-1024", "qwen-1024"):
        # Flux-dev: <= 12.6 GB; Qwen-Image (20 B parameters, above that in fp8 alone): less memory than the peer. Both
        # against the peer measured in the same run: without it a met time is said as such, not as the goal met.
        memory = "<= 12.6 GB" if name.startswith("flux") else "less memory than the peer"
        goal = f"{name}: hookkit fastest <= 1.08 s and {memory}, beside the peer in this run"
        rows = doc["groups"][name]["rows"]
        best = min((r for c in FASTEST if (r := _ok(rows, c))), key=lambda r: r["latency_s"], default=None)
        peer = _ok(rows, PEER)
        if best is None:
            out.append((goal, "—", verdict(None)))
            continue
        gb = best["peak_memory_gb"] or 99
        if name.startswith("flux"):
            ok = best["latency_s"] <= 1.08 and gb <= 12.6
        else:
            ok = best["latency_s"] <= 1.08 and (peer is None or gb < (peer["peak_memory_gb"] or 0))
        vs = f", peer {peer['latency_s']:.3f} s / {peer['peak_memory_gb']:.2f} GB" if peer else ", peer not measured"
        said = verdict(ok) if peer is not None or not ok else "met without the peer in this run (not the goal)"
        out.append((goal, f"{best['config']}: {best['latency_s']:.3f} s, {best['peak_memory_gb']:.2f} GB{vs}", said))
    rows = doc["groups"]["flux-1024-cold"]["rows"]
    hk, peer = _ok(rows, FASTEST[0]), _ok(rows, PEER)
    if hk is not None:
        ttfi = hk.get("time_to_first_image_s")
        ok = ttfi is not None and ttfi <= 30 and (peer is None or ttfi <= peer["time_to_first_image_s"] / 5)
        peer_text = f", peer {peer['time_to_first_image_s']:.1f} s" if peer else ", peer not measured"
        out.append(("cold start 1024²: <= 30 s and <= 1/5 of the peer's", f"hookkit {ttfi:.1f} s{peer_text}",
                    verdict(ok if peer is not None else None)))
    for name in ("flux-512", "flux-256"):
        rows = doc["groups"][name]["rows"]
        best = min((r for c in FASTEST if (r := _ok(rows, c))), key=lambda r: r["latency_s"], default=None)
        peer = _ok(rows, PEER)
        ratio = peer["latency_s"] / best["latency_s"] if best and peer else None
        out.append((f"{name}: hookkit fastest >= 1.3x faster than the peer", _f(ratio, ".2f") + "x", verdict(
            None if ratio is None else ratio >= 1.3)))
    rows = doc["groups"]["flux-512"]["rows"]
    dyn, static = _ok(rows, DYN), _ok(rows, FAST)
    if dyn and static:
        r = dyn["latency_s"] / static["latency_s"]
        same = _cached(dyn) == _cached(static)
        out.append(("dynamic DBCache under graphs, 512²: within 5 % of static-mask graphs, same steps",
                    f"{dyn['latency_s']:.3f} s vs {static['latency_s']:.3f} s ({100 * (r - 1):+.1f} %), cached "
                    f"{_cached(dyn)} vs {_cached(static)}", verdict(r <= 1.05 and same)))
    else:
        out.append(("dynamic DBCache under graphs, 512²: within 5 % of static-mask graphs", "—", verdict(None)))
    # the uncached step: in the pipeline (the uncached row's time / steps) where it ran, else the step profile's GPU time
    # per call (its best variant)
    uncached = _ok(doc["groups"]["flux-1024"]["rows"], UNCACHED)
    prof = doc.get("step_profile") or {}
    best = min((r for r in prof.get("rows", []) if r.get("status") == "ok"), key=lambda r: r["step_ms"], default=None)
    parts, ok = [], None
    if uncached is not None:
        step = 1e3 * uncached["latency_s"] / STEPS
        parts.append(f"pipeline {step:.1f} ms ({uncached['config']}, {uncached['latency_s']:.3f} s / {STEPS})")
        ok = step <= 92
    if best is not None:
        parts.append(f"step profile best {best['variant']} {best['step_ms']:.1f} ms")
        ok = best["step_ms"] <= 92 if ok is None else ok
    out.append(("uncached fp8 step at 1024² <= 92 ms", "; ".join(parts) or "—", verdict(ok)))
    return out


def markdown(doc: dict[str, Any]) -> str:
    quick = os.environ.get("QUICK") == "1"
    title = "# peer goals: CPU plumbing check (QUICK=1: tiny models, CPU stand-in rows; the numbers mean nothing)" \
        if quick else "# peer goals on one lease"
    lines = [title, "", "| group | config | status | median (s) | spread (%) | peak (GB) | "
             "first call (s) | to first image (s) | cached | note |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, group in doc["groups"].items():
        for r in group["rows"]:
            ok = r.get("status") == "ok"
            lines.append(f"| {name} | {r.get('config')} | {r.get('status')} | {_f(r.get('latency_s') if ok else None, '.3f')} | "
                         f"{_f(_spread(r) if ok else None, '.1f')} | {_f(r.get('peak_memory_gb') if ok else None, '.2f')} | "
                         f"{_f(r.get('first_call_s') if ok else None, '.1f')} | "
                         f"{_f(r.get('time_to_first_image_s') if ok else None, '.1f')} | {_cached(r) if ok else '—'} | "
                         f"{(r.get('note') or '')[:120]} |")
    prof = doc.get("step_profile")
    if prof:
        groups = prof.get("groups", [])
        lines += ["", f"## step profile (Flux {prof.get('size')}², uncached, fp8 + transformer graphs; floor "
                      f"{prof.get('floor_ms')} ms)", "", "| variant | step (ms) | kernels (ms) | " + " | ".join(groups) + " |",
                  "|" + "---|" * (len(groups) + 3)]
        for r in prof.get("rows", []):
            if r.get("status") != "ok":
                lines.append(f"| {r['variant']} | {r['status']}: {r.get('note', '')[:80]} |" + " |" * (len(groups) + 1))
                continue
            lines.append(f"| {r['variant']} | {r['step_ms']:.2f} | {r['kernel_ms']:.2f} | "
                         + " | ".join(f"{r['groups_ms'].get(g, 0):.2f}" for g in groups) + " |")
    quality = doc.get("quality")
    if quality:
        lines += ["", "## quality on the trained tiny Flux (vs bf16 uncached)", "",
                  "| config | PSNR (dB) | min PSNR | SSIM | recognised | note |", "|---|---|---|---|---|---|"]
        for r in quality.get("rows", []):
            lines.append(f"| {r['name']} | {_f(r.get('psnr_db'), '.2f')} | {_f(r.get('psnr_min_db'), '.2f')} | "
                         f"{_f(r.get('ssim'), '.4f')} | {_f(r.get('recognised'), '.0%')} | {r.get('note', '')[:80]} |")
    lines += ["", "## goals", "", "| goal | measured | verdict |", "|---|---|---|"]
    lines += [f"| {g} | {m} | {v} |" for g, m, v in goals(doc)]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("res", help="the queue's result folder ($W/res of benchmarks/queue.sh)")
    p.add_argument("--out", default=None, help="where peer_goals.md and peer_goals.json go (default: RES)")
    args = p.parse_args()
    res = Path(args.res)
    doc = collect(res)
    doc["goals"] = [dict(goal=g, measured=m, verdict=v) for g, m, v in goals(doc)]
    out = Path(args.out) if args.out else res
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(doc)
    (out / "peer_goals.md").write_text(text + "\n")
    (out / "peer_goals.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
