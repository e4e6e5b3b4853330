"""The CUDA kernel of `hookkit::rms_norm_rope` (norm_rope.py): per-head RMSNorm and rotary embedding in one pass.

Imported only when the op runs on a CUDA tensor. One program takes one token of one stream, every head of it in
registers split into even and odd elements (the rotary pairs); a token too wide for one program's registers, a chunk of
heads at a time, twice over the token. In it: the mean of squares per head (or over all heads, Wan's
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

from hookkit.errors import HookError
from hookkit.techniques.compile.fp8_rows_triton import _round_bf16, ptx


@triton.jit
def _normalize_rotate(even, odd, inverse, w_even, w_odd, c_even, c_odd, s_even, s_odd, ROUND_FIRST: tl.constexpr,
                      BF16_TABLES: tl.constexpr, PTX: tl.constexpr):
    """The even and odd elements of heads, normalized by `inverse`, weighted and rotated, rounded where eager rounds."""
    if ROUND_FIRST:  # diffusers' RMSNorm: (x * r) rounded to bf16, then times the bf16 weight, rounded
        a = _round_bf16(_round_bf16(even * inverse, PTX) * w_even, PTX)
        b = _round_bf16(_round_bf16(odd * inverse, PTX) * w_odd, PTX)
    else:  # torch's rms_norm: x * r * weight in float32, rounded once
        a = _round_bf16((even * inverse) * w_even, PTX)
        b = _round_bf16((odd * inverse) * w_odd, PTX)
    # (a, b) rotated: a * cos - b * sin, b * cos + a * sin (each product rounded, then the sum), rounded to bf16
    # (the interpreter's own bf16 cast does not round to nearest: values are rounded first, then cast exactly)
    if BF16_TABLES:  # eager bf16 arithmetic: each product (exact in float32) rounded to bf16, then the sum
        rot_even = _round_bf16(_round_bf16(a * c_even, PTX) - _round_bf16(b * s_even, PTX), PTX).to(tl.bfloat16)
        rot_odd = _round_bf16(_round_bf16(b * c_odd, PTX) + _round_bf16(a * s_odd, PTX), PTX).to(tl.bfloat16)
    else:
        rot_even = _round_bf16(a * c_even - b * s_even, PTX).to(tl.bfloat16)
        rot_odd = _round_bf16(b * c_odd + a * s_odd, PTX).to(tl.bfloat16)
    return rot_even, rot_odd


@triton.jit
def _table_row(cos_ptr, sin_ptr, seq, stride_cs, stride_cj, cos_odd, stride_ss, stride_sj, sin_odd,
               D: tl.constexpr):
    """This token's rotation table row, for every head: cos and sin of each pair's even and odd element."""
    pair = tl.arange(0, D // 2)[None, :]
    c_even = tl.load(cos_ptr + seq * stride_cs + pair * stride_cj).to(tl.float32)
    c_odd = tl.load(cos_ptr + seq * stride_cs + pair * stride_cj + cos_odd).to(tl.float32)
    s_even = tl.load(sin_ptr + seq * stride_ss + pair * stride_sj).to(tl.float32)
    s_odd = tl.load(sin_ptr + seq * stride_ss + pair * stride_sj + sin_odd).to(tl.float32)
    return c_even, c_odd, s_even, s_odd


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
    c_even, c_odd, s_even, s_odd = _table_row(cos_ptr, sin_ptr, seq, stride_cs, stride_cj, cos_odd, stride_ss,
                                              stride_sj, sin_odd, D)
    rot_even, rot_odd = _normalize_rotate(even, odd, inverse, w_even, w_odd, c_even, c_odd, s_even, s_odd,
                                          ROUND_FIRST, BF16_TABLES, PTX)
    target = out_ptr + ((batch * out_tokens + offset + seq) * heads + head) * D
    tl.store(target + tl.arange(0, D)[None, :], tl.reshape(tl.join(rot_even, rot_odd), (HEADS, D)), mask=live)


@triton.jit
def _rms_norm_rope_chunked_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, heads, tokens, out_tokens, offset,
                                  stride_xb, stride_xs, stride_cs, stride_cj, cos_odd, stride_ss, stride_sj, sin_odd,
                                  eps, D: tl.constexpr, CHUNK: tl.constexpr, ROUND_FIRST: tl.constexpr,
                                  BF16_TABLES: tl.constexpr, PTX: tl.constexpr):
    """A norm over all heads of a token too wide for one program's registers (Wan 2.1 14B: 40 heads x 128): `CHUNK`
    heads at a time, twice over the token: the squares summed, then each chunk read again (from cache), normalized,
    weighted, rotated and stored. No head is padded beyond the last chunk's."""
    token = tl.program_id(0).to(tl.int64)
    batch, seq = token // tokens, token % tokens
    pair = tl.arange(0, D // 2)[None, :]
    source = x_ptr + batch * stride_xb + seq * stride_xs
    target = out_ptr + ((batch * out_tokens + offset + seq) * heads) * D
    squares = tl.zeros((CHUNK, D // 2), dtype=tl.float32)
    for first in range(0, heads, CHUNK):
        head = first + tl.arange(0, CHUNK)[:, None]
        x = tl.load(source + head * D + tl.arange(0, D)[None, :], mask=head < heads, other=0.0).to(tl.float32)
        even, odd = tl.split(tl.reshape(x, (CHUNK, D // 2, 2)))
        squares += even * even + odd * odd
    inverse = tl.rsqrt(tl.sum(tl.sum(squares, axis=1), axis=0) / (heads * D) + eps)
    c_even, c_odd, s_even, s_odd = _table_row(cos_ptr, sin_ptr, seq, stride_cs, stride_cj, cos_odd, stride_ss,
                                              stride_sj, sin_odd, D)
    for first in range(0, heads, CHUNK):
        head = first + tl.arange(0, CHUNK)[:, None]
        live = head < heads
        x = tl.load(source + head * D + tl.arange(0, D)[None, :], mask=live, other=0.0).to(tl.float32)
        even, odd = tl.split(tl.reshape(x, (CHUNK, D // 2, 2)))
        w_even = tl.load(w_ptr + head * D + 2 * pair, mask=live, other=0.0).to(tl.float32)
        w_odd = tl.load(w_ptr + head * D + 2 * pair + 1, mask=live, other=0.0).to(tl.float32)
        rot_even, rot_odd = _normalize_rotate(even, odd, inverse, w_even, w_odd, c_even, c_odd, s_even, s_odd,
                                              ROUND_FIRST, BF16_TABLES, PTX)
        tl.store(target + head * D + tl.arange(0, D)[None, :],
                 tl.reshape(tl.join(rot_even, rot_odd), (CHUNK, D)), mask=live)


def launch(xs: list[torch.Tensor], weights: list[torch.Tensor], eps: list[float], cos: list[torch.Tensor],
           sin: list[torch.Tensor], round_first: bool, out: torch.Tensor, across_heads: bool = False,
           num_warps: int = 4, use_ptx: bool | None = None, chunk_heads: int | None = None) -> None:
    """Fill `out` `[B, sum of tokens, H, D]` stream by stream (norm_rope.py checked shapes and dtypes). A rotation table
    `[tokens, D / 2]` (one value per pair) serves both elements of a pair; a `[tokens, D]` one holds each element's.
    `chunk_heads` (a power of two; with `across_heads` only): the chunked kernel, that many heads at a time (the op
    passes it where a token is too wide for one program). `num_warps`, `use_ptx`: the kernel's variants, for benchmarks
    (the defaults are what the op runs)."""
    if chunk_heads is not None and not (across_heads and chunk_heads > 0 and chunk_heads & (chunk_heads - 1) == 0):
        raise HookError(f"norm_rope_triton.launch: chunk_heads expected a power of two with across_heads=True, got "
                        f"{chunk_heads} (across_heads={across_heads}). Pass one, or None for the one-program kernel.")
    batch, total, heads, dim = out.shape
    offset = 0
    with torch.cuda.device(out.device) if out.is_cuda else contextlib.nullcontext():  # (CPU: Triton's interpreter)
        for x, w, e, c, s in zip(xs, weights, eps, cos, sin, strict=True):
            tokens, paired = x.shape[1], c.shape[1] == dim // 2
            if batch * tokens:
                cj, sj = (c.stride(1), s.stride(1)) if paired else (2 * c.stride(1), 2 * s.stride(1))
                c_odd, s_odd = (0, 0) if paired else (c.stride(1), s.stride(1))
                common = (x, w, c, s, out, heads, tokens, total, offset, x.stride(0), x.stride(1), c.stride(0), cj,
                          c_odd, s.stride(0), sj, s_odd, float(e))
                variant = dict(D=dim, ROUND_FIRST=bool(round_first), BF16_TABLES=c.dtype == torch.bfloat16,
                               PTX=ptx() if use_ptx is None else use_ptx, num_warps=num_warps, enable_fp_fusion=False)
                if chunk_heads is None:
                    _rms_norm_rope_kernel[(batch * tokens,)](*common, HEADS=triton.next_power_of_2(heads),
                                                             ACROSS=bool(across_heads), **variant)
                else:
                    _rms_norm_rope_chunked_kernel[(batch * tokens,)](*common, CHUNK=chunk_heads, **variant)
            offset += tokens
