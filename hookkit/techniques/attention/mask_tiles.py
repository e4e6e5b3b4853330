"""Boolean attention masks for hookkit's Triton kernels, tile by tile: which key blocks each query block must visit.

Why: a mask that leaves whole tiles out (padding: HunyuanVideo 1.5 masks every pair with a padding token) should
cost what the allowed pairs cost. One pass over the mask classifies each `BLOCK_M` x `BLOCK_N` tile (every pair
allowed, some, none); per query block the key blocks to visit are then listed, every-pair blocks first (they run
unmasked), then some-pair blocks (they read their mask tile); none-pair blocks are skipped. All on the device, with no
host sync (CUDA-graph safe). `fp8_triton` and `int8_triton` take the lists.

Imported on first use with the kernels (importing triton is slow); on the CPU it runs under Triton's interpreter.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl


@triton.jit
def _mask_tiles_kernel(mask_ptr, states_ptr, mask_rows, k_tokens, q_blocks, k_blocks, heads, stride_mb, stride_mh,
                       stride_mq, stride_mk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    """What one `BLOCK_M` x `BLOCK_N` tile of a boolean mask allows: 0 no pair, 1 every pair, 2 some. Rows past
    `mask_rows` (the last block's padding queries, stored nowhere) allow everything; keys past `k_tokens` nothing, so
    the last key block of a length that is no multiple of `BLOCK_N` is never "every pair". `states_ptr` is
    `[mask batch, mask heads, q_blocks, k_blocks]` int8; the mask is read through its strides (0 where it broadcasts),
    once, `ROWS` rows a step: the whole tile at once, 128 values a thread in 4 warps, made ptxas spill kilobytes a
    thread (benchmarks/kernel_spills.py)."""
    block_n = tl.program_id(0)
    block_m = tl.program_id(1)
    bh = tl.program_id(2).to(tl.int64)
    batch, head = bh // heads, bh % heads
    keys = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    columns = mask_ptr + batch * stride_mb + head * stride_mh + keys[None, :] * stride_mk
    some = tl.zeros([ROWS, BLOCK_N], tl.int32)
    every = tl.full([ROWS, BLOCK_N], 1, tl.int32)
    for row0 in range(0, BLOCK_M, ROWS):
        rows = block_m * BLOCK_M + row0 + tl.arange(0, ROWS)
        inside = (rows[:, None] < mask_rows) & (keys[None, :] < k_tokens)
        allowed = tl.load(columns + rows[:, None].to(tl.int64) * stride_mq, mask=inside, other=0).to(tl.int32)
        some = tl.maximum(some, allowed)
        every = tl.minimum(every, tl.where(rows[:, None] < mask_rows, allowed, 1))
    state = tl.where(tl.max(tl.max(some, 1), 0) == 0, 0, tl.where(tl.min(tl.min(every, 1), 0) == 1, 1, 2))
    tl.store(states_ptr + (bh * q_blocks + block_m) * k_blocks + block_n, state.to(tl.int8))


#: mask rows `_mask_tiles_kernel` reads a step (16 values a thread in 4 warps)
TILE_ROWS_A_STEP = 16


@triton.jit
def key_block_list(order_ptr, counts_ptr, batch, head, block_m, k_blocks, stride_cb, stride_ch, stride_cq):
    """In a kernel: this query block's list of key blocks (`key_block_order`) and how many of them allow every pair
    and how many some; `stride_c*` are the lists' row strides (`kernel_args`)."""
    crow = batch * stride_cb + head * stride_ch + block_m * stride_cq
    return order_ptr + crow * k_blocks, tl.load(counts_ptr + crow * 2), tl.load(counts_ptr + crow * 2 + 1)


@triton.jit
def mask_tile(mask_ptr, batch, head, rows, keys, q_tokens, k_tokens, stride_mb, stride_mh, stride_mq, stride_mk):
    """In a kernel: the mask's `rows` x `keys` tile as booleans, False outside the queries and keys."""
    allowed = tl.load(mask_ptr + batch * stride_mb + head * stride_mh + rows[:, None].to(tl.int64) * stride_mq
                      + keys[None, :] * stride_mk, mask=(rows[:, None] < q_tokens) & (keys[None, :] < k_tokens),
                      other=0)
    return allowed != 0


def mask_tiles(mask: torch.Tensor, q_tokens: int, k_tokens: int, block_m: int = 128,
               block_n: int = 128) -> torch.Tensor:
    """What each `block_m` x `block_n` tile of a boolean mask (4 dimensions, `hooks.mask_ok`) allows: int8
    `[mask batch, mask heads, query blocks, key blocks]`, 0 no pair, 1 every pair, 2 some (`_mask_tiles_kernel`). A
    mask that broadcasts over queries has one query block."""
    mb, mh, mq, _ = mask.shape
    q_blocks = 1 if mq == 1 else triton.cdiv(q_tokens, block_m)
    k_blocks = triton.cdiv(k_tokens, block_n)
    states = torch.empty(mb, mh, q_blocks, k_blocks, device=mask.device, dtype=torch.int8)
    strides = [0 if n == 1 else s for n, s in zip(mask.shape, mask.stride(), strict=True)]
    _mask_tiles_kernel[(k_blocks, q_blocks, mb * mh)](mask.view(torch.uint8), states, mq, k_tokens, q_blocks, k_blocks,
                                                      mh, *strides, BLOCK_M=block_m, BLOCK_N=block_n,
                                                      ROWS=min(TILE_ROWS_A_STEP, block_m))
    return states


def key_block_order(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query block, the key blocks to visit: int32 `[..., key blocks]`, those that allow every pair first, then
    those that allow some, each in ascending order (the rest after them, never read); and int32 `[..., 2]`, how many
    of each. On the device, without a host sync (CUDA-graph safe)."""
    k_blocks = states.shape[-1]
    rank = torch.where(states == 1, 0, torch.where(states == 2, 1, 2)).to(torch.int32)
    index = torch.arange(k_blocks, device=states.device, dtype=torch.int32)
    order = torch.argsort(rank * k_blocks + index, dim=-1).to(torch.int32).contiguous()
    counts = torch.stack([(states == 1).sum(-1), (states == 2).sum(-1)], dim=-1).to(torch.int32).contiguous()
    return order, counts


def kernel_args(mask: torch.Tensor | None, q_tokens: int, k_tokens: int, block_m: int, block_n: int,
                dummy: torch.Tensor) -> list[Any]:
    """The ten mask arguments of a kernel launch: the mask as bytes, the key block lists and their counts, the mask's
    four strides (0 where it broadcasts), the lists' row strides per batch, head and query block (0 where the mask
    broadcasts). Without a mask: `dummy` for the three tensors and zeros (the kernel's MASKED is then off)."""
    if mask is None:
        return [dummy] * 3 + [0] * 7
    mask4 = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    order, counts = key_block_order(mask_tiles(mask4, q_tokens, k_tokens, block_m, block_n))
    strides = [0 if n == 1 else s for n, s in zip(mask4.shape, mask4.stride(), strict=True)]
    rows = [0 if n == 1 else s // order.shape[-1] for n, s in zip(order.shape[:3], order.stride()[:3], strict=True)]
    return [mask4.view(torch.uint8), order, counts, *strides, *rows]
