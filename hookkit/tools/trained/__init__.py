"""Small *trained* Flux- and Wan-architecture models, so that caching is judged on real denoising trajectories.

Random weights never trigger dynamic caching: their block residuals change from step to step as a trained
model's do not. No trained weights can be downloaded here, so hookkit trains and ships its own:

- stock `diffusers.FluxTransformer2DModel`s trained with rectified flow matching on procedural 32x32 images of
  ten classes (`CLASSES`: a shape in a colour; `shapes`). `MODELS`: "tiny" (2 double + 4 single blocks, 192
  hidden; the default) and "deep" (4 + 12 blocks, 128 hidden; in `deep/`), so that the first block is at most
  1/16 of a step; "video" (`video.py`, in `video/`): a stock `WanTransformer3DModel` in a `WanPipeline`, 9 frames;
- a class is a fixed random `prompt_embeds` (1, 4, 64) (Flux also a `pooled_prompt_embeds` (1, 64)) stored with
  the weights, the pipelines run with `text_encoder=None`; one extra "null" class (index `NUM_CLASSES`) for CFG;
- `PatchVAE` is pixel (un)shuffle by 2 (a 32x32 RGB image is a 12x16x16 latent; a token is a 4x4 pixel patch);
- a small CNN (`ShapeClassifier`) says whether a generated image (each frame of a clip) shows the class asked for.

    pipe = trained.load_pipeline()                 # CPU, float32, the tiny model; model="deep" or "video"
    images = pipe(**trained.call_kwargs(["red circle", 3], seeds=[0, 1])).images   # (2, 3, 32, 32) in [0, 1]

Weights: `benchmarks/train_tiny_flux.py`, `train_tiny_wan.py`; each `MODEL_CARD.md` says how, on what, how well.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn

from hookkit.core.quiet import quiet_imports

with quiet_imports():
    from diffusers import ConfigMixin, ModelMixin
    from diffusers.configuration_utils import register_to_config

from hookkit.errors import SpecError, UnsupportedError
from hookkit.tools.meta import meta_device
from hookkit.tools.trained.shapes import CLASSES
from hookkit.tools.trained.video import FRAMES, VIDEO_TRANSFORMER_CONFIG, PatchVAE3D, build_video_pipeline

__all__ = [
    "ARCHITECTURES",
    "CLASSES",
    "CLASSIFIER_FILE",
    "DEEP_TRANSFORMER_CONFIG",
    "FRAMES",
    "IMAGE_SIZE",
    "MODELS",
    "MODEL_FILE",
    "NULL_CLASS",
    "NUM_CLASSES",
    "SCHEDULER_CONFIG",
    "TEXT_TOKENS",
    "TRANSFORMER_CONFIG",
    "VIDEO_MODELS",
    "VIDEO_TRANSFORMER_CONFIG",
    "ClassConditions",
    "PatchVAE",
    "PatchVAE3D",
    "ShapeClassifier",
    "build_pipeline",
    "call_kwargs",
    "class_index",
    "load_classifier",
    "load_conditions",
    "load_pipeline",
    "load_transformer",
    "make_conditions",
    "make_scheduler",
    "is_video",
    "missing_weights",
    "model_file",
    "output_images",
    "predict",
    "read_metadata",
    "save_classifier",
    "save_model",
]

HERE = Path(__file__).resolve().parent
MODEL_FILE = HERE / "model.safetensors"
CLASSIFIER_FILE = HERE / "classifier.safetensors"
FORMAT = "hookkit-trained-v1"

NUM_CLASSES = len(CLASSES)
#: index of the unconditional ("null") embedding, for true CFG (`negative_prompt_embeds`)
NULL_CLASS = NUM_CLASSES
IMAGE_SIZE = 32
TEXT_TOKENS = 4
#: the latent is the image pixel-unshuffled by this factor (FluxPipeline's `vae_scale_factor`)
PATCH = 2
LATENT_CHANNELS = 3 * PATCH * PATCH

#: The transformer; `in_channels` = 4 x latent channels because FluxPipeline packs 2x2 latent patches.
TRANSFORMER_CONFIG: dict[str, Any] = dict(
    patch_size=1, in_channels=4 * LATENT_CHANNELS, num_layers=2, num_single_layers=4, attention_head_dim=32,
    num_attention_heads=6, joint_attention_dim=64, pooled_projection_dim=64, guidance_embeds=False,
    axes_dims_rope=(8, 12, 12),
)

#: The deep model: 4 double + 12 single blocks (16, so one block is at most 1/16 of a step), 4 heads x 32 =
#: 128 hidden (narrower, to train in minutes and ship in about as many MB as the tiny one). Same inputs,
#: conditioning and RoPE axes as `TRANSFORMER_CONFIG`.
DEEP_TRANSFORMER_CONFIG: dict[str, Any] = dict(TRANSFORMER_CONFIG, num_layers=4, num_single_layers=12,
                                               num_attention_heads=4)

#: The shipped models: name -> (transformer config, weights file). All share the classes, the conditioning
#: (`make_conditions(0)`) and the classifier; the image models also the latents and the scheduler. "video" is a
#: `WanTransformer3DModel` in a `WanPipeline` making clips of `FRAMES` frames (`hookkit.tools.trained.video`).
MODELS: dict[str, tuple[dict[str, Any], Path]] = {
    "tiny": (TRANSFORMER_CONFIG, MODEL_FILE),
    "deep": (DEEP_TRANSFORMER_CONFIG, HERE / "deep" / "model.safetensors"),
    "video": (VIDEO_TRANSFORMER_CONFIG, HERE / "video" / "model.safetensors"),
}
#: the models whose pipeline returns clips (B, FRAMES, 3, 32, 32) in `.frames`
VIDEO_MODELS: frozenset[str] = frozenset({"video"})
#: the transformer classes a weights file may name (metadata "architecture"): matched exactly, never imported by name
ARCHITECTURES: tuple[str, ...] = ("FluxTransformer2DModel", "WanTransformer3DModel")

#: Flux-dev's scheduler: resolution-dependent time shift (at 64 image tokens, sigmas shift by exp(0.47) = 1.6).
SCHEDULER_CONFIG: dict[str, Any] = dict(
    shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
    max_image_seq_len=4096,
)

#: Latent normalisation (as Flux's VAE has): model latents = (raw - SHIFT) * SCALE. Measured on the
#: procedural images in [-1, 1]: mean -0.57, std 0.32, so that model latents have about unit variance.
SHIFT_FACTOR = -0.57
SCALING_FACTOR = 3.0


# --- the autoencoder stand-in ---------------------------------------------------------------------------------

class PatchVAE(ModelMixin, ConfigMixin):
    """A deterministic, weightless "VAE": a latent is the image pixel-unshuffled by `patch`.

    It implements exactly what `FluxPipeline` uses of an autoencoder: `config.block_out_channels` (only its
    length: `vae_scale_factor = 2 ** (len - 1)` must equal `patch`), `config.scaling_factor`,
    `config.shift_factor`, and `decode(latents, return_dict=False)[0]`, which the pipeline calls with
    `latents / scaling_factor + shift_factor`. `encode` is the inverse of `decode` and returns raw latents;
    the training script normalises them as `(raw - shift_factor) * scaling_factor`.
    """

    @register_to_config
    def __init__(self, in_channels: int = 3, patch: int = PATCH, scaling_factor: float = SCALING_FACTOR,
                 shift_factor: float = SHIFT_FACTOR, block_out_channels: tuple[int, ...] = (3, 12)) -> None:
        super().__init__()
        if 2 ** (len(block_out_channels) - 1) != patch:
            raise SpecError(
                f"PatchVAE.block_out_channels: expected {int.bit_length(patch)} entries so that FluxPipeline's "
                f"vae_scale_factor 2 ** (len - 1) equals patch={patch}, got {block_out_channels!r}."
            )
        # No weights; a buffer gives the module a device and dtype for `pipe.to(...)` and the pipeline.
        self.register_buffer("anchor", torch.zeros(()), persistent=False)

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """Images (B, 3, H, W) in [-1, 1] -> raw latents (B, 3 * patch**2, H / patch, W / patch)."""
        return nn.functional.pixel_unshuffle(images, self.config.patch)

    def decode(self, latents: torch.Tensor, return_dict: bool = True) -> Any:
        """Raw latents -> images in [-1, 1] (as the pipeline's image processor expects)."""
        images = nn.functional.pixel_shuffle(latents, self.config.patch)
        if return_dict:
            from diffusers.models.autoencoders.vae import DecoderOutput

            return DecoderOutput(sample=images)
        return (images,)


# --- the classifier -----------------------------------------------------------------------------------------


class ShapeClassifier(nn.Module):
    """A small CNN: images (B, 3, 32, 32) in [0, 1] -> logits (B, NUM_CLASSES).

    Pooling over the whole image (mean and max) makes it indifferent to where the shape is.
    """

    def __init__(self, num_classes: int = NUM_CLASSES, width: int = 32) -> None:
        super().__init__()
        w = width

        def conv(cin: int, cout: int) -> list[nn.Module]:
            return [nn.Conv2d(cin, cout, 3, padding=1), nn.GELU()]

        self.features = nn.Sequential(
            *conv(3, w), *conv(w, w), nn.MaxPool2d(2),
            *conv(w, 2 * w), *conv(2 * w, 2 * w), nn.MaxPool2d(2),
            *conv(2 * w, 4 * w),
        )
        self.head = nn.Linear(8 * w, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        f = self.features(images * 2 - 1)
        return self.head(torch.cat([f.mean(dim=(2, 3)), f.amax(dim=(2, 3))], dim=1))


# --- class conditions ---------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True, eq=False)
class ClassConditions:
    """The fixed embedding of every class, row `NULL_CLASS` being the unconditional one."""

    prompt_embeds: torch.Tensor  # (NUM_CLASSES + 1, TEXT_TOKENS, joint_attention_dim)
    pooled_prompt_embeds: torch.Tensor  # (NUM_CLASSES + 1, pooled_projection_dim)

    def select(self, labels: Sequence[int], device: torch.device | str | None = None,
               dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompt_embeds, pooled_prompt_embeds) of `labels`, batched in that order."""
        index = torch.as_tensor(list(labels), dtype=torch.long)
        return (self.prompt_embeds[index].to(device=device, dtype=dtype),
                self.pooled_prompt_embeds[index].to(device=device, dtype=dtype))


def make_conditions(seed: int = 0) -> ClassConditions:
    """Fresh random class embeddings (unit normal, seeded). Training draws them once and stores them in
    the weights file, so that loading never depends on a random number generator."""
    g = torch.Generator().manual_seed(seed)
    cfg = TRANSFORMER_CONFIG
    return ClassConditions(
        prompt_embeds=torch.randn(NUM_CLASSES + 1, TEXT_TOKENS, cfg["joint_attention_dim"], generator=g),
        pooled_prompt_embeds=torch.randn(NUM_CLASSES + 1, cfg["pooled_projection_dim"], generator=g),
    )


def class_index(cls: int | str) -> int:
    """The label of a class given by index or by name ("red circle")."""
    if isinstance(cls, str):
        if cls not in CLASSES:
            raise SpecError(f"hookkit.tools.trained class: expected one of {list(CLASSES)} or an index, got {cls!r}.")
        return CLASSES.index(cls)
    if isinstance(cls, bool) or not isinstance(cls, int) or not 0 <= cls < NUM_CLASSES:
        raise SpecError(f"hookkit.tools.trained class: expected an index in [0, {NUM_CLASSES}) or a name, got {cls!r}.")
    return cls


# --- files --------------------------------------------------------------------------------------------------

_TRAIN_HINT = ("Train them with `python benchmarks/train_tiny_flux.py --device cuda --out DIR` (about 5 minutes on "
               "one H200) and copy DIR/model.safetensors and DIR/classifier.safetensors into hookkit/tools/trained/"
               " (the deep model: add `--model deep --classifier hookkit/tools/trained/classifier.safetensors` and "
               "copy DIR/* into hookkit/tools/trained/deep/).")
_TRAIN_VIDEO_HINT = ("Train it with `python benchmarks/train_tiny_wan.py --fit-steps --out DIR` (about 40 minutes on a "
                     "2-core CPU) and copy DIR/* into hookkit/tools/trained/video/.")


def _train_hint(path: Path) -> str:
    """How to make the missing weights file `path`: the video model's script for its file, else the image models'."""
    return _TRAIN_VIDEO_HINT if path == MODELS["video"][1] else _TRAIN_HINT


def is_video(model: str) -> bool:
    """Whether `model`'s pipeline makes clips (a `WanPipeline`) rather than images (a `FluxPipeline`)."""
    model_file(model)  # refuses an unknown name
    return model in VIDEO_MODELS


def model_file(model: str = "tiny") -> Path:
    """The shipped weights file of `model` ("tiny", "deep" or "video"; see `MODELS`), whether or not it exists yet."""
    if model not in MODELS:
        raise SpecError(f"hookkit.tools.trained model: expected one of {list(MODELS)}, got {model!r}.")
    return MODELS[model][1]


def missing_weights(model: str = "tiny") -> str | None:
    """None when `model`'s shipped weights and the classifier exist, else a sentence saying which file is
    missing and how to make it."""
    missing = [str(p.relative_to(HERE)) for p in (model_file(model), CLASSIFIER_FILE) if not p.is_file()]
    if not missing:
        return None
    return f"hookkit.tools.trained: {' and '.join(missing)} not found in {HERE}. {_train_hint(model_file(model))}"


def _weights_path(path: str | Path | None, default: Path) -> Path:
    p = Path(path) if path is not None else default
    if not p.is_file():
        where = "" if path is None else f" (path={str(path)!r})"
        raise UnsupportedError(f"hookkit.tools.trained: weights file {p} not found{where}. {_train_hint(p)}")
    return p


def read_metadata(path: str | Path | None = None, model: str = "tiny") -> dict[str, Any]:
    """The JSON metadata stored in a weights file (config, classes, training settings and results): `path`,
    else the shipped file of `model`."""
    from safetensors import safe_open

    p = _weights_path(path, model_file(model))
    with safe_open(str(p), framework="pt") as f:
        raw = f.metadata() or {}
    if raw.get("format") != FORMAT:
        raise UnsupportedError(f"hookkit.tools.trained: {p} is not a {FORMAT} file (metadata format={raw.get('format')!r}). "
                               f"Re-train with benchmarks/train_tiny_flux.py.")
    return {k: json.loads(v) if k != "format" else v for k, v in raw.items()}


@functools.lru_cache(maxsize=4)
def _load_file(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path)


def load_conditions(path: str | Path | None = None, model: str = "tiny") -> ClassConditions:
    """The class embeddings stored with the transformer weights (`path`, else the shipped file of `model`)."""
    tensors = _load_file(str(_weights_path(path, model_file(model))))
    return ClassConditions(prompt_embeds=tensors["conditions.prompt_embeds"].float(),
                           pooled_prompt_embeds=tensors["conditions.pooled_prompt_embeds"].float())


@quiet_imports()
def make_scheduler() -> Any:
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG)


@quiet_imports()
def build_pipeline(transformer: nn.Module) -> Any:
    """A stock `FluxPipeline` around `transformer` with `PatchVAE`, the Flux-dev scheduler and no text encoders
    (a `WanTransformer3DModel`: the video model's `WanPipeline`, `video.build_video_pipeline`).

    Its default size is the training size (32x32): `default_sample_size * vae_scale_factor` = 16 * 2.
    """
    from diffusers import FluxPipeline, WanTransformer3DModel

    if isinstance(transformer, WanTransformer3DModel):
        return build_video_pipeline(transformer)

    pipe = FluxPipeline(scheduler=make_scheduler(), vae=PatchVAE(), text_encoder=None, tokenizer=None,
                        text_encoder_2=None, tokenizer_2=None, transformer=transformer)
    pipe.default_sample_size = IMAGE_SIZE // PATCH
    pipe.set_progress_bar_config(disable=True)
    return pipe


def save_model(path: str | Path, transformer: nn.Module | dict[str, torch.Tensor], conditions: ClassConditions,
               meta: dict[str, Any] | None = None) -> Path:
    """Write a weights file `load_pipeline(path=...)` reads: the transformer's weights as float16, the class
    conditions as float32, and JSON metadata (`config` = `TRANSFORMER_CONFIG` and `architecture` = the module's class,
    or Flux for a state dict, unless `meta` says otherwise)."""
    from safetensors.torch import save_file

    state = transformer.state_dict() if isinstance(transformer, nn.Module) else transformer
    tensors = {f"transformer.{k}": v.detach().to(torch.float16).cpu().contiguous() for k, v in state.items()}
    tensors["conditions.prompt_embeds"] = conditions.prompt_embeds.float().contiguous()
    tensors["conditions.pooled_prompt_embeds"] = conditions.pooled_prompt_embeds.float().contiguous()
    info = {"config": TRANSFORMER_CONFIG, "classes": list(CLASSES),
            "architecture": transformer.__class__.__name__ if isinstance(transformer, nn.Module) else ARCHITECTURES[0],
            **(meta or {})}
    out = Path(path)
    save_file(tensors, str(out), metadata={"format": FORMAT, **{k: json.dumps(v) for k, v in info.items()}})
    _load_file.cache_clear()
    return out


def save_classifier(path: str | Path, classifier: ShapeClassifier) -> Path:
    """Write a classifier file `load_classifier(path=...)` reads."""
    from safetensors.torch import save_file

    out = Path(path)
    save_file({k: v.detach().float().cpu().contiguous() for k, v in classifier.state_dict().items()}, str(out),
              metadata={"format": FORMAT, "classes": json.dumps(list(CLASSES))})
    return out


@quiet_imports()
def load_transformer(path: str | Path | None = None, device: torch.device | str = "cpu",
                     dtype: torch.dtype = torch.float32, model: str = "tiny") -> nn.Module:
    """The trained transformer (eval mode) from its weights file: `path`, else the shipped file of `model` ("tiny",
    "deep" or "video"). The class is the file's `architecture` (one of `ARCHITECTURES`), the shape its `config`."""
    from diffusers import FluxTransformer2DModel, WanTransformer3DModel

    p = _weights_path(path, model_file(model))
    meta = read_metadata(p)
    config, architecture = meta["config"], meta.get("architecture", ARCHITECTURES[0])
    classes = {"FluxTransformer2DModel": FluxTransformer2DModel, "WanTransformer3DModel": WanTransformer3DModel}
    if architecture not in classes:
        raise UnsupportedError(f"hookkit.tools.trained: {p} names architecture {architecture!r}; expected one of "
                               f"{list(ARCHITECTURES)}. Re-train it with benchmarks/train_tiny_flux.py or train_tiny_wan.py.")
    state = {k.removeprefix("transformer."): v for k, v in _load_file(str(p)).items() if k.startswith("transformer.")}
    if architecture == "FluxTransformer2DModel":
        with meta_device():
            model = classes[architecture](**config)
    else:  # Wan's rotary tables are non-persistent buffers made at construction: build it for real (it is small)
        model = classes[architecture](**config)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True, assign=True)
    return model.to(device).eval().requires_grad_(False)


def load_pipeline(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                  path: str | Path | None = None, model: str = "tiny") -> Any:
    """A shipped model in a stock `FluxPipeline` (the video model: `WanPipeline`), no text encoders, on `device`
    in `dtype`.

    Args:
        device: where the transformer runs.
        dtype: the transformer's dtype (the weights are stored as float16).
        path: a weights file written by `save_model`; None for the shipped file of `model`.
        model: "tiny" (default; 2 double + 4 single blocks), "deep" (4 + 12 blocks) or "video" (8 Wan blocks);
            see `MODELS`.
    """
    pipe = build_pipeline(load_transformer(path, device, dtype, model))
    pipe.vae.to(device)  # weightless: no dtype to set (the decode is a reshuffle in the latents' dtype)
    return pipe


def load_classifier(device: torch.device | str = "cpu", path: str | Path | None = None) -> ShapeClassifier:
    """The shipped `ShapeClassifier` (eval mode, float32)."""
    from safetensors.torch import load_file

    model = ShapeClassifier()
    model.load_state_dict(load_file(str(_weights_path(path, CLASSIFIER_FILE))), strict=True)
    return model.to(device).eval().requires_grad_(False)


def call_kwargs(classes: Sequence[int | str], seeds: Sequence[int], steps: int = 28, cfg_scale: float = 1.0,
                output_type: str = "pt", device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                path: str | Path | None = None, model: str = "tiny") -> dict[str, Any]:
    """Keyword arguments for one `pipe(...)` call generating `classes[i]` from seed `seeds[i]`.

    Every sample has its own CPU generator, so an image depends only on its class and seed, not on the
    batch it was made in (nor on the device). `cfg_scale` > 1 turns on FluxPipeline's true CFG against the
    null class (two transformer calls per step; the video model: WanPipeline's `guidance_scale`). The class
    embeddings come from `path`, else from the shipped file of `model`; a video model makes `FRAMES` frames.
    """
    labels = [class_index(c) for c in classes]
    if len(labels) != len(seeds):
        raise SpecError(f"hookkit.tools.trained.call_kwargs.seeds: expected one seed per class ({len(labels)}), "
                        f"got {len(seeds)}.")
    conditions = load_conditions(path, model)
    embeds, pooled = conditions.select(labels, device, dtype)
    generators = [torch.Generator().manual_seed(int(s)) for s in seeds]
    if is_video(model):
        kwargs = dict(prompt_embeds=embeds, num_inference_steps=steps, height=IMAGE_SIZE, width=IMAGE_SIZE,
                      num_frames=FRAMES, guidance_scale=max(1.0, cfg_scale), generator=generators,
                      output_type=output_type)
        if cfg_scale > 1.0:
            kwargs["negative_prompt_embeds"] = conditions.select([NULL_CLASS] * len(labels), device, dtype)[0]
        return kwargs
    kwargs: dict[str, Any] = dict(
        prompt_embeds=embeds, pooled_prompt_embeds=pooled, num_inference_steps=steps, height=IMAGE_SIZE,
        width=IMAGE_SIZE, generator=generators, output_type=output_type,
    )
    if cfg_scale > 1.0:
        neg, neg_pooled = conditions.select([NULL_CLASS] * len(labels), device, dtype)
        kwargs.update(negative_prompt_embeds=neg, negative_pooled_prompt_embeds=neg_pooled, true_cfg_scale=cfg_scale)
    return kwargs


def output_images(output: Any) -> torch.Tensor:
    """What a trained pipeline's call made: images (B, 3, H, W) from a FluxPipeline's `.images`, clips
    (B, F, 3, H, W) from a WanPipeline's `.frames` (with `output_type="pt"`)."""
    frames = getattr(output, "frames", None)
    return output.images if frames is None else frames


def predict(classifier: ShapeClassifier, images: torch.Tensor) -> list[int]:
    """The class `classifier` sees in each image (B, 3, H, W), or in each clip (B, F, 3, H, W): the class most of
    its frames show (ties: the lower label)."""
    with torch.no_grad():
        if images.ndim == 4:
            return classifier(images).argmax(-1).tolist()
        if images.ndim != 5:
            raise SpecError(f"hookkit.tools.trained.predict: expected images (B, 3, H, W) or clips (B, F, 3, H, W), "
                            f"got shape {tuple(images.shape)}.")
        per_frame = classifier(images.flatten(0, 1)).argmax(-1).view(images.shape[:2])
        return per_frame.mode(dim=1).values.tolist()


#: Seeds the shipped calibrations were made on (one per class): disjoint from the quality harness's evaluation
#: seeds (100 and up) and from every default chosen on seeds 0-3.
CALIBRATION_SEEDS = tuple(range(50, 60))


def calibration_file(model: str = "tiny", steps: int = 28) -> Path:
    """The shipped `CacheCalibration` JSON of `model` at `steps` (made by `make_calibration`), existing or not."""
    return model_file(model).parent / f"calibration-{model}-{steps}.json"


def calibration(model: str = "tiny", steps: int = 28) -> Any:
    """The shipped calibration of a trained model: DBCache's "magnitude" and "schedule" rules read it.

    Shipped at 28 and 14 steps for both image models and at 28 for the video model; made from one uncached call of
    every class on `CALIBRATION_SEEDS`.
    """
    from hookkit.techniques.cache.calibration import CacheCalibration

    path = calibration_file(model, steps)
    if not path.is_file():
        raise SpecError(f"hookkit.tools.trained.calibration: expected a shipped calibration of {model!r} at {steps} "
                        f"steps ({path.name}), got none. Shipped: 28 and 14 steps; make others with "
                        "hookkit.calibrate(trained.load_pipeline(model=...), calls).")
    return CacheCalibration.load(path)


def make_calibration(model: str = "tiny", steps: int = 28) -> Any:
    """Calibrate `model` at `steps` on `CALIBRATION_SEEDS` (one call, every class, with the per-step sensitivity
    `gains`) and write it where `calibration` reads it."""
    import hookkit

    pipe = load_pipeline(model=model)
    made = hookkit.calibrate(pipe, [call_kwargs(list(range(NUM_CLASSES)), list(CALIBRATION_SEEDS), steps=steps,
                                                model=model)], sensitivity=True)
    made.save(calibration_file(model, steps))
    return made
