"""The `Quantize` spec: which torchao scheme, on which Linear layers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import attrs

from hookkit.core.validate import boolean, choice, int_field, str_tuple, to_tuple
from hookkit.errors import spec_error

QUANT_SCHEMES = ("fp8_row", "fp8_tensor", "fp8_weight_only", "int8_dynamic", "int8_weight_only", "nvfp4", "mxfp8")


@attrs.frozen(kw_only=True)
class Quantize:
    """torchao weight quantization of the transformer's Linear layers, selected by the adapter and rules.

    Args:
        scheme: the torchao scheme, one of `QUANT_SCHEMES` ("fp8_row": fp8 weights and dynamic per-row fp8
            activations, SM89+).
        region: "repeated_blocks" (default) quantizes only Linears inside the adapter's repeated block classes;
            "all" considers every Linear of the transformer.
        exclude: fnmatch patterns on module paths kept out, on top of the adapter's `quant_exclude`.
        include: fnmatch patterns that override the region, exclude and size rules (not the scheme's
            divisibility and dtype requirements).
        min_features: skip Linears whose smaller side is below this (tiny layers gain nothing).
        filter_fn: `(module, fqn) -> bool` replacing the selection rules above (torchao's `filter_fn`).
        keep_original: "cpu" or "device" keeps the original weights so that removal restores them; None
            keeps nothing and makes the handle unremovable.
        include_modulation: also quantize the adapter's AdaLN modulation Linears (`quant_modulation`: on Flux
            `*.norm1.linear`, `*.norm1_context.linear`, `*.norm.linear`, 3.2 B parameters). They run at one
            activation row per sample (M = batch): per-row fp8 halves their memory (about 3.2 GB on
            Flux-dev, what cache-dit saves by quantizing them), while their output scales and gates every
            block, so the quality cost is measured, not assumed (`benchmarks/quality_fp8.py`). Off by default.
    """

    NAME: ClassVar[str] = "quantize"
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
        if value is not None and not callable(value):
            raise spec_error("Quantize", "filter_fn", value, "a callable (module, fqn) -> bool or None")
