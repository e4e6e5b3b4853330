"""The CUDA kernel of `hookkit::rms_norm_rope` (norm_rope.py): per-head RMSNorm and rotary embedding in one pass.

Imported only when the op runs on a CUDA tensor. One program takes one token of one stream, every head of it in
registers split into even and odd elements (the rotary pairs): the mean of squares per head (or over all heads, Wan's
`rms_norm_across_heads`), the normalization and the weight, the rotation by the token's table row (read once for all
heads; bf16 tables round every product and sum, as eager bf16 arithmetic does), and the store into the stream's place
in the concatenated output. Every intermediate is rounded where eager rounds it (`_round_bf16`) and the launch turns
floating-point contraction off (`enable_fp_fusion=False`): a product and a sum stay two roundings, as in eager.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from hookkit.techniques.compile.fp8_rows_triton import _round_bf16, ptx


@triton.jit
def _rms_norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, heads, tokens, out_tokens, offset, stride_xb,
                          stride_xs, stride_cs, stride_cj, cos_odd, stride_ss, stride_sj, sin_odd, eps,
                          D: tl.constexpr, HEADS: tl.constexpr, ROUND_FIRST: tl.constexpr, ACROSS: tl.constexpr,
                          BF16_TABLES: tl.constexpr, PTX: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    batch, seq = token // tokens, token % tokens
    head = tl.arange(0, HEADS)[:, None]  # HEADS: the head count rounded up to a power of two
    live = head < heads
    pair = tl.arange(0, D // 2)[None, :]
    source = x_ptr + batch * stride_xb + seq * stride_xs + head * D
    # one contiguous load of each head, split in registers (two strided loads of the even and odd elements were 11x
    # slower on an H200: BENCHMARKS.md)
    x = tl.load(source + tl.arange(0, D)[None, :], mask=live, other=0.0).to(tl.float32)
    even, odd = tl.split(tl.reshape(x, (HEADS, D // 2, 2)))
    # eager: mean(x.float() ** 2) (each square rounded), + eps, rsqrt; the kernel sums the squares in another order
    squares = even * even + odd * odd
    if ACROSS:  # one mean over every head of the token; the weight has one value per head and element
        inverse = tl.rsqrt(tl.sum(tl.sum(squares, axis=1), axis=0) / (heads * D) + eps)
        w_even = tl.load(w_ptr + head * D + 2 * pair, mask=live, other=0.0).to(tl.float32)
        w_odd = tl.load(w_ptr + head * D + 2 * pair + 1, mask=live, other=0.0).to(tl.float32)
    else:
        inverse = tl.rsqrt(tl.sum(squares, axis=1)[:, None] / D + eps)
        w_even = tl.load(w_ptr + 2 * pair).to(tl.float32)
        w_odd = tl.load(w_ptr + 2 * pair + 1).to(tl.float32)
    if ROUND_FIRST:  # diffusers' RMSNorm: (x * r) rounded to bf16, then times the bf16 weight, rounded
        a = _round_bf16(_round_bf16(even * inverse, PTX) * w_even, PTX)
        b = _round_bf16(_round_bf16(odd * inverse, PTX) * w_odd, PTX)
    else:  # torch's rms_norm: x * r * weight in float32, rounded once
        a = _round_bf16((even * inverse) * w_even, PTX)
        b = _round_bf16((odd * inverse) * w_odd, PTX)
    c_even = tl.load(cos_ptr + seq * stride_cs + pair * stride_cj).to(tl.float32)  # this token's row, for every head
    c_odd = tl.load(cos_ptr + seq * stride_cs + pair * stride_cj + cos_odd).to(tl.float32)
    s_even = tl.load(sin_ptr + seq * stride_ss + pair * stride_sj).to(tl.float32)
    s_odd = tl.load(sin_ptr + seq * stride_ss + pair * stride_sj + sin_odd).to(tl.float32)
    # (a, b) rotated: a * cos - b * sin, b * cos + a * sin (each product rounded, then the sum), rounded to bf16
    # (the interpreter's own bf16 cast does not round to nearest: values are rounded first, then cast exactly)
    if BF16_TABLES:  # eager bf16 arithmetic: each product (exact in float32) rounded to bf16, then the sum
        rot_even = _round_bf16(_round_bf16(a * c_even, PTX) - _round_bf16(b * s_even, PTX), PTX).to(tl.bfloat16)
        rot_odd = _round_bf16(_round_bf16(b * c_odd, PTX) + _round_bf16(a * s_odd, PTX), PTX).to(tl.bfloat16)
    else:
        rot_even = _round_bf16(a * c_even - b * s_even, PTX).to(tl.bfloat16)
        rot_odd = _round_bf16(b * c_odd + a * s_odd, PTX).to(tl.bfloat16)
    target = out_ptr + ((batch * out_tokens + offset + seq) * heads + head) * D
    tl.store(target + tl.arange(0, D)[None, :], tl.reshape(tl.join(rot_even, rot_odd), (HEADS, D)), mask=live)


def launch(xs: list[torch.Tensor], weights: list[torch.Tensor], eps: list[float], cos: list[torch.Tensor],
           sin: list[torch.Tensor], round_first: bool, out: torch.Tensor, across_heads: bool = False,
           num_warps: int = 4, use_ptx: bool | None = None) -> None:
    """Fill `out` `[B, sum of tokens, H, D]` stream by stream (norm_rope.py checked shapes and dtypes). A rotation table
    `[tokens, D / 2]` (one value per pair) serves both elements of a pair; a `[tokens, D]` one holds each element's.
    `num_warps`, `use_ptx`: the kernel's variants, for benchmarks (the defaults are what the op runs)."""
    batch, total, heads, dim = out.shape
    offset = 0
    with torch.cuda.device(out.device) if out.is_cuda else contextlib.nullcontext():  # (CPU: Triton's interpreter)
        for x, w, e, c, s in zip(xs, weights, eps, cos, sin, strict=True):
            tokens, paired = x.shape[1], c.shape[1] == dim // 2
            if batch * tokens:
                cj, sj = (c.stride(1), s.stride(1)) if paired else (2 * c.stride(1), 2 * s.stride(1))
                c_odd, s_odd = (0, 0) if paired else (c.stride(1), s.stride(1))
                _rms_norm_rope_kernel[(batch * tokens,)](
                    x, w, c, s, out, heads, tokens, total, offset, x.stride(0), x.stride(1), c.stride(0), cj, c_odd,
                    s.stride(0), sj, s_odd, float(e), D=dim, HEADS=triton.next_power_of_2(heads),
                    ROUND_FIRST=bool(round_first), ACROSS=bool(across_heads),
                    BF16_TABLES=c.dtype == torch.bfloat16, PTX=ptx() if use_ptx is None else use_ptx,
                    num_warps=num_warps, enable_fp_fusion=False)
            offset += tokens
