"""Quality of every fp8 variant on hookkit's trained tiny Flux, against the bf16 reference.

Runs `hookkit.tools.quality.run_quality` in bfloat16 on the GPU (per-row fp8 needs SM89+): the reference is the
uncached bf16 pipeline; each row reports PSNR / SSIM of the final images against it and the fraction the
shipped classifier still recognises. Rows:

  fp8                      hookkit.Quantize("fp8_row"): the blocks' Linears, modulation kept in bf16 (default)
  fp8+mod                  Quantize("fp8_row", include_modulation=True): the AdaLN modulation Linears too
  cache-fast               DBCache F1B0 on the static "fast" mask, bf16 (what caching alone costs)
  fp8+mod+compile          fp8_row incl. modulation + regional compile (GPU): its GELU / concatenated inputs quantized
                           by hookkit's one-pass kernel with Compile's default fuse_fp8_rows="fast" (tanh from exp,
                           approximate division)
  fp8+mod+compile-exact    the same with fuse_fp8_rows="exact" (eager torchao's arithmetic, bitwise)
  fp8+mod+compile-unfused  the same with fuse_fp8_rows="off": inductor's own two-pass quantization
  fp8+cache-fast           the fastest hookkit row's numerics (graphs replay the same kernels)
  fp8+mod+cache-fast       the same with the modulation Linears in fp8
  fp8+cache-dyn-R0.24      dynamic DBCache (hookkit's default threshold) with fp8: what split graphs run
  cache-dit-fp8            cache-dit's own `quantize(QuantizeConfig(quant_type="float8_per_row"))` (skipped
                           without cache-dit)
  cache-dit-fp8+cache-fast cache-dit's fp8 + its DBCache F1B0 on the "fast" mask (the peer's fastest row)

    python benchmarks/quality_fp8.py                 # GPU: 10 classes x 4 seeds, 28 steps (~1 min on an H200)
    python benchmarks/quality_fp8.py --quick         # CPU check: 2 classes x 1 seed, 6 steps, fp8 weight-only

Writes $OUT/quality_fp8/{quality.md,quality.json} (no plot). With `--quick` on a CPU the fp8_row rows become
fp8_weight_only (the fp8 scheme a CPU runs) and cache-dit's rows float8_weight_only: the script is checked,
not the numbers.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import hookkit
from hookkit.tools import quality


def _fast() -> hookkit.DBCache:
    return hookkit.DBCache(fn_blocks=1, bn_blocks=0, warmup_steps=0, steps_mask="fast", mask_policy="static",
                           taylorseer_order=0)


def _cache_dit_fp8(quant_type: str, steps: int, cached: bool) -> Callable[[Any], Callable[[], None]]:
    def setup(pipe: Any) -> Callable[[], None]:
        import cache_dit  # type: ignore[import-not-found]

        qc = cache_dit.QuantizeConfig(quant_type=quant_type)
        if cached:
            cache_dit.enable_cache(pipe, cache_config=cache_dit.DBCacheConfig(
                Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=0.12, max_warmup_steps=0,
                steps_computation_mask=cache_dit.steps_mask(mask_policy="fast", total_steps=steps),
                steps_computation_policy="static"), quantize_config=qc)
            return lambda: cache_dit.disable_cache(pipe)
        cache_dit.quantize(pipe.transformer, quantize_config=qc)
        return lambda: None  # each row gets a freshly loaded pipeline: nothing to undo
    return setup


def configs(scheme: str, cache_dit_type: str, steps: int, compiled: bool = False) -> list[quality.QualityConfig]:
    def q(mod: bool) -> hookkit.Quantize:
        # keep_original: the harness removes every handle after its row
        return hookkit.Quantize(scheme=scheme, include_modulation=mod, keep_original="device")

    S, QC = hookkit.Spec, quality.QualityConfig
    dyn = hookkit.DBCache(threshold=0.24, taylorseer_order=0)
    return [
        QC(name="fp8", family="fp8", spec=S(quantize=q(False)), x="fp8", description=f"{scheme}, modulation bf16"),
        QC(name="fp8+mod", family="fp8", spec=S(quantize=q(True)), x="fp8+mod", description=f"{scheme} incl. modulation"),
        *([QC(name="fp8+mod+compile", family="fp8", spec=S(quantize=q(True), compile=hookkit.Compile()), x="compile",
              description=f"{scheme} incl. modulation + regional compile, one-pass fast quantization (the default)"),
           QC(name="fp8+mod+compile-exact", family="fp8", spec=S(quantize=q(True),
              compile=hookkit.Compile(fuse_fp8_rows="exact")), x="compile-exact",
              description=f"{scheme} incl. modulation + regional compile, one-pass quantization bitwise eager's"),
           QC(name="fp8+mod+compile-unfused", family="fp8", spec=S(quantize=q(True),
              compile=hookkit.Compile(fuse_fp8_rows="off")), x="compile-unfused",
              description=f"{scheme} incl. modulation + regional compile, inductor's two-pass quantization")]
          if compiled else []),
        QC(name="cache-fast", family="cache", spec=S(cache=_fast()), x="fast", description="DBCache F1B0 'fast' mask, bf16"),
        QC(name="fp8+cache-fast", family="fp8+cache", spec=S(quantize=q(False), cache=_fast()), x="fast",
           description=f"{scheme} + DBCache 'fast' mask"),
        QC(name="fp8+mod+cache-fast", family="fp8+cache", spec=S(quantize=q(True), cache=_fast()), x="fast+mod",
           description=f"{scheme} incl. modulation + DBCache 'fast' mask"),
        QC(name="fp8+cache-dyn-R0.24", family="fp8+cache", spec=S(quantize=q(False), cache=dyn), x="dyn",
           description=f"{scheme} + dynamic DBCache F1B0 R0.24 W8 (TaylorSeer off: split graphs run this)"),
        QC(name="cache-dit-fp8", family="cache-dit", setup=_cache_dit_fp8(cache_dit_type, steps, cached=False),
           requires="cache_dit", x="fp8", description=f"cache-dit QuantizeConfig({cache_dit_type!r})"),
        QC(name="cache-dit-fp8+cache-fast", family="cache-dit", setup=_cache_dit_fp8(cache_dit_type, steps, cached=True),
           requires="cache_dit", x="fp8+fast", description=f"cache-dit {cache_dit_type} + DBCache F1B0 'fast' mask"),
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=28)
    p.add_argument("--seeds", type=int, default=4)
    p.add_argument("--classes", default=None, help="comma-separated class indices (default: all 10)")
    p.add_argument("--quick", action="store_true", help="CPU check: 2 classes x 1 seed, 6 steps, fp8 weight-only")
    p.add_argument("--only", default=None, help="comma-separated row names (default: every row)")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "out"), "quality_fp8"))
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    if not args.quick and not cuda:
        raise SystemExit("quality_fp8.py: per-row fp8 needs a CUDA GPU (SM89+); --quick checks the script on the CPU.")
    steps = 6 if args.quick else args.steps
    classes = [int(c) for c in args.classes.split(",")] if args.classes else ([0, 5] if args.quick else None)
    seeds = range(1 if args.quick else args.seeds)
    on_gpu = cuda and not args.quick
    scheme, cache_dit_type = ("fp8_row", "float8_per_row") if on_gpu else ("fp8_weight_only", "float8_weight_only")
    rows = quality.only_rows(configs(scheme, cache_dit_type, steps, compiled=on_gpu), args.only, "quality_fp8.py")
    report = quality.run_quality(rows, classes=classes, seeds=seeds, steps=steps,
                                 device="cuda" if on_gpu else "cpu", dtype=torch.bfloat16,
                                 log=lambda m: print(m, file=sys.stderr, flush=True))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report.write(out, plot=False)
    print(report.markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
