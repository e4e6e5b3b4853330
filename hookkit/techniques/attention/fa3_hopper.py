"""FlashAttention-3's own Hopper e4m3 kernel, hookkit's "fa3_fp8": the `flash_attn_interface` module of
flash-attention's `hopper/` folder.

Why: FlashInfer's "flashinfer_fp8" is a port of this kernel (warp-specialised, ping-pong schedule, both products on
fp8 tensor cores); at Wan 2.1 14B's attention shape FA3's own build ran faster than the port on an H100, built with
ptxas 12.8 past 1.6x cuDNN's bf16 kernel (BENCHMARKS.md, "FlashAttention-3's own e4m3 kernel, one H100"). Users who
have FA3 built can choose it.

FA3 has no PyPI package: it must be built from source, for sm_90a (nvcc, minutes)::

    git clone https://github.com/Dao-AILab/flash-attention && cd flash-attention/hopper && python setup.py install

Quantization: hookkit feeds FA3 exactly the codes and per-head scales `flashinfer_fa3.quantize` makes (Q, K and V in
e4m3, one scale per (batch, head)), K smoothed and V's mean taken out before and added back after by
`flashinfer_fa3.attention`, so both Hopper fp8 kernels compute the same quantization and differ only in the kernel.
FA3 takes the scales as its descales (dequantization factors), which is what `quantize`'s scales are.

Layout: FA3 takes `[B, N, H, D]` tensors with any strides except along the head dimension (its TMA loads read the
strides; they need unit stride there) and writes `[B, N, H, D]` bf16, the whole batch in one call.
"""

from __future__ import annotations

import torch

#: the module FA3's `hopper/` folder installs (`import flash_attn_interface`)
MODULE = "flash_attn_interface"
#: how to build it, for refusals
BUILD = ("git clone https://github.com/Dao-AILab/flash-attention && cd flash-attention/hopper && "
         "python setup.py install")
#: the head sizes hookkit runs FA3's fp8 kernel at: the only size built and measured (benchmarks/fa3_site.py)
HEADS = (128,)


def run_fp8(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, q_scale: torch.Tensor, k_scale: torch.Tensor,
            v_scale: torch.Tensor, sm_scale: float, causal: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """FA3's e4m3 kernel on quantized `[B, H, N, D]` inputs (`flashinfer_fa3.quantize`) and their float32 `[B, H]`
    scales: one call for the whole batch; the `[B, H, N, D]` output in `out_dtype`, a view of a `[B, N, H, D]` tensor
    (as `flashinfer_fa3.run_fp8`'s). `flash_attn_interface` is imported at the first call."""
    import flash_attn_interface

    # [B, N, H, D] views: FA3 reads the strides, but its TMA loads need unit stride along the head dimension
    q, k, v = (t.transpose(1, 2) for t in (q8, k8, v8))
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = flash_attn_interface.flash_attn_func(q, k, v, softmax_scale=sm_scale, causal=causal,
                                               q_descale=q_scale.float().contiguous(),
                                               k_descale=k_scale.float().contiguous(),
                                               v_descale=v_scale.float().contiguous())
    out = out[0] if isinstance(out, tuple) else out  # some FA3 versions return (out, softmax_lse)
    return out.to(out_dtype).transpose(1, 2)
