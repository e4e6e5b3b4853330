"""The `Compile` spec: regional or whole-model torch.compile, and whole-transformer CUDA graphs."""

from __future__ import annotations

import attrs

from hookkit.core.validate import boolean, choice

COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@attrs.frozen(kw_only=True)
class Compile:
    """torch.compile of the adapter's repeated blocks (`regional=True`) or of the whole transformer.

    Args:
        regional: compile each instance of the adapter's repeated block classes (default True: short warm-up,
            hooks stay outside the graphs); False compiles the whole transformer.
        mode: torch.compile's mode (default None, as "default"); "reduce-overhead" and "max-autotune" use
            CUDA graph trees, for which hookkit marks every transformer call as a step boundary.
        fullgraph: refuse graph breaks inside a compiled region (default True).
        dynamic: torch.compile's `dynamic` (default None: torch decides; True/False force it).
        cuda_graphs: "none" (default), or "transformer": capture one CUDA graph per transformer call signature
            on top of regional compilation and replay it (GPU only; mode must not use CUDA graphs itself).
        backend: "inductor" (default) for speed; "eager"/"aot_eager" to debug tracing without code generation;
            "cudagraphs" for CUDA graphs without inductor.
    """

    regional: bool = attrs.field(default=True, validator=boolean)
    mode: str | None = attrs.field(default=None, validator=choice(*COMPILE_MODES))
    fullgraph: bool = attrs.field(default=True, validator=boolean)
    dynamic: bool | None = attrs.field(default=None, validator=choice(None, True, False))
    cuda_graphs: str = attrs.field(default="none", validator=choice("none", "transformer"))
    backend: str = attrs.field(default="inductor", validator=choice("inductor", "eager", "aot_eager", "cudagraphs"))
