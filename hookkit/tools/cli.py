"""The `hookkit` command line (also `python -m hookkit`).

    hookkit demo                         tiny Flux on the CPU: plain vs hookkit, summary, timings
    hookkit generate flux --cache ...    one generation with the chosen optimizations, saved to a file
    hookkit bench --configs eager,...    a matrix of configurations, one process each, as a markdown table

Everything runs without downloads: models are built from config with random weights (`hookkit.tools.zoo`),
tiny on the CPU or full size with `--full`, unless `--model-path` names a local pipeline folder.
A flag whose feature this machine or installation lacks fails with hookkit's own error message and exit
code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

import hookkit
from hookkit.tools import bench, distributed
from hookkit.tools.bench import ModelOptions
from hookkit.errors import HookkitError, SpecError
from hookkit.techniques.cache.spec import MASK_POLICIES
from hookkit.techniques.compile.spec import COMPILE_MODES
from hookkit.techniques.quantize.spec import QUANT_SCHEMES
from hookkit.core.summary import table

EXIT_ERROR = 2  # usage errors and unavailable features, like argparse's own


# --- shared --------------------------------------------------------------------------------------------


def _quiet_third_party() -> None:
    """Silence import-time chatter of torchao/diffusers/transformers (missing optional kernels, deprecations)
    so that the CLI's own output stays readable; `-v` keeps it."""
    import os

    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="torchao")


def _model_options(args: argparse.Namespace, name: str) -> ModelOptions:
    if args.prompt is not None and args.model_path is None:
        raise SpecError(f"--prompt {args.prompt!r}: only with --model-path (a local pipeline with text encoders); "
                        "tiny and --full models get random prompt embeddings. Drop --prompt or add --model-path.")
    if args.threads is not None:  # last: an error above leaves the process's thread count alone
        if args.threads < 1:
            raise SpecError(f"--threads: expected an int >= 1, got {args.threads}.")
        torch.set_num_threads(args.threads)
    prompt = ModelOptions.prompt_default() if args.prompt is None else args.prompt
    return ModelOptions(name=name, full=args.full, model_path=args.model_path, device=args.device, dtype=args.dtype,
                        steps=args.steps, height=args.height, width=args.width, batch=args.batch, seed=args.seed,
                        threads=args.threads, prompt=prompt)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: 6 tiny, 28 full or local)")
    p.add_argument("--height", type=int, default=None, help="output height (default: the model's)")
    p.add_argument("--width", type=int, default=None, help="output width (default: the model's)")
    p.add_argument("--batch", type=int, default=1, help="images (or videos) per call")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights, embeddings and latents")
    p.add_argument("--model-path", default=None, help="a local diffusers pipeline folder (no downloads)")
    p.add_argument("--full", action="store_true",
                   help="the full-size architecture (random weights) instead of the tiny one; skips decoding")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when visible)")
    p.add_argument("--dtype", default=None, choices=sorted(bench.DTYPES), help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    p.add_argument("--prompt", default=None,
                   help=f"text prompt, only with --model-path (default {ModelOptions.prompt_default()!r}; a folder "
                        "without text encoders, tiny and --full models get random embeddings)")


def _progress(pipe: Any, desc: str, leave: bool = True) -> None:
    """Turn diffusers' own per-step progress bar (tqdm, on stderr) back on, labelled."""
    pipe.set_progress_bar_config(disable=False, desc=desc, leave=leave, dynamic_ncols=True)


# --- demo ------------------------------------------------------------------------------------------------


def demo_spec(have: frozenset[str]) -> hookkit.Spec:
    """What the demo turns on: every feature that is installed and useful on a CPU.

    DBCache runs on cache-dit's static "fast" mask (random weights never cache dynamically); memo and
    sync-free run anywhere; compile and quantization are left out (minutes of CPU compilation, schemes
    that need a GPU).
    """
    kwargs: dict[str, Any] = {}
    if "cache" in have:
        kwargs["cache"] = hookkit.DBCache(fn_blocks=1, bn_blocks=0, warmup_steps=0, steps_mask="fast",
                                          mask_policy="static")
    if "memo" in have:
        kwargs["memo"] = True
    if "sync_free" in have:
        kwargs["sync_free"] = True
    return hookkit.Spec(**kwargs)


def cmd_demo(args: argparse.Namespace) -> int:
    from hookkit.tools import zoo

    for flag, value in (("--steps", args.steps), ("--runs", args.runs), ("--threads", args.threads),
                        ("--height", args.height), ("--width", args.width)):
        if value < 1:
            raise SpecError(f"{flag}: expected an int >= 1, got {value}.")
    device = torch.device("cpu")
    # One thread: a tiny model gains nothing from more, and timings stay stable on a busy machine.
    torch.set_num_threads(args.threads)
    spec = demo_spec(bench.available_fields())
    on = [k for k, v in spec.to_dict().items() if v not in (None, False)]
    print(f"hookkit demo: tiny FluxPipeline built from config with random weights, {bench.device_description(device)}, "
          f"{args.steps} steps, {args.height}x{args.width}, seed {args.seed}")
    print(f"hookkit features installed: {', '.join(sorted(bench.available_fields())) or 'none yet'}; "
          f"demo turns on: {', '.join(on) if on else 'bookkeeping only (Spec())'}")
    pipe = zoo.tiny_pipeline("flux", seed=args.seed)

    def call() -> torch.Tensor:
        kwargs = zoo.call_kwargs("flux", steps=args.steps, seed=args.seed, height=args.height, width=args.width,
                                 output_type="pt")
        return pipe(**kwargs).images

    def runs(label: str, n: int) -> tuple[torch.Tensor, float]:
        """The last output (every run gives the same: fresh seeded generator) and the median time of `n` runs."""
        times, output = [], None
        for i in range(n):
            _progress(pipe, f"{label} {i + 1}/{n}", leave=i == n - 1)
            seconds, output = bench.timed(call, device)
            times.append(seconds)
        return output, statistics.median(times)

    call()  # warm-up: one-time allocations and lazy initialisation, untimed
    plain, t_plain = runs("plain  ", args.runs)
    handle = hookkit.enable(pipe, spec)
    hooked, t_hooked = runs("hookkit", args.runs)
    summary = handle.summary()
    hookkit.disable(pipe)
    after, _ = runs("after disable", 1)

    print()
    print(summary)
    print()
    print(table(["run", f"median of {args.runs} (s)", "speed-up"],
                [["plain diffusers", f"{t_plain:.4f}", "1.00x"],
                 ["hookkit", f"{t_hooked:.4f}", f"{t_plain / t_hooked:.2f}x"]]))
    if torch.equal(hooked, plain):
        print("hookkit output vs plain: bitwise equal")
    else:
        why = ""
        if spec.cache is not None:
            ts = spec.cache.taylorseer_order
            why = " (cached steps reuse the middle blocks' residuals" + (
                f", extrapolated by TaylorSeer order {ts})" if ts else ")")
        print(f"hookkit output vs plain: PSNR {bench.psnr(plain, hooked, peak=1.0):.2f} dB{why}")
    equal = torch.equal(after, plain)
    print(f"after hookkit.disable: output bitwise equal to the plain run: {equal}")
    return 0 if equal else 1


# --- generate --------------------------------------------------------------------------------------------


#: defaults of the flags that mean something only with --cache: argparse's defaults and the check below
#: that refuses them without --cache read this one table
CACHE_FLAG_DEFAULTS: dict[str, Any] = {
    "cache_mask": None, "cache_mode": "dynamic", "cache_fn": 1, "cache_bn": 0, "cache_threshold": 0.12,
    "cache_warmup": None, "cache_max_continuous": None, "cache_taylorseer": None,
}


def spec_from_args(args: argparse.Namespace) -> hookkit.Spec:
    """The `Spec` the generate flags ask for (validated by the specs themselves)."""
    if not args.cache:
        for dest, default in CACHE_FLAG_DEFAULTS.items():
            value = getattr(args, dest)
            if value != default:
                raise SpecError(f"--{dest.replace('_', '-')} {value}: only with --cache. Add --cache.")
    if args.compile_mode is not None and not (args.compile or args.cuda_graphs):
        raise SpecError(f"--compile-mode {args.compile_mode}: only with --compile or --cuda-graphs. Add --compile.")
    cache = None
    if args.cache:
        masked = args.cache_mask is not None
        cache = hookkit.DBCache(
            fn_blocks=args.cache_fn, bn_blocks=args.cache_bn, threshold=args.cache_threshold,
            warmup_steps=args.cache_warmup if args.cache_warmup is not None else (0 if masked else 8),
            max_continuous_cached_steps=args.cache_max_continuous if args.cache_max_continuous is not None
            else (-1 if masked else 3),
            steps_mask=args.cache_mask, mask_policy=args.cache_mode,
            taylorseer_order=args.cache_taylorseer if args.cache_taylorseer is not None
            else (0 if masked else hookkit.DBCache().taylorseer_order),
        )
    compile_ = None
    if args.compile or args.cuda_graphs:
        compile_ = hookkit.Compile(regional=True, mode=args.compile_mode,
                                   cuda_graphs="transformer" if args.cuda_graphs else "none")
    quantize = hookkit.Quantize(scheme=args.quantize) if args.quantize else None
    return hookkit.Spec(cache=cache, quantize=quantize, compile=compile_, sync_free=args.sync_free, memo=args.memo)


def optimization_tag(spec: hookkit.Spec) -> str:
    """A short name of what is on, in the spirit of cache-dit's `DBCache_F1B0_W8MC3_R0.12_nvfp4`."""
    parts = []
    if spec.cache is not None:
        c = spec.cache
        parts.append(f"DBCache_F{c.fn_blocks}B{c.bn_blocks}_W{c.warmup_steps}MC{c.max_continuous_cached_steps}"
                     f"_R{c.threshold:g}" + (f"_TS{c.taylorseer_order}" if c.taylorseer_order else ""))
        if c.steps_mask is not None:
            mask = c.steps_mask if isinstance(c.steps_mask, str) else "custom"
            parts.append(f"SCM-{mask}-{c.mask_policy}")
    if spec.quantize is not None:
        parts.append(spec.quantize.scheme)
    if spec.compile is not None:
        parts.append("compile" + ("" if spec.compile.mode is None else f"-{spec.compile.mode}")
                     + ("-regional" if spec.compile.regional else ""))
        if spec.compile.cuda_graphs != "none":
            parts.append("cudagraphs")
    if spec.memo:
        parts.append("memo")
    if spec.sync_free:
        parts.append("syncfree")
    if spec.parallel is not None:
        parts.append(f"CP-U{spec.parallel.ulysses}R{spec.parallel.ring}")
    return "_".join(parts) if parts else "eager"


def _feature_lines(summary: Any) -> list[str]:
    """Seed-002-style lines from `handle.summary()`: cached steps, quantized layers, other features."""
    lines = []
    for name, feature in summary.features.items():
        data = feature.data
        stats = bench.cache_stats({name: data}) if name == "cache" else None
        if stats is not None:
            cached = sorted({s for b in data["branches"].values() for s in b.get("cached", ())})
            lines.append(f"Cached Steps: {stats[0]} of {stats[1]} transformer steps"
                         + (f", steps {cached}" if cached else "")
                         + (f"; block calls run: {data['block_calls']} of {data['block_calls_uncached']}"
                            if "block_calls" in data and "block_calls_uncached" in data else ""))
        elif name == "quantize" and "quantized" in data:
            lines.append(f"Quantized Linear Layers: {data['quantized']} {data.get('scheme', '')}, "
                         f"skipped {data.get('skipped', '?')}, total {data.get('total', '?')}")
        elif name == "memo" and "hits" in data:
            lines.append(f"Memoized Tensors: {data['hits']} hits, {data.get('misses', '?')} misses "
                         f"({data.get('scope', '?')} scope)")
        elif name == "sync_free" and "host_reads" in data:
            lines.append(f"Sync-free Loop: {data.get('scheduler', '?')}, timestep reads answered on the host: "
                         f"{data['host_reads']}, schedule copies: {data.get('host_copies', '?')}")
        elif name == "compile" and "regions" in data:
            lines.append(f"Compiled: {data['regions']} regions, mode {data.get('mode', 'default')}"
                         + (f", CUDA graphs: {data['cuda_graphs']}" if data.get("cuda_graphs", "none") != "none" else "")
                         + (" (no CUDA graphs on this device)" if data.get("cudagraph_trees") is False else ""))
        else:
            first = feature.text.strip().splitlines()[0] if feature.text.strip() else ""
            lines.append(f"{name}: {first}")
    return lines


def _size_of(output: Any, latent: bool, kwargs: dict[str, Any]) -> str:
    """`HxW` of what the pipeline produced (latents: what was asked, or the pipeline's default)."""
    if not latent:
        first = output[0][0] if isinstance(output[0], list) else output[0]
        width, height = first.size
        return f"{height}x{width}"
    if "height" in kwargs and "width" in kwargs:
        return f"{kwargs['height']}x{kwargs['width']}"
    return "default-size"


def _check_image_suffix(out: Path) -> None:
    """Refuse an --out that PIL cannot write before minutes of generation, not after."""
    from PIL import Image

    known = Image.registered_extensions()
    if out.suffix.lower() not in known:
        raise SpecError(f"--out {out}: expected a file name ending in an image format PIL writes "
                        f"(.png, .jpg, .webp, .gif, ...), got suffix {out.suffix or 'none'!r}. Add one, e.g. {out.stem}.png.")


def _save(output: Any, out: Path, latent: bool, video: bool) -> list[Path]:
    """Write images as PNG, videos as GIF (or one PNG per frame when `out` ends in .png), latents as .pt."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if latent:
        path = out.with_suffix(".pt")
        torch.save(output.detach().float().cpu(), path)
        return [path]
    items = list(output)
    paths = []
    for i, item in enumerate(items):
        target = out if len(items) == 1 else out.with_name(f"{out.stem}_{i}{out.suffix}")
        if not video:
            item.save(target)
            paths.append(target)
        elif target.suffix.lower() == ".png":
            for j, frame in enumerate(item):
                frame_path = target.with_name(f"{target.stem}.frame{j:03d}.png")
                frame.save(frame_path)
                paths.append(frame_path)
        else:
            item[0].save(target, save_all=True, append_images=list(item[1:]), duration=125, loop=0)
            paths.append(target)
    return paths


def cmd_generate(args: argparse.Namespace) -> int:
    opts = _model_options(args, args.model)
    bench.check_model(opts)
    spec = spec_from_args(args)
    if args.parallel is not None:  # under torchrun: join the group, one device per rank, diffusers shards
        spec = attrs.evolve(spec, parallel=distributed.parse_parallel(args.parallel))
        opts = attrs.evolve(opts, device=distributed.init_distributed(opts.device))
    device = bench.resolve_device(opts.device)
    dtype = bench.resolve_dtype(opts.dtype, device)
    latent = opts.full
    if args.out is not None and not latent:
        _check_image_suffix(Path(args.out))
    steps = opts.num_steps()

    load_s, pipe = bench.timed(lambda: bench.load_pipeline(opts), device)
    enable_s, handle = bench.timed(lambda: hookkit.enable(pipe, spec), device)
    output_type = "latent" if latent else "pil"
    warmup_s = 0.0
    for i in range(args.warmup):
        _progress(pipe, f"warmup {i + 1}/{args.warmup}")
        seconds, _ = bench.timed(lambda: pipe(**bench.call_kwargs(pipe, opts, output_type)), device)
        warmup_s += seconds
    _progress(pipe, "inference")
    kwargs = bench.call_kwargs(pipe, opts, output_type)
    infer_s, result = bench.timed(lambda: pipe(**kwargs), device)
    output = bench.output_of(result)
    video = hasattr(result, "frames")  # what the pipeline returned, not a list of model names
    summary = handle.summary()

    tag = optimization_tag(spec)
    size = _size_of(output, latent, kwargs)
    if args.out is not None:
        out = Path(args.out)
    else:
        out = Path(f"{opts.name}.{size}.{tag}" + (".pt" if latent else ".gif" if video else ".png"))
    paths = _save(output, out, latent, video) if distributed.is_main() else []
    ranks = None
    if spec.parallel is not None:  # every rank: the gather needs them all
        ranks = distributed.check_same_decisions({n: f.data for n, f in summary.features.items()}, "generate")
    if not distributed.is_main():
        return 0

    if args.summary:
        print(summary)
        print()
    source = (f"local pipeline {opts.model_path}"
              + ("" if bench.has_text_encoder(pipe) else ", no text encoder: random prompt embeddings")
              if opts.model_path else
              f"{'full-size' if opts.full else 'tiny'} architecture from config, random weights, random prompt embeddings")
    lines = [
        f"Model: {opts.name} ({summary.transformer} in {summary.pipeline}; {source})",
        f"Optimization: {tag}",
        *_feature_lines(summary),
        f"Device: {bench.device_description(device)}, {str(dtype).removeprefix('torch.')}",
        f"Input: {size}, {steps} steps, "
        f"batch {opts.batch}, seed {opts.seed}",
        f"Load Time: {load_s:.2f}s",
        f"Enable Time: {enable_s:.2f}s",
        f"Warmup Time: {warmup_s:.2f}s ({args.warmup} run{'s' if args.warmup != 1 else ''})",
        f"Inference Time: {infer_s:.2f}s",
    ]
    if spec.parallel is not None:
        lines.append(f"Parallel: {ranks} ranks, context parallel ulysses {spec.parallel.ulysses} x ring "
                     f"{spec.parallel.ring}; DBCache decisions identical on every rank")
    if latent:
        lines.append("Decoding: skipped for --full (output_type='latent'); latents saved as a tensor")
    lines.append(f"Saved: {', '.join(str(p) for p in paths[:4])}" + (f" (+{len(paths) - 4} more)" if len(paths) > 4 else ""))
    print("hookkit generate summary")
    print("\n".join(f"- {line}" for line in lines))
    # No handle.remove(): the process ends here, and quantization without keep_original cannot be undone.
    return 0


# --- bench -----------------------------------------------------------------------------------------------


def _print_report(data: dict[str, Any], json_path: str | None) -> None:
    env, model = data["environment"], data["model"]
    kind = "full-size" if model["full"] else "local" if model["model_path"] else "tiny"
    size = ("the model's default size" if model["height"] is None and model["width"] is None else
            f"{model['height'] or 'default'}x{model['width'] or 'default'}")
    print(f"hookkit bench: {model['name']} ({kind}), {size}, "
          f"{model['steps']} steps, batch {model['batch']}, {model['dtype']}, {env['device']}; torch {env['torch']}, "
          f"diffusers {env['diffusers']}; median of {data['runs']} runs after {data['warmup']} warm-up; "
          f"memory: {data['memory']}; PSNR on {'latents' if model['output'] == 'latent' else 'decoded images'}")
    print()
    print(bench.markdown_table(data["rows"]))
    for note in data["notes"]:
        print(f"- {note}")
    if json_path:
        bench.write_json(Path(json_path), data)
        print(f"\nJSON written to {json_path}")


def _progress_line(message: str) -> None:
    """Per-configuration progress of `hookkit bench`, on stderr so that stdout is the table."""
    print(message, file=sys.stderr, flush=True)


def cmd_bench(args: argparse.Namespace) -> int:

    if args.quality:  # main() hands `bench --quality` to the quality harness before parsing
        raise SpecError("--quality: expected `hookkit [-v] bench --quality [options]`, got it after other options.")
    if args.merge:
        data = bench.merge_reports([bench.read_report(Path(p)) for p in args.merge])
        _print_report(data, args.json)
        return 0
    device = bench.resolve_device(args.device)
    if args.list:
        have = bench.available_fields()
        rows = [[c.name, c.kind, c.description, c.unavailable(device, have) or "yes"] for c in bench.CONFIGS.values()]
        print(table(["config", "kind", "what", "runs here"], rows))
        return 0
    opts = _model_options(args, args.model)
    bench.check_model(opts)
    if args.runs < 1 or args.warmup < 0:
        raise SpecError(f"--runs/--warmup: expected runs >= 1 and warmup >= 0, got {args.runs} and {args.warmup}.")
    names = [n.strip() for n in args.configs.split(",") if n.strip()] if args.configs else None
    configs, notes = bench.select_configs(names, device)
    if args.parallel is not None:  # under torchrun: every rank measures in-process, rank 0 reports
        cp = distributed.parse_parallel(args.parallel)
        opts = attrs.evolve(opts, device=distributed.init_distributed(opts.device))
        rows = distributed.run_matrix(configs, opts, args.runs, args.warmup,
                                      Path(args.out_dir) if args.out_dir else None, cp, log=_progress_line)
        notes = [*notes, f"context parallel ulysses {cp.ulysses} x ring {cp.ring} over "
                         f"{torch.distributed.get_world_size()} ranks (diffusers' enable_parallelism)"]
        if not distributed.is_main():
            return 0 if rows[0]["status"] == "ok" else 1
    else:
        rows = bench.run_matrix(configs, opts, args.runs, args.warmup, args.timeout,
                                Path(args.out_dir) if args.out_dir else None, log=_progress_line)
    data = bench.report(rows, notes, opts, args.runs, args.warmup, args.argv)
    _print_report(data, args.json)
    return 0 if rows[0]["status"] == "ok" else 1


def cmd_bench_one(args: argparse.Namespace) -> int:
    """One row of `hookkit bench`, in this process; writes the row as JSON to --result."""
    opts = _model_options(args, args.model)
    if args.config not in bench.CONFIGS:
        raise SpecError(f"--config: unknown configuration {args.config!r}; known: {list(bench.CONFIGS)}.")
    row = bench.measure(bench.CONFIGS[args.config], opts, args.runs, args.warmup, Path(args.out_dir))
    text = bench.to_json(row)
    if args.result:
        Path(args.result).write_text(text)
    print(text)
    return 0


# --- parser ----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hookkit", description="Hook-based optimizations for diffusers pipelines.")
    parser.add_argument("-v", "--verbose", action="store_true", help="hookkit attach/detach log and library warnings")
    parser.add_argument("--version", action="version", version=f"hookkit {hookkit.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("demo", help="tiny Flux on the CPU: plain vs hookkit, summary, timings, exact restore")
    p.add_argument("--steps", type=int, default=28, help="denoising steps (default 28)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--height", type=int, default=32)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--runs", type=int, default=3, help="timed runs per variant (median)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (default 1: the tiny model needs no more)")
    p.set_defaults(func=cmd_demo)

    models = sorted(hookkit.list_adapters())
    p = sub.add_parser("generate", help="one generation with the chosen optimizations, saved to a file")
    p.add_argument("model", metavar="MODEL", help=f"a shipped adapter name: {', '.join(models)}")
    p.add_argument("--compile", action="store_true", help="regional torch.compile of the repeated blocks")
    p.add_argument("--compile-mode", default=None, choices=[m for m in COMPILE_MODES if m], help="torch.compile mode")
    p.add_argument("--cuda-graphs", action="store_true", help="one CUDA graph per transformer call (implies --compile; GPU)")
    p.add_argument("--quantize", default=None, choices=QUANT_SCHEMES, metavar="SCHEME",
                   help=f"torchao quantization: {', '.join(QUANT_SCHEMES)}")
    p.add_argument("--cache", action="store_true", help="DBCache (F1B0, W8, MC3, R0.12, TaylorSeer order 1 unless set below)")
    p.add_argument("--cache-mask", default=CACHE_FLAG_DEFAULTS["cache_mask"], choices=sorted(MASK_POLICIES), metavar="POLICY",
                   help=f"step computation mask: {', '.join(MASK_POLICIES)} (then warm-up 0, no run limit by default)")
    p.add_argument("--cache-mode", default=CACHE_FLAG_DEFAULTS["cache_mode"], choices=("dynamic", "static"),
                   help="masked steps: cache when the residual change is small (dynamic) or always (static)")
    p.add_argument("--cache-fn", type=int, default=CACHE_FLAG_DEFAULTS["cache_fn"], help="first blocks always computed")
    p.add_argument("--cache-bn", type=int, default=CACHE_FLAG_DEFAULTS["cache_bn"], help="last blocks always computed")
    p.add_argument("--cache-threshold", type=float, default=CACHE_FLAG_DEFAULTS["cache_threshold"], help="relative L1 residual threshold")
    p.add_argument("--cache-warmup", type=int, default=CACHE_FLAG_DEFAULTS["cache_warmup"], help="steps always computed first (default 8, 0 with a mask)")
    p.add_argument("--cache-max-continuous", type=int, default=CACHE_FLAG_DEFAULTS["cache_max_continuous"],
                   help="cached steps in a row (default 3, -1 with a mask)")
    p.add_argument("--cache-taylorseer", type=int, default=CACHE_FLAG_DEFAULTS["cache_taylorseer"], choices=[0, 1, 2],
                   help="TaylorSeer order of cached residuals (default: DBCache's, 0 with a mask)")
    p.add_argument("--sync-free", action="store_true", help="no host syncs in the denoising loop")
    p.add_argument("--memo", action="store_true", help="memoize per-step index tensors")
    p.add_argument("--summary", action="store_true", help="print handle.summary() (hooks, per-feature statistics)")
    p.add_argument("--parallel", default=None, metavar="KEY=VALUE,...",
                   help="context parallelism under torchrun, e.g. ulysses=2 or ring=2,attention_backend=_native_cudnn")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs before the timed one (compilation happens here)")
    p.add_argument("--out", default=None, help="output file (.png; .gif or .png frames for video; .pt with --full)")
    _add_model_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("bench", help="a matrix of configurations, one process each, as a markdown table")
    p.add_argument("--model", default="flux", choices=models, help="model family (default flux)")
    p.add_argument("--configs", default=None,
                   help=f"comma-separated rows (default: all that run here): {', '.join(bench.CONFIGS)}")
    p.add_argument("--runs", type=int, default=3, help="timed runs per configuration (median)")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs first (compilation, CUDA graph capture)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    p.add_argument("--out-dir", default=None, help="keep each configuration's output (.pt) and row (.json) here")
    p.add_argument("--timeout", type=float, default=bench.default_timeout(), help="seconds per configuration")
    p.add_argument("--list", action="store_true", help="list the configurations and whether they run here")
    p.add_argument("--parallel", default=None, metavar="KEY=VALUE,...",
                   help="under torchrun: every configuration context-parallel (e.g. ulysses=2), rank 0 reports")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="print one table from several --json files of the same model and settings (runs nothing)")
    p.add_argument("--quality", action="store_true",
                   help="speed-up vs quality on hookkit's trained tiny Flux instead (takes hookkit.tools.quality's options: "
                        "`hookkit bench --quality --help`)")
    _add_model_args(p)
    p.set_defaults(func=cmd_bench, argv=None)

    p = sub.add_parser("bench-one", help="(internal) one configuration of `hookkit bench`, as JSON")
    p.add_argument("--config", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--result", default=None)
    _add_model_args(p)
    p.set_defaults(func=cmd_bench_one)
    return parser


#: flags that go before the command (`hookkit -v bench ...`)
GLOBAL_FLAGS = ("-v", "--verbose")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `hookkit` console script and `python -m hookkit`. Returns the exit code."""
    argv = list(argv) if argv is not None else sys.argv[1:]
    lead = 0  # global flags before the command
    while lead < len(argv) and argv[lead] in GLOBAL_FLAGS:
        lead += 1
    if argv[lead:lead + 1] == ["bench"] and "--quality" in argv[lead + 1:]:  # the harness has its own options
        if lead:
            hookkit.set_verbosity("INFO")
        else:
            _quiet_third_party()
        from hookkit.tools.quality import quality_main

        return quality_main([a for a in argv[lead + 1:] if a != "--quality"])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.verbose:
        hookkit.set_verbosity("INFO")
    else:
        _quiet_third_party()
    if args.command == "bench":
        args.argv = argv
    try:
        return args.func(args)
    except HookkitError as exc:
        print(f"hookkit {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(f"hookkit {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
