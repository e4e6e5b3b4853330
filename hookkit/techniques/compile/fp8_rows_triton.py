"""The CUDA kernel of `hookkit::fp8_quantize_rows` (fp8_rows.py): one program per row, the whole row in registers.

Imported only when the op runs on a CUDA tensor (importing triton is slow, and CPU-only installs have none). Rows are held in
registers in the input dtype, in chunks of 4,096 columns (a first version held fp32 rows of power-of-two width and
spilled registers: 468 µs instead of inductor's 245 µs for Flux's proj_out input). The
arithmetic follows eager torchao step by step: GELU in fp32 rounded to the input dtype, the row amax, the scale
`amax / 448` rounded to the input dtype, correctly rounded division (Triton's `/` is approximate), clamp to ±448,
round-to-nearest-even e4m3. The division is exact without `div_rn`: the reciprocal of the row scale once per row,
then two FMAs per element (Markstein), correctly rounded as IEEE division is.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

#: columns per register chunk; a piece takes at most MAX_CHUNKS of them (wider pieces stay inductor's: fp8_rows)
CHUNK = 4096
MAX_CHUNKS = 4


# Chunk C of a row in the input dtype (half the registers of fp32); with GELU, torch's tanh GELU computed in fp32 and
# rounded to the input dtype, as eager stores it (masked lanes stay 0: GELU(0) = 0).
# FAST: tanh(u) = 1 - 2 / (exp(2u) + 1) with Triton's approximate division (the relaxed kernel of BENCHMARKS.md).
@triton.jit
def _chunk(ptr, row, stride, width, C: tl.constexpr, CHUNK: tl.constexpr, GELU: tl.constexpr, FAST: tl.constexpr):
    cols = C * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(ptr + row * stride + cols, mask=cols < width, other=0.0)
    if GELU:
        f = x.to(tl.float32)
        u = 0.7978845608028654 * (f + 0.044715 * (f * f * f))
        if FAST:
            t = 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)
        else:
            t = libdevice.tanh(u)
        f = 0.5 * f * (1.0 + t)
        x = f.to(ptr.dtype.element_ty)
    return x


@triton.jit
def _amax(x):
    return tl.max(tl.abs(x.to(tl.float32)), axis=0)


# The division by the row scale s. Exact: Markstein's correction of the product by the correctly rounded reciprocal
# `inverse` = RN(1/s): q0 = RN(f * inverse), r = f - q0 * s (exact with an FMA), q = RN(q0 + r * inverse) is RN(f / s),
# as IEEE division (`div_rn`) gives it, for two FMAs instead of div_rn's subroutine (benchmarks/markstein_check.py
# checks the rounding); a zero keeps its sign (the correction would turn -0 into +0, and eager's -0 / s is -0).
@triton.jit
def _put(q_ptr, offset, x, scale, inverse, width, C: tl.constexpr, CHUNK: tl.constexpr, FAST: tl.constexpr):
    cols = C * CHUNK + tl.arange(0, CHUNK)
    f = x.to(tl.float32)
    if FAST:
        q = f / scale
    else:
        q0 = f * inverse
        q = tl.fma(tl.fma(-q0, tl.zeros_like(f) + scale, f), tl.zeros_like(f) + inverse, q0)
        q = tl.where(q0 == 0.0, q0, q)
    q = tl.clamp(q, -448.0, 448.0)
    tl.store(q_ptr + offset + cols, q.to(tl.float8e4nv), mask=cols < width)


# One program per row: up to 4 chunks of piece A and 4 of piece B held in registers, read once.
@triton.jit
def _fp8_quantize_rows_kernel(a_ptr, b_ptr, q_ptr, s_ptr, width_a, width_b, stride_a, stride_b, floor,
                              CHUNK: tl.constexpr, NA: tl.constexpr, NB: tl.constexpr,
                              GELU_A: tl.constexpr, GELU_B: tl.constexpr, FAST: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    a0 = _chunk(a_ptr, row, stride_a, width_a, 0, CHUNK, GELU_A, FAST)
    amax = _amax(a0)
    if NA > 1:
        a1 = _chunk(a_ptr, row, stride_a, width_a, 1, CHUNK, GELU_A, FAST)
        amax = tl.maximum(amax, _amax(a1))
    if NA > 2:
        a2 = _chunk(a_ptr, row, stride_a, width_a, 2, CHUNK, GELU_A, FAST)
        amax = tl.maximum(amax, _amax(a2))
    if NA > 3:
        a3 = _chunk(a_ptr, row, stride_a, width_a, 3, CHUNK, GELU_A, FAST)
        amax = tl.maximum(amax, _amax(a3))
    if NB > 0:
        b0 = _chunk(b_ptr, row, stride_b, width_b, 0, CHUNK, GELU_B, FAST)
        amax = tl.maximum(amax, _amax(b0))
    if NB > 1:
        b1 = _chunk(b_ptr, row, stride_b, width_b, 1, CHUNK, GELU_B, FAST)
        amax = tl.maximum(amax, _amax(b1))
    if NB > 2:
        b2 = _chunk(b_ptr, row, stride_b, width_b, 2, CHUNK, GELU_B, FAST)
        amax = tl.maximum(amax, _amax(b2))
    if NB > 3:
        b3 = _chunk(b_ptr, row, stride_b, width_b, 3, CHUNK, GELU_B, FAST)
        amax = tl.maximum(amax, _amax(b3))
    amax = tl.maximum(amax, floor)  # torchao's lower bound (fp8_rows.floor_in)
    # eager divides the amax by 448 in the input dtype: IEEE division (div_rn), rounded to that dtype
    scale = tl.math.div_rn(amax, amax * 0.0 + 448.0).to(a_ptr.dtype.element_ty).to(tl.float32)
    inverse = tl.math.div_rn(scale * 0.0 + 1.0, scale)
    out = row * (width_a + width_b)
    _put(q_ptr, out, a0, scale, inverse, width_a, 0, CHUNK, FAST)
    if NA > 1:
        _put(q_ptr, out, a1, scale, inverse, width_a, 1, CHUNK, FAST)
    if NA > 2:
        _put(q_ptr, out, a2, scale, inverse, width_a, 2, CHUNK, FAST)
    if NA > 3:
        _put(q_ptr, out, a3, scale, inverse, width_a, 3, CHUNK, FAST)
    if NB > 0:
        _put(q_ptr, out + width_a, b0, scale, inverse, width_b, 0, CHUNK, FAST)
    if NB > 1:
        _put(q_ptr, out + width_a, b1, scale, inverse, width_b, 1, CHUNK, FAST)
    if NB > 2:
        _put(q_ptr, out + width_a, b2, scale, inverse, width_b, 2, CHUNK, FAST)
    if NB > 3:
        _put(q_ptr, out + width_a, b3, scale, inverse, width_b, 3, CHUNK, FAST)
    tl.store(s_ptr + row, scale)


def _rows(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1, t.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def quantize(pieces: Sequence[torch.Tensor], gelu: Sequence[bool], fast: bool = False, *, floor: float
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 data [..., sum of widths], float32 scale [..., 1]) of one or two pieces (fp8_rows checked them);
    `fast`: tanh from exp and approximate division instead of libdevice's tanh and IEEE division; `floor`: the
    smallest row amax (`fp8_rows.floor_in`: torchao's lower bound as the input's dtype holds it)."""
    lead = pieces[0].shape[:-1]
    a = _rows(pieces[0])
    two = len(pieces) == 2
    b = _rows(pieces[1]) if two else a
    width_a, width_b = a.shape[1], b.shape[1] if two else 0
    rows = a.shape[0]
    q = torch.empty((rows, width_a + width_b), device=a.device, dtype=torch.float8_e4m3fn)
    s = torch.empty((rows, 1), device=a.device, dtype=torch.float32)
    if rows:
        chunk = min(CHUNK, triton.next_power_of_2(max(width_a, width_b)))
        na, nb = triton.cdiv(width_a, chunk), triton.cdiv(width_b, chunk)
        lanes = (na + nb) * chunk
        with torch.cuda.device(a.device):
            _fp8_quantize_rows_kernel[(rows,)](
                a, b, q, s, width_a, width_b, a.stride(0), b.stride(0), float(floor), CHUNK=chunk, NA=na, NB=nb,
                GELU_A=bool(gelu[0]), GELU_B=bool(two and gelu[1]), FAST=bool(fast),
                num_warps=8 if lanes >= 8192 else 4 if lanes >= 2048 else 2)
    return q.reshape(*lead, width_a + width_b), s.reshape(*lead, 1)


# fp32 -> the nearest bf16 (ties to even), returned as fp32, where eager rounds between its operations. On a GPU (`PTX`)
# one `cvt.rn.bf16.f32` instruction as inline PTX, which no compiler pass folds away (a `.to(bf16).to(fp32)` round trip
# measured as if one rounding were missing: a fifth of the row scales moved; BENCHMARKS.md). Triton's CPU
# interpreter runs no PTX: there the same rounding in integer arithmetic, which it runs exactly (on a GPU, where integer
# operations run at half the float rate, the AdaLN kernel took 31 µs per Flux-sized call with it and 23 µs with PTX,
# in two different measurements, not side by side).
@triton.jit
def _round_bf16(x, PTX: tl.constexpr):
    if PTX:
        return tl.inline_asm_elementwise("cvt.rn.bf16.f32 $0, $1;", "=h,r", [x], dtype=tl.bfloat16, is_pure=True,
                                         pack=1).to(tl.float32)
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))  # NaN stays NaN


def ptx() -> bool:
    """Whether kernels run as PTX on a GPU (False in Triton's CPU interpreter, `TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True")


# One program per ROWS consecutive tokens of one batch element of `layer_norm(h) * a + b`, each row in registers
# (BLOCK >= width) in turn: mean and variance in fp32 (two passes over the registers), then with ROUNDED (Flux's bf16
# form) the normalized row, the product and the sum each rounded to bf16 as eager rounds them, without it (Wan's
# float32 form, float32 a and b) float32 throughout and one rounding to bf16 at the end; the amax, the scale
# `amax / 448` rounded to bf16, approximate division, clamp, e4m3. The modulation rows a and b are the same for every
# token of a batch element: loaded once per program, not once per row (float32 rows of 5,120 are 40 KB a token).
@triton.jit
def _fp8_quantize_layer_norm_rows_kernel(h_ptr, a_ptr, b_ptr, q_ptr, s_ptr, width, tokens, stride_h, stride_a,
                                         stride_b, eps, floor, BLOCK: tl.constexpr, PTX: tl.constexpr,
                                         ROUNDED: tl.constexpr, ROWS: tl.constexpr):
    batch = tl.program_id(1).to(tl.int64)
    first = tl.program_id(0).to(tl.int64) * ROWS
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    a = tl.load(a_ptr + batch * stride_a + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + batch * stride_b + cols, mask=mask, other=0.0).to(tl.float32)
    for i in range(ROWS):
        token = first + i
        if token < tokens:
            row = batch * tokens + token
            x = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
            mean = tl.sum(x, axis=0) / width
            centred = tl.where(mask, x - mean, 0.0)
            var = tl.sum(centred * centred, axis=0) / width
            normed = centred * tl.rsqrt(var + eps)
            if ROUNDED:
                y = _round_bf16(_round_bf16(_round_bf16(normed, PTX) * a, PTX) + b, PTX)
            else:
                y = _round_bf16(normed * a + b, PTX)
            amax = tl.maximum(tl.max(tl.where(mask, tl.abs(y), 0.0), axis=0), floor)
            scale = _round_bf16(tl.math.div_rn(amax, amax * 0.0 + 448.0), PTX)
            q = tl.clamp(y / scale, -448.0, 448.0)
            tl.store(q_ptr + row * width + cols, q.to(tl.float8e4nv), mask=mask)
            tl.store(s_ptr + row, scale)


def _batch_rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A `[B or 1, 1, width]` modulation tensor (or a `[width]` one, a norm's weight) as `[B or 1, width]` rows with
    unit column stride, and its batch stride (0 when one row serves every batch element)."""
    rows = t[None] if t.dim() == 1 else t[:, 0, :]
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    return rows, rows.stride(0) if rows.shape[0] > 1 else 0


#: tokens one program of the AdaLN kernel quantizes, sharing one load of the modulation rows, by `rounded` (the bf16
#: form, Flux's; False: Wan's float32 form). Measured on one H100 (BENCHMARKS.md, "Wan's float32 AdaLN input in one
#: pass"): Wan 2.1 14B's input (32,760 tokens of 5,120) takes 469 us at one token a program and 326 us at 16 (343 at 4,
#: 330 at 8); Flux's (4,608 of 3,072) 27.1 us at one and 35.5 us at two
LAYER_NORM_ROWS = {True: 1, False: 16}


def quantize_layer_norm(h: torch.Tensor, a: torch.Tensor, b: torch.Tensor, eps: float, use_ptx: bool | None = None,
                        rounded: bool = True, rows_per_program: int | None = None, *, floor: float
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 data like h, float32 scale [..., 1]) of `layer_norm(h) * a + b` (fp8_rows checked the shapes);
    `rounded=False`: Wan's float32 form, one rounding to bf16 at the end; `use_ptx=False` rounds in integer arithmetic
    on a GPU too (benchmarks compare the two); `rows_per_program`: tokens a program quantizes (default
    `LAYER_NORM_ROWS` of the form; benchmarks sweep it), the same values for any; `floor`: the smallest row amax
    (`fp8_rows.floor_in(torch.bfloat16)`)."""
    batch, tokens, width = h.shape
    flat = _rows(h)
    a_rows, stride_a = _batch_rows(a)
    b_rows, stride_b = _batch_rows(b)
    q = torch.empty((batch * tokens, width), device=h.device, dtype=torch.float8_e4m3fn)
    s = torch.empty((batch * tokens, 1), device=h.device, dtype=torch.float32)
    if batch * tokens:
        block = triton.next_power_of_2(width)
        rows = LAYER_NORM_ROWS[rounded] if rows_per_program is None else rows_per_program
        with torch.cuda.device(h.device):
            _fp8_quantize_layer_norm_rows_kernel[(triton.cdiv(tokens, rows), batch)](
                flat, a_rows, b_rows, q, s, width, tokens, flat.stride(0), stride_a, stride_b, float(eps),
                float(floor), BLOCK=block, PTX=ptx() if use_ptx is None else use_ptx, ROUNDED=rounded,
                ROWS=rows,
                num_warps=8 if block >= 4096 else 4 if block >= 1024 else 2)
    return q.reshape(batch, tokens, width), s.reshape(batch, tokens, 1)
