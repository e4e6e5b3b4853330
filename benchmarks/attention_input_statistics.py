"""K's and V's channel means and V's channel extremes for `hookkit_fp8` at a video shape: torch's four reductions
against `fp8_triton.channel_statistics`'s one pass over each, and `fp8_triton.quantize_inputs` whole.

Default shape: Wan 2.1 14B at 480x832x81 frames (32,760 tokens, 40 heads x 128, batch 1, bf16), in the layout a
diffusers attention processor hands SDPA: `[B, S, H, D]` tensors seen through a transpose as `[B, H, S, D]`. Each row
is timed as CUDA-graph replays after warm-up (median and min-max of `--repeats`); the kernel's results are compared
with torch's (the means' largest difference: float32 sums in another order; the extremes must be equal).

    python benchmarks/attention_input_statistics.py --out attention_input_statistics.json
    python benchmarks/attention_input_statistics.py --blocks 4 8 16 32 64 --programs 256 512 1024 2048 4096 8192

`--blocks` / `--programs`: also the kernel at each `fp8_triton.STATISTICS_BLOCK` and `STATISTICS_PROGRAMS` given
(rows a step loads, programs launched), the tiling sweep its defaults were chosen by.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.timing import summary, time_graph_replays  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32760)
    p.add_argument("--heads", type=int, default=40)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--blocks", type=int, nargs="*", default=[], help="STATISTICS_BLOCK values to sweep")
    p.add_argument("--programs", type=int, nargs="*", default=[], help="STATISTICS_PROGRAMS values to sweep")
    p.add_argument("--out", type=Path, default=None, help="JSON file to write (its folder is created)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA device: the kernel runs on the GPU (its arithmetic is tested in Triton's interpreter)")
    return args


def torch_statistics(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`channel_statistics`'s results by torch's strided reductions, one a statistic."""
    b, h, _, d = k.shape
    k_mean, v_mean = (t.mean(dim=2, dtype=torch.float32).reshape(b * h, d) for t in (k, v))
    top, bottom = (t.float().reshape(b * h, d) for t in (v.amax(dim=2), v.amin(dim=2)))
    return k_mean, v_mean, top, bottom


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    from hookkit.techniques.attention import fp8_triton

    g = torch.Generator("cuda").manual_seed(0)
    shape = (1, args.tokens, args.heads, args.dim)  # [B, S, H, D], seen as [B, H, S, D]
    q, k, v = ((torch.randn(shape, device="cuda", generator=g) * 2 + torch.randn(args.dim, device="cuda", generator=g))
               .to(torch.bfloat16).transpose(1, 2) for _ in range(3))
    bytes_kv = 2 * k.numel() * k.element_size()
    rows: list[dict[str, Any]] = []
    want = torch_statistics(k, v)
    names = ("k_mean", "v_mean", "v_max", "v_min")
    checks = {f"{name}_max_abs_diff": (got - expected).abs().max().item()
              for name, got, expected in zip(names, fp8_triton.channel_statistics(k, v), want, strict=True)}
    for name, fn in (("torch: k.mean, v.mean, v.amax, v.amin", lambda: torch_statistics(k, v)),
                     ("hookkit: channel_statistics", lambda: fp8_triton.channel_statistics(k, v)),
                     ("quantize_inputs (Q, K, V codes and scales)", lambda: fp8_triton.quantize_inputs(q, k, v))):
        timed = time_graph_replays(fn, args.repeats, args.warmup)
        spread = summary(timed.times_ms)
        row = {"row": name, **spread, "timing": timed.how, "times_ms": timed.times_ms,
               "tb_per_s_k_and_v": bytes_kv / (spread["median_ms"] * 1e-3) / 1e12}
        rows.append(row)
        print(f"{name:<45} {spread['median_ms'] * 1e3:8.1f} us ({spread['min_ms'] * 1e3:.1f}-"
              f"{spread['max_ms'] * 1e3:.1f})  K+V read at {row['tb_per_s_k_and_v']:.2f} TB/s", flush=True)
    defaults = fp8_triton.STATISTICS_BLOCK, fp8_triton.STATISTICS_PROGRAMS
    sweep = ([(b, n) for b in args.blocks or [defaults[0]] for n in args.programs or [defaults[1]]]
             if args.blocks or args.programs else [])
    try:
        for block, programs in sweep:
            fp8_triton.STATISTICS_BLOCK, fp8_triton.STATISTICS_PROGRAMS = block, programs
            timed = time_graph_replays(lambda: fp8_triton.channel_statistics(k, v), args.repeats, args.warmup)
            spread = summary(timed.times_ms)
            rows.append({"row": f"channel_statistics, {block} rows a step, about {programs} programs", **spread,
                         "block": block, "programs": programs, "timing": timed.how,
                         "v_extremes_equal": all(torch.equal(got, expected) for got, expected in
                                                 zip(fp8_triton.channel_statistics(k, v)[2:], want[2:], strict=True))})
            print(f"{rows[-1]['row']:<60} {spread['median_ms'] * 1e3:8.1f} us", flush=True)
    finally:
        fp8_triton.STATISTICS_BLOCK, fp8_triton.STATISTICS_PROGRAMS = defaults
    print(json.dumps(checks), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "shape_bshd": list(shape),
                "argv": sys.argv[1:] if argv is None else argv, **checks}
        args.out.write_text(json.dumps({"meta": meta, "results": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
