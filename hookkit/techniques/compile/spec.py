"""The `Compile` spec: regional or whole-model torch.compile, and whole-transformer CUDA graphs."""

from __future__ import annotations

from typing import ClassVar

import attrs

from hookkit.core.validate import boolean, choice, strict_init

COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@strict_init
@attrs.frozen(kw_only=True)
class Compile:
    """torch.compile of the adapter's repeated blocks (`regional=True`) or of the whole transformer.

    `cuda_graphs="transformer"` captures one CUDA graph per transformer call signature on top of
    regional compilation (GPU only).
    """

    NAME: ClassVar[str] = "compile"
    regional: bool = attrs.field(default=True, validator=boolean)
    mode: str | None = attrs.field(default=None, validator=choice(*COMPILE_MODES))
    fullgraph: bool = attrs.field(default=True, validator=boolean)
    dynamic: bool | None = attrs.field(default=None, validator=choice(None, True, False))
    cuda_graphs: str = attrs.field(default="none", validator=choice("none", "transformer"))
    #: torch.compile backend; "inductor" for speed, "eager"/"aot_eager" to debug tracing without codegen
    backend: str = attrs.field(default="inductor", validator=choice("inductor", "eager", "aot_eager", "cudagraphs"))
