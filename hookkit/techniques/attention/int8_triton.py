"""hookkit's low-precision attention kernel (`Attention(low_precision="hookkit_int8")`): SageAttention's recipe in
Triton.

Imported on first use (importing triton is slow, and CPU-only installs have none); on the CPU it runs only under
Triton's interpreter (`TRITON_INTERPRET=1`), which is how the tests check its arithmetic.

The arithmetic, for `q, k, v` `[batch, heads, tokens, head_dim]` in fp16 or bf16:

1. K smoothing: `k - mean(k over tokens)` per batch, head and channel. Softmax is invariant to adding a constant to a
   query's row of scores, and `q . mean(k)` is such a constant, so the output is unchanged in exact arithmetic; what
   changes is the int8 range: diffusion transformers' keys carry a large channel-wise offset shared by every token
   (SageAttention, arXiv 2410.02367, section 4.2), which would otherwise take most of the 256 codes.
2. Per-block int8: each block of `BLOCK_M` query rows (`BLOCK_N` key rows) of one head is scaled by its own
   `amax / 127` and rounded; the query's scale also carries `softmax_scale * log2(e)`, so the kernel's scores are
   already in base-2 units (`exp2`).
3. The kernel: one program per block of `BLOCK_M` query rows of one head; for each block of keys the int8 product
   `q_int8 @ k_int8^T` accumulates exactly in int32 and is rescaled by the two blocks' scales; online softmax (running
   max and sum, flash-attention's rescaling); `P @ V` with P and V in fp16 and fp32 accumulation; one division by the
   running sum at the end, stored in the input's dtype.
"""

from __future__ import annotations

import contextlib
import math

import torch
import triton
import triton.language as tl

from hookkit.techniques.attention import hooks, mask_tiles

#: the head sizes the kernel takes (one block of the head dimension in registers; `tl.arange` needs a power of two)
HEAD_DIMS = (32, 64, 128)
LOG2_E = 1.4426950408889634


@triton.jit
def _int8_key_block(acc, l_i, m_i, q, q_scale, k_ptr, ks_ptr, v_base, bh, k_blocks, block_n, allowed, cols, dims,
                    stride_vs, k_tokens, D: tl.constexpr, BLOCK_N: tl.constexpr):
    """Online softmax over one block of keys and its P·V into `acc`; `allowed` (broadcast to the scores) masks pairs
    out. A row that has seen no allowed key yet (its running max still -inf) shifts by 0, not -inf - -inf (NaN), and
    adds nothing."""
    keys = block_n * BLOCK_N + cols
    k = tl.load(k_ptr + (bh * k_blocks * BLOCK_N + keys[:, None]) * D + dims[None, :])
    k_scale = tl.load(ks_ptr + bh * k_blocks + block_n)
    scores = tl.dot(q, tl.trans(k), out_dtype=tl.int32).to(tl.float32) * (q_scale * k_scale)
    scores = tl.where(allowed, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(scores - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_base + keys[:, None] * stride_vs + dims[None, :], mask=keys[:, None] < k_tokens, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v.to(tl.float16), out_dtype=tl.float32)
    return acc, l_i, m_new


@triton.jit
def _int8_attention_kernel(q_ptr, k_ptr, v_ptr, qs_ptr, ks_ptr, out_ptr, heads, q_tokens, k_tokens, q_blocks, k_blocks,
                           stride_vb, stride_vh, stride_vs, stride_ob, stride_oh, stride_os, mask_ptr, order_ptr,
                           counts_ptr, stride_mb, stride_mh, stride_mq, stride_mk, stride_cb, stride_ch, stride_cq,
                           key_counts_ptr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           MASKED: tl.constexpr, KEY_COUNTS: tl.constexpr):
    """MASKED: a boolean mask, visited by the key block lists of `mask_tiles` (as `fp8_triton`'s kernel does: blocks
    that allow every pair unmasked, then those that allow some with their mask tile; a row with no allowed key is 0).

    KEY_COUNTS (unmasked): batch element b attends to its first `key_counts_ptr[b]` keys only (int32, read on the
    device: no host sync); the key blocks past them are never visited, as in `fp8_triton`'s kernel."""
    block_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    batch, head = bh // heads, bh % heads
    rows = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, D)
    # int8 q and k are padded to whole blocks and contiguous: [batch * heads, blocks * BLOCK, D]
    q = tl.load(q_ptr + (bh * q_blocks * BLOCK_M + rows[:, None]) * D + dims[None, :])
    q_scale = tl.load(qs_ptr + bh * q_blocks + block_m)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    v_base = v_ptr + batch * stride_vb + head * stride_vh
    if MASKED:
        order, n_every, n_some = mask_tiles.key_block_list(order_ptr, counts_ptr, batch, head, block_m, k_blocks,
                                                           stride_cb, stride_ch, stride_cq)
        for t in range(0, n_every):
            block_n = tl.load(order + t)
            acc, l_i, m_i = _int8_key_block(acc, l_i, m_i, q, q_scale, k_ptr, ks_ptr, v_base, bh, k_blocks, block_n,
                                            (cols >= 0)[None, :], cols, dims, stride_vs, k_tokens, D, BLOCK_N)
        for t in range(n_every, n_every + n_some):
            block_n = tl.load(order + t)
            allowed = mask_tiles.mask_tile(mask_ptr, batch, head, rows, block_n * BLOCK_N + cols, q_tokens, k_tokens,
                                           stride_mb, stride_mh, stride_mq, stride_mk)
            acc, l_i, m_i = _int8_key_block(acc, l_i, m_i, q, q_scale, k_ptr, ks_ptr, v_base, bh, k_blocks, block_n,
                                            allowed, cols, dims, stride_vs, k_tokens, D, BLOCK_N)
        l_i = tl.where(l_i > 0, l_i, float("inf"))  # no allowed key: acc is 0, the row comes out 0
    else:
        valid_keys = k_tokens
        if KEY_COUNTS:
            valid_keys = tl.load(key_counts_ptr + batch)
        for block_n in range(0, tl.cdiv(valid_keys, BLOCK_N)):
            acc, l_i, m_i = _int8_key_block(acc, l_i, m_i, q, q_scale, k_ptr, ks_ptr, v_base, bh, k_blocks, block_n,
                                            (block_n * BLOCK_N + cols < valid_keys)[None, :], cols, dims, stride_vs,
                                            k_tokens, D, BLOCK_N)
        if KEY_COUNTS:
            l_i = tl.where(l_i > 0, l_i, float("inf"))  # a count of 0: no key, the row comes out 0
    out = acc / l_i[:, None]
    target = out_ptr + batch * stride_ob + head * stride_oh + rows[:, None] * stride_os + dims[None, :]
    tl.store(target, out.to(out_ptr.dtype.element_ty), mask=rows[:, None] < q_tokens)


def quantize_blocks(x: torch.Tensor, block: int, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` `[B, H, S, D]` as int8 per block of `block` rows of one head: (codes `[B * H, blocks * block, D]`, zero
    padded, contiguous; scales `[B * H, blocks]` float32, each `amax / 127 * scale`)."""
    b, h, s, d = x.shape
    blocks = triton.cdiv(s, block)
    padded = torch.zeros(b * h, blocks * block, d, device=x.device, dtype=torch.float32)
    padded[:, :s] = x.reshape(b * h, s, d)
    grouped = padded.view(b * h, blocks, block, d)
    amax = grouped.abs().amax(dim=(2, 3)).clamp_min(1e-12)
    step = amax / 127.0
    codes = torch.round(grouped / step[:, :, None, None]).clamp_(-127, 127).to(torch.int8)
    return codes.view(b * h, blocks * block, d), (step * scale).contiguous()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
              mask: torch.Tensor | None = None, block_m: int = 128, block_n: int = 64, num_warps: int | None = None,
              num_stages: int | None = None, smooth_k: bool = True,
              key_counts: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q kᵀ · scale) v for `[B, H, S, D]` fp16/bf16 tensors (no dropout, same heads in q and k/v), by the
    int8 kernel; `scale` defaults to `1 / sqrt(D)`. `mask`: None, or a boolean mask as SDPA takes it (True: the pair
    attends; each dimension SDPA's size or 1): key blocks it masks whole are skipped (`mask_tiles`), a row with no
    allowed key is 0, as in SDPA. `block_m`, `block_n`, `num_warps`, `num_stages`: the kernel's tiling, for benchmarks
    (the defaults are what `Attention` runs); `smooth_k=False` skips K smoothing (to measure what it buys: tests,
    benchmarks). `key_counts`: None, or int32 `[B]` on q's device: batch element b attends to its first
    `key_counts[b]` keys only (a padding mask whose valid keys come first, without a mask: the unmasked kernel, its key
    loop ending at the count; K's smoothing and quantization still see every key, which changes no score). Not with
    `mask`."""
    b, h, sq, d = q.shape
    if mask is not None and not hooks.mask_ok(mask, q, k):
        raise ValueError(f"int8_triton.attention: expected a boolean mask broadcastable to {(b, h, sq, k.shape[2])}, "
                         f"got {mask.dtype} {tuple(mask.shape)}")
    if key_counts is not None:
        hooks.check_key_counts("int8_triton", q, mask, key_counts)
    sk = k.shape[2]
    v = v if v.stride(-1) == 1 else v.contiguous()
    softmax_scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    q_codes, q_scales = quantize_blocks(q, block_m, softmax_scale * LOG2_E)
    k_codes, k_scales = quantize_blocks(k - k.mean(dim=2, keepdim=True) if smooth_k else k, block_n)
    out = torch.empty(b, h, sq, d, device=q.device, dtype=q.dtype)
    grid = (triton.cdiv(sq, block_m), b * h)
    options = {k_: v_ for k_, v_ in (("num_warps", num_warps), ("num_stages", num_stages)) if v_ is not None}
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():  # (CPU: Triton's interpreter)
        masked = mask_tiles.kernel_args(mask, sq, sk, block_m, block_n, q_scales)
        _int8_attention_kernel[grid](q_codes, k_codes, v, q_scales, k_scales, out, h, sq, sk, q_scales.shape[1],
                                     k_scales.shape[1], v.stride(0), v.stride(1), v.stride(2), out.stride(0),
                                     out.stride(1), out.stride(2), *masked,
                                     q_scales if key_counts is None else key_counts, D=d, BLOCK_M=block_m,
                                     BLOCK_N=block_n, MASKED=mask is not None, KEY_COUNTS=key_counts is not None,
                                     **options)
    return out
