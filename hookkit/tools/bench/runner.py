"""Running the matrix: each row in its own `python -m hookkit bench-one` process (so that one configuration's
compiled graphs, CUDA graphs, allocator state or global settings cannot leak into the next), the measurement in
that process, fresh compiler caches for `--cold`, and the comparison of every row with the eager one."""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

import hookkit
from hookkit.errors import SpecError
from hookkit.tools.bench.metrics import _dynamo_graphs, _peak_memory_gb, psnr, synchronize, timed, timing_caveat
from hookkit.tools.bench.models import (
    ModelOptions,
    available_fields,
    call_kwargs,
    load_pipeline,
    output_of,
    output_type_for,
    resolve_device,
)
from hookkit.tools.bench.row import BenchConfig, RunContext, _empty_row


def _summary_data(handle: Any) -> dict[str, Any]:
    if handle is None:
        return {}
    summary = handle.summary()
    return {name: feature.data for name, feature in summary.features.items()}


def _companion_data(handle: Any) -> dict[str, dict[str, Any]]:
    """Per further transformer of a several-transformer pipeline (Wan 2.2's `transformer_2`): its features' data, by
    component name. Why: its cache decides its own steps (its first step has no residual of its own to reuse)."""
    if handle is None:
        return {}
    return {c.component: {name: feature.data for name, feature in c.features.items()}
            for c in handle.summary().companions}


def measure(config: BenchConfig, opts: ModelOptions, runs: int, warmup: int, out_dir: Path) -> dict[str, Any]:
    """Build a fresh pipeline, set `config` up, warm up, time `runs` calls; save the last output as .pt."""
    device = resolve_device(opts.device)
    reason = config.unavailable(device, available_fields())
    if reason is not None:
        return _empty_row(config, "skipped", reason)
    row = _empty_row(config, "ok", "")
    try:
        t0 = time.perf_counter()
        pipe = load_pipeline(opts)
        row["load_s"] = time.perf_counter() - t0
        ctx = RunContext(pipe=pipe, opts=opts)
        graphs_before = _dynamo_graphs()
        t0 = time.perf_counter()
        config.setup(ctx)
        row["setup_s"] = time.perf_counter() - t0
        output_type = output_type_for(opts)
        t0 = time.perf_counter()
        for i in range(warmup):
            output_of(pipe(**call_kwargs(pipe, opts, output_type)))
            if i == 0:
                synchronize(device)
                row["first_call_s"] = time.perf_counter() - t0
        synchronize(device)
        row["warmup_s"] = time.perf_counter() - t0
        graphs_warm = _dynamo_graphs()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        latencies = []
        output = None
        for _ in range(runs):
            kwargs = call_kwargs(pipe, opts, output_type)
            seconds, output = timed(lambda: output_of(pipe(**kwargs)), device)
            latencies.append(seconds)
        row["latencies_s"] = latencies
        if warmup == 0:
            row["first_call_s"] = latencies[0]
        # what a user waits for after building the pipeline: enable (quantize, hooks) plus the first call
        # (compilation, autotuning, graph capture)
        row["time_to_first_image_s"] = row["setup_s"] + row["first_call_s"]
        row["cold"] = cold_cache_dirs()
        row["timing_caveat"] = timing_caveat(device, tiny=not opts.full and opts.model_path is None)
        # a graph compiled after the warm-up means the timed runs include compilation: the median is suspect
        graphs_after = _dynamo_graphs()
        row["compiled_graphs"] = graphs_after - graphs_before
        row["graphs_compiled_while_timed"] = graphs_after - graphs_warm
        row["latency_s"] = statistics.median(latencies)
        row["peak_memory_gb"], row["memory_kind"] = _peak_memory_gb(device)
        row["features"] = _summary_data(ctx.handle) if ctx.features is None else ctx.features()
        if ctx.features is None:
            row["companion_features"] = _companion_data(ctx.handle)
        else:
            row["companion_features"] = ctx.companion_features() if ctx.companion_features is not None else {}
        torch.save(output.detach().float().cpu(), out_dir / f"{config.name}.pt")
    except Exception as exc:  # a failing configuration is a result, not a crash
        traceback.print_exc(file=sys.stderr)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        row.update(status="failed", note=f"{type(exc).__name__}: {first}"[:300])
    return row


# --- the matrix (in the parent process) ------------------------------------------------------------------


#: The compiler caches `--cold` points at fresh, empty folders in each row's process: inductor's (FX graphs,
#: AOTAutograd, autotuning results, generated kernels) and Triton's (compiled kernels).
COLD_CACHE_VARS = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


def cold_env(root: Path, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a `--cold` row's process: `environ` (default: this process's) with every compiler
    cache in `COLD_CACHE_VARS` pointed at a new empty folder under `root`, so that nothing compiled by an
    earlier row or run is reused."""
    env = dict(os.environ if environ is None else environ)
    for var in COLD_CACHE_VARS:
        folder = root / var.lower()
        folder.mkdir(parents=True, exist_ok=False)
        env[var] = str(folder)
    env[COLD_VARIABLE] = "1"
    return env


#: the environment variable that marks a row's process as cold: `--cold` sets it for its rows (benchmarks/suite_lib.sh
#: for the bench-one rows it points at fresh caches itself)
COLD_VARIABLE = "HOOKKIT_BENCH_COLD"


def cold_from_environment() -> bool:
    """Whether `$HOOKKIT_BENCH_COLD` marks this process's row as cold: "1" yes; unset, empty or "0" no; anything else
    a SpecError naming the variable and what it takes (checked before a row is timed, not read as "warm")."""
    value = os.environ.get(COLD_VARIABLE, "").strip()
    if value in ("", "0"):
        return False
    if value == "1":
        return True
    raise SpecError(f"{COLD_VARIABLE}={value!r}: expected 1 (the row's compiler caches are fresh and empty; `hookkit "
                    f"bench --cold` sets it for its rows), 0 or unset, got {value!r}. Unset it, or use "
                    "`hookkit bench --cold`.")


def cold_cache_dirs() -> dict[str, Any] | None:
    """In a row's process: the fresh cache folders `--cold` gave it, or None for a warm row."""
    if not cold_from_environment():
        return None
    return {var: os.environ.get(var) for var in COLD_CACHE_VARS}


def _files_under(folder: str | None) -> int:
    return sum(len(files) for _, _, files in os.walk(folder)) if folder else 0


def run_matrix(configs: Sequence[BenchConfig], opts: ModelOptions, runs: int, warmup: int, timeout_s: float,
               out_dir: Path | None = None, log: Callable[[str], None] = print,
               cold: bool = False) -> list[dict[str, Any]]:
    """Run each configuration in its own `python -m hookkit bench-one` process; rows in `configs` order.

    `cold`: every row's process gets fresh, empty compiler cache folders (`cold_env`), deleted after the row;
    its `first_call_s` and `time_to_first_image_s` then include all compilation and autotuning.
    """
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        if out_dir is None:
            out_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="hookkit-bench-")))
        out_dir.mkdir(parents=True, exist_ok=True)
        device, have = resolve_device(opts.device), available_fields()
        adapter = hookkit.get_adapter(opts.name)
        for i, config in enumerate(configs, 1):
            log(f"[{i}/{len(configs)}] {config.name}: {config.description}")
            reason = config.unavailable(device, have, adapter)
            rows.append(_run_child(config, opts, runs, warmup, timeout_s, out_dir, cold) if reason is None
                        else _empty_row(config, "skipped", reason))
            log(f"[{i}/{len(configs)}] {config.name}: {_status_line(rows[-1])}")
        _compare(rows, out_dir, peak=None if opts.full else 1.0)
    return rows


def _run_child(config: BenchConfig, opts: ModelOptions, runs: int, warmup: int, timeout_s: float,
               out_dir: Path, cold: bool = False) -> dict[str, Any]:
    if not cold:
        return _run_child_process(config, opts, runs, warmup, timeout_s, out_dir, None)
    with tempfile.TemporaryDirectory(prefix=f"hookkit-cold-{config.name}-") as root:
        row = _run_child_process(config, opts, runs, warmup, timeout_s, out_dir, cold_env(Path(root)))
        if isinstance(row.get("cold"), dict):  # what the row compiled from nothing (the folders go away now)
            row["cold"]["files_written"] = {var: _files_under(row["cold"].get(var)) for var in COLD_CACHE_VARS}
    return row


def _run_child_process(config: BenchConfig, opts: ModelOptions, runs: int, warmup: int, timeout_s: float,
                       out_dir: Path, env: dict[str, str] | None) -> dict[str, Any]:
    result = out_dir / f"{config.name}.json"
    argv = [sys.executable, "-m", "hookkit", "bench-one", "--config", config.name, "--runs", str(runs),
            "--warmup", str(warmup), "--out-dir", str(out_dir), "--result", str(result), *opts.to_argv()]
    log = out_dir / f"{config.name}.log"  # the child's stderr: tracebacks of failed rows, compile warnings
    try:
        proc = subprocess.run(argv, timeout=timeout_s, capture_output=True, text=True, env=env)
        log.write_text(proc.stderr)
        failure = None if proc.returncode == 0 else f"exit code {proc.returncode}: {_tail(proc.stderr)}"
    except subprocess.TimeoutExpired as exc:
        log.write_text(exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or "")
        failure = f"timed out after {timeout_s:.0f} s"
    if failure is None and result.is_file():
        return json.loads(result.read_text())
    return _empty_row(config, "failed", f"bench-one process: {failure or 'wrote no result'}")


def _tail(text: str, lines: int = 3) -> str:
    return " / ".join(line.strip() for line in text.strip().splitlines()[-lines:])


def _nonfinite(output: torch.Tensor) -> int:
    """How many values of a row's output are NaN or infinite (0 for integer outputs)."""
    return int((~torch.isfinite(output)).sum()) if output.is_floating_point() else 0


def _compare(rows: list[dict[str, Any]], out_dir: Path, peak: float | None) -> None:
    """Each row's count of non-finite output values (`nonfinite`, with or without an eager row: a fast row whose
    output is NaN has measured nothing worth having), then speed-up and PSNR of every row against the eager row (the
    first; none without it: `--no-eager`). An output with NaN or infinity gets no PSNR, nor does any row when the
    reference has them, and the table says so rather than printing "nan"."""
    ref_row = rows[0]
    reference = None
    for row in rows:  # the eager row first: its output and `nonfinite` are known before any other row is compared
        path = out_dir / f"{row['config']}.pt"
        output = torch.load(path) if row["status"] == "ok" and path.is_file() else None
        if output is not None:
            row["nonfinite"] = _nonfinite(output)
        if ref_row["config"] != "eager" or row["status"] != "ok":
            continue
        if row is ref_row:
            reference = output
        if ref_row["status"] == "ok":
            row["speedup"] = ref_row["latency_s"] / row["latency_s"]
        if reference is None or output is None or row["nonfinite"] or ref_row["nonfinite"]:
            continue
        if output.shape == reference.shape:
            value = psnr(reference, output, peak)
            row["psnr_db"] = None if math.isinf(value) else value
            row["identical"] = torch.equal(reference, output)
        else:
            row["note"] = (row["note"] + f"; output shape {tuple(output.shape)} differs").lstrip("; ")


def _status_line(row: dict[str, Any]) -> str:
    if row["status"] != "ok":
        return f"{row['status']}: {row['note']}"
    return f"median {row['latency_s']:.4f} s over {len(row['latencies_s'])} runs"


#: the environment variable that sets `hookkit bench --timeout`'s default, and the default without it
TIMEOUT_VARIABLE = "HOOKKIT_BENCH_TIMEOUT"
DEFAULT_TIMEOUT_S = 1800.0


def check_timeout(seconds: float, where: str) -> float:
    """`seconds` when it is a finite number > 0, else a SpecError naming `where` (the flag or the variable)."""
    if not (math.isfinite(seconds) and seconds > 0):
        raise SpecError(f"{where}: expected a number of seconds > 0, got {seconds:g}.")
    return seconds


def default_timeout() -> float:
    """Seconds a row of `hookkit bench` may take when `--timeout` is not given: `$HOOKKIT_BENCH_TIMEOUT`, else
    `DEFAULT_TIMEOUT_S`. Read when a matrix runs, not when the parser is built: whatever the variable holds,
    `--help` and the other commands work."""
    text = os.environ.get(TIMEOUT_VARIABLE, "").strip()
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(text)
    except ValueError:
        raise SpecError(f"{TIMEOUT_VARIABLE}={text!r}: expected a number of seconds > 0 (the default of "
                        f"--timeout), got {text!r}. Set e.g. {TIMEOUT_VARIABLE}=3600, or unset it for "
                        f"{DEFAULT_TIMEOUT_S:g}.") from None
    return check_timeout(seconds, f"{TIMEOUT_VARIABLE}={text!r}")
