"""Host time per transformer call under whole-transformer CUDA graphs, measured on the CPU.

A replayed CUDA graph runs no Python: what a graph-served step costs the host is hookkit's hooks (the model watch,
the graph key, the cache's decision), the pipeline's loop and the scheduler. Where the GPU's work per step is
short (DBCache's cached steps: one block; small sizes) that host time is the step's time (BENCHMARKS.md, "Host
time of a graph-served call"). This runs the real
`Compile(cuda_graphs="transformer")` feature on the CPU with a capture whose replay does nothing, on Flux-dev's and
Qwen-Image's block counts at tiny widths (the host path scales with modules and tensors, not with widths), Flux with
and without memo (its torch-function mode is active around the whole call; Qwen-Image needs memo under graphs), and
prints the median host time per graph-served call.

    python benchmarks/graph_host_cost.py [--models flux,qwenimage] [--calls 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import hookkit
from hookkit.techniques.compile import hooks as compile_hooks
from hookkit.tools import zoo

STEPS = 28
#: full-size block counts (Flux-dev: 19 double + 38 single blocks; Qwen-Image: 60)
LAYERS: dict[str, dict[str, int]] = {"flux": dict(num_layers=19, num_single_layers=38), "qwenimage": dict(num_layers=60)}


class NoReplayBackend:
    """A stand-in for `CudaGraphBackend` whose replay runs nothing, as a CUDA graph replay runs no Python."""

    def memory_in_use(self) -> int:
        return 0

    def capture(self, fn: Any) -> tuple[Any, Any]:
        fn()
        return (lambda: None), fn()


def host_ms_per_call(name: str, memo: bool, calls: int) -> dict[str, Any]:
    """Median host ms per graph-served transformer call of a 28-step call, after the captures (2 calls)."""
    pipe = zoo.tiny_pipeline(name, **LAYERS[name])
    spec = hookkit.Spec(cache=hookkit.DBCache(fn_blocks=1, bn_blocks=0, warmup_steps=0, steps_mask="fast",
                                              mask_policy="static", taylorseer_order=0),
                        compile=hookkit.Compile(cuda_graphs="transformer", backend="eager"), memo=memo)
    marks: list[float] = []
    hook = pipe.transformer.register_forward_pre_hook(lambda m, a, k: marks.append(time.perf_counter()),
                                                      with_kwargs=True)
    handle = hookkit.enable(pipe, spec)
    try:
        for _ in range(2):  # the first-call check, then the captures
            pipe(**zoo.call_kwargs(name, steps=STEPS))
        per_call = []
        for _ in range(calls):
            marks.clear()
            pipe(**zoo.call_kwargs(name, steps=STEPS))
            end = time.perf_counter()
            per_call.append([1e3 * (b - a) for a, b in zip(marks, [*marks[1:], end])][:-1])  # the last: the epilogue
        values = [statistics.median(step) for step in zip(*per_call)]
        return dict(model=name, memo=memo, modules=len(list(pipe.transformer.modules())),
                    host_ms_median=statistics.median(values), host_ms_per_step=values)
    finally:
        handle.remove()
        hook.remove()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="flux,qwenimage")
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = p.parse_args()
    torch.set_num_threads(1)
    compile_hooks.CudaGraphBackend = NoReplayBackend  # the real feature, its replays stand-ins
    compile_hooks.check_on_cuda = lambda transformer: None
    # Qwen-Image needs memo under transformer graphs (its prologue builds tensors from Python data: compat table)
    rows = [host_ms_per_call(name, memo, args.calls) for name in args.models.split(",")
            for memo in ((True,) if name == "qwenimage" else (False, True))]
    print("| model (block count of the full size) | modules | memo | host ms per graph-served call (median) |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['modules']} | {r['memo']} | {r['host_ms_median']:.2f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "graph_host_cost.json").write_text(json.dumps(dict(torch=torch.__version__, rows=rows), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
