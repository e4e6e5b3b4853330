"""The GPU benchmark matrix of issue 6, in groups that each fit in one ten-minute command.

Runs `hookkit bench --full` (full-size architectures, random weights, bf16, batch 1, 28 steps) for one
model, size and group of configurations, writes `$OUT/<model>-<size>-<group>.json`, then merges every
group of that model and size found in `$OUT` into `$OUT/<model>-<size>.json` and prints the merged
markdown table (the one that goes into BENCHMARKS.md). Each group starts with its own eager row, the
reference for speed-up and PSNR.

    python benchmarks/bench_matrix.py --quick                       # ~2 min sanity check, Flux 256^2
    python benchmarks/bench_matrix.py --tiny --group hookkit        # CPU: checks the script only
    python benchmarks/bench_matrix.py --model flux --size 1024 --group stock
    python benchmarks/bench_matrix.py --model flux --size 1024 --group hookkit
    ...                                                             # groups: see GROUPS
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

GROUPS: dict[str, list[str]] = {
    "stock": ["eager", "regional-compile", "regional-compile-ro", "fbcache", "cache-dit"],
    "stock-full": ["eager", "full-compile", "full-compile-ro"],
    "hookkit": ["eager", "hookkit", "hookkit-cache", "hookkit-cache-fast", "hookkit-memo", "hookkit-sync-free"],
    "hookkit-compile": ["eager", "hookkit-compile", "hookkit-compile-ro", "hookkit-cuda-graphs"],
    "hookkit-combo": ["eager", "hookkit-cache-fast+compile", "hookkit-fp8+compile", "hookkit-fp8+cuda-graphs", "hookkit-all"],
}


def run(argv: list[str]) -> int:
    print("+ " + " ".join(argv), flush=True)
    return subprocess.run(argv).returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="flux", choices=("flux", "qwenimage", "cogvideox", "wan"))
    parser.add_argument("--size", type=int, default=1024, help="height = width")
    parser.add_argument("--group", default="hookkit", choices=sorted(GROUPS))
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="Flux 256^2, 4 steps, 3 configurations, 1 run")
    parser.add_argument("--tiny", action="store_true",
                        help="tiny models on any machine: checks this script, measures nothing")
    args = parser.parse_args()

    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    if args.quick:
        args.model, args.size, args.steps, args.runs, args.warmup = "flux", 256, 4, 1, 1
        configs, stem = ["eager", "hookkit-cache-fast", "hookkit-compile"], "quick"
    else:
        configs, stem = GROUPS[args.group], f"{args.model}-{'tiny' if args.tiny else args.size}-{args.group}"
    model = ["--height", "32", "--width", "32", "--steps", "4"] if args.tiny else \
        ["--full", "--height", str(args.size), "--width", str(args.size), "--steps", str(args.steps)]
    code = run([sys.executable, "-m", "hookkit", "bench", "--model", args.model, *model, "--runs", str(args.runs),
                "--warmup", str(args.warmup), "--configs", ",".join(configs), "--out-dir", str(out / f"{stem}-outputs"),
                "--json", str(out / f"{stem}.json")])
    if code != 0 or args.quick:
        return code
    prefix = stem.removesuffix(args.group)
    parts = [out / f"{prefix}{g}.json" for g in GROUPS if (out / f"{prefix}{g}.json").is_file()]
    print(f"\nmerged table of {[p.name for p in parts]}:\n", flush=True)
    return run([sys.executable, "-m", "hookkit", "bench", "--merge", *map(str, parts), "--json",
                str(out / f"{prefix.removesuffix('-')}.json")])


if __name__ == "__main__":
    sys.exit(main())
