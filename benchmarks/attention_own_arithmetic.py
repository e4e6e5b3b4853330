"""Each fp8 attention kernel against its own arithmetic, over head sizes, sequence lengths and kinds of input.

Why: on the trained models' attention inputs (heads of 32 zero-padded to 64, 68 tokens) FlashInfer's e4m3 kernel
erred 6-13x what its arithmetic gives, while at Wan's shape on Gaussian inputs it matched it. This measures where it
departs: for every (kernel, head size, tokens, kind) row, the kernel's mean relative error against float32 SDPA, its
torch mirror's against float32 SDPA on the same inputs, and the kernel's against the mirror. A kernel computing its
arithmetic is within rounding of the mirror for keys that fit one of its tiles (`flashinfer_fa3.reference`, exact
there) and has the mirror's error against SDPA beyond it (where it rounds P against a running maximum).

Kernels: "flashinfer_fp8" (`flashinfer_fa3.attention`, the heads zero-padded as hookkit runs them, V smoothed; its
mirror `flashinfer_fa3.reference_attention`; needs the flashinfer package and a Hopper GPU),
"flashinfer_fp8_unsmoothed_v" (the same with V as it comes: what smoothing V changes) and "hookkit_fp8" (hookkit's
Triton kernel, the control: its mirror `fp8_triton.reference` is known to match it; SM 8.9+). Kinds:

  gaussian   Q, K, V ~ N(0, 1)
  offsets    the same plus a channel offset twice the spread, each head 1x, 2x, 3x, ... the first: real activations
             have both (a kernel applying one head's scales to another errs here, not on "gaussian")
  trained    the trained tiny Flux's own Q, K, V, recorded at its SDPA calls (heads of 32, 68 tokens; every 8th call
             of one denoising run); only where --dims has 32, at its own length
  check      `enable`'s check's own 4 heads (`flashinfer_fa3.check_inputs`: two Gaussian, two with channel offsets,
             ranges 1 and 3); check-q, check-k, check-v: the same draws with the offsets in Q, K or V only, to tell
             which one a kernel departs on (--heads does not apply)
Each row also lists every head's ratio (`head_ratios`: the kernel's error over its mirror's, 1.0 as its arithmetic).

    python benchmarks/attention_own_arithmetic.py --out attention_own_arithmetic.json
    python benchmarks/attention_own_arithmetic.py --dims 32 64 128 256 --tokens 68 120 1024 2048 4096 8192
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hookkit.techniques.attention import flashinfer_fa3, fp8_triton  # noqa: E402

KERNELS = ("flashinfer_fp8", "flashinfer_fp8_unsmoothed_v", "hookkit_fp8")
KINDS = ("gaussian", "offsets", "trained")
#: kinds from `flashinfer_fa3.check_inputs`, by which tensors carry the offsets
CHECK_KINDS = {"check": "qkv", "check-q": "q", "check-k": "k", "check-v": "v"}
#: the kernel and its mirror, each `(q, k, v, scale) -> [B, H, N, D]`
Kernel = tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]


def kernels() -> dict[str, Kernel]:
    return {"flashinfer_fp8": (flashinfer_fa3.attention, flashinfer_fa3.reference_attention),
            "flashinfer_fp8_unsmoothed_v": (partial(flashinfer_fa3.attention, smooth_value=False),
                                            partial(flashinfer_fa3.reference_attention, smooth_value=False)),
            "hookkit_fp8": (fp8_triton.attention, fp8_triton.reference)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS)
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS + tuple(CHECK_KINDS))
    p.add_argument("--dims", type=int, nargs="+", default=[32, 64, 128, 256], help="head sizes (default 32 64 128 256)")
    p.add_argument("--tokens", type=int, nargs="+", default=[68, 120, 1024, 2048, 4096, 8192],
                   help="sequence lengths of the random kinds (default 68 120 1024 2048 4096 8192: 2048 and "
                        "4096 place where FlashInfer's kernel stops departing, between 1,024 and 8,192)")
    p.add_argument("--heads", type=int, default=4, help="heads of the random kinds (default 4)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    if min(args.dims) < 1 or min(args.tokens) < 1 or args.heads < 1:
        p.error("--dims, --tokens and --heads must be positive")
    if args.out is not None and not args.out.parent.is_dir():
        p.error(f"--out: no folder {args.out.parent}")
    return args


def random_inputs(kind: str, heads: int, tokens: int, dim: int, device: torch.device) -> list[tuple[Any, ...]]:
    """One call's `(q, k, v, scale)` in bf16 `[1, heads, tokens, dim]` (module docstring)."""
    g = torch.Generator(device=device).manual_seed(0)
    ranges = torch.arange(1, heads + 1, device=device, dtype=torch.float32)[None, :, None, None]
    qkv = []
    for _ in range(3):
        t = torch.randn(1, heads, tokens, dim, generator=g, device=device)
        if kind == "offsets":
            t = (t + 2.0 * torch.randn(dim, generator=g, device=device)) * ranges
        qkv.append(t.to(torch.bfloat16))
    return [(*qkv, None)]


def trained_inputs(device: torch.device) -> list[tuple[Any, ...]]:
    """Every 8th SDPA call's `(q, k, v, scale)` of one denoising run of the trained tiny Flux (class 0, seed 100)."""
    from benchmarks.quality_attention import record_attention_inputs

    calls = record_attention_inputs("tiny", steps=28, seed=100, device=str(device))
    return [(q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16), scale) for q, k, v, scale in calls[::8]]


def head_ratios(out: torch.Tensor, expected: torch.Tensor, exact: torch.Tensor) -> list[float]:
    """Each head's error of the kernel against float32 SDPA over its mirror's: how much more the head errs than the
    kernel's arithmetic implies (1.0: no more)."""
    return [flashinfer_fa3.error_ratio(out[:, h], expected[:, h], exact[:, h]) for h in range(out.shape[1])]


def measure(kernel: Kernel, calls: list[tuple[Any, ...]]) -> dict[str, Any]:
    """The median over `calls` of the three errors (module docstring) and of the worst head's ratio
    (`worst_head_ratio`), or the kernel's error message."""
    run, mirror = kernel
    errors: dict[str, list[float]] = {"kernel_vs_fp32": [], "mirror_vs_fp32": [], "kernel_vs_mirror": [],
                                      "worst_head_ratio": []}
    per_head: list[list[float]] = []
    try:
        for q, k, v, scale in calls:
            exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=scale)
            out = run(q, k, v, scale).float()
            expected = mirror(q, k, v, scale).float()
            errors["kernel_vs_fp32"].append(flashinfer_fa3.relative_error(out, exact))
            errors["mirror_vs_fp32"].append(flashinfer_fa3.relative_error(expected, exact))
            errors["kernel_vs_mirror"].append(flashinfer_fa3.relative_error(out, expected))
            per_head.append(head_ratios(out, expected, exact))
            errors["worst_head_ratio"].append(max(per_head[-1]))
    except Exception as exc:  # noqa: BLE001 - a kernel that cannot run here is a row with its reason
        return {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"}
    return {**{key: statistics.median(values) for key, values in errors.items()},
            "head_ratios": [statistics.median(h) for h in zip(*per_head, strict=True)]}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    device = torch.device(args.device)
    cases: list[tuple[str, int, int, list[tuple[Any, ...]]]] = []
    for kind in args.kinds:
        if kind == "trained":
            if 32 in args.dims:
                calls = trained_inputs(device)
                cases.append((kind, 32, calls[0][0].shape[2], calls))
            continue
        if kind in CHECK_KINDS:
            cases += [(kind, dim, tokens, [(*flashinfer_fa3.check_inputs(dim, tokens, torch.bfloat16, device,
                                                                        CHECK_KINDS[kind]), None)])
                      for dim in args.dims for tokens in args.tokens]
            continue
        cases += [(kind, dim, tokens, random_inputs(kind, args.heads, tokens, dim, device))
                  for dim in args.dims for tokens in args.tokens]
    rows = []
    table = kernels()
    print(f"{'kernel':15} {'kind':9} {'dim':>4} {'tokens':>6} {'vs fp32':>9} {'mirror':>9} {'vs mirror':>9} "
          f"{'worst head':>10}  each head", flush=True)
    for name in args.kernels:
        for kind, dim, tokens, calls in cases:
            row = {"kernel": name, "kind": kind, "dim": dim, "tokens": tokens, "calls": len(calls),
                   **measure(table[name], calls)}
            rows.append(row)
            if "error" in row:
                print(f"{name:15} {kind:9} {dim:>4} {tokens:>6} failed: {row['error'][:90]}", flush=True)
            else:
                print(f"{name:15} {kind:9} {dim:>4} {tokens:>6} {row['kernel_vs_fp32']:>9.2e} "
                      f"{row['mirror_vs_fp32']:>9.2e} {row['kernel_vs_mirror']:>9.2e} "
                      f"{row['worst_head_ratio']:>10.2f}  {' '.join(f'{r:.2f}' for r in row['head_ratios'])}",
                      flush=True)
    if args.out is not None:
        meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                "argv": sys.argv[1:] if argv is None else argv}
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
