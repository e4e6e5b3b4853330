"""The `Quantize` spec: which torchao scheme, on which Linear layers."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import attrs

from hookkit.core.validate import boolean, choice, int_field, str_tuple, strict_init, to_tuple
from hookkit.errors import field_error

QUANT_SCHEMES = ("fp8_row", "fp8_tensor", "fp8_weight_only", "int8_dynamic", "int8_weight_only", "nvfp4", "mxfp8")


@strict_init
@attrs.frozen(kw_only=True)
class Quantize:
    """torchao weight quantization of the transformer's Linear layers, selected by the adapter and rules
    (the order of the rules is in `hookkit.techniques.quantize.torchao`).

    Args:
        scheme: the torchao scheme (required): "fp8_row", "fp8_tensor" (fp8 with dynamic activations, CUDA
            compute capability 8.9+), "fp8_weight_only", "int8_dynamic", "int8_weight_only" (any device),
            "nvfp4", "mxfp8" (10.0+).
        region: "repeated_blocks" (default): only Linears inside the adapter's repeated block classes; "all".
        exclude: fnmatch patterns on module paths never to quantize, on top of the adapter's `quant_exclude`. Each
            must match a Linear layer: one that matches none (a typo) is refused at enable, naming the closest paths.
        include: patterns quantized even when `region`, `exclude` or `min_features` would skip them (each must match
            a Linear layer, as for `exclude`).
        min_features: skip Linears with `min(in_features, out_features)` below this (default 0).
        filter_fn: `(module, fqn) -> bool` replacing the selection rules, as torchao's `filter_fn`; it must be
            deterministic (the plan and the attach ask it separately). Default None.
        keep_original: where the original weights are kept so that removal restores them: "cpu", "device", or
            None (default: nothing kept, and `handle.remove()` refuses).
        include_modulation: also quantize the adapter's AdaLN modulation Linears (its `quant_modulation`
            patterns; on Flux `*.norm1.linear`, `*.norm1_context.linear`, `*.norm.linear`), which stay in bf16
            by default. They run at one activation row per sample; in per-row fp8 they take half the memory
            (what cache-dit's fp8 saves on Flux), and their output scales and gates every block, so their
            quality cost is measured by `benchmarks/quality_fp8.py`. Default False.
    """

    scheme: str = attrs.field(validator=choice(*QUANT_SCHEMES))
    region: str = attrs.field(default="repeated_blocks", validator=choice("repeated_blocks", "all"))
    exclude: tuple[str, ...] = attrs.field(default=(), converter=to_tuple, validator=str_tuple)
    include: tuple[str, ...] = attrs.field(default=(), converter=to_tuple, validator=str_tuple)
    min_features: int = attrs.field(default=0, validator=int_field(0))
    filter_fn: Callable[..., bool] | None = attrs.field(default=None, eq=False)
    keep_original: str | None = attrs.field(default=None, validator=choice(None, "cpu", "device"))
    include_modulation: bool = attrs.field(default=False, validator=boolean)

    @filter_fn.validator
    def _check_filter(self, attr: attrs.Attribute, value: Any) -> None:
        """A callable that cannot take `(module, fqn)` is refused here, not with torchao's TypeError at enable."""
        if value is None:
            return
        if not callable(value):
            raise field_error("Quantize", "filter_fn", value, "a callable (module, fqn) -> bool or None")
        try:
            signature = inspect.signature(value)
        except (ValueError, TypeError):  # no signature to read (some builtins): torchao's call will say
            return
        try:
            signature.bind(None, "")  # binds the arguments only: nothing is called
        except TypeError:
            raise field_error("Quantize", "filter_fn", value, "a callable taking (module, fqn) and returning a bool",
                              f"It takes {signature}. Pass a function of the module and its path, e.g. "
                              "hookkit.techniques.quantize.filters.by_name('*.attn.*').") from None
