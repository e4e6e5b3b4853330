"""Where a pipeline's output first turns non-finite: one pipeline call with forward hooks on the transformer's
top-level modules and its blocks, and every SDPA call watched, recording per transformer call the first module and
the first attention call whose output holds NaN or infinity (with whether that call's inputs were finite and how many
of its query rows the mask leaves no key), and the largest magnitude each block's output reached.

Why: HunyuanVideo 1.5's output at 480x832x81 on an H100 was all non-finite with hookkit's fp8 attention kernel,
finite in stock eager under every SDPA backend (BENCHMARKS.md, "On one H100: `hookkit_fp8` under the padding mask
turns the output non-finite"). `--sdpa` pins SDPA's backend, to tell a kernel's fully-masked rows from the model's
arithmetic. The checks read values back to the host: a diagnosis, not a timing.

    python benchmarks/first_nonfinite.py --model hunyuanvideo15 --full --height 480 --width 832 --frames 81 \
        --steps 1 --sdpa cudnn --out first_nonfinite.json
    python benchmarks/first_nonfinite.py --model hunyuanvideo15 --steps 1 --device cpu      (the tiny model)

`--hookkit-attention hookkit_fp8` runs the call with `hookkit.Attention(low_precision=..., full_first=0,
full_last=0)`: the kernel on every block and step, and records the kernel's first call whose output is non-finite:
its inputs' largest magnitudes and per-block scales, the mask, how many output rows are non-finite, whether SDPA on
the same inputs is finite, and the same call unmasked and over the mask's valid prefix. `--fp8-gemms` adds
`hookkit.Quantize(scheme="fp8_row")` and `--compile` hookkit's regional compile, the recipe of the bench rows whose
output was non-finite; under `--compile` only the kernel's calls and the transformer's output are watched (compiled
regions would take the module hooks and SDPA watch in).
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hookkit.techniques.attention.hooks import _sdpa_args  # noqa: E402
from hookkit.tools.bench import models  # noqa: E402
from hookkit.tools.bench.runner import _nonfinite  # noqa: E402

#: `--sdpa` names and torch's backends
BACKENDS = {"cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "flash": "FLASH_ATTENTION",
            "math": "MATH"}


def finite(t: Any) -> bool:
    return not (torch.is_tensor(t) and t.is_floating_point()) or _nonfinite(t) == 0


def rows_without_keys(mask: torch.Tensor | None) -> int:
    """Query rows a boolean SDPA mask leaves no key (summed over its broadcast dimensions); 0 without a mask."""
    if mask is None or mask.dtype != torch.bool:
        return 0
    return int((~mask.any(dim=-1)).sum())


class Watch(TorchFunctionMode):
    """Records in the current transformer call's record (`records[-1]`) its first non-finite SDPA output."""

    def __init__(self, records: list[dict[str, Any]]) -> None:
        super().__init__()
        self.records = records

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is F.scaled_dot_product_attention and self.records:
            record = self.records[-1]
            record["sdpa_calls"] += 1
            if record["attention"] is None and not finite(out):
                a = _sdpa_args(args, kwargs)
                q, k, v, mask = a["query"], a["key"], a["value"], a["attn_mask"]
                record["attention"] = {
                    "call": record["sdpa_calls"], "module": record["current"], "shape": list(q.shape),
                    "inputs_finite": all(finite(t) for t in (q, k, v)), "mask": None if mask is None else
                    {"dtype": str(mask.dtype), "shape": list(mask.shape), "rows_without_keys": rows_without_keys(mask)},
                    "nonfinite_values": _nonfinite(out)}
        return out


def watch(transformer: torch.nn.Module, modules: bool = True) -> list[dict[str, Any]]:
    """Hooks on `transformer`: each call appends its record to the list returned, its modules (to depth 2, with
    `modules`; not under compile, whose regions take their hooks in) fill it in; `Watch` over the same list adds the
    SDPA calls."""
    records: list[dict[str, Any]] = []

    def before_call(module: torch.nn.Module, args: Any) -> None:
        records.append({"first_module": None, "attention": None, "block_max": {}, "current": None, "sdpa_calls": 0})

    def after_call(module: torch.nn.Module, args: Any, out: Any) -> None:
        records[-1]["output_finite"] = finite(out[0] if isinstance(out, tuple) else getattr(out, "sample", out))

    def named(name: str) -> Any:
        def before(module: torch.nn.Module, args: Any) -> None:
            records[-1]["current"] = name

        def after(module: torch.nn.Module, args: Any, out: Any) -> None:
            record = records[-1]
            outs = out if isinstance(out, tuple) else (out,)
            if record["first_module"] is None and not all(finite(o) for o in outs):
                record["first_module"] = name
            if name.split(".")[0].endswith("blocks") and name.count(".") == 1:
                values = [o.float().abs().max().item() for o in outs if torch.is_tensor(o) and o.is_floating_point()]
                record["block_max"][name] = max(values, default=None)
        return before, after

    transformer.register_forward_pre_hook(before_call)
    transformer.register_forward_hook(after_call)
    for name, module in transformer.named_modules() if modules else ():
        if name and name.count(".") <= 1:
            before, after = named(name)
            module.register_forward_pre_hook(before)
            module.register_forward_hook(after)
    return records


def watch_kernel(module: str, calls: list[dict[str, Any]]) -> None:
    """Wrap `hookkit.techniques.attention.<module>.attention` (the op looks it up at each call): each call appends
    its count of non-finite output values to `calls`; the first non-finite one also what its inputs were."""
    import importlib

    kernels = importlib.import_module(f"hookkit.techniques.attention.{module}")
    attention = kernels.attention

    def watched(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                mask: torch.Tensor | None = None, **options: Any) -> torch.Tensor:
        out = attention(q, k, v, scale, mask, **options)
        record: dict[str, Any] = {"call": len(calls), "nonfinite_values": _nonfinite(out)}
        if record["nonfinite_values"] and not any(c["nonfinite_values"] for c in calls):
            bad_rows = (~torch.isfinite(out.float())).any(dim=-1)  # [B, H, Sq]
            rows = bad_rows.any(dim=(0, 1)).nonzero().flatten()
            _, q_scales, _, k_scales, *_ = kernels.quantize_inputs(q, k, v, scale)  # the kernel's own scales
            sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
            record.update({
                "shape": list(q.shape), "inputs_finite": all(finite(t) for t in (q, k, v)),
                "amax": {n: t.float().abs().amax().item() for n, t in (("q", q), ("k", k), ("v", v))},
                "scales": {n: [s.min().item(), s.max().item()] for n, s in (("q", q_scales), ("k", k_scales))},
                "mask": None if mask is None else {"dtype": str(mask.dtype), "shape": list(mask.shape),
                                                    "stride": list(mask.stride()),
                                                    "rows_without_keys": rows_without_keys(mask),
                                                    "keys_allowed": int(mask.sum())},
                "nonfinite_rows": int(bad_rows.sum()), "heads_with_nonfinite": int(bad_rows.any(dim=2).sum()),
                "first_rows": rows[:8].tolist(), "last_rows": rows[-8:].tolist(),
                "sdpa_nonfinite_values": _nonfinite(sdpa),
                # the same kernel without the mask: over every token, and over the valid prefix where the mask is a
                # padding mask (its valid tokens first), which is what the masked call computes on the valid rows
                "unmasked_nonfinite_values": _nonfinite(attention(q, k, v, scale, **options))})
            if mask is not None and mask.dtype == torch.bool:
                valid = int(mask.reshape(-1, mask.shape[-1])[0].sum())
                record["valid_prefix"] = valid
                record["prefix_nonfinite_values"] = _nonfinite(attention(q[:, :, :valid], k[:, :, :valid],
                                                                         v[:, :, :valid], scale, **options))
        calls.append(record)
        return out

    kernels.attention = watched


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--full", action="store_true", help="the full-size architecture, random weights")
    p.add_argument("--arch", default=None)
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--frames", type=int, default=None)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None,
                   help="the pipeline's dtype: bfloat16, float16 or float32 (default: bfloat16 on a GPU, else float32)")
    p.add_argument("--sdpa", choices=sorted(BACKENDS), default=None,
                   help="pin SDPA's backend (default: torch's choice)")
    p.add_argument("--out", type=Path, default=None, help="write the report as JSON here")
    p.add_argument("--hookkit-attention", choices=("hookkit_fp8",), default=None,
                   help="run with hookkit.Attention(low_precision=...) and record its kernel's first non-finite call")
    p.add_argument("--fp8-gemms", action="store_true", help="with hookkit.Quantize(scheme='fp8_row')")
    p.add_argument("--compile", action="store_true", help="with hookkit's regional compile (SDPA calls not watched)")
    args = p.parse_args(argv)
    if args.out is not None and not args.out.parent.is_dir():
        raise SystemExit(f"--out: expected a file in an existing folder, got {args.out}")
    opts = models.ModelOptions(name=args.model, full=args.full, arch=args.arch, height=args.height, width=args.width,
                               frames=args.frames, steps=args.steps, device=args.device, dtype=args.dtype)
    pipe = models.load_pipeline(opts)
    kernel_calls: list[dict[str, Any]] = []
    if args.hookkit_attention is not None or args.fp8_gemms or args.compile:
        import hookkit
        attention = None if args.hookkit_attention is None else hookkit.Attention(
            low_precision=args.hookkit_attention, full_first=0, full_last=0)
        hookkit.enable(pipe, hookkit.Spec(
            attention=attention, quantize=hookkit.Quantize(scheme="fp8_row") if args.fp8_gemms else None,
            compile=hookkit.Compile(regional=True) if args.compile else None))
        if args.hookkit_attention is not None:
            watch_kernel(args.hookkit_attention.removeprefix("hookkit_") + "_triton", kernel_calls)
    report = locate(pipe, opts, args.sdpa, watch_sdpa=not args.compile)
    report["kernel_calls"] = kernel_calls
    if kernel_calls:
        print(f"kernel calls: {len(kernel_calls)}; first non-finite: " + json.dumps(
            next((c for c in kernel_calls if c["nonfinite_values"]), None)))
    first = report["first_call"]
    print(f"output finite: {report['output_finite']}; first transformer call with a non-finite value: {first}")
    if first is not None:
        print(json.dumps({k: v for k, v in report["transformer_calls"][first].items() if k != "block_max"}))
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1))
    return report


def locate(pipe: Any, opts: models.ModelOptions, sdpa: str | None, watch_sdpa: bool = True) -> dict[str, Any]:
    """One call of `pipe` as `opts` describes it, watched (`watch`; its SDPA calls too with `watch_sdpa`): the
    report `main` writes."""
    records = watch(pipe.transformer, modules=watch_sdpa)
    if sdpa is None:
        backend: Any = nullcontext()
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = sdpa_kernel([getattr(SDPBackend, BACKENDS[sdpa])])
    with torch.no_grad(), backend, Watch(records) if watch_sdpa else nullcontext():
        output = models.output_of(pipe(**models.call_kwargs(pipe, opts, models.output_type_for(opts))))
    for record in records:
        record.pop("current")
    first = next((i for i, r in enumerate(records) if r["first_module"] or r["attention"]), None)
    return {"model": opts.name, "full": opts.full, "arch": opts.arch, "sdpa": sdpa or "torch's choice",
            "device": str(models.resolve_device(opts.device)), "output_finite": finite(output), "first_call": first,
            "transformer_calls": records}


if __name__ == "__main__":
    main()
