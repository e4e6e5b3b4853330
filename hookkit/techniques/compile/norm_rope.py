"""The RMSNorm and rotary embedding of queries and keys in one pass, for compiled regions (CUDA).

Flux, Qwen-Image and many other DiTs normalize every head of the query and the key (RMSNorm over the head dimension,
with a weight), then rotate each pair of its elements (rotary embedding), some concatenating the text and the image
streams in between. Inductor fuses this into kernels of its own, but slow ones: at Flux-dev 1024² on an H200 they took
4.5 ms of a step in the single blocks (119 µs per block for about 25 µs of memory traffic) and about 2.5 ms in the
double blocks, 9.3 ms of a Qwen-Image step (BENCHMARKS.md, a step profile): the reduction over the head and the
access to each element's rotary partner split it into several passes over the tensor.

`FusedNormRope` is an inductor post-grad graph pass (in the `options` of hookkit's own `torch.compile` calls, chained
after `RealComplexMul`, never set process-wide) that finds exactly that computation and replaces it with one
`hookkit::rms_norm_rope` call per query or key, which writes the attention's input in one pass. It knows the two
RMSNorm forms of diffusers' models (torch's `rms_norm`: `x * r * weight` in float32, rounded once; diffusers'
`RMSNorm` with a bf16 weight: `x * r` rounded, then times the weight), per head or over all heads of a token before
they are split (Wan's `rms_norm_across_heads`), and three rotary forms (diffusers' `apply_rotary_emb(use_real=True)`
on interleaved pairs, Flux's; a complex rotation as `RealComplexMul` writes it, Qwen-Image's; Wan's own, written into
an empty tensor, with float32 or bf16 tables), streams concatenated before the rotation (Flux's double blocks) or
after it (Qwen-Image's). Anything else is left to inductor. The op computes what the graph computes: its CPU
implementation is that arithmetic, and the CUDA kernel rounds where it rounds (the squares are summed in another
order).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hookkit.errors import HookError
from hookkit.techniques.compile.graph_pass import CountingPass, binary as _pair, fake_call, fake_value as _val, has_triton
from hookkit.techniques.compile.graph_pass import is_call as _is, last_dim as _last, orders as _orders

aten, prims = torch.ops.aten, torch.ops.prims
_CONVERT = prims.convert_element_type.default
#: device types whose graphs `FusedNormRope` rewrites by default: CUDA, where the Triton kernel runs (on the CPU the op
#: is eager arithmetic, slower than inductor's own code; tests widen this to check the rewrite there)
DEVICES: tuple[str, ...] = ("cuda",)
#: the widest head the kernel holds (a power of two; Flux, Qwen-Image: 128)
MAX_HEAD_DIM = 256
#: the most values of a token (heads rounded up to a power of two, times the head) that the pass gives the op for
#: a norm over all heads, as measured (BENCHMARKS.md): Wan 2.1 1.3B's 16 x 128 ran in 7.0 ms per step against
#: inductor's 7.5 (H200); Wan 2.1 14B's 64 x 128 (40 heads), in the chunked kernel 4 heads at a time, 569 µs a call
#: against inductor's 1,177 (H100; one program holding the whole token took 1.9x inductor's). Wider tokens are
#: unmeasured and stay with inductor
MAX_ACROSS_WIDTH = 8192
#: the most values of a token one program of the kernel holds; a wider token (a norm over all heads) runs the chunked
#: kernel, `CHUNK_WIDTH` values (a power-of-two number of heads) at a time, twice over the token: at Wan 14B 4 heads
#: of 128 took 569 µs, 8 heads 661 µs, 16 heads 1,155 µs (H100, 4 warps)
MAX_ONE_PROGRAM_WIDTH = 2048
CHUNK_WIDTH = 512


# --- the op ------------------------------------------------------------------------------------------------


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float, round_first: bool, across_heads: bool = False
          ) -> torch.Tensor:
    """RMSNorm over the last dimension as the graph computes it (torch's `rms_norm`, or diffusers' `RMSNorm` when
    `round_first`); over the last two (every head of a token, Wan's `rms_norm_across_heads`) when `across_heads`."""
    if across_heads:
        return _norm(x.flatten(-2), weight, eps, round_first).unflatten(-1, x.shape[-2:])
    xf = x.float()
    inverse = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if round_first:
        return (x * inverse).to(x.dtype) * weight
    return (xf * inverse * weight).to(x.dtype)


def _rotate(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Each pair (a, b) of y's last dimension rotated: (a cos - b sin, b cos' + a sin') in float32, rounded to y's dtype;
    with bf16 tables in bf16, every product and sum rounded (Wan's tables in a bf16 model). A table `[tokens, D]` holds
    each element's value (cos' and sin' of the odd element), `[tokens, D / 2]` one per pair."""
    a, b = (y if cos.dtype == torch.bfloat16 else y.float()).unflatten(-1, (-1, 2)).unbind(-1)
    if cos.shape[-1] == y.shape[-1]:
        (c0, c1), (s0, s1) = cos.unflatten(-1, (-1, 2)).unbind(-1), sin.unflatten(-1, (-1, 2)).unbind(-1)
    else:
        c0 = c1 = cos
        s0 = s1 = sin
    c0, c1, s0, s1 = (t[:, None, :] for t in (c0, c1, s0, s1))  # over the heads
    return torch.stack([a * c0 - b * s0, b * c1 + a * s1], dim=-1).flatten(-2).to(y.dtype)


def _reference(xs: list[torch.Tensor], weights: list[torch.Tensor], eps: list[float], cos: list[torch.Tensor],
               sin: list[torch.Tensor], round_first: bool, across_heads: bool = False) -> torch.Tensor:
    parts = [_rotate(_norm(x, w, e, round_first, across_heads), c, s)
             for x, w, e, c, s in zip(xs, weights, eps, cos, sin, strict=True)]
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0].contiguous()


def _check(xs: list[torch.Tensor], weights: list[torch.Tensor], eps: list[float], cos: list[torch.Tensor],
           sin: list[torch.Tensor], round_first: bool, across_heads: bool = False) -> None:
    name = "hookkit::rms_norm_rope"
    if not xs or not len(xs) == len(weights) == len(eps) == len(cos) == len(sin):
        raise HookError(f"{name}: expected one weight, eps, cos and sin per stream (at least one stream), got "
                        f"{len(xs)}, {len(weights)}, {len(eps)}, {len(cos)}, {len(sin)}. Pass equal-length lists.")
    first = xs[0]
    dim = first.shape[-1] if first.dim() == 4 else -1
    width = first.shape[-2] * dim if across_heads and first.dim() == 4 else dim
    tables = cos[0].dtype
    for k, (x, w, c, s) in enumerate(zip(xs, weights, cos, sin, strict=True)):
        ok = (x.dim() == 4 and dim % 2 == 0 and x.dtype == first.dtype and x.shape[0] == first.shape[0]
              and x.shape[2:] == first.shape[2:] and tuple(w.shape) == (width,)
              and (w.dtype == x.dtype if round_first else w.dtype in (x.dtype, torch.float32))
              and all(t.dim() == 2 and t.dtype == tables and t.dtype in (torch.float32, x.dtype)
                      and t.shape[0] == x.shape[1] and t.shape[1] in (dim, dim // 2) for t in (c, s))
              and c.shape == s.shape)
        if not ok:
            raise HookError(f"{name}: stream {k}: expected x [batch, tokens, heads, D] (D even, batch, heads and D as "
                            f"stream 0's), weight [{'heads * D' if across_heads else 'D'}] "
                            f"({'x' if round_first else 'x or float32'} dtype), cos and sin float32 or x's dtype (as "
                            f"stream 0's) [tokens, D or D / 2]; got x {tuple(x.shape)} {x.dtype}, weight {tuple(w.shape)} "
                            f"{w.dtype}, cos {tuple(c.shape)} {c.dtype}, sin {tuple(s.shape)} {s.dtype}. "
                            "Pass the query or key of one attention, split by stream.")


def _kernel_fits(xs: list[torch.Tensor]) -> bool:
    dim = xs[0].shape[-1]
    return xs[0].is_cuda and xs[0].dtype == torch.bfloat16 and dim <= MAX_HEAD_DIM and dim & (dim - 1) == 0 \
        and has_triton()


@torch.library.custom_op("hookkit::rms_norm_rope", mutates_args=())
def rms_norm_rope(xs: list[torch.Tensor], weights: list[torch.Tensor], eps: list[float], cos: list[torch.Tensor],
                  sin: list[torch.Tensor], round_first: bool, across_heads: bool = False) -> torch.Tensor:
    """The streams `xs` (`[B, tokens, H, D]` each) RMS-normalized per head (`weights`, `eps`; `round_first`: diffusers'
    `RMSNorm` rounding; `across_heads`: over every head of a token, weights `[H * D]`), each pair of elements rotated by
    the stream's `cos`/`sin` table (float32, or bf16 with bf16 arithmetic), concatenated over tokens:
    `[B, sum of tokens, H, D]`, contiguous. The CPU computes the eager arithmetic; CUDA runs one kernel per stream."""
    _check(xs, weights, eps, cos, sin, round_first, across_heads)
    if not _kernel_fits(xs):
        return _reference(xs, weights, eps, cos, sin, round_first, across_heads)
    from hookkit.techniques.compile import norm_rope_triton  # imports triton: CUDA only, on first use

    dim = xs[0].shape[-1]
    xs = [x if x.stride(3) == 1 and x.stride(2) == dim else x.contiguous() for x in xs]  # the kernel reads whole heads
    weights = [w.contiguous() for w in weights]
    out = xs[0].new_empty([xs[0].shape[0], sum(x.shape[1] for x in xs), xs[0].shape[2], dim])
    norm_rope_triton.launch(xs, weights, list(eps), list(cos), list(sin), round_first, out, across_heads,
                            chunk_heads=chunk_heads(xs[0].shape[2], dim) if across_heads else None)
    return out


def chunk_heads(heads: int, dim: int) -> int | None:
    """How many heads at a time the kernel normalizes a token of `heads` x `dim` over all heads: None (all at once,
    one program) up to `MAX_ONE_PROGRAM_WIDTH` values (heads rounded up to a power of two), else the power of two of
    `CHUNK_WIDTH` values (at least 1)."""
    if padded_width(heads, dim) <= MAX_ONE_PROGRAM_WIDTH:
        return None
    return 1 << max(0, (CHUNK_WIDTH // dim).bit_length() - 1)


def padded_width(heads: int, dim: int) -> int:
    """The values of a token one program of the kernel holds for a norm over all heads: heads rounded up to a power of
    two, times the head."""
    return (1 << (heads - 1).bit_length()) * dim


@rms_norm_rope.register_fake
def _(xs: list[torch.Tensor], weights: list[torch.Tensor], eps: list[float], cos: list[torch.Tensor],
      sin: list[torch.Tensor], round_first: bool, across_heads: bool = False) -> torch.Tensor:
    _check(xs, weights, eps, cos, sin, round_first, across_heads)
    first = xs[0]
    return first.new_empty([first.shape[0], sum(x.shape[1] for x in xs), first.shape[2], first.shape[3]])


# --- the graph pass ----------------------------------------------------------------------------------------


def _converts(node: Any, dtype: torch.dtype) -> Any:
    """x of `convert_element_type(x, dtype)`, else None."""
    return node.args[0] if _is(node, _CONVERT) and node.args[1] == dtype else None


def _inverse_rms(node: Any) -> tuple[torch.fx.Node, float] | None:
    """(xf, eps) of `rsqrt(mean(xf ** 2, [-1], keepdim=True) + eps)`."""
    if not _is(node, aten.rsqrt.default):
        return None
    shifted = node.args[0]
    if not (_is(shifted, aten.add.Tensor) or _is(shifted, aten.add.Scalar)) or len(shifted.args) != 2:
        return None
    mean, eps = shifted.args
    if not isinstance(eps, float) or eps <= 0 or not _is(mean, aten.mean.dim):
        return None
    keepdim = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
    square = mean.args[0]
    if not keepdim or not _is(square, aten.pow.Tensor_Scalar) or square.args[1] != 2:
        return None
    xf, dims = square.args[0], mean.args[1]
    val = _val(xf)
    if val is None or len(dims) != 1 or not _last(dims[0], val.dim()):
        return None
    return xf, eps


def rms_norm_source(y: Any, input_ok: Callable[[Any], bool] | None = None
                    ) -> tuple[torch.fx.Node, torch.fx.Node, float, bool] | None:
    """(x, weight, eps, round_first) when `y` is a bf16 RMSNorm of x over its head dimension with a weight: torch's
    `convert(xf * r * w, bf16)` (round_first False) or diffusers' `convert(x * r, bf16) * w` (True), where
    `xf = convert(x, f32)`, `r = rsqrt(mean(xf ** 2, [-1], True) + eps)`. `input_ok` judges x (default: a head the
    kernel holds, `[B, tokens, heads, D]`)."""
    input_ok = input_ok or _head_input
    inner = _converts(y, torch.bfloat16)
    for product, w in _orders(_pair(inner, aten.mul.Tensor)):  # torch: ((xf * r) * w) in float32
        for xf, r in _orders(_pair(product, aten.mul.Tensor)):
            found = _inverse_rms(r)
            x = _converts(xf, torch.float32)
            if found is not None and found[0] is xf and input_ok(x) and _weight(w, x, (torch.bfloat16, torch.float32)):
                return x, w, found[1], False
    for normed, w in _orders(_pair(y, aten.mul.Tensor)):  # diffusers: convert(x * r, bf16) * w, w bf16
        for x, r in _orders(_pair(_converts(normed, torch.bfloat16), aten.mul.Tensor)):
            found = _inverse_rms(r)
            if found is not None and _converts(found[0], torch.float32) is x and input_ok(x) \
                    and _weight(w, x, (torch.bfloat16,)):
                return x, w, found[1], True
    return None


def across_heads_source(y: Any) -> tuple[torch.fx.Node, torch.fx.Node, float, bool] | None:
    """(x, weight, eps, round_first) when `y` is `reshape(n, [B, tokens, heads, D])` of a bf16 RMSNorm `n` of x
    `[B, tokens, heads * D]` over all heads (Wan's `rms_norm_across_heads`), else None."""
    if not _is(y, aten.reshape.default) or not _head_input(y):
        return None
    shape = _val(y).shape
    if padded_width(shape[2], shape[3]) > MAX_ACROSS_WIDTH:  # slower than inductor's kernels there
        return None

    def whole_token(x: Any) -> bool:
        val = _val(x)
        return _static(val) and val.dtype == torch.bfloat16 and tuple(val.shape) == (*shape[:2], shape[2] * shape[3])

    return rms_norm_source(y.args[0], whole_token)


def _static(val: Any) -> bool:
    return isinstance(val, torch.Tensor) and all(isinstance(d, int) for d in val.shape)


def _head_input(x: Any) -> bool:
    """A bf16 `[B, tokens, heads, D]` tensor of static shape whose head the kernel holds."""
    val = _val(x)
    if not (_static(val) and val.dim() == 4 and val.dtype == torch.bfloat16):
        return False
    dim = val.shape[-1]
    return 2 <= dim <= MAX_HEAD_DIM and dim & (dim - 1) == 0


def _weight(w: Any, x: Any, dtypes: tuple[torch.dtype, ...]) -> bool:
    val = _val(w)
    return _static(val) and tuple(val.shape) == (_val(x).shape[-1],) and val.dtype in dtypes


def _table(node: Any, dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)) -> tuple[int, int] | None:
    """(tokens, width) when `node` is a rotation table (of `dtypes`) that broadcasts over the heads of a
    `[B, tokens, heads, ...]` tensor: `[1, tokens, 1, width]`, `[tokens, 1, width]`, else None."""
    val = _val(node)
    if not _static(val) or val.dtype not in dtypes or not 3 <= val.dim() <= 4:
        return None
    shape = [1] * (4 - val.dim()) + list(val.shape)
    return (shape[1], shape[3]) if shape[0] == 1 and shape[2] == 1 else None


def _fits(node: Any, y: torch.fx.Node, width: int, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> bool:
    """Whether `node` is a rotation table (float32, or of `dtypes`) of y's tokens and `width` values per token."""
    return _table(node, dtypes) == (_val(y).shape[1], width)


def _getitem(node: Any, source: Any, index: int) -> bool:
    return _is(node, operator.getitem) and node.args[0] is source and node.args[1] == index


def real_rope_source(out: Any) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node] | None:
    """(y, cos, sin) when `out` is diffusers' `apply_rotary_emb(y, (cos, sin), use_real=True, sequence_dim=1)` on
    interleaved pairs: `convert(convert(y, f32) * cos + convert(rotated, f32) * sin, y.dtype)`, where `rotated` is
    `stack([-odd, even], -1).flatten(3)` of `y.reshape(..., -1, 2).unbind(-1)`."""
    total = _converts(out, torch.bfloat16)
    for first, second in _orders(_pair(total, aten.add.Tensor)):
        for yf, cos in _orders(_pair(first, aten.mul.Tensor)):
            y = _converts(yf, torch.float32)
            if y is None or not _head_input(y) or not _fits(cos, y, _val(y).shape[3]):
                continue
            for rf, sin in _orders(_pair(second, aten.mul.Tensor)):
                if _fits(sin, y, _val(y).shape[3]) and _rotated(_converts(rf, torch.float32), y):
                    return y, cos, sin
    return None


def _rotated(node: Any, y: torch.fx.Node) -> bool:
    """Whether `node` is `reshape(cat([unsqueeze(-odd, -1), unsqueeze(even, -1)], -1), y.shape)` with
    `even, odd = unbind(reshape(y, [..., -1, 2]), -1)`."""
    if not _is(node, aten.reshape.default) or _val(node) is None or _val(node).shape != _val(y).shape:
        return False
    cat = node.args[0]
    if not _is(cat, aten.cat.default) or len(cat.args[0]) != 2 or not _last(cat.args[1] if len(cat.args) > 1 else 0, 5):
        return False
    parts = []
    for piece in cat.args[0]:
        if not _is(piece, aten.unsqueeze.default) or not _last(piece.args[1], 5):
            return False
        parts.append(piece.args[0])
    negated, even = parts
    if not _is(negated, aten.neg.default):
        return False
    return _unbound_pairs(even, negated.args[0]) is y


def _unbound_pairs(even: Any, odd: Any) -> Any:
    """y when `even, odd = unbind(reshape(y, [..., -1, 2]), -1)` (each pair's two elements), else None."""
    unbind = even.args[0] if _is(even, operator.getitem) else None
    if unbind is None or not _getitem(even, unbind, 0) or not _getitem(odd, unbind, 1):
        return None
    if not _is(unbind, aten.unbind.int) or not _last(unbind.args[1] if len(unbind.args) > 1 else 0, 5):
        return None
    pairs = unbind.args[0]
    return pairs.args[0] if _is(pairs, aten.reshape.default) and _val(pairs).shape[-1] == 2 else None


def complex_rope_source(out: Any) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node] | None:
    """(y, cos, sin) when `out` is a complex rotation of y's pairs as `RealComplexMul` writes it:
    `convert(reshape(where(iota(2) == 0, (a c - b d)[..., None], (a d + b c)[..., None]), y.shape), y.dtype)` with
    `a, b` the pairs of `reshape(convert(y, f32), [..., -1, 2])` and `c, d` of a float view of the complex factor; cos
    and sin are `c` and `d` (one value per pair)."""
    shaped = _converts(out, torch.bfloat16)
    if not _is(shaped, aten.reshape.default):
        return None
    where = shaped.args[0]
    if not _is(where, aten.where.self) or not _is(where.args[0], aten.eq.Scalar) or where.args[0].args[1] != 0:
        return None
    if not all(_is(t, aten.unsqueeze.default) and t.args[1] == -1 for t in where.args[1:]):
        return None
    real, imag = where.args[1].args[0], where.args[2].args[0]
    difference = _pair(real, aten.sub.Tensor)
    if difference is None:
        return None
    for a, c in _orders(_pair(difference[0], aten.mul.Tensor)):
        for b, d in _orders(_pair(difference[1], aten.mul.Tensor)):
            y = _pairs_of(a, b)
            if y is None or _val(shaped).shape != _val(y).shape or not _sum_of(imag, {a, d}, {b, c}):
                continue
            if _select(c, 0) is None or _select(c, 0) is not _select(d, 1):
                continue
            if not (_fits(c, y, _val(y).shape[3] // 2) and _fits(d, y, _val(y).shape[3] // 2)):
                continue
            return y, c, d
    return None


def _select(node: Any, index: int) -> Any:
    """t of `select(t, -1, index)`, else None."""
    if _is(node, aten.select.int) and node.args[1] == -1 and node.args[2] == index:
        return node.args[0]
    return None


def _pairs_of(a: Any, b: Any) -> torch.fx.Node | None:
    """y when a, b are the even and odd elements of `reshape(convert(y, f32), [..., -1, 2])`, else None."""
    pairs = _select(a, 0)
    if pairs is None or _select(b, 1) is not pairs or not _is(pairs, aten.reshape.default):
        return None
    y = _converts(pairs.args[0], torch.float32)
    return y if _head_input(y) and _val(pairs).shape[-1] == 2 else None


def _sum_of(node: Any, first: set[Any], second: set[Any]) -> bool:
    """Whether `node` is `add(mul(*first), mul(*second))` in any operand order."""
    for p, q in _orders(_pair(node, aten.add.Tensor)):
        fp, fq = _pair(p, aten.mul.Tensor), _pair(q, aten.mul.Tensor)
        if fp is not None and fq is not None and set(fp) == first and set(fq) == second:
            return True
    return False


def _strided_half(node: Any, target: Any, start: int) -> Any:
    """t of `slice(t, -1, start, end, 2)` or `slice_scatter(t, src, -1, start, end, 2)` (every second element of t's
    last dimension from `start`), else None."""
    skip = 1 if target == aten.slice_scatter.default else 0
    if not _is(node, target) or len(node.args) != 5 + skip or node.kwargs:
        return None
    t, (dim, first, end, step) = node.args[0], node.args[1 + skip:]
    val = _val(t)
    if val is None or not _last(dim, val.dim()) or first != start or step != 2 or not isinstance(end, int) \
            or end < val.shape[-1]:
        return None
    return t


def _scattered(node: Any, start: int) -> tuple[Any, Any] | None:
    """(base, value) when `node` is `slice_scatter(base, copy(slice(base, -1, start, end, 2), value), -1, start, end,
    2)`: `base[..., start::2] = value`, as functionalization writes it."""
    if not _is(node, aten.slice_scatter.default) or len(node.args) != 6:
        return None
    base, copied = node.args[0], node.args[1]
    if _strided_half(node, aten.slice_scatter.default, start) is not base or not _is(copied, aten.copy.default):
        return None
    if _strided_half(copied.args[0], aten.slice.Tensor, start) is not base:
        return None
    return base, copied.args[1]


def wan_rope_source(out: Any) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node] | None:
    """(y, cos, sin) when `out` is Wan's rotary embedding of y: `out = empty_like(y); out[..., 0::2] = a * c - b * s;
    out[..., 1::2] = a * s + b * c` with `a, b = unbind(reshape(y, [..., -1, 2]), -1)`, `c = cos[..., 0::2]`, `s =
    sin[..., 1::2]`; cos and sin are those halves (one value per pair; float32 tables, or bf16 ones in a bf16 model)."""
    odd = _scattered(out, 1)
    even = _scattered(odd[0], 0) if odd is not None else None
    if even is None or not _is(even[0], aten.empty.memory_format):
        return None
    difference = _pair(even[1], aten.sub.Tensor)
    if difference is None:
        return None
    for a, c in _orders(_pair(difference[0], aten.mul.Tensor)):
        for b, s in _orders(_pair(difference[1], aten.mul.Tensor)):
            y = _unbound_pairs(a, b)
            if not _head_input(y) or tuple(_val(even[0]).shape) != tuple(_val(y).shape):
                continue
            half = _val(y).shape[3] // 2
            if _strided_half(c, aten.slice.Tensor, 0) is None or _strided_half(s, aten.slice.Tensor, 1) is None:
                continue
            both = (torch.float32, torch.bfloat16)
            if not (_fits(c, y, half, both) and _fits(s, y, half, both) and _val(c).dtype == _val(s).dtype):
                continue
            if _sum_of(odd[1], {a, s}, {b, c}):
                return y, c, s
    return None


#: one stream of an op call: (x, weight, eps, round_first, heads): `heads` is None for a norm per head of x
#: `[B, tokens, heads, D]`, or that shape for a norm over all heads of x `[B, tokens, heads * D]`
Stream = tuple[torch.fx.Node, torch.fx.Node, float, bool, list[int] | None]


def _streams(y: torch.fx.Node) -> list[Stream] | None:
    """The RMSNorms `y` concatenates over tokens (one when y is itself an RMSNorm), else None."""
    if _is(y, aten.cat.default) and len(y.args) > 1 and y.args[1] == 1:
        found = [rms_norm_source(part) for part in y.args[0]]
        return [(*f, None) for f in found] if found and all(f is not None for f in found) else None
    found = rms_norm_source(y)
    if found is None:
        across = across_heads_source(y)
        return [(*across, list(_val(y).shape))] if across is not None else None
    return [(*found, None)]


class FusedNormRope(CountingPass):
    """Inductor post-grad pass: the query's or key's RMSNorm (per head or over all heads) and rotary embedding become one
    `hookkit::rms_norm_rope` call (`rewritten` counts those calls, all graphs together).

    Args:
        devices: device types whose graphs are rewritten (default `DEVICES`: CUDA, where the Triton kernel runs).
        then: a post-grad pre-pass that was already configured, run after this one (hookkit's compile options replace
            the process-wide `post_grad_custom_pre_pass` for its own compiles, so it is chained, not dropped).
    """

    source = Path(__file__).read_bytes()

    def __init__(self, devices: tuple[str, ...] | None = None, then: Any = None) -> None:
        super().__init__(then)
        self.devices = DEVICES if devices is None else devices

    def settings(self) -> tuple[Any, ...]:
        return (self.devices, MAX_ACROSS_WIDTH)

    def rewrite(self, graph: torch.fx.Graph) -> int:
        ropes: dict[torch.fx.Node, tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node]] = {}
        for node in graph.nodes:
            match = real_rope_source(node) or complex_rope_source(node) or wan_rope_source(node)
            if match is not None and _val(match[0]).device.type in self.devices:
                ropes[node] = match
        found = 0
        for node in list(graph.nodes):  # streams rotated, then concatenated (Qwen-Image): one call for the cat
            if not (_is(node, aten.cat.default) and len(node.args) > 1 and node.args[1] == 1):
                continue
            parts = node.args[0]
            if len(parts) < 2 or not all(p in ropes for p in parts):
                continue
            streams = [_streams(ropes[p][0]) for p in parts]
            if not all(s is not None and len(s) == 1 for s in streams):
                continue
            tables = [(ropes[p][1], ropes[p][2]) for p in parts]
            if self._replace(graph, node, [s[0] for s in streams], tables):
                found += 1
                for p in parts:
                    ropes.pop(p)
        for node, (y, cos, sin) in ropes.items():  # one stream, or streams concatenated before the rotation (Flux)
            streams = _streams(y)
            if streams is None:
                continue
            start, tables = 0, []
            for x, *_ in streams:
                tokens = _val(x).shape[1]
                tables.append(((cos, start, tokens), (sin, start, tokens)) if len(streams) > 1 else (cos, sin))
                start += tokens
            if self._replace(graph, node, streams, tables):
                found += 1
        return found

    @staticmethod
    def _replace(graph: torch.fx.Graph, node: torch.fx.Node, streams: list[Stream],
                 tables: list[tuple[Any, Any]]) -> bool:
        """`hookkit::rms_norm_rope` of `streams` takes `node`'s place; a table given as (node, start, tokens) is that
        slice of a table over every stream's tokens. False (graph unchanged) when the streams round or normalize
        differently, or their tables differ in dtype."""
        from torch._guards import detect_fake_mode

        flat_tables = [t[0] if isinstance(t, tuple) else t for pair in tables for t in pair]
        if len({s[3] for s in streams}) != 1 or len({s[4] is None for s in streams}) != 1 \
                or len({_val(t).dtype for t in flat_tables}) != 1:
            return False
        fake = detect_fake_mode([_val(s[0]) for s in streams])
        call = functools.partial(fake_call, graph, fake)  # a new node with its fake value
        with graph.inserting_before(node):
            xs = [x if heads is None else call(aten.reshape.default, x, heads) for x, _, _, _, heads in streams]
            cos, sin = [], []
            for (x, *_), pair in zip(streams, tables, strict=True):
                for table, into in zip(pair, (cos, sin), strict=True):
                    source, start, tokens = table if isinstance(table, tuple) else (table, 0, None)
                    flat = call(aten.reshape.default, source, list(_table(source)))
                    into.append(flat if tokens is None else call(aten.slice.Tensor, flat, 0, start, start + tokens))
            fused = call(torch.ops.hookkit.rms_norm_rope.default, xs, [s[1] for s in streams],
                         [s[2] for s in streams], cos, sin, streams[0][3], streams[0][4] is not None)
        node.replace_all_uses_with(fused)
        return True
