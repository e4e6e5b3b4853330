"""fp8_row quantization of the full-size Flux-dev architecture against bf16, eager and regionally compiled.

    python benchmarks/quant_flux.py                 # 1024², 28 steps, 3 timed runs per variant
    python benchmarks/quant_flux.py --quick         # 256², 4 steps, 2 of 19 double and 4 of 38 single blocks
    python benchmarks/quant_flux.py --variants bf16-regional,fp8-regional,fp8-ro,fp8-graph

Variants (one process, one transformer, side by side; each is enabled, warmed up, timed, then removed):
  bf16-eager     stock diffusers
  bf16-regional  hookkit.Compile(): inductor compile of each repeated block (hooks outside the region)
  fp8-eager      hookkit.Quantize("fp8_row"): torchao dynamic per-row fp8 on the blocks' Linear layers
  fp8-regional   fp8_row + hookkit.Compile()
  fp8-ro         fp8_row + hookkit.Compile(mode="reduce-overhead")   (optional)
  fp8-graph      fp8_row + hookkit.Compile(cuda_graphs="transformer") (optional)
Suffixes (experiments toward the 0.75 goal), e.g. `fp8-regional+fused+mod`:
  +fused         diffusers' `transformer.fuse_qkv_projections()` before enabling (one QKV GEMM per stream)
  +mod           also quantize the AdaLN modulation Linears the adapter excludes (`Quantize(include=...)`)

Quantization keeps the original weights on the CPU (`keep_original="cpu"`), so every removal restores
bf16 exactly; the last line checks that bitwise. Goal: fp8-regional <= 0.75 x bf16-regional (BENCHMARKS.md,
"fp8 per-row quantization and compilation"). Random weights, bf16, batch 1, latents out,
median of N runs after warm-up. PSNR (peak = reference range) of each fp8 output against bf16 of the same
compilation, and against bf16 eager. Prints a markdown table; writes JSON to $OUT/quant_flux_<size>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from hookkit.tools.bench import psnr, timed

REFERENCE_BF16_REGIONAL_S = 3.81  # DESIGN.md, H200, Flux-dev 1024², 28 steps
GOAL = 0.75




MODULATION = ("*.norm1.linear", "*.norm1_context.linear", "*.norm.linear")


def split_variant(variant: str) -> tuple[str, set[str]]:
    """`"fp8-regional+fused+mod"` -> `("fp8-regional", {"fused", "mod"})`."""
    base, *extras = variant.split("+")
    return base, set(extras)


def spec_of(variant: str, keep: str | None) -> Any:
    import hookkit

    variant, extras = split_variant(variant)
    include = MODULATION if "mod" in extras else ()
    quantize = hookkit.Quantize(scheme="fp8_row", keep_original=keep, include=include) \
        if variant.startswith("fp8") else None
    compile_ = {
        "eager": None,
        "regional": hookkit.Compile(),
        "ro": hookkit.Compile(mode="reduce-overhead"),
        "graph": hookkit.Compile(cuda_graphs="transformer"),
    }[variant.split("-", 1)[1]]
    return hookkit.Spec(quantize=quantize, compile=compile_)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--steps", type=int, default=28)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--variants", default="bf16-eager,bf16-regional,fp8-eager,fp8-regional")
    p.add_argument("--quick", action="store_true", help="256², 4 steps, 2 runs, 2+4 blocks")
    args = p.parse_args()
    overrides: dict[str, Any] = {}
    if args.quick:
        args.size, args.steps, args.runs = 256, 4, 2
        overrides = dict(num_layers=2, num_single_layers=4)
    out_dir = os.environ.get("OUT", "out")
    os.makedirs(out_dir, exist_ok=True)

    import hookkit
    from hookkit.tools import bench, zoo

    bench.require_cuda("quant_flux.py", "On the CPU: hookkit generate flux --quantize int8_weight_only --summary.")
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        pipe = zoo.full_pipeline("flux", **overrides)
    torch.set_default_dtype(torch.float32)
    kw = lambda: zoo.full_call_kwargs("flux", steps=args.steps, height=args.size, width=args.size)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"Flux-dev arch ({'quick: ' + str(overrides) if overrides else 'full'}), {args.size}², {args.steps} steps",
          flush=True)

    rows: list[dict[str, Any]] = []
    outputs: dict[str, torch.Tensor] = {}
    quant_report: dict[str, Any] | None = None
    for name in args.variants.split(","):
        torch._dynamo.reset()
        torch.cuda.empty_cache()
        row: dict[str, Any] = {"variant": name, "size": args.size, "steps": args.steps}
        fused = "fused" in split_variant(name)[1]
        try:
            if fused:
                pipe.transformer.fuse_qkv_projections()
            t_enable, handle = timed(lambda: hookkit.enable(pipe, spec_of(name, "cpu")))
            row["enable_s"] = round(t_enable, 2)  # includes quantization and the CPU copy of the originals
            try:
                if quant_report is None and "quantize" in handle.summary().features:
                    feature = handle.summary().features["quantize"]
                    quant_report = {k: v for k, v in feature.data.items() if k != "layers"}
                    print(feature.text, flush=True)
                torch.cuda.reset_peak_memory_stats()
                warm = [timed(lambda: pipe(**kw()).images)[0] for _ in range(1 if name.endswith("eager") else 2)]
                times = []
                for _ in range(args.runs):
                    t, out = timed(lambda: pipe(**kw()).images)
                    times.append(t)
                row.update(warmup_s=[round(t, 2) for t in warm], median_s=round(statistics.median(times), 3),
                           times=[round(t, 3) for t in times],
                           peak_gb=round(torch.cuda.max_memory_allocated() / 2**30, 1))
                outputs[name] = out
            finally:
                handle.remove()
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:240]}"
            traceback.print_exc()
        if fused:
            pipe.transformer.unfuse_qkv_projections()
        rows.append(row)
        print(json.dumps(row), flush=True)

    for row in rows:
        name = row["variant"]
        if name.startswith("fp8") and name in outputs:
            twin = "bf16-" + split_variant(name)[0].split("-", 1)[1]
            if twin in outputs:
                row["psnr_vs_bf16_same_compile_db"] = round(psnr(outputs[twin], outputs[name]), 2)
            if "bf16-eager" in outputs:
                row["psnr_vs_bf16_eager_db"] = round(psnr(outputs["bf16-eager"], outputs[name]), 2)

    restored = None
    if "bf16-eager" in outputs:
        torch._dynamo.reset()
        restored = bool(torch.equal(pipe(**kw()).images, outputs["bf16-eager"]))

    med = {r["variant"]: r["median_s"] for r in rows if "median_s" in r}
    ratio = med["fp8-regional"] / med["bf16-regional"] if {"fp8-regional", "bf16-regional"} <= med.keys() else None
    print(f"\n| variant | {args.size}² median s | warm-up s | enable s | peak GB | x bf16 same compile | "
          "PSNR vs bf16 same compile dB | PSNR vs bf16 eager dB | error |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        twin = "bf16-" + split_variant(r["variant"])[0].split("-", 1)[1]
        rel = f"{r['median_s'] / med[twin]:.3f}" if "median_s" in r and twin in med else ""
        print(f"| {r['variant']} | {r.get('median_s', '')} | {r.get('warmup_s', '')} | {r.get('enable_s', '')} | "
              f"{r.get('peak_gb', '')} | {rel} | {r.get('psnr_vs_bf16_same_compile_db', '')} | "
              f"{r.get('psnr_vs_bf16_eager_db', '')} | {r.get('error', '')} |")
    if ratio is not None:
        print(f"\nfp8-regional / bf16-regional = {ratio:.3f} (goal <= {GOAL}: {'met' if ratio <= GOAL else 'NOT met'}); "
              f"fp8-regional / {REFERENCE_BF16_REGIONAL_S} s reference = {med['fp8-regional'] / REFERENCE_BF16_REGIONAL_S:.3f}")
    print(f"bf16 restored bitwise after all removals: {restored}")
    with open(os.path.join(out_dir, f"quant_flux_{args.size}.json"), "w") as f:
        json.dump({"rows": rows, "ratio_fp8_regional_vs_bf16_regional": ratio, "goal": GOAL,
                   "restored_bitwise": restored, "quantization": quant_report, "quick": args.quick,
                   "torch": torch.__version__, "device": torch.cuda.get_device_name()}, f, indent=1)


if __name__ == "__main__":
    main()
