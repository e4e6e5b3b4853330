"""The row registry of `hookkit bench`: every named configuration (`CONFIGS`), the named groups of rows
(`ROW_GROUPS`), rows that run a user's Spec from a JSON file (`spec:PATH`), and which rows a command runs."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

import hookkit
from hookkit.errors import SpecError
from hookkit.tools.bench.models import available_fields
from hookkit.tools.bench.peers import (
    _cache_dit,
    _cache_dit_compile,
    _cache_dit_fp8_compile,
    _cache_dit_fp8_compile_2x,
    _cache_dit_fp8_compile_sage,
    _eager,
    _first_block_cache,
    _mag_cache,
    _stock_full_compile,
    _stock_regional_compile,
)
from hookkit.tools.bench.render import NO_EAGER_NOTE
from hookkit.tools.bench.row import BenchConfig, HookkitSetup


def _cache_2x(steps: int = 28) -> Any:
    """The rule `hookkit.tune(..., speedup=2)` returns on the trained tiny Flux: "schedule" at 2x with TaylorSeer 2,
    planned from the shipped calibration (`tuned_2x_mask`'s steps; under transformer graphs the extrapolation is
    written into the residual slots before each cached replay). The residual form, pinned: the GPU rows in
    BENCHMARKS.md were measured with it (`extrapolate="output"` computes the same steps)."""
    from hookkit.tools import trained

    return hookkit.DBCache(rule="schedule", calibration=trained.calibration("tiny", steps), speedup=2.0,
                           taylorseer_order=2, extrapolate="residual")


def _hookkit(make_spec: Callable[[], Any]) -> HookkitSetup:
    return HookkitSetup(make_spec)


def _cache_fast() -> Any:
    """DBCache F1B0 on cache-dit's static "fast" mask (11 of 28 steps computed): random weights never cache
    dynamically, so a static mask is how caching speed is measured (DESIGN.md)."""
    return hookkit.DBCache(fn_blocks=1, bn_blocks=0, warmup_steps=0, steps_mask="fast", mask_policy="static",
                           taylorseer_order=0)


def _cache_fast_output() -> Any:
    """The same static "fast" computed steps with nothing of the transformer run on a cached step: its output
    extrapolated (TaylorSeer 1; `DBCache.extrapolate`). cache-dit runs its first block on a cached step (F1B0)."""
    return hookkit.DBCache(fn_blocks=0, bn_blocks=0, warmup_steps=0, steps_mask="fast", mask_policy="static",
                           taylorseer_order=1, extrapolate="output")


def _cache_cachedit_settings() -> Any:
    """DBCache with a dynamic decision at cache-dit's common settings (F1B0, 8 warm-up steps, at most 3 cached in a
    row, threshold 0.12), for comparing with cache-dit at equal settings. Not `hookkit.DBCache()`: the
    "hookkit-cache" row runs that."""
    return hookkit.DBCache(fn_blocks=1, bn_blocks=0, threshold=0.12, warmup_steps=8, max_continuous_cached_steps=3,
                           taylorseer_order=0)


def _cache_fast_dynamic() -> Any:
    """The "fast" mask's computed steps, its other steps decided by the threshold (mask_policy="dynamic"),
    with a threshold no diff reaches: it caches exactly the static "fast" row's steps, but through the whole
    dynamic machinery (the statistic and its host read on each of those steps; under CUDA graphs the split
    head/tail graphs), so its time against hookkit-...cache-fast rows is the cost of deciding dynamically.
    Random weights never cache at a real threshold (DESIGN.md)."""
    return hookkit.DBCache(fn_blocks=1, bn_blocks=0, warmup_steps=0, steps_mask="fast", mask_policy="dynamic",
                           threshold=1e9, taylorseer_order=0)


def _compile(mode: str | None = None, cuda_graphs: str = "none", fuse_fp8_rows: str = "fast",
             real_rope: bool = True) -> Any:
    return hookkit.Compile(regional=True, mode=mode, cuda_graphs=cuda_graphs, fuse_fp8_rows=fuse_fp8_rows,
                           real_rope=real_rope)


def _fp8_mod_fast_graphs(mode: str | None = None, fuse_fp8_rows: str = "fast", real_rope: bool = True,
                         cached: bool = True, attention: hookkit.Attention | None = None) -> Callable[[], Any]:
    """The spec of the fastest row (static 'fast' DBCache, fp8 incl. modulation, transformer graphs) and its
    variants: a compile mode, another `fuse_fp8_rows`, complex RoPE left to inductor, no cache, an attention kernel."""
    return lambda: hookkit.Spec(cache=_cache_fast() if cached else None,
                                quantize=hookkit.Quantize(scheme="fp8_row", include_modulation=True),
                                compile=_compile(mode, cuda_graphs="transformer", fuse_fp8_rows=fuse_fp8_rows,
                                                 real_rope=real_rope),
                                memo=True, attention=attention)


def _fp8_attention_every_step(kernel: str = "hookkit_fp8") -> Any:
    """An fp8 attention kernel (hookkit's, or FlashInfer's) on every step and block: a short benchmark run (6 steps)
    then measures the step the middle of a 50-step run spends (`Attention()`'s default keeps bf16 on the first and
    last 2 steps; at 50 steps those are 4 of 50)."""
    return hookkit.Attention(low_precision=kernel, full_first=0, full_last=0)


def _configs() -> dict[str, BenchConfig]:
    S = hookkit.Spec
    rows = [
        BenchConfig(name="eager", kind="stock", description="stock diffusers, eager", setup=_eager),
        BenchConfig(name="regional-compile", kind="stock", setup=_stock_regional_compile(None),
                    description="stock transformer.compile_repeated_blocks(fullgraph=True)"),
        BenchConfig(name="regional-compile-ro", kind="stock", setup=_stock_regional_compile("reduce-overhead"),
                    needs_cuda=True, description="stock compile_repeated_blocks(mode='reduce-overhead')"),
        BenchConfig(name="full-compile", kind="stock", setup=_stock_full_compile(None),
                    description="stock transformer.compile(fullgraph=True)"),
        BenchConfig(name="full-compile-ro", kind="stock", setup=_stock_full_compile("reduce-overhead"),
                    needs_cuda=True, description="stock transformer.compile(fullgraph=True, mode='reduce-overhead')"),
        BenchConfig(name="fbcache", kind="stock", setup=_first_block_cache,
                    description="diffusers FirstBlockCache, threshold 0.12"),
        BenchConfig(name="magcache", kind="stock", setup=_mag_cache,
                    description="diffusers MagCache, its defaults and its shipped FLUX_MAG_RATIOS"),
        BenchConfig(name="cache-dit", kind="peer", setup=_cache_dit, needs_module="cache_dit",
                    description="cache-dit DBCache F1B0, static 'fast' mask"),
        BenchConfig(name="cache-dit+compile", kind="peer", setup=_cache_dit_compile, needs_module="cache_dit",
                    description="cache-dit DBCache F1B0, static 'fast' mask + stock regional compile"),
        BenchConfig(name="cache-dit+fp8+compile", kind="peer", setup=_cache_dit_fp8_compile, needs_module="cache_dit",
                    needs_cuda=True, description="cache-dit DBCache F1B0, static 'fast' mask + its fp8 per-row + "
                                                 "stock regional compile"),
        BenchConfig(name="cache-dit+fp8+compile+sage", kind="peer", setup=_cache_dit_fp8_compile_sage,
                    needs_module=("cache_dit", "sageattention"), needs_cuda=True,
                    description="cache-dit+fp8+compile with cache-dit's SageAttention backend (needs the "
                                "sageattention package)"),
        BenchConfig(name="hookkit", kind="hookkit", setup=_hookkit(lambda: S()),
                    description="hookkit.enable(pipe, Spec()): bookkeeping only (overhead)"),
        BenchConfig(name="hookkit-cache", kind="hookkit", setup=_hookkit(lambda: S(cache=hookkit.DBCache())),
                    fields=frozenset({"cache"}),
                    description="hookkit.DBCache(), the documented default (what generate --cache runs)"),
        BenchConfig(name="hookkit-cache-cachedit-settings", kind="hookkit",
                    setup=_hookkit(lambda: S(cache=_cache_cachedit_settings())), fields=frozenset({"cache"}),
                    description="DBCache F1B0 W8 MC3 R0.12, dynamic: cache-dit's common settings"),
        BenchConfig(name="hookkit-cache-fast", kind="hookkit", setup=_hookkit(lambda: S(cache=_cache_fast())),
                    fields=frozenset({"cache"}), description="DBCache F1B0, static 'fast' mask"),
        BenchConfig(name="hookkit-memo", kind="hookkit", setup=_hookkit(lambda: S(memo=True)),
                    fields=frozenset({"memo"}), description="memoized per-step index tensors"),
        BenchConfig(name="hookkit-sync-free", kind="hookkit", setup=_hookkit(lambda: S(sync_free=True)),
                    fields=frozenset({"sync_free"}), description="sync-free denoising loop"),
        BenchConfig(name="hookkit-compile", kind="hookkit", setup=_hookkit(lambda: S(compile=_compile())),
                    fields=frozenset({"compile"}), description="regional compile of the adapter's repeated blocks"),
        BenchConfig(name="hookkit-compile-ro", kind="hookkit",
                    setup=_hookkit(lambda: S(compile=_compile("reduce-overhead"))), fields=frozenset({"compile"}),
                    needs_cuda=True, description="regional compile, mode='reduce-overhead' (CUDA-graph safe)"),
        BenchConfig(name="hookkit-cuda-graphs", kind="hookkit",
                    setup=_hookkit(lambda: S(compile=_compile(cuda_graphs="transformer"), memo=True)),
                    fields=frozenset({"compile", "memo"}), needs_cuda=True,
                    description="regional compile + one CUDA graph per transformer call (+ memo where needed)"),
        BenchConfig(name="hookkit-cache-fast+compile", kind="hookkit",
                    setup=_hookkit(lambda: S(cache=_cache_fast(), compile=_compile())),
                    fields=frozenset({"cache", "compile"}), description="static 'fast' DBCache + regional compile"),
        BenchConfig(name="hookkit-fp8+compile", kind="hookkit",
                    setup=_hookkit(lambda: S(quantize=hookkit.Quantize(scheme="fp8_row"), compile=_compile())),
                    fields=frozenset({"quantize", "compile"}), needs_cuda=True,
                    description="torchao fp8 dynamic per-row + regional compile"),
        BenchConfig(name="hookkit-fp8+cache-fast+compile", kind="hookkit",
                    setup=_hookkit(lambda: S(cache=_cache_fast(), quantize=hookkit.Quantize(scheme="fp8_row"),
                                             compile=_compile(), memo=True)),
                    fields=frozenset({"cache", "quantize", "compile", "memo"}), needs_cuda=True,
                    description="static 'fast' DBCache + fp8 dynamic per-row + regional compile, bf16 attention: "
                                "cache-dit's best configuration's techniques, for models whose forward refuses "
                                "whole-transformer graphs (HunyuanVideo 1.5)"),
        BenchConfig(name="hookkit-fp8+cuda-graphs", kind="hookkit",
                    setup=_hookkit(lambda: S(quantize=hookkit.Quantize(scheme="fp8_row"),
                                             compile=_compile(cuda_graphs="transformer"), memo=True)),
                    fields=frozenset({"quantize", "compile", "memo"}), needs_cuda=True,
                    description="torchao fp8 dynamic per-row + regional compile + one CUDA graph per transformer call"),
        BenchConfig(name="hookkit-fp8+cache-fast+cuda-graphs", kind="hookkit",
                    setup=_hookkit(lambda: S(cache=_cache_fast(), quantize=hookkit.Quantize(scheme="fp8_row"),
                                             compile=_compile(cuda_graphs="transformer"), memo=True)),
                    fields=frozenset({"cache", "quantize", "compile", "memo"}), needs_cuda=True,
                    description="static 'fast' DBCache + fp8 dynamic per-row + one CUDA graph per call and decision"),
        BenchConfig(name="hookkit-fp8+cache-dyn+cuda-graphs", kind="hookkit",
                    setup=_hookkit(lambda: S(cache=_cache_fast_dynamic(), quantize=hookkit.Quantize(scheme="fp8_row"),
                                             compile=_compile(cuda_graphs="transformer"), memo=True)),
                    fields=frozenset({"cache", "quantize", "compile", "memo"}), needs_cuda=True,
                    description="dynamic DBCache (caching the 'fast' mask's steps) + fp8 + transformer graphs split "
                                "at each decision"),
        BenchConfig(name="hookkit-cache-dyn+cuda-graphs", kind="hookkit",
                    setup=_hookkit(lambda: S(cache=_cache_fast_dynamic(), compile=_compile(cuda_graphs="transformer"),
                                             memo=True)),
                    fields=frozenset({"cache", "compile", "memo"}), needs_cuda=True,
                    description="dynamic DBCache (caching the 'fast' mask's steps) + transformer graphs split at "
                                "each decision"),
        BenchConfig(name="hookkit-cache-fast+cuda-graphs", kind="hookkit",
                    setup=_hookkit(lambda: S(cache=_cache_fast(), compile=_compile(cuda_graphs="transformer"),
                                             memo=True)),
                    fields=frozenset({"cache", "compile", "memo"}), needs_cuda=True,
                    description="static 'fast' DBCache + one CUDA graph per call and decision"),
        BenchConfig(name="hookkit-fp8-mod+cuda-graphs", kind="hookkit", setup=_hookkit(_fp8_mod_fast_graphs(cached=False)),
                    fields=frozenset({"quantize", "compile", "memo"}), needs_cuda=True,
                    description="the fastest row's fp8 (modulation included) and transformer graphs, uncached: "
                                "every step computed (the uncached step is its time / steps)"),
        BenchConfig(name="hookkit-fp8-mod+cache-2x+cuda-graphs", kind="hookkit",
                    setup=_hookkit(lambda: S(cache=_cache_2x(), quantize=hookkit.Quantize(scheme="fp8_row",
                                                                                       include_modulation=True),
                                             compile=_compile(cuda_graphs="transformer"), memo=True)),
                    fields=frozenset({"cache", "quantize", "compile", "memo"}), needs_cuda=True,
                    description="the tuned 2x rule (schedule, TaylorSeer 2: 14 of 28 steps, no block on a cached "
                                "step) + fp8 incl. modulation + transformer graphs"),
        BenchConfig(name="cache-dit+fp8+compile+2x", kind="peer", setup=_cache_dit_fp8_compile_2x,
                    needs_module="cache_dit", needs_cuda=True,
                    description="cache-dit DBCache F1B0 on the tuned 2x rule's 14 of 28 steps + its fp8 per-row + "
                                "stock regional compile"),
        BenchConfig(name="hookkit-fp8-mod+cache-fast+cuda-graphs", kind="hookkit", setup=_hookkit(_fp8_mod_fast_graphs()),
                    fields=frozenset({"cache", "quantize", "compile", "memo"}), needs_cuda=True,
                    description="as hookkit-fp8+cache-fast+cuda-graphs, the AdaLN modulation Linears in fp8 too"),
        *(BenchConfig(name=f"hookkit-fp8-mod+cache-fast+cuda-graphs+rows-{rows}", kind="hookkit",
                      setup=_hookkit(_fp8_mod_fast_graphs(fuse_fp8_rows=rows)),
                      fields=frozenset({"cache", "quantize", "compile", "memo"}), needs_cuda=True,
                      description=f"as hookkit-fp8-mod+cache-fast+cuda-graphs with Compile(fuse_fp8_rows={rows!r})")
          for rows in ("exact", "off")),
        BenchConfig(name="hookkit-fp8-mod+cache-fast+cuda-graphs+rope-complex", kind="hookkit",
                    setup=_hookkit(_fp8_mod_fast_graphs(real_rope=False)),
                    fields=frozenset({"cache", "quantize", "compile", "memo"}), needs_cuda=True,
                    description="as hookkit-fp8-mod+cache-fast+cuda-graphs with Compile(real_rope=False): complex "
                                "RoPE (Qwen-Image) left to inductor's ATen fallback"),
        BenchConfig(name="hookkit-fp8-mod+cache-fast+cuda-graphs+autotune", kind="hookkit",
                    setup=_hookkit(_fp8_mod_fast_graphs("max-autotune-no-cudagraphs")),
                    fields=frozenset({"cache", "quantize", "compile", "memo"}), needs_cuda=True,
                    description="as hookkit-fp8-mod+cache-fast+cuda-graphs, regions compiled with "
                                "mode='max-autotune-no-cudagraphs' (autotuned GEMM templates; long warm-up)"),
        BenchConfig(name="hookkit-fp8-mod+cache-fast+cuda-graphs+fp8-attention", kind="hookkit",
                    setup=_hookkit(_fp8_mod_fast_graphs(attention=hookkit.Attention(low_precision="hookkit_fp8"))),
                    fields=frozenset({"cache", "quantize", "compile", "memo", "attention"}), needs_cuda=True,
                    description="as hookkit-fp8-mod+cache-fast+cuda-graphs with hookkit's fp8 attention kernel on the "
                                "middle steps (bf16 SDPA on the first and last 2): the graphs keyed by the kernel"),
        BenchConfig(name="hookkit-int8-attention", kind="hookkit",
                    setup=_hookkit(lambda: S(attention=hookkit.Attention(low_precision="hookkit_int8"))),
                    fields=frozenset({"attention"}), needs_cuda=True,
                    description="eager, hookkit's int8 Q.K^T attention kernel on every block of the middle steps "
                                "(bf16 SDPA on the first and last 2 steps)"),
        BenchConfig(name="hookkit-fp8+cache-fast+int8-attention", kind="hookkit",
                    setup=_hookkit(lambda: S(cache=_cache_fast(), quantize=hookkit.Quantize(scheme="fp8_row"),
                                             attention=hookkit.Attention(low_precision="hookkit_int8"))),
                    fields=frozenset({"cache", "quantize", "attention"}), needs_cuda=True,
                    description="static 'fast' DBCache + fp8 dynamic per-row + int8 attention on the middle steps, "
                                "eager"),
        BenchConfig(name="hookkit-fp8+compile+fp8-attention", kind="hookkit",
                    setup=_hookkit(lambda: S(quantize=hookkit.Quantize(scheme="fp8_row"), compile=_compile(), memo=True,
                                             attention=_fp8_attention_every_step())),
                    fields=frozenset({"quantize", "compile", "memo", "attention"}), needs_cuda=True,
                    description="fp8 dynamic per-row + regional compile + hookkit's fp8 attention kernel at every "
                                "step, uncached (the uncached step is its time / steps)"),
        BenchConfig(name="hookkit-fp8+cache-fast+compile+fp8-attention", kind="hookkit",
                    setup=_hookkit(lambda: S(cache=_cache_fast(), quantize=hookkit.Quantize(scheme="fp8_row"),
                                             compile=_compile(), memo=True, attention=_fp8_attention_every_step())),
                    fields=frozenset({"cache", "quantize", "compile", "memo", "attention"}), needs_cuda=True,
                    description="static 'fast' DBCache + fp8 dynamic per-row + regional compile + hookkit's fp8 "
                                "attention kernel at every step"),
        BenchConfig(name="hookkit-fp8+cache-fast-output+compile+fp8-attention", kind="hookkit",
                    setup=_hookkit(lambda: S(cache=_cache_fast_output(), quantize=hookkit.Quantize(scheme="fp8_row"),
                                             compile=_compile(), memo=True, attention=_fp8_attention_every_step())),
                    fields=frozenset({"cache", "quantize", "compile", "memo", "attention"}), needs_cuda=True,
                    description="as hookkit-fp8+cache-fast+compile+fp8-attention, a cached step running nothing of "
                                "the transformer (its output extrapolated)"),
        BenchConfig(name="hookkit-fp8+compile+flashinfer-attention", kind="hookkit",
                    setup=_hookkit(lambda: S(quantize=hookkit.Quantize(scheme="fp8_row"), compile=_compile(), memo=True,
                                             attention=hookkit.Attention(kernel="flashinfer", low_precision=None))),
                    fields=frozenset({"quantize", "compile", "memo", "attention"}), needs_cuda=True,
                    needs_module="flashinfer",
                    description="fp8 dynamic per-row + regional compile + FlashInfer's bf16 attention kernel at every "
                                "step, uncached: full-precision attention (needs the flashinfer-python package and a "
                                "Hopper GPU)"),
        BenchConfig(name="hookkit-fp8+compile+flashinfer-fp8-attention", kind="hookkit",
                    setup=_hookkit(lambda: S(quantize=hookkit.Quantize(scheme="fp8_row"), compile=_compile(), memo=True,
                                             attention=_fp8_attention_every_step("flashinfer_fp8"))),
                    fields=frozenset({"quantize", "compile", "memo", "attention"}), needs_cuda=True,
                    needs_module="flashinfer",
                    description="fp8 dynamic per-row + regional compile + FlashInfer's fp8 attention kernel at every "
                                "step on calls of 8,192 keys or more (shorter ones native), uncached (needs the "
                                "flashinfer-python package and a Hopper GPU)"),
        BenchConfig(name="hookkit-fp8+cache-fast+compile+flashinfer-fp8-attention", kind="hookkit",
                    setup=_hookkit(lambda: S(cache=_cache_fast(), quantize=hookkit.Quantize(scheme="fp8_row"),
                                             compile=_compile(), memo=True,
                                             attention=_fp8_attention_every_step("flashinfer_fp8"))),
                    fields=frozenset({"cache", "quantize", "compile", "memo", "attention"}), needs_cuda=True,
                    needs_module="flashinfer",
                    description="static 'fast' DBCache + fp8 dynamic per-row + regional compile + FlashInfer's fp8 "
                                "attention kernel at every step on calls of 8,192 keys or more (shorter ones native; "
                                "needs the flashinfer-python package and a Hopper GPU)"),
        BenchConfig(name="hookkit-fp8+cache-fast-output+compile+flashinfer-fp8-attention", kind="hookkit",
                    setup=_hookkit(lambda: S(cache=_cache_fast_output(), quantize=hookkit.Quantize(scheme="fp8_row"),
                                             compile=_compile(), memo=True,
                                             attention=_fp8_attention_every_step("flashinfer_fp8"))),
                    fields=frozenset({"cache", "quantize", "compile", "memo", "attention"}), needs_cuda=True,
                    needs_module="flashinfer",
                    description="as hookkit-fp8+cache-fast+compile+flashinfer-fp8-attention, a cached step running "
                                "nothing of the transformer (its output extrapolated)"),
        BenchConfig(name="hookkit-fp8+compile+fa3-fp8-attention", kind="hookkit",
                    setup=_hookkit(lambda: S(quantize=hookkit.Quantize(scheme="fp8_row"), compile=_compile(), memo=True,
                                             attention=_fp8_attention_every_step("fa3_fp8"))),
                    fields=frozenset({"quantize", "compile", "memo", "attention"}), needs_cuda=True,
                    needs_module="flash_attn_interface",
                    description="as hookkit-fp8+compile+flashinfer-fp8-attention with FA3's own e4m3 kernel (needs "
                                "FA3 built from flash-attention's hopper/ and a Hopper GPU)"),
        BenchConfig(name="hookkit-fp8+cache-fast-output+compile+fa3-fp8-attention", kind="hookkit",
                    setup=_hookkit(lambda: S(cache=_cache_fast_output(), quantize=hookkit.Quantize(scheme="fp8_row"),
                                             compile=_compile(), memo=True,
                                             attention=_fp8_attention_every_step("fa3_fp8"))),
                    fields=frozenset({"cache", "quantize", "compile", "memo", "attention"}), needs_cuda=True,
                    needs_module="flash_attn_interface",
                    description="as hookkit-fp8+cache-fast-output+compile+flashinfer-fp8-attention with FA3's own e4m3 "
                                "kernel (needs FA3 built from flash-attention's hopper/ and a Hopper GPU)"),
        BenchConfig(name="hookkit-all", kind="hookkit",
                    setup=_hookkit(lambda: S(cache=_cache_fast(), memo=True, sync_free=True, compile=_compile())),
                    fields=frozenset({"cache", "memo", "sync_free", "compile"}),
                    description="static 'fast' DBCache + memo + sync-free + regional compile"),
    ]
    return {row.name: row for row in rows}


CONFIGS: dict[str, BenchConfig] = _configs()

#: named groups of rows for `--configs`: "video" is the matrix of the video models: stock eager and
#: regional compile, diffusers' two caches, the strongest peer and hookkit's fastest, the last two on the same static
#: "fast" computed steps. Image-only rows (the modulation variants: Wan has no AdaLN Linears to quantize) stay out.
ROW_GROUPS: dict[str, tuple[str, ...]] = {
    "video": ("eager", "regional-compile", "fbcache", "magcache", "cache-dit+fp8+compile", "cache-dit+fp8+compile+sage",
              "hookkit-fp8+cuda-graphs", "hookkit-fp8+cache-fast+cuda-graphs", "hookkit-fp8+compile+fp8-attention",
              "hookkit-fp8+cache-fast+compile+fp8-attention", "hookkit-fp8+cache-fast-output+compile+fp8-attention",
              "hookkit-fp8+compile+flashinfer-attention",
              "hookkit-fp8+compile+flashinfer-fp8-attention",
              "hookkit-fp8+cache-fast+compile+flashinfer-fp8-attention",
              "hookkit-fp8+cache-fast-output+compile+flashinfer-fp8-attention"),
}

#: a row named "spec:PATH" runs the Spec in the JSON file PATH (`Spec.to_dict()`, as `hookkit tune --json` writes it)
SPEC_PREFIX = "spec:"


def read_spec(path: str | Path, flag: str = "--spec") -> Any:
    """The `hookkit.Spec` of a JSON file written from `Spec.to_dict()` (`hookkit tune --json`); SpecError naming the
    flag when the file is missing or is not a Spec."""
    source = Path(path)
    try:
        data = json.loads(source.read_text())
    except (OSError, ValueError) as exc:
        raise SpecError(f"{flag} {source}: expected a JSON file of a hookkit Spec (hookkit tune --json writes one), "
                        f"got {type(exc).__name__}: {exc}.") from None
    return hookkit.Spec.from_dict(data)


def config_named(name: str) -> BenchConfig:
    """A shipped row, or "spec:PATH": the Spec in that JSON file (read now, so a bad file fails before any run)."""
    if name.startswith(SPEC_PREFIX):
        path = name[len(SPEC_PREFIX):]
        spec = read_spec(path, "--configs spec:")
        fields = frozenset(f for f in ("cache", "quantize", "compile", "parallel") if getattr(spec, f) is not None)
        return BenchConfig(name=name, kind="hookkit", setup=_hookkit(lambda: read_spec(path)), fields=fields,
                           description=f"the Spec in {path}")
    return CONFIGS[name]


def select_configs(names: Sequence[str] | None, device: torch.device,
                   eager: bool = True) -> tuple[list[BenchConfig], list[str]]:
    """The rows to run, "eager" first (it is the reference), and notes on the rows left out. A name of
    `ROW_GROUPS` stands for its rows.

    Named rows that cannot run here stay in (their row says why); the default matrix keeps only the rows
    that can run, and notes the others.

    Args:
        eager: add the eager row where it is not named. Without it (`hookkit bench --no-eager`, for a group of rows
            that `--merge` joins to a run that has it; a full-size eager row costs minutes) the rows get no speed-up
            or PSNR of their own, and rows must be named.
    """
    have = available_fields()
    notes: list[str] = []
    if names:
        names = [row for n in names for row in ROW_GROUPS.get(n, (n,))]
        unknown = [n for n in names if n not in CONFIGS and not n.startswith(SPEC_PREFIX)]
        if unknown:
            import difflib

            close = difflib.get_close_matches(unknown[0], list(CONFIGS), n=1, cutoff=0.5)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise SpecError(f"--configs: unknown configuration {unknown[0]!r}; {hint}known: {list(CONFIGS)} and the "
                            f"groups {list(ROW_GROUPS)} (`hookkit bench --list` says what each does and whether it "
                            "runs here).")
        chosen = [config_named(n) for n in dict.fromkeys(names)]
    else:
        chosen = []
        for cfg in CONFIGS.values():
            reason = cfg.unavailable(device, have)
            if reason is None:
                chosen.append(cfg)
            else:
                notes.append(f"{cfg.name}: skipped ({reason})")
    if not eager:
        if not names:
            raise SpecError("--no-eager: expected the rows to run in --configs (the default matrix is measured against "
                            "its eager row); name them, or drop --no-eager.")
        notes.append(NO_EAGER_NOTE)
    elif chosen[0].name != "eager":
        chosen = [CONFIGS["eager"]] + [c for c in chosen if c.name != "eager"]
        if names:
            notes.append("eager: added as the reference for speed-up and PSNR")
    return chosen, notes
