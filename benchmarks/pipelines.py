"""The pipelines people run, on the full-size architectures with random weights, bf16, batch 1.

    python benchmarks/pipelines.py                      # all three parts, full settings
    python benchmarks/pipelines.py --quick              # fewer steps and runs, smaller sizes: a fast check
    python benchmarks/pipelines.py --parts wan22 --runs 5
    python benchmarks/pipelines.py --cpu-smoke          # CPU: checks the script end to end with the tiny models

A part that fails records its error (and traceback) in the JSON and prints the traceback to stderr; the other parts run.

Parts (`--parts`, default all):
  wan22       Wan 2.2 A14B layout: two WanTransformer3DModel experts (40 layers, 40 heads x 128, ffn 13824, text 4096),
              boundary_ratio 0.875, the shortest video (5 frames, 480x832), CFG as two calls per step. Stock eager vs
              hookkit DBCache F1B0 on the static "fast" mask + regional compile, both experts hooked by one
              `hookkit.enable(pipe, spec)`; per-expert cached steps from the summary.
  controlnet  Flux-dev 1024² with a FluxControlNetModel (4 double + 10 single layers, `from_transformer`'s default;
              its zero-initialised output projections get Linear's default init, so its residuals are not zero):
              uncached vs DBCache on the "fast" mask (eager), the ControlNet residuals counted once.
              `--cpu-smoke` runs this part on the same structure (19 + 38 blocks, the 8x VAE) at tiny widths.
  resolutions regional compile over 5 resolutions (Flux-dev): automatic dynamic shapes (hookkit's default
              `Compile(dynamic=None)`) vs a fixed-shape compile per resolution (`torch._dynamo.reset()`, then
              `Compile(dynamic=False)`): graphs compiled, first-call seconds and median per-call latency.

Random weights never pass a dynamic threshold, so caching runs on a static mask: this measures what caching costs and
saves, not image quality. Writes `$OUT/pipelines.json` (default ./out), one record per measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch

import hookkit
from hookkit.tools import zoo
from hookkit.tools.bench import psnr, timed

WAN22_A14B = dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16,
                  out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
                  qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
FLUX_CONTROLNET_LAYERS = (4, 10)  # double, single


def cache_spec() -> hookkit.DBCache:
    return hookkit.DBCache(fn_blocks=1, bn_blocks=0, steps_mask="fast", mask_policy="static", taylorseer_order=0)


def median_run(call: Callable[[], Any], runs: int, device: torch.device) -> tuple[float, list[float], Any]:
    times, out = [], None
    for _ in range(runs):
        seconds, out = timed(call, device)
        times.append(round(seconds, 4))
    return statistics.median(times), times, out


def latents(out: Any) -> torch.Tensor:
    return out.frames if hasattr(out, "frames") else out.images


def cached_steps(summary: Any) -> dict[str, dict[int, list[int]]]:
    """Per transformer (pipe attribute) and CFG branch: the cached steps."""
    out = {}
    for s in (summary, *summary.companions):
        cache = s.features.get("cache")
        if cache is not None:
            out[s.component or "transformer"] = {b: d["cached"] for b, d in cache.data["branches"].items()}
    return out


# --- pipelines ------------------------------------------------------------------------------------------------


def building(device: torch.device) -> Any:
    """Build full-size models directly on the GPU. Only around construction: calls under a `torch.device` context
    run a TorchFunctionMode that Dynamo cannot trace through (`super().unflatten()`)."""
    return torch.device(device) if device.type == "cuda" else contextlib.nullcontext()


def wan22_pipeline(smoke: bool) -> Any:
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline

    if smoke:
        return zoo.tiny_variant("wan22")
    vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True]).eval()  # the real 8x spatial, 4x temporal factors
    experts = [zoo.full_transformer("wan", **WAN22_A14B) for _ in range(2)]
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=12.0)
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=vae, scheduler=scheduler, transformer=experts[0],
                       transformer_2=experts[1], boundary_ratio=0.875)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def wan22_kwargs(smoke: bool, steps: int, device: str, quick: bool) -> dict[str, Any]:
    if smoke:
        return zoo.variant_call_kwargs("wan22", steps=steps)
    g = torch.Generator().manual_seed(1234)
    emb = lambda: torch.randn(1, 512, 4096, generator=g).to(device, torch.bfloat16)  # noqa: E731
    height, width = (240, 416) if quick else (480, 832)
    return dict(prompt_embeds=emb(), negative_prompt_embeds=emb(), height=height, width=width, num_frames=5,
                num_inference_steps=steps, guidance_scale=4.0, guidance_scale_2=3.0, output_type="latent",
                generator=torch.Generator(device=device).manual_seed(0))


def flux_controlnet_pipeline(smoke: bool) -> Any:
    """Flux-dev + a ControlNet; `smoke`: the same structure at tiny widths (the code path the GPU runs)."""
    return zoo.full_controlnet_pipeline(*FLUX_CONTROLNET_LAYERS, narrow=smoke)


def flux_controlnet_kwargs(smoke: bool, steps: int, size: int, device: str) -> dict[str, Any]:
    dtype = torch.float32 if smoke else torch.bfloat16
    kw = zoo.full_call_kwargs("flux", steps=steps, height=size, width=size, device=device, dtype=dtype, narrow=smoke)
    g = torch.Generator().manual_seed(7)
    kw.update(control_image=torch.rand(1, 3, size, size, generator=g).to(device, dtype),
              controlnet_conditioning_scale=0.7)
    return kw


# --- parts ----------------------------------------------------------------------------------------------------


def part_wan22(opts: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    with building(device):
        pipe = wan22_pipeline(opts.cpu_smoke)
    kw = lambda: wan22_kwargs(opts.cpu_smoke, opts.steps, str(device), opts.quick)  # noqa: E731
    eager_s, eager_times, ref = median_run(lambda: pipe(**kw()), opts.runs, device)
    spec = hookkit.Spec(cache=cache_spec(), compile=hookkit.Compile(backend=opts.backend))
    handle = hookkit.enable(pipe, spec)
    try:
        warm_s, _ = timed(lambda: pipe(**kw()), device)
        fast_s, fast_times, out = median_run(lambda: pipe(**kw()), opts.runs, device)
        summary = handle.summary()
    finally:
        handle.remove()
    return [{"part": "wan22", "steps": opts.steps, "eager_s": eager_s, "eager_times": eager_times,
             "hookkit_cache_compile_s": fast_s, "hookkit_times": fast_times, "warmup_s": round(warm_s, 2),
             "speedup": round(eager_s / fast_s, 3), "psnr_db": psnr(latents(ref).float(), latents(out).float()),
             "cached_steps": cached_steps(summary),
             "peak_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None}]


def part_controlnet(opts: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    with building(device):
        pipe = flux_controlnet_pipeline(opts.cpu_smoke)
    size = 64 if opts.cpu_smoke else 512 if opts.quick else 1024
    kw = lambda: flux_controlnet_kwargs(opts.cpu_smoke, opts.steps, size, str(device))  # noqa: E731
    uncached_s, uncached_times, ref = median_run(lambda: pipe(**kw()), opts.runs, device)
    handle = hookkit.enable(pipe, hookkit.Spec(cache=cache_spec()))
    try:
        timed(lambda: pipe(**kw()), device)
        cached_s, cached_times, out = median_run(lambda: pipe(**kw()), opts.runs, device)
        summary = handle.summary()
    finally:
        handle.remove()
    data = summary.features["cache"].data
    return [{"part": "controlnet", "size": size, "steps": opts.steps, "uncached_s": uncached_s,
             "uncached_times": uncached_times, "cached_s": cached_s, "cached_times": cached_times,
             "speedup": round(uncached_s / cached_s, 3), "psnr_db": psnr(latents(ref).float(), latents(out).float()),
             "cached_steps": cached_steps(summary), "block_calls": data["block_calls"],
             "block_calls_uncached": data["block_calls_uncached"]}]


def part_resolutions(opts: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    from torch._dynamo.utils import counters

    if opts.cpu_smoke:
        pipe, sizes = zoo.tiny_pipeline("flux"), [16, 24, 32, 40, 48]
        kw = lambda s: zoo.call_kwargs("flux", steps=opts.steps, height=s, width=s)  # noqa: E731
    else:
        with building(device):
            pipe = zoo.full_pipeline("flux")
        sizes = [256, 384, 512, 640, 768] if opts.quick else [512, 640, 768, 896, 1024]
        kw = lambda s: zoo.full_call_kwargs("flux", steps=opts.steps, height=s, width=s, device=str(device))  # noqa: E731
    records = []
    for label, dynamic, reset_each in (("automatic dynamic", None, False), ("fixed shape", False, True)):
        torch._dynamo.reset()
        handle = hookkit.enable(pipe, hookkit.Spec(compile=hookkit.Compile(backend=opts.backend, dynamic=dynamic)))
        try:
            for size in sizes:
                if reset_each:  # a compile made for this one shape, as a user compiling per resolution gets
                    torch._dynamo.reset()
                counters.clear()
                first_s, _ = timed(lambda: pipe(**kw(size)), device)
                graphs = counters["stats"]["unique_graphs"]
                per_call, times, _ = median_run(lambda: pipe(**kw(size)), opts.runs, device)
                records.append({"part": "resolutions", "compile": label, "size": size, "steps": opts.steps,
                                "graphs_compiled": graphs, "first_call_s": round(first_s, 3), "per_call_s": per_call,
                                "times": times})
                print(json.dumps(records[-1]), flush=True)
        finally:
            handle.remove()
    return records


PARTS = {"wan22": part_wan22, "controlnet": part_controlnet, "resolutions": part_resolutions}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS))
    parser.add_argument("--quick", action="store_true", help="8 steps, 1 run, smaller sizes")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny models on the CPU: checks the script")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--runs", type=int, default=None)
    parser.add_argument("--backend", default=None, help="torch.compile backend (default inductor; eager on the CPU)")
    opts = parser.parse_args()
    smoke = opts.cpu_smoke
    opts.steps = opts.steps or (4 if smoke else 8 if opts.quick else 28)
    opts.runs = opts.runs or (1 if smoke or opts.quick else 3)
    opts.backend = opts.backend or ("eager" if smoke else "inductor")
    device = torch.device("cpu" if smoke else "cuda")
    if not smoke:
        torch.set_default_dtype(torch.bfloat16)
    out_dir = os.environ.get("OUT", "./out")
    os.makedirs(out_dir, exist_ok=True)
    records: list[dict[str, Any]] = []
    for name in opts.parts:
        try:
            records += PARTS[name](opts, device)
        except Exception as exc:  # keep what the other parts measured, and where this one failed
            trace = traceback.format_exc()
            print(trace, file=sys.stderr, flush=True)
            records.append({"part": name, "error": f"{type(exc).__name__}: {exc}", "traceback": trace})
        print(json.dumps(records[-1]), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        path = os.path.join(out_dir, "pipelines.json")
        with open(path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                       "torch": torch.__version__, "quick": opts.quick, "records": records}, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
