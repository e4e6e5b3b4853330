"""hookkit's fp8 attention kernel (`Attention(low_precision="hookkit_fp8")`): both products on fp8 tensor cores.

Imported on first use (importing triton is slow); on the CPU it runs in Triton's interpreter (tests: `reference`).

Why: on Hopper fp8 tensor cores run twice as fast as bf16 ones, and at video lengths attention is most of a step; the
int8 kernel (`int8_triton`) halves only Q·Kᵀ, so its P·V keeps the bf16 rate. For `[B, H, S, D]` fp16/bf16 inputs:

1. Quantization (one pass per tensor): Q per block of `BLOCK_M` rows, scaled by its own amax (the scale also carries
   `softmax_scale · log2(e)`: base-2 scores); K smoothed first (`k − mean over tokens`: softmax ignores the per-query
   constant `q · mean(k)`, and diffusion keys share a large channel offset; SageAttention, arXiv 2410.02367), then per
   block of `BLOCK_N` rows; Q and K in int8 (default) or e4m3. V in e4m3 per channel (P·V factors that scale out of
   the sum over keys), stored transposed: Hopper's fp8 products take both operands contiguous along the summed axis;
   on calls of `SMOOTH_V_MIN_KEYS` keys or more V is smoothed first (its mean over the tokens subtracted per channel,
   added to the output: attention weights sum to 1). K's and V's channel means and V's extremes come from one pass
   over each (`channel_statistics`), not five reductions.
2. The kernel, one program per `BLOCK_M` query rows of one head: per key block the product accumulates exactly
   (int32) and is rescaled by the two blocks' scales; online softmax (flash-attention's running max and sum); P =
   `exp2(s − max + 8)`, i.e. scaled by 256 into e4m3's range (the running sum carries the factor), times the e4m3 V
   block into fp32; at the end V's channel scales over the running sum, plus V's channel means. The `loop`, `tma` and
   `exp_f16` variants (none faster on an H200: benchmarks/attention_fp8_tiling.py) are kept to be measured again.
"""

from __future__ import annotations

import contextlib
import math
import os

import torch
import triton
import triton.language as tl

from hookkit.techniques.attention import hooks, mask_tiles
from hookkit.techniques.attention.e4m3_triton import to_fp8 as _to_fp8

#: the head sizes the kernel takes (fp8 tensor-core products sum over multiples of 32; `tl.arange` needs a power of 2)
HEAD_DIMS = (32, 64, 128)
#: the oldest GPU generation with fp8 tensor cores (Ada, sm_89; Hopper is 9.0)
MIN_CAPABILITY = (8, 9)
LOG2_E = 1.4426950408889634
#: e4m3's largest finite value
FP8_MAX = 448.0
_FP8_MAX = tl.constexpr(FP8_MAX)
#: P is computed scaled by 2**P_SHIFT (exact: a power of two) to use more of e4m3's range than [0, 1]
P_SHIFT = 8.0
_P_SHIFT = tl.constexpr(P_SHIFT)

Q_MODE, K_MODE, V_MODE = 0, 1, 2


@triton.jit
def _quantize_kernel(x_ptr, channel_ptr, mean_ptr, codes_ptr, scales_ptr, heads, tokens, blocks, stride_b, stride_h,
                     stride_s, multiplier, D: tl.constexpr, BLOCK: tl.constexpr, MODE: tl.constexpr,
                     INT8: tl.constexpr, INTERPRET: tl.constexpr):
    """One block of `BLOCK` rows of one head of `x` to e4m3 (int8 with `INT8`, Q and K only). Q_MODE: per-block scale
    (times `multiplier`); K_MODE: the channel means (`channel_ptr`) subtracted first; V_MODE: the channel means
    (`mean_ptr`) subtracted, then divided by the channel scales (`channel_ptr` holds their inverses), stored transposed
    `[batch * heads, D, blocks * BLOCK]`. Rows past `tokens` are stored as zeros."""
    blk = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    batch, head = bh // heads, bh % heads
    rows = blk * BLOCK + tl.arange(0, BLOCK)
    dims = tl.arange(0, D)
    valid = rows[:, None] < tokens
    x = tl.load(x_ptr + batch * stride_b + head * stride_h + rows[:, None] * stride_s + dims[None, :], mask=valid,
                other=0.0).to(tl.float32)
    padded = blocks * BLOCK
    if MODE == 2:
        x = tl.where(valid, x - tl.load(mean_ptr + bh * D + dims)[None, :], 0.0)
        x = x * tl.load(channel_ptr + bh * D + dims)[None, :]
        x = tl.minimum(tl.maximum(x, -_FP8_MAX), _FP8_MAX)
        tl.store(codes_ptr + bh * D * padded + dims[None, :] * padded + rows[:, None], _to_fp8(x, INTERPRET))
    else:
        if MODE == 1:
            x = tl.where(valid, x - tl.load(channel_ptr + bh * D + dims)[None, :], 0.0)
        amax = tl.maximum(tl.max(tl.abs(x)), 1e-20)
        top = 127.0 if INT8 else _FP8_MAX
        x = tl.minimum(tl.maximum(x * (top / amax), -top), top)
        if INT8:
            codes = tl.where(x >= 0, x + 0.5, x - 0.5).to(tl.int8)  # round half away from zero
        else:
            codes = _to_fp8(x, INTERPRET)
        tl.store(codes_ptr + (bh * padded + rows[:, None]) * D + dims[None, :], codes)
        tl.store(scales_ptr + bh * blocks + blk, amax / top * multiplier)


@triton.jit
def _channel_statistics_kernel(k_ptr, v_ptr, k_sums_ptr, v_sums_ptr, v_max_ptr, v_min_ptr, heads, tokens, per_split,
                               splits, k_stride_b, k_stride_h, k_stride_s, v_stride_b, v_stride_h, v_stride_s,
                               D: tl.constexpr, BLOCK: tl.constexpr):
    """One split of one head's tokens: the float32 sums of K and of V over them per channel and V's largest and
    smallest value per channel, into row `(batch * heads + head) * splits + split` of `k_sums_ptr`, `v_sums_ptr`,
    `v_max_ptr` and `v_min_ptr` (`[*, D]`)."""
    split = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    batch, head = bh // heads, bh % heads
    dims = tl.arange(0, D)
    start = split * per_split
    end = tl.minimum(start + per_split, tokens)
    k_base = k_ptr + batch * k_stride_b + head * k_stride_h
    v_base = v_ptr + batch * v_stride_b + head * v_stride_h
    k_acc = tl.zeros([BLOCK, D], tl.float32)
    v_acc = tl.zeros([BLOCK, D], tl.float32)
    v_top = tl.full([BLOCK, D], float("-inf"), tl.float32)
    v_bottom = tl.full([BLOCK, D], float("inf"), tl.float32)
    for row0 in range(start, end, BLOCK):
        rows = row0 + tl.arange(0, BLOCK)
        valid = rows[:, None] < end
        k_acc += tl.load(k_base + rows[:, None] * k_stride_s + dims[None, :], mask=valid, other=0.0).to(tl.float32)
        v = tl.load(v_base + rows[:, None] * v_stride_s + dims[None, :], mask=valid, other=0.0).to(tl.float32)
        v_acc += v
        v_top = tl.maximum(v_top, tl.where(valid, v, float("-inf")))
        v_bottom = tl.minimum(v_bottom, tl.where(valid, v, float("inf")))
    out = (bh * splits + split) * D + dims
    tl.store(k_sums_ptr + out, tl.sum(k_acc, 0))
    tl.store(v_sums_ptr + out, tl.sum(v_acc, 0))
    tl.store(v_max_ptr + out, tl.max(v_top, 0))
    tl.store(v_min_ptr + out, tl.min(v_bottom, 0))


@triton.jit
def _exp2_f16x2(x):
    """exp2 of fp16 values, two per instruction (Hopper's `ex2.approx.f16x2`): twice the exponential unit's rate."""
    return tl.inline_asm_elementwise("ex2.approx.f16x2 $0, $1;", "=r,r", [x], dtype=tl.float16, is_pure=True,
                                     pack=2)


@triton.jit
def _raw_scores(q, k, QK_INT8: tl.constexpr):
    """`q · kᵀ` of one block of keys in fp32; with QK_INT8 offset by 1.5 * 2**23, which the row max and the shift of
    the softmax take out. Why the offset: int32 -> fp32 without the conversion unit (a quarter of the ALU's rate on
    Hopper): adding 1.5 * 2**23's bit pattern makes a float whose integer part is the product (exact while
    |product| < 2**22: 127² · 128 is)."""
    if QK_INT8:  # one return: Triton types a return after a constexpr `if` that returned, with this branch's inputs
        s = (tl.dot(q, tl.trans(k), out_dtype=tl.int32) + 0x4B400000).to(tl.float32, bitcast=True)
    else:
        s = tl.dot(q, tl.trans(k))
    return s


@triton.jit
def _scores(q, k_src, ks_base, q_scale, row0, block_n, cols, dims, D: tl.constexpr, BLOCK_N: tl.constexpr,
            QK_INT8: tl.constexpr, TMA: tl.constexpr):
    """The raw scores of one block of keys (`_raw_scores`) and their scale."""
    if TMA:
        k = k_src.load([row0 + block_n * BLOCK_N, 0])
    else:
        k = tl.load(k_src + (row0 + block_n * BLOCK_N + cols[:, None]) * D + dims[None, :])
    return _raw_scores(q, k, QK_INT8), q_scale * tl.load(ks_base + block_n)


@triton.jit
def _softmax_pv(acc, l_i, m_i, s, scale, v_src, v_row0, padded, block_n, k_tokens, cols, dims, D: tl.constexpr,
                BLOCK_N: tl.constexpr, MASK: tl.constexpr, QK_INT8: tl.constexpr, EXP_F16: tl.constexpr,
                TMA: tl.constexpr, INTERPRET: tl.constexpr, SAFE: tl.constexpr = False):
    """Online softmax over one block of scores and its P·V into `acc`. SAFE: a row may have had every key so far
    masked (its running max still -inf); its shift is then 0, not -inf - -inf (NaN), and it adds nothing."""
    offset = 12582912.0 if QK_INT8 else 0.0
    if MASK:
        s = tl.where(block_n * BLOCK_N + cols[None, :] < k_tokens, s, float("-inf"))
    m_new = tl.maximum(m_i, (tl.max(s, 1) - offset) * scale)
    m_use = m_new
    if SAFE:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    x = s * scale - (m_use + offset * scale - _P_SHIFT)[:, None]
    if EXP_F16:
        p16 = _exp2_f16x2(x.to(tl.float16))
        l_ij = tl.sum(p16.to(tl.float32), 1)
        p8 = p16.to(tl.float8e4nv)
    else:
        p = tl.exp2(x)
        l_ij = tl.sum(p, 1)
        p8 = _to_fp8(p, INTERPRET)
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + l_ij
    if TMA:
        vt = v_src.load([v_row0, block_n * BLOCK_N])
    else:
        vt = tl.load(v_src + (v_row0 + dims[:, None]) * padded + block_n * BLOCK_N + cols[None, :])
    acc = tl.dot(p8, tl.trans(vt), acc * alpha[:, None])
    return acc, l_i, m_new


@triton.jit
def _exp2_poly(x):
    """exp2 on the FMA units (a degree-2 polynomial, relative error below 0.3 %, far under e4m3's 6 % step): an fp8
    attention tile on Hopper is bound by the exponential/conversion unit, so half the tile's exponentials go here.
    x <= 8 (scores are shifted so); below -125 it returns 2**-125 (flushed to zero by the cast to e4m3)."""
    x = tl.maximum(x, -125.0)
    t = x + 12582912.0  # 1.5 * 2**23: the float add rounds x to the nearest integer n, held in t's low bits
    f = x - (t - 12582912.0)  # in [-0.5, 0.5]
    p = 1.0008063686 + f * (0.7067171237 + f * 0.2390917277)
    return (p.to(tl.int32, bitcast=True) + (t.to(tl.int32, bitcast=True) << 23)).to(tl.float32, bitcast=True)


@triton.jit
def _key_block_split(acc, l_i, m_i, q, q_scale, k_ptr, ks_base, vt_ptr, k_row0, v_row0, padded, block_n, k_tokens,
                     dims, D: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, QK_INT8: tl.constexpr,
                     INTERPRET: tl.constexpr):
    """One block of keys as two halves: the first half's exponentials on the exponential unit, the second's by
    `_exp2_poly` on the FMA units (two halves, not one tile split in registers: no layout shuffle)."""
    HALF: tl.constexpr = BLOCK_N // 2
    half = tl.arange(0, HALF)
    keys_a = block_n * BLOCK_N + half
    keys_b = keys_a + HALF
    k_a = tl.load(k_ptr + (k_row0 + keys_a[:, None]).to(tl.int64) * D + dims[None, :])
    k_b = tl.load(k_ptr + (k_row0 + keys_b[:, None]).to(tl.int64) * D + dims[None, :])
    scale = q_scale * tl.load(ks_base + block_n)
    s_a = _raw_scores(q, k_a, QK_INT8)
    s_b = _raw_scores(q, k_b, QK_INT8)
    offset = 12582912.0 if QK_INT8 else 0.0
    if MASK:
        s_a = tl.where(keys_a[None, :] < k_tokens, s_a, float("-inf"))
        s_b = tl.where(keys_b[None, :] < k_tokens, s_b, float("-inf"))
    m_new = tl.maximum(m_i, (tl.maximum(tl.max(s_a, 1), tl.max(s_b, 1)) - offset) * scale)
    shift = (m_new + offset * scale - _P_SHIFT)[:, None]
    p_a = tl.exp2(s_a * scale - shift)
    p_b = _exp2_poly(s_b * scale - shift)
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p_a, 1) + tl.sum(p_b, 1)
    vt_a = tl.load(vt_ptr + (v_row0 + dims[:, None]).to(tl.int64) * padded + keys_a[None, :])
    vt_b = tl.load(vt_ptr + (v_row0 + dims[:, None]).to(tl.int64) * padded + keys_b[None, :])
    acc = tl.dot(_to_fp8(p_a, INTERPRET), tl.trans(vt_a), acc * alpha[:, None])
    acc = tl.dot(_to_fp8(p_b, INTERPRET), tl.trans(vt_b), acc)
    return acc, l_i, m_new


@triton.jit
def _fp8_attention_kernel(q_src, k_src, v_src, qs_ptr, ks_ptr, vs_ptr, vm_ptr, out_ptr, heads, q_tokens, k_tokens,
                          q_blocks, k_blocks, stride_ob, stride_oh, stride_os, mask_ptr, order_ptr, counts_ptr,
                          stride_mb, stride_mh, stride_mq, stride_mk, stride_cb, stride_ch, stride_cq, key_counts_ptr,
                          D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QK_INT8: tl.constexpr,
                          EXP_F16: tl.constexpr, LOOP: tl.constexpr, TMA: tl.constexpr, INTERPRET: tl.constexpr,
                          MASKED: tl.constexpr, KEY_COUNTS: tl.constexpr):
    """LOOP 0: one key block after the other; 1: the next block's Q·Kᵀ issued before this block's softmax (the
    tensor cores work while the exponentials run); 2: as 0, warp-specialized by Triton; 3: each block as two halves,
    the second's exponentials by polynomial (`_key_block_split`; pointers only). TMA: blocks loaded by Hopper's
    tensor-memory accelerator (q_src, k_src, v_src are descriptors), else by pointers.

    MASKED (LOOP 0, pointers): a boolean mask (`mask_ptr`, read through its strides) says which pairs attend. The
    query block visits only the key blocks `order_ptr` lists for it (`mask_tiles.key_block_order`: `counts_ptr`
    holds how many allow every pair, which come first and run as unmasked blocks, and how many allow some, which
    load their mask tile); blocks that allow no pair are skipped. Rows that no key is allowed for come out 0, as
    torch's SDPA gives them (V's mean, `vm_ptr`, is added to every other row). `stride_c*`: the block lists' row
    strides per batch, head and query block (0 where the mask broadcasts).

    KEY_COUNTS (unmasked): batch element b attends to its first `key_counts_ptr[b]` keys only (int32, read on the
    device: no host sync); the key blocks past them are never visited, as if `k_tokens` were that count."""
    block_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    batch, head = bh // heads, bh % heads
    rows = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, D)
    padded = k_blocks * BLOCK_N
    q_row0 = (bh * q_blocks * BLOCK_M + block_m * BLOCK_M).to(tl.int32)
    k_row0 = (bh * padded).to(tl.int32)
    v_row0 = (bh * D).to(tl.int32)
    if TMA:
        q = q_src.load([q_row0, 0])
    else:
        q = tl.load(q_src + (q_row0 + tl.arange(0, BLOCK_M)[:, None]).to(tl.int64) * D + dims[None, :])
    q_scale = tl.load(qs_ptr + bh * q_blocks + block_m)
    ks_base = ks_ptr + bh * k_blocks
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    last = k_blocks - 1  # only the last block can hold padding: no mask in the loop
    if KEY_COUNTS:
        k_tokens = tl.load(key_counts_ptr + batch)
        last = tl.maximum(tl.cdiv(k_tokens, BLOCK_N), 1) - 1
    if MASKED:
        order, n_every, n_some = mask_tiles.key_block_list(order_ptr, counts_ptr, batch, head, block_m, k_blocks,
                                                           stride_cb, stride_ch, stride_cq)
        for t in range(0, n_every):
            block_n = tl.load(order + t)
            s, scale = _scores(q, k_src, ks_base, q_scale, k_row0, block_n, cols, dims, D, BLOCK_N, QK_INT8, False)
            acc, l_i, m_i = _softmax_pv(acc, l_i, m_i, s, scale, v_src, v_row0, padded, block_n, k_tokens, cols, dims,
                                        D, BLOCK_N, False, QK_INT8, EXP_F16, False, INTERPRET)
        for t in range(n_every, n_every + n_some):
            block_n = tl.load(order + t)
            s, scale = _scores(q, k_src, ks_base, q_scale, k_row0, block_n, cols, dims, D, BLOCK_N, QK_INT8, False)
            allowed = mask_tiles.mask_tile(mask_ptr, batch, head, rows, block_n * BLOCK_N + cols, q_tokens, k_tokens,
                                           stride_mb, stride_mh, stride_mq, stride_mk)
            s = tl.where(allowed, s, float("-inf"))
            acc, l_i, m_i = _softmax_pv(acc, l_i, m_i, s, scale, v_src, v_row0, padded, block_n, k_tokens, cols, dims,
                                        D, BLOCK_N, False, QK_INT8, EXP_F16, False, INTERPRET, True)
        l_i = tl.where(l_i > 0, l_i, float("inf"))  # no allowed key: acc is 0, the row comes out 0
    elif LOOP == 3:
        for block_n in range(0, last):
            acc, l_i, m_i = _key_block_split(acc, l_i, m_i, q, q_scale, k_src, ks_base, v_src, k_row0, v_row0, padded,
                                             block_n, k_tokens, dims, D, BLOCK_N, False, QK_INT8, INTERPRET)
        acc, l_i, m_i = _key_block_split(acc, l_i, m_i, q, q_scale, k_src, ks_base, v_src, k_row0, v_row0, padded,
                                         last, k_tokens, dims, D, BLOCK_N, True, QK_INT8, INTERPRET)
    elif LOOP == 1:
        s, scale = _scores(q, k_src, ks_base, q_scale, k_row0, 0, cols, dims, D, BLOCK_N, QK_INT8, TMA)
        for block_n in range(0, last):
            s_next, scale_next = _scores(q, k_src, ks_base, q_scale, k_row0, block_n + 1, cols, dims, D, BLOCK_N,
                                         QK_INT8, TMA)
            acc, l_i, m_i = _softmax_pv(acc, l_i, m_i, s, scale, v_src, v_row0, padded, block_n, k_tokens, cols, dims,
                                        D, BLOCK_N, False, QK_INT8, EXP_F16, TMA, INTERPRET)
            s, scale = s_next, scale_next
    else:
        for block_n in tl.range(0, last, warp_specialize=LOOP == 2):
            s, scale = _scores(q, k_src, ks_base, q_scale, k_row0, block_n, cols, dims, D, BLOCK_N, QK_INT8, TMA)
            acc, l_i, m_i = _softmax_pv(acc, l_i, m_i, s, scale, v_src, v_row0, padded, block_n, k_tokens, cols, dims,
                                        D, BLOCK_N, False, QK_INT8, EXP_F16, TMA, INTERPRET)
        s, scale = _scores(q, k_src, ks_base, q_scale, k_row0, last, cols, dims, D, BLOCK_N, QK_INT8, TMA)
    if LOOP != 3 and not MASKED:
        acc, l_i, m_i = _softmax_pv(acc, l_i, m_i, s, scale, v_src, v_row0, padded, last, k_tokens, cols, dims, D,
                                    BLOCK_N, True, QK_INT8, EXP_F16, TMA, INTERPRET)
    v_scale = tl.load(vs_ptr + bh * D + dims)
    v_mean = tl.load(vm_ptr + bh * D + dims)[None, :]
    if MASKED:  # only here: in the unmasked kernel this `where` made Triton 3.6 spill in the key loop (kernel_spills)
        v_mean = tl.where(l_i[:, None] < float("inf"), v_mean, 0.0)
    out = acc * v_scale[None, :] / l_i[:, None] + v_mean
    target = out_ptr + batch * stride_ob + head * stride_oh + rows[:, None] * stride_os + dims[None, :]
    tl.store(target, out.to(out_ptr.dtype.element_ty), mask=rows[:, None] < q_tokens)


def _quantize(x: torch.Tensor, block: int, mode: int, channel: torch.Tensor | None, multiplier: float, int8: bool,
              interpret: bool, mean: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    b, h, s, d = x.shape
    blocks = triton.cdiv(s, block)
    shape = (b * h, d, blocks * block) if mode == V_MODE else (b * h, blocks * block, d)
    codes = torch.empty(shape, device=x.device, dtype=torch.int8 if int8 else torch.float8_e4m3fn)
    scales = torch.empty(b * h, blocks, device=x.device, dtype=torch.float32)
    dummy = scales if channel is None else channel
    _quantize_kernel[(blocks, b * h)](x, dummy, dummy if mean is None else mean, codes, scales, h, s, blocks,
                                      x.stride(0), x.stride(1), x.stride(2), multiplier, D=d, BLOCK=block, MODE=mode,
                                      INT8=int8, INTERPRET=interpret)
    return codes, scales


#: rows of K and V a `_channel_statistics_kernel` step loads, and about how many programs `channel_statistics`
#: launches whatever batch × heads is: on an H100 at Wan 2.1 14B's shape 16 rows and 1,024 programs took 248 µs, 32 or
#: 64 rows 314-339 µs, 256-512 programs 339-565 µs (BENCHMARKS.md)
STATISTICS_BLOCK = 16
STATISTICS_PROGRAMS = 1024


def channel_statistics(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """K's mean over the tokens, V's mean over them and V's largest and smallest value, per (batch, head) and channel:
    float32 `[batch * heads, D]` each, `(k_mean, v_mean, v_max, v_min)`, for `[B, H, S, D]` inputs of any strides with
    contiguous channels.

    Why one kernel: the reductions `k.mean(dim=2)`, `v.mean(dim=2)`, `v.amax(dim=2)` and `v.amin(dim=2)` pass over K
    once and V three times, each strided across tokens (Wan's `[B, S, H, D]` seen as `[B, H, S, D]`). Here each program
    reduces one split of one head's tokens in registers; the splits' partial results are combined by torch in a fixed
    order, so the result is the same on every run (no atomics). V's extremes are exact, the means float32 sums in
    another order than torch's.
    """
    b, h, s, d = k.shape
    splits = max(1, min(triton.cdiv(STATISTICS_PROGRAMS, b * h), triton.cdiv(s, STATISTICS_BLOCK)))
    per_split = max(1, triton.cdiv(triton.cdiv(s, splits), STATISTICS_BLOCK)) * STATISTICS_BLOCK
    splits = max(1, triton.cdiv(s, per_split))
    k_sums, v_sums, v_max, v_min = (torch.empty(b * h * splits, d, device=k.device, dtype=torch.float32)
                                    for _ in range(4))
    _channel_statistics_kernel[(splits, b * h)](k, v, k_sums, v_sums, v_max, v_min, h, s, per_split, splits,
                                                k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
                                                v.stride(2), D=d, BLOCK=STATISTICS_BLOCK, num_warps=4)
    k_mean = k_sums.view(b * h, splits, d).sum(dim=1).div_(s)
    v_mean = v_sums.view(b * h, splits, d).sum(dim=1).div_(s)
    return k_mean, v_mean, v_max.view(b * h, splits, d).amax(dim=1), v_min.view(b * h, splits, d).amin(dim=1)


#: the fewest keys on which V is smoothed. Why smooth: Hopper's fp8 tensor cores add each block of products to an
#: accumulator aligned to the larger of the two with about 14 bits, so a P·V sum that grows with every block of keys
#: (values sharing a channel offset) loses the low bits of the later blocks; on an H100 the kernel erred 6.2x its
#: arithmetic on such a head at 2,048 keys and 19.6x at 8,192 (BENCHMARKS.md). Why not below: over a few blocks that
#: loss is small, and smoothing is not free: on the trained video model's 192-token calls it raised the arithmetic's
#: error (1.63 to 2.17 %, the worst call 2.74 to 6.04 %; CPU). 2,048: the shortest length the departure was measured at
SMOOTH_V_MIN_KEYS = 2048


def smooths_values(keys: int, smooth_value: bool | None = None) -> bool:
    """Whether a call over `keys` keys smooths V: `smooth_value` where given (benchmarks time both ways), else from
    `SMOOTH_V_MIN_KEYS` keys."""
    return keys >= SMOOTH_V_MIN_KEYS if smooth_value is None else smooth_value


def quantize_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                    block_m: int = 128, block_n: int = 128, qk_int8: bool = True,
                    smooth_value: bool | None = None) -> tuple[torch.Tensor, ...]:
    """The kernel's inputs (step 1 of the module docstring): Q and smoothed K codes with their per-block scales
    (Q's times `scale · log2(e)`), V's transposed e4m3 codes, per-channel scales and the channel means taken out of it
    (zeros where the call does not smooth V, `smooths_values`), each `[batch * heads, ...]`. The arguments are
    `attention`'s."""
    d = q.shape[-1]
    interpret = not q.is_cuda
    softmax_scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    q_codes, q_scales = _quantize(q, block_m, Q_MODE, None, softmax_scale * LOG2_E, qk_int8, interpret)
    k_mean, v_mean, top, bottom = channel_statistics(k, v)
    if smooths_values(k.shape[2], smooth_value):
        v_amax = torch.maximum(top - v_mean, v_mean - bottom).clamp_min_(1e-20)
    else:
        v_mean = torch.zeros_like(v_mean)
        v_amax = torch.maximum(top, -bottom).clamp_min_(1e-20)
    k_codes, k_scales = _quantize(k, block_n, K_MODE, k_mean, 1.0, qk_int8, interpret)
    v_codes, _ = _quantize(v, block_n, V_MODE, FP8_MAX / v_amax, 1.0, False, interpret, v_mean)
    return q_codes, q_scales, k_codes, k_scales, v_codes, (v_amax / FP8_MAX).contiguous(), v_mean


def launch(masked: bool) -> tuple[int, int, int]:
    """The kernel's tiling by default: `(block_m, block_n, num_warps)`, 128 x 128 tiles in 4 warps, or 64 x 128 in
    4 warps with a mask. Why smaller tiles there: as Triton 3.6 builds the masked kernel on 128 x 128 tiles in 4 warps
    its every-pair key loop spills registers (the unmasked one's does not), on 64 x 128 nothing spills
    (benchmarks/kernel_spills.py), and that launch runs the masked call fastest on an H100 of those measured (8 warps
    on 128 x 128, 4 on 128 x 64; BENCHMARKS.md); the unmasked kernel is fastest on 128 x 128 in 4."""
    return (64, 128, 4) if masked else (128, 128, 4)


def launch_tiles(masked: bool, block_m: int | None, block_n: int | None) -> tuple[int, int]:
    """`block_m` and `block_n`, each `launch`'s where None."""
    launch_m, launch_n, _ = launch(masked)
    return launch_m if block_m is None else block_m, launch_n if block_n is None else block_n


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
              mask: torch.Tensor | None = None, block_m: int | None = None, block_n: int | None = None,
              num_warps: int | None = None,
              num_stages: int | None = 3, qk_int8: bool = True, exp_f16: bool = False, loop: int = 0,
              tma: bool = False, smooth_value: bool | None = None,
              key_counts: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q kᵀ · scale) v for `[B, H, S, D]` fp16/bf16 tensors (no dropout, same heads in q and k/v), by the fp8
    kernel; `scale` defaults to `1 / sqrt(D)`. The output has q's dtype and strides (a transposed `[B, S, H, D]` view
    in, one out: diffusers' transpose back is then free).

    `mask`: None, or a boolean mask as SDPA takes it (True: the pair attends; each dimension the size of SDPA's
    `[B, H, Sq, Sk]` or 1). Key blocks it masks whole are skipped, so a padding mask costs what the valid tokens cost; a
    row with no allowed key is 0, as in SDPA.
    `block_m`, `block_n`, `num_warps`, `num_stages`, `qk_int8`, `exp_f16`, `loop`, `tma`: the kernel's tiling, Q·Kᵀ's
    precision (int8 codes, SageAttention 2's recipe, instead of e4m3), exponential and loop variants, for benchmarks
    (the defaults are what `Attention` runs; `exp_f16` needs a GPU; a mask takes loop 0 without TMA; `block_m`,
    `block_n`, `num_warps` None: `launch`'s).
    `smooth_value`: smooth V or not whatever the length (`smooths_values`; None, what `Attention` runs: by length).
    `key_counts`: None, or int32 `[B]` on q's device: batch element b attends to its first `key_counts[b]` keys only
    (a padding mask whose valid keys come first, without a mask: the unmasked kernel, its key loop ending at the count;
    the quantization still sees every key, which changes no score). Not with `mask`."""
    b, h, sq, _ = q.shape
    sk = k.shape[2]
    if mask is not None and (loop != 0 or tma or not hooks.mask_ok(mask, q, k)):
        raise ValueError(f"fp8_triton.attention: a mask takes loop=0, tma=False and a boolean mask broadcastable to "
                         f"{(b, h, sq, sk)}; got loop={loop}, tma={tma}, mask {mask.dtype} {tuple(mask.shape)}")
    if key_counts is not None:
        hooks.check_key_counts("fp8_triton", q, mask, key_counts)
    block_m, block_n = launch_tiles(mask is not None, block_m, block_n)
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():  # (CPU: Triton's interpreter)
        inputs = quantize_inputs(q, k, v, scale, block_m, block_n, qk_int8, smooth_value)
    return run_quantized(q, sk, inputs, mask, block_m, block_n, num_warps, num_stages, qk_int8, exp_f16, loop, tma,
                         key_counts)


def run_quantized(q: torch.Tensor, keys: int, inputs: tuple[torch.Tensor, ...], mask: torch.Tensor | None = None,
                  block_m: int = 128, block_n: int = 128, num_warps: int | None = None, num_stages: int | None = 3,
                  qk_int8: bool = True, exp_f16: bool = False, loop: int = 0, tma: bool = False,
                  key_counts: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel alone (step 2 of the module docstring) on `inputs`, what `quantize_inputs` made of `q` and `keys`
    keys with the same `block_m`, `block_n` and `qk_int8`: `attention` without its quantization passes, so that a
    benchmark can time the two apart. The other arguments are `attention`'s (its checks of `mask` and `key_counts` are
    not repeated)."""
    b, h, sq, d = q.shape
    interpret = not q.is_cuda
    q_codes, q_scales, k_codes, k_scales, v_codes, v_scales, v_mean = inputs
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        out = torch.empty_like(q)
        grid = (triton.cdiv(sq, block_m), b * h)
        warps = launch(mask is not None)[2] if num_warps is None else num_warps
        options = {k_: v_ for k_, v_ in (("num_warps", warps), ("num_stages", num_stages)) if v_ is not None}
        if tma:
            from triton.tools.tensor_descriptor import TensorDescriptor

            q_codes = TensorDescriptor.from_tensor(q_codes.view(-1, d), [block_m, d])
            k_codes = TensorDescriptor.from_tensor(k_codes.view(-1, d), [block_n, d])
            v_codes = TensorDescriptor.from_tensor(v_codes.view(-1, v_codes.shape[-1]), [d, block_n])
        masked = mask_tiles.kernel_args(mask, sq, keys, block_m, block_n, q_scales)
        _fp8_attention_kernel[grid](q_codes, k_codes, v_codes, q_scales, k_scales, v_scales, v_mean, out, h, sq, keys,
                                    q_scales.shape[1], k_scales.shape[1], out.stride(0), out.stride(1), out.stride(2),
                                    *masked, q_scales if key_counts is None else key_counts, D=d, BLOCK_M=block_m,
                                    BLOCK_N=block_n, QK_INT8=qk_int8, EXP_F16=exp_f16, LOOP=loop, TMA=tma,
                                    INTERPRET=interpret, MASKED=mask is not None,
                                    KEY_COUNTS=key_counts is not None, **options)
    return out


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
              mask: torch.Tensor | None = None, block_m: int | None = None, block_n: int | None = None,
              qk_int8: bool = True, smooth_value: bool | None = None) -> torch.Tensor:
    """What the kernel computes, in torch (float32, the whole score matrix): the same quantization of Q, smoothed
    K, V (smoothed where `smooths_values`, its mean added back) and P, the same scales. For tests: the kernel's
    online softmax differs from this only by float rounding (the running max is the row max, except where P's
    rounding to fp8 sees a different shift). `block_m`, `block_n` None: `launch`'s, as `attention`'s."""
    b, h, sq, d = q.shape
    softmax_scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    block_m, block_n = launch_tiles(mask is not None, block_m, block_n)

    def blocks_fp8(x: torch.Tensor, block: int) -> torch.Tensor:
        s = x.shape[2]
        n = triton.cdiv(s, block)
        padded = torch.zeros(b, h, n * block, d, dtype=torch.float32, device=x.device)
        padded[:, :, :s] = x
        grouped = padded.view(b, h, n, block, d)
        top = 127.0 if qk_int8 else FP8_MAX
        step = grouped.abs().amax(dim=(3, 4), keepdim=True).clamp_min(1e-20) / top
        scaled = (grouped / step).clamp(-top, top)
        codes = scaled.sign() * (scaled.abs() + 0.5).floor() if qk_int8 else scaled.to(torch.float8_e4m3fn).float()
        return (codes * step).view(b, h, n * block, d)[:, :, :s]

    qf, kf, vf = q.float(), k.float(), v.float()
    qd = blocks_fp8(qf, block_m)
    kd = blocks_fp8(kf - kf.mean(dim=2, keepdim=True), block_n)
    v_mean = (vf.mean(dim=2, keepdim=True) if smooths_values(k.shape[2], smooth_value)
              else torch.zeros_like(vf[:, :, :1]))
    vf = vf - v_mean
    v_step = vf.abs().amax(dim=2, keepdim=True).clamp_min(1e-20) / FP8_MAX
    vd = (vf / v_step).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * v_step
    s = qd @ kd.transpose(-1, -2) * (softmax_scale * LOG2_E)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    top = s.amax(dim=-1, keepdim=True)
    p = torch.exp2(s - torch.where(top == float("-inf"), 0.0, top) + P_SHIFT)
    total = p.sum(dim=-1, keepdim=True)
    out = p.to(torch.float8_e4m3fn).float() @ vd / torch.where(total > 0, total, float("inf"))
    return (out + torch.where(total > 0, v_mean, 0.0)).to(q.dtype)
