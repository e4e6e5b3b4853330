"""hookkit's attention kernels on one real masked call: HunyuanVideo 1.5's first block at full width (16 heads x
128, random weights, bf16) at 480x832x81 frames, its self-attention call under the padding mask (34,745 tokens,
34,016 valid) captured from a forward of the embeddings and that block, then the kernel run on chosen heads of it
against float32 SDPA over the valid tokens.

Why: with `hookkit_fp8` on every block the pipeline's output was all non-finite on an H100 (BENCHMARKS.md, "On one
H100: `hookkit_fp8` under the padding mask turns the output non-finite"). This separates the kernel on the model's own
inputs from everything else the pipeline runs: on the CPU (Triton's interpreter, about 16 minutes a head here) it
checks the kernel's arithmetic at that length, on a GPU the compiled kernel on the same inputs (every head, seconds).

    python benchmarks/masked_attention_call.py --heads 0 --out masked_call_cpu.json            # the CPU
    python benchmarks/masked_attention_call.py --device cuda --out masked_call_gpu.json         # every head
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hookkit.tools import zoo  # noqa: E402
from hookkit.tools.bench.runner import _nonfinite  # noqa: E402


class Captured(Exception):
    """Raised by the watched SDPA once it holds the masked call: nothing after it needs to run."""


def capture(device: str, frames: int, height: int, width: int, min_tokens: int) -> dict[str, Any]:
    """Q, K, V and the valid length of the first SDPA call of at least `min_tokens` tokens in a forward of
    HunyuanVideo 1.5's embeddings and first block (the call diffusers makes, its mask checked to be a padding mask:
    every pair of the first `valid` tokens, nothing else)."""
    torch.manual_seed(0)
    with torch.device(device):
        transformer = zoo.full_transformer("hunyuanvideo15", num_layers=1, num_refiner_layers=1).to(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    bf16 = torch.bfloat16
    latent = (1, 65, (frames - 1) // 4 + 1, height // 16, width // 16)  # the 480p VAE: 4x in time, 16x in space
    inputs = dict(hidden_states=torch.randn(*latent, generator=g).to(bf16),
                  timestep=torch.tensor([999.0], dtype=bf16),
                  encoder_hidden_states=torch.randn(1, 1000, 3584, generator=g).to(bf16),
                  encoder_attention_mask=torch.ones(1, 1000, dtype=torch.long),
                  encoder_hidden_states_2=torch.randn(1, 256, 1472, generator=g).to(bf16),
                  encoder_attention_mask_2=torch.ones(1, 256, dtype=torch.long),
                  image_embeds=torch.zeros(1, 729, 1152, dtype=bf16))
    sdpa = F.scaled_dot_product_attention
    held: dict[str, Any] = {}

    def watched(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
                **kwargs: Any) -> torch.Tensor:
        if query.shape[2] >= min_tokens and attn_mask is not None:
            valid = int(attn_mask[0, 0].any(dim=-1).sum())
            padding = bool(attn_mask[0, 0, :valid, :valid].all()) and not bool(attn_mask[0, 0, valid:].any()) \
                and not bool(attn_mask[0, 0, :, valid:].any())
            held.update(q=query, k=key, v=value, valid=valid, padding_mask=padding)
            raise Captured
        return sdpa(query, key, value, attn_mask=attn_mask, **kwargs)

    F.scaled_dot_product_attention = watched
    try:
        with torch.no_grad():
            transformer(**{k: v.to(device) for k, v in inputs.items()})
    except Captured:
        pass
    finally:
        F.scaled_dot_product_attention = sdpa
    if "q" not in held:
        raise SystemExit(f"no masked SDPA call of at least {min_tokens} tokens in the first block")
    return held


#: `run_heads`' name for one launch over every head at once, as the pipeline runs the kernel
ALL_HEADS = -1


def run_heads(call: dict[str, Any], kernel: str, heads: list[int]) -> list[dict[str, Any]]:
    """The kernel on each of `heads` (`ALL_HEADS`: every head in one launch) under the call's padding mask: its
    non-finite values, its error on the valid rows against float32 SDPA over the valid tokens, the padding rows'
    largest magnitude, seconds."""
    import importlib

    module = importlib.import_module(f"hookkit.techniques.attention.{kernel}")
    q, k, v, n = call["q"], call["k"], call["v"], call["valid"]
    valid = torch.arange(q.shape[2], device=q.device) < n
    mask = (valid[:, None] & valid[None, :])[None, None]
    rows = []
    for h in heads:
        head = slice(None) if h == ALL_HEADS else slice(h, h + 1)
        start = time.perf_counter()
        out = module.attention(q[:, head], k[:, head], v[:, head], None, mask).float()
        seconds = time.perf_counter() - start
        exact = F.scaled_dot_product_attention(q[:, head, :n].float(), k[:, head, :n].float(), v[:, head, :n].float())
        rows.append({"head": "all" if h == ALL_HEADS else h, "nonfinite": _nonfinite(out),
                     "mean_rel_error_valid_rows": ((out[:, :, :n] - exact).abs().sum() / exact.abs().sum()).item(),
                     "padding_rows_max_abs": out[:, :, n:].abs().max().item(), "seconds": seconds})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--kernel", default="fp8_triton", choices=("fp8_triton", "int8_triton"))
    p.add_argument("--heads", type=int, nargs="+", default=None,
                   help="heads to run, one launch each, -1 for all heads in one launch as the pipeline runs them "
                        "(default: -1, then every head)")
    p.add_argument("--frames", type=int, default=81)
    p.add_argument("--height", type=int, default=480)
    p.add_argument("--width", type=int, default=832)
    p.add_argument("--min-tokens", type=int, default=2048, help="the first masked call at least this long")
    p.add_argument("--out", type=Path, default=None, help="write the report as JSON here")
    args = p.parse_args(argv)
    if args.out is not None and not args.out.parent.is_dir():
        raise SystemExit(f"--out: expected a file in an existing folder, got {args.out}")
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":  # read when triton is first imported:
        os.execve(sys.executable, [sys.executable, __file__, *(sys.argv[1:] if argv is None else argv)],
                  {**os.environ, "TRITON_INTERPRET": "1"})  # this process has, so it starts again with it set
    call = capture(args.device, args.frames, args.height, args.width, args.min_tokens)
    q, k, v = call["q"], call["k"], call["v"]
    report = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu (Triton's interpreter)",
              "torch": torch.__version__, "kernel": args.kernel, "shape": list(q.shape), "valid": call["valid"],
              "padding_mask": call["padding_mask"],
              "amax": {n: t.float().abs().amax().item() for n, t in (("q", q), ("k", k), ("v", v))},
              "rows": run_heads(call, args.kernel, args.heads or [ALL_HEADS, *range(q.shape[1])])}
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
