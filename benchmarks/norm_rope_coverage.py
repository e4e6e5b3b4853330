"""Which diffusers transformers `Compile(fuse_norm_rope=True)` reaches: every tiny config of diffusers' own tests.

For each transformer config of `tests/data/diffusers_transformers.json` (diffusers' tiny test configs): the model in
bf16, its dummy inputs (floating tensors in bf16), hookkit's regional compile with the norm-rope pass allowed on the
CPU (`norm_rope.DEVICES`; on the CPU the op is the eager arithmetic), one call. Recorded: the op calls per compiled
block graph (`norm_ropes_per_graph`), and the largest difference of the output from the same model compiled without
the pass (inductor's own kernels; `--no-reference` skips that second compile). A model with no call keeps inductor's
kernels for its queries and keys: its norm or rotary form is not one the pass knows, or it has none.

    python benchmarks/norm_rope_coverage.py --out DIR            # CPU, all configs (~20 min on 2 cores)
    python benchmarks/norm_rope_coverage.py --only flux,wan      # some configs
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch._inductor.config as inductor_config

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
import diffusers_configs  # noqa: E402  (tests/diffusers_configs.py)

import hookkit  # noqa: E402
from hookkit.techniques.compile import norm_rope  # noqa: E402


def _bf16(value: Any) -> Any:
    if torch.is_tensor(value):
        return value.to(torch.bfloat16) if value.is_floating_point() else value
    if isinstance(value, dict):
        return {k: _bf16(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_bf16(v) for v in value)
    return value


def _flat(output: Any) -> torch.Tensor:
    if isinstance(output, (list, tuple)):
        return torch.cat([_flat(o) for o in output if o is not None])
    if hasattr(output, "to_tuple"):  # a diffusers output dataclass
        return _flat(output.to_tuple())
    return output.reshape(-1).float()


def run(name: str, fuse: bool) -> tuple[torch.Tensor, dict[str, Any]]:
    """The bf16 model's output under regional compile (with or without the pass) and the compile summary's data."""
    torch._dynamo.reset()
    model = diffusers_configs.build(name).to(torch.bfloat16)
    handle = hookkit.enable(model, hookkit.Spec(compile=hookkit.Compile(fullgraph=False, fuse_norm_rope=fuse)))
    try:
        # no FX graph cache: a graph served from it was rewritten (or not) when cached, and is not counted again
        with torch.no_grad(), inductor_config.patch(fx_graph_cache=False):
            out = _flat(model(**_bf16(diffusers_configs.inputs(name))))
        return out, handle.summary().features["compile"].data
    finally:
        handle.remove()


def _cosmos_without_torchvision() -> None:
    """Cosmos resizes its padding mask with torchvision, which this environment may lack: the tests' nearest resize."""
    import diffusers.models.transformers.transformer_cosmos as cosmos

    if "transforms" not in vars(cosmos):
        cosmos.transforms = diffusers_configs.torchvision_shim()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated config names (default: all)")
    parser.add_argument("--no-reference", action="store_true", help="skip the compile without the pass")
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    norm_rope.DEVICES = ("cpu",)
    _cosmos_without_torchvision()
    names = [n for n in args.only.split(",") if n] or diffusers_configs.configs()
    rows = []
    for name in names:
        t0 = time.perf_counter()
        row: dict[str, Any] = {"config": name, "class": diffusers_configs.entry(name)["class"]}
        try:
            out, data = run(name, fuse=True)
            row.update(status="ok", norm_ropes_per_graph=data.get("norm_ropes_per_graph"),
                       fused=data.get("norm_ropes_fused"), regions=data.get("regions"))
            if not args.no_reference and row["fused"]:
                reference, _ = run(name, fuse=False)
                finite = torch.isfinite(out) & torch.isfinite(reference)
                row["max_abs_diff"] = (out[finite] - reference[finite]).abs().max().item() if finite.any() else None
                row["reference_max_abs"] = reference[finite].abs().max().item() if finite.any() else None
        except Exception as exc:  # a model this path cannot run is a result, not the end of the table
            traceback.print_exc(file=sys.stderr)
            row.update(status="failed", note=f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}")
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    reached = [r["config"] for r in rows if r.get("fused")]
    summary = {"configs": len(rows), "reached": len(reached), "reached_configs": reached}
    print(json.dumps(summary))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "norm_rope_coverage.json").write_text(json.dumps({
        "script": "benchmarks/norm_rope_coverage.py", "argv": sys.argv[1:], "torch": torch.__version__,
        "summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
