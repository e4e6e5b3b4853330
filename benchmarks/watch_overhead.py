"""CPU cost of the per-call `ModelWatch` check of whole-transformer CUDA graphs, on full-size architectures.

    python benchmarks/watch_overhead.py [--quick] [--out DIR]

The transformers are built on the meta device (full-size module trees and parameter lists, no memory): the
check reads only metadata (identity, address, version, dtype, device, hooks, children), so its cost is the
same as on a CUDA model. Reports the median and minimum per-call process CPU time of `check()` (nothing changed) in µs, the number of
modules and tensors it reads, and writes JSON to $OUT (default ./out)/watch_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from hookkit.techniques.compile.hooks import ModelWatch


def build(name: str) -> torch.nn.Module:
    from diffusers import FluxTransformer2DModel, QwenImageTransformer2DModel

    with torch.device("meta"):
        if name == "flux":
            return FluxTransformer2DModel(guidance_embeds=True)
        return QwenImageTransformer2DModel()


def per_check_us(watch: ModelWatch, module: torch.nn.Module, calls: int, repeats: int) -> tuple[float, float]:
    """(median, min) over repeats of the process CPU time per check, in µs: CPU time, not wall time, so that
    other processes on a shared machine do not count."""
    samples = []
    for _ in range(repeats):
        t0 = time.process_time()
        for _ in range(calls):
            if watch.check(module) is not None:
                raise RuntimeError("the watch saw a change in an unchanged model")
        samples.append((time.process_time() - t0) / calls * 1e6)
    return statistics.median(samples), min(samples)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="Flux only, fewer repeats")
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = p.parse_args()
    calls, repeats = (20, 3) if args.quick else (200, 7)
    results = []
    for name in ("flux",) if args.quick else ("flux", "qwenimage"):
        module = build(name)
        watch = ModelWatch()
        watch.arm(module)
        row = {
            "model": name, "modules": sum(1 for _ in module.modules()),
            "tensors": sum(1 for _ in module.parameters()) + sum(1 for _ in module.buffers()),
            **dict(zip(("check_us_median", "check_us_min"), map(lambda v: round(v, 1), per_check_us(watch, module, calls, repeats)))),
            "torch": torch.__version__, "threads": torch.get_num_threads(),
        }
        print(json.dumps(row))
        results.append(row)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "watch_overhead.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
