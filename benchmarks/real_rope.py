"""Qwen-Image's query/key prologue compiled with and without `Compile(real_rope)`'s pass, side by side.

The prologue of every Qwen-Image attention call: RMSNorm of the image and text queries and keys over the head
dimension, then the complex rotary embedding (`apply_rotary_emb_qwen(..., use_real=False)`), at Qwen-Image 1024²'s
shapes (4,096 image + 128 text tokens, 24 heads of 128, bf16). Compiled by inductor as hookkit compiles a region,
once with hookkit's `RealComplexMul` post-grad pass and once without (inductor runs the complex product as an ATen
kernel); the outputs are compared bitwise and each variant is timed (medians after warm-up, min-max shown) with the
kernels of its generated code counted.

    python benchmarks/real_rope.py                    # the GPU when there is one, else the CPU
    python benchmarks/real_rope.py --device cpu --runs 20
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen  # noqa: E402
from torch._inductor.utils import run_and_get_code  # noqa: E402

from hookkit.techniques.compile.real_rope import RealComplexMul  # noqa: E402


def prologue(img_q: torch.Tensor, img_k: torch.Tensor, txt_q: torch.Tensor, txt_k: torch.Tensor,
             img_freqs: torch.Tensor, txt_freqs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What QwenDoubleStreamAttnProcessor2_0 does between the QKV projections and the attention."""
    def norm(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), eps=1e-6)

    return (apply_rotary_emb_qwen(norm(img_q), img_freqs, use_real=False),
            apply_rotary_emb_qwen(norm(img_k), img_freqs, use_real=False),
            apply_rotary_emb_qwen(norm(txt_q), txt_freqs, use_real=False),
            apply_rotary_emb_qwen(norm(txt_k), txt_freqs, use_real=False))


def inputs(device: torch.device, img: int, txt: int, heads: int, dim: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    qk = [torch.randn(1, n, heads, dim, generator=g).to(device, torch.bfloat16) for n in (img, img, txt, txt)]
    freqs = [torch.polar(torch.ones(n, dim // 2), torch.randn(n, dim // 2, generator=g)).to(device) for n in (img, txt)]
    return (*qk, *freqs)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(fn: Any, args: tuple[torch.Tensor, ...], device: torch.device, warmup: int, runs: int) -> list[float]:
    for _ in range(warmup):
        fn(*args)
    sync(device)
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn(*args)
        sync(device)
        out.append(1e3 * (time.perf_counter() - t0))
    return out


def variant(name: str, rope: RealComplexMul | None, args: tuple[torch.Tensor, ...], device: torch.device,
            warmup: int, runs: int) -> tuple[dict[str, Any], tuple[torch.Tensor, ...]]:
    torch._dynamo.reset()
    options = {"fx_graph_cache": False} | ({"post_grad_custom_pre_pass": rope} if rope is not None else {})
    fn = torch.compile(prologue, options=options)
    with torch.no_grad():
        out, code = run_and_get_code(fn, *args)
        times = timed_ms(fn, args, device, warmup, runs)
    text = "\n".join(code)
    kernels = len(re.findall(r"async_compile\.(?:cpp_pybinding|cpp|triton)\(", text))
    row = dict(variant=name, ms=statistics.median(times), ms_min=min(times), ms_max=max(times),
               generated_kernels=kernels, aten_complex_calls=text.count("aten.view_as_complex"),
               rewritten=rope.rewritten if rope is not None else None)
    return row, out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--img-tokens", type=int, default=4096)
    p.add_argument("--txt-tokens", type=int, default=128)
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = p.parse_args()
    device = torch.device(args.device)
    xs = inputs(device, args.img_tokens, args.txt_tokens, args.heads, args.head_dim)
    complex_row, complex_out = variant("complex (inductor's ATen fallback)", None, xs, device, args.warmup, args.runs)
    real_row, real_out = variant("real_rope (hookkit's pass)", RealComplexMul(), xs, device, args.warmup, args.runs)
    real_row["bitwise_complex_path"] = all(torch.equal(a, b) for a, b in zip(real_out, complex_out, strict=True))
    real_row["max_abs_diff"] = max((a.float() - b.float()).abs().max().item()
                                   for a, b in zip(real_out, complex_out, strict=True))
    doc = dict(script="benchmarks/real_rope.py", argv=sys.argv[1:], device=str(device), torch=torch.__version__,
               shapes=dict(img=args.img_tokens, txt=args.txt_tokens, heads=args.heads, head_dim=args.head_dim),
               threads=torch.get_num_threads(), rows=[complex_row, real_row],
               speedup=complex_row["ms"] / real_row["ms"])
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "real_rope.json").write_text(json.dumps(doc, indent=2) + "\n")
    print("| variant | median ms | min-max ms | generated kernels | ATen complex calls |")
    print("|---|---|---|---|---|")
    for r in doc["rows"]:
        print(f"| {r['variant']} | {r['ms']:.3f} | {r['ms_min']:.3f}-{r['ms_max']:.3f} | "
              f"{r['generated_kernels']} | {r['aten_complex_calls']} |")
    print(f"speed-up {doc['speedup']:.2f}x; bitwise the complex path: {real_row['bitwise_complex_path']} "
          f"(max |diff| {real_row['max_abs_diff']:.3g})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
