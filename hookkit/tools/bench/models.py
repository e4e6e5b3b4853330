"""The pipelines `hookkit generate` and `hookkit bench` run: which exist here, building them, checking a size before
anything is loaded, and the keyword arguments of one call.

Models come from `hookkit.tools.zoo` (tiny on the CPU, or the full-size architecture with `full=True`, random
weights, random prompt embeddings: no downloads) or from a local folder (`model_path`).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import torch

import hookkit
from hookkit.core.quiet import quiet_imports
from hookkit.core.validate import closest
from hookkit.errors import SpecError, UnsupportedError
from hookkit.tools import local, zoo
from hookkit.tools.meta import meta_device


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


def check_model(opts: ModelOptions, flag: str = "--model") -> None:
    """Fail early, with the list of what exists, for a model that cannot be built here. `flag` is how the command
    names the model (`bench`'s and the benchmark scripts' --model, `generate`'s positional MODEL), so that the
    message names what was typed."""
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
            with meta_device():  # the scheduler stays the tiny pipeline's: it cannot be built on meta
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


def _tensor_bytes(modules: list[torch.nn.Module], dtype: torch.dtype) -> int:
    """Bytes of the parameters and buffers of `modules` (on any device, meta included) with float tensors in `dtype`."""
    size = torch.empty((), dtype=dtype).element_size()
    return sum(t.numel() * (size if t.is_floating_point() else t.element_size())
               for m in modules for t in [*m.parameters(), *m.buffers()])


def _decoder_channels(vae: Any) -> int | None:
    """Channels of the VAE decoder's last blocks, which run at the output's full resolution: AutoencoderKL's (and
    CogVideoX's) first `block_out_channels`, Wan's and Qwen-Image's `base_dim`; None when unknown."""
    config = getattr(vae, "config", None)
    if config is None:
        return None
    channels = config.get("block_out_channels")
    if isinstance(channels, (list, tuple)) and channels and isinstance(channels[0], int):
        return channels[0]
    base = config.get("base_dim")
    return base if isinstance(base, int) else None


def _size_text(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def check_memory(opts: ModelOptions, device: torch.device, *, tiled: bool | None = None,
                 offload: str | None = None) -> None:
    """Refuse a call whose weights and activations cannot fit the memory `device` has available, before anything is
    loaded: found at the decode, it loses the whole denoising in an allocator traceback.

    What is counted is a lower bound, so that nothing that fits is refused: the weights of the transformer(s) and the
    VAE that are on the device at once, plus two activations of the largest layer each phase must hold, an input
    and an output. Denoising holds the hidden states, `batch x tokens x heads x head_dim`; decoding (not for `--full`,
    which returns latents; not under `tiled` VAE decoding) the VAE decoder's last block at full resolution,
    `batch x channels x height x width` for one frame (video VAEs decode frame by frame). Text encoders, attention
    and every other buffer come on top. Weights that alone exceed the memory are left to `check_fits` and
    `local.check_fits`, which name them: this check refuses what the call's size adds.

    Args:
        opts: the model and the call.
        device: where it runs; its available memory is `_available_bytes(device)`.
        tiled: whether the VAE decodes in tiles (`--vae-tiling`); None for a command without that flag (the message
            then does not suggest it).
        offload: "model" keeps one component on the device at a time, "sequential" one layer (no weights counted).
    """
    try:
        available = _available_bytes(device)
    except (OSError, RuntimeError, AssertionError):  # no /proc/meminfo; a CUDA device type on a machine without one
        return
    pipe = skeleton_pipeline(opts)
    if pipe is None:
        return
    default_height, default_width, default_frames = default_size(pipe, opts)
    height, width = opts.height or default_height, opts.width or default_width
    if height is None or width is None:
        return
    frames = opts.frames or default_frames
    dtype = resolve_dtype(opts.dtype, device)
    size = torch.empty((), dtype=dtype).element_size()
    transformers = [m for m in (getattr(pipe, "transformer", None), getattr(pipe, "transformer_2", None))
                    if isinstance(m, torch.nn.Module)]
    vae = getattr(pipe, "vae", None)
    experts = [_tensor_bytes([m], dtype) for m in transformers]  # "model" offload holds one expert at a time
    weights = {"transformer": (max(experts, default=0) if offload == "model" else sum(experts)),
               "vae": _tensor_bytes([vae], dtype) if isinstance(vae, torch.nn.Module) else 0}
    if offload == "sequential":
        weights = {key: 0 for key in weights}
    config = transformers[0].config if transformers else {}
    heads, head_dim = config.get("num_attention_heads"), config.get("attention_head_dim")
    tokens = local.latent_tokens(pipe, height, width, frames)
    phases: list[tuple[int, int, str]] = []  # (bytes needed, of which weights, what)
    if isinstance(heads, int) and isinstance(head_dim, int) and tokens is not None:
        hidden = 2 * opts.batch * tokens * heads * head_dim * size
        resident = weights["transformer"] + (0 if offload else weights["vae"])
        phases.append((resident + hidden, resident,
                       f"denoising: {_size_text(resident)} of weights and {_size_text(hidden)} of hidden states "
                       f"({opts.batch} x {tokens:,} tokens x {heads * head_dim} channels, a block's input and output)"))
    channels = _decoder_channels(vae)
    if not opts.full and not tiled and channels is not None:
        decoded = 2 * opts.batch * channels * height * width * size
        resident = weights["vae"] + (0 if offload else weights["transformer"])
        phases.append((resident + decoded, resident,
                       f"decoding: {_size_text(resident)} of weights and {_size_text(decoded)} for the VAE's last block "
                       f"({opts.batch} x {channels} channels x {height}x{width}, its input and output)"))
    if not phases:
        return
    need, resident, why = max(phases)
    if need <= available or resident > available:  # weights that alone cannot fit: `check_fits` says so, naming them
        return
    asked = " ".join(f"{flag} {value}" for flag, value in (
        ("--height", opts.height), ("--width", opts.width), ("--frames", opts.frames),
        ("--batch", opts.batch if opts.batch != 1 else None)) if value is not None)
    decoding = why.startswith("decoding")
    fixes = ["a smaller --height/--width" + (" or --batch" if opts.batch > 1 else "")]
    if decoding and tiled is False:
        fixes.append("--vae-tiling (the VAE decodes in tiles)")
    if opts.dtype in (None, "float32") and dtype == torch.float32:
        fixes.append("--dtype bfloat16")
    raise UnsupportedError(
        f"{asked + ': ' if asked else ''}{type(pipe).__name__} needs at least {_size_text(need)} on {device} for this "
        f"call, and {_size_text(available)} are available. The largest phase is {why}; attention, text encoders and "
        f"other buffers come on top. Pass {', or '.join(fixes)}.")


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


def load_pipeline(opts: ModelOptions, flag: str = "--model") -> Any:
    """The pipeline `opts` describes, on its device and in its dtype, with diffusers' progress bar off. `flag`: how
    the command names the model, for its messages (`check_model`)."""
    check_model(opts, flag)
    device = resolve_device(opts.device)
    dtype = resolve_dtype(opts.dtype, device)
    if opts.model_path is not None:
        pipe = _from_pretrained(opts, dtype, flag)
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
    with meta_device():
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
def _from_pretrained(opts: ModelOptions, dtype: torch.dtype, flag: str) -> Any:
    from diffusers import DiffusionPipeline

    path = Path(opts.model_path or "")
    index = local.read_index(path)  # refuses a folder whose loading would run code it names or ships
    # Components saved as null (e.g. a pipeline saved without text encoders) must be passed as None.
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
        raise SpecError(f"--model-path {str(path)!r}: holds {type(pipe).__name__} with {found}; {flag} {opts.name!r} "
                        f"is for {list(adapter.transformer)}. Pass the matching {flag} name.")
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


def output_type_for(opts: ModelOptions) -> str:
    """Full-size random models return latents (decoding is skipped: it is not what is measured); others
    return decoded images/frames as tensors in [0, 1]."""
    return "latent" if opts.full else "pt"
