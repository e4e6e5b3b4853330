"""One-pass fp8 per-row activation quantization for compiled regions of a `Quantize("fp8_row")` model.

torchao's dynamic per-row fp8 Linear quantizes its input X on every call: `s = (|X|.amax(-1) / 448)`, then
`X / s` clamped and cast to e4m3. Inside a compiled region inductor fuses X's producer into that quantization,
but as two passes over the row (a reduction for the amax, then a pointwise kernel that recomputes the producer,
divides and casts, or one kernel looping twice), well below the GPU's memory bandwidth. Where X is a GELU output
or a concatenation with one (Flux's single blocks quantize `cat(attention, gelu(mlp))`, 15,360 values per row;
every feed-forward quantizes `gelu(h)`), a kernel that holds the row in registers reads the inputs once, applies
the GELU, takes the amax and writes the fp8 row and its scale (BENCHMARKS.md has the kernel times and the step
profile with and without it).

`FusedFp8Rows` is an inductor post-grad graph pass (passed in the `options` of hookkit's own `torch.compile`
calls, never set process-wide) that finds exactly torchao's per-row quantization of such an X and replaces it
with one call of `torch.ops.hookkit.fp8_quantize_rows`; every other quantization is left to inductor. The op
computes what eager torchao computes (GELU rounded to the input dtype, the scale divided in the input dtype,
IEEE division, round-to-nearest-even e4m3): its CPU implementation *is* the eager arithmetic, and the CUDA
kernel follows it step by step (libdevice's tanh, as eager CUDA's `tanhf`). `fast=True` trades that for speed:
tanh from exp and approximate division, as inductor's own kernels compute (an fp8 code may move by one step).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from hookkit.errors import HookError
from hookkit.techniques.compile.graph_pass import CountingPass, binary as _pair, fake_call, fake_value as _val
from hookkit.techniques.compile.graph_pass import has_triton as _has_triton, is_call as _is, last_dim as _last_dim, orders

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448.0
#: the smallest row amax the scale is taken from: `quantize.torchao.ACTIVATION_AMAX_FLOOR`, which hookkit's fp8 configs
#: give torchao (an all-zero row then quantizes to zeros, not 0 / 0 = NaN). The pass also rewrites a quantization
#: without that bound (a torchao config of the user's); the kernels then give such a row zeros where eager gives NaN.
AMAX_FLOOR = 2.0 ** -14
#: the widest piece the kernel holds in registers (4 chunks of 4,096 columns); wider ones stay inductor's
MAX_WIDTH = 16384
#: pieces per row the kernel takes (Flux: attention + MLP)
MAX_PIECES = 2
#: the widest row the layer-norm kernel holds in registers (one power-of-two block; Flux and Qwen-Image: 3,072)
LAYER_NORM_MAX_WIDTH = 8192
#: device types whose graphs `FusedFp8Rows` rewrites by default: CUDA, where the Triton kernel runs (on the CPU the op
#: is eager arithmetic, slower than inductor's own C++ kernel; tests widen this to check the rewrite there)
DEVICES: tuple[str, ...] = ("cuda",)


# --- the op ------------------------------------------------------------------------------------------------


def floor_in(dtype: torch.dtype) -> float:
    """`AMAX_FLOOR` as eager's clamp of a `dtype` amax holds it (the same value in bf16, fp16 and fp32): the bound
    the Triton kernels take."""
    return float(torch.tensor(AMAX_FLOOR, dtype=dtype))


def _reference(pieces: Sequence[torch.Tensor], gelu: Sequence[bool]) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager torchao's arithmetic, op for op (`_choose_scale_float8` with `AMAX_FLOOR` as its lower bound +
    `_quantize_affine_float8`, per row)."""
    parts = [F.gelu(p, approximate="tanh") if g else p for p, g in zip(pieces, gelu, strict=True)]
    x = torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]
    scale = (x.abs().amax(dim=-1, keepdim=True).clamp(min=AMAX_FLOOR) / FP8_MAX).to(torch.float32)
    return (x.to(torch.float32) / scale).clamp(min=-FP8_MAX, max=FP8_MAX).to(FP8), scale


def _check_pieces(pieces: Sequence[torch.Tensor], gelu: Sequence[bool]) -> None:
    if not pieces or len(pieces) != len(gelu):
        raise HookError(f"hookkit::fp8_quantize_rows: expected as many gelu flags as pieces (at least one), got "
                        f"{len(pieces)} pieces and {len(gelu)} flags. Pass one flag per piece.")
    lead = pieces[0].shape[:-1]
    if any(p.shape[:-1] != lead or p.dtype != pieces[0].dtype for p in pieces):
        raise HookError("hookkit::fp8_quantize_rows: expected pieces with the same leading shape and dtype, got "
                        + ", ".join(f"{tuple(p.shape)} {p.dtype}" for p in pieces)
                        + ". Pass the pieces of one row-major concatenation.")


def _kernel_fits(pieces: Sequence[torch.Tensor]) -> bool:
    return (_has_triton() and len(pieces) <= MAX_PIECES and pieces[0].dtype in (torch.bfloat16, torch.float16, torch.float32)
            and all(p.shape[-1] <= MAX_WIDTH for p in pieces))


def _triton_quantize(pieces: Sequence[torch.Tensor], gelu: Sequence[bool], fast: bool
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    from hookkit.techniques.compile import fp8_rows_triton  # imports triton: CUDA only, on first use

    return fp8_rows_triton.quantize(pieces, gelu, fast, floor=floor_in(pieces[0].dtype))


@torch.library.custom_op("hookkit::fp8_quantize_rows", mutates_args=())
def fp8_quantize_rows(pieces: list[torch.Tensor], gelu: list[bool], fast: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """`cat([gelu_tanh(p) if g else p ...], -1)` quantized per row to e4m3 with torchao's scale: (data, scale).
    `fast`: the CUDA kernel's tanh from exp and approximate division (codes may differ from eager's by one step); the
    CPU runs the eager arithmetic either way."""
    _check_pieces(pieces, gelu)
    if pieces[0].is_cuda and _kernel_fits(pieces):
        return _triton_quantize(pieces, gelu, fast)
    return _reference(pieces, gelu)


@fp8_quantize_rows.register_fake
def _(pieces: list[torch.Tensor], gelu: list[bool], fast: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    _check_pieces(pieces, gelu)
    lead = list(pieces[0].shape[:-1])
    width = sum(p.shape[-1] for p in pieces)
    first = pieces[0]
    return first.new_empty([*lead, width], dtype=FP8), first.new_empty([*lead, 1], dtype=torch.float32)


def _layer_norm_reference(h: torch.Tensor, a: torch.Tensor, b: torch.Tensor, eps: float
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager arithmetic of `layer_norm(h) * a + b` (no affine; each op rounded to h's dtype), quantized as torchao does."""
    x = F.layer_norm(h, (h.shape[-1],), eps=eps) * a + b
    return _reference([x], [False])


def _one_row(t: torch.Tensor, h: torch.Tensor, flat: bool) -> bool:
    """Whether modulation `t` fits `h` [batch, tokens, width]: one row per batch element `[B or 1, 1, width]`, or with
    `flat` also one for all `[width]` (a norm's weight)."""
    width = h.shape[-1]
    if flat and t.dim() == 1:
        return t.shape[0] == width
    return t.dim() == 3 and t.shape[1] == 1 and t.shape[2] == width and (t.shape[0] == 1 or t.shape[0] == h.shape[0])


def _check_layer_norm(h: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    for name, t in (("a", a), ("b", b)):
        if h.dim() != 3 or not _one_row(t, h, flat=False) or t.dtype != h.dtype:
            raise HookError(f"hookkit::fp8_quantize_layer_norm_rows: expected h [batch, tokens, width] and {name} [batch or "
                            f"1, 1, width] of h's dtype, got h {tuple(h.shape)} {h.dtype}, {name} {tuple(t.shape)} "
                            f"{t.dtype}. Pass one modulation row per batch element.")


@torch.library.custom_op("hookkit::fp8_quantize_layer_norm_rows", mutates_args=())
def fp8_quantize_layer_norm_rows(h: torch.Tensor, a: torch.Tensor, b: torch.Tensor, eps: float
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """`layer_norm(h) * a + b` (AdaLN modulation: a = 1 + scale, b = shift, one row per batch element) quantized per
    row to e4m3 with torchao's scale: (data, scale). The CUDA kernel holds the row in registers and reads h once; its
    mean and variance are summed in another order than eager's (only `fast` graphs are rewritten to it) and it rounds
    to bf16 where eager does (GPU tests: row scales as eager torchao's on more than 99 % of rows; on a Flux-sized
    input every scale equal, 0.006 % of the codes one step apart). The CPU runs the eager arithmetic."""
    _check_layer_norm(h, a, b)
    if h.is_cuda and _has_triton() and h.dtype == torch.bfloat16 and h.shape[-1] <= LAYER_NORM_MAX_WIDTH:
        from hookkit.techniques.compile import fp8_rows_triton

        return fp8_rows_triton.quantize_layer_norm(h, a, b, eps, floor=floor_in(h.dtype))
    return _layer_norm_reference(h, a, b, eps)


@fp8_quantize_layer_norm_rows.register_fake
def _(h: torch.Tensor, a: torch.Tensor, b: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    _check_layer_norm(h, a, b)
    return h.new_empty(h.shape, dtype=FP8), h.new_empty([*h.shape[:-1], 1], dtype=torch.float32)


def _float_layer_norm_reference(h: torch.Tensor, a: torch.Tensor, b: torch.Tensor, eps: float
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager arithmetic of `(layer_norm(h.float()) * a + b).to(h.dtype)` (float32 throughout, one rounding at the
    end), quantized as torchao does."""
    x = (F.layer_norm(h.float(), (h.shape[-1],), eps=eps) * a + b).to(h.dtype)
    return _reference([x], [False])


def _check_float_layer_norm(h: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    for name, t in (("a", a), ("b", b)):
        if h.dim() != 3 or h.dtype not in _LOW or t.dtype != torch.float32 or not _one_row(t, h, flat=True):
            raise HookError(f"hookkit::fp8_quantize_float_layer_norm_rows: expected h [batch, tokens, width] in bf16 or "
                            f"fp16 and {name} float32 [width] or [batch or 1, 1, width], got h {tuple(h.shape)} "
                            f"{h.dtype}, {name} {tuple(t.shape)} {t.dtype}. Pass one float32 modulation row per batch "
                            "element or one for all.")


@torch.library.custom_op("hookkit::fp8_quantize_float_layer_norm_rows", mutates_args=())
def fp8_quantize_float_layer_norm_rows(h: torch.Tensor, a: torch.Tensor, b: torch.Tensor, eps: float
                                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """`(layer_norm(h.float()) * a + b).to(h.dtype)` quantized per row to e4m3 with torchao's scale: (data, scale).
    Wan's form of the AdaLN input (its FP32LayerNorm, float32 modulation rows `1 + scale` and `shift`, or the norm's
    own float32 weight and bias), where Flux's rounds to bf16 after each op. The CUDA kernel holds the row in
    registers and reads h once, summing mean and variance in another order than eager (only `fast` graphs are
    rewritten to it). The CPU runs the eager arithmetic."""
    _check_float_layer_norm(h, a, b)
    if h.is_cuda and _has_triton() and h.dtype == torch.bfloat16 and h.shape[-1] <= LAYER_NORM_MAX_WIDTH:
        from hookkit.techniques.compile import fp8_rows_triton

        return fp8_rows_triton.quantize_layer_norm(h, a, b, eps, rounded=False, floor=floor_in(h.dtype))
    return _float_layer_norm_reference(h, a, b, eps)


@fp8_quantize_float_layer_norm_rows.register_fake
def _(h: torch.Tensor, a: torch.Tensor, b: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    _check_float_layer_norm(h, a, b)
    return h.new_empty(h.shape, dtype=FP8), h.new_empty([*h.shape[:-1], 1], dtype=torch.float32)


# --- the graph pass ----------------------------------------------------------------------------------------

aten, prims = torch.ops.aten, torch.ops.prims
_CONVERT = prims.convert_element_type.default
_LOW = (torch.bfloat16, torch.float16)


def _number(value: Any, expected: float) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and float(value) == expected


def _split(node: Any, target: Any, constant: float, commutative: bool = False) -> Any:
    """`x` of `target(x, constant)` (or of `target(constant, x)` when `commutative`), else None."""
    if not _is(node, target) or len(node.args) != 2 or node.kwargs:
        return None
    first, second = node.args
    if _number(second, constant):
        return first
    if commutative and _number(first, constant):
        return second
    return None


def gelu_tanh_source(node: Any) -> torch.fx.Node | None:
    """M when `node` is torch's decomposition of `gelu(M, approximate="tanh")` for a bf16/fp16 M:
    `convert(0.5 * x * (1 + tanh(0.79788... * (x + 0.044715 * x * x * x))), M.dtype)` with `x = convert(M, f32)`."""
    if not _is(node, _CONVERT) or node.args[1] not in _LOW:
        return None
    for half, one_plus in orders(_pair(node.args[0], aten.mul.Tensor)):
        x = _split(half, aten.mul.Tensor, 0.5, True)
        t = _split(one_plus, aten.add.Tensor, 1.0, True)
        if x is None or not _is(t, aten.tanh.default):
            continue
        inner = _split(t.args[0], aten.mul.Tensor, 0.7978845608028654, True)
        terms = _pair(inner, aten.add.Tensor)
        if terms is None:
            continue
        for linear, cubic in (terms, terms[::-1]):
            cube = _split(cubic, aten.mul.Tensor, 0.044715, True)
            if linear is not x or cube is None:
                continue
            outer = _pair(cube, aten.mul.Tensor)
            square = next((p for p in (outer or ()) if _pair(p, aten.mul.Tensor) == (x, x)), None)
            if outer is None or square is None or x not in outer:
                continue
            if _is(x, _CONVERT) and x.args[1] == torch.float32 and _val(x.args[0]) is not None \
                    and _val(x.args[0]).dtype == node.args[1]:
                return x.args[0]
    return None


def _floored(node: Any) -> Any:
    """A of torchao's lower bound on the amax A (`activation_value_lb`, `AMAX_FLOOR`), else `node` itself. Post-grad, a
    bf16/fp16 A is bounded in float32 and rounded back: `convert(clamp_min(convert(A, f32), AMAX_FLOOR), A.dtype)`;
    a float32 A as `clamp_min(A, AMAX_FLOOR)` (or `clamp(A, AMAX_FLOOR)`)."""
    rounded = node if _is(node, _CONVERT) and node.args[1] in _LOW else None
    inner = rounded.args[0] if rounded is not None else node
    if _is(inner, aten.clamp.default) and len(inner.args) >= 2 and _number(inner.args[1], AMAX_FLOOR) \
            and (len(inner.args) < 3 or inner.args[2] is None) and not inner.kwargs:
        amax = inner.args[0]
    else:
        amax = _split(inner, aten.clamp_min.default, AMAX_FLOOR)
    if amax is None:
        return node
    if rounded is not None:  # the bound taken in float32: A came in as convert(A, f32), and goes back to A's dtype
        if not (_is(amax, _CONVERT) and amax.args[1] == torch.float32):
            return node
        amax = amax.args[0]
        if _val(amax) is None or _val(amax).dtype != rounded.args[1]:
            return node
    return amax


def _row_quantization(q: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """(X, scale) when `q` is torchao's per-row fp8 quantization of X (last dimension, e4m3, 448):
    `convert(clamp_max(clamp_min(convert(X, f32) / s, -448), 448), e4m3)`, `s = convert(amax(|X|, [-1], True) / 448, f32)`
    (the amax floored at `AMAX_FLOOR` or not)."""
    if not _is(q, _CONVERT) or q.args[1] != FP8:
        return None
    clamped = q.args[0]
    if _is(clamped, aten.clamp.default):
        low, high = (list(clamped.args[1:]) + [None, None])[:2]
        if not (_number(low, -FP8_MAX) and _number(high, FP8_MAX)):
            return None
        divided = clamped.args[0]
    else:
        low = _split(clamped, aten.clamp_max.default, FP8_MAX)
        divided = _split(low, aten.clamp_min.default, -FP8_MAX)
    quotient = _pair(divided, aten.div.Tensor)
    if quotient is None:
        return None
    xf, scale = quotient
    if not (_is(xf, _CONVERT) and xf.args[1] == torch.float32 and _is(scale, _CONVERT) and scale.args[1] == torch.float32):
        return None
    x = xf.args[0]
    amax = _floored(_split(scale.args[0], aten.div.Tensor, FP8_MAX))
    if not _is(amax, aten.amax.default) or not _is(amax.args[0], aten.abs.default) or amax.args[0].args[0] is not x:
        return None
    val = _val(x)
    dims, keepdim = amax.args[1], (amax.args[2] if len(amax.args) > 2 else amax.kwargs.get("keepdim", False))
    if val is None or val.dtype not in _LOW or not keepdim or len(dims) != 1 or not _last_dim(dims[0], val.dim()):
        return None
    return x, scale


def _fits(piece: torch.fx.Node) -> bool:
    """A piece of a known width the kernel holds in registers (a symbolic or wider one stays inductor's)."""
    width = _val(piece).shape[-1]
    return isinstance(width, int) and width <= MAX_WIDTH


#: the attention kernels whose output (getitem 0) the attention's output projection quantizes
_ATTENTION_KERNELS = tuple(getattr(aten, name).default for name in (
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention_for_cpu") if hasattr(aten, name))
#: views between an attention kernel's output and the Linear that reads it (heads merged, streams split)
_VIEWS = (aten.permute.default, aten.reshape.default, aten.view.default, aten.slice.Tensor, aten.unsqueeze.default,
          aten.squeeze.dim, aten.alias.default)
_SPLITS = (aten.split_with_sizes.default, aten.split.Tensor)


def attention_output(x: Any) -> bool:
    """Whether X is a view of an attention kernel's output: the input of Flux's double-block and Qwen-Image's `to_out`
    and `to_add_out` (the joint attention's output, heads merged, split into its image and text tokens). The attention
    writes it anyway, and inductor's quantization reads it twice (a reduction, then the scaled cast: 32 µs per
    Qwen-Image image stream at 1024² on an H200), where the one-pass kernel reads it once."""
    node = x
    while True:
        if _is(node, operator.getitem) and isinstance(node.args[0], torch.fx.Node) and node.args[0].target in _SPLITS:
            node = node.args[0].args[0]
        elif isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _VIEWS:
            node = node.args[0]
        else:
            break
    return (_is(node, operator.getitem) and node.args[1] == 0 and isinstance(node.args[0], torch.fx.Node)
            and node.args[0].op == "call_function" and node.args[0].target in _ATTENTION_KERNELS)


def _pieces(x: torch.fx.Node) -> tuple[list[torch.fx.Node], list[bool]] | None:
    """The inputs the op takes for X: `gelu(M)`, an attention's output (`attention_output`), or `cat([...], -1)` of up
    to two GELU outputs or tensors (at least one GELU). Any other plain tensor stays inductor's: it fuses the producer
    into the quantization, where the op would need the tensor written out first."""
    source = gelu_tanh_source(x)
    if source is not None:
        return ([source], [True]) if _fits(source) else None
    if attention_output(x):
        return ([x], [False]) if _fits(x) and _val(x).dtype in _LOW else None
    if not _is(x, aten.cat.default):
        return None
    parts, dim = x.args[0], (x.args[1] if len(x.args) > 1 else x.kwargs.get("dim", 0))
    if not _last_dim(dim, _val(x).dim()) or not 1 <= len(parts) <= MAX_PIECES:
        return None
    sources = [gelu_tanh_source(p) for p in parts]
    if not any(s is not None for s in sources):
        return None
    pieces = [s if s is not None else p for s, p in zip(sources, parts, strict=True)]
    if any(_val(p) is None or _val(p).dtype != _val(x).dtype for p in pieces):
        return None
    if not all(_fits(p) for p in pieces):
        return None
    return pieces, [s is not None for s in sources]


def layer_norm_modulation(x: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node, float] | None:
    """(h, a, b, eps) when X is torch's decomposition of `layer_norm(h) * a + b` (no affine, last dimension, h bf16
    of static width; a and b one row per batch element: `[B or 1, 1, width]`), the AdaLN input
    of Flux's and Qwen-Image's attention and feed-forward:
    `add(mul(convert(mul(sub(hf, mean), rsqrt(add(var, eps))), dtype), a), b)`, `var, mean = var_mean(hf, [-1],
    correction=0, keepdim=True)`, `hf = convert(h, f32)` (either operand order of the add and the muls)."""
    val = _val(x)
    if val is None or val.dtype != torch.bfloat16 or val.dim() != 3:  # the kernel rounds to bf16
        return None
    return _modulated(x, _layer_norm_source, lambda t: _modulation_row(t, val))


def float_layer_norm_modulation(x: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node, float] | None:
    """(h, a, b, eps) when X is torch's decomposition of `(layer_norm(h.float()) * a + b).to(bf16)` (float32 a and
    b: `[width]` or one row per batch element `[B or 1, 1, width]`; h bf16 of static width), Wan's AdaLN input and its
    affine cross-attention norm: `convert(add(mul(mul(sub(hf, mean), rsqrt(add(var, eps))), a), b), bf16)`,
    `hf = convert(h, f32)` (either operand order of the add and the muls)."""
    val = _val(x)
    if not _is(x, _CONVERT) or x.args[1] != torch.bfloat16 or val is None or val.dim() != 3:
        return None

    def bf16_normalized(ln: Any) -> tuple[torch.fx.Node, float] | None:
        match = _normalized(ln)
        return match if match is not None and _val(match[0]).dtype == torch.bfloat16 else None

    return _modulated(x.args[0], bf16_normalized, lambda t: _float_row(t, val))


def _modulated(total: Any, normalized: Callable[[Any], tuple[torch.fx.Node, float] | None],
               row: Callable[[Any], bool]) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node, float] | None:
    """(h, a, b, eps) when `total` is `add(mul(n, a), b)` (either operand order of each) with `normalized(n)` giving
    (h, eps) and `row` accepting a and b."""
    for product, b in orders(_pair(total, aten.add.Tensor)):
        for ln, a in orders(_pair(product, aten.mul.Tensor)):
            match = normalized(ln)
            if match is not None and row(a) and row(b):
                return match[0], a, b, match[1]
    return None


def _float_row(node: Any, x_val: torch.Tensor) -> bool:
    """Whether `node` is a float32 tensor of X's width: `[width]` or one row per batch element `[B or 1, 1, width]`."""
    val = _val(node)
    return isinstance(val, torch.Tensor) and val.dtype == torch.float32 and _one_row(val, x_val, flat=True)


def _layer_norm_source(node: Any) -> tuple[torch.fx.Node, float] | None:
    """(h, eps) of `convert(mul(sub(hf, mean), rsqrt(add(var, eps))), h.dtype)` over the last dimension."""
    if not _is(node, _CONVERT) or node.args[1] not in _LOW:
        return None
    match = _normalized(node.args[0])
    if match is None or _val(match[0]).dtype != node.args[1]:
        return None
    return match


def _normalized(node: Any) -> tuple[torch.fx.Node, float] | None:
    """(h, eps) of `mul(sub(hf, mean), rsqrt(add(var, eps)))` over the last dimension, `hf = convert(h, f32)`, h bf16
    or fp16 of a static width the kernel holds (`LAYER_NORM_MAX_WIDTH`)."""
    for centred, inverse in orders(_pair(node, aten.mul.Tensor)):
        diff = _pair(centred, aten.sub.Tensor)
        if diff is None or not _is(inverse, aten.rsqrt.default):
            continue
        shifted = _pair(inverse.args[0], aten.add.Tensor)
        if shifted is None or not isinstance(shifted[1], float) or shifted[1] <= 0:
            continue
        hf, mean = diff
        var, eps = shifted
        if not (_is(mean, operator.getitem) and _is(var, operator.getitem) and mean.args[0] is var.args[0]
                and (mean.args[1], var.args[1]) == (1, 0)):
            continue
        stats = mean.args[0]
        if (not _is(stats, aten.var_mean.correction) or stats.args[0] is not hf
                or stats.kwargs != {"correction": 0, "keepdim": True}):
            continue
        if not (_is(hf, _CONVERT) and hf.args[1] == torch.float32):
            continue
        h = hf.args[0]
        dims, h_val = stats.args[1], _val(h)
        if h_val is None or h_val.dtype not in _LOW or len(dims) != 1 or not _last_dim(dims[0], h_val.dim()):
            continue
        width = h_val.shape[-1]
        if not isinstance(width, int) or width > LAYER_NORM_MAX_WIDTH:
            continue
        return h, eps
    return None


def _modulation_row(node: Any, x_val: torch.Tensor) -> bool:
    """Whether `node` is a tensor of X's dtype holding one row per batch element: `[B or 1, 1, width]`."""
    val = _val(node)
    return isinstance(val, torch.Tensor) and val.dtype == x_val.dtype and _one_row(val, x_val, flat=False)


class FusedFp8Rows(CountingPass):
    """Inductor post-grad pass: torchao per-row fp8 quantizations of GELU / concatenated GELU / attention-output inputs
    become one
    `hookkit::fp8_quantize_rows` call each; `rewritten` counts the sites replaced by this instance's compiles. With
    `share`, Linears that quantize the same input first share one quantization (`shared` counts those dropped).

    Args:
        fast: the kernel's relaxed arithmetic (`Compile(fuse_fp8_rows="fast")`): tanh from exp, approximate division.
        devices: device types whose graphs are rewritten (default `DEVICES`: CUDA, where the Triton kernel runs).
        layer_norm: also rewrite quantizations of `layer_norm(h) * a + b` (AdaLN modulation) to
            `hookkit::fp8_quantize_layer_norm_rows`, and of Wan's float32 form `(layer_norm(h.float()) * a + b)
            .to(bf16)` to `hookkit::fp8_quantize_float_layer_norm_rows` (their kernel sums mean and variance in
            another order than eager: "fast" graphs only).
        share: Linears that quantize the same input share one quantization (exact: the same computation).
        then: a post-grad pass that was already configured, run after this one (hookkit's compile options replace the
            process-wide `post_grad_custom_post_pass` for its own compiles, so it is chained, not dropped).
    """

    source = Path(__file__).read_bytes()  # part of the cache key (read once: inductor asks for it at every compile)

    def __init__(self, fast: bool = False, devices: tuple[str, ...] | None = None, layer_norm: bool = False,
                 share: bool = False, then: Callable[[torch.fx.Graph], None] | None = None) -> None:
        super().__init__(then)
        self.fast = fast
        self.devices = DEVICES if devices is None else devices
        self.layer_norm = layer_norm
        self.share = share
        #: per graph (compile order), how many quantizations were dropped for an identical earlier one
        self.shared_per_graph: list[int] = []

    @property
    def shared(self) -> int:
        """Quantizations dropped for an identical one of the same input, all graphs together."""
        return sum(self.shared_per_graph)

    def settings(self) -> tuple[Any, ...]:
        return (self.fast, self.devices, self.layer_norm, self.share)

    def rewrite(self, graph: torch.fx.Graph) -> int:
        shared = self._share(graph) if self.share else 0
        self.shared_per_graph.append(shared)
        if shared:
            graph.eliminate_dead_code()
        found = 0
        for q in list(graph.nodes):
            match = _row_quantization(q)
            if match is None:
                continue
            x, scale = match
            if _val(x).device.type not in self.devices:
                continue
            pieces = _pieces(x)
            if pieces is not None:
                self._replace(graph, q, scale, torch.ops.hookkit.fp8_quantize_rows.default, (*pieces, self.fast))
                found += 1
                continue
            if not self.layer_norm:
                continue
            norm = layer_norm_modulation(x)
            if norm is not None:
                self._replace(graph, q, scale, torch.ops.hookkit.fp8_quantize_layer_norm_rows.default, norm)
                found += 1
                continue
            norm = float_layer_norm_modulation(x)
            if norm is not None:
                self._replace(graph, q, scale, torch.ops.hookkit.fp8_quantize_float_layer_norm_rows.default, norm)
                found += 1
        return found

    def _share(self, graph: torch.fx.Graph) -> int:
        """Linears that quantize the same input (Flux's and Qwen-Image's to_q, to_k and to_v of one normalized stream,
        a single block's proj_mlp too) each get torchao's quantization of it; inductor fuses them into one kernel but
        still writes one fp8 copy per Linear. The first quantization of an input serves every later one (the same
        computation on the same tensor: bitwise the same data and scale)."""
        order = {node: i for i, node in enumerate(graph.nodes)}
        first: dict[torch.fx.Node, tuple[torch.fx.Node, torch.fx.Node]] = {}
        shared = 0
        for q in list(graph.nodes):
            match = _row_quantization(q)
            if match is None or _val(match[0]).device.type not in self.devices:
                continue
            x, scale = match
            if x not in first:
                first[x] = (q, scale)
                continue
            kept_q, kept_scale = first[x]
            # FX order is execution order: the kept quantization (found first) precedes this one and its uses; a use
            # of this scale placed before the kept scale is this quantization's own division, dead once q is replaced
            q.replace_all_uses_with(kept_q)
            scale.replace_all_uses_with(kept_scale, delete_user_cb=lambda user: order.get(user, -1) > order[kept_scale])
            shared += 1
        return shared

    @staticmethod
    def _replace(graph: torch.fx.Graph, q: torch.fx.Node, scale: torch.fx.Node, op: Any, args: tuple[Any, ...]) -> None:
        """`op(*args)` (fp8 data, scale) takes the place of torchao's quantization `q` and its `scale`."""
        from torch._guards import detect_fake_mode

        fake = detect_fake_mode([_val(a) for a in torch.utils._pytree.tree_leaves(args) if isinstance(a, torch.fx.Node)])
        with graph.inserting_before(scale):  # before both outputs' first use: X and its inputs precede `scale`
            fused = fake_call(graph, fake, op, *args)
            data = graph.call_function(operator.getitem, (fused, 0))
            new_scale = graph.call_function(operator.getitem, (fused, 1))
        data.meta["val"], new_scale.meta["val"] = fused.meta["val"]
        q.replace_all_uses_with(data)
        scale.replace_all_uses_with(new_scale)

