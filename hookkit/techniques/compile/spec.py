"""The `Compile` spec: regional or whole-model torch.compile, and whole-transformer CUDA graphs."""

from __future__ import annotations

from typing import ClassVar

import attrs

from hookkit.core.validate import boolean, choice, int_field

COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@attrs.frozen(kw_only=True)
class Compile:
    """torch.compile of the adapter's repeated blocks (`regional=True`) or of the whole transformer.

    `cuda_graphs="transformer"` captures one CUDA graph per transformer call signature on top of
    regional compilation (GPU only).

    Args:
        regional: compile each repeated block (True) or the whole transformer (False).
        mode: torch.compile mode; "reduce-overhead" adds cudagraph trees (hookkit marks the step boundary).
        fullgraph: refuse graph breaks inside a compiled region.
        dynamic: torch.compile's `dynamic`. None (default) is automatic dynamic shapes: the first resolution (or
            batch size) compiles static, the second recompiles once with the changed dimensions symbolic (the
            sequence length), and later ones reuse that graph, so 10 resolutions are 2 compiles per region, not 10.
            False compiles every new shape again until torch's recompile limit (8), after which the region runs
            eagerly; True starts symbolic (one compile, possibly slower kernels).
        cuda_graphs: "transformer" captures the whole transformer call as one CUDA graph per input signature.
        backend: torch.compile backend; "inductor" for speed, "eager"/"aot_eager" to debug tracing without codegen.
        max_graphs: with cuda_graphs="transformer", how many captured graphs are kept (least recently replayed
            evicted first; each input signature, CFG branch and DBCache decision is one graph). Every graph holds
            its static inputs and outputs in the shared pool: the summary reports captures, evictions and the
            memory each capture took.
    """

    NAME: ClassVar[str] = "compile"
    regional: bool = attrs.field(default=True, validator=boolean)
    mode: str | None = attrs.field(default=None, validator=choice(*COMPILE_MODES))
    fullgraph: bool = attrs.field(default=True, validator=boolean)
    dynamic: bool | None = attrs.field(default=None, validator=choice(None, True, False))
    cuda_graphs: str = attrs.field(default="none", validator=choice("none", "transformer"))
    #: torch.compile backend; "inductor" for speed, "eager"/"aot_eager" to debug tracing without codegen
    backend: str = attrs.field(default="inductor", validator=choice("inductor", "eager", "aot_eager", "cudagraphs"))
    max_graphs: int = attrs.field(default=16, validator=int_field(1))
