"""Flux, fast: DBCache + (on a GPU) fp8 quantization and whole-transformer CUDA graphs, then an exact undo.

Runs anywhere with no downloads: a tiny Flux pipeline built from config with random weights (on the CPU),
fed random prompt embeddings. On a CUDA GPU it adds regional `torch.compile` with one CUDA graph per
transformer call and cache decision, and on an SM89+ one (H100/H200, RTX 4090) also torchao fp8 dynamic
per-row quantization; elsewhere it says what it would add. That is the fastest combination measured on an
H200 (BENCHMARKS.md: full-size Flux-dev 1024², 28 steps, 1.14 s against 4.84 s eager).

The cache runs on the static "fast" step mask (cache-dit's, step for step: 11 of 28 steps computed, the rest reuse
the cached residual of the middle blocks), the steps BENCHMARKS.md's peer rows compute. The default
`hookkit.DBCache()` is decided before the call too (half of the steps, every block skipped on the others), so it
runs under whole-transformer graphs as well; a threshold rule decides at each step and runs as split graphs.

    python examples/flux_fast.py [--steps 28]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

import hookkit
from hookkit.tools import zoo


def call_kwargs(steps: int, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """Random prompt embeddings and a fresh seeded generator: every call gives the same output."""
    kwargs = zoo.call_kwargs("flux", steps=steps, output_type="pt")
    return {k: v.to(device, dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
            for k, v in kwargs.items()}


def timed(pipe: Any, kwargs: dict[str, Any]) -> tuple[torch.Tensor, float]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    images = pipe(**kwargs).images
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return images, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=28)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    pipe = zoo.tiny_pipeline("flux")
    if cuda:
        pipe.to(device, dtype)

    # static mask, no TaylorSeer: every decision is known before the call, as whole-transformer graphs need
    cache = hookkit.DBCache(fn_blocks=1, bn_blocks=0, warmup_steps=0, steps_mask="fast", mask_policy="static",
                            taylorseer_order=0)
    quantize = compile_ = None
    fp8_ok = cuda and torch.cuda.get_device_capability() >= (8, 9)
    if fp8_ok:
        # keep_original="cpu": hookkit.disable() can then put the bf16 weights back.
        quantize = hookkit.Quantize(scheme="fp8_row", keep_original="cpu")
    else:
        print("no SM89+ CUDA device: on one, this example would add "
              "hookkit.Quantize(scheme='fp8_row', keep_original='cpu')")
    if cuda:
        compile_ = hookkit.Compile(regional=True, cuda_graphs="transformer")
    else:
        print("no CUDA device: on one, this example would add hookkit.Compile(regional=True, "
              "cuda_graphs='transformer') (torch.compile of the repeated Flux blocks, one CUDA graph per "
              "transformer call and cache decision)")
    spec = hookkit.Spec(cache=cache, quantize=quantize, compile=compile_)

    timed(pipe, call_kwargs(args.steps, device, dtype))  # warm-up: lazy initialisation, untimed
    reference, t_plain = timed(pipe, call_kwargs(args.steps, device, dtype))
    handle = hookkit.enable(pipe, spec)
    timed(pipe, call_kwargs(args.steps, device, dtype))  # warm-up: compilation happens here
    fast, t_fast = timed(pipe, call_kwargs(args.steps, device, dtype))
    summary = handle.summary()
    print(summary)
    cached = summary.features["cache"].data["branches"][0]["cached"]
    print(f"cached steps: {len(cached)} of {args.steps}: {cached}")

    mse = torch.mean((fast.double() - reference.double()) ** 2).item()
    psnr = float("inf") if mse == 0 else 10 * torch.log10(torch.tensor(1.0 / mse)).item()
    print(f"plain: {t_plain:.3f} s, hookkit: {t_fast:.3f} s ({t_plain / t_fast:.2f}x); PSNR vs plain: {psnr:.2f} dB")

    hookkit.disable(pipe)
    after, _ = timed(pipe, call_kwargs(args.steps, device, dtype))
    print(f"bitwise equal to the plain run after hookkit.disable: {torch.equal(after, reference)}")


if __name__ == "__main__":
    main()
