"""The `Attention` spec: which attention kernel each transformer block runs at each denoising step."""

from __future__ import annotations

from typing import Any

import attrs

from hookkit.core.validate import choice, int_field, owner, strict_init, to_tuple
from hookkit.errors import field_error

#: the full-precision kernels hookkit can choose: diffusers' backend names (`diffusers.models.attention_dispatch`) and
#: "flashinfer" (FlashInfer's FA3 kernel, the `flashinfer-python` package)
FULL_KERNELS = ("native", "_native_cudnn", "_native_flash", "_native_efficient", "_native_math", "flash",
                "flashinfer")
#: the low-precision kernels: hookkit's Triton kernels (int8 Q·Kᵀ with fp16 P·V; int8 Q·Kᵀ with e4m3 P·V),
#: SageAttention's (the `sageattention` package), FlashInfer's FA3 fp8 kernel (the `flashinfer-python` package) and
#: FA3's own fp8 kernel (the `flash_attn_interface` module built from flash-attention's hopper/ folder)
LOW_KERNELS = ("hookkit_int8", "hookkit_fp8", "sage", "flashinfer_fp8", "fa3_fp8")
KERNELS = FULL_KERNELS + LOW_KERNELS


def _block_selectors(inst: Any, attr: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, tuple) or not all(
            (isinstance(v, str) and v) or (isinstance(v, int) and not isinstance(v, bool)) for v in value):
        raise field_error(owner(inst), attr.name, value,
                          "a list of block path patterns ('transformer_blocks.0', 'single_transformer_blocks.*') "
                          "or block indices in execution order (0, -1)")


@strict_init
@attrs.frozen(kw_only=True)
class Attention:
    """The attention kernel per block and per denoising step: full precision on the first and last steps (and on the
    blocks in `full_blocks`), `low_precision` in between.

    Why: low-precision attention (int8 Q·Kᵀ) is the largest single saving at video lengths (attention is most of
    a Wan 2.1 step at 32,760 tokens), and its error matters least in the middle of the schedule: the first steps lay
    out the composition, the last ones the fine detail (SageAttention's and the caching literature's observation),
    and a few blocks of a model may be more sensitive than the rest.

    Args:
        kernel: the full-precision kernel, by diffusers' backend name (default "native": torch's SDPA with its own
            choice): one of "native", "_native_cudnn", "_native_flash", "_native_efficient", "_native_math" (torch's
            SDPA restricted to that backend), "flash" (the `flash-attn` package) or "flashinfer" (FlashInfer's FA3
            kernel in bf16/fp16, Hopper only; the `flashinfer-python` package, which compiles it with nvcc at its
            first use: at `enable`).
        low_precision: the kernel of the steps and blocks in between (default "hookkit_int8": hookkit's Triton kernel,
            int8 Q·Kᵀ with per-block scales and K smoothing, P·V in fp16, any GPU from Ampere on); "hookkit_fp8"
            (hookkit's Hopper/Ada kernel: int8 Q·Kᵀ as above, P·V in e4m3 with V scaled per channel, fp8 tensor
            cores, compute capability 8.9 or newer; with more error); "sage" (the `sageattention` package's
            `sageattn`, K smoothed by hookkit, out of place); "flashinfer_fp8" (FlashInfer's FA3 kernel, Hopper only,
            heads of 128 only (on heads of 32 padded to 64 it gave 6-13x the error of its own arithmetic): Q, smoothed K
            and V in e4m3 with a scale per head, both products on fp8 tensor cores; the `flashinfer-python` package,
            which compiles the kernel with nvcc at its first use: at `enable`, where its output is checked); "fa3_fp8"
            (FlashAttention-3's own e4m3 kernel, of which "flashinfer_fp8" is a port, fed the same quantization;
            Hopper only, heads of 128 only; the `flash_attn_interface` module, which has no PyPI package: build
            flash-attention's hopper/ folder (`python setup.py install` there); its output is checked at `enable` as
            "flashinfer_fp8"'s); any full-precision name (to compare kernels); None runs `kernel` everywhere.
        full_first: how many of the first denoising steps run `kernel` in every block (default 2).
        full_last: how many of the last steps run `kernel` in every block (default 2; needs the number of steps: a
            pipeline call, or `handle.generation(num_steps=...)`; without it no step counts as one of the last).
        full_blocks: blocks that run `kernel` at every step (default none): module path patterns (fnmatch, e.g.
            "transformer_blocks.0", "single_transformer_blocks.*") or indices in the adapter's execution order
            (0 the first block, -1 the last).
    """

    kernel: str = attrs.field(default="native", validator=choice(*FULL_KERNELS))
    low_precision: str | None = attrs.field(default="hookkit_int8", validator=choice(None, *KERNELS))
    full_first: int = attrs.field(default=2, validator=int_field(0))
    full_last: int = attrs.field(default=2, validator=int_field(0))
    full_blocks: tuple[str | int, ...] = attrs.field(default=(), converter=to_tuple, validator=_block_selectors)

    def kernels(self) -> tuple[str, ...]:
        """Every kernel this spec may run, `kernel` first."""
        return (self.kernel,) if self.low_precision in (None, self.kernel) else (self.kernel, self.low_precision)
