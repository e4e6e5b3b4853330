"""A stand-in `flash_attn_interface` module (FlashAttention-3's Hopper interface) for the CPU tests: what FA3's e4m3
kernel computes, on `[B, N, H, D]` inputs with float32 `[B, H]` descales (each head's Q, K and V times its descale; P
times 448 rounded to e4m3 for P·V, the row sums before rounding, as `flashinfer_fa3.reference`), each call recorded.
Put it in `sys.modules["flash_attn_interface"]` (the `stand_in` fixture of `test_attention_fa3.py` does)."""

from __future__ import annotations

import importlib.machinery
import types
from typing import Any

import torch

from flashinfer_stand_in import fa3_semantics


class StandIn(types.ModuleType):
    """A `flash_attn_interface` module for the CPU: FA3's fp8 semantics, each call recorded.

    Args:
        returns_lse: return `(out, softmax_lse)`, as some FA3 versions do, instead of `out`.
    """

    def __init__(self, returns_lse: bool = False) -> None:
        super().__init__("flash_attn_interface")
        self.__spec__ = importlib.machinery.ModuleSpec("flash_attn_interface", None)
        self.returns_lse = returns_lse
        self.calls: list[dict[str, Any]] = []

    def flash_attn_func(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = None,
                        causal: bool = False, q_descale: torch.Tensor | None = None,
                        k_descale: torch.Tensor | None = None, v_descale: torch.Tensor | None = None,
                        **kwargs: Any) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        descales = (q_descale, k_descale, v_descale)
        self.calls.append({"shapes": (tuple(q.shape), tuple(k.shape), tuple(v.shape)), "dtype": q.dtype,
                           "descales": None if q_descale is None else tuple(tuple(s.shape) for s in descales),
                           "descale_dtypes": None if q_descale is None else tuple(s.dtype for s in descales),
                           "last_strides": (q.stride(-1), k.stride(-1), v.stride(-1)),
                           "softmax_scale": softmax_scale, "causal": causal})
        batch, _, heads, dim = q.shape
        ones = torch.ones(batch, heads)
        qf, kf, vf = (t.float().transpose(1, 2) * (ones if s is None else s.float())[:, :, None, None]
                      for t, s in zip((q, k, v), descales))  # [B, H, N, D]
        scale = dim ** -0.5 if softmax_scale is None else softmax_scale
        out = fa3_semantics(qf, kf, vf, scale, causal, fp8=q_descale is not None)
        out = out.transpose(1, 2).contiguous().to(torch.bfloat16)  # [B, N, H, D]
        if not self.returns_lse:
            return out
        scores = qf @ kf.transpose(-1, -2) * scale
        return out, torch.logsumexp(scores, dim=-1)
