"""The tiny Flux called in bf16 on the GPU, and the error measure of a compiled bf16 pipeline against its eager twin:
shared by the GPU tests of the attention kernels (hookkit's and FlashInfer's), which compare a pipeline with a kernel
against the same pipeline without, and a compiled pipeline against an eager one."""

from __future__ import annotations

from typing import Any

import torch

from hookkit.tools import zoo


def call_flux_bf16(pipe: Any, steps: int = 4, size: int | None = None) -> torch.Tensor:
    """`pipe`'s images for the tiny Flux's call arguments, floating-point tensors moved to the GPU in bf16; `size`:
    the images' height and width (the tiny Flux has size² / 16 image tokens; its default 32 gives 64)."""
    extra = {} if size is None else {"height": size, "width": size}
    kwargs = {k: v.to("cuda", torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v
              for k, v in zoo.call_kwargs("flux", steps=steps, **extra).items()}
    return pipe(**kwargs).images


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Mean absolute difference over mean magnitude, in float32. Compiled and eager bf16 pipelines differ by rounding
    (inductor fuses the norm, RoPE and casts): about 0.2 % of the tiny Flux's 4-step output on average, yet a few
    elements of magnitude 4 differ by two bf16 steps (0.03), so an elementwise bound tests the output's range, not
    the kernel. A kernel reading the wrong strides or scales is off by tens of percent."""
    out, ref = out.float(), ref.float()
    return ((out - ref).abs().mean() / ref.abs().mean()).item()
