"""The `Compile` spec: regional or whole-model torch.compile, and whole-transformer CUDA graphs."""

from __future__ import annotations

import attrs

from hookkit.core.validate import boolean, choice, int_field, strict_init

COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@strict_init
@attrs.frozen(kw_only=True)
class Compile:
    """torch.compile of the adapter's repeated blocks (`regional=True`) or of the whole transformer.

    Args:
        regional: compile each instance of the adapter's repeated block classes (default True: short warm-up,
            hooks stay outside the graphs); False compiles the whole transformer.
        mode: torch.compile's mode (default None, as "default"); "reduce-overhead" and "max-autotune" use
            CUDA graph trees, for which hookkit marks every transformer call as a step boundary.
        fullgraph: refuse graph breaks inside a compiled region (default True).
        dynamic: torch.compile's `dynamic`. None (default) is automatic dynamic shapes: the first resolution (or
            batch size) compiles static, the second recompiles once with the changed dimensions (the sequence
            length) symbolic, later ones reuse that graph: 10 resolutions are 2 compiles per region, not 10.
            False compiles every new shape again until torch's recompile limit, after which the region runs
            eagerly; True starts symbolic (one compile, possibly slower kernels).
        cuda_graphs: "none" (default), or "transformer": capture one CUDA graph per transformer call signature
            on top of regional compilation and replay it (GPU only; mode must not use CUDA graphs itself).
        backend: "inductor" (default) for speed; "eager"/"aot_eager" to debug tracing without code generation;
            "cudagraphs" for CUDA graphs without inductor.
        max_graphs: with cuda_graphs="transformer", how many captured graphs are kept (default 16; the least
            recently replayed is evicted first). Each input signature, CFG branch and DBCache decision is one
            graph holding its static inputs and outputs; the summary counts captures and evictions and reports
            the memory each kept graph took.
        fuse_fp8_rows: with `Quantize(scheme="fp8_row")` and the inductor backend on CUDA, quantize in one pass, by
            hookkit's Triton kernels, the Linear inputs inductor quantizes in two passes over the row: GELU outputs and
            concatenations with one (Flux's single-block `proj_out`, every feed-forward's second Linear), attention
            outputs (Flux's double-block and Qwen-Image's `to_out` / `to_add_out`), and with "fast" the AdaLN inputs
            `layer_norm(h) * (1 + scale) + shift` (Linears of one input then share one quantization). "fast"
            (default) computes tanh from exp and divides approximately, as inductor's own kernels do: an fp8 Flux-dev
            step at 1024² 7.5 ms shorter on an H200 from the GELU sites alone (BENCHMARKS.md), fp8 codes
            within one step of eager torchao's. "exact" follows eager torchao's arithmetic (libdevice tanh, correctly
            rounded division) on the GELU and attention sites and leaves AdaLN inputs to inductor: the compiled Linear
            is bitwise eager torchao's, for reproducing eager outputs. "off" leaves all of torchao's quantization to
            inductor.
        real_rope: with the inductor backend, compute complex multiplications whose operand is a real tensor viewed
            as complex and whose result is viewed back as real (complex rotary embeddings: Qwen-Image, Z-Image, ...)
            as real arithmetic (default True): inductor generates no code for complex operators and runs them as
            separate kernels between unfused neighbours; as real arithmetic they fuse into the query/key
            normalization. The same formula as ATen's complex product: on the CPU bitwise the complex path's output.
        fuse_norm_rope: with the inductor backend on CUDA, compute each attention's query/key RMSNorm and rotary
            embedding (the forms of Flux, Qwen-Image, Wan up to 16 heads, and the models that share their attention
            code) in one pass by hookkit's kernel, writing the attention's input directly (default True): inductor's
            own kernels pass over the query and key several times (the kernels between the QKV projections and the
            attention took 6.4 ms of an fp8 Flux-dev 1024² step on an H200, 3.1 ms with hookkit's; Qwen-Image's 7.3
            against 4.3 ms; Wan 2.1 1.3B's 7.5 against 7.0 ms: BENCHMARKS.md). The kernel rounds where
            eager rounds (bitwise in Triton's CPU interpreter; on the GPU the sum of squares in another order moves a
            few values in a million by one bf16 step). False leaves them to inductor.
    """

    regional: bool = attrs.field(default=True, validator=boolean)
    mode: str | None = attrs.field(default=None, validator=choice(*COMPILE_MODES))
    fullgraph: bool = attrs.field(default=True, validator=boolean)
    dynamic: bool | None = attrs.field(default=None, validator=choice(None, True, False))
    cuda_graphs: str = attrs.field(default="none", validator=choice("none", "transformer"))
    backend: str = attrs.field(default="inductor", validator=choice("inductor", "eager", "aot_eager", "cudagraphs"))
    max_graphs: int = attrs.field(default=16, validator=int_field(1))
    fuse_fp8_rows: str = attrs.field(default="fast", validator=choice("exact", "fast", "off"))
    real_rope: bool = attrs.field(default=True, validator=boolean)
    fuse_norm_rope: bool = attrs.field(default=True, validator=boolean)
