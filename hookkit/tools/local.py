"""Checks and call options of `hookkit generate` for a local pipeline folder, run before any weight is read,
and the output-path checks the commands run before they load or time anything.

A FLUX.1-dev folder is tens of GB: what can be known from `model_index.json`, the components' `config.json`
and the safetensors headers (a few KB each) is checked first, so a wrong MODEL, a folder without text encoders
given `--prompt`, a quantization scheme this GPU lacks or a model larger than the device fails in a second,
not after the load.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import struct
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

import hookkit
from hookkit.errors import SpecError, UnsupportedError
from hookkit.tools.meta import meta_device

#: bytes per element of the safetensors dtypes a pipeline holds
_ELEMENT_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
                  "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_FLOATS = {"F64", "F32", "F16", "BF16"}
#: model_index.json keys of the text encoders a prompt needs
TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")


def read_index(folder: Path) -> dict[str, Any]:
    """The folder's `model_index.json`, or a SpecError saying what the folder lacks. Its components are checked
    (`check_components`): a folder whose loading would import a module it names or run code it ships is refused
    here, before anything is loaded."""
    if not folder.is_dir():
        raise SpecError(f"--model-path: expected a local pipeline folder (with model_index.json), got {str(folder)!r}.")
    try:
        index = json.loads((folder / "model_index.json").read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise SpecError(f"--model-path {str(folder)!r}: expected a diffusers pipeline folder with a readable "
                        f"model_index.json ({exc}).") from None
    if not isinstance(index, dict):
        raise SpecError(f"--model-path {str(folder)!r}: expected a model_index.json holding one JSON object "
                        f"(component name -> [library, class]), got a {type(index).__name__}. Pass a folder "
                        "`save_pretrained` wrote.")
    check_components(index, folder)
    return index


def check_components(index: dict[str, Any], folder: Path) -> None:
    """Refuse a folder whose components diffusers could load only by running code the folder names or ships.

    A component is `[library, class]`. diffusers imports `library` to find the class, and loads a component folder's
    `<library>.py` as custom code: so the library must be one diffusers loads components from (`diffusers`,
    `transformers`, ... or one of diffusers' pipeline modules) and no component folder may hold such a file. A model
    folder is data: hookkit runs no code it names, whatever the installed diffusers would do with it.
    """
    from diffusers import pipelines

    try:
        from diffusers.pipelines.pipeline_loading_utils import LOADABLE_CLASSES
    except ImportError:  # pragma: no cover - a diffusers that moved the table: the libraries 0.42 loads from
        LOADABLE_CLASSES = {"diffusers": {}, "transformers": {}, "onnxruntime.training": {}}

    for key, value in index.items():
        if key.startswith("_") or not (isinstance(value, list) and len(value) == 2
                                       and all(isinstance(v, str) for v in value)):
            continue  # "_class_name", "_diffusers_version", a component saved as [null, null], a config value
        library = value[0]
        where = f"--model-path {str(folder)!r}: model_index.json's {key!r} is {value!r}"
        if (folder / key / f"{library}.py").is_file():
            raise SpecError(
                f"{where}; expected a class of an installed library, got custom code the folder ships "
                f"({key}/{library}.py): loading it would run that file; nothing was loaded. If you trust it, load the "
                "pipeline in Python (DiffusionPipeline.from_pretrained(folder, trust_remote_code=True)) and pass it "
                "to hookkit.enable.")
        if library not in LOADABLE_CLASSES and not _is_pipeline_module(pipelines, library):
            raise SpecError(
                f"{where}; expected a class of a library diffusers loads components from "
                f"({', '.join(LOADABLE_CLASSES)}), got library {library!r}: loading it would import {library!r} and "
                "run its code; nothing was imported. If you trust that module, import it and load the pipeline in "
                "Python, then pass it to hookkit.enable.")


def _is_pipeline_module(pipelines: Any, name: str) -> bool:
    """Whether `name` is one of diffusers' pipeline modules (`["stable_diffusion", "StableDiffusionSafetyChecker"]`):
    looked up on diffusers' own lazy `pipelines` package, which imports nothing outside diffusers."""
    if not name.isidentifier() or name.startswith("_"):
        return False
    try:
        return hasattr(pipelines, name)
    except Exception:  # noqa: BLE001 - diffusers' lazy module failing to load its own submodule
        return False


def _component(index: dict[str, Any], key: str) -> str | None:
    """The class name of component `key` (`["diffusers", "FluxTransformer2DModel"]`), None when saved as null."""
    value = index.get(key)
    if isinstance(value, list) and len(value) == 2 and value[1] is not None:
        return str(value[1])
    return None


def model_of(index: dict[str, Any], folder: Path) -> str:
    """The shipped adapter whose transformer class is exactly the folder's (MODEL read from the folder)."""
    cls = _component(index, "transformer")
    if cls is None:
        raise UnsupportedError(f"--model-path {str(folder)!r}: model_index.json names no transformer "
                               f"({index.get('_class_name', '?')}); hookkit optimizes diffusion transformers.")
    for name, adapter in sorted(hookkit.list_adapters().items()):
        if cls in adapter.transformer:
            return name
    raise UnsupportedError(f"--model-path {str(folder)!r}: transformer {cls} has no shipped adapter "
                           f"(adapters: {sorted(hookkit.list_adapters())}). Register one (hookkit.register_adapter).")


def check_family(index: dict[str, Any], folder: Path, model: str) -> None:
    """MODEL's adapter must name the folder's transformer class exactly."""
    cls = _component(index, "transformer")
    adapter = hookkit.get_adapter(model)
    if cls not in adapter.transformer:
        guess = model_of(index, folder) if cls is not None else None
        raise SpecError(f"MODEL {model!r}: its adapter is for {list(adapter.transformer)}, but {str(folder)!r} holds "
                        f"{index.get('_class_name', '?')} with {cls}. "
                        + (f"Pass MODEL {guess!r} (or the folder alone)." if guess else "Pass the matching MODEL."))


def has_text_encoders(index: dict[str, Any]) -> bool:
    """Whether the folder has every text encoder its pipeline names (none saved as null)."""
    keys = [k for k in TEXT_ENCODERS if k in index]
    return bool(keys) and all(_component(index, k) is not None for k in keys)


def weight_bytes(folder: Path, dtype: torch.dtype) -> dict[str, int]:
    """Bytes each component's weights take in `dtype` (float tensors cast, others as stored), from the
    safetensors headers only."""
    size = torch.empty((), dtype=dtype).element_size()
    out: dict[str, int] = {}
    for path in sorted(folder.glob("*/*.safetensors")):
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        total = 0
        for name, info in header.items():
            if name == "__metadata__":
                continue
            numel = 1
            for d in info["shape"]:
                numel *= d
            total += numel * (size if info["dtype"] in _FLOATS else _ELEMENT_BYTES.get(info["dtype"], 4))
        out[path.parent.name] = out.get(path.parent.name, 0) + total
    return out


def check_fits(folder: Path, dtype: torch.dtype, device: torch.device, available: int, offload: str | None) -> None:
    """Refuse a pipeline whose weights cannot fit `device` (`available` bytes) before loading them.

    Without offload every component goes to the device; `model` offload moves one component at a time (the
    largest must fit); `sequential` streams layer by layer (no check).
    """
    sizes = weight_bytes(folder, dtype)
    if not sizes or offload == "sequential":
        return
    need = max(sizes.values()) if offload == "model" else sum(sizes.values())
    if need > available:
        what = f"its largest component ({max(sizes, key=sizes.get)})" if offload == "model" else "its weights"
        dtype_name = str(dtype).removeprefix("torch.")
        fix = ("Use --cpu-offload sequential, a smaller --dtype, or a larger device." if offload == "model" else
               "Add --cpu-offload model (one component on the GPU at a time) or sequential, or use a larger device.")
        raise UnsupportedError(f"--model-path {str(folder)!r}: {what} need {need / 1e9:.1f} GB in {dtype_name}, "
                               f"{device} has {available / 1e9:.1f} GB available. {fix}")


def check_folder(folder: Path, flag: str, value: str) -> None:
    """Refuse a folder that cannot be created or written, before anything is loaded: found after the run, it
    loses the run's output in a traceback. The nearest existing ancestor must be a writable folder; the folder is
    created now and a probe file written and removed in it.

    Args:
        folder: the folder an output goes into (created later, by whoever writes the output).
        flag: the flag or variable that named it, for the message.
        value: what the user gave (the file's path when `folder` is its parent).
    """
    existing = Path(os.path.abspath(folder))
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        blocked = "" if existing == Path(os.path.abspath(folder)) else f", so the folder {folder} cannot be created"
        raise SpecError(f"{flag} {value}: expected a path under a folder, but {existing} is a file{blocked}. "
                        "Pass a path under a folder.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise SpecError(f"{flag} {value}: expected a path whose folders can be written, but {existing} is not "
                        "writable for this user. Pass a path under a writable folder.")
    # permission bits do not tell everything (root passes os.access everywhere; /proc, read-only mounts and full
    # disks refuse anyway): make the folder now and write a probe file in it
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".hookkit-probe-"):
            pass
    except OSError as exc:
        raise SpecError(f"{flag} {value}: expected a path whose folder can be created and written, but writing in "
                        f"{folder} failed ({type(exc).__name__}: {exc.strerror or exc}). Pass a path under a "
                        "writable folder.") from None


def check_output_file(out: Path, flag: str) -> None:
    """Refuse an output file path that cannot be written (a folder, or under a file or an unwritable folder)."""
    if out.is_dir():
        raise SpecError(f"{flag} {out}: expected a file name, got an existing folder. Pass a file in it, e.g. "
                        f"{out / 'image.png'}.")
    check_folder(out.parent, flag, str(out))


@attrs.frozen(kw_only=True)
class Lora:
    """One `--lora PATH[:SCALE]`.

    Args:
        path: a LoRA file or folder diffusers' `load_lora_weights` reads.
        scale: its weight in `set_adapters` (default 1.0).
    """

    path: str
    scale: float = 1.0

    @staticmethod
    def parse(text: str) -> Lora:
        """`PATH` or `PATH:SCALE`. A tail after the last colon that is no number belongs to the path (`d/b:c`),
        unless the part before it exists and the whole does not: then it was meant as the scale, and is refused
        as one rather than reported as a missing file."""
        path, sep, tail = text.rpartition(":")
        if sep and path:
            try:
                scale = float(tail)
            except ValueError:
                scale = None
            if scale is not None and math.isfinite(scale):
                return Lora(path=path, scale=scale)
            if Path(path).exists() and not Path(text).exists():
                raise SpecError(f"--lora {text}: expected PATH or PATH:SCALE with SCALE a finite number, got scale "
                                f"{tail!r}. Pass e.g. --lora {path}:0.8, or --lora {path} for scale 1.0.")
        return Lora(path=text)


def load_image(path: str) -> Any:
    """`--image PATH` as an RGB PIL image, read now (before any model is built): a missing file or one that is no
    image fails in a second, not after the load."""
    from PIL import Image, UnidentifiedImageError

    file = Path(path)
    if not file.is_file():
        what = "a folder" if file.is_dir() else "no such file"
        raise SpecError(f"--image {path}: expected an image file (.png, .jpg, .webp, ...), got {what}. "
                        "Pass the path of an existing image.")
    try:
        with Image.open(file) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SpecError(f"--image {path}: expected an image PIL can read, got a file it cannot ({first}). "
                        "Pass a .png, .jpg or .webp image.") from None


def takes_image(pipeline_class: type) -> bool:
    """Whether a pipeline's `__call__` takes an input image (`image=`: edit, img2img, inpainting pipelines)."""
    return "image" in inspect.signature(pipeline_class.__call__).parameters


def _diffusers_class(name: str | None) -> type | None:
    import diffusers

    found = getattr(diffusers, name or "", None) if name else None
    return found if isinstance(found, type) else None


def check_image_input(index: dict[str, Any] | None, folder: Path | None) -> None:
    """`--image` needs a pipeline that takes one: refused for the tiny and --full models (text-to-image and
    text-to-video pipelines) and for a folder whose pipeline class takes no `image`, before the load."""
    if index is None:
        raise UnsupportedError(
            "--image: the tiny and --full models hookkit builds are text-to-image and text-to-video pipelines, which "
            "take no input image. Pass --model-path to a local edit or img2img pipeline folder (e.g. "
            "FluxKontextPipeline, FluxImg2ImgPipeline, QwenImageEditPipeline), or drop --image.")
    cls = _diffusers_class(index.get("_class_name"))
    if cls is not None and not takes_image(cls):
        raise UnsupportedError(
            f"--image: {cls.__name__} (the pipeline in {str(folder)!r}) takes no input image; only edit and img2img "
            "pipelines (those whose __call__ takes `image`) do. Drop --image, or pass such a pipeline's folder.")


#: `--vae-tiling` / `--vae-slicing`: the VAE method each calls, and the attribute a VAE that implements it has
VAE_OPTIONS: dict[str, tuple[str, str]] = {"--vae-tiling": ("enable_tiling", "use_tiling"),
                                           "--vae-slicing": ("enable_slicing", "use_slicing")}


def check_vae_options(flags: Sequence[str], full: bool, index: dict[str, Any] | None, folder: Path | None) -> None:
    """Before the load: VAE flags mean nothing with --full (no decoding), nor for a folder whose VAE class lacks
    the method."""
    for flag in flags:
        if full:
            raise SpecError(f"{flag}: --full skips decoding (the output is latents), so the VAE never runs. "
                            f"Drop {flag}, or drop --full.")
        if index is not None:
            cls = _diffusers_class(_component(index, "vae"))
            if cls is not None and not hasattr(cls, VAE_OPTIONS[flag][0]):
                raise UnsupportedError(f"{flag}: the VAE of {str(folder)!r} ({cls.__name__}) has no "
                                       f"{VAE_OPTIONS[flag][0]}(). Drop {flag}.")


def enable_vae_options(pipe: Any, flags: Sequence[str]) -> None:
    """Call `pipe.vae.enable_tiling()` / `enable_slicing()` for the flags given; a VAE that does not implement
    one (no such method, or diffusers' NotImplementedError: no `use_tiling` attribute) is refused, naming it."""
    vae = getattr(pipe, "vae", None)
    for flag in flags:
        method, attribute = VAE_OPTIONS[flag]
        what = f"{type(pipe).__name__}'s VAE ({type(vae).__name__})" if vae is not None else \
            f"{type(pipe).__name__} (no VAE)"
        if vae is None or not callable(getattr(vae, method, None)) or not hasattr(vae, attribute):
            raise UnsupportedError(f"{flag}: {what} does not implement {method}(). Drop {flag}.")
        try:
            getattr(vae, method)()
        except NotImplementedError:
            raise UnsupportedError(f"{flag}: {what} does not implement {method}(). Drop {flag}.") from None


@attrs.frozen(kw_only=True)
class CallOptions:
    """What `generate` adds to the pipeline call and load, beyond `bench.ModelOptions`.

    Args:
        guidance_scale: the pipeline's `guidance_scale` (Flux-dev: distilled guidance), None for its default.
        negative_prompt: a negative prompt; with it, true CFG at `true_cfg_scale` (two transformer calls per step).
        true_cfg_scale: the true-CFG scale used with `negative_prompt`.
        num_images: images per prompt (`num_images_per_prompt`).
        loras: LoRAs loaded (in order) before hookkit is enabled.
        cpu_offload: "model" or "sequential" (accelerate's offload; CUDA only), None for none.
        image: the input image of an edit or img2img pipeline (`--image`, a PIL image), passed as `image=`.
        vae_flags: `--vae-tiling` and/or `--vae-slicing`: `pipe.vae.enable_tiling()` / `enable_slicing()` before
            the call (decoding large images or videos in less memory).
    """

    guidance_scale: float | None = None
    negative_prompt: str | None = None
    true_cfg_scale: float = 4.0
    num_images: int = 1
    loras: tuple[Lora, ...] = ()
    cpu_offload: str | None = None
    image: Any = None
    vae_flags: tuple[str, ...] = ()

    def call_kwargs(self, pipe: Any, batch: int = 1) -> dict[str, Any]:
        """The extra keyword arguments for `pipe(...)` of `batch` prompts; a flag the pipeline does not take is
        refused."""
        import inspect

        accepted = set(inspect.signature(type(pipe).__call__).parameters)
        kw: dict[str, Any] = {}
        if self.guidance_scale is not None:
            kw["guidance_scale"] = self.guidance_scale
        if self.negative_prompt is not None:
            kw["negative_prompt"] = [self.negative_prompt] * batch
            if "true_cfg_scale" in accepted:
                kw["true_cfg_scale"] = self.true_cfg_scale
        if self.num_images != 1:
            kw["num_images_per_prompt"] = self.num_images
        if self.image is not None:
            kw["image"] = self.image
        flags = {"guidance_scale": "--guidance-scale", "negative_prompt": "--negative-prompt",
                 "num_images_per_prompt": "--num-images", "image": "--image"}
        for key in kw:
            if key in flags and key not in accepted:
                raise UnsupportedError(f"{flags[key]}: {type(pipe).__name__} takes no {key}. Drop {flags[key]}.")
        return kw

    def prepare(self, pipe: Any) -> None:
        """Turn on the VAE options, load the LoRAs and turn on offload (before hookkit.enable: LoRAs and offload
        replace or wrap modules)."""
        enable_vae_options(pipe, self.vae_flags)
        if self.loras:
            names = []
            for i, lora in enumerate(self.loras):
                name = f"lora_{i}"
                try:
                    pipe.load_lora_weights(lora.path, adapter_name=name)
                except (OSError, ValueError, KeyError) as exc:
                    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                    raise SpecError(f"--lora {lora.path}: diffusers could not load it into {type(pipe).__name__}: "
                                    f"{first}") from None
                names.append(name)
            pipe.set_adapters(names, adapter_weights=[lora.scale for lora in self.loras])
        if self.cpu_offload == "model":
            pipe.enable_model_cpu_offload()
        elif self.cpu_offload == "sequential":
            pipe.enable_sequential_cpu_offload()


def check_call_options(options: CallOptions, device: torch.device, cuda_graphs: bool) -> None:
    """What the call options need that this machine or the other flags lack, before anything is loaded."""
    if options.num_images < 1:
        raise SpecError(f"--num-images: expected an int >= 1, got {options.num_images}.")
    for lora in options.loras:
        if not Path(lora.path).exists():
            head, sep, tail = lora.path.rpartition(":")
            scale = f", and {tail!r} after its last ':' is no scale (not a number)" if sep and head else ""
            raise SpecError(f"--lora {lora.path}: no such file or folder{scale}. Give a local LoRA (.safetensors or a "
                            "folder), optionally with :SCALE.")
    if options.cpu_offload is not None:
        if device.type != "cuda":
            raise UnsupportedError(f"--cpu-offload {options.cpu_offload}: offloads to the CPU from a CUDA device, and "
                                   f"this run is on {device}. Drop --cpu-offload.")
        if cuda_graphs:
            raise SpecError(f"--cpu-offload {options.cpu_offload} with --cuda-graphs: a CUDA graph replays fixed "
                            "device addresses, and offload moves the weights every call. Drop one of them.")
        try:
            import accelerate  # noqa: F401
        except ImportError:
            raise UnsupportedError(f"--cpu-offload {options.cpu_offload}: needs accelerate. "
                                   "pip install accelerate.") from None


def size_multiple(pipe: Any) -> int | None:
    """The multiple of which the pipeline's height and width must be, or None when unknown.

    Flux and Qwen-Image pack 2x2 latent patches, SD3 and Wan patchify by the transformer's patch size; a
    size that is no multiple is silently rounded down by the pipeline (30 becomes 28 on the tiny Flux).
    """
    vae = getattr(pipe, "vae_scale_factor", None) or getattr(pipe, "vae_scale_factor_spatial", None)
    if not isinstance(vae, int):
        return None
    name = type(pipe).__name__
    patch = getattr(getattr(pipe.transformer, "config", None), "patch_size", 1)
    if isinstance(patch, (tuple, list)):
        patch = patch[-1]
    if name.startswith(("Flux", "QwenImage")):
        return vae * 2
    return vae * int(patch or 1)


def latent_tokens(pipe: Any, height: int, width: int, frames: int = 1) -> int | None:
    """Tokens a sample's latents make at `height` x `width` (and `frames` for a video pipeline): what each
    attention call of the transformer runs over, text aside. None when the pipeline's geometry is unknown.

    Spatially one token per `size_multiple` pixels a side; in time the VAE keeps `(frames - 1) // t + 1` latent
    frames (Wan, CogVideoX) and the transformer patches `patch_size_t` of them (Wan's `patch_size[0]`).
    """
    multiple = size_multiple(pipe)
    if multiple is None:
        return None
    tokens = (height // multiple) * (width // multiple)
    temporal = getattr(pipe, "vae_scale_factor_temporal", None)
    if isinstance(temporal, int) and frames > 1:
        config = pipe.transformer.config
        patch = config.get("patch_size", 1)
        patch_t = config.get("patch_size_t") or (patch[0] if isinstance(patch, (tuple, list)) else 1)
        tokens *= -(-((frames - 1) // temporal + 1) // patch_t)
    return tokens


def skeleton_pipeline(folder: Path) -> Any | None:
    """The folder's pipeline with its transformer and VAE built from their config.json on the meta device and
    every other component None: its geometry (scale factors, patch sizes, default size) without reading a weight.
    None when the folder's layout does not allow it (no diffusers class of that name, a component without a
    config.json, a pipeline whose constructor needs more): its size is then checked after the load."""
    import diffusers

    index = read_index(folder)
    try:
        cls = getattr(diffusers, index["_class_name"])
        parts = {}
        for key in ("transformer", "vae"):
            name = _component(index, key)
            config = json.loads((folder / key / "config.json").read_text())
            with meta_device():
                parts[key] = getattr(diffusers, name or "").from_config(config)
        required = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        others = {p.name: None for p in inspect.signature(cls.__init__).parameters.values()
                  if p.name not in ("self", *parts) and p.kind in required and p.default is inspect.Parameter.empty}
        return cls(**others, **parts)
    except (AttributeError, KeyError, OSError, TypeError, ValueError):
        return None


def check_size(pipe: Any, height: int | None, width: int | None) -> None:
    """Refuse a height or width the pipeline would silently change."""
    multiple = size_multiple(pipe)
    if multiple is None:
        return
    for flag, value in (("--height", height), ("--width", width)):
        if value is not None and value % multiple:
            down, up = value - value % multiple, value - value % multiple + multiple
            raise SpecError(f"{flag} {value}: {type(pipe).__name__} makes images in multiples of {multiple} and "
                            f"would silently make it {down or multiple}. Pass {flag} {down or up} or {up}.")


def slug(text: str, limit: int = 40) -> str:
    """A file-name-safe short form of a prompt: lower case, words joined by '-'."""
    words = "".join(c.lower() if c.isalnum() else " " for c in text).split()
    out = "-".join(words)[:limit].rstrip("-")
    return out or "prompt"


def loras_text(loras: Sequence[Lora]) -> str:
    return ", ".join(f"{Path(lo.path).name}:{lo.scale:g}" for lo in loras)
