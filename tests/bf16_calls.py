"""The tiny Flux called in bf16 on the GPU: shared by the GPU tests of the attention kernels (hookkit's and
FlashInfer's), which compare a pipeline with a kernel against the same pipeline without."""

from __future__ import annotations

from typing import Any

import torch

from hookkit.tools import zoo


def call_flux_bf16(pipe: Any, steps: int = 4) -> torch.Tensor:
    """`pipe`'s images for the tiny Flux's call arguments, floating-point tensors moved to the GPU in bf16."""
    kwargs = {k: v.to("cuda", torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v
              for k, v in zoo.call_kwargs("flux", steps=steps).items()}
    return pipe(**kwargs).images
