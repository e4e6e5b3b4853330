"""Context parallelism on full-size architectures (random weights): 1 GPU vs Ulysses-2 vs ring-2, hookkit vs cache-dit.

    torchrun --nproc_per_node 2 benchmarks/context_parallel.py --quick          # Flux 1024², 8 steps, ~6 min
    torchrun --nproc_per_node 2 benchmarks/context_parallel.py --cases flux-1024 --layouts single,ulysses2,ring2
    torchrun --nproc_per_node 2 benchmarks/context_parallel.py --cases flux-2048 --configs compile,cache-fast+fp8+compile
    python benchmarks/context_parallel.py --dry-run --quick                     # one GPU, degree 1: the code paths
    python benchmarks/context_parallel.py --cpu-smoke                           # CPU, tiny Flux, no compile/fp8

Every rank builds the same pipeline from the same seed (bf16, batch 1, random prompt embeddings, latents out) and
runs the same calls. Layouts: `single` (no sharding; every rank runs the whole sequence on its own GPU, rank 0's time
is the 1-GPU time), `ulysses2` (`hookkit.ContextParallel(ulysses=2)`, native/cuDNN SDPA), `ring2`
(`ContextParallel(ring=2, attention_backend="_native_cudnn")`: ring attention needs the log-sum-exp). Configs:

    compile                      uncached, hookkit regional compile
    cache-fast+fp8+compile       DBCache F1B0 on cache-dit's static "fast" mask + fp8 rowwise + regional compile
    cache-dynamic+fp8+compile    DBCache F1B0 threshold 0.12, 8 warm-up steps, at most 3 in a row + fp8 + compile
                                 (random weights never pass a threshold: this measures the decision's cost, i.e.
                                 the one all-reduce of two numbers per decided step under context parallelism)
    cache-dit-fast               cache-dit DBCache F1B0 on the same mask + stock regional compile, with cache-dit's
                                 own parallelism (`ParallelismConfig(ulysses_size=2)` / `ring_size=2`)

Per row: median latency (torch.cuda.synchronize around each call), warm-up time, peak memory of every GPU,
whether every rank took the same cache decisions (gathered and compared), PSNR of the latents against the 1-GPU
row of the same config and against the 1-GPU uncached `compile` row. JSON to $OUT (default ./out), one file per
invocation named after its selection. A row that fails is recorded (status "failed") and the next one runs.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import hookkit  # noqa: E402
from hookkit.core.parallel import gather_objects  # noqa: E402
from hookkit.tools import bench  # noqa: E402
from hookkit.tools.distributed import cache_decisions  # noqa: E402

CASES = {"flux-1024": ("flux", 1024), "flux-2048": ("flux", 2048), "qwen-1024": ("qwenimage", 1024)}
LAYOUTS = ("single", "ulysses2", "ring2")
CONFIGS = ("compile", "cache-fast+fp8+compile", "cache-dynamic+fp8+compile", "cache-dit-fast")


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def log(message: str) -> None:
    if rank() == 0:
        print(f"[{datetime.datetime.now():%H:%M:%S}] {message}", file=sys.stderr, flush=True)


def parallel_spec(layout: str) -> hookkit.ContextParallel | None:
    if layout == "ulysses2":
        return hookkit.ContextParallel(ulysses=2)
    if layout == "ring2":
        return hookkit.ContextParallel(ring=2, attention_backend="_native_cudnn")
    return None


def hookkit_spec(config: str, layout: str, smoke: bool = False) -> hookkit.Spec:
    compile_ = None if smoke else hookkit.Compile(regional=True)
    quantize = None if smoke else hookkit.Quantize(scheme="fp8_row")
    parallel = parallel_spec(layout)
    if config == "compile":
        return hookkit.Spec(compile=compile_, parallel=parallel)
    if config == "cache-fast+fp8+compile":
        cache = hookkit.DBCache(fn_blocks=1, bn_blocks=0, warmup_steps=0, steps_mask="fast", mask_policy="static",
                                taylorseer_order=0)
    else:
        cache = hookkit.DBCache(fn_blocks=1, bn_blocks=0, threshold=0.12, warmup_steps=8,
                                max_continuous_cached_steps=3, taylorseer_order=0)
    return hookkit.Spec(cache=cache, quantize=quantize, compile=compile_, parallel=parallel)


def setup_cache_dit(pipe: Any, opts: bench.ModelOptions, layout: str) -> Callable[[], dict[str, Any]]:
    """cache-dit with the same mask and its own context parallelism; returns the reader of its decisions."""
    import cache_dit  # type: ignore[import-not-found]

    parallelism = None
    if layout == "ulysses2":
        parallelism = cache_dit.ParallelismConfig(ulysses_size=2)
    elif layout == "ring2":
        parallelism = cache_dit.ParallelismConfig(ring_size=2)
    kwargs: dict[str, Any] = {} if parallelism is None else {"parallelism_config": parallelism}
    cache_dit.enable_cache(pipe, cache_config=cache_dit.DBCacheConfig(
        Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=0.12, max_warmup_steps=0,
        steps_computation_mask=cache_dit.steps_mask(mask_policy="fast", total_steps=opts.num_steps()),
        steps_computation_policy="static"), **kwargs)
    pipe.transformer.compile_repeated_blocks(fullgraph=True)
    from hookkit.techniques.cache.hooks import NAME

    return lambda: {NAME: bench.cache_dit_steps(cache_dit.summary(pipe, logging=False))}


def run_row(case: str, layout: str, config: str, args: argparse.Namespace, device: str) -> tuple[dict[str, Any], Any]:
    name, size = CASES[case]
    if args.cpu_smoke:
        size = 32
    opts = bench.ModelOptions(name=name, full=not args.cpu_smoke, device=device, steps=args.steps, height=size,
                              width=size)
    row: dict[str, Any] = {"case": case, "layout": layout, "config": config, "status": "ok", "note": ""}
    output = None
    try:
        if layout != "single" and dist.get_world_size() < 2:
            raise hookkit.errors.UnsupportedError(f"layout {layout}: needs 2 ranks (torchrun --nproc_per_node 2)")
        pipe = bench.load_pipeline(opts)
        bench.synchronize(torch.device(device))
        t0 = time.perf_counter()
        if config == "cache-dit-fast":
            features = setup_cache_dit(pipe, opts, layout)
        else:
            handle = hookkit.enable(pipe, hookkit_spec(config, layout, args.cpu_smoke))
            features = lambda: {n: f.data for n, f in handle.summary().features.items()}  # noqa: E731
        row["setup_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            bench.output_of(pipe(**bench.call_kwargs(pipe, opts, "latent")))
        bench.synchronize(torch.device(device))
        row["warmup_s"] = time.perf_counter() - t0
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        latencies = []
        for _ in range(args.runs):
            kwargs = bench.call_kwargs(pipe, opts, "latent")
            seconds, output = bench.timed(lambda: bench.output_of(pipe(**kwargs)), torch.device(device))
            latencies.append(seconds)
        row["latencies_s"] = latencies
        row["latency_s"] = statistics.median(latencies)
        row["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None
        row["decisions"] = cache_decisions(features())
        output = output.detach().float().cpu()
    except Exception as exc:  # a failing row is a result
        traceback.print_exc(file=sys.stderr)
        row.update(status="failed", note=f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300])
    finally:
        pipe = handle = features = None  # noqa: F841
        torch._dynamo.reset()  # compiled code and its guards hold the model: free it before the next row builds one
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    everyone = gather_objects({k: row.get(k) for k in ("status", "peak_memory_gb", "decisions", "latency_s")})
    row["per_rank"] = everyone
    row["ranks_agree"] = all(r["decisions"] == everyone[0]["decisions"] for r in everyone)
    first = next(iter((everyone[0]["decisions"] or {}).values()), None)  # branch 0 (cache-dit: "cond")
    row["cached_steps"] = first["cached"] if first is not None else None
    return row, output


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="flux-1024,flux-2048,qwen-1024")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true",
                        help="flux-1024, 8 steps, 2 runs after 1 warm-up; layouts single,ulysses2; 3 configs")
    parser.add_argument("--dry-run", action="store_true", help="one process, one GPU: layout single only (degree 1)")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="the script's plumbing on the CPU: tiny Flux, 2 steps, layout single, no compile/fp8")
    args = parser.parse_args()
    if args.cpu_smoke:
        args.cases, args.steps, args.runs, args.warmup, args.dry_run = "flux-1024", 2, 1, 0, True
    if args.quick:
        args.cases, args.steps, args.runs, args.warmup = "flux-1024", 8, 2, 1
        args.layouts = "single,ulysses2" if "--layouts" not in sys.argv else args.layouts
        args.configs = ("compile,cache-fast+fp8+compile,cache-dit-fast" if "--configs" not in sys.argv
                        else args.configs)
    if args.dry_run:
        args.layouts = "single"
    if not torch.cuda.is_available() and not args.cpu_smoke:
        print("benchmarks/context_parallel.py: needs CUDA (one GPU per rank); --cpu-smoke checks it on the CPU",
              file=sys.stderr)
        return 2
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if not args.cpu_smoke:
        torch.cuda.set_device(local)
    if "RANK" not in os.environ:  # --dry-run without torchrun: a group of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo" if args.cpu_smoke else "nccl", timeout=datetime.timedelta(minutes=10))
    device = "cpu" if args.cpu_smoke else f"cuda:{local}"
    hookkit.set_verbosity(None)
    cases, layouts, configs = (args.cases.split(","), args.layouts.split(","), args.configs.split(","))
    for value, known in ((cases, CASES), (layouts, LAYOUTS), (configs, CONFIGS)):
        unknown = [v for v in value if v not in known]
        if unknown:
            print(f"unknown {unknown}; known: {list(known)}", file=sys.stderr)
            return 2

    rows: list[dict[str, Any]] = []
    outputs: dict[tuple[str, str, str], Any] = {}
    for case in cases:
        for layout in layouts:  # single first: the PSNR reference
            for config in configs:
                log(f"{case} {layout} {config}")
                row, output = run_row(case, layout, config, args, device)
                if output is not None:
                    outputs[(case, layout, config)] = output
                    same = outputs.get((case, "single", config)) if layout != "single" else None
                    uncached = outputs.get((case, "single", "compile")) if (layout, config) != ("single", "compile") else None
                    if same is not None:
                        row["psnr_vs_single_same_config"] = bench.psnr(same, output)
                    if uncached is not None:
                        row["psnr_vs_single_uncached"] = bench.psnr(uncached, output)
                log(f"  -> {row['status']} {row.get('latency_s')} s, peak {[r['peak_memory_gb'] for r in row['per_rank']]}"
                    f" GB, ranks agree {row['ranks_agree']}, cached {row['cached_steps']} {row['note']}")
                rows.append(row)
    if rank() == 0:
        out = Path(os.environ.get("OUT", "out"))
        out.mkdir(parents=True, exist_ok=True)
        tag = "dry-run" if args.dry_run else "quick" if args.quick else "-".join(cases)
        data = {"environment": bench.environment(torch.device(device)), "world_size": dist.get_world_size(),
                "steps": args.steps, "runs": args.runs, "warmup": args.warmup, "rows": rows}
        path = out / f"context_parallel_{tag}_{'_'.join(layouts)}.json"
        path.write_text(bench.to_json(data, indent=1))
        log(f"wrote {path}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
