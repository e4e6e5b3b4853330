"""Per-call cost of regional compilation on the CPU: stock `compile_repeated_blocks` against `hookkit.Compile()`.

At small resolutions a GPU run is bound by what the host does per block call (guards, wrappers, hooks), so
this measures that host cost where nothing else hides it: the tiny Flux (2 double + 3 single blocks), CPU,
float32, 4 steps, median of 7 pipeline calls after 2 warm-up calls; each variant in its own process so that
compiled code cannot leak between them.

    python benchmarks/regional_dispatch.py
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

VARIANTS = ("eager", "stock-regional", "hookkit-regional")


def measure(variant: str) -> None:
    import torch
    import torch._dynamo.utils

    import hookkit
    from hookkit.tools import zoo

    torch.manual_seed(0)
    pipe = zoo.tiny_pipeline("flux")
    kw = zoo.call_kwargs("flux", steps=4)
    if variant == "stock-regional":
        pipe.transformer.compile_repeated_blocks(fullgraph=True)
    elif variant == "hookkit-regional":
        hookkit.enable(pipe, hookkit.Spec(compile=hookkit.Compile()))
    with torch.no_grad():
        for _ in range(2):
            pipe(**kw)
        times = []
        for _ in range(7):
            t0 = time.perf_counter()
            pipe(**kw)
            times.append(time.perf_counter() - t0)
    stats = torch._dynamo.utils.counters["stats"]
    print(f"| {variant} | {statistics.median(times) * 1e3:.2f} | {stats.get('unique_graphs', 0)} |", flush=True)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--variant":
        measure(sys.argv[2])
        return
    print("| variant | ms per 4-step pipeline call | compiled graphs |\n|---|---|---|", flush=True)
    for variant in VARIANTS:
        proc = subprocess.run([sys.executable, __file__, "--variant", variant], capture_output=True, text=True)
        rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
        print(rows[-1] if proc.returncode == 0 and rows else f"| {variant} | failed: {proc.stderr.strip()[-200:]} | |",
              flush=True)


if __name__ == "__main__":
    main()
