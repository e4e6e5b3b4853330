"""Per-head e4m3 quantization of Q, K and V in Triton, for FlashInfer's fp8 kernel outside torch.compile.

`flashinfer_fa3.quantize` runs this on a CUDA device when it is not being traced. Why: the same arithmetic as torch
ops took 4.8 ms a call at Wan 2.1 14B's attention shape (40 heads x 128, 32,760 tokens) beside the kernel's 25.4 ms,
float32 temporaries and a pass over the tensor per op; two kernels a tensor read it twice and write one byte a value.
Under torch.compile the torch ops are traced instead and inductor fuses them into the block's graph.

The result is the torch ops' bit for bit (`flashinfer_fa3.quantize_torch`; tested in Triton's interpreter): K's mean
over the tokens comes from the same torch reduction (V's from the caller), K and V are smoothed in float32, a head's
amax is a max (exact in any order), its scale is computed by the caller's rule (`flashinfer_fa3.scale_of`), and each
value is multiplied by the scale's float32 inverse, clamped to +-448 and rounded to the nearest e4m3, ties to even.

1. `_block_amax_kernel`: one program per block of `BLOCK // D` tokens of one head writes the block's amax;
2. torch reduces the blocks' amaxes to the head's, the scale rule makes scales and inverses (`[B, H]`);
3. `_cast_kernel`: the same blocks scaled, clamped and stored as e4m3, in the input's layout.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

#: e4m3's largest finite value
E4M3_MAX = 448.0
_E4M3_MAX = tl.constexpr(E4M3_MAX)
#: values a program reads (`BLOCK // D` tokens of a head of D): 64 float32 registers a thread at `NUM_WARPS`
BLOCK = 16384
NUM_WARPS = 8


@triton.jit
def to_fp8(x, INTERPRET: tl.constexpr):
    """fp32 -> e4m3 with round-to-nearest-even. Under Triton's interpreter the value is first rounded to e4m3's
    precision, the interpreter's own conversion being wrong there (on a GPU the hardware conversion does it): normals
    to 3 mantissa bits by integer arithmetic (the interpreter drops the carry when rounding reaches the next power of
    two: 1.97 -> 1.0, not 2.0); subnormals (below 2^-6) to a multiple of 2^-9 by adding and subtracting 1.5 * 2^14,
    whose float32 spacing is 2^-9, sign kept (the interpreter truncates them)."""
    if INTERPRET:
        bits = x.to(tl.int32, bitcast=True)
        rounded = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
        subnormal = (tl.abs(x) + 24576.0) - 24576.0
        subnormal = tl.where(bits < 0, -subnormal, subnormal)  # the sign kept, zeros' too
        x = tl.where(tl.abs(x) < 0.015625, subnormal, rounded.to(tl.float32, bitcast=True))
    return x.to(tl.float8e4nv, fp_downcast_rounding="rtne")


@triton.jit
def _load_block(x_ptr, mean_ptr, bh, heads, tokens, stride_b, stride_h, stride_s, stride_d, D: tl.constexpr,
                BLOCK_S: tl.constexpr, SMOOTH: tl.constexpr):
    """Block `program_id(0)` of head `bh` in float32 (K minus its float32 channel means with SMOOTH), rows past
    `tokens` zero."""
    rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    dims = tl.arange(0, D)
    valid = rows[:, None] < tokens
    offsets = _offsets(bh, heads, rows, dims, stride_b, stride_h, stride_s, stride_d)
    x = tl.load(x_ptr + offsets, mask=valid, other=0.0).to(tl.float32)
    if SMOOTH:
        x = tl.where(valid, x - tl.load(mean_ptr + bh * D + dims)[None, :], 0.0)
    return x


@triton.jit
def _offsets(bh, heads, rows, dims, stride_b, stride_h, stride_s, stride_d):
    return (bh // heads) * stride_b + (bh % heads) * stride_h + rows[:, None] * stride_s + dims[None, :] * stride_d


@triton.jit
def _block_amax_kernel(x_ptr, mean_ptr, amax_ptr, heads, tokens, blocks, stride_b, stride_h, stride_s, stride_d,
                       D: tl.constexpr, BLOCK_S: tl.constexpr, SMOOTH: tl.constexpr):
    bh = tl.program_id(1).to(tl.int64)
    x = _load_block(x_ptr, mean_ptr, bh, heads, tokens, stride_b, stride_h, stride_s, stride_d, D, BLOCK_S, SMOOTH)
    tl.store(amax_ptr + bh * blocks + tl.program_id(0), tl.max(tl.max(tl.abs(x), axis=1), axis=0))


@triton.jit
def _cast_kernel(x_ptr, mean_ptr, inverse_ptr, out_ptr, heads, tokens, stride_b, stride_h, stride_s, stride_d,
                 out_b, out_h, out_s, out_d, D: tl.constexpr, BLOCK_S: tl.constexpr, SMOOTH: tl.constexpr,
                 INTERPRET: tl.constexpr):
    bh = tl.program_id(1).to(tl.int64)
    x = _load_block(x_ptr, mean_ptr, bh, heads, tokens, stride_b, stride_h, stride_s, stride_d, D, BLOCK_S, SMOOTH)
    x = tl.minimum(tl.maximum(x * tl.load(inverse_ptr + bh), -_E4M3_MAX), _E4M3_MAX)
    rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    out = _offsets(bh, heads, rows, tl.arange(0, D), out_b, out_h, out_s, out_d)
    tl.store(out_ptr + out, to_fp8(x, INTERPRET), mask=rows[:, None] < tokens)


def head_quantize(x: torch.Tensor, scale_of: Callable[[torch.Tensor], torch.Tensor],
                  mean: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A `[B, H, N, D]` fp16/bf16 tensor (minus `mean`, float32 `[B, H, 1, D]`, where given) in e4m3 with one scale
    per (batch, head), `scale_of` its amax: `(codes, scales)`, codes in `x`'s layout where it is dense, scales float32
    `[B, H]`. `D` a power of two."""
    b, h, n, d = x.shape
    rows = BLOCK // d
    blocks = triton.cdiv(n, rows)
    interpret = not x.is_cuda
    means = x if mean is None else mean.reshape(b * h, d).contiguous()  # unread without SMOOTH
    amax = torch.empty(b * h, blocks, device=x.device, dtype=torch.float32)
    strides = (x.stride(0), x.stride(1), x.stride(2), x.stride(3))
    smooth = mean is not None
    _block_amax_kernel[(blocks, b * h)](x, means, amax, h, n, blocks, *strides, D=d, BLOCK_S=rows, SMOOTH=smooth,
                                        num_warps=NUM_WARPS)
    scales = scale_of(amax.amax(dim=1).reshape(b, h))
    inverse = (1.0 / scales).contiguous()
    codes = torch.empty_like(x, dtype=torch.float8_e4m3fn)  # x's layout where it is dense, else contiguous
    _cast_kernel[(blocks, b * h)](x, means, inverse, codes, h, n, *strides, *codes.stride(), D=d, BLOCK_S=rows,
                                  SMOOTH=smooth, INTERPRET=interpret, num_warps=NUM_WARPS)
    return codes, scales


def quantize(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             scale_of: Callable[[torch.Tensor], torch.Tensor],
             mean_of_value: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """`flashinfer_fa3.quantize`'s result, `(q8, k8, v8, q_scale, k_scale, v_scale)`, by the kernels above; `scale_of`
    makes a head's scale from its amax (`flashinfer_fa3.scale_of`), `mean_of_value` (float32 `[B, H, 1, D]`), where
    given, is taken out of V as K's mean is out of K."""
    q8, q_scale = head_quantize(query, scale_of)
    k8, k_scale = head_quantize(key, scale_of, key.mean(dim=2, keepdim=True, dtype=torch.float32))
    v8, v_scale = head_quantize(value, scale_of, mean_of_value)
    return q8, k8, v8, q_scale, k_scale, v_scale
