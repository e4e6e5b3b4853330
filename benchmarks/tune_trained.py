"""The Specs `hookkit.tune` returns on the shipped trained models, as a `--specs` file for the quality front.

    python benchmarks/tune_trained.py --model tiny --steps 28 --speedups 1.5,2,3 --out out/tuned-tiny-28.json
    python -m hookkit.tools.front --model tiny --steps 28 --specs out/tuned-tiny-28.json

Tuned on every class at seed 10 (`--seeds`), which neither the shipped calibrations (seeds 50-59) nor the front's
evaluation (seeds 100 and up) use, so the front judges each tuned Spec on samples it never saw.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # runnable from a checkout without installing hookkit
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from hookkit.tools import trained  # noqa: E402
from hookkit.tools.tune import search  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=28)
    p.add_argument("--speedups", default="1.5,2,3")
    p.add_argument("--seeds", default="10")
    p.add_argument("--cfg-scale", type=float, default=1.0,
                   help="> 1: tune on guided calls (against the null class), as the front's --cfg-scale runs them")
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda: where the trained model runs (float32)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    pipe = trained.load_pipeline(device=args.device, model=args.model)
    classes = list(range(trained.NUM_CLASSES))
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = []
    for target in (float(s) for s in args.speedups.split(",")):
        calls = [trained.call_kwargs(classes, [s] * len(classes), steps=args.steps, model=args.model,
                                    device=args.device, cfg_scale=args.cfg_scale) for s in seeds]
        result = search(pipe, calls, speedup=target)
        print(result.table(), flush=True)
        rows.append({"name": f"hookkit-tune-{target:g}x", "family": "hookkit tune", "x": target,
                     "spec": result.spec.to_dict(),
                     "description": f"hookkit.tune(speedup={target:g}) on seeds {args.seeds}"
                                    + (f", CFG {args.cfg_scale:g}" if args.cfg_scale > 1 else "") + f": {result.chosen.name} "
                                    f"({result.chosen.speedup:.2f}x, {result.chosen.psnr_mean:.2f} dB there)"})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
