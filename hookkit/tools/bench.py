"""Build, run and time pipelines: the machinery behind `hookkit generate` and `hookkit bench`.

Models come from `hookkit.tools.zoo` (tiny on the CPU, or the full-size architecture with `full=True`, random
weights, random prompt embeddings: no downloads) or from a local folder (`model_path`).

`hookkit bench` measures a matrix of configurations -- stock diffusers (eager, regional and full compile),
diffusers' FirstBlockCache, cache-dit when installed, and hookkit's -- each in its own process
(`python -m hookkit bench-one ...`), so that one configuration's compiled graphs, CUDA graphs, allocator
state or global settings cannot leak into the next. Each child writes its row as JSON and its output
tensor as `.pt`; the parent compares outputs against the eager row (PSNR) and prints a markdown table.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

import hookkit
from hookkit.core.quiet import quiet_imports
from hookkit.tools import local, zoo
from hookkit.core.validate import closest
from hookkit.errors import SpecError, UnsupportedError
from hookkit.core.summary import table

#: Text tokens of the random prompt embeddings for full-size models (what the real text encoders emit).
FULL_TEXT_TOKENS = {"flux": 512, "qwenimage": 128, "cogvideox": 226, "wan": 512, "hunyuanvideo15": 1000}
#: HunyuanVideo 1.5's second text encoder (ByT5, glyphs): its padded length
FULL_TEXT_TOKENS_2 = {"hunyuanvideo15": 256}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# --- what this installation and machine offer -----------------------------------------------------------


def available_fields() -> frozenset[str]:
    """`Spec` fields some installed technique implements (the keys of `hookkit.features.FEATURES`)."""
    from hookkit.features import FEATURES

    return frozenset(FEATURES)


def tiny_models() -> tuple[str, ...]:
    """Model families `hookkit.tools.zoo` can build a whole tiny pipeline for."""
    return tuple(sorted(zoo._PIPELINES))


def resolve_device(device: str | None) -> torch.device:
    """`device` as a torch.device (default: cuda when visible, else cpu); a missing GPU is a clear error."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise SpecError(f"--device: expected 'cpu', 'cuda' or 'cuda:N', got {device!r}.") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UnsupportedError(f"--device {device}: no CUDA device is visible (torch.cuda.is_available() is False). "
                               "Use --device cpu.")
    if dev.type not in ("cpu", "cuda"):
        raise SpecError(f"--device: expected 'cpu', 'cuda' or 'cuda:N', got {device!r}.")
    return dev


def resolve_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    """bfloat16 on CUDA, float32 on the CPU, unless asked otherwise."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise SpecError(f"--dtype: expected one of {sorted(DTYPES)}, got {dtype!r}.")
    return DTYPES[dtype]


def device_description(device: torch.device) -> str:
    """The device column of a timing: `NVIDIA H200 x 1` or `CPU (2 threads)` (the thread count moves CPU timings)."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} x {torch.cuda.device_count()}"
    threads = torch.get_num_threads()
    return f"CPU ({threads} thread{'s' if threads != 1 else ''})"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device | None = None) -> tuple[float, Any]:
    """`(seconds, fn())`, `device` (default: the current CUDA device, if any) synchronized before and after
    so that queued GPU work is counted."""
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    synchronize(device)
    return time.perf_counter() - t0, out


# --- models ----------------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class ModelOptions:
    """Which pipeline to build and how to call it; shared by `generate`, `bench` and `bench-one`."""

    name: str
    full: bool = False
    model_path: str | None = None
    device: str | None = None
    dtype: str | None = None
    steps: int | None = None
    height: int | None = None
    width: int | None = None
    batch: int = 1
    seed: int = 0
    threads: int | None = None
    prompt: str = "A cat holding a sign that says hello world"
    #: video frames per call (None: the pipeline's default, 81 for Wan)
    frames: int | None = None
    #: with `full`: which published architecture of the family (`zoo.FULL_ARCHITECTURES`; None: its default)
    arch: str | None = None

    @staticmethod
    def prompt_default() -> str:
        return attrs.fields(ModelOptions).prompt.default

    def num_steps(self) -> int:
        """Default: 6 for tiny models; for full-size ones their pipeline's default (`FullArchitecture.default_steps`:
        50 for Wan), else 28 (Flux-dev's default; also for local models)."""
        if self.steps is not None:
            return self.steps
        if self.full and self.model_path is None:
            architecture = zoo.full_architecture(self.name, self.arch) if self.name in zoo._TRANSFORMERS else None
            if architecture is not None:
                return architecture.default_steps
        return 28 if (self.full or self.model_path) else 6

    def to_argv(self) -> list[str]:
        """The command-line flags that rebuild these options (for `bench-one` child processes)."""
        argv = ["--model", self.name, "--batch", str(self.batch), "--seed", str(self.seed), "--steps", str(self.num_steps())]
        for flag, value in (("--model-path", self.model_path), ("--device", self.device), ("--dtype", self.dtype),
                            ("--height", self.height), ("--width", self.width), ("--threads", self.threads),
                            ("--frames", self.frames), ("--arch", self.arch)):
            if value is not None:
                argv += [flag, str(value)]
        if self.full:
            argv.append("--full")
        if self.prompt != self.prompt_default():
            argv += ["--prompt", self.prompt]
        return argv


def check_model(opts: ModelOptions, flag: str = "MODEL") -> None:
    """Fail early, with the list of what exists, for a model that cannot be built here. `flag` is how the command
    names the model (`generate`'s positional MODEL, `bench`'s --model), so that the message names what was typed."""
    adapters = hookkit.list_adapters()
    if opts.name not in adapters:
        raise SpecError(f"{flag}: expected a shipped adapter name, one of {sorted(adapters)}, got {opts.name!r}."
                        f"{closest(opts.name, adapters)}")
    if opts.model_path is None and opts.name not in tiny_models():
        raise UnsupportedError(
            f"{flag} {opts.name!r}: no {'full-size' if opts.full else 'tiny'} pipeline for {opts.name} yet (random-weight "
            f"pipelines, tiny and --full, exist for "
            f"{list(tiny_models())}). Pass --model-path with a local {opts.name} checkpoint folder instead."
        )
    if opts.full and opts.model_path is not None:
        raise SpecError("--full: builds a random-weight architecture and cannot be combined with --model-path; drop one.")
    if opts.arch is not None:
        if not opts.full:
            raise SpecError(f"--arch {opts.arch}: names a full-size architecture, only with --full. Add --full.")
        zoo.full_architecture(opts.name, opts.arch)
    if opts.batch < 1:
        raise SpecError(f"--batch: expected an int >= 1, got {opts.batch}.")
    if opts.num_steps() < 1:
        raise SpecError(f"--steps: expected an int >= 1, got {opts.num_steps()}.")
    for flag, value in (("--height", opts.height), ("--width", opts.width)):
        if value is not None and value < 1:  # 0 would silently mean the default size, -32 a torch traceback
            raise SpecError(f"{flag}: expected an int >= 1, got {value}.")


#: The most latent tokens a sample (the sequence each attention call runs over) may have, per device type.
#: Attention's time grows with the square of the token count. On a GPU, 2**17 is above the longest sequence the
#: supported families are made for (HunyuanVideo at 1280x720, 129 frames: 118,800 tokens). On the CPU, 2**15 still
#: holds Wan 2.1's default 480x832 at 81 frames (32,760 tokens), while the tiny Flux at 1024x1024 (65,536 tokens)
#: takes about two minutes a step on one thread, and at 4096x4096 (1,048,576) hours.
#: A video's tokens are those of all its latent frames together (attention runs over the whole clip): Wan's VAE
#: keeps (frames - 1) / 4 + 1 latent frames of (height / 16) x (width / 16) tokens each after patching, so
#: 480x832 at 81 frames is 21 x 30 x 52 = 32,760 and 720x1280 at 81 frames 21 x 45 x 80 = 75,600 (GPU only).
MAX_LATENT_TOKENS: dict[str, int] = {"cpu": 2**15, "cuda": 2**17}


def skeleton_pipeline(opts: ModelOptions) -> Any | None:
    """The pipeline `opts` names with what sets its geometry (transformer, VAE) but no weights to speak of: the
    tiny pipeline itself, the full-size transformer and VAE on the meta device, or a local folder's built from its
    config files (`local.skeleton_pipeline`; None when that cannot be done, and the size is checked after the
    load). What `check_size` reads before anything is loaded."""
    with torch.random.fork_rng(devices=[]), quiet_imports():  # the tiny builders seed torch's global generator
        if opts.model_path is not None:
            return local.skeleton_pipeline(Path(opts.model_path))
        pipe = zoo.tiny_pipeline(opts.name)
        if opts.full:
            with torch.device("meta"):  # the scheduler stays the tiny pipeline's: it cannot be built on meta
                pipe = _full_pipeline(pipe, opts, _full_vae(opts.name))
        return pipe


def _full_pipeline(tiny: Any, opts: ModelOptions, vae: torch.nn.Module) -> Any:
    """`tiny`'s pipeline class and scheduler around the full-size transformer(s) of `opts` and `vae`: pipelines
    derive their latent geometry from the VAE; a two-expert architecture adds `transformer_2` and its pipeline
    config (Wan 2.2's `boundary_ratio`)."""
    architecture = zoo.full_architecture(opts.name, opts.arch)
    parts = zoo.full_transformers(opts.name, opts.arch)
    return type(tiny)(**{**tiny.components, **parts, "vae": vae},
                      **(architecture.pipeline if architecture is not None else {}))


def default_size(pipe: Any, opts: ModelOptions) -> tuple[int | None, int | None, int]:
    """Height, width and frame count a call makes when `--height`/`--width` are not given (None: unknown)."""
    if opts.model_path is None and not opts.full:
        kw = zoo.call_kwargs(opts.name, steps=1)
        return kw["height"], kw["width"], kw.get("num_frames", 1)
    parameters = inspect.signature(type(pipe).__call__).parameters
    config = pipe.transformer.config

    def default(name: str, sample: str) -> int | None:
        value = getattr(parameters.get(name), "default", None)
        if isinstance(value, int):
            return value
        for attribute in ("vae_scale_factor", "vae_scale_factor_spatial"):  # Flux: 128 * 8; CogVideoX: 60 * 8
            factor, size = getattr(pipe, attribute, None), getattr(pipe, "default_sample_size", None) or config.get(sample)
            if isinstance(factor, int) and isinstance(size, int):
                return size * factor
        return None

    frames = getattr(parameters.get("num_frames"), "default", None)
    if not isinstance(frames, int):
        frames = config.get("sample_frames") or 1
    return default("height", "sample_height"), default("width", "sample_width"), frames


def check_frames(pipe: Any, frames: int) -> None:
    """Refuse a `--frames` the pipeline would round or cannot make, naming the nearest counts it takes: a video VAE
    that compresses time `t`x keeps the first frame and then one latent frame per `t` (Wan, CogVideoX, HunyuanVideo:
    t = 4, so frames = 4k + 1); an image pipeline takes no frames at all."""
    name = type(pipe).__name__
    if "num_frames" not in inspect.signature(type(pipe).__call__).parameters:
        raise SpecError(f"--frames {frames}: {name} makes images, not videos; drop --frames.")
    if frames < 1:
        raise SpecError(f"--frames: expected an int >= 1, got {frames}.")
    t = getattr(pipe, "vae_scale_factor_temporal", None)
    if isinstance(t, int) and t > 1 and (frames - 1) % t != 0:
        below = (frames - 1) // t * t + 1
        raise SpecError(f"--frames {frames}: {name}'s VAE compresses time {t}x and takes {t}k+1 frames (the first frame, "
                        f"then {t} per latent frame); got {frames}. Pass --frames {below} or {below + t}.")


def check_size(opts: ModelOptions, device: torch.device) -> None:
    """Refuse `--height`/`--width`/`--frames` before anything is loaded: a size or frame count the pipeline would
    silently round (`local.check_size`, `check_frames`), or one whose latents are more tokens a sample than
    `MAX_LATENT_TOKENS` allows on `device`. Nothing to check when none is given: the model's own default size."""
    if opts.height is None and opts.width is None and opts.frames is None:
        return
    pipe = skeleton_pipeline(opts)
    if pipe is None:
        return
    local.check_size(pipe, opts.height, opts.width)
    if opts.frames is not None:
        check_frames(pipe, opts.frames)
    default_height, default_width, frames = default_size(pipe, opts)
    frames = opts.frames or frames
    height, width = opts.height or default_height, opts.width or default_width
    if height is None or width is None:
        return
    tokens = local.latent_tokens(pipe, height, width, frames)
    bound = MAX_LATENT_TOKENS.get(device.type, MAX_LATENT_TOKENS["cuda"])
    if tokens is not None and tokens > bound:
        asked = " ".join(f"{flag} {value}" for flag, value in (("--height", opts.height), ("--width", opts.width),
                                                               ("--frames", opts.frames)) if value is not None)
        size = f"{height}x{width}" + (f", {frames} frames" if frames > 1 else "")
        where = "the CPU" if device.type == "cpu" else f"a {device.type} device"
        other = f" ({MAX_LATENT_TOKENS['cuda']:,} on a GPU)" if device.type == "cpu" else ""
        raise SpecError(
            f"{asked}: {type(pipe).__name__} would attend over {tokens:,} latent tokens a sample ({size}), above the "
            f"{bound:,} hookkit allows on {where}{other}: attention's time and memory grow with the square of the "
            "token count, and the longest sequence the supported families are made for is 118,800 tokens "
            "(HunyuanVideo at 1280x720, 129 frames). Pass a smaller --height/--width"
            + (" or fewer --frames (all latent frames attend together)." if frames > 1 else "."))


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def _full_vae(name: str) -> torch.nn.Module:
    """The published VAE architecture of family `name` (random weights): it sets the latent geometry."""
    import diffusers

    if name == "flux":
        return diffusers.AutoencoderKL(
            in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
            latent_channels=16, norm_num_groups=32, sample_size=1024, scaling_factor=0.3611, shift_factor=0.1159,
            use_quant_conv=False, use_post_quant_conv=False,
        ).eval()
    if name == "qwenimage":
        return diffusers.AutoencoderKLQwenImage().eval()
    if name == "cogvideox":
        return diffusers.AutoencoderKLCogVideoX().eval()
    if name == "wan":
        return diffusers.AutoencoderKLWan().eval()
    if name == "hunyuanvideo15":
        return diffusers.AutoencoderKLHunyuanVideo15().eval()
    raise UnsupportedError(f"--full {name}: no full-size pipeline for {name} yet; available: {list(tiny_models())}.")


def load_pipeline(opts: ModelOptions) -> Any:
    """The pipeline `opts` describes, on its device and in its dtype, with diffusers' progress bar off."""
    check_model(opts)
    device = resolve_device(opts.device)
    dtype = resolve_dtype(opts.dtype, device)
    if opts.model_path is not None:
        pipe = _from_pretrained(opts, dtype)
    elif opts.full:
        check_cpu_full(opts, device)
        check_fits(opts.name, device, dtype, opts.arch)
        tiny = zoo.tiny_pipeline(opts.name)  # its scheduler and pipeline class; the tiny transformer is dropped
        torch.manual_seed(opts.seed)
        with torch.device(device), _default_dtype(dtype):
            pipe = _full_pipeline(tiny, opts, _full_vae(opts.name))
    else:
        pipe = zoo.tiny_pipeline(opts.name, seed=opts.seed)
    # Only cast what needs it: diffusers warns on every dtype cast of a model built from config.
    if pipe.transformer.dtype != dtype:
        pipe.to(dtype=dtype)
    if pipe.transformer.device != device:
        pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def full_transformer_parameters(name: str, arch: str | None = None) -> int:
    """Parameters of the full-size `name` transformer(s) (`arch`: `zoo.FULL_ARCHITECTURES`; both experts of a
    two-expert one), counted on the meta device (no memory)."""
    with torch.device("meta"):
        parts = zoo.full_transformers(name, arch)
    return sum(p.numel() for part in parts.values() for p in part.parameters())


def full_transformer_bytes(name: str, dtype: torch.dtype, arch: str | None = None) -> int:
    """Bytes of the full-size `name` transformer's weights in `dtype` (both experts of a two-expert `arch`)."""
    return full_transformer_parameters(name, arch) * torch.empty((), dtype=dtype).element_size()


def _available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:  # Linux; elsewhere no check
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


def require_cuda(script: str, instead: str) -> None:
    """End a GPU-only benchmark script without a CUDA device with one clear line (exit 1), not a traceback from
    deep inside a model build; `instead` says what runs here."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{script}: needs a CUDA device (full-size architectures on the GPU); none is visible. "
                         f"{instead}")


def check_cpu_full(opts: ModelOptions, device: torch.device) -> None:
    """Refuse `--full` on a CPU the user did not ask for: a full-size model that fits in RAM (CogVideoX, Wan)
    would otherwise start minutes per denoising step with no sign of why. `--device cpu` runs it anyway."""
    if device.type != "cpu" or opts.device is not None:
        return
    params = full_transformer_parameters(opts.name, opts.arch)
    raise UnsupportedError(
        f"--full {opts.name}: no CUDA device is visible, and the full-size {opts.name} transformer "
        f"({params / 1e9:.1f} B parameters) takes minutes per denoising step on the CPU. Run it on a CUDA GPU, drop "
        "--full for the tiny model, or pass --device cpu to run it on the CPU anyway.")


def check_fits(name: str, device: torch.device, dtype: torch.dtype, arch: str | None = None) -> None:
    """Refuse a full-size model that cannot fit before building it: the alternative is the OOM killer minutes
    later (a 20B-parameter transformer in float32 is 80 GB)."""
    try:
        available = _available_bytes(device)
    except OSError:
        return
    need = full_transformer_bytes(name, dtype, arch)
    if need > available:
        dtype_name = str(dtype).removeprefix("torch.")
        raise UnsupportedError(
            f"--full {name}: the full-size transformer needs {need / 1e9:.1f} GB in {dtype_name}, "
            f"{device} has {available / 1e9:.1f} GB available. Run it on a GPU with enough memory, or drop --full "
            "for the tiny model.")


@quiet_imports()
def _from_pretrained(opts: ModelOptions, dtype: torch.dtype) -> Any:
    from diffusers import DiffusionPipeline

    path = Path(opts.model_path or "")
    if not path.is_dir():
        raise SpecError(f"--model-path: expected a local pipeline folder (with model_index.json), got {str(path)!r}.")
    # Components saved as null (e.g. a pipeline saved without text encoders) must be passed as None.
    try:
        index = json.loads((path / "model_index.json").read_text())
    except (OSError, ValueError) as exc:
        raise SpecError(f"--model-path {str(path)!r}: expected a diffusers pipeline folder with a readable "
                        f"model_index.json ({exc}).") from None
    missing = {k: None for k, v in index.items() if isinstance(v, list) and v[:1] == [None]}
    try:
        pipe = DiffusionPipeline.from_pretrained(str(path), torch_dtype=dtype, local_files_only=True, **missing)
    except (OSError, ValueError, TypeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SpecError(f"--model-path {str(path)!r}: diffusers could not load it: {first}") from None
    transformer = getattr(pipe, "transformer", None)
    adapter = hookkit.get_adapter(opts.name)
    if transformer is None or not adapter.matches(transformer):
        found = type(transformer).__name__ if transformer is not None else "no transformer"
        raise SpecError(f"--model-path {str(path)!r}: holds {type(pipe).__name__} with {found}; MODEL {opts.name!r} "
                        f"is for {list(adapter.transformer)}. Pass the matching MODEL name.")
    return pipe


def call_kwargs(pipe: Any, opts: ModelOptions, output_type: str) -> dict[str, Any]:
    """Keyword arguments for one pipeline call: a text prompt for a local model, random embeddings otherwise.

    A fresh seeded generator every time, so repeated calls give the same output.
    """
    device = resolve_device(opts.device)
    dtype = resolve_dtype(opts.dtype, device)
    steps = opts.num_steps()
    if opts.model_path is not None and has_text_encoder(pipe):
        kw: dict[str, Any] = dict(prompt=[opts.prompt] * opts.batch, num_inference_steps=steps,
                                  generator=torch.Generator().manual_seed(opts.seed), output_type=output_type)
    elif opts.full or opts.model_path is not None:
        kw = _embedding_call_kwargs(pipe, opts, steps, output_type)
    else:
        kw = zoo.call_kwargs(opts.name, steps=steps, seed=opts.seed, batch=opts.batch, height=opts.height,
                             width=opts.width, output_type=output_type)
    if opts.height is not None:
        kw["height"] = opts.height
    if opts.width is not None:
        kw["width"] = opts.width
    if opts.frames is not None:
        kw["num_frames"] = opts.frames
    for key, value in kw.items():
        if isinstance(value, torch.Tensor):
            kw[key] = value.to(device, dtype) if value.is_floating_point() else value.to(device)
    return kw


def has_text_encoder(pipe: Any) -> bool:
    """Whether `pipe` can encode a text prompt (a folder saved without text encoders cannot)."""
    return getattr(pipe, "text_encoder", None) is not None


def _embedding_call_kwargs(pipe: Any, opts: ModelOptions, steps: int, output_type: str) -> dict[str, Any]:
    """Random prompt embeddings shaped like the real text encoders' output, from the transformer's config:
    for full-size architectures and for local pipelines saved without text encoders."""
    if opts.name not in FULL_TEXT_TOKENS:
        where = f"the pipeline in {opts.model_path} has no text encoder, and " if opts.model_path else ""
        raise UnsupportedError(
            f"{opts.name}: {where}hookkit makes random prompt embeddings only for {sorted(FULL_TEXT_TOKENS)}. "
            "Save the pipeline with its text encoders, or pick one of those models.")
    cfg = pipe.transformer.config
    g = torch.Generator().manual_seed(1234 + opts.seed)
    b, tokens = opts.batch, FULL_TEXT_TOKENS[opts.name]
    kw: dict[str, Any] = dict(num_inference_steps=steps, generator=torch.Generator().manual_seed(opts.seed),
                              output_type=output_type)
    if opts.name == "flux":
        kw.update(prompt_embeds=torch.randn(b, tokens, cfg.joint_attention_dim, generator=g),
                  pooled_prompt_embeds=torch.randn(b, cfg.pooled_projection_dim, generator=g), guidance_scale=3.5)
    elif opts.name == "qwenimage":
        kw.update(prompt_embeds=torch.randn(b, tokens, cfg.joint_attention_dim, generator=g),
                  prompt_embeds_mask=torch.ones(b, tokens, dtype=torch.long), true_cfg_scale=1.0)
    elif opts.name == "cogvideox":
        kw.update(prompt_embeds=torch.randn(b, tokens, cfg.text_embed_dim, generator=g),
                  negative_prompt_embeds=torch.randn(b, tokens, cfg.text_embed_dim, generator=g), guidance_scale=6.0)
    elif opts.name == "wan":
        kw.update(prompt_embeds=torch.randn(b, tokens, cfg.text_dim, generator=g),
                  negative_prompt_embeds=torch.randn(b, tokens, cfg.text_dim, generator=g), guidance_scale=5.0)
    elif opts.name == "hunyuanvideo15":  # CFG through the pipeline's guider (guidance 6)
        kw.update(zoo.hunyuanvideo15_embeddings(b, tokens, cfg.text_embed_dim, FULL_TEXT_TOKENS_2[opts.name],
                                                cfg.text_embed_2_dim, g))
    return kw


def output_of(result: Any) -> Any:
    """The images (or video frames) of a pipeline result."""
    return result.frames if hasattr(result, "frames") else result.images


def psnr(reference: torch.Tensor, output: torch.Tensor, peak: float | None = None) -> float:
    """PSNR in dB of `output` against `reference` (`math.inf` when they are equal).

    `peak` defaults to the reference's value range (1.0 for images in [0, 1]; the range for latents).
    """
    if reference.shape != output.shape:
        raise SpecError(f"psnr: shapes differ: reference {tuple(reference.shape)}, output {tuple(output.shape)}.")
    ref, out = reference.double(), output.double()
    mse = torch.mean((ref - out) ** 2).item()
    if peak is None:
        peak = (ref.max() - ref.min()).item() or 1.0
    return psnr_from_mse(mse, peak)


def psnr_from_mse(mse: float, peak: float = 1.0) -> float:
    """PSNR in dB of a mean squared error against `peak`; `math.inf` when it is 0 (bitwise-equal outputs)."""
    return math.inf if mse == 0 else 10.0 * math.log10(peak * peak / mse)


# --- configurations --------------------------------------------------------------------------------------


@attrs.define
class RunContext:
    """What a configuration's setup sees and leaves behind (the hookkit handle, notes for the table)."""

    pipe: Any
    opts: ModelOptions
    handle: Any = None
    #: feature data of a configuration that is not hookkit's, read after the timed runs (cache-dit's steps)
    features: Callable[[], dict[str, Any]] | None = None


@attrs.frozen(kw_only=True)
class BenchConfig:
    """One row of the matrix: how to set a freshly built pipeline up, and what it needs."""

    name: str
    kind: str  # "stock" | "peer" | "hookkit"
    description: str
    setup: Callable[[RunContext], None]
    fields: frozenset[str] = frozenset()  # hookkit Spec fields it needs
    needs_cuda: bool = False
    needs_module: str | None = None

    def unavailable(self, device: torch.device, have: frozenset[str]) -> str | None:
        """Why this configuration cannot run here, or None when it can."""
        missing = sorted(self.fields - have)
        if missing:
            return f"hookkit has no feature for Spec.{missing[0]} in this installation"
        if self.needs_cuda and device.type != "cuda":
            return "needs a CUDA device"
        if self.needs_module is not None:
            import importlib.util

            if importlib.util.find_spec(self.needs_module) is None:
                return f"{self.needs_module} is not installed"
        return None


def _eager(ctx: RunContext) -> None:
    """Stock diffusers, nothing changed."""


def transformers_of(pipe: Any) -> list[torch.nn.Module]:
    """The pipeline's transformers: `transformer`, and `transformer_2` where it has one (Wan 2.2 A14B's low-noise
    expert). A stock row sets each up, as hookkit's rows do, so that both experts' steps are what is measured."""
    second = getattr(pipe, "transformer_2", None)
    return [pipe.transformer] + ([second] if second is not None else [])


def _stock_regional_compile(mode: str | None) -> Callable[[RunContext], None]:
    def setup(ctx: RunContext) -> None:
        for transformer in transformers_of(ctx.pipe):
            if not getattr(transformer, "_repeated_blocks", None):
                raise UnsupportedError(f"{type(transformer).__name__} has no _repeated_blocks: stock regional compile "
                                       "is unavailable (hookkit-compile uses the adapter's repeated_blocks)")
            kwargs: dict[str, Any] = {"fullgraph": True}
            if mode is not None:
                kwargs["mode"] = mode
            transformer.compile_repeated_blocks(**kwargs)
    return setup


def _stock_full_compile(mode: str | None) -> Callable[[RunContext], None]:
    def setup(ctx: RunContext) -> None:
        kwargs: dict[str, Any] = {"fullgraph": True}
        if mode is not None:
            kwargs["mode"] = mode
        for transformer in transformers_of(ctx.pipe):
            transformer.compile(**kwargs)
    return setup


def _first_block_cache(ctx: RunContext) -> None:
    from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache

    for transformer in transformers_of(ctx.pipe):
        apply_first_block_cache(transformer, FirstBlockCacheConfig(threshold=0.12))


def _mag_cache(ctx: RunContext) -> None:
    """diffusers' MagCache with its defaults (threshold 0.06, at most 3 skipped steps in a row, the first 20 %
    computed) and the only magnitude ratios diffusers ships, `FLUX_MAG_RATIOS`, interpolated to the step count.
    Ratios are a trained checkpoint's statistic: random weights have none worth calibrating, so the row's skip
    schedule is the one Flux-dev's ratios give (as the image rows' masks come from a trained model)."""
    from diffusers.hooks import MagCacheConfig, apply_mag_cache
    from diffusers.hooks.mag_cache import FLUX_MAG_RATIOS

    for transformer in transformers_of(ctx.pipe):
        apply_mag_cache(transformer, MagCacheConfig(mag_ratios=FLUX_MAG_RATIOS,
                                                    num_inference_steps=ctx.opts.num_steps()))


def separate_cfg_calls(pipe: Any, kwargs: dict[str, Any]) -> bool:
    """Whether a pipeline call with `kwargs` runs the transformer twice per step (conditional, then
    unconditional). cache-dit must be told (`enable_separate_cfg`): its Qwen-Image default assumes it, and on
    a call without true CFG it then pairs consecutive steps as two branches and follows the wrong mask."""
    from hookkit.adapters import resolve_adapter

    if resolve_adapter(pipe.transformer).cfg != "separate":
        return False
    if kwargs.get("negative_prompt_embeds") is None and kwargs.get("negative_prompt") is None:
        return False
    guider = getattr(pipe, "guider", None)  # HunyuanVideo 1.5: CFG is the pipeline's guider, not a call argument
    default = getattr(guider, "guidance_scale", 1.0) if guider is not None else 1.0
    return float(kwargs.get("true_cfg_scale", kwargs.get("guidance_scale", default))) > 1.0


def tuned_2x_mask(steps: int = 28) -> tuple[int, ...]:
    """The steps `hookkit.tune(..., speedup=2)` computes on the trained tiny Flux at `steps` steps: DBCache's
    "schedule" rule, TaylorSeer 2, planned from the shipped calibration (14 of 28 steps computed, no block on a
    cached step). Random weights never tell a rule anything, so speed is measured on the rule's decisions."""
    from hookkit.techniques.cache.spec import rule_mask
    from hookkit.tools import trained

    spec = hookkit.DBCache(rule="schedule", calibration=trained.calibration("tiny", steps), speedup=2.0,
                           taylorseer_order=2)
    return rule_mask(spec, steps, num_blocks=1)  # fn_blocks 0: the plan does not depend on the model's depth


def _cache_dit(ctx: RunContext, quant_type: str | None = None, mask: Sequence[int] | None = None) -> None:
    """cache-dit DBCache F1B0 with the static "fast" step mask: the configuration DESIGN.md measured, told
    whether this call's CFG runs as separate transformer calls. `quant_type`: cache-dit's own torchao
    quantization (`QuantizeConfig(quant_type=...)`, applied by `enable_cache` after the cache hooks).

    The mask is hookkit's `resolve_steps_mask("fast", steps)`, the one hookkit's "cache-fast" rows compute: cache-dit's
    own `steps_mask("fast", ...)` is the same at 28 steps but not at others (at 6 steps it computes steps 0, 1, 2, 5,
    hookkit's 0, 3, 5), and rows compared on different steps would measure different work."""
    import cache_dit  # type: ignore[import-not-found]

    from hookkit.techniques.cache.spec import resolve_steps_mask

    steps = ctx.opts.num_steps()
    separate = separate_cfg_calls(ctx.pipe, call_kwargs(ctx.pipe, ctx.opts, output_type_for(ctx.opts)))
    extra: dict[str, Any] = {}
    if quant_type is not None:
        extra["quantize_config"] = cache_dit.QuantizeConfig(quant_type=quant_type)
    cache_dit.enable_cache(ctx.pipe, cache_config=cache_dit.DBCacheConfig(
        Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=0.12, max_warmup_steps=0,
        enable_separate_cfg=separate,
        steps_computation_mask=list(mask if mask is not None else resolve_steps_mask("fast", steps)),
        steps_computation_policy="static",
    ), **extra)
    ctx.features = lambda: {"cache": cache_dit_steps(cache_dit.summary(ctx.pipe, logging=False))}


def _cache_dit_compile(ctx: RunContext) -> None:
    """cache-dit as above, then stock regional compilation of the blocks inside cache-dit's wrapper (DESIGN.md's
    "cache-dit + regional compile"): the peer's fastest configuration on the same mask."""
    _cache_dit(ctx)
    _stock_regional_compile(None)(ctx)


def _cache_dit_fp8_compile(ctx: RunContext) -> None:
    """The strongest peer configuration, the one hookkit's fastest rows are measured against: cache-dit DBCache on the "fast" mask with cache-dit's own
    fp8 (`QuantizeConfig(quant_type="float8_per_row")`: torchao dynamic per-row on every Linear of the
    repeated blocks, the AdaLN modulation Linears included), then stock regional compilation."""
    _cache_dit(ctx, quant_type="float8_per_row")
    _stock_regional_compile(None)(ctx)


def _cache_dit_fp8_compile_2x(ctx: RunContext) -> None:
    """The strongest peer configuration on the tuned 2x rule's computed steps (`tuned_2x_mask`): cache-dit F1B0 (its
    smallest Fn) with that mask, its fp8 per-row, stock regional compile."""
    _cache_dit(ctx, quant_type="float8_per_row", mask=tuned_2x_mask(ctx.opts.num_steps()))
    _stock_regional_compile(None)(ctx)


def _cache_2x(steps: int = 28) -> Any:
    """The rule `hookkit.tune(..., speedup=2)` returns on the trained tiny Flux: "schedule" at 2x with TaylorSeer 2,
    planned from the shipped calibration (`tuned_2x_mask`'s steps; under transformer graphs the extrapolation is
    written into the residual slots before each cached replay)."""
    from hookkit.tools import trained

    return hookkit.DBCache(rule="schedule", calibration=trained.calibration("tiny", steps), speedup=2.0,
                           taylorseer_order=2)


def cache_dit_steps(stats: Sequence[Any]) -> dict[str, Any]:
    """cache-dit's `CacheStats` of the last call in the shape of hookkit's DBCache summary data (cached and
    computed step indices per CFG branch), so that the table's notes read the same for both."""
    branches: dict[str, dict[str, list[int]]] = {}
    for stat in stats[:1]:  # one entry per cached block list; the first carries the step decisions
        for name, cached, executed in (("cond", stat.cached_steps, stat.accumulated_executed_steps),
                                       ("uncond", stat.cfg_cached_steps, stat.accumulated_executed_steps)):
            if name == "uncond" and not stat.cache_options["cache_config"].enable_separate_cfg:
                continue
            cached = sorted(cached)
            branches[name] = {"cached": cached, "computed": [i for i in range(executed) if i not in set(cached)]}
    return {"source": "cache-dit", "branches": branches}


def _hookkit(make_spec: Callable[[], Any]) -> Callable[[RunContext], None]:
    def setup(ctx: RunContext) -> None:
        ctx.handle = hookkit.enable(ctx.pipe, make_spec())
    return setup


def _cache_fast() -> Any:
    """DBCache F1B0 on cache-dit's static "fast" mask (11 of 28 steps computed): random weights never cache
    dynamically, so a static mask is how caching speed is measured (DESIGN.md)."""
    return hookkit.DBCache(fn_blocks=1, bn_blocks=0, warmup_steps=0, steps_mask="fast", mask_policy="static",
                           taylorseer_order=0)


def _cache_dynamic() -> Any:
    """DBCache with a dynamic decision at cache-dit's common settings (F1B0, 8 warm-up steps, at most 3 cached in a
    row, threshold 0.12), for comparing with cache-dit at equal settings."""
    return hookkit.DBCache(fn_blocks=1, bn_blocks=0, threshold=0.12, warmup_steps=8, max_continuous_cached_steps=3,
                           taylorseer_order=0)


def _cache_fast_dynamic() -> Any:
    """The "fast" mask's computed steps, its other steps decided by the threshold (mask_policy="dynamic"),
    with a threshold no diff reaches: it caches exactly the static "fast" row's steps, but through the whole
    dynamic machinery (the statistic and its host read on each of those steps; under CUDA graphs the split
    head/tail graphs), so its time against hookkit-...cache-fast rows is the cost of deciding dynamically.
    Random weights never cache at a real threshold (DESIGN.md)."""
    return hookkit.DBCache(fn_blocks=1, bn_blocks=0, warmup_steps=0, steps_mask="fast", mask_policy="dynamic",
                           threshold=1e9, taylorseer_order=0)


def _compile(mode: str | None = None, cuda_graphs: str = "none", fuse_fp8_rows: str = "fast",
             real_rope: bool = True) -> Any:
    return hookkit.Compile(regional=True, mode=mode, cuda_graphs=cuda_graphs, fuse_fp8_rows=fuse_fp8_rows,
                           real_rope=real_rope)


def _fp8_mod_fast_graphs(mode: str | None = None, fuse_fp8_rows: str = "fast", real_rope: bool = True,
                         cached: bool = True) -> Callable[[], Any]:
    """The spec of the fastest row (static 'fast' DBCache, fp8 incl. modulation, transformer graphs) and its
    variants: a compile mode, another `fuse_fp8_rows`, complex RoPE left to inductor, no cache."""
    return lambda: hookkit.Spec(cache=_cache_fast() if cached else None,
                                quantize=hookkit.Quantize(scheme="fp8_row", include_modulation=True),
                                compile=_compile(mode, cuda_graphs="transformer", fuse_fp8_rows=fuse_fp8_rows,
                                                 real_rope=real_rope),
                                memo=True)


def _configs() -> dict[str, BenchConfig]:
    S = hookkit.Spec
    rows = [
        BenchConfig(name="eager", kind="stock", description="stock diffusers, eager", setup=_eager),
        BenchConfig(name="regional-compile", kind="stock", setup=_stock_regional_compile(None),
                    description="stock transformer.compile_repeated_blocks(fullgraph=True)"),
        BenchConfig(name="regional-compile-ro", kind="stock", setup=_stock_regional_compile("reduce-overhead"),
                    needs_cuda=True, description="stock compile_repeated_blocks(mode='reduce-overhead')"),
        BenchConfig(name="full-compile", kind="stock", setup=_stock_full_compile(None),
                    description="stock transformer.compile(fullgraph=True)"),
        BenchConfig(name="full-compile-ro", kind="stock", setup=_stock_full_compile("reduce-overhead"),
                    needs_cuda=True, description="stock transformer.compile(fullgraph=True, mode='reduce-overhead')"),
        BenchConfig(name="fbcache", kind="stock", setup=_first_block_cache,
                    description="diffusers FirstBlockCache, threshold 0.12"),
        BenchConfig(name="magcache", kind="stock", setup=_mag_cache,
                    description="diffusers MagCache, its defaults and its shipped FLUX_MAG_RATIOS"),
        BenchConfig(name="cache-dit", kind="peer", setup=_cache_dit, needs_module="cache_dit",
                    description="cache-dit DBCache F1B0, static 'fast' mask"),
        BenchConfig(name="cache-dit+compile", kind="peer", setup=_cache_dit_compile, needs_module="cache_dit",
                    description="cache-dit DBCache F1B0, static 'fast' mask + stock regional compile"),
        BenchConfig(name="cache-dit+fp8+compile", kind="peer", setup=_cache_dit_fp8_compile, needs_module="cache_dit",
                    needs_cuda=True, description="cache-dit DBCache F1B0, static 'fast' mask + its fp8 per-row + "
                                                 "stock regional compile"),
        BenchConfig(name="hookkit", kind="hookkit", setup=_hookkit(lambda: S()),
                    description="hookkit.enable(pipe, Spec()): bookkeeping only (overhead)"),
        BenchConfig(name="hookkit-cache", kind="hookkit", setup=_hookkit(lambda: S(cache=_cache_dynamic())),
                    fields=frozenset({"cache"}), description="DBCache F1B0 W8 MC3 R0.12, dynamic"),
        BenchConfig(name="hookkit-cache-fast", kind="hookkit", setup=_hookkit(lambda: S(cache=_cache_fast())),
                    fields=frozenset({"cache"}), description="DBCache F1B0, static 'fast' mask"),
        BenchConfig(name="hookkit-memo", kind="hookkit", setup=_hookkit(lambda: S(memo=True)),
                    fields=frozenset({"memo"}), description="memoized per-step index tensors"),
        BenchConfig(name="hookkit-sync-free", kind="hookkit", setup=_hookkit(lambda: S(sync_free=True)),
                    fields=frozenset({"sync_free"}), description="sync-free denoising loop"),
        BenchConfig(name="hookkit-compile", kind="hookkit", setup=_hookkit(lambda: S(compile=_compile())),
                    fields=frozenset({"compile"}), description="regional compile of the adapter's repeated blocks"),
        BenchConfig(name="hookkit-compile-ro", kind="hookkit",
                    setup=_hookkit(lambda: S(compile=_compile("reduce-overhead"))), fields=frozenset({"compile"}),
                    needs_cuda=True, description="regional compile, mode='reduce-overhead' (CUDA-graph safe)"),
        BenchConfig(name="hookkit-cuda-graphs", kind="hookkit",
                    setup=_hookkit(lambda: S(compile=_compile(cuda_graphs="transformer"), memo=True)),
                    fields=frozenset({"compile", "memo"}), needs_cuda=True,
                    description="regional compile + one CUDA graph per transformer call (+ memo where needed)"),
        BenchConfig(name="hookkit-cache-fast+compile", kind="hookkit",
                    setup=_hookkit(lambda: S(cache=_cache_fast(), compile=_compile())),
                    fields=frozenset({"cache", "compile"}), description="static 'fast' DBCache + regional compile"),
        BenchConfig(name="hookkit-fp8+compile", kind="hookkit",
                    setup=_hookkit(lambda: S(quantize=hookkit.Quantize(scheme="fp8_row"), compile=_compile())),
                    fields=frozenset({"quantize", "compile"}), needs_cuda=True,
                    description="torchao fp8 dynamic per-row + regional compile"),
        BenchConfig(name="hookkit-fp8+cuda-graphs", kind="hookkit",
                    setup=_hookkit(lambda: S(quantize=hookkit.Quantize(scheme="fp8_row"),
                                             compile=_compile(cuda_graphs="transformer"), memo=True)),
                    fields=frozenset({"quantize", "compile", "memo"}), needs_cuda=True,
                    description="torchao fp8 dynamic per-row + regional compile + one CUDA graph per transformer call"),
        BenchConfig(name="hookkit-fp8+cache-fast+cuda-graphs", kind="hookkit",
                    setup=_hookkit(lambda: S(cache=_cache_fast(), quantize=hookkit.Quantize(scheme="fp8_row"),
                                             compile=_compile(cuda_graphs="transformer"), memo=True)),
                    fields=frozenset({"cache", "quantize", "compile", "memo"}), needs_cuda=True,
                    description="static 'fast' DBCache + fp8 dynamic per-row + one CUDA graph per call and decision"),
        BenchConfig(name="hookkit-fp8+cache-dyn+cuda-graphs", kind="hookkit",
                    setup=_hookkit(lambda: S(cache=_cache_fast_dynamic(), quantize=hookkit.Quantize(scheme="fp8_row"),
                                             compile=_compile(cuda_graphs="transformer"), memo=True)),
                    fields=frozenset({"cache", "quantize", "compile", "memo"}), needs_cuda=True,
                    description="dynamic DBCache (caching the 'fast' mask's steps) + fp8 + transformer graphs split "
                                "at each decision"),
        BenchConfig(name="hookkit-cache-dyn+cuda-graphs", kind="hookkit",
                    setup=_hookkit(lambda: S(cache=_cache_fast_dynamic(), compile=_compile(cuda_graphs="transformer"),
                                             memo=True)),
                    fields=frozenset({"cache", "compile", "memo"}), needs_cuda=True,
                    description="dynamic DBCache (caching the 'fast' mask's steps) + transformer graphs split at "
                                "each decision"),
        BenchConfig(name="hookkit-cache-fast+cuda-graphs", kind="hookkit",
                    setup=_hookkit(lambda: S(cache=_cache_fast(), compile=_compile(cuda_graphs="transformer"),
                                             memo=True)),
                    fields=frozenset({"cache", "compile", "memo"}), needs_cuda=True,
                    description="static 'fast' DBCache + one CUDA graph per call and decision"),
        BenchConfig(name="hookkit-fp8-mod+cuda-graphs", kind="hookkit", setup=_hookkit(_fp8_mod_fast_graphs(cached=False)),
                    fields=frozenset({"quantize", "compile", "memo"}), needs_cuda=True,
                    description="the fastest row's fp8 (modulation included) and transformer graphs, uncached: "
                                "every step computed (the uncached step is its time / steps)"),
        BenchConfig(name="hookkit-fp8-mod+cache-2x+cuda-graphs", kind="hookkit",
                    setup=_hookkit(lambda: S(cache=_cache_2x(), quantize=hookkit.Quantize(scheme="fp8_row",
                                                                                       include_modulation=True),
                                             compile=_compile(cuda_graphs="transformer"), memo=True)),
                    fields=frozenset({"cache", "quantize", "compile", "memo"}), needs_cuda=True,
                    description="the tuned 2x rule (schedule, TaylorSeer 2: 14 of 28 steps, no block on a cached "
                                "step) + fp8 incl. modulation + transformer graphs"),
        BenchConfig(name="cache-dit+fp8+compile+2x", kind="peer", setup=_cache_dit_fp8_compile_2x,
                    needs_module="cache_dit", needs_cuda=True,
                    description="cache-dit DBCache F1B0 on the tuned 2x rule's 14 of 28 steps + its fp8 per-row + "
                                "stock regional compile"),
        BenchConfig(name="hookkit-fp8-mod+cache-fast+cuda-graphs", kind="hookkit", setup=_hookkit(_fp8_mod_fast_graphs()),
                    fields=frozenset({"cache", "quantize", "compile", "memo"}), needs_cuda=True,
                    description="as hookkit-fp8+cache-fast+cuda-graphs, the AdaLN modulation Linears in fp8 too"),
        *(BenchConfig(name=f"hookkit-fp8-mod+cache-fast+cuda-graphs+rows-{rows}", kind="hookkit",
                      setup=_hookkit(_fp8_mod_fast_graphs(fuse_fp8_rows=rows)),
                      fields=frozenset({"cache", "quantize", "compile", "memo"}), needs_cuda=True,
                      description=f"as hookkit-fp8-mod+cache-fast+cuda-graphs with Compile(fuse_fp8_rows={rows!r})")
          for rows in ("exact", "off")),
        BenchConfig(name="hookkit-fp8-mod+cache-fast+cuda-graphs+rope-complex", kind="hookkit",
                    setup=_hookkit(_fp8_mod_fast_graphs(real_rope=False)),
                    fields=frozenset({"cache", "quantize", "compile", "memo"}), needs_cuda=True,
                    description="as hookkit-fp8-mod+cache-fast+cuda-graphs with Compile(real_rope=False): complex "
                                "RoPE (Qwen-Image) left to inductor's ATen fallback"),
        BenchConfig(name="hookkit-fp8-mod+cache-fast+cuda-graphs+autotune", kind="hookkit",
                    setup=_hookkit(_fp8_mod_fast_graphs("max-autotune-no-cudagraphs")),
                    fields=frozenset({"cache", "quantize", "compile", "memo"}), needs_cuda=True,
                    description="as hookkit-fp8-mod+cache-fast+cuda-graphs, regions compiled with "
                                "mode='max-autotune-no-cudagraphs' (autotuned GEMM templates; long warm-up)"),
        BenchConfig(name="hookkit-int8-attention", kind="hookkit",
                    setup=_hookkit(lambda: S(attention=hookkit.Attention(low_precision="hookkit_int8"))),
                    fields=frozenset({"attention"}), needs_cuda=True,
                    description="eager, hookkit's int8 Q.K^T attention kernel on every block of the middle steps "
                                "(bf16 SDPA on the first and last 2 steps)"),
        BenchConfig(name="hookkit-fp8+cache-fast+int8-attention", kind="hookkit",
                    setup=_hookkit(lambda: S(cache=_cache_fast(), quantize=hookkit.Quantize(scheme="fp8_row"),
                                             attention=hookkit.Attention(low_precision="hookkit_int8"))),
                    fields=frozenset({"cache", "quantize", "attention"}), needs_cuda=True,
                    description="static 'fast' DBCache + fp8 dynamic per-row + int8 attention on the middle steps, "
                                "eager (Attention does not compose with Compile yet)"),
        BenchConfig(name="hookkit-all", kind="hookkit",
                    setup=_hookkit(lambda: S(cache=_cache_fast(), memo=True, sync_free=True, compile=_compile())),
                    fields=frozenset({"cache", "memo", "sync_free", "compile"}),
                    description="static 'fast' DBCache + memo + sync-free + regional compile"),
    ]
    return {row.name: row for row in rows}


CONFIGS: dict[str, BenchConfig] = _configs()

#: named groups of rows for `--configs`: "video" is the matrix of the video models (issue 31): stock eager and
#: regional compile, diffusers' two caches, the strongest peer and hookkit's fastest, the last two on the same static
#: "fast" computed steps. Image-only rows (the modulation variants: Wan has no AdaLN Linears to quantize) stay out.
ROW_GROUPS: dict[str, tuple[str, ...]] = {
    "video": ("eager", "regional-compile", "fbcache", "magcache", "cache-dit+fp8+compile",
              "hookkit-fp8+cache-fast+cuda-graphs", "hookkit-int8-attention", "hookkit-fp8+cache-fast+int8-attention"),
}

#: a row named "spec:PATH" runs the Spec in the JSON file PATH (`Spec.to_dict()`, as `hookkit tune --json` writes it)
SPEC_PREFIX = "spec:"


def read_spec(path: str | Path, flag: str = "--spec") -> Any:
    """The `hookkit.Spec` of a JSON file written from `Spec.to_dict()` (`hookkit tune --json`); SpecError naming the
    flag when the file is missing or is not a Spec."""
    source = Path(path)
    try:
        data = json.loads(source.read_text())
    except (OSError, ValueError) as exc:
        raise SpecError(f"{flag} {source}: expected a JSON file of a hookkit Spec (hookkit tune --json writes one), "
                        f"got {type(exc).__name__}: {exc}.") from None
    return hookkit.Spec.from_dict(data)


def config_named(name: str) -> BenchConfig:
    """A shipped row, or "spec:PATH": the Spec in that JSON file (read now, so a bad file fails before any run)."""
    if name.startswith(SPEC_PREFIX):
        path = name[len(SPEC_PREFIX):]
        spec = read_spec(path, "--configs spec:")
        fields = frozenset(f for f in ("cache", "quantize", "compile", "parallel") if getattr(spec, f) is not None)
        return BenchConfig(name=name, kind="hookkit", setup=_hookkit(lambda: read_spec(path)), fields=fields,
                           description=f"the Spec in {path}")
    return CONFIGS[name]


def select_configs(names: Sequence[str] | None, device: torch.device) -> tuple[list[BenchConfig], list[str]]:
    """The rows to run, "eager" always first (it is the reference), and notes on the rows left out. A name of
    `ROW_GROUPS` stands for its rows.

    Named rows that cannot run here stay in (their row says why); the default matrix keeps only the rows
    that can run, and notes the others.
    """
    have = available_fields()
    notes: list[str] = []
    if names:
        names = [row for n in names for row in ROW_GROUPS.get(n, (n,))]
        unknown = [n for n in names if n not in CONFIGS and not n.startswith(SPEC_PREFIX)]
        if unknown:
            import difflib

            close = difflib.get_close_matches(unknown[0], list(CONFIGS), n=1, cutoff=0.5)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise SpecError(f"--configs: unknown configuration {unknown[0]!r}; {hint}known: {list(CONFIGS)} and the "
                            f"groups {list(ROW_GROUPS)} (`hookkit bench --list` says what each does and whether it "
                            "runs here).")
        chosen = [config_named(n) for n in dict.fromkeys(names)]
    else:
        chosen = []
        for cfg in CONFIGS.values():
            reason = cfg.unavailable(device, have)
            if reason is None:
                chosen.append(cfg)
            else:
                notes.append(f"{cfg.name}: skipped ({reason})")
    if chosen[0].name != "eager":
        chosen = [CONFIGS["eager"]] + [c for c in chosen if c.name != "eager"]
        if names:
            notes.append("eager: added as the reference for speed-up and PSNR")
    return chosen, notes


# --- one measurement (in the child process) ----------------------------------------------------------------

ROW_KEYS = ("config", "kind", "description", "status", "note", "load_s", "setup_s", "warmup_s", "latency_s",
            "latencies_s", "peak_memory_gb", "memory_kind", "speedup", "psnr_db", "identical", "features",
            "compiled_graphs", "graphs_compiled_while_timed", "first_call_s", "time_to_first_image_s", "cold")


def _dynamo_graphs() -> int:
    """Graphs torch.compile has compiled in this process so far (dynamo's `unique_graphs` counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _peak_memory_gb(device: torch.device) -> tuple[float, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9, "cuda_max_memory_allocated"
    # ru_maxrss is in KiB on Linux, bytes on macOS
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss * (1 if sys.platform == "darwin" else 1024) / 1e9, "cpu_max_rss"


def _summary_data(handle: Any) -> dict[str, Any]:
    if handle is None:
        return {}
    summary = handle.summary()
    return {name: feature.data for name, feature in summary.features.items()}


def output_type_for(opts: ModelOptions) -> str:
    """Full-size random models return latents (decoding is skipped: it is not what is measured); others
    return decoded images/frames as tensors in [0, 1]."""
    return "latent" if opts.full else "pt"


def measure(config: BenchConfig, opts: ModelOptions, runs: int, warmup: int, out_dir: Path) -> dict[str, Any]:
    """Build a fresh pipeline, set `config` up, warm up, time `runs` calls; save the last output as .pt."""
    device = resolve_device(opts.device)
    reason = config.unavailable(device, available_fields())
    if reason is not None:
        return _empty_row(config, "skipped", reason)
    row = _empty_row(config, "ok", "")
    try:
        t0 = time.perf_counter()
        pipe = load_pipeline(opts)
        row["load_s"] = time.perf_counter() - t0
        ctx = RunContext(pipe=pipe, opts=opts)
        graphs_before = _dynamo_graphs()
        t0 = time.perf_counter()
        config.setup(ctx)
        row["setup_s"] = time.perf_counter() - t0
        output_type = output_type_for(opts)
        t0 = time.perf_counter()
        for i in range(warmup):
            output_of(pipe(**call_kwargs(pipe, opts, output_type)))
            if i == 0:
                synchronize(device)
                row["first_call_s"] = time.perf_counter() - t0
        synchronize(device)
        row["warmup_s"] = time.perf_counter() - t0
        graphs_warm = _dynamo_graphs()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        latencies = []
        output = None
        for _ in range(runs):
            kwargs = call_kwargs(pipe, opts, output_type)
            seconds, output = timed(lambda: output_of(pipe(**kwargs)), device)
            latencies.append(seconds)
        row["latencies_s"] = latencies
        if warmup == 0:
            row["first_call_s"] = latencies[0]
        # what a user waits for after building the pipeline: enable (quantize, hooks) plus the first call
        # (compilation, autotuning, graph capture)
        row["time_to_first_image_s"] = row["setup_s"] + row["first_call_s"]
        row["cold"] = cold_cache_dirs()
        # a graph compiled after the warm-up means the timed runs include compilation: the median is suspect
        graphs_after = _dynamo_graphs()
        row["compiled_graphs"] = graphs_after - graphs_before
        row["graphs_compiled_while_timed"] = graphs_after - graphs_warm
        row["latency_s"] = statistics.median(latencies)
        row["peak_memory_gb"], row["memory_kind"] = _peak_memory_gb(device)
        row["features"] = _summary_data(ctx.handle) if ctx.features is None else ctx.features()
        torch.save(output.detach().float().cpu(), out_dir / f"{config.name}.pt")
    except Exception as exc:  # a failing configuration is a result, not a crash
        traceback.print_exc(file=sys.stderr)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        row.update(status="failed", note=f"{type(exc).__name__}: {first}"[:300])
    return row


# --- the matrix (in the parent process) ------------------------------------------------------------------


#: The compiler caches `--cold` points at fresh, empty folders in each row's process: inductor's (FX graphs,
#: AOTAutograd, autotuning results, generated kernels) and Triton's (compiled kernels).
COLD_CACHE_VARS = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


def cold_env(root: Path, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a `--cold` row's process: `environ` (default: this process's) with every compiler
    cache in `COLD_CACHE_VARS` pointed at a new empty folder under `root`, so that nothing compiled by an
    earlier row or run is reused."""
    env = dict(os.environ if environ is None else environ)
    for var in COLD_CACHE_VARS:
        folder = root / var.lower()
        folder.mkdir(parents=True, exist_ok=False)
        env[var] = str(folder)
    env["HOOKKIT_BENCH_COLD"] = "1"
    return env


def cold_cache_dirs() -> dict[str, Any] | None:
    """In a row's process: the fresh cache folders `--cold` gave it, or None for a warm row."""
    if os.environ.get("HOOKKIT_BENCH_COLD") != "1":
        return None
    return {var: os.environ.get(var) for var in COLD_CACHE_VARS}


def _files_under(folder: str | None) -> int:
    return sum(len(files) for _, _, files in os.walk(folder)) if folder else 0


def run_matrix(configs: Sequence[BenchConfig], opts: ModelOptions, runs: int, warmup: int, timeout_s: float,
               out_dir: Path | None = None, log: Callable[[str], None] = print,
               cold: bool = False) -> list[dict[str, Any]]:
    """Run each configuration in its own `python -m hookkit bench-one` process; rows in `configs` order.

    `cold`: every row's process gets fresh, empty compiler cache folders (`cold_env`), deleted after the row;
    its `first_call_s` and `time_to_first_image_s` then include all compilation and autotuning.
    """
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        if out_dir is None:
            out_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="hookkit-bench-")))
        out_dir.mkdir(parents=True, exist_ok=True)
        device, have = resolve_device(opts.device), available_fields()
        for i, config in enumerate(configs, 1):
            log(f"[{i}/{len(configs)}] {config.name}: {config.description}")
            reason = config.unavailable(device, have)
            rows.append(_run_child(config, opts, runs, warmup, timeout_s, out_dir, cold) if reason is None
                        else _empty_row(config, "skipped", reason))
            log(f"[{i}/{len(configs)}] {config.name}: {_status_line(rows[-1])}")
        _compare(rows, out_dir, peak=None if opts.full else 1.0)
    return rows


def _run_child(config: BenchConfig, opts: ModelOptions, runs: int, warmup: int, timeout_s: float,
               out_dir: Path, cold: bool = False) -> dict[str, Any]:
    if not cold:
        return _run_child_process(config, opts, runs, warmup, timeout_s, out_dir, None)
    with tempfile.TemporaryDirectory(prefix=f"hookkit-cold-{config.name}-") as root:
        row = _run_child_process(config, opts, runs, warmup, timeout_s, out_dir, cold_env(Path(root)))
        if isinstance(row.get("cold"), dict):  # what the row compiled from nothing (the folders go away now)
            row["cold"]["files_written"] = {var: _files_under(row["cold"].get(var)) for var in COLD_CACHE_VARS}
    return row


def _run_child_process(config: BenchConfig, opts: ModelOptions, runs: int, warmup: int, timeout_s: float,
                       out_dir: Path, env: dict[str, str] | None) -> dict[str, Any]:
    result = out_dir / f"{config.name}.json"
    argv = [sys.executable, "-m", "hookkit", "bench-one", "--config", config.name, "--runs", str(runs),
            "--warmup", str(warmup), "--out-dir", str(out_dir), "--result", str(result), *opts.to_argv()]
    log = out_dir / f"{config.name}.log"  # the child's stderr: tracebacks of failed rows, compile warnings
    try:
        proc = subprocess.run(argv, timeout=timeout_s, capture_output=True, text=True, env=env)
        log.write_text(proc.stderr)
        failure = None if proc.returncode == 0 else f"exit code {proc.returncode}: {_tail(proc.stderr)}"
    except subprocess.TimeoutExpired as exc:
        log.write_text(exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or "")
        failure = f"timed out after {timeout_s:.0f} s"
    if failure is None and result.is_file():
        return json.loads(result.read_text())
    return _empty_row(config, "failed", f"bench-one process: {failure or 'wrote no result'}")


def _empty_row(config: BenchConfig, status: str, note: str) -> dict[str, Any]:
    """A row with no measurement: `status` "skipped" or "failed", `note` says why."""
    row: dict[str, Any] = {key: None for key in ROW_KEYS}
    row.update(config=config.name, kind=config.kind, description=config.description, status=status,
               note=note[:300], latencies_s=[], identical=False, features={})
    return row


def _tail(text: str, lines: int = 3) -> str:
    return " / ".join(line.strip() for line in text.strip().splitlines()[-lines:])


def _compare(rows: list[dict[str, Any]], out_dir: Path, peak: float | None) -> None:
    """Speed-up and PSNR of every row against the eager row (the first)."""
    ref_row = rows[0]
    ref_path = out_dir / f"{ref_row['config']}.pt"
    reference = torch.load(ref_path) if ref_row["status"] == "ok" and ref_path.is_file() else None
    for row in rows:
        if row["status"] != "ok":
            continue
        if ref_row["status"] == "ok":
            row["speedup"] = ref_row["latency_s"] / row["latency_s"]
        path = out_dir / f"{row['config']}.pt"
        if reference is not None and path.is_file():
            output = torch.load(path)
            if output.shape == reference.shape:
                value = psnr(reference, output, peak)
                row["psnr_db"] = None if math.isinf(value) else value
                row["identical"] = torch.equal(reference, output)
            else:
                row["note"] = (row["note"] + f"; output shape {tuple(output.shape)} differs").lstrip("; ")


def _status_line(row: dict[str, Any]) -> str:
    if row["status"] != "ok":
        return f"{row['status']}: {row['note']}"
    return f"median {row['latency_s']:.4f} s over {len(row['latencies_s'])} runs"


def cache_stats(features: dict[str, Any]) -> tuple[int, int] | None:
    """(cached, total) transformer steps from the DBCache summary data, summed over CFG branches."""
    data = features.get("cache") or features.get("dbcache")  # "dbcache": result files written before 0.1
    if not isinstance(data, dict) or not isinstance(data.get("branches"), dict):
        return None
    cached = total = 0
    for branch in data["branches"].values():
        cached += len(branch.get("cached", ()))
        total += len(branch.get("cached", ())) + len(branch.get("computed", ()))
    return cached, total


def _cached_steps(features: dict[str, Any]) -> str | None:
    stats = cache_stats(features)
    return None if stats is None else f"cached {stats[0]}/{stats[1]} steps"


def spread(row: dict[str, Any]) -> tuple[float, float] | None:
    """(min, max) of a row's timed runs, None without them (a skipped row, or an older JSON)."""
    latencies = row.get("latencies_s") or []
    return (min(latencies), max(latencies)) if row.get("status") == "ok" and latencies else None


def unresolved(row: dict[str, Any], reference: dict[str, Any]) -> str | None:
    """A note when the row's or the reference's spread (max - min) is larger than the latency difference the
    row claims against the reference: on a busy host the speed-up (or slow-down) is then noise."""
    if row is reference or row.get("status") != "ok" or reference.get("status") != "ok":
        return None
    mine, theirs = spread(row), spread(reference)
    if mine is None or theirs is None:
        return None
    width = max(mine[1] - mine[0], theirs[1] - theirs[0])
    diff = abs(reference["latency_s"] - row["latency_s"])
    if width <= diff:
        return None
    return (f"not resolved: spread {width:.4f} s > the {diff:.4f} s difference to {reference['config']} "
            "(a busy host? more --runs)")


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """The results as a markdown table (also readable in a terminal): the median of the timed runs and their
    spread (min-max), and a note on rows whose spread is larger than the difference they claim to the first row."""
    out = []
    for i, row in enumerate(rows):
        ok = row["status"] == "ok"
        notes = [] if ok else [f"{row['status']}: {row['note']}"]
        if ok and row["note"]:
            notes.append(row["note"])
        flag = unresolved(row, rows[0]) if rows else None
        if flag:
            notes.append(flag)
        cached = _cached_steps(row.get("features") or {})
        if cached:
            notes.append(cached)
        if ok and row.get("cold") is not None and row.get("time_to_first_image_s") is not None:
            notes.append(f"cold caches: first image {row['time_to_first_image_s']:.1f} s after enable")
        if ok and row.get("graphs_compiled_while_timed"):
            notes.append(f"{row['graphs_compiled_while_timed']} graph(s) compiled during the timed runs: add warm-up")
        if i == 0 and ok:
            psnr_cell = "reference"
        elif row["identical"]:
            psnr_cell = "inf (bitwise equal)"
        elif row["psnr_db"] is not None:
            psnr_cell = f"{row['psnr_db']:.2f}"
        else:
            psnr_cell = "—"
        bounds = spread(row)
        out.append([
            row["config"],
            f"{row['latency_s']:.4f}" if ok else "—",
            f"{bounds[0]:.4f}–{bounds[1]:.4f}" if bounds else "—",
            f"{row['warmup_s']:.2f}" if ok and row["warmup_s"] is not None else "—",
            f"{row['peak_memory_gb']:.3f}" if ok else "—",
            f"{row['speedup']:.2f}x" if ok and row["speedup"] is not None else "—",
            psnr_cell,
            "; ".join(notes),
        ])
    return table(["config", "median latency (s)", "spread min–max (s)", "warm-up (s)", "peak mem (GB)", "speed-up", "PSNR vs eager (dB)",
                  "notes"], out)


def environment(device: torch.device) -> dict[str, Any]:
    """Versions, the device and the installed features: what a reader needs to place a measurement."""
    import platform

    import diffusers

    return dict(hookkit=hookkit.__version__, torch=torch.__version__, diffusers=diffusers.__version__,
                python=platform.python_version(), device=device_description(device),
                hookkit_features=sorted(available_fields()))


def report(rows: list[dict[str, Any]], notes: list[str], opts: ModelOptions, runs: int, warmup: int,
           argv: Sequence[str]) -> dict[str, Any]:
    """The JSON document `hookkit bench --json` writes."""
    device = resolve_device(opts.device)
    memory = "CUDA max_memory_allocated" if device.type == "cuda" else "CPU peak RSS of the process"
    return dict(
        command=["hookkit", *argv], environment=environment(device),
        model=dict(name=opts.name, full=opts.full, model_path=opts.model_path, steps=opts.num_steps(),
                   height=opts.height, width=opts.width, batch=opts.batch, seed=opts.seed,
                   dtype=str(resolve_dtype(opts.dtype, device)).removeprefix("torch."),
                   output=output_type_for(opts)),
        runs=runs, warmup=warmup, memory=memory, notes=notes, rows=rows,
    )


def read_report(path: Path) -> dict[str, Any]:
    """A `hookkit bench --json` file, or a SpecError that says what is wrong with it."""
    expected = "expected a JSON file written by `hookkit bench --json`"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise SpecError(f"--merge {path}: no such file; {expected}.") from None
    except (OSError, ValueError) as exc:
        raise SpecError(f"--merge {path}: {expected}, could not read it ({exc}).") from None
    missing = [k for k in ("command", "environment", "model", "runs", "warmup", "notes", "rows")
               if not isinstance(data, dict) or k not in data]
    if missing:
        raise SpecError(f"--merge {path}: {expected}, but it has no {missing[0]!r} key.")
    return data


def merge_reports(reports: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One report from several `hookkit bench --json` files of the same model, settings and machine.

    Long matrices are run in groups (one command each, every group starting with its own eager row). The
    first file's eager row is the reference: later rows get their speed-up recomputed against it and keep
    the PSNR measured against their own group's eager run (same seed, so the same weights and inputs).
    A configuration already present is not repeated.
    """
    if not reports:
        raise SpecError("--merge: expected at least one JSON file written by `hookkit bench --json`.")
    first = reports[0]
    for i, other in enumerate(reports[1:], 2):
        for key in ("model", "runs", "warmup"):
            if other.get(key) != first.get(key):
                raise SpecError(f"--merge: file {i} has {key}={other.get(key)!r}, file 1 has {first.get(key)!r}; "
                                "merge only runs of the same model and settings.")
        if other["environment"]["device"] != first["environment"]["device"]:
            raise SpecError(f"--merge: file {i} ran on {other['environment']['device']!r}, file 1 on "
                            f"{first['environment']['device']!r}; merge only runs of one machine.")
    rows = [dict(row) for row in first["rows"]]
    reference = rows[0]
    seen = {row["config"] for row in rows}
    notes = list(first["notes"])
    for other in reports[1:]:
        for row in other["rows"]:
            if row["config"] in seen:
                continue
            row = dict(row)
            if row["status"] == "ok" and reference["status"] == "ok":
                row["speedup"] = reference["latency_s"] / row["latency_s"]
            rows.append(row)
            seen.add(row["config"])
        notes += [n for n in other["notes"] if n not in notes]
    return {**first, "command": [r["command"] for r in reports], "notes": notes, "rows": rows}


def _finite(value: Any) -> Any:
    """`value` with every NaN/Infinity float (e.g. in a feature's statistics) replaced by its string."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def to_json(data: Any, indent: int | None = None) -> str:
    """Strict JSON (no NaN/Infinity: strict parsers reject them). Bitwise-equal outputs have
    `psnr_db: null`, `identical: true`; anything that is not JSON becomes its string."""
    return json.dumps(_finite(data), indent=indent, allow_nan=False, default=str)


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_json(data, indent=2) + "\n")


#: the environment variable that sets `hookkit bench --timeout`'s default, and the default without it
TIMEOUT_VARIABLE = "HOOKKIT_BENCH_TIMEOUT"
DEFAULT_TIMEOUT_S = 1800.0


def check_timeout(seconds: float, where: str) -> float:
    """`seconds` when it is a finite number > 0, else a SpecError naming `where` (the flag or the variable)."""
    if not (math.isfinite(seconds) and seconds > 0):
        raise SpecError(f"{where}: expected a number of seconds > 0, got {seconds:g}.")
    return seconds


def default_timeout() -> float:
    """Seconds a row of `hookkit bench` may take when `--timeout` is not given: `$HOOKKIT_BENCH_TIMEOUT`, else
    `DEFAULT_TIMEOUT_S`. Read when a matrix runs, not when the parser is built: whatever the variable holds,
    `--help` and the other commands work."""
    text = os.environ.get(TIMEOUT_VARIABLE, "").strip()
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(text)
    except ValueError:
        raise SpecError(f"{TIMEOUT_VARIABLE}={text!r}: expected a number of seconds > 0 (the default of "
                        f"--timeout), got {text!r}. Set e.g. {TIMEOUT_VARIABLE}=3600, or unset it for "
                        f"{DEFAULT_TIMEOUT_S:g}.") from None
    return check_timeout(seconds, f"{TIMEOUT_VARIABLE}={text!r}")


__all__ = [
    "CONFIGS",
    "ROW_KEYS",
    "BenchConfig",
    "ModelOptions",
    "available_fields",
    "call_kwargs",
    "load_pipeline",
    "markdown_table",
    "measure",
    "psnr",
    "run_matrix",
    "select_configs",
]
