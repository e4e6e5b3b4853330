"""Host cost per pipeline call of hookkit's eager features, where nothing hides it: the tiny Flux on the CPU.

A GPU run at 512² without CUDA graphs is host-bound, and the host's speed there moves by tens of percent
between runs (BENCHMARKS.md, "The `hookkit bench` matrix at 512²"), so the GPU cannot rank eager configurations that differ by a few
hundred microseconds. This measures what each feature adds to the host's work per call instead: the tiny
Flux (2 double + 3 single blocks, 32x32, float32, one thread), 28 steps, every variant enabled on the same
pipeline and disabled again, in rounds whose order rotates so that drift spreads over all variants; median
over rounds of the fastest of `--calls` calls. The DBCache variant uses threshold 0, so it never caches but
runs the whole dynamic decision (Fn residual, relative L1, one host read) at every step: its pure overhead.

    python benchmarks/host_overhead.py [--rounds 7] [--calls 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import hookkit
from hookkit.tools import zoo

STEPS = 28
VARIANTS: dict[str, Callable[[], hookkit.Spec | None]] = {
    "eager": lambda: None,
    "Spec() (bookkeeping)": lambda: hookkit.Spec(),
    "memo=True": lambda: hookkit.Spec(memo=True),
    "sync_free=True": lambda: hookkit.Spec(sync_free=True),
    "DBCache F1B0, threshold 0 (decides every step, never caches)": lambda: hookkit.Spec(
        cache=hookkit.DBCache(fn_blocks=1, bn_blocks=0, threshold=0.0, warmup_steps=0, taylorseer_order=0)),
}


def timed_calls(pipe: Any, kwargs: dict[str, Any], calls: int) -> float:
    """Fastest of `calls` pipeline calls after one untimed call: the least disturbed, the host cost itself."""
    pipe(**kwargs)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        pipe(**kwargs)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    pipe = zoo.tiny_pipeline("flux")
    kwargs = zoo.call_kwargs("flux", steps=STEPS)
    blocks = len(pipe.transformer.transformer_blocks) + len(pipe.transformer.single_transformer_blocks)
    names = list(VARIANTS)
    results: dict[str, list[float]] = {name: [] for name in names}
    with torch.no_grad():
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                spec = VARIANTS[name]()
                handle = hookkit.enable(pipe, spec) if spec is not None else None
                results[name].append(timed_calls(pipe, kwargs, args.calls))
                if name.startswith("DBCache"):
                    cached = handle.summary().features["cache"].data["branches"][0]["cached"]
                    if cached:
                        raise RuntimeError(f"{name}: cached steps {cached}; the variant must never cache")
                if handle is not None:
                    handle.remove()

    eager = statistics.median(results["eager"])
    print(f"tiny Flux ({blocks} blocks), CPU, float32, 1 thread, torch {torch.__version__}; {STEPS} steps; "
          f"median over {args.rounds} rounds of the fastest of {args.calls} calls")
    print()
    print("| variant | ms per call | added ms per call | added µs per step | added µs per block call |")
    print("|---|---|---|---|---|")
    for name in names:
        median = statistics.median(results[name])
        added = median - eager
        print(f"| {name} | {median * 1e3:.2f} | {added * 1e3:+.2f} | {added / STEPS * 1e6:+.1f} | "
              f"{added / (STEPS * blocks) * 1e6:+.1f} |")


if __name__ == "__main__":
    main()
