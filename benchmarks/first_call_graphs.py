"""What the first-call adapter check costs under whole-transformer CUDA graphs: per-call times of the first generations.

    python benchmarks/first_call_graphs.py [--quick] [--size 1024] [--steps 8] [--out DIR]

Under `Compile(cuda_graphs="transformer")` the first transformer call after enable runs eagerly while the check
observes every block (`hookkit.core.graphs.EagerCalls`); the graphs are warmed up and captured at the next call.
This script times every transformer call (CUDA-synchronized wall time) of three generations on a bare Flux
transformer (full-size architecture, random weights, bf16; `--quick`: the tiny zoo Flux) under graphs, and of two
generations in eager mode (where call 0 is the checked call, call 1 the same work unobserved), and reports the
summary's capture, eager-call and invalidation counts. Writes JSON to $OUT (default ./out)/first_call_graphs.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

import hookkit
from hookkit.tools import zoo


def build(quick: bool) -> torch.nn.Module:
    if quick:
        return zoo.tiny_transformer("flux").to("cuda", torch.bfloat16)
    from diffusers import FluxTransformer2DModel

    with torch.device("cuda"):
        return FluxTransformer2DModel(guidance_embeds=True).to(torch.bfloat16)


def inputs(transformer: torch.nn.Module, size: int, text_tokens: int) -> dict[str, Any]:
    config = transformer.config
    tokens = (size // 16) ** 2
    g = torch.Generator("cuda").manual_seed(0)
    randn = lambda *shape: torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    return dict(hidden_states=randn(1, tokens, config.in_channels),
                encoder_hidden_states=randn(1, text_tokens, config.joint_attention_dim),
                pooled_projections=randn(1, config.pooled_projection_dim),
                timestep=torch.full((1,), 0.5, device="cuda", dtype=torch.bfloat16),
                img_ids=torch.zeros(tokens, 3, device="cuda", dtype=torch.bfloat16),
                txt_ids=torch.zeros(text_tokens, 3, device="cuda", dtype=torch.bfloat16),
                guidance=torch.full((1,), 3.5, device="cuda", dtype=torch.bfloat16), return_dict=False)


def generation(handle: hookkit.Handle, transformer: torch.nn.Module, kwargs: dict[str, Any], steps: int) -> list[float]:
    """Seconds per transformer call of one generation."""
    times = []
    with handle.generation(num_steps=steps), torch.no_grad():
        for _ in range(steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            transformer(**kwargs)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny zoo Flux, 4 steps")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("first_call_graphs.py needs a CUDA device (it times CUDA-graph capture)")
    steps, size, text = (4, 64, 8) if args.quick else (args.steps, args.size, 512)
    transformer = build(args.quick)
    kwargs = inputs(transformer, size, text)
    result: dict[str, Any] = {"quick": args.quick, "size": size, "steps": steps, "device": torch.cuda.get_device_name()}

    handle = hookkit.enable(transformer, hookkit.Spec())  # eager: call 0 is checked, call 1 is not
    result["eager_s"] = [generation(handle, transformer, kwargs, steps) for _ in range(2)]
    handle.remove()

    handle = hookkit.enable(transformer, hookkit.Spec(compile=hookkit.Compile(cuda_graphs="transformer")))
    result["graphs_s"] = [generation(handle, transformer, kwargs, steps) for _ in range(3)]
    data = handle.summary().features["compile"].data
    result.update(first_call=handle.summary().first_call, graphs_captured=data["graphs_captured"],
                  eager_calls=data["eager_calls"], graph_invalidations=data["graph_invalidations"])
    handle.remove()

    eager, graphs = result["eager_s"], result["graphs_s"]
    result["check_overhead_eager_s"] = eager[0][0] - eager[1][0]  # the checked call vs the same call unobserved
    print(f"eager:  checked call {eager[0][0] * 1e3:.1f} ms, unobserved {eager[1][0] * 1e3:.1f} ms")
    print(f"graphs: call 0 (eager, checked) {graphs[0][0]:.2f} s, call 1 (warm-up + capture) {graphs[0][1]:.2f} s, "
          f"replay {graphs[2][0] * 1e3:.1f} ms; captured {data['graphs_captured']}, eager calls "
          f"{data['eager_calls']}, invalidations {data['graph_invalidations']}, first call {result['first_call']}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "first_call_graphs.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
