"""FlashInfer's Hopper attention kernels: FA3's warp-specialised kernel from the `flashinfer-python` package, which
compiles it for sm_90a with nvcc on first use and caches it on disk. Two of hookkit's kernel names run it:

- "flashinfer": bf16/fp16 inputs as they come: full precision, a candidate for `Attention.kernel`;
- "flashinfer_fp8": both products on fp8 tensor cores, after hookkit's quantization (below).

Why: on Hopper, cuDNN's bf16 and hookkit's Triton fp8 kernel idle the tensor cores while a warpgroup does its
exponentials; FA3's ping-pong schedule overlaps them (Triton cannot express it). FlashInfer ships it, fp8 included.

The fp8 quantization (torch ops where the mode answers SDPA, so that regional `Compile` fuses them into the block;
outside torch.compile on a GPU, `e4m3_triton`'s kernels, the same bits): Q, K and V in e4m3, one scale per (batch,
head), amax / 448; K and V first smoothed (each one's mean over the tokens subtracted per channel in float32, V's
added back to the output: no output changes; the e4m3 ranges keep what varies between tokens, and V's smoothing keeps
Hopper's fp8 accumulation precise, `value_mean`). FlashInfer quantizes P (times 448) and dequantizes by the scales.

Layout: diffusers hands SDPA `[B, H, N, D]` tensors; FlashInfer's single-sequence call takes `[N, H, D]` views with any
strides (it reads them), one call per batch element, and writes `[N, H, D]`: the output is returned as the
`[B, H, N, D]` view of a `[B, N, H, D]` tensor, the layout diffusers' processors transpose back to anyway. Heads of a
size FlashInfer has no kernel for (32, 72, 96, ...; up to 256) are zero-padded to the next it has: zeros change no
score, no per-head scale or key mean, and the padded output channels are cut off.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
import torch.nn.functional as F

from hookkit.errors import UnsupportedError

#: the largest finite e4m3 value
E4M3_MAX = 448.0
#: head sizes FlashInfer's Hopper kernels are instantiated for
HEAD_SIZES = (64, 128, 256)
#: the oldest FlashInfer release whose `single_prefill_with_kv_cache` takes fp8 inputs with per-head scales on the FA3
#: backend and an output dtype
MIN_VERSION = (0, 2, 14)


def padded_size(dim: int) -> int | None:
    """The head size FlashInfer's kernel runs heads of `dim` at: the smallest of `HEAD_SIZES` at least `dim` (their
    zero-padded size), or None above the largest."""
    return next((size for size in HEAD_SIZES if size >= dim), None)


def softmax_scale(query: torch.Tensor, scale: float | None) -> float:
    """SDPA's softmax scale: `scale`, or 1 / sqrt(head size) where it is None (FlashInfer's kernels take it given)."""
    return float(query.shape[-1] ** -0.5 if scale is None else scale)


#: the smallest amax a scale is computed from: a head of zeros gets a finite scale whose inverse is finite too
AMAX_FLOOR = 2.0 ** -100


def scale_of(amax: torch.Tensor) -> torch.Tensor:
    """The float32 e4m3 scales of heads whose largest magnitudes are `amax`: amax / 448 (amax at least `AMAX_FLOOR`,
    so that a head of zeros quantizes to zeros)."""
    return amax.float().clamp(min=AMAX_FLOOR) / E4M3_MAX


def head_scales(t: torch.Tensor) -> torch.Tensor:
    """The e4m3 scale of each (batch, head) of a `[B, H, N, D]` tensor, float32 `[B, H]` (`scale_of` its amax)."""
    return scale_of(torch.maximum(t.amax(dim=(2, 3)), -t.amin(dim=(2, 3))))


def to_e4m3(t: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`t` times its (batch, head)'s float32 inverse scale (`head_scales`) in e4m3, clamped to e4m3's range (rounding
    in float32 can land just past 448)."""
    inverse = (1.0 / scales)[:, :, None, None]
    return (t.float() * inverse).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def value_mean(value: torch.Tensor) -> torch.Tensor:
    """V's mean over the tokens per (batch, head, channel), float32 `[B, H, 1, D]`: what `quantize` takes out of V and
    `attention` adds back to the output (every row of attention weights sums to 1, so the mean passes through).

    Why beyond V's range: Hopper's fp8 tensor cores add each product to a sum aligned to the larger of the two with
    about 14 bits (DeepSeek-V3's report), so where V's channels carry an offset every key shares, P·V grows into a sum
    whose low bits each further block of keys loses. On `check`'s head shaped like real activations FlashInfer's kernel
    erred 14.5x its arithmetic without smoothing and 1.09x with it (an H100, 8,192 keys; a CPU model of that
    accumulation, `tests/flashinfer_stand_in.py`, gives 21x and 1.15x)."""
    return value.mean(dim=2, keepdim=True, dtype=torch.float32)


def quantize_torch(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   mean_of_value: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """`quantize` in torch ops: what torch.compile traces and fuses, and what the CPU runs."""
    key = key.float() - key.mean(dim=2, keepdim=True, dtype=torch.float32)
    if mean_of_value is not None:
        value = value.float() - mean_of_value
    scales = [head_scales(t) for t in (query, key, value)]
    return (*(to_e4m3(t, s) for t, s in zip((query, key, value), scales, strict=True)), *scales)


def quantize(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             mean_of_value: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """`[B, H, N, D]` Q, K, V as e4m3 tensors of the same shape and their float32 `[B, H]` scales:
    `(q8, k8, v8, q_scale, k_scale, v_scale)`; K smoothed first, in float32 (module docstring), and V less
    `mean_of_value` (`value_mean`) where given. On a CUDA device outside torch.compile, by two Triton kernels a
    tensor (`e4m3_triton`), the torch ops' result bit for bit."""
    if query.is_cuda and not torch.compiler.is_compiling():
        from hookkit.techniques.attention import e4m3_triton

        return e4m3_triton.quantize(query, key, value, scale_of, mean_of_value)
    return quantize_torch(query, key, value, mean_of_value)


def _per_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scales: tuple[torch.Tensor, ...] | None,
                  sm_scale: float, causal: bool, out_dtype: torch.dtype) -> torch.Tensor:
    import flashinfer

    # the kernel's TMA loads need unit stride along the head dimension (the other strides it reads as they are)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    outs = []
    for b in range(q.shape[0]):
        fp8 = {} if scales is None else {"scale_q": scales[0][b], "scale_k": scales[1][b], "scale_v": scales[2][b]}
        outs.append(flashinfer.single_prefill_with_kv_cache(
            q[b].transpose(0, 1), k[b].transpose(0, 1), v[b].transpose(0, 1), o_dtype=out_dtype, causal=causal,
            sm_scale=sm_scale, kv_layout="NHD", backend="fa3", **fp8))
    out = outs[0].unsqueeze(0) if len(outs) == 1 else torch.stack(outs)
    return out.transpose(1, 2)


def run_fp8(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, q_scale: torch.Tensor, k_scale: torch.Tensor,
            v_scale: torch.Tensor, sm_scale: float, causal: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """FlashInfer's fp8 kernel on quantized `[B, H, N, D]` inputs (`quantize`): one single-sequence call per batch
    element; the `[B, H, N, D]` output in `out_dtype`, a view of a `[B, N, H, D]` tensor."""
    return _per_sequence(q8, k8, v8, (q_scale, k_scale, v_scale), sm_scale, causal, out_dtype)


def run_half(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sm_scale: float,
             causal: bool) -> torch.Tensor:
    """FlashInfer's bf16/fp16 kernel on `[B, H, N, D]` inputs as they are; the output as `run_fp8`'s, in their dtype."""
    return _per_sequence(query, key, value, None, sm_scale, causal, query.dtype)


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None = None,
              causal: bool = False, fp8: bool = True,
              kernels: tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]] = (run_half, run_fp8),
              smooth_value: bool = True) -> torch.Tensor:
    """SDPA's result for `[B, H, N, D]` fp16/bf16 inputs, by FlashInfer's fp8 kernel (quantization included) or, with
    `fp8=False`, its bf16/fp16 kernel; heads FlashInfer has no kernel for zero-padded (`padded_size`).

    Args:
        kernels: what runs the bf16 and the fp8 kernel (`run_half`, `run_fp8`: hookkit's hooks pass the same as ops
            torch.compile keeps opaque, so that the padding and the quantization are traced around them).
        smooth_value: for the fp8 kernel, take V's mean over the tokens out before quantizing and add it to the
            output (module docstring); False runs V as it comes (for measurements of what smoothing changes).
    """
    dim = query.shape[-1]
    sm_scale = softmax_scale(query, scale)  # of the heads as they are: padding changes no score
    size = padded_size(dim)
    if size is None:
        raise UnsupportedError(f"FlashInfer's kernels: expected heads of size up to {HEAD_SIZES[-1]}, got {dim}. "
                               "Choose another kernel (hookkit.Attention checks this at enable).")
    if size != dim:
        query, key, value = (F.pad(t, (0, size - dim)) for t in (query, key, value))
    half, low = kernels
    if not fp8:
        out = half(query, key, value, sm_scale, causal)
    else:
        mean = value_mean(value) if smooth_value else None
        out = low(*quantize(query, key, value, mean), sm_scale, causal, query.dtype)
        if mean is not None:
            out = out.add_(mean)  # in float32, one rounding to out's dtype, in place: the kernel's [B, N, H, D] layout
    return out if size == dim else out[..., :dim]


def reference(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, q_scale: torch.Tensor, k_scale: torch.Tensor,
              v_scale: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """What FlashInfer's fp8 kernel computes from `quantize`'s output (its `StandardFP8Attention`, read in the
    package's source), in float32 torch ops: scores from the e4m3 codes times the Q and K scales; P = exp(score - row
    max) times 448, rounded to e4m3 for P·V; the row sums from P before rounding; the output times the V scale / 448.

    Exact for keys that fit one tile of the kernel (128 keys for heads of 64 and 256, 192 for 128): over more, the
    kernel rounds P against a running maximum, a different rounding of the same size (about 2.5 % apart at 8,192
    Gaussian keys). On an H100 the kernel departs from it on short sequences (`FP8_MIN_KEYS`); `check` compares their
    errors against float32 attention at the shortest length hookkit runs the kernel on."""
    qs, ks, vs = (s[:, :, None, None] for s in (q_scale, k_scale, v_scale))
    scores = (q8.float() * qs) @ (k8.float() * ks).transpose(-1, -2) * sm_scale
    p = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    p8 = (p * E4M3_MAX).to(torch.float8_e4m3fn).float()
    return p8 @ (v8.float() * vs) / (p.sum(dim=-1, keepdim=True) * E4M3_MAX)


def reference_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        scale: float | None = None, smooth_value: bool = True) -> torch.Tensor:
    """What `attention(...)` with the fp8 kernel computes, in float32 torch ops: the same zero-padding and quantization
    (`quantize_torch`, V smoothed as `smooth_value` says), then `reference`, V's mean added back; float32
    `[B, H, N, D]`."""
    dim = query.shape[-1]
    size = padded_size(dim) or dim
    sm_scale = softmax_scale(query, scale)  # of the heads as they are: padding changes no score
    query, key, value = (F.pad(t, (0, size - dim)) for t in (query, key, value))
    mean = value_mean(value) if smooth_value else None
    out = reference(*quantize_torch(query, key, value, mean), sm_scale)
    return (out if mean is None else out + mean)[..., :dim]


#: the fewest keys hookkit runs FlashInfer's fp8 kernel on. Measured against its own arithmetic (`reference`) on an
#: H100 (BENCHMARKS.md, "FlashInfer's fp8 kernel against its own arithmetic"): on Gaussian heads of 128 its error
#: against float32 attention is 44 % at 68 keys, 21 % at 120 and 6.9 % at 1,024, where its arithmetic gives about 5 %;
#: from 8,192 keys (and at Wan's 32,760) it is its arithmetic's. Shorter calls run as "native".
FP8_MIN_KEYS = 8192
#: tokens of `check`'s inputs, by `fp8`. The fp8 kernel is checked at the shortest length it is taken at (where it
#: departs most), not a multiple of its 192-key tile for heads of 128 (the last tile's masking runs); the bf16 kernel
#: at 120 tokens (not a multiple of 16)
CHECK_TOKENS = {True: FP8_MIN_KEYS, False: 120}
#: what `check` accepts on each head, by `fp8`. For the fp8 kernel: its mean relative error against float32 attention
#: at most 1.5x its own arithmetic's (`reference`) on the same inputs. Not its distance from `reference`: over more keys
#: than a tile the kernel rounds P against a running maximum, a rounding as large as the mirror's but independent of
#: it, so a kernel computing the same arithmetic is 2.5 % from `reference` on Gaussian heads and 7.5 % on the check's
#: head of 3x range (one H100, 8,192 keys), while it errs against float32 attention as its arithmetic does (1.0-1.16x
#: at 8,192 keys and 1.0-1.3x at 1,024, BENCHMARKS.md). A kernel that departs on short sequences errs 4-10x its
#: arithmetic, one that misreads a scale 10^3 and more. For the bf16 kernel: a mean relative error of 2 % against
#: float32 attention (bf16 P and output).
CHECK_BOUND = {True: 1.5, False: 0.02}


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    """The mean absolute difference over the mean magnitude of `expected` (NaN where `out` has NaN)."""
    return ((out - expected).abs().mean() / expected.abs().mean()).item()


def error_ratio(out: torch.Tensor, mirror: torch.Tensor, exact: torch.Tensor) -> float:
    """`out`'s error against `exact` (float32 attention) over `mirror`'s, the kernel's arithmetic in PyTorch: how much
    more the kernel errs than its quantization implies (1.0: no more)."""
    return relative_error(out, exact) / relative_error(mirror, exact)


def check_inputs(head_dim: int, tokens: int, dtype: torch.dtype, device: torch.device,
                 offset_in: str = "qkv") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`check`'s seeded `[1, 4, tokens, head_dim]` Q, K and V (its docstring says what the 4 heads are).

    Args:
        offset_in: which of "q", "k", "v" carry the channel offsets of heads 2 and 3 (all three in `check`); the
            others keep the same draws without them, so that a benchmark can tell which offset a kernel errs on.
    """
    g = torch.Generator(device=device).manual_seed(0)
    ranges = torch.tensor([1.0, 3.0, 1.0, 3.0], device=device)[None, :, None, None]
    offsets = torch.tensor([0.0, 0.0, 2.0, 2.0], device=device)[None, :, None, None]
    tensors = []
    for name in "qkv":
        t = torch.randn(1, 4, tokens, head_dim, generator=g, device=device)
        channel = torch.randn(head_dim, generator=g, device=device)
        tensors.append(((t + offsets * channel if name in offset_in else t) * ranges).to(dtype))
    q, k, v = tensors
    return q, k, v


def check(head_dim: int, dtype: torch.dtype, device: torch.device, fp8: bool,
          kernels: tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]] = (run_half, run_fp8)) -> float:
    """Run a kernel once, as hookkit runs it on heads of `head_dim` (zero-padded where FlashInfer has no kernel of that
    size), on seeded random inputs (`CHECK_TOKENS[fp8]` tokens, 4 heads: two Gaussian, two shaped like real
    activations, with channel offsets twice their spread, the second of each pair 3x the first, so that a kernel
    applying one head's scales to another is off), and return the worst head's error against float32 SDPA of the same
    inputs: for the fp8 kernel as a multiple of its own arithmetic's error there (`reference`: 1.0 errs as the
    quantization implies), for the bf16 kernel as a mean relative error. Heads are compared one at a time, so the
    check holds one head's scores at a time.

    Why at `enable`: FlashInfer builds (nvcc) and caches its module at its first call, so a missing compiler or a
    failed build is a refusal there, not an error in the first denoising step; and a kernel that computes something
    else (a FlashInfer release whose scale semantics differ, a module built for another torch, a kernel that errs on
    some head size or length) is refused, not run.

    Args:
        kernels: what runs the bf16 and the fp8 kernel, passed on to `attention` (FA3's own fp8 kernel,
            `fa3_hopper.run_fp8`, is checked as FlashInfer's port of it is).
    """
    q, k, v = check_inputs(head_dim, CHECK_TOKENS[fp8], dtype, device)
    out = attention(q, k, v, fp8=fp8, kernels=kernels).float()
    errors = []
    for h in range(q.shape[1]):
        qh, kh, vh = (t[:, h:h + 1] for t in (q, k, v))
        exact = F.scaled_dot_product_attention(qh.float(), kh.float(), vh.float())
        head = out[:, h:h + 1]
        errors.append(error_ratio(head, reference_attention(qh, kh, vh), exact) if fp8 else relative_error(head, exact))
    return max(errors, key=lambda e: e if e == e else float("inf"))  # a NaN head is the largest


def version_ok(version: str) -> bool:
    """Whether a FlashInfer version string ("0.2.14.post1", "0.7.4") is `MIN_VERSION` or newer."""
    parts: list[int] = []
    for part in version.split(".")[:3]:
        digits = re.match(r"\d+", part)
        if digits is None:
            break
        parts.append(int(digits.group()))
    return tuple(parts) >= MIN_VERSION
