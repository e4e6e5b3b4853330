"""A stand-in `flashinfer` module for the CPU tests: what FlashInfer's source says `single_prefill_with_kv_cache` computes
(with fp8 inputs: each head's Q, K and V times its scale; P times 448 rounded to e4m3 for P·V, the row sums before
rounding), each call recorded. Put it in `sys.modules["flashinfer"]` (the `stand_in` fixture of
`test_attention_flashinfer.py` does)."""

from __future__ import annotations

import importlib.machinery
import types
from collections.abc import Callable
from typing import Any

import torch


class StandIn(types.ModuleType):
    """A `flashinfer` module for the CPU: FlashInfer's fp8 semantics (its `StandardFP8Attention`), each call
    recorded."""

    def __init__(self, version: str = "0.2.14.post1") -> None:
        super().__init__("flashinfer")
        self.__version__ = version
        self.__spec__ = importlib.machinery.ModuleSpec("flashinfer", None)
        self.calls: list[dict[str, Any]] = []

    def single_prefill_with_kv_cache(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                                     o_dtype: torch.dtype, causal: bool, sm_scale: float, kv_layout: str, backend: str,
                                     scale_q: torch.Tensor | None = None, scale_k: torch.Tensor | None = None,
                                     scale_v: torch.Tensor | None = None) -> torch.Tensor:
        scales = (scale_q, scale_k, scale_v)
        self.calls.append({"shapes": (tuple(q.shape), tuple(k.shape), tuple(v.shape)), "dtype": q.dtype,
                           "scales": None if scale_q is None else tuple(tuple(s.shape) for s in scales),
                           "o_dtype": o_dtype, "causal": causal, "sm_scale": sm_scale, "kv_layout": kv_layout,
                           "backend": backend})
        ones = torch.ones(q.shape[1])
        qf, kf, vf = (t.float().transpose(0, 1) * (ones if s is None else s)[:, None, None]
                      for t, s in zip((q, k, v), scales))
        out = fa3_semantics(qf, kf, vf, sm_scale, causal, fp8=scale_q is not None)
        return out.transpose(0, 1).contiguous().to(o_dtype)  # [N, H, D], as FlashInfer allocates it


def fa3_semantics(qf: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor, sm_scale: float, causal: bool,
                  fp8: bool) -> torch.Tensor:
    """What FA3's kernel (FlashInfer's port and FA3's own) computes from dequantized float32 `[..., N, D]` Q, K, V: the
    fp8 kernel rounds P * 448 to e4m3 for P·V and divides by 448 and the row sums of P before rounding."""
    scores = qf @ kf.transpose(-1, -2) * sm_scale
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    p = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    pv = (p * 448.0).to(torch.float8_e4m3fn).float() / 448.0 if fp8 else p
    return pv @ vf / p.sum(dim=-1, keepdim=True)


def applying_first_heads_scales(call: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`call` (a `single_prefill_with_kv_cache`) as a kernel that applies the first head's fp8 scales to every head:
    a mistake only inputs whose heads differ in range show."""
    def wrapped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        for name in ("scale_q", "scale_k", "scale_v"):
            kwargs[name] = kwargs[name][:1].expand_as(kwargs[name]).contiguous()
        return call(q, k, v, **kwargs)
    return wrapped


def rounding_against_a_running_maximum(tile: int) -> Callable[..., torch.Tensor]:
    """A `single_prefill_with_kv_cache` with FlashInfer's fp8 semantics computed as its kernel does over more keys
    than a tile: online softmax, P of each `tile` keys times 448 (as `reference`) rounded to e4m3 against the running
    maximum of the scores so far, earlier tiles' sums rescaled when the maximum grows. Only the rounding of P differs
    from `StandIn`'s, by as much as it rounds."""
    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, o_dtype: torch.dtype, sm_scale: float,
             scale_q: torch.Tensor, scale_k: torch.Tensor, scale_v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        qf, kf, vf = (t.float().transpose(0, 1) * s[:, None, None] for t, s in zip((q, k, v), (scale_q, scale_k,
                                                                                                 scale_v)))
        scores = qf @ kf.transpose(1, 2) * sm_scale
        top = torch.full(scores.shape[:-1] + (1,), float("-inf"))
        acc, total = torch.zeros(qf.shape[:-1] + (vf.shape[-1],)), torch.zeros_like(top)
        for start in range(0, scores.shape[-1], tile):
            s = scores[..., start:start + tile]
            new_top = torch.maximum(top, s.amax(dim=-1, keepdim=True))
            shrink = torch.exp(top - new_top)
            p = torch.exp(s - new_top)
            p8 = (p * 448.0).to(torch.float8_e4m3fn).float() / 448.0
            acc = acc * shrink + p8 @ vf[:, start:start + tile]
            total = total * shrink + p.sum(dim=-1, keepdim=True)
            top = new_top
        return (acc / total).transpose(0, 1).contiguous().to(o_dtype)
    return call


def accumulating_p_v_in_limited_precision(bits: int = 14, keys: int = 32) -> Callable[..., torch.Tensor]:
    """A `single_prefill_with_kv_cache` with FlashInfer's fp8 semantics (`StandIn`'s), its P·V accumulated as Hopper's
    fp8 tensor cores do by DeepSeek-V3's report: each instruction adds the products of `keys` keys to the running sum
    aligned to the largest of them with about `bits` bits, the lower bits cut (towards zero). On values whose channels
    share an offset the sum grows with every block of keys and each block loses more of its low bits."""
    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, o_dtype: torch.dtype, sm_scale: float,
             scale_q: torch.Tensor, scale_k: torch.Tensor, scale_v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        qf, kf = (t.double().transpose(0, 1) * s.double()[:, None, None] for t, s in zip((q, k), (scale_q, scale_k)))
        codes = v.double().transpose(0, 1)  # [H, N, D]: V's e4m3 codes, scaled after the sum as the kernel does
        scores = qf @ kf.transpose(1, 2) * sm_scale
        p = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
        p8 = (p * 448.0).to(torch.float8_e4m3fn).double()
        acc = torch.zeros(p.shape[:-1] + (codes.shape[-1],), dtype=torch.float64)
        for start in range(0, p.shape[-1], keys):
            products = p8[..., start:start + keys, None] * codes[:, None, start:start + keys, :]  # [H, Nq, keys, D]
            largest = torch.maximum(acc.abs(), products.abs().amax(dim=-2))
            quantum = 2.0 ** (torch.floor(torch.log2(largest.clamp(min=1e-300))) - bits + 1)
            acc = torch.trunc(acc / quantum) * quantum + (torch.trunc(products / quantum[..., None, :])
                                                          * quantum[..., None, :]).sum(dim=-2)
        out = acc * scale_v.double()[:, None, None] / (p.sum(dim=-1, keepdim=True) * 448.0)
        return out.transpose(0, 1).contiguous().to(o_dtype)
    return call
