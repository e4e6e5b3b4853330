"""CogVideoX without host syncs in the denoising loop, and a regional-compilation plan it cannot make stock.

CogVideoX's loop hands a CUDA timestep to a DDIM scheduler whose tables live on the CPU: every lookup, and
dynamic CFG's `t.item()`, waits for the GPU to drain its queue (3-4 a step on CogVideoX-2b on an H200: BENCHMARKS.md). `Spec(sync_free=True)`
answers those reads from a host copy of the schedule: same values, same output, no stall. And
`CogVideoXTransformer3DModel` has no `_repeated_blocks`, so stock `compile_repeated_blocks()` refuses;
hookkit's adapter names the repeated block class, so `Compile(regional=True)` finds one region per block. This
example shows that plan (`hookkit.build_plan`, nothing attached) and runs no compiled call: compiling takes
minutes on a CPU. `hookkit generate cogvideox --compile` (or `hookkit bench --configs eager,hookkit-compile`)
runs it.

On a CUDA device the example counts host syncs with `hookkit.profile_syncs` (sync debug mode), with and
without hookkit. On the CPU there is no device queue to wait for: it runs the same hooks, checks the output is
bitwise equal and prints what hookkit answered from the host. Tiny model from config, no downloads.

    python examples/cogvideox_sync_free.py [--steps 6]
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

import hookkit
from hookkit.tools import zoo


def call_kwargs(steps: int, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    kwargs = zoo.call_kwargs("cogvideox", steps=steps, use_dynamic_cfg=True)  # dynamic CFG reads t.item()
    return {k: v.to(device, dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
            for k, v in kwargs.items()}


def run(pipe: Any, steps: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, Any]:
    """The pipeline's output and, on CUDA, hookkit's host-sync report of the call (None on the CPU)."""
    kwargs = call_kwargs(steps, device, dtype)
    if device.type != "cuda":
        return pipe(**kwargs).frames, None
    report = hookkit.profile_syncs(pipe, **kwargs)  # syncs per step and per place, steps 1..N-1
    return report.output.frames, report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    pipe = zoo.tiny_pipeline("cogvideox")
    if cuda:
        pipe.to(device, dtype)

    # 1. Regional compilation: stock diffusers needs `_repeated_blocks`, hookkit's adapter supplies them.
    print(f"{type(pipe.transformer).__name__}._repeated_blocks = {pipe.transformer._repeated_blocks!r}")
    try:
        pipe.transformer.compile_repeated_blocks(fullgraph=True)
    except ValueError as exc:
        print(f"stock compile_repeated_blocks: ValueError: {str(exc).splitlines()[0]}")
    adapter = hookkit.get_adapter("cogvideox")
    plan = hookkit.build_plan(pipe, hookkit.Spec(compile=hookkit.Compile(regional=True)))
    regions = [target for target, _ in plan.targets("compile")]
    print(f"hookkit adapter repeated_blocks = {list(adapter.repeated_blocks)}: Compile(regional=True) compiles {regions}")

    # 2. The sync-free loop.
    reference, syncs_plain = run(pipe, args.steps, device, dtype)
    handle = hookkit.enable(pipe, hookkit.Spec(sync_free=True))
    out, syncs_free = run(pipe, args.steps, device, dtype)
    summary = handle.summary()
    print(summary)
    data = summary.features["sync_free"].data
    print(f"sync-free: {data['scheduler']} with CPU tables mapped: {data['cpu_tables']}; "
          f"timestep reads answered on the host: {data['host_reads']}")
    if cuda:
        print(f"stock:\n{syncs_plain}\nsync-free:\n{syncs_free}")
        print(f"host syncs after step 0: stock {syncs_plain.total}, sync-free {syncs_free.total}")
    else:
        print("no CUDA device: on one, this example would count host syncs per step and place with "
              "hookkit.profile_syncs(pipe, ...), stock vs sync-free")
    print(f"sync-free output vs plain: {'bitwise equal' if torch.equal(out, reference) else 'different'}")
    hookkit.disable(pipe)
    after, _ = run(pipe, args.steps, device, dtype)
    print(f"bitwise equal to the plain run after hookkit.disable: {torch.equal(after, reference)}")


if __name__ == "__main__":
    main()
