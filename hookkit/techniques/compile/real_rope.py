"""Complex multiplications in compiled regions as real arithmetic that inductor fuses (complex rotary embeddings).

Qwen-Image, Z-Image, NucleusMoE, Bria-Fibo and others apply rotary embeddings to queries and keys as
`view_as_real(view_as_complex(x.float().reshape(..., -1, 2)) * freqs)`. Inductor generates no code for complex
operators (it warns: "Performance may be worse than eager"): the product runs as its own ATen kernel, and the
normalization before it and the cast after it cannot fuse across it, so each query and key makes extra float32
round trips through memory at every attention call. `RealComplexMul` is an inductor post-grad graph pass (passed in the
`options` of hookkit's own `torch.compile` calls as `post_grad_custom_pre_pass`, never set process-wide) that
replaces each such product by (a + bi)(c + di) = (ac - bd) + (ad + bc)i on float views of its operands, the formula
ATen's complex product computes, so that it fuses with its neighbours into one kernel. Products whose result is
used as a complex tensor, or whose factors are not both complex of one dtype, are left alone (a conjugated factor,
Sana-WM's inverse rotation, reaches the pass resolved and is rewritten like any other).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from hookkit.techniques.compile.graph_pass import CountingPass, fake_call, fake_value as _val, is_call as _is

aten, prims = torch.ops.aten, torch.ops.prims
#: complex dtype -> the real dtype of its parts
_REAL = {torch.complex64: torch.float32, torch.complex128: torch.float64}


def _complex_product(mul: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """(the real tensor viewed as complex, the other complex factor) of `view_as_complex(x) * y` whose every use
    is `view_as_real`, else None."""
    if not _is(mul, aten.mul.Tensor) or len(mul.args) != 2 or mul.kwargs:
        return None
    a, b = mul.args
    if not _is(a, aten.view_as_complex.default):
        a, b = b, a
    if not _is(a, aten.view_as_complex.default) or not isinstance(b, torch.fx.Node):
        return None
    va, vb = _val(a), _val(b)
    if va is None or vb is None or va.dtype not in _REAL or vb.dtype != va.dtype:  # the product then has va's dtype
        return None
    if vb.is_conj():  # an unresolved conjugate has no real view (view_as_real refuses it); functionalization resolves them
        return None
    if not mul.users or any(not _is(u, aten.view_as_real.default) for u in mul.users):
        return None
    return a.args[0], b


class RealComplexMul(CountingPass):
    """Inductor post-grad pass: `view_as_real(view_as_complex(x) * y)` becomes real arithmetic on `x` and
    `view_as_real(y)`; `rewritten` counts the products replaced by this instance's compiles.

    Args:
        then: a post-grad pre-pass that was already configured, run after this one (hookkit's compile options replace
            the process-wide `post_grad_custom_pre_pass` for its own compiles, so it is chained, not dropped).
    """

    source = Path(__file__).read_bytes()

    def rewrite(self, graph: torch.fx.Graph) -> int:
        found = 0
        for mul in list(graph.nodes):
            match = _complex_product(mul)
            if match is not None:
                self._replace(graph, mul, *match)
                found += 1
        return found

    @staticmethod
    def _replace(graph: torch.fx.Graph, mul: torch.fx.Node, x: torch.fx.Node, y: torch.fx.Node) -> None:
        from torch._guards import detect_fake_mode

        fake = detect_fake_mode([_val(x), _val(y)])

        call = functools.partial(fake_call, graph, fake)  # a new node with its fake value

        with graph.inserting_before(mul):
            parts = call(aten.view_as_real.default, y)
            a, b = call(aten.select.int, x, -1, 0), call(aten.select.int, x, -1, 1)
            c, d = call(aten.select.int, parts, -1, 0), call(aten.select.int, parts, -1, 1)
            real = call(aten.sub.Tensor, call(aten.mul.Tensor, a, c), call(aten.mul.Tensor, b, d))
            imag = call(aten.add.Tensor, call(aten.mul.Tensor, a, d), call(aten.mul.Tensor, b, c))
            # interleave (real, imag) on a new last dim with a pointwise select, not a cat (which would
            # materialize both halves): out[..., k] = real if k == 0 else imag
            index = call(prims.iota.default, 2, start=0, step=1, dtype=torch.int64, device=_val(x).device,
                         requires_grad=False)
            out = call(aten.where.self, call(aten.eq.Scalar, index, 0), call(aten.unsqueeze.default, real, -1),
                       call(aten.unsqueeze.default, imag, -1))
        for use in list(mul.users):
            use.replace_all_uses_with(out)
