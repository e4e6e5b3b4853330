"""The fp8 attention kernel's tilings and variants at a video shape: which block sizes, warps, pipeline depth, Q·Kᵀ
precision (e4m3 or int8) and exponential (fp32 or fp16x2) `fp8_triton.attention` should run by default.

Default shape: Wan 2.1 14B at 480x832x81 frames (32,760 tokens, 40 heads x 128, batch 1, bf16). Inputs: Gaussian Q
and V, K with a shared channel offset (the statistics K smoothing is for). Each variant is timed whole (quantization
included) as CUDA-graph replays after warm-up, median and min-max of `--repeats`; its error against an fp32
reference on the first `--ref-heads` heads (max abs, mean relative); cuDNN bf16 in the same process for scale. A
variant that fails to compile or run is recorded with its error.

    python benchmarks/attention_fp8_tiling.py --out results/attention_fp8_tiling.json
    python benchmarks/attention_fp8_tiling.py --exp16   # also the fp16x2 exponential
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.timing import summary, time_graph_replays  # noqa: E402

#: (block_m, block_n, num_warps, num_stages)
TILINGS = ("128x64w4s3", "128x128w4s2", "128x128w4s3", "64x128w4s3", "128x128w8s3", "128x128w8s2")
#: the key loop (0 plain, 1 next block's Q·Kᵀ issued before this block's softmax, 2 Triton's warp specialization,
#: 3 two half blocks, the second's exponentials by polynomial)
LOOPS = (0, 1, 3)


def tiling(text: str) -> tuple[int, int, int, int]:
    """"128x64w4s3" -> (block_m 128, block_n 64, num_warps 4, num_stages 3)."""
    m, rest = text.split("x")
    n, rest = rest.split("w")
    w, st = rest.split("s")
    return int(m), int(n), int(w), int(st)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32760)
    p.add_argument("--heads", type=int, default=40)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--ref-heads", type=int, default=4, help="heads the error is measured on (default 4)")
    p.add_argument("--exp16", action="store_true", help="also each variant with the fp16x2 exponential")
    p.add_argument("--loops", type=int, nargs="+", default=list(LOOPS), choices=(0, 1, 2, 3))
    p.add_argument("--tilings", nargs="+", default=list(TILINGS), help="BMxBNwWARPSsSTAGES, e.g. 128x128w4s2")
    p.add_argument("--tma", action="store_true", help="also each variant with descriptor (TMA) loads")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    from hookkit.techniques.attention import fp8_triton

    g = torch.Generator("cuda").manual_seed(0)
    shape = (1, args.heads, args.tokens, args.dim)
    q, v = (torch.randn(shape, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    k = (torch.randn(shape, device="cuda", generator=g) + 2 * torch.randn(1, args.heads, 1, args.dim, device="cuda",
                                                                          generator=g)).to(torch.bfloat16)
    n = args.ref_heads
    ref = torch.cat([F.scaled_dot_product_attention(q[:, h:h + 1].float(), k[:, h:h + 1].float(),
                                                    v[:, h:h + 1].float()) for h in range(n)], dim=1)
    flops = 4 * args.tokens * args.tokens * args.heads * args.dim
    rows: list[dict[str, Any]] = []

    def run(name: str, fn: Any, **what: Any) -> None:
        row: dict[str, Any] = {"variant": name, **what, "error": None}
        try:
            out = fn()
            err = (out[:, :n].float() - ref).abs()
            row["max_abs_error"] = err.max().item()
            row["mean_rel_error"] = (err.mean() / ref.abs().mean()).item()
            timed = time_graph_replays(fn, args.repeats, args.warmup)
            spread = summary(timed.times_ms)
            row.update(times_ms=timed.times_ms, timing=timed.how, **spread,
                       tflops=flops / (spread["median_ms"] * 1e-3) / 1e12)
        except Exception as error:  # noqa: BLE001 - every variant is reported
            row["error"] = f"{type(error).__name__}: {error}"[:400]
            row["traceback"] = traceback.format_exc(limit=4)[-2000:]
        rows.append(row)
        ok = row["error"] is None
        print(f"{name:<40} " + (f"{row['median_ms']:8.3f} ms {row['tflops']:7.1f} TFLOP/s "
                                f"rel {row['mean_rel_error']:.2e}" if ok else f"failed: {row['error'][:120]}"),
              flush=True)

    from torch.nn.attention import SDPBackend, sdpa_kernel

    def cudnn() -> torch.Tensor:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v)

    run("sdpa_cudnn", cudnn)

    def quantize_only() -> torch.Tensor:  # the default tiling's three quantization passes, without the kernel
        fp8_triton.quantize_inputs(q, k, v)
        return ref  # (no output: its "error" is zero)

    run("quantization only (default tiling)", quantize_only)
    for qk_int8, loop, tma, exp_f16 in itertools.product((False, True), args.loops,
                                                         (False, True) if args.tma else (False,),
                                                         (False, True) if args.exp16 else (False,)):
        if loop == 3 and (tma or exp_f16):
            continue  # the split loop loads by pointers and has its own exponentials
        for bm, bn, warps, stages in map(tiling, args.tilings):
            name = (f"{'int8' if qk_int8 else 'fp8'}qk {'exp16' if exp_f16 else 'exp32'} loop{loop} "
                    f"{'tma' if tma else 'ptr'} {bm}x{bn} w{warps} s{stages}")
            kernel_args = dict(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages, qk_int8=qk_int8,
                               exp_f16=exp_f16, loop=loop, tma=tma)
            run(name, lambda a=kernel_args: fp8_triton.attention(q, k, v, **a), **kernel_args)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "shape": list(shape),
                "argv": sys.argv[1:] if argv is None else argv, "flops_formula": "4 * N^2 * heads * dim"}
        args.out.write_text(json.dumps({"meta": meta, "results": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
