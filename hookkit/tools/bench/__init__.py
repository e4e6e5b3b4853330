"""Build, run and time pipelines: the machinery behind `hookkit generate` and `hookkit bench`.

`hookkit bench` measures a matrix of configurations -- stock diffusers (eager, regional and full compile),
diffusers' FirstBlockCache and MagCache, cache-dit when installed, and hookkit's -- each in its own process
(`python -m hookkit bench-one ...`). Each child writes its row as JSON and its output tensor as `.pt`; the parent
compares outputs against the eager row (PSNR) and prints a markdown table.

One module per part, every name re-exported here (`from hookkit.tools import bench; bench.X`):
`models` (which pipelines exist, building them, size checks, call arguments), `metrics` (synchronized time, peak
memory, PSNR), `row` (`BenchConfig`, `RunContext`, a result row's keys), `peers` (stock diffusers and cache-dit
setups), `configs` (the row registry `CONFIGS`, `ROW_GROUPS`, `spec:PATH` rows), `runner` (the child processes,
one measurement, `--cold`, timeouts) and `render` (the table, the JSON report, merging reports). A test that
replaces a function replaces it in the module that calls it.
"""

from __future__ import annotations

from hookkit.tools.bench.configs import CONFIGS, ROW_GROUPS, SPEC_PREFIX, config_named, read_spec, select_configs
from hookkit.tools.bench.metrics import (
    TINY_CPU_TIMINGS,
    device_description,
    psnr,
    psnr_from_mse,
    synchronize,
    timed,
    timing_caveat,
)
from hookkit.tools.bench.models import (
    DTYPES,
    FULL_TEXT_TOKENS,
    FULL_TEXT_TOKENS_2,
    MAX_LATENT_TOKENS,
    ModelOptions,
    _available_bytes,
    _embedding_call_kwargs,
    available_fields,
    call_kwargs,
    check_cpu_full,
    check_fits,
    check_frames,
    check_memory,
    check_model,
    check_size,
    default_size,
    full_transformer_bytes,
    full_transformer_parameters,
    has_text_encoder,
    load_pipeline,
    output_of,
    output_type_for,
    require_cuda,
    resolve_device,
    resolve_dtype,
    skeleton_pipeline,
    tiny_models,
)
from hookkit.tools.bench.peers import cache_dit_steps, separate_cfg_calls, transformers_of, tuned_2x_mask
from hookkit.tools.bench.render import (
    cache_stats,
    environment,
    markdown_table,
    merge_reports,
    read_report,
    report,
    spread,
    to_json,
    unresolved,
    write_json,
)
from hookkit.tools.bench.row import ROW_KEYS, BenchConfig, RunContext, _empty_row
from hookkit.tools.bench.runner import (
    COLD_CACHE_VARS,
    COLD_VARIABLE,
    DEFAULT_TIMEOUT_S,
    TIMEOUT_VARIABLE,
    _compare,
    _run_child,
    _status_line,
    _summary_data,
    check_timeout,
    cold_cache_dirs,
    cold_env,
    cold_from_environment,
    default_timeout,
    measure,
    run_matrix,
)

__all__ = [
    "CONFIGS",
    "ROW_KEYS",
    "BenchConfig",
    "ModelOptions",
    "available_fields",
    "call_kwargs",
    "load_pipeline",
    "markdown_table",
    "measure",
    "psnr",
    "run_matrix",
    "select_configs",
]
