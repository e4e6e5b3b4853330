"""The `hookkit` command line (also `python -m hookkit`).

    hookkit demo                         trained tiny Flux on the CPU: plain vs hookkit side by side in a PNG
    hookkit generate flux --cache ...    one generation with the chosen optimizations, saved to a file
    hookkit bench --configs eager,...    a matrix of configurations, one process each, as a markdown table

Everything runs without downloads: models are built from config with random weights (`hookkit.tools.zoo`),
tiny on the CPU or full size with `--full`, unless `--model-path` names a local pipeline folder.
A flag whose feature this machine or installation lacks fails with hookkit's own error message and exit
code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

import hookkit
from hookkit.tools import bench, distributed, zoo
from hookkit.tools.bench import ModelOptions
from hookkit.errors import HookkitError, SpecError, UnsupportedError
from hookkit.techniques.cache.spec import MASK_POLICIES
from hookkit.techniques.compile.spec import COMPILE_MODES
from hookkit.techniques.quantize.spec import QUANT_SCHEMES
from hookkit.core.summary import table
from hookkit.tools import local
from hookkit.tools.meta import meta_device
from hookkit.tools.demo import DEFAULT_CLASSES as DEMO_CLASSES

EXIT_ERROR = 2  # usage errors and unavailable features, like argparse's own


# --- shared --------------------------------------------------------------------------------------------


def _created_folder(folder: Path, flag: str) -> Path:
    """`folder`, created now (with its parents) rather than after the work whose results go in it."""
    local.check_folder(folder, flag, str(folder))
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SpecError(f"{flag} {folder}: expected a folder hookkit can create, got {type(exc).__name__}: "
                        f"{exc.strerror or exc}. Pass another folder.") from None
    return folder


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
    # torch's AOTAutograd cache about torchao's quantized weights (attributed to torch, not torchao); the compile
    # feature filters it too (`compile.regional.quiet_subclass_cache_hash_warning`)
    warnings.filterwarnings("ignore", message=r".*_stable_hash_for_caching", category=UserWarning)


def _model_options(args: argparse.Namespace, name: str) -> ModelOptions:
    if args.prompt is not None and args.model_path is None:
        raise SpecError(f"--prompt {args.prompt!r}: only with --model-path (a local pipeline with text encoders); "
                        "tiny and --full models get random prompt embeddings. Drop --prompt or add --model-path.")
    if args.threads is None and args.model_path is None and not args.full and bench.resolve_device(args.device).type == "cpu":
        # a tiny model on the CPU: as `demo`, one thread (more only add launch and sync overhead to such small
        # layers, and steal cores from whatever else runs); --threads N overrides
        args.threads = 1
    if args.threads is not None:  # last: an error above leaves the process's thread count alone
        if args.threads < 1:
            raise SpecError(f"--threads: expected an int >= 1, got {args.threads}.")
        torch.set_num_threads(args.threads)
    prompt = ModelOptions.prompt_default() if args.prompt is None else args.prompt
    return ModelOptions(name=name, full=args.full, model_path=args.model_path, device=args.device, dtype=args.dtype,
                        steps=args.steps, height=args.height, width=args.width, batch=args.batch, seed=args.seed,
                        threads=args.threads, prompt=prompt, frames=args.frames, arch=args.arch)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=None,
                   help="denoising steps (default: 6 tiny; full: the pipeline's, 50 for Wan, else 28; local 28)")
    p.add_argument("--height", type=int, default=None, help="output height (default: the model's)")
    p.add_argument("--width", type=int, default=None, help="output width (default: the model's)")
    p.add_argument("--frames", type=int, default=None,
                   help="video frames (default: the pipeline's, 81 for Wan; Wan takes 4k+1)")
    p.add_argument("--arch", default=None, choices=sorted(zoo.FULL_ARCHITECTURES), metavar="NAME",
                   help="with --full: which published architecture (" + ", ".join(
                       a.describe() for a in zoo.FULL_ARCHITECTURES.values()) + "; default: the family's smallest)")
    p.add_argument("--batch", type=int, default=1, help="images (or videos) per call")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights, embeddings and latents")
    p.add_argument("--model-path", default=None, help="a local diffusers pipeline folder (no downloads)")
    p.add_argument("--full", action="store_true",
                   help="the full-size architecture (random weights) instead of the tiny one; skips decoding")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when visible)")
    p.add_argument("--dtype", default=None, choices=sorted(bench.DTYPES), help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: 1 for a tiny model on the CPU, as `demo`; "
                        "torch's choice otherwise)")
    p.add_argument("--prompt", default=None,
                   help=f"text prompt, only with --model-path (default {ModelOptions.prompt_default()!r}; a folder "
                        "without text encoders, tiny and --full models get random embeddings)")


def _progress(pipe: Any, desc: str, leave: bool = True) -> None:
    """Turn diffusers' own per-step progress bar (tqdm, on stderr) back on, labelled."""
    pipe.set_progress_bar_config(disable=False, desc=desc, leave=leave, dynamic_ncols=True)


# --- demo ------------------------------------------------------------------------------------------------


def cmd_demo(args: argparse.Namespace) -> int:
    from hookkit.tools import demo

    for flag, value in (("--steps", args.steps), ("--threads", args.threads)):
        if value < 1:
            raise SpecError(f"--{flag.lstrip('-')}: expected an int >= 1, got {value}.")
    classes = [c.strip() for c in args.classes.split(",") if c.strip()]
    if not classes:
        raise SpecError(f"--classes: expected comma-separated class names, got {args.classes!r}. "
                        f"Give e.g. --classes 'red circle,green square'.")
    out = Path(args.out)
    if out.suffix.lower() != ".png":  # the grid's labels go into a PNG text chunk
        raise SpecError(f"--out {out}: expected a .png file name, got suffix {out.suffix or 'none'!r}. "
                        f"Pass e.g. --out {out.with_suffix('.png')}.")
    local.check_output_file(out, "--out")
    # One thread by default: a tiny model gains nothing from more, and timings stay stable on a busy machine.
    return demo.run_demo(classes, args.steps, args.seed, out, args.threads, args.model)


# --- generate --------------------------------------------------------------------------------------------


#: the flags that mean something only with --cache, all defaulting to None ("not given"), so that one given
#: without --cache is refused even at DBCache's own value (`--cache-fn 1`); unset, they take `DBCache()`'s values
CACHE_FLAG_DEFAULTS: dict[str, Any] = {
    "cache_mask": None, "cache_mode": None, "cache_fn": None, "cache_bn": None, "cache_threshold": None,
    "cache_warmup": None, "cache_max_continuous": None, "cache_taylorseer": None,
}


#: generate's flags that build a Spec: refused beside --spec, which gives the whole Spec
SPEC_FLAGS = ("cache", "compile", "cuda_graphs", "quantize", "sync_free", "memo")


def spec_from_args(args: argparse.Namespace) -> hookkit.Spec:
    """The `Spec` the generate flags ask for (validated by the specs themselves), or the one in `--spec`'s file."""
    if getattr(args, "spec", None) is not None:
        given = [f for f in SPEC_FLAGS if getattr(args, f)] + [
            d for d, default in CACHE_FLAG_DEFAULTS.items() if getattr(args, d) != default]
        if given:
            raise SpecError(f"--spec {args.spec}: the file gives the whole Spec, got --{given[0].replace('_', '-')} "
                            "beside it. Drop one of them (or edit the JSON).")
        return bench.read_spec(args.spec)
    if not args.cache:
        for dest, default in CACHE_FLAG_DEFAULTS.items():
            value = getattr(args, dest)
            if value != default:
                raise SpecError(f"--{dest.replace('_', '-')} {value}: only with --cache. Add --cache.")
    if args.compile_mode is not None and not (args.compile or args.cuda_graphs):
        raise SpecError(f"--compile-mode {args.compile_mode}: only with --compile or --cuda-graphs. Add --compile.")
    cache = None
    if args.cache:
        # Unset flags leave `hookkit.DBCache()`'s defaults: the calibration-free schedule, unless a flag only the
        # threshold rule reads (--cache-threshold, --cache-mask) picks that rule. A mask is the schedule, so with one
        # the warm-up is 0 and TaylorSeer off unless asked for.
        masked = args.cache_mask is not None
        given = {"fn_blocks": args.cache_fn, "bn_blocks": args.cache_bn, "threshold": args.cache_threshold,
                 "warmup_steps": args.cache_warmup if args.cache_warmup is not None else (0 if masked else None),
                 "max_continuous_cached_steps": args.cache_max_continuous, "steps_mask": args.cache_mask,
                 "mask_policy": args.cache_mode,
                 "taylorseer_order": args.cache_taylorseer if args.cache_taylorseer is not None
                 else (0 if masked else None)}
        cache = hookkit.DBCache(**{k: v for k, v in given.items() if v is not None})
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
        warmup = "auto" if c.warmup_steps is None else c.warmup_steps
        decides = f"_R{c.threshold:g}" if c.threshold is not None else f"_{c.rule}{c.speedup:g}x"
        parts.append(f"DBCache_F{c.fn_blocks}B{c.bn_blocks}_W{warmup}MC{c.max_continuous_cached_steps}"
                     + decides + (f"_TS{c.taylorseer_order}" if c.taylorseer_order else ""))
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
    """One short line per feature from `handle.summary()` (cached steps, quantized layers, other features): what a
    user checks after a run, without the full table."""
    lines = []
    for name, feature in summary.features.items():
        data = feature.data
        stats = bench.cache_stats({name: data}) if name == "cache" else None
        if stats is not None:
            lines.extend(_cache_lines(data, stats))
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


def _cache_lines(data: dict[str, Any], stats: tuple[int, int]) -> list[str]:
    """The DBCache line(s) of `generate`'s output. One branch: "Cached Steps: 2 of 6 transformer steps, steps [2, 4]".
    CFG branches (one transformer call each per step) are counted apart, each under its name (the pipeline's
    `cache_context` name, or "branch i"), never summed into one step list. When nothing was cached, why."""
    branches = data["branches"]
    names = data.get("branch_names") or {}
    blocks = (f"; block calls run: {data['block_calls']} of {data['block_calls_uncached']}"
              if "block_calls" in data and "block_calls_uncached" in data else "")
    why = data.get("no_cache_brief")
    if len(branches) <= 1:
        cached = next(iter(branches.values()), {}).get("cached", [])
        if stats[0] == 0 and why:
            return [f"Cached Steps: 0 of {stats[1]} transformer steps: {why}"]
        return [f"Cached Steps: {stats[0]} of {stats[1]} transformer steps" + (f", steps {cached}" if cached else "")
                + blocks]
    head = f"Cached Steps: {stats[0]} of {stats[1]} transformer calls ({len(branches)} CFG branches, one call per step each)"
    if stats[0] == 0 and why:
        return [f"{head}: {why}"]
    lines = [head + blocks]
    for index, b in branches.items():
        cached, steps = b.get("cached", []), len(b.get("cached", ())) + len(b.get("computed", ()))
        lines.append(f"  - {names.get(index, f'branch {index}')}: {len(cached)} of {steps} steps cached"
                     + (f", steps {cached}" if cached else ""))
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


def _resolve_model(args: argparse.Namespace) -> None:
    """MODEL may be a folder (then it is --model-path) or left out with --model-path: read from model_index.json."""
    if args.model is not None and args.model not in hookkit.list_adapters() and Path(args.model).is_dir():
        if args.model_path is not None:
            raise SpecError(f"MODEL {args.model!r} is a folder and --model-path {args.model_path!r} is another; give one.")
        args.model_path, args.model = args.model, None
    if args.model is not None and args.model not in hookkit.list_adapters() and "/" in args.model:
        raise SpecError(f"MODEL {args.model!r}: no such folder (a path, not a shipped adapter name). Give an existing "
                        "pipeline folder or one of: " + ", ".join(sorted(hookkit.list_adapters())) + ".")
    if args.model is None:
        if args.model_path is None:
            raise SpecError(f"MODEL: expected a shipped adapter name ({', '.join(sorted(hookkit.list_adapters()))}) "
                            "or a local pipeline folder, got neither. Add one, e.g. `hookkit generate flux`.")
        folder = Path(args.model_path)
        args.model = local.model_of(local.read_index(folder), folder)


def vae_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """The `--vae-*` flags given, as typed."""
    return tuple(flag for flag in local.VAE_OPTIONS if getattr(args, flag.lstrip("-").replace("-", "_")))


def call_options(args: argparse.Namespace) -> local.CallOptions:
    """The call options of `generate`'s flags; `--image` is read here, before any model is built."""
    image = local.load_image(args.image) if args.image is not None else None
    return local.CallOptions(guidance_scale=args.guidance_scale, negative_prompt=args.negative_prompt,
                             true_cfg_scale=args.true_cfg_scale, num_images=args.num_images,
                             loras=tuple(local.Lora.parse(t) for t in args.lora), cpu_offload=args.cpu_offload,
                             image=image, vae_flags=vae_flags(args))


def precheck_generate(args: argparse.Namespace, opts: ModelOptions, spec: hookkit.Spec, options: local.CallOptions,
                      device: torch.device, dtype: torch.dtype) -> None:
    """Everything that needs no weights, before any are read (a FLUX.1-dev folder is tens of GB)."""
    if args.cuda_graphs and device.type != "cuda":
        raise UnsupportedError(f"--cuda-graphs: captures CUDA graphs and needs a CUDA device; this run is on {device}. "
                               "Drop --cuda-graphs (--compile alone compiles the repeated blocks here).")
    if args.cuda_graphs and args.compile_mode not in (None, "default", "max-autotune-no-cudagraphs"):
        raise SpecError(f"--compile-mode {args.compile_mode} with --cuda-graphs: hookkit captures the graphs itself. "
                        "Use --compile-mode default or max-autotune-no-cudagraphs, or drop --compile-mode.")
    if spec.quantize is not None:
        from hookkit.techniques.quantize.torchao import check_hardware

        try:
            check_hardware(spec.quantize.scheme, [device])
        except UnsupportedError as exc:
            raise UnsupportedError(str(exc).replace(f"Quantize.scheme={spec.quantize.scheme!r}",
                                                    f"--quantize {spec.quantize.scheme}")
                                   .replace("scheme='", "--quantize '")) from None
    local.check_call_options(options, device, args.cuda_graphs)
    bench.check_size(opts, device)
    if opts.model_path is None:
        if options.negative_prompt is not None:
            raise SpecError("--negative-prompt: needs text encoders, only with --model-path (a local pipeline with "
                            "them); tiny and --full models get random prompt embeddings. Drop it or add --model-path.")
        if options.image is not None:
            local.check_image_input(None, None)
        local.check_vae_options(options.vae_flags, opts.full, None, None)
        bench.check_memory(opts, device, tiled="--vae-tiling" in options.vae_flags, offload=options.cpu_offload)
        return
    folder = Path(opts.model_path)
    index = local.read_index(folder)
    local.check_family(index, folder, opts.name)
    if options.image is not None:
        local.check_image_input(index, folder)
    local.check_vae_options(options.vae_flags, opts.full, index, folder)
    if not local.has_text_encoders(index):
        for flag, value in (("--prompt", args.prompt), ("--negative-prompt", options.negative_prompt)):
            if value is not None:
                raise SpecError(f"{flag} {value!r}: {str(folder)!r} was saved without text encoders "
                                "(model_index.json names them null), so no text can be encoded; it would run on "
                                f"random embeddings. Drop {flag}, or use a folder with its text encoders.")
    local.check_fits(folder, dtype, device, bench._available_bytes(device), options.cpu_offload)
    bench.check_memory(opts, device, tiled="--vae-tiling" in options.vae_flags, offload=options.cpu_offload)


def output_name(opts: ModelOptions, size: str, tag: str, prompt: str | None, suffix: str) -> Path:
    """`flux.a-cat-holding-a-sign.1024x1024.DBCache_....png`: model, prompt (when one was encoded), size, tag."""
    parts = [opts.name] + ([local.slug(prompt)] if prompt else []) + [size, tag]
    return Path(".".join(parts) + suffix)


def cmd_generate(args: argparse.Namespace) -> int:
    _resolve_model(args)
    opts = _model_options(args, args.model)
    bench.check_model(opts, "MODEL")
    spec = spec_from_args(args)
    if args.parallel is not None:  # under torchrun: join the group, one device per rank, diffusers shards
        spec = attrs.evolve(spec, parallel=distributed.parse_parallel(args.parallel))
        opts = attrs.evolve(opts, device=distributed.init_distributed(opts.device))
    options = call_options(args)
    device = bench.resolve_device(opts.device)
    dtype = bench.resolve_dtype(opts.dtype, device)
    latent = opts.full
    if args.out is not None:
        if not latent:
            _check_image_suffix(Path(args.out))
        local.check_output_file(Path(args.out), "--out")
    precheck_generate(args, opts, spec, options, device, dtype)
    steps = opts.num_steps()
    cache = spec.cache
    if cache is not None and cache.rule == "schedule" and cache.calibration is not None \
            and cache.calibration.steps != steps:  # before loading: the plan needs a calibration at the call's steps
        raise SpecError(f"--spec {args.spec}: its schedule rule was calibrated at {cache.calibration.steps} steps, the "
                        f"call has {steps}. Pass --steps {cache.calibration.steps}, or tune again with --steps {steps}.")
    compiling = args.compile or args.cuda_graphs
    warmup = args.warmup if args.warmup is not None else (1 if compiling else 0)
    if warmup < 0:
        raise SpecError(f"--warmup: expected an int >= 0, got {warmup}.")

    def load() -> Any:
        # With offload the weights stay on the CPU: accelerate moves each component to the GPU when it runs
        # (moving all of FLUX.1-dev there first is what offload exists to avoid).
        where = opts if options.cpu_offload is None else attrs.evolve(
            opts, device="cpu", dtype=str(dtype).removeprefix("torch."))
        pipe = bench.load_pipeline(where, "MODEL")
        local.check_size(pipe, opts.height, opts.width)
        options.prepare(pipe)
        return pipe

    load_s, pipe = bench.timed(load, device)
    enable_s, handle = bench.timed(lambda: hookkit.enable(pipe, spec), device)
    output_type = "latent" if latent else "pil"
    encoded = opts.model_path is not None and bench.has_text_encoder(pipe)
    prompt = opts.prompt if encoded else None

    def kwargs_now() -> dict[str, Any]:
        return {**bench.call_kwargs(pipe, opts, output_type), **options.call_kwargs(pipe, opts.batch)}

    warmup_s = 0.0
    for i in range(warmup):
        _progress(pipe, f"warmup {i + 1}/{warmup}")
        seconds, _ = bench.timed(lambda: pipe(**kwargs_now()), device)
        warmup_s += seconds
    _progress(pipe, "inference")
    kwargs = kwargs_now()
    infer_s, result = bench.timed(lambda: pipe(**kwargs), device)
    output = bench.output_of(result)
    video = hasattr(result, "frames")  # what the pipeline returned, not a list of model names
    summary = handle.summary()

    tag = optimization_tag(spec)
    size = _size_of(output, latent, kwargs)
    if args.out is not None:
        out = Path(args.out)
    else:
        out = output_name(opts, size, tag, prompt, ".pt" if latent else ".gif" if video else ".png")
    paths = _save(output, out, latent, video) if distributed.is_main() else []
    ranks = None
    if spec.parallel is not None:  # every rank: the gather needs them all
        ranks = distributed.check_same_decisions({n: f.data for n, f in summary.features.items()}, "generate")
    if not distributed.is_main():
        return 0

    if args.summary == "full":
        print(summary)
        print()
    elif args.summary is not None:  # fits SUMMARY_WIDTH columns; each layer and counter behind --summary full
        print(summary.render(full=False))
        print("(every detail: --summary full)")
        print()
    source = (f"local pipeline {opts.model_path}"
              + ("" if bench.has_text_encoder(pipe) else ", no text encoder: random prompt embeddings")
              if opts.model_path else
              f"{'full-size' if opts.full else 'tiny'} architecture from config, random weights and prompt embeddings")
    extras = [f"{k}={v!r}" for k, v in options.call_kwargs(pipe, opts.batch).items() if k != "image"]
    if args.image is not None:
        extras.append(f"image {args.image}")
    extras.extend(f"{flag.removeprefix('--')}" for flag in options.vae_flags)
    if options.loras:
        extras.append(f"LoRA {local.loras_text(options.loras)}")
    if options.cpu_offload:
        extras.append(f"cpu offload {options.cpu_offload}")
    caveat = bench.timing_caveat(device, tiny=not opts.full and opts.model_path is None)  # as bench's tables say
    lines = [
        f"Model: {opts.name} ({summary.transformer} in {summary.pipeline})",
        f"Weights: {source}",
        *([f"Prompt: {prompt!r}"] if prompt is not None else []),
        f"Optimization: {tag}",
        *_feature_lines(summary),
        f"Device: {bench.device_description(device)}, {str(dtype).removeprefix('torch.')}",
        f"Input: {size}" + (f", {kwargs['num_frames']} frames" if "num_frames" in kwargs else "") + f", {steps} steps, "
        f"batch {opts.batch}, seed {opts.seed}" + (f"; {', '.join(extras)}" if extras else ""),
        f"Load Time: {load_s:.2f}s",
        f"Enable Time: {enable_s:.2f}s",
        f"Warmup Time: {warmup_s:.2f}s ({warmup} run{'s' if warmup != 1 else ''}"
        + ("" if warmup or compiling else "; none needed without --compile") + ")",
        f"Inference Time: {infer_s:.2f}s",
        *([f"Note: {caveat}."] if caveat else []),
    ]
    if spec.parallel is not None:
        lines.append(f"Parallel: {ranks} ranks, context parallel ulysses {spec.parallel.ulysses} x ring "
                     f"{spec.parallel.ring}; DBCache decisions identical on every rank")
    if latent:
        lines.append("Decoding: skipped for --full (output_type='latent'); latents saved as a tensor")
    lines.append(f"Saved: {', '.join(str(p) for p in paths[:4])}" + (f" (+{len(paths) - 4} more)" if len(paths) > 4 else ""))
    print("hookkit generate summary")
    print("\n".join(line if line.startswith("  ") else f"- {line}" for line in lines))  # "  - ": a sub-line
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
        for group, names in bench.ROW_GROUPS.items():
            print(f"--configs {group}: {','.join(names)}")
        return 0
    opts = _model_options(args, args.model)
    bench.check_model(opts)
    if opts.full and device.type != "cuda" and opts.device is None:
        # refused here, in a second, not once per row in a child process each (nor after sizing the model)
        raise UnsupportedError(
            f"--full {opts.name}: no CUDA device is visible, and a full-size {opts.name} transformer takes minutes per "
            "denoising step on the CPU, for every row. Run it on a CUDA GPU, drop --full for the tiny model, or pass "
            "--device cpu to run it on the CPU anyway.")
    if args.runs < 1 or args.warmup < 0:
        raise SpecError(f"--runs/--warmup: expected runs >= 1 and warmup >= 0, got {args.runs} and {args.warmup}.")
    timeout = bench.default_timeout() if args.timeout is None else bench.check_timeout(args.timeout, "--timeout")
    bench.cold_from_environment()  # every row's process inherits it: a bad value fails here, not in each row
    bench.check_size(opts, device)
    bench.check_memory(opts, device)
    if args.json:
        local.check_output_file(Path(args.json), "--json")
    if args.out_dir:
        local.check_folder(Path(args.out_dir), "--out-dir", args.out_dir)
    names = [n.strip() for n in args.configs.split(",") if n.strip()] if args.configs else None
    if args.spec is not None:
        bench.read_spec(args.spec)  # a bad file fails now, not in a child process
        names = [*(names or ["eager"]), f"{bench.SPEC_PREFIX}{args.spec}"]
    configs, notes = bench.select_configs(names, device, eager=not args.no_eager)
    if args.parallel is not None:  # under torchrun: every rank measures in-process, rank 0 reports
        cp = distributed.parse_parallel(args.parallel)
        opts = attrs.evolve(opts, device=distributed.init_distributed(opts.device))
        rows = distributed.run_matrix(configs, opts, args.runs, args.warmup,
                                      Path(args.out_dir) if args.out_dir else None, cp, log=_progress_line)
        notes = [*notes, f"context parallel ulysses {cp.ulysses} x ring {cp.ring} over "
                         f"{torch.distributed.get_world_size()} ranks (diffusers' enable_parallelism)"]
        if not distributed.is_main():
            return _bench_status(rows)
    else:
        rows = bench.run_matrix(configs, opts, args.runs, args.warmup, timeout,
                                Path(args.out_dir) if args.out_dir else None, log=_progress_line, cold=args.cold)
    data = bench.report(rows, notes, opts, args.runs, args.warmup, args.argv)
    _print_report(data, args.json)
    return _bench_status(rows)


def _bench_status(rows: list[dict[str, Any]]) -> int:
    """`hookkit bench`'s exit status: 1 when the eager row failed (the model or the machine is broken, not a row), or,
    without one (`--no-eager`), when no row ran; a failed or skipped row is a row of the table, not an error."""
    if rows[0]["config"] == "eager":
        return 0 if rows[0]["status"] == "ok" else 1
    return 0 if any(row["status"] == "ok" for row in rows) else 1


def cmd_bench_one(args: argparse.Namespace) -> int:
    """One row of `hookkit bench`, in this process; writes the row as JSON to --result."""
    opts = _model_options(args, args.model)
    if args.config not in bench.CONFIGS and not args.config.startswith(bench.SPEC_PREFIX):
        raise SpecError(f"--config: unknown configuration {args.config!r}; known: {list(bench.CONFIGS)} or "
                        f"{bench.SPEC_PREFIX}PATH.")
    bench.check_size(opts, bench.resolve_device(opts.device))
    bench.check_memory(opts, bench.resolve_device(opts.device))
    bench.cold_from_environment()
    out_dir = _created_folder(Path(args.out_dir), "--out-dir")
    row = bench.measure(bench.config_named(args.config), opts, args.runs, args.warmup, out_dir)
    text = bench.to_json(row)
    if args.result:
        Path(args.result).write_text(text)
    print(text)
    return 0


def _model_for_derive(target: str, trust_remote_code: bool = False) -> torch.nn.Module:
    """A transformer to read: a diffusers class name, a dotted path "pkg.module.Class", or a folder with config.json
    (diffusers layout, `transformer/` subfolder or the model folder itself). Built on the meta device: no weights.
    A class outside diffusers is imported only with `trust_remote_code` (`adapters.derive.transformer_class`)."""
    from hookkit.adapters.derive import transformer_class
    from hookkit.errors import AdapterError

    folder = Path(target)
    config: dict[str, Any] | None = None
    source = ""
    if folder.exists():
        for candidate in (folder / "transformer" / "config.json", folder / "config.json"):
            if candidate.is_file():
                try:
                    config = json.loads(candidate.read_text())
                except (OSError, ValueError, RecursionError) as exc:
                    raise AdapterError(f"adapter derive: expected {str(candidate)!r} to be a readable JSON file (a "
                                       f"diffusers config.json), got {type(exc).__name__}: {exc}.") from None
                source = f"the _class_name of {str(candidate)!r}"
                break
        if not isinstance(config, dict) or "_class_name" not in config:
            raise AdapterError(f"adapter derive: expected a folder with a diffusers config.json naming its _class_name "
                               f"(the model folder or a pipeline folder with transformer/), got {target!r}.")
        if not isinstance(config["_class_name"], str) or not config["_class_name"]:
            raise AdapterError(f"adapter derive: expected {source} to be a class name, got "
                               f"{config['_class_name']!r}.")
        target = config["_class_name"]
    cls = transformer_class(target, trust_remote_code=trust_remote_code, source=source)
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        raise AdapterError(f"adapter derive: expected an nn.Module class, got {target!r} ({type(cls).__name__}).")
    try:
        with meta_device():
            if config is not None and hasattr(cls, "from_config"):
                return cls.from_config(config)
            return cls()
    except Exception as exc:  # noqa: BLE001 - a model's own constructor, whatever it raises
        raise AdapterError(f"adapter derive: expected {cls.__name__} to build from its default config, got "
                           f"{type(exc).__name__}: {exc}. Pass the model's folder (with its config.json) instead."
                           ) from None


def _calibration_inputs(args: argparse.Namespace, out: Path) -> tuple[Any, list[dict[str, Any]]]:
    """`tune`'s and `calibrate`'s pipeline and calls: the shipped trained model drawing every class per seed, or a
    local pipeline folder with `--prompt`; the output path is checked first."""
    from hookkit.tools import trained

    local.check_output_file(out, "--json")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        seeds = []
    if not seeds:
        raise SpecError(f"--seeds: expected comma-separated ints (e.g. 10,11), got {args.seeds!r}.")
    if args.steps < 2:
        raise SpecError(f"--steps: expected an int >= 2, got {args.steps}.")
    if args.model_path is None:
        pipe = trained.load_pipeline(model=args.trained)
        classes = list(range(trained.NUM_CLASSES))
        return pipe, [trained.call_kwargs(classes, [s] * len(classes), steps=args.steps, model=args.trained)
                      for s in seeds]
    folder = Path(args.model_path)
    opts = bench.ModelOptions(name=local.model_of(local.read_index(folder), folder), model_path=args.model_path,
                              steps=args.steps, prompt=args.prompt or bench.ModelOptions.prompt_default())
    pipe = bench.load_pipeline(opts)
    return pipe, [bench.call_kwargs(pipe, attrs.evolve(opts, seed=s), "pt") for s in seeds]


def cmd_tune(args: argparse.Namespace) -> int:
    """`hookkit tune`: `hookkit.tune` on the shipped trained model (default) or a local pipeline folder, the chosen Spec
    written as JSON for `generate --spec` / `bench --spec`."""
    from hookkit.tools import tune as tuning

    if args.speedup is None and args.min_psnr is None:
        raise SpecError("hookkit tune: expected --speedup S (e.g. 2) or --min-psnr DB, got neither.")
    out = Path(args.json)
    pipe, calls = _calibration_inputs(args, out)
    result = tuning.search(pipe, calls, speedup=args.speedup, min_psnr=args.min_psnr, progress=True)
    print(result.table())
    out.write_text(json.dumps(result.spec.to_dict(), indent=1) + "\n")
    print(f"chosen: {result.chosen.name} ({result.chosen.speedup:.2f}x, mean PSNR {result.chosen.psnr_mean:.2f} dB on "
          f"these calls); Spec written to {out} (hookkit generate --spec {out}, hookkit bench --spec {out})")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    """`hookkit calibrate`: one uncached run, the `CacheCalibration` (magnitude ratios, gram matrix) written as JSON."""
    from hookkit.tools import tune as tuning

    out = Path(args.json)
    pipe, calls = _calibration_inputs(args, out)
    calibration = tuning.calibrate(pipe, calls, progress=True)
    calibration.save(out)
    print(f"calibrated {calibration.model} at {calibration.steps} steps on {calibration.calls} call(s); ratios "
          f"{', '.join(f'{r:.3f}' for r in calibration.ratios or ())}; written to {out} "
          "(hookkit.DBCache(rule='magnitude' or 'schedule', calibration=hookkit.CacheCalibration.load(path)))")
    return 0


def cmd_adapter_derive(args: argparse.Namespace) -> int:
    """Print the adapter hookkit derives from the model's code, as TOML that `register_adapter` reads back."""
    from hookkit.adapters.derive import adapter_toml, derive_adapter

    model = _model_for_derive(args.model, trust_remote_code=args.trust_remote_code)
    shipped = _shipped_adapter_name(model)
    if shipped is not None:  # the derivation is then a starting point for comparison, not something to register
        print(f"hookkit adapter derive: a shipped adapter exists for {type(model).__name__}: {shipped!r} "
              f"(hookkit.get_adapter({shipped!r}); enable uses it). The derived adapter follows.", file=sys.stderr)
    print(adapter_toml(derive_adapter(model)), end="")
    return 0


def _shipped_adapter_name(model: torch.nn.Module) -> str | None:
    """The name of the registered adapter matching `model`'s exact class, or None."""
    from hookkit.errors import AdapterError

    try:
        return hookkit.resolve_adapter(model).name
    except AdapterError:
        return None


# --- parser ----------------------------------------------------------------------------------------------


class CommandParser(argparse.ArgumentParser):
    """An ArgumentParser that knows its subcommands' parsers (`commands`), so that an unknown flag is reported by
    the command it was given to, with that command's usage (`unknown_arguments`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: subcommand name -> its parser (filled by `add_command`)
        self.commands: dict[str, CommandParser] = {}


def add_command(sub: Any, parent: CommandParser, name: str, **kwargs: Any) -> CommandParser:
    """`sub.add_parser(name, ...)`, remembered in `parent.commands`."""
    p = sub.add_parser(name, **kwargs)
    parent.commands[name] = p
    return p


def unknown_arguments(parser: CommandParser, args: argparse.Namespace, extras: list[str]) -> None:
    """Report arguments no parser took, as the (sub)command they were given to does: its usage, and the closest
    flag it has ("did you mean --guidance-scale?"). Exits with argparse's code 2."""
    import difflib

    target = parser
    for dest in ("command", "adapter_command"):
        name = getattr(args, dest, None)
        if name in target.commands:
            target = target.commands[name]
    flags = [o for action in target._actions for o in action.option_strings if o.startswith("--")]
    hints = []
    for extra in extras:
        if extra.startswith("--"):
            close = difflib.get_close_matches(extra.split("=", 1)[0], flags, n=1, cutoff=0.6)
            if close:
                hints.append(f"{extra.split('=', 1)[0]}: did you mean {close[0]}?")
    target.error(f"unrecognized arguments: {' '.join(extras)}" + (f" ({'; '.join(hints)})" if hints else ""))


def build_parser() -> CommandParser:
    parser = CommandParser(prog="hookkit", description="Hook-based optimizations for diffusers pipelines.")
    parser.add_argument("-v", "--verbose", action="store_true", help="hookkit attach/detach log and library warnings")
    parser.add_argument("--version", action="version", version=f"hookkit {hookkit.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = add_command(sub, parser, "demo", help="hookkit's trained tiny Flux on the CPU: plain vs hookkit side by side in one PNG, "
                                    "summary, exact restore")
    p.add_argument("--steps", type=int, default=28, help="denoising steps (default 28, the model's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the first class's image (the next get +1, +2, ...)")
    p.add_argument("--classes", default=",".join(DEMO_CLASSES),
                   help=f"comma-separated classes to draw (default {','.join(DEMO_CLASSES)!r}; all ten: "
                        "hookkit.tools.trained.CLASSES)")
    p.add_argument("--out", default="hookkit-demo.png", help="the side-by-side PNG (default ./hookkit-demo.png)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (default 1: the tiny model needs no more)")
    p.add_argument("--model", default="tiny", help="which trained model draws: tiny (default; 6 blocks) or deep "
                                                   "(16 blocks) (hookkit.tools.trained.MODELS)")
    p.set_defaults(func=cmd_demo)

    models = sorted(hookkit.list_adapters())
    p = add_command(sub, parser, "generate", help="one generation with the chosen optimizations, saved to a file")
    p.add_argument("model", metavar="MODEL", nargs="?", default=None,
                   help=f"a model family that runs as is, with random weights ({', '.join(bench.tiny_models())}); another "
                        f"shipped adapter name ({', '.join(m for m in models if m not in bench.tiny_models())}) with "
                        "--model-path; or a local pipeline folder (then the name is read from its model_index.json; same "
                        "as --model-path)")
    p.add_argument("--compile", action="store_true", help="regional torch.compile of the repeated blocks")
    p.add_argument("--compile-mode", default=None, choices=[m for m in COMPILE_MODES if m], help="torch.compile mode")
    p.add_argument("--cuda-graphs", action="store_true", help="one CUDA graph per transformer call (implies --compile; GPU)")
    p.add_argument("--quantize", default=None, choices=QUANT_SCHEMES, metavar="SCHEME",
                   help=f"torchao quantization: {', '.join(QUANT_SCHEMES)}")
    p.add_argument("--cache", action="store_true",
                   help="hookkit.DBCache(): the calibration-free planned rule, 2x less block work, TaylorSeer 2; "
                        "--cache-threshold or --cache-mask picks the threshold rule (F1B0, threshold 0.24, TaylorSeer 1); "
                        "the flags below override one field each")
    p.add_argument("--cache-mask", default=CACHE_FLAG_DEFAULTS["cache_mask"], choices=sorted(MASK_POLICIES), metavar="POLICY",
                   help=f"step computation mask: {', '.join(MASK_POLICIES)} (then warm-up 0, no run limit by default)")
    p.add_argument("--cache-mode", default=CACHE_FLAG_DEFAULTS["cache_mode"], choices=("dynamic", "static"),
                   help="masked steps: cache when the residual change is small (dynamic, the default) or always (static)")
    p.add_argument("--cache-fn", type=int, default=CACHE_FLAG_DEFAULTS["cache_fn"], help="first blocks always computed (default: 0 with the planned rule, 1 with the threshold rule)")
    p.add_argument("--cache-bn", type=int, default=CACHE_FLAG_DEFAULTS["cache_bn"], help="last blocks always computed (default 0)")
    p.add_argument("--cache-threshold", type=float, default=CACHE_FLAG_DEFAULTS["cache_threshold"], help="relative L1 residual threshold; picks the threshold rule (its default 0.24)")
    p.add_argument("--cache-warmup", type=int, default=CACHE_FLAG_DEFAULTS["cache_warmup"], help="steps always computed first (default: the first step with the planned rule; with the threshold rule scaled to the step count, 8 at 28, and 0 with a mask)")
    p.add_argument("--cache-max-continuous", type=int, default=CACHE_FLAG_DEFAULTS["cache_max_continuous"],
                   help="cached steps in a row (default -1: no limit)")
    p.add_argument("--cache-taylorseer", type=int, default=CACHE_FLAG_DEFAULTS["cache_taylorseer"], choices=[0, 1, 2],
                   help="TaylorSeer order of cached residuals (default: DBCache's, 0 with a mask)")
    p.add_argument("--spec", default=None, metavar="JSON",
                   help="the whole Spec from a JSON file (Spec.to_dict(); `hookkit tune --json` writes one) instead of "
                        "the flags above")
    p.add_argument("--sync-free", action="store_true", help="no host syncs in the denoising loop")
    p.add_argument("--memo", action="store_true", help="memoize per-step index tensors")
    p.add_argument("--summary", nargs="?", const="brief", default=None, choices=("brief", "full"),
                   help="print handle.summary(): hooks and per-feature statistics in 100 columns (brief, the "
                        "default), or every detail (full: each quantized layer, every compile counter)")
    p.add_argument("--image", default=None, metavar="PATH",
                   help="input image of an edit or img2img pipeline (--model-path to one whose __call__ takes "
                        "`image`: FluxKontextPipeline, FluxImg2ImgPipeline, QwenImageEditPipeline, ...)")
    p.add_argument("--vae-tiling", action="store_true",
                   help="pipe.vae.enable_tiling(): decode in tiles (large images and videos in less memory)")
    p.add_argument("--vae-slicing", action="store_true",
                   help="pipe.vae.enable_slicing(): decode a batch one sample at a time")
    p.add_argument("--parallel", default=None, metavar="KEY=VALUE,...",
                   help="context parallelism under torchrun, e.g. ulysses=2 or ring=2,attention_backend=_native_cudnn")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed runs before the timed one (default: 1 with --compile or --cuda-graphs, where compilation "
                        "happens, else 0)")
    p.add_argument("--guidance-scale", type=float, default=None, help="the pipeline's guidance_scale (default: its own)")
    p.add_argument("--negative-prompt", default=None,
                   help="negative prompt: true CFG (two transformer calls per step); needs text encoders")
    p.add_argument("--true-cfg-scale", type=float, default=4.0, help="true-CFG scale with --negative-prompt (default 4)")
    p.add_argument("--num-images", type=int, default=1, help="images per prompt (num_images_per_prompt)")
    p.add_argument("--lora", action="append", default=[], metavar="PATH[:SCALE]",
                   help="load a LoRA before enabling hookkit (repeatable; scale default 1.0)")
    p.add_argument("--cpu-offload", default=None, choices=("model", "sequential"),
                   help="accelerate's offload (CUDA): model (one component on the GPU at a time; FLUX.1-dev bf16 on a "
                        "24 GB card) or sequential (layer by layer, slowest, least memory)")
    p.add_argument("--out", default=None, help="output file (.png; .gif or .png frames for video; .pt with --full)")
    _add_model_args(p)
    p.set_defaults(func=cmd_generate)

    p = add_command(sub, parser, "bench", help="a matrix of configurations, one process each, as a markdown table")
    p.add_argument("--model", default="flux", choices=models, help="model family (default flux)")
    p.add_argument("--configs", default=None,
                   help=f"comma-separated rows (default: all that run here): {', '.join(bench.CONFIGS)}; a group "
                        f"({', '.join(bench.ROW_GROUPS)}) stands for its rows; "
                        f"{bench.SPEC_PREFIX}PATH runs the Spec in a JSON file (`hookkit tune --json`)")
    p.add_argument("--spec", default=None, metavar="JSON",
                   help=f"add a row for the Spec in this JSON file (same as {bench.SPEC_PREFIX}JSON in --configs)")
    p.add_argument("--runs", type=int, default=3, help="timed runs per configuration (median)")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs first (compilation, CUDA graph capture)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    p.add_argument("--out-dir", default=None, help="keep each configuration's output (.pt) and row (.json) here")
    p.add_argument("--timeout", type=float, default=None,
                   help=f"seconds per configuration (default: ${bench.TIMEOUT_VARIABLE} or {bench.DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--cold", action="store_true",
                   help="fresh, empty inductor and Triton cache folders for every row: first-call and "
                        "time-to-first-image include all compilation and autotuning")
    p.add_argument("--no-eager", action="store_true",
                   help="run only the rows --configs names, without the eager reference row (no speed-up or PSNR): a "
                        "group of rows that `--merge` joins to a run that has it")
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

    # internal (the child process of each `hookkit bench` row): runs, but stays out of `hookkit --help`
    p = add_command(sub, parser, "bench-one", description="(internal) one configuration of `hookkit bench`, as JSON")
    p.add_argument("--config", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--result", default=None)
    _add_model_args(p)
    p.set_defaults(func=cmd_bench_one)

    def calibration_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--trained", default="tiny", help="the shipped trained model: tiny (default) or deep")
        p.add_argument("--model-path", default=None, help="a local diffusers pipeline folder instead (no downloads)")
        p.add_argument("--prompt", default=None, help="with --model-path: the calibration prompt")
        p.add_argument("--seeds", default="10,11", help="calibration seeds (default 10,11; a trained model draws every "
                                                        "class per seed); judge a tuned Spec on other seeds")
        p.add_argument("--steps", type=int, default=28, help="denoising steps (default 28): calibrations and tuned "
                                                             "Specs are per step count")

    p = add_command(sub, parser, "tune", help="the caching Spec with the best PSNR at a speed-up (or the fastest above a PSNR), "
                                    "measured on your model and seeds; written as JSON")
    p.add_argument("--speedup", type=float, default=None, help="speed-up in executed block work to reach (e.g. 2)")
    p.add_argument("--min-psnr", type=float, default=None, help="PSNR (dB) every calibration image must keep")
    p.add_argument("--json", required=True, metavar="PATH", help="where to write the chosen Spec (Spec.to_dict())")
    calibration_args(p)
    p.set_defaults(func=cmd_tune)

    p = add_command(sub, parser, "calibrate", help="one uncached run: the per-step statistics DBCache's 'magnitude' and "
                                         "'schedule' rules read, written as JSON")
    p.add_argument("--json", required=True, metavar="PATH", help="where to write the CacheCalibration")
    calibration_args(p)
    p.set_defaults(func=cmd_calibrate)

    p = add_command(sub, parser, "adapter", help="adapters: `adapter derive MODEL` prints the one hookkit derives, as TOML")
    adapter_sub = p.add_subparsers(dest="adapter_command", required=True, metavar="ACTION")
    d = add_command(adapter_sub, p, "derive", help="derive an adapter from the model's code and print it as TOML")
    d.add_argument("model", metavar="MODEL_CLASS_OR_PATH",
                   help="a diffusers class name, a dotted path pkg.module.Class, or a model folder with config.json")
    d.add_argument("--trust-remote-code", action="store_true",
                   help="import a class outside diffusers (a dotted path, or a config.json's _class_name): runs its code")
    d.set_defaults(func=cmd_adapter_derive)
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
        rest = [a for a in argv[lead + 1:] if a != "--quality"]
        if "--front" in rest:  # the Pareto-front comparison has its own options (`--quality --front --help`)
            from hookkit.tools.front import front_main

            return front_main([a for a in rest if a != "--front"])
        from hookkit.tools.quality import quality_main

        return quality_main(rest)
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        unknown_arguments(parser, args, extras)
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
