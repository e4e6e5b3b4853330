"""SDPA under HunyuanVideo 1.5's padding mask at 480x832, 81 frames: which kernel torch runs and what it costs,
beside the same attention over the valid tokens alone.

Why: HunyuanVideo 1.5's processor builds a boolean mask of every token pair (valid query and valid key) at every
attention call and hands it to SDPA. Valid tokens come first (diffusers reorders the text and image tokens: valid ones,
then padding), so the valid rows of the masked attention equal attention over the valid prefix with no mask. A masked
SDPA call cannot take the flash kernel; this measures what it takes instead, the time the mask costs, and hookkit_fp8
and hookkit_int8 with the mask (they skip the key blocks it leaves out, `mask_tiles.mask_tiles`), and hookkit_fp8 in
other tilings beside its launch (`fp8_triton.launch`: 64 x 128 tiles in 4 warps masked, 128 x 128 in 4 unmasked): over
the valid prefix in 8 warps, masked in `kernel_spills.MASKED_ALTERNATIVES` (128 x 128 in 8 warps and in 4, whose every-
pair loop Triton 3.6 builds with spills, and 128 x 64 in 4: benchmarks/kernel_spills.py), and under the mask's validity
row as the attention mode runs it (`row_hookkit_fp8`: `hooks.run_with_validity_row`, the unmasked kernel over the
valid keys, reordered first and counted on the device) and as it ran before (`row_mask_hookkit_fp8`: the masked kernel
under the `[B, 1, 1, S]` key mask); neither reads the S x S mask. hookkit_int8 the same ways: over the valid prefix,
masked, and under the validity row (`row_hookkit_int8`, `row_mask_hookkit_int8`).

Shapes: batch 1, 16 heads x 128; 32,760 video tokens (21 x 30 x 52 latents) and 1,985 text and image tokens (1,000
Qwen2.5-VL, 256 ByT5, 729 image), of which the 729 image tokens are padding in text-to-video: 34,016 valid of 34,745.
Timed with CUDA events, median and min-max of 10 calls after 2.

    python benchmarks/attention_padding_mask.py OUT.json
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.kernel_spills import MASKED_ALTERNATIVES  # noqa: E402
from benchmarks.timing import summary, time_calls  # noqa: E402

if len(sys.argv) < 2 or not torch.cuda.is_available():
    raise SystemExit("usage: python benchmarks/attention_padding_mask.py OUT.json (needs a CUDA GPU)")

B, H, D = 1, 16, 128
VIDEO, TEXT, BYT5, IMAGE = 21 * 30 * 52, 1000, 256, 729
L = VIDEO + TEXT + BYT5 + IMAGE
VALID = VIDEO + TEXT + BYT5
dev = "cuda"
torch.manual_seed(0)
q, k, v = (torch.randn(B, L, H, D, device=dev, dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))
encoder_mask = torch.zeros(B, TEXT + BYT5 + IMAGE, dtype=torch.bool, device=dev)
encoder_mask[:, :TEXT + BYT5] = True


def build_mask() -> torch.Tensor:
    """The processor's mask, as transformer_hunyuan_video15.py builds it at every attention call."""
    m = F.pad(encoder_mask, (L - encoder_mask.shape[1], 0), value=True).bool()
    m1 = m.view(B, 1, 1, L).repeat(1, 1, L, 1)
    return (m1 & m1.transpose(2, 3)).bool()


def timeit(fn: Callable[[], Any], flops: float | None = None, n: int = 10) -> dict[str, float]:
    """Median and min-max ms of `n` plain calls after 2 (`benchmarks.timing`), with TFLOP/s when `flops` is given."""
    row = summary(time_calls(fn, repeats=n, warmup=2))
    if flops:
        row["tflops"] = flops / row["median_ms"] / 1e9
    return row


from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

out: dict[str, Any] = {"tokens": L, "valid": VALID, "heads": H, "head_dim": D, "torch": torch.__version__,
                       "cudnn": torch.backends.cudnn.version()}
mask = build_mask()
valid_flops = 4 * VALID * VALID * H * D * B
out["mask_build"] = timeit(build_mask)
reference = F.scaled_dot_product_attention(q[:, :, :VALID], k[:, :, :VALID], v[:, :, :VALID])


def compare(o: torch.Tensor) -> dict[str, Any]:
    valid = o[:, :, :VALID].float()
    pad = o[:, :, VALID:].float()
    return {"max_abs_vs_prefix": (valid - reference.float()).abs().max().item(),
            "padding_rows_nan": int(pad.isnan().sum().item()),
            "padding_rows_abs_max": pad.nan_to_num().abs().max().item()}


def run(name: str, fn: Callable[[], torch.Tensor], flops: float) -> None:
    try:
        out[name] = {**timeit(fn, flops), **compare(fn())}
    except Exception:
        out[name] = {"error": traceback.format_exc()[-1500:]}
    print(name, out[name], flush=True)


run("masked_default", lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), valid_flops)
run("masked_with_build", lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=build_mask()), valid_flops)
for backend in ("CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "FLASH_ATTENTION"):
    def forced(backend: str = backend) -> torch.Tensor:
        with sdpa_kernel([getattr(SDPBackend, backend)]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    run(f"masked_{backend.lower()}", forced, valid_flops)


def prefix(backend: str) -> Callable[[], torch.Tensor]:
    def fn() -> torch.Tensor:
        o = torch.zeros_like(q)
        with sdpa_kernel([getattr(SDPBackend, backend)]):
            o[:, :, :VALID] = F.scaled_dot_product_attention(q[:, :, :VALID], k[:, :, :VALID], v[:, :, :VALID])
        return o
    return fn


run("prefix_cudnn", prefix("CUDNN_ATTENTION"), valid_flops)
run("prefix_flash", prefix("FLASH_ATTENTION"), valid_flops)
try:
    from hookkit.techniques.attention import fp8_triton, int8_triton, mask_tiles

    def fp8_prefix(num_warps: int | None = None) -> torch.Tensor:
        o = torch.zeros_like(q)
        o[:, :, :VALID] = fp8_triton.attention(q[:, :, :VALID], k[:, :, :VALID], v[:, :, :VALID], None,
                                               num_warps=num_warps)
        return o
    run("prefix_hookkit_fp8", fp8_prefix, valid_flops)
    run("masked_hookkit_fp8", lambda: fp8_triton.attention(q, k, v, None, mask), valid_flops)
    # other tilings beside the launch's (`fp8_triton.launch`)
    run("prefix_hookkit_fp8_8_warps", lambda: fp8_prefix(num_warps=8), valid_flops)
    for block_m, block_n, warps in MASKED_ALTERNATIVES:
        run(f"masked_hookkit_fp8_{warps}_warps_{block_m}x{block_n}",
            lambda bm=block_m, bn=block_n, w=warps: fp8_triton.attention(q, k, v, None, mask, block_m=bm, block_n=bn,
                                                                         num_warps=w), valid_flops)
    # the mask taken as its validity row, as the attention mode takes the processor's (`outer_masks`): the unmasked
    # kernel over the valid keys (reordered first, counted), and the masked kernel under the [B, 1, 1, L] key mask;
    # each with the padding queries' rows set to 0
    from hookkit.techniques.attention import hooks

    row = F.pad(encoder_mask, (L - encoder_mask.shape[1], 0), value=True).view(B, 1, 1, L)
    sdpa_call = {"query": q, "key": k, "value": v, "scale": None}
    run("row_hookkit_fp8", lambda: hooks.run_with_validity_row("hookkit_fp8", sdpa_call, row), valid_flops)
    run("row_mask_hookkit_fp8",
        lambda: fp8_triton.attention(q, k, v, None, row).masked_fill(~row.transpose(2, 3), 0.0), valid_flops)
    run("masked_hookkit_int8", lambda: int8_triton.attention(q, k, v, None, mask), valid_flops)

    def int8_prefix() -> torch.Tensor:
        o = torch.zeros_like(q)
        o[:, :, :VALID] = int8_triton.attention(q[:, :, :VALID], k[:, :, :VALID], v[:, :, :VALID], None)
        return o
    run("prefix_hookkit_int8", int8_prefix, valid_flops)
    run("row_hookkit_int8", lambda: hooks.run_with_validity_row("hookkit_int8", sdpa_call, row), valid_flops)
    run("row_mask_hookkit_int8",
        lambda: int8_triton.attention(q, k, v, None, row).masked_fill(~row.transpose(2, 3), 0.0), valid_flops)
    run("masked_hookkit_fp8_with_build", lambda: fp8_triton.attention(q, k, v, None, build_mask()), valid_flops)
    tiles = fp8_triton.launch(True)[:2]
    out["mask_tiles"] = timeit(lambda: mask_tiles.key_block_order(mask_tiles.mask_tiles(mask, L, L, *tiles)))
except Exception:
    out["prefix_hookkit_fp8"] = {"error": traceback.format_exc()[-1500:]}
print(json.dumps(out, indent=1))
with open(sys.argv[1], "w") as f:
    json.dump(out, f, indent=1)
