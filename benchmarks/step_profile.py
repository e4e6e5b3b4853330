"""Where the uncached fp8 + whole-transformer-graphs step at 1024² spends its time: Flux-dev or Qwen-Image.

One transformer call = one denoising step without caching. This script captures the inputs of a real pipeline
call, then, for each variant (an attention backend set with diffusers' `transformer.set_attention_backend`, and
optionally the AdaLN modulation Linears in fp8 too), enables hookkit on the bare transformer
(`Quantize("fp8_row")` + `Compile(cuda_graphs="transformer")`), times the step (calls back to back, CUDA events
between them, median: a pipeline's step; `synced_step_ms` times each call synchronized instead) and
profiles it with `torch.profiler`: device kernel time grouped as GEMMs / attention / activation quantization /
norms+modulation / RoPE / other, against the 87 ms floor (DESIGN.md: 64 ms of fp8 GEMMs at 1140-1300 TFLOP/s
+ 23 ms of cuDNN attention at 652 TFLOP/s on an H200). A backend that is not installed is a "failed" row with
the reason, not a crash. Rows stream to $OUT/step_profile.json as they finish.

    python benchmarks/step_profile.py                       # H200: Flux-dev 1024², ~3 min
    python benchmarks/step_profile.py --variants native,native+mod,native+fused+mod --size 512
    python benchmarks/step_profile.py --model qwenimage     # H200: Qwen-Image 1024² (no floor computed)
    python benchmarks/step_profile.py --model wan --size 480 --variants native+mod,native+mod+nonormrope
    python benchmarks/step_profile.py --quick               # CPU: the tiny model, int8 weight-only, no graphs (~1 min)

Kernel names are grouped by regular expressions (`GROUPS`); each row keeps its 25 largest kernels with their
group, so a misfiled kernel is visible in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import hookkit
from hookkit.tools import bench

FLOOR_MS_1024 = 87.0  # DESIGN.md, H200, Flux-dev 1024²: fp8 GEMMs 64 ms + cuDNN attention 23 ms
DEFAULT_VARIANTS = "native,native+mod,native+fused,_native_cudnn,_native_flash,_native_efficient,flash,_flash_3"

#: (group, pattern) checked in order on the lower-cased kernel (or, on the CPU, operator) name
GROUPS: tuple[tuple[str, str], ...] = (
    ("attention", r"flash|fmha|attention|attn|sdpa|cudnn|mha|softmax"),
    ("activation quantization", r"amax|float8|fp8|f8|quant|e4m3|clamp.*to_copy|to_copy.*clamp"),
    ("GEMMs", r"gemm|cutlass|xmma|nvjet|cublas|matmul|_mm\b|aten::mm|addmm|linear|gemv|sm90_"),
    ("RoPE", r"rotary|rope|\bcos\b|\bsin\b|view_as_complex|unbind.*stack"),
    ("norms+modulation", r"norm|rsqrt|var_mean|mean.*mul.*add|addcmul|mul_add|add_mul|silu"),
)


def kernel_group(name: str) -> str:
    lowered = name.lower()
    for group, pattern in GROUPS:
        if re.search(pattern, lowered):
            return group
    return "other"


def capture_inputs(pipe: Any, opts: bench.ModelOptions) -> dict[str, Any]:
    """The keyword arguments of the transformer's first call in a one-step pipeline call (cloned)."""
    seen: list[dict[str, Any]] = []

    def grab(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not seen:
            assert not args, "diffusers pipelines call their transformer with keyword arguments only"
            seen.append({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})

    hook = pipe.transformer.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        pipe(**{**bench.call_kwargs(pipe, opts, bench.output_type_for(opts)), "num_inference_steps": 1})
    finally:
        hook.remove()
    return seen[0]


def step_ms(transformer: torch.nn.Module, inputs: dict[str, Any], runs: int, device: torch.device) -> list[float]:
    """Per call, as a pipeline's steps run: `runs` calls back to back, the GPU's time from each call's start to the
    next one's (CUDA events; the host launches ahead as far as a graph launch lets it), so host work that a pipeline
    overlaps is not counted twice. The first call starts from an idle GPU and includes the host's work before its
    launch (the median leaves it out). On the CPU: the wall time of each call."""
    if device.type != "cuda":
        return synced_step_ms(transformer, inputs, runs, device)
    bench.synchronize(device)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(runs + 1)]
    for event in events[:-1]:
        event.record()
        transformer(**inputs)
    events[-1].record()
    events[-1].synchronize()
    return [a.elapsed_time(b) for a, b in zip(events, events[1:])]


def synced_step_ms(transformer: torch.nn.Module, inputs: dict[str, Any], runs: int, device: torch.device
                   ) -> list[float]:
    """Each call synchronized before and after: the CPU's measure, and on a GPU a comparison for `step_ms`. The host's
    work before the graph launch adds to the GPU's here, which a pipeline overlaps, so this overstates the step."""
    return [1e3 * bench.timed(lambda: transformer(**inputs), device)[0] for _ in range(runs)]


def kernels_of(events: Any, cuda: bool) -> list[tuple[str, float, int]]:
    """(name, self µs, count) of a profile's device kernels (`cuda`), or on the CPU, which has no kernels, of its leaf
    `aten::` operators by self host time."""
    if cuda:
        return [(e.key, e.self_device_time_total, e.count) for e in events
                if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0]
    return [(e.key, e.self_cpu_time_total, e.count) for e in events
            if e.key.startswith("aten::") and e.self_cpu_time_total > 0]


def group_ms(kernels: list[tuple[str, float, int]]) -> dict[str, float]:
    """Milliseconds of `kernels_of`'s kernels summed per group (`GROUPS`, then "other"), every group named."""
    groups: dict[str, float] = {g: 0.0 for g, _ in GROUPS} | {"other": 0.0}
    for name, us, _ in kernels:
        groups[kernel_group(name)] += us / 1e3
    return groups


def profile(transformer: torch.nn.Module, inputs: dict[str, Any], calls: int, device: torch.device) -> dict[str, Any]:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(calls):
            transformer(**inputs)
        bench.synchronize(device)
    events = prof.key_averages()
    kernels = kernels_of(events, device.type == "cuda")
    groups = {group: ms / calls for group, ms in group_ms(kernels).items()}
    launches = sum(e.count for e in events if e.key in (
        "cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaGraphLaunch")) / calls
    top = sorted(kernels, key=lambda k: -k[1])[:25]
    return dict(
        kernel_ms=sum(groups.values()), groups_ms=groups, launches_per_call=launches,
        top_kernels=[dict(name=n[:160], group=kernel_group(n), ms=us / 1e3 / calls, count=c / calls) for n, us, c in top],
    )


def spec_for(quick: bool, modulation: bool, mode: str | None = None, fuse: str | None = None,
             real_rope: bool = True, norm_rope: bool = True) -> hookkit.Spec:
    """The profiled spec; `fuse` None keeps `Compile`'s own `fuse_fp8_rows` default (what a user gets)."""
    if quick:  # CPU: a scheme the CPU runs, no compile (this only checks the script)
        return hookkit.Spec(quantize=hookkit.Quantize(scheme="int8_weight_only", keep_original="device",
                                                      include_modulation=modulation))
    return hookkit.Spec(quantize=hookkit.Quantize(scheme="fp8_row", keep_original="device", include_modulation=modulation),
                        compile=hookkit.Compile(cuda_graphs="transformer", mode=mode, real_rope=real_rope,
                                                fuse_norm_rope=norm_rope,
                                                **({} if fuse is None else {"fuse_fp8_rows": fuse})), memo=True)


#: variant suffixes: what each changes before enabling
SUFFIXES = {
    "mod": "the AdaLN modulation Linears in fp8 too (Quantize(include_modulation=True))",
    "fused": "diffusers' fuse_qkv_projections first (one QKV GEMM per stream)",
    "cdt": "inductor's coordinate-descent tuning of the generated kernels (torch._inductor.config)",
    "autotune": "regions compiled with mode='max-autotune-no-cudagraphs' (GEMM templates autotuned)",
    "nofuse": "Compile(fuse_fp8_rows='off'): all of torchao's activation quantization left to inductor (two passes)",
    "fastq": "Compile(fuse_fp8_rows='fast') named explicitly (the default; older commands name it)",
    "exactq": "Compile(fuse_fp8_rows='exact'): hookkit's one-pass kernel with eager torchao's arithmetic (bitwise)",
    "complex": "Compile(real_rope=False): complex RoPE products left to inductor's ATen fallback (Qwen-Image)",
    "mk": "inductor's triton.multi_kernel=1 in the quantized regions' options (one-pass row reductions up to 16x wider)",
    "adaln": "the fp8 row pass's experimental AdaLN path (compile.hooks.ADALN_ROWS): Linears of the same input share "
             "one quantization, layer_norm(h) * (1 + scale) + shift quantized in one pass by hookkit's kernel",
    "noadaln": "that AdaLN path off, whatever compile.hooks.ADALN_ROWS says",
    "nonormrope": "Compile(fuse_norm_rope=False): the query/key RMSNorm and RoPE left to inductor's kernels",
}


def fuse_for(extras: list[str]) -> str | None:
    """`Compile.fuse_fp8_rows` for a variant's suffixes: None (the library default, "fast") unless one names it."""
    return "off" if "nofuse" in extras else "exact" if "exactq" in extras else "fast" if "fastq" in extras else None


def run_variant(variant: str, transformer: torch.nn.Module, inputs: dict[str, Any], args: argparse.Namespace,
                device: torch.device) -> dict[str, Any]:
    backend, *extras = variant.split("+")
    unknown = set(extras) - set(SUFFIXES)
    row: dict[str, Any] = dict(variant=variant, attention_backend=backend, include_modulation="mod" in extras,
                               fused_qkv="fused" in extras, status="ok", note="")
    handle = None
    fused = False
    import torch._inductor.config as inductor_config
    cdt_before = inductor_config.coordinate_descent_tuning
    from hookkit.techniques.compile import hooks as compile_hooks
    options_before = dict(compile_hooks.QUANTIZED_INDUCTOR_OPTIONS)
    adaln_before = compile_hooks.ADALN_ROWS
    try:
        if unknown:
            raise ValueError(f"unknown variant suffix {sorted(unknown)}; expected any of {sorted(SUFFIXES)}")
        inductor_config.coordinate_descent_tuning = "cdt" in extras or cdt_before
        if "mk" in extras:
            compile_hooks.QUANTIZED_INDUCTOR_OPTIONS["triton.multi_kernel"] = 1
        compile_hooks.ADALN_ROWS = (adaln_before or "adaln" in extras) and "noadaln" not in extras
        transformer.set_attention_backend(backend)
        if "fused" in extras:  # diffusers' one QKV GEMM per stream (before quantizing: the fused Linear is quantized)
            transformer.fuse_qkv_projections()
            fused = True
        t0 = time.perf_counter()
        mode = "max-autotune-no-cudagraphs" if "autotune" in extras else None
        handle = hookkit.enable(transformer, spec_for(args.quick, "mod" in extras, mode, fuse=fuse_for(extras),
                                                   real_rope="complex" not in extras,
                                                   norm_rope="nonormrope" not in extras))
        row["enable_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(args.warmup):  # compile, autotune, capture
            transformer(**inputs)
        bench.synchronize(device)
        row["warmup_s"] = time.perf_counter() - t0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = step_ms(transformer, inputs, args.runs, device)
        row.update(step_ms=statistics.median(times), step_ms_all=times)
        synced = synced_step_ms(transformer, inputs, args.runs, device)
        row.update(synced_step_ms=statistics.median(synced), synced_step_ms_all=synced)
        row["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
        compiled = handle.summary().features.get("compile")
        row["fp8_rows_fused"] = compiled.data.get("fp8_rows_fused") if compiled is not None else None
        row["fp8_rows_shared"] = compiled.data.get("fp8_rows_shared") if compiled is not None else None
        row["complex_muls_as_real"] = compiled.data.get("complex_muls_as_real") if compiled is not None else None
        row["norm_ropes_fused"] = compiled.data.get("norm_ropes_fused") if compiled is not None else None
        row.update(profile(transformer, inputs, args.profile_calls, device))
        if args.size == 1024 and args.model == "flux" and not args.quick:
            row["floor_ms"] = FLOOR_MS_1024
            row["above_floor_pct"] = 100.0 * (row["step_ms"] / FLOOR_MS_1024 - 1.0)
    except Exception as exc:  # an uninstalled backend or a failing combination is a result
        traceback.print_exc(file=sys.stderr)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        row.update(status="failed", note=f"{type(exc).__name__}: {first}"[:300])
    finally:
        inductor_config.coordinate_descent_tuning = cdt_before
        compile_hooks.QUANTIZED_INDUCTOR_OPTIONS.clear()
        compile_hooks.QUANTIZED_INDUCTOR_OPTIONS.update(options_before)
        compile_hooks.ADALN_ROWS = adaln_before
        if handle is not None:
            handle.remove()
        if fused:
            transformer.unfuse_qkv_projections()
        torch._dynamo.reset()
        try:
            transformer.set_attention_backend("native")
        except Exception:  # noqa: BLE001 (best effort: the next variant sets its own)
            pass
    return row


def markdown(rows: list[dict[str, Any]]) -> str:
    groups = [g for g, _ in GROUPS] + ["other"]
    head = "| variant | step (ms) | kernels (ms) | " + " | ".join(groups) + " | launches | peak GB | note |"
    lines = [head, "|" + "---|" * (len(groups) + 6)]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['variant']} | — | — | " + " | ".join("—" for _ in groups) + f" | — | — | {r['note']} |")
            continue
        peak = f"{r['peak_memory_gb']:.2f}" if r.get("peak_memory_gb") is not None else "—"
        lines.append(f"| {r['variant']} | {r['step_ms']:.2f} | {r['kernel_ms']:.2f} | "
                     + " | ".join(f"{r['groups_ms'][g]:.2f}" for g in groups)
                     + f" | {r['launches_per_call']:.0f} | {peak} | |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--model", default="flux", choices=("flux", "qwenimage", "wan"),
                   help="Flux-dev (the 87 ms floor at 1024² is Flux's), Qwen-Image or Wan 2.1 1.3B (size² frames; no "
                        "floor computed)")
    p.add_argument("--variants", default=DEFAULT_VARIANTS,
                   help="comma-separated attention backends, each with optional suffixes: "
                        + "; ".join(f"'+{k}' {v}" for k, v in SUFFIXES.items()))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--runs", type=int, default=20, help="timed transformer calls per variant (median)")
    p.add_argument("--profile-calls", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="CPU check: the tiny model, int8 weight-only, no graphs")
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = p.parse_args()
    if args.quick:
        args.variants = "native,native+mod,native+fused,_native_math,flash" if args.variants == DEFAULT_VARIANTS else args.variants
        args.runs, args.profile_calls, args.warmup = min(args.runs, 3), min(args.profile_calls, 2), 1
        opts = bench.ModelOptions(name=args.model, steps=1)
    else:
        bench.require_cuda("step_profile.py", "--quick checks the script on the CPU with the tiny model.")
        opts = bench.ModelOptions(name=args.model, full=True, steps=1, height=args.size, width=args.size)
    device = bench.resolve_device(opts.device)
    pipe = bench.load_pipeline(opts)
    inputs = capture_inputs(pipe, opts)
    transformer = pipe.transformer
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = dict(script="benchmarks/step_profile.py", argv=sys.argv[1:],
                               environment=bench.environment(device), size=args.size, quick=args.quick,
                               model=args.model,
                               floor_ms=FLOOR_MS_1024 if (args.size, args.model, args.quick) == (1024, "flux", False) else None,
                               groups=[g for g, _ in GROUPS] + ["other"], rows=[])
    for variant in [v.strip() for v in args.variants.split(",") if v.strip()]:
        with torch.no_grad():  # as the pipeline calls it (fp8's `_scaled_mm` has no derivative)
            row = run_variant(variant, transformer, inputs, args, device)
        doc["rows"].append(row)
        (out_dir / "step_profile.json").write_text(bench.to_json(doc, indent=2) + "\n")  # streaming: every row
        status = f"{row['step_ms']:.2f} ms/step" if row["status"] == "ok" else row["note"]
        print(f"[step_profile] {variant}: {status}", file=sys.stderr, flush=True)
    table = markdown(doc["rows"])
    (out_dir / "step_profile.md").write_text(table + "\n")
    print(table)
    return 0 if any(r["status"] == "ok" for r in doc["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
