"""Compilation and CUDA-graph variants of full-size Flux-dev / Qwen-Image architectures, side by side.

    python benchmarks/compile_flux.py --size 256 --runs 5 --variants eager,hk-graph,regional,hk-ro,stock-ro
    python benchmarks/compile_flux.py --model qwenimage --memo --size 1024 --variants eager,hk-ro,stock-ro,hk-graph

Variants:
  eager      stock diffusers, no compilation
  stock-regional  stock `transformer.compile_repeated_blocks(fullgraph=True)`
  regional   hookkit.Compile() -- regional inductor compile of the repeated blocks
  stock-ro   stock `transformer.compile_repeated_blocks(mode="reduce-overhead")` (fails on diffusers 0.42.1)
  hk-ro      hookkit.Compile(mode="reduce-overhead"): outputs cloned outside each region + step marks
  hk-ro-mark hk-ro without the output clones (step marks only)
  hk-ro-clone hk-ro without the step marks (output clones only)
  hk-graph   hookkit.Compile(cuda_graphs="transformer"): regional compile + one CUDA graph per transformer call

Random weights, bf16, batch 1, latents out. Prints one markdown table; writes JSON to $OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import traceback
from collections.abc import Callable
from typing import Any

import torch

from hookkit.tools.bench import psnr, timed


def setup_variant(name: str, pipe: Any, memo: bool = False) -> Callable[[], None]:
    """Apply a variant; return its teardown."""
    import hookkit
    from hookkit.core.registry import HookRegistry

    if name == "eager":
        return lambda: None
    if name in ("stock-ro", "stock-regional"):
        mode = "reduce-overhead" if name == "stock-ro" else None
        pipe.transformer.compile_repeated_blocks(fullgraph=True, mode=mode)

        def undo() -> None:
            for m in pipe.transformer.modules():
                if getattr(m, "_compiled_call_impl", None) is not None:
                    m._compiled_call_impl = None
        return undo
    spec = {
        "regional": hookkit.Compile(),
        "hk-ro": hookkit.Compile(mode="reduce-overhead"),
        "hk-ro-mark": hookkit.Compile(mode="reduce-overhead"),
        "hk-ro-clone": hookkit.Compile(mode="reduce-overhead"),
        "hk-graph": hookkit.Compile(cuda_graphs="transformer"),
    }[name]
    handle = hookkit.enable(pipe, hookkit.Spec(compile=spec, memo=memo))
    if name in ("hk-ro-mark", "hk-ro-clone"):
        drop = "hookkit.compile.clone" if name == "hk-ro-mark" else "hookkit.compile.step_mark"
        for module in pipe.transformer.modules():
            reg = HookRegistry.of(module, create=False)
            if reg is not None and drop in reg:
                reg.remove(drop)
    return handle.remove


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="flux", choices=["flux", "qwenimage"])
    p.add_argument("--memo", action="store_true", help="also turn on Spec(memo=True) in hookkit variants")
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--steps", type=int, default=28)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--variants", default="eager,hk-graph,regional,hk-ro,stock-ro")
    p.add_argument("--quick", action="store_true", help="256², 4 steps, 2 runs")
    args = p.parse_args()
    if args.quick:
        args.size, args.steps, args.runs = 256, 4, 2
    out_dir = os.environ.get("OUT", "out")
    os.makedirs(out_dir, exist_ok=True)

    from hookkit.tools import bench, zoo

    bench.require_cuda("compile_flux.py", "On the CPU, benchmarks/regional_dispatch.py measures the host cost of "
                       "regional compilation.")
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        pipe = zoo.full_pipeline(args.model)
    torch.set_default_dtype(torch.float32)
    kw = lambda: zoo.full_call_kwargs(args.model, steps=args.steps, height=args.size, width=args.size)

    rows: list[dict[str, Any]] = []
    reference: torch.Tensor | None = None
    for name in args.variants.split(","):
        torch._dynamo.reset()
        row: dict[str, Any] = {"model": args.model, "variant": name, "size": args.size, "steps": args.steps}
        try:
            teardown = setup_variant(name, pipe, memo=args.memo)
            try:
                warm, out = timed(lambda: pipe(**kw()).images)
                times = []
                for _ in range(args.runs):
                    t, out = timed(lambda: pipe(**kw()).images)
                    times.append(t)
                row.update(warmup_s=round(warm, 2), median_s=round(statistics.median(times), 3),
                           times=[round(t, 3) for t in times],
                           peak_gb=round(torch.cuda.max_memory_allocated() / 2**30, 1))
                if reference is None:
                    reference = out
                row["psnr_db"] = round(psnr(reference, out), 1)
                row["max_abs_err"] = float((out.float() - reference.float()).abs().max())
            finally:
                teardown()
        except Exception as exc:  # record the failure (stock-ro is expected to fail)
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            traceback.print_exc()
        rows.append(row)
        print(json.dumps(row), flush=True)

    eager = next((r["median_s"] for r in rows if r["variant"] == "eager" and "median_s" in r), None)
    print(f"\n| variant | {args.size}² median s | warm-up s | speed-up vs eager | PSNR vs eager dB | max abs err | error |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        sp = f"{eager / r['median_s']:.2f}x" if eager and "median_s" in r else ""
        print(f"| {r['variant']} | {r.get('median_s', '')} | {r.get('warmup_s', '')} | {sp} | {r.get('psnr_db', '')} | "
              f"{r.get('max_abs_err', '')} | {r.get('error', '')} |")
    with open(os.path.join(out_dir, f"compile_{args.model}_{args.size}.json"), "w") as f:
        json.dump({"rows": rows, "torch": torch.__version__, "device": torch.cuda.get_device_name()}, f, indent=1)


if __name__ == "__main__":
    main()
