"""Host syncs in the denoising loop, stock vs hookkit (memo + sync_free), on full-size architectures.

    python benchmarks/syncs.py                 # Flux-dev 512², Qwen-Image (zero_cond_t) 512², CogVideoX-2b 480x720x9, 6 steps
    python benchmarks/syncs.py --quick         # 4 steps, smaller frames, smaller scheduler matrix
    python benchmarks/syncs.py --models cogvideox --steps 20   # 79 syncs in 20 steps stock

Per model: `hookkit.profile_syncs` on the stock pipeline (sync debug mode on for the steps after the first),
then `hookkit.diagnostics.testing.assert_no_host_sync` with `Spec(memo=True, sync_free=True)`, the "count | where"
tables of both, a second stock run as a determinism control, and bitwise equality of the latents. Then a
scheduler matrix on a tiny CogVideoX pipeline on the GPU (float32): every scheduler hookkit maps, plus the
step-index-searching ones, stock vs hookkit syncs per step and bitwise equality.

Random weights, bf16, batch 1, latents out (no VAE decode). Prints markdown tables; writes JSON to
$OUT/syncs.json. Without a GPU it only checks bitwise equality on tiny pipelines (`--tiny` is implied).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import traceback
from collections.abc import Callable
from typing import Any

import torch

import hookkit
from hookkit.tools import zoo
from hookkit.tools.bench import timed
from hookkit.diagnostics.host_syncs import SyncReport, profile_syncs
from hookkit.diagnostics.testing import assert_no_host_sync

SPEC = hookkit.Spec(memo=True, sync_free=True)
MATRIX = ("CogVideoXDDIMScheduler", "DDIMScheduler", "CogVideoXDPMScheduler", "DDPMScheduler", "DDIMParallelScheduler",
          "DDPMParallelScheduler", "DDIMInverseScheduler", "LCMScheduler", "TCDScheduler",
          "DPMSolverMultistepScheduler", "EulerDiscreteScheduler", "UniPCMultistepScheduler")
QUICK_MATRIX = ("CogVideoXDDIMScheduler", "DDIMScheduler", "CogVideoXDPMScheduler", "LCMScheduler",
                "DPMSolverMultistepScheduler")


def output_of(result: Any) -> torch.Tensor:
    return result.frames if hasattr(result, "frames") else result.images


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality that also holds for NaNs in the same places."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))



# --- the three pipelines ------------------------------------------------------------------------------------------


def build(name: str, tiny: bool) -> Any:
    overrides = {"zero_cond_t": True} if name == "qwenimage" else {}
    if tiny:
        pipe = zoo.tiny_pipeline(name, **overrides)
        return pipe.to("cuda") if torch.cuda.is_available() else pipe
    torch.manual_seed(0)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            return zoo.full_pipeline(name, **overrides)
    finally:
        torch.set_default_dtype(saved)


def make_kwargs(name: str, steps: int, quick: bool, tiny: bool) -> Callable[[], dict[str, Any]]:
    """A fresh set of call arguments (seeded generator) per call."""
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def tiny_kw() -> dict[str, Any]:
        kw = zoo.call_kwargs(name, steps=steps)
        if name == "cogvideox":
            kw["use_dynamic_cfg"] = True
        if name == "qwenimage":
            kw.update(negative_prompt_embeds=kw["prompt_embeds"].flip(1), prompt_embeds_mask=_padded_mask(8, 6),
                      negative_prompt_embeds_mask=_padded_mask(8, 6), true_cfg_scale=4.0)
        for key, value in kw.items():
            if isinstance(value, torch.Tensor):
                kw[key] = value.to(device)
        kw["generator"] = torch.Generator(device).manual_seed(0)
        return kw

    def full_kw() -> dict[str, Any]:
        size = 256 if quick else 512
        if name == "flux":
            return zoo.full_call_kwargs("flux", steps=steps, height=size, width=size)
        if name == "qwenimage":
            kw = zoo.full_call_kwargs("qwenimage", steps=steps, height=size, width=size)
            mask = _padded_mask(64, 40).to("cuda")  # a prompt of 40 tokens padded to 64: the mask path runs
            kw.update(prompt_embeds_mask=mask, negative_prompt_embeds=kw["prompt_embeds"].flip(1),
                      negative_prompt_embeds_mask=mask, true_cfg_scale=4.0)
            return kw
        height, width = (256, 384) if quick else (480, 720)
        return zoo.full_call_kwargs("cogvideox", steps=steps, height=height, width=width, use_dynamic_cfg=True)

    return tiny_kw if tiny else full_kw


def _padded_mask(total: int, valid: int) -> torch.Tensor:
    mask = torch.zeros(1, total, dtype=torch.long)
    mask[:, :valid] = 1
    return mask


def profile_model(name: str, steps: int, quick: bool, tiny: bool) -> dict[str, Any]:
    row: dict[str, Any] = {"model": name, "steps": steps, "tiny": tiny}
    pipe = build(name, tiny)
    kw = make_kwargs(name, steps, quick, tiny)
    gpu = torch.cuda.is_available()
    try:
        # stock: syncs, latents, and a second run as a determinism control
        stock: SyncReport | None = profile_syncs(pipe, **kw()) if gpu else None
        stock_out = stock.output if stock is not None else pipe(**kw())
        stock_time, control = timed(lambda: pipe(**kw()))
        row["stock_deterministic"] = bits_equal(output_of(stock_out), output_of(control))
        handle = hookkit.enable(pipe, SPEC)
        try:
            hooked: SyncReport | None = None
            if gpu:
                try:
                    hooked = assert_no_host_sync(pipe, **kw())
                    row["assert_no_host_sync"] = "passed"
                except AssertionError as exc:
                    row["assert_no_host_sync"] = "FAILED"
                    print(exc, flush=True)
                    hooked = profile_syncs(pipe, **kw())
            hooked_out = hooked.output if hooked is not None else pipe(**kw())
            hooked_time, _ = timed(lambda: pipe(**kw()))
            summary = handle.summary()
            row["memo"] = summary.features["memo"].data if "memo" in summary.features else None
            row["sync"] = summary.features["sync_free"].data
        finally:
            handle.remove()
        row["bitwise_equal"] = bits_equal(output_of(stock_out), output_of(hooked_out))
        row["wall_s"] = {"stock": round(stock_time, 3), "hookkit": round(hooked_time, 3)}
        if stock is not None and hooked is not None:
            row["stock_syncs"] = stock.to_dict()
            row["hookkit_syncs"] = hooked.to_dict()
            print(f"\n## {name}: stock\n{stock.render()}\n\n## {name}: hookkit memo + sync_free\n{hooked.render()}\n",
                  flush=True)
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        traceback.print_exc()
    return row


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --- scheduler matrix -----------------------------------------------------------------------------------------------


def profile_scheduler(scheduler_name: str, steps: int) -> dict[str, Any]:
    import diffusers

    row: dict[str, Any] = {"scheduler": scheduler_name}
    gpu = torch.cuda.is_available()
    try:
        pipe = zoo.tiny_pipeline("cogvideox")
        pipe.scheduler = getattr(diffusers, scheduler_name).from_config(pipe.scheduler.config)
        if gpu:
            pipe = pipe.to("cuda")
        kw = make_kwargs("cogvideox", steps, quick=True, tiny=True)
        stock = profile_syncs(pipe, **kw()) if gpu else None
        stock_out = stock.output if stock is not None else pipe(**kw())
        handle = hookkit.enable(pipe, hookkit.Spec(sync_free=True))
        try:
            hooked = profile_syncs(pipe, **kw()) if gpu else None
            hooked_out = hooked.output if hooked is not None else pipe(**kw())
            row["sync"] = handle.summary().features["sync_free"].data
        finally:
            handle.remove()
        row["bitwise_equal"] = bits_equal(output_of(stock_out), output_of(hooked_out))
        if stock is not None and hooked is not None:
            row["stock_per_step"] = statistics.mean(stock.per_step().values())
            row["hookkit_per_step"] = statistics.mean(hooked.per_step().values())
            row["stock_where"] = [f"{n} {loc.where}" for n, loc in stock.per_location()]
            row["hookkit_where"] = [f"{n} {loc.where}" for n, loc in hooked.per_location()]
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        traceback.print_exc()
    return row


def per_step_cell(row: dict[str, Any], key: str) -> str:
    return " ".join(str(v) for v in row[key]["per_step"].values()) if key in row else ""


# --- main --------------------------------------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="flux,qwenimage,cogvideox")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--quick", action="store_true", help="4 steps, Flux/Qwen 256², CogVideoX 256x384, short matrix")
    p.add_argument("--tiny", action="store_true", help="tiny models instead of full-size ones (plumbing check)")
    p.add_argument("--no-matrix", action="store_true", help="skip the scheduler matrix")
    args = p.parse_args()
    gpu = torch.cuda.is_available()
    tiny = args.tiny or not gpu
    steps = 4 if args.quick else args.steps
    out_dir = os.environ.get("OUT", "out")
    os.makedirs(out_dir, exist_ok=True)
    if not gpu:
        print("no CUDA device: tiny models on the CPU, bitwise equality only (sync counts need a GPU)")

    rows = []
    for name in args.models.split(","):
        row = profile_model(name, steps, args.quick, tiny)
        free_memory()
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if not k.endswith("_syncs")}), flush=True)

    matrix = []
    if not args.no_matrix:
        for scheduler_name in (QUICK_MATRIX if args.quick else MATRIX):
            row = profile_scheduler(scheduler_name, 5)
            matrix.append(row)
            print(json.dumps(row), flush=True)

    print("\n| model | steps | stock syncs/step (steps 1..) | hookkit syncs/step | assert_no_host_sync | bitwise equal | "
          "stock deterministic | memo hits/misses | sync: args mapped, t reads, step index on host | wall s stock / hookkit | error |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        memo = f"{r['memo']['hits']}/{r['memo']['misses']}" if r.get("memo") and r["memo"].get("attached") else "-"
        sync = r.get("sync") or {}
        sync_cell = f"{sync.get('mapped_args', '')}, {sync.get('host_reads', '')}, {sync.get('host_step_index', '')}"
        wall = r.get("wall_s", {})
        print(f"| {r['model']} | {r['steps']} | {per_step_cell(r, 'stock_syncs')} | {per_step_cell(r, 'hookkit_syncs')} | "
              f"{r.get('assert_no_host_sync', 'n/a (CPU)')} | {r.get('bitwise_equal', '')} | {r.get('stock_deterministic', '')} | "
              f"{memo} | {sync_cell} | {wall.get('stock', '')} / {wall.get('hookkit', '')} | {r.get('error', '')} |")
    for r in rows:
        if "stock_syncs" in r:
            print(f"\n{r['model']} stock, where: " + "; ".join(f"{d['count']} {d['where']} ({d['code'][:60]})"
                                                            for d in r["stock_syncs"]["per_location"]))
    if matrix:
        print("\n| scheduler (tiny CogVideoX, fp32, 5 steps) | stock syncs/step | hookkit syncs/step | bitwise equal | "
              "args mapped | step index on host | stock where | error |")
        print("|---|---|---|---|---|---|---|---|")
        for r in matrix:
            sync = r.get("sync") or {}
            print(f"| {r['scheduler']} | {r.get('stock_per_step', '')} | {r.get('hookkit_per_step', '')} | "
                  f"{r.get('bitwise_equal', '')} | {sync.get('mapped_args', '')} | {sync.get('host_step_index', '')} | "
                  f"{'; '.join(r.get('stock_where', []))} | {r.get('error', '')} |")
    info = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if gpu else "cpu", "tiny": tiny,
            "quick": args.quick}
    with open(os.path.join(out_dir, "syncs.json"), "w") as f:
        json.dump({"models": rows, "schedulers": matrix, **info}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
