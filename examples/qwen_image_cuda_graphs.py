"""Qwen-Image with CUDA graphs and no model edits, and memoized index tensors.

Stock regional `mode="reduce-overhead"` fails on Qwen-Image with "accessing tensor output of CUDAGraphs
that has been overwritten" unless the modeling code clones its inputs. hookkit marks the transformer-call
boundary outside the compiled blocks instead, and `cuda_graphs="transformer"` captures one CUDA graph per
transformer call signature. Qwen-Image with `zero_cond_t=True` also rebuilds `modulate_index` with `torch.tensor(list, device=cuda)` at every
step (a synchronizing copy); `Spec(memo=True)` builds it once.

On a CUDA device this example runs both CUDA-graph variants and times them against the plain pipeline.
On the CPU it prints the plan hookkit would attach (pure data), shows the error a GPU-only option gives
here, and runs the memoization, which works anywhere. Tiny model from config, random weights, no downloads.

    python examples/qwen_image_cuda_graphs.py [--steps 8]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

import hookkit
from hookkit.tools import zoo
from hookkit.errors import UnsupportedError


def call_kwargs(steps: int, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    kwargs = zoo.call_kwargs("qwenimage", steps=steps)  # latents out: the VAE is not what this is about
    return {k: (v.to(device, dtype) if v.is_floating_point() else v.to(device)) if isinstance(v, torch.Tensor) else v
            for k, v in kwargs.items()}


def run(pipe: Any, steps: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, float]:
    kwargs = call_kwargs(steps, device, dtype)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    latents = pipe(**kwargs).images
    if device.type == "cuda":
        torch.cuda.synchronize()
    return latents, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    # zero_cond_t=True: the code path that rebuilds modulate_index from a Python list every step
    pipe = zoo.tiny_pipeline("qwenimage", zero_cond_t=True)
    if cuda:
        pipe.to(device, dtype)

    reduce_overhead = hookkit.Spec(compile=hookkit.Compile(regional=True, mode="reduce-overhead"), memo=True)
    graphs = hookkit.Spec(compile=hookkit.Compile(regional=True, cuda_graphs="transformer"), memo=True)
    plan = hookkit.build_plan(pipe, reduce_overhead)
    print("plan for Spec(compile=Compile(regional=True, mode='reduce-overhead'), memo=True):")
    for target, name in plan.targets():
        print(f"  {name:28s} on {target or '<transformer>'}")

    run(pipe, args.steps, device, dtype)  # warm-up, untimed
    reference, t_plain = run(pipe, args.steps, device, dtype)
    if cuda:
        variants = {"reduce-overhead + memo": reduce_overhead, "cuda_graphs='transformer'": graphs}
    else:
        try:
            hookkit.build_plan(pipe, graphs)
        except UnsupportedError as exc:
            print(f"cuda_graphs='transformer' on this machine: UnsupportedError: {exc}")
        print("no CUDA device: on one, this example would time both CUDA-graph variants; running Spec(memo=True)")
        variants = {"memo": hookkit.Spec(memo=True)}

    for label, spec in variants.items():
        handle = hookkit.enable(pipe, spec)
        run(pipe, args.steps, device, dtype)  # warm-up: compilation and graph capture happen here
        out, seconds = run(pipe, args.steps, device, dtype)
        summary = handle.summary()
        print(summary)
        memo = summary.features.get("memo")
        if memo is not None:
            print(f"memoized index tensors: {memo.data['hits']} hits, {memo.data['misses']} misses "
                  f"in {summary.generations} calls of {args.steps} steps")
        same = "bitwise equal" if torch.equal(out, reference) else \
            f"max abs diff {(out.float() - reference.float()).abs().max().item():.3g}"
        timing = f"{seconds:.4f} s vs plain {t_plain:.4f} s ({t_plain / seconds:.2f}x)" if cuda else \
            "(CPU timings of a tiny model measure nothing; run on a GPU)"
        print(f"{label}: {timing}; output vs plain: {same}")
        hookkit.disable(pipe)

    after, _ = run(pipe, args.steps, device, dtype)
    print(f"bitwise equal to the plain run after hookkit.disable: {torch.equal(after, reference)}")


if __name__ == "__main__":
    main()
