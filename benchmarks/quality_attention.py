"""Image quality of the low-precision attention kernels on hookkit's trained models, against the bf16 reference.

Runs `hookkit.tools.quality.run_quality` in bfloat16 on the GPU for the tiny and the deep trained Flux (6 and 4 heads
of 32): the reference is the uncached bf16 pipeline with torch's SDPA; each row reports PSNR / SSIM of the final
images against it and the fraction the shipped classifier still recognises. Seeds 100.. by default: no default of
`Attention` (its kernels, `full_first=2`, `full_last=2`) was chosen on them. Rows:

  int8-every-step       Attention(low_precision="hookkit_int8", full_first=0, full_last=0): int8 Q·Kᵀ at every step
  int8                  the same with the default schedule (bf16 on the first and last 2 steps)
  fp8-every-step        Attention(low_precision="hookkit_fp8", full_first=0, full_last=0): int8 Q·Kᵀ, e4m3 P·V
  fp8                   the same with the default schedule
  gemm-fp8              hookkit.Quantize("fp8_row") alone: what fp8 GEMMs cost, for scale
  gemm-fp8+fp8-every-step  fp8 GEMMs and fp8 attention at every step (what the video rows run)
  sage-every-step       sageattention's `sageattn` at every step (sageattention 1.0.6 takes heads of 64, 96 or 128:
                        a skipped row on these models, with its reason)
  flashinfer-fp8-every-step  FlashInfer's FA3 fp8 kernel (Attention(low_precision="flashinfer_fp8")) at every step:
                        a skipped row, with its reason (the kernel is taken on heads of 128 only; on these models'
                        heads of 32, zero-padded to 64, it erred 6-13x its own arithmetic; see attention_error.json)
  flashinfer-fp8        the same with the default schedule (skipped likewise)
  flashinfer-bf16       FlashInfer's FA3 bf16 kernel (Attention(kernel="flashinfer")) at every step
  (the FlashInfer rows need the `flashinfer` package and a Hopper GPU; skipped with their reason elsewhere)

Besides the images, `attention_error.json` holds each kernel's output error on the trained models' own attention
inputs: Q, K and V recorded at every SDPA call of one denoising run (class 0, the first seed), each kernel against
fp32 SDPA on them (mean relative error, max abs error; median and worst over the calls), FlashInfer's kernels
("flashinfer", and "flashinfer_fp8" called directly, its heads zero-padded) included when the package imports. The fp8
kernels also get "vs_own_arithmetic": the same error against their torch mirror on the same inputs
(`fp8_triton.reference`, `flashinfer_fa3.reference`), which a kernel computing what it should matches to rounding:
what separates a kernel's own error from its quantization's.

    python benchmarks/quality_attention.py                 # GPU (SM89+ for fp8): both models, 10 classes x 4 seeds
    python benchmarks/quality_attention.py --quick         # CPU check: 2 classes x 1 seed, 6 steps, tiny model;
                                                           # the CUDA kernels become "_native_math" (script checked,
                                                           # not the numbers)
    python benchmarks/quality_attention.py --arithmetic --models tiny,video   # CPU: hookkit_fp8's arithmetic

`--arithmetic` (CPU, no GPU needed): one row, "fp8-arithmetic-every-step", where every SDPA call is answered by
hookkit_fp8's torch mirror (`fp8_triton.reference`: the kernel's quantization of Q, K, V and P, which the kernel
matches to rounding on a GPU, `test_gpu_fp8_kernel_against_its_mirror_and_bf16_sdpa_at_wan_shape`), for models the
GPU rows do not cover (the trained video model) and, on "tiny", as a check against the kernel's own GPU row.

Writes $OUT/quality_attention/{tiny,deep}/{quality.md,quality.json} and attention_error.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import hookkit  # noqa: E402
from hookkit.tools import quality  # noqa: E402


#: why the FlashInfer fp8 image rows are skipped on these models
FLASHINFER_FP8_HEADS = ("flashinfer_fp8 takes heads of 128 only; the trained models' heads are 32 (zero-padded to 64, "
                        "its attention error on their inputs was 6-13x its own arithmetic's: attention_error.json)")


def configs(low: dict[str, str], quantize: hookkit.Quantize) -> list[quality.QualityConfig]:
    """The rows; `low` maps each kernel name to what runs it here (itself on a GPU, "_native_math" in --quick)."""
    S, QC, A = hookkit.Spec, quality.QualityConfig, hookkit.Attention

    def every(kernel: str) -> hookkit.Attention:
        return A(low_precision=low[kernel], full_first=0, full_last=0)

    return [
        QC(name="int8-every-step", family="int8", spec=S(attention=every("hookkit_int8")), x="every",
           description="hookkit_int8 at every step"),
        QC(name="int8", family="int8", spec=S(attention=A(low_precision=low["hookkit_int8"])), x="default",
           description="hookkit_int8, bf16 SDPA on the first and last 2 steps"),
        QC(name="fp8-every-step", family="fp8", spec=S(attention=every("hookkit_fp8")), x="every",
           description="hookkit_fp8 at every step"),
        QC(name="fp8", family="fp8", spec=S(attention=A(low_precision=low["hookkit_fp8"])), x="default",
           description="hookkit_fp8, bf16 SDPA on the first and last 2 steps"),
        QC(name="gemm-fp8", family="gemm", spec=S(quantize=quantize), x="gemm",
           description=f"Quantize({quantize.scheme!r}) alone"),
        QC(name="gemm-fp8+fp8-every-step", family="gemm", spec=S(quantize=quantize, attention=every("hookkit_fp8")),
           x="gemm+attention", description=f"Quantize({quantize.scheme!r}) + hookkit_fp8 at every step"),
        QC(name="sage-every-step", family="sage", spec=S(attention=every("sage")), requires="sageattention",
           x="every", description="sageattention's sageattn at every step",
           unsupported="sageattention 1.0.6 takes heads of 64, 96 or 128; the trained models' heads are 32"),
        QC(name="flashinfer-fp8-every-step", family="flashinfer", spec=S(attention=every("flashinfer_fp8")),
           requires="flashinfer", x="every", description="FlashInfer's FA3 fp8 kernel at every step",
           unsupported=FLASHINFER_FP8_HEADS),
        QC(name="flashinfer-fp8", family="flashinfer", spec=S(attention=A(low_precision=low["flashinfer_fp8"])),
           requires="flashinfer", x="default", unsupported=FLASHINFER_FP8_HEADS,
           description="FlashInfer's FA3 fp8 kernel, bf16 SDPA on the first and last 2 steps"),
        QC(name="flashinfer-bf16", family="flashinfer",
           spec=S(attention=A(kernel=low["flashinfer"], low_precision=None)), requires="flashinfer", x="bf16",
           description="FlashInfer's FA3 bf16 kernel at every step (heads padded)"),
    ]


def _sdpa_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """An SDPA call's arguments by name, as given positionally or by keyword."""
    return {**dict(zip(("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale"), args)), **kwargs}


def _error(got: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """(mean relative error, max abs error) of `got` against `expected`."""
    return ((got - expected).abs().mean() / expected.abs().mean()).item(), (got - expected).abs().max().item()


class RecordSDPA(TorchFunctionMode):
    """Keeps a float32 copy of (q, k, v, scale) of every SDPA call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, float | None]] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            bound = _sdpa_call(args, kwargs)
            q, k, v = (bound[n].detach().float().clone() for n in ("query", "key", "value"))
            self.calls.append((q, k, v, bound.get("scale")))
        return func(*args, **kwargs)


class MirrorSDPA(TorchFunctionMode):
    """Answers every SDPA call without a mask, dropout or causal flag by `fp8_triton.reference` (hookkit_fp8's
    arithmetic in torch); counts the calls it answered and the others, which run SDPA."""

    def __init__(self) -> None:
        super().__init__()
        self.answered = 0
        self.passed = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            from hookkit.techniques.attention import fp8_triton

            bound = _sdpa_call(args, kwargs)
            if bound.get("attn_mask") is None and not bound.get("dropout_p") and not bound.get("is_causal"):
                self.answered += 1
                return fp8_triton.reference(bound["query"], bound["key"], bound["value"], bound.get("scale"))
            self.passed += 1
        return func(*args, **kwargs)


def arithmetic_row(counts: list[MirrorSDPA]) -> quality.QualityConfig:
    """The `--arithmetic` row: `MirrorSDPA` entered for the row's pipeline calls (each entry appended to `counts`)."""

    def setup(pipe: Any) -> Any:
        mode = MirrorSDPA()
        mode.__enter__()
        counts.append(mode)
        return lambda: mode.__exit__(None, None, None)

    return quality.QualityConfig(name="fp8-arithmetic-every-step", family="fp8", setup=setup, x="every",
                                 description="hookkit_fp8's arithmetic (fp8_triton.reference) at every SDPA call")


def record_attention_inputs(model: str, steps: int, seed: int, device: str) -> list[tuple[Any, ...]]:
    """`(q, k, v, scale)` of every SDPA call of one denoising run of the trained `model` (class 0, `seed`), float32."""
    from hookkit.tools import trained

    pipe = trained.load_pipeline(model=model, device=device, dtype=torch.bfloat16)
    recorder = RecordSDPA()
    with recorder, torch.no_grad():
        pipe(**trained.call_kwargs([0], [seed], steps=steps, device=device, dtype=torch.bfloat16, model=model))
    return recorder.calls


def _summary(rel: list[float], worst: list[float]) -> dict[str, float]:
    return {"mean_rel_median": statistics.median(rel), "mean_rel_worst": max(rel),
            "max_abs_median": statistics.median(worst), "max_abs_worst": max(worst)}


def attention_error(model: str, kernels: dict[str, str], steps: int, seed: int, device: str) -> dict[str, Any]:
    """Each kernel's output error against fp32 SDPA on the attention inputs of one denoising run of `model`, and the
    fp8 kernels' against their own arithmetic (module docstring); `kernels` maps each name reported to the kernel that
    runs it."""
    from hookkit.techniques.attention import flashinfer_fa3, fp8_triton
    from hookkit.techniques.attention.hooks import run_kernel, unsupported

    calls = record_attention_inputs(model, steps, seed, device)
    out: dict[str, Any] = {"model": model, "calls": len(calls), "shape": list(calls[0][0].shape) if calls else None}
    mirrors = {"hookkit_fp8": fp8_triton.reference, "flashinfer_fp8": flashinfer_fa3.reference_attention}
    for name, kernel in kernels.items():
        rel, worst, own, own_worst = [], [], [], []
        reason = None
        if kernel.startswith("flashinfer") and importlib.util.find_spec("flashinfer") is None:
            out[name] = {"unsupported": "flashinfer is not installed"}
            continue
        mirror = mirrors.get(kernel)  # None where --quick runs another kernel in its place
        for q, k, v, scale in calls:
            ref = F.scaled_dot_product_attention(q, k, v, scale=scale)
            args = tuple(t.to(torch.bfloat16) for t in (q, k, v))
            if kernel == "flashinfer_fp8":  # called directly: `Attention` refuses these models' heads of 32
                got = flashinfer_fa3.attention(*args, scale).float()
            else:
                reason = unsupported(kernel, {"query": args[0], "key": args[1], "value": args[2], "attn_mask": None,
                                              "dropout_p": 0.0, "is_causal": False, "scale": scale,
                                              "enable_gqa": False})
                if reason is not None:
                    break
                got = run_kernel(kernel, F.scaled_dot_product_attention, args, {"scale": scale}).float()
            mean, top = _error(got, ref)
            rel.append(mean)
            worst.append(top)
            if mirror is not None:
                mean, top = _error(got, mirror(*args, scale).float())
                own.append(mean)
                own_worst.append(top)
        if reason is not None:
            out[name] = {"unsupported": reason}
            continue
        out[name] = _summary(rel, worst)
        if own:
            out[name]["vs_own_arithmetic"] = _summary(own, own_worst)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=28)
    p.add_argument("--seeds", type=int, default=4, help="how many seeds (default 4)")
    p.add_argument("--first-seed", type=int, default=100, help="the first seed (default 100: held out)")
    p.add_argument("--models", default="tiny,deep", help="comma-separated trained models (default tiny,deep)")
    p.add_argument("--quick", action="store_true", help="CPU check: tiny model, 2 classes x 1 seed, 6 steps")
    p.add_argument("--only", default=None, help="comma-separated row names (default: every row)")
    p.add_argument("--arithmetic", action="store_true",
                   help="CPU: hookkit_fp8's arithmetic (its torch mirror) at every step, the one row (docstring)")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "out"), "quality_attention"))
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    if args.arithmetic:
        return arithmetic(args)
    if not args.quick and not cuda:
        raise SystemExit("quality_attention.py: hookkit's attention kernels need a CUDA GPU (fp8: SM89+); --quick "
                         "checks the script on the CPU.")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)  # before any model runs: a bad --out fails now
    on_gpu = cuda and not args.quick
    steps = 6 if args.quick else args.steps
    classes = [0, 5] if args.quick else None
    seeds = range(args.first_seed, args.first_seed + (1 if args.quick else args.seeds))
    models = ["tiny"] if args.quick else args.models.split(",")
    names = ("hookkit_int8", "hookkit_fp8", "sage", "flashinfer_fp8", "flashinfer")
    low = {k: (k if on_gpu else "_native_math") for k in names}
    quantize = hookkit.Quantize(scheme="fp8_row" if on_gpu else "fp8_weight_only", keep_original="device")
    rows = quality.only_rows(configs(low, quantize), args.only, "quality_attention.py")
    errors = []
    for model in models:
        report = quality.run_quality(rows, classes=classes, seeds=seeds, steps=steps,
                                     device="cuda" if on_gpu else "cpu", dtype=torch.bfloat16, model=model,
                                     log=lambda m: print(m, file=sys.stderr, flush=True))
        report.write(out / model, plot=False)
        print(f"## {model}\n\n{report.markdown()}\n")
        error_kernels = {k: low[k] for k in ("hookkit_int8", "hookkit_fp8", "flashinfer", "flashinfer_fp8")}
        errors.append(attention_error(model, error_kernels, steps, seeds[0], "cuda" if on_gpu else "cpu"))
    (out / "attention_error.json").write_text(json.dumps(errors, indent=1))
    print(json.dumps(errors, indent=1))
    return 0


def mirror_error(model: str, steps: int, seed: int) -> dict[str, Any]:
    """hookkit_fp8's mirror's output error against fp32 SDPA on the attention inputs of one denoising run of `model`
    on the CPU (`attention_error`'s measure, for the mirror in place of the kernel)."""
    from hookkit.techniques.attention import fp8_triton

    calls = record_attention_inputs(model, steps, seed, "cpu")
    rel, worst = [], []
    for q, k, v, scale in calls:
        ref = F.scaled_dot_product_attention(q, k, v, scale=scale)
        mean, top = _error(fp8_triton.reference(*(t.to(torch.bfloat16) for t in (q, k, v)), scale).float(), ref)
        rel.append(mean)
        worst.append(top)
    return {"model": model, "calls": len(calls), "shape": list(calls[0][0].shape), "mirror": _summary(rel, worst)}


def arithmetic(args: argparse.Namespace) -> int:
    """`--arithmetic`: the mirror row on the CPU in bfloat16, per model; writes quality.md/.json per model,
    arithmetic_calls.json (how many SDPA calls the mirror answered per model, and how many ran SDPA) and
    arithmetic_error.json (`mirror_error` of each model, on its first seed)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    calls, errors = {}, []
    for model in args.models.split(","):
        counts: list[MirrorSDPA] = []
        report = quality.run_quality([arithmetic_row(counts)], seeds=seeds, steps=args.steps, device="cpu",
                                     dtype=torch.bfloat16, model=model,
                                     log=lambda m: print(m, file=sys.stderr, flush=True))
        report.write(out / model, plot=False)
        calls[model] = {"answered": sum(c.answered for c in counts), "ran_sdpa": sum(c.passed for c in counts)}
        errors.append(mirror_error(model, args.steps, seeds[0]))
        print(f"## {model}\n\n{report.markdown()}\n{json.dumps(calls[model])}\n{json.dumps(errors[-1])}\n",
              flush=True)
    (out / "arithmetic_calls.json").write_text(json.dumps(calls, indent=1))
    (out / "arithmetic_error.json").write_text(json.dumps(errors, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
