"""Models built from config with random weights: tiny ones for the CPU (tests, demo, examples) and
full-size architectures for GPU benchmarks. No downloads, ever.

`tiny_transformer(name)` builds a transformer; `tiny_pipeline(name)` a whole pipeline with
`text_encoder=None`, fed through `call_kwargs(name, ...)` (random prompt embeddings of the right shape).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import attrs
import torch

from hookkit.core.quiet import quiet_imports
from hookkit.errors import AdapterError, SpecError

# Transformer configs: tiny (CPU, seconds) and full (the published architectures' defaults).
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "flux": dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=3, attention_head_dim=8,
                 num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16, guidance_embeds=True,
                 axes_dims_rope=(2, 2, 4)),
    "qwenimage": dict(patch_size=2, in_channels=16, out_channels=4, num_layers=3, attention_head_dim=16,
                      num_attention_heads=2, joint_attention_dim=16, axes_dims_rope=(4, 6, 6)),
    "cogvideox": dict(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, time_embed_dim=8,
                      text_embed_dim=16, num_layers=3, sample_width=8, sample_height=8, sample_frames=9, patch_size=2,
                      temporal_compression_ratio=4, max_text_seq_length=16),
    "wan": dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
                text_dim=16, freq_dim=32, ffn_dim=32, num_layers=3, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", rope_max_seq_len=32),
    "sd3": dict(sample_size=16, patch_size=2, in_channels=4, num_layers=3, attention_head_dim=8, num_attention_heads=2,
                joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=16, out_channels=4,
                pos_embed_max_size=16),
    "hunyuanvideo": dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10, num_layers=2,
                         num_single_layers=2, num_refiner_layers=1, patch_size=1, patch_size_t=1, guidance_embeds=True,
                         text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 4, 4)),
    # diffusers' test config (tests/diffusers_configs.py), in_channels 4 + 4 + 1: latents, condition latents, mask
    "hunyuanvideo15": dict(in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=2,
                           num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1, text_embed_dim=16,
                           text_embed_2_dim=8, image_embed_dim=12, rope_axes_dim=(2, 2, 4), target_size=16,
                           task_type="t2v"),
}

#: Wan 2.1 T2V 14B's `transformer/config.json` (Wan-AI/Wan2.1-T2V-14B-Diffusers), written out rather than left to
#: diffusers' defaults (which are these values in 0.42.1): a changed default must not silently change the benchmark.
WAN_14B = dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16,
               text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
               qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None, added_kv_proj_dim=None, rope_max_seq_len=1024)
#: Wan 2.1 T2V 1.3B (Wan-AI/Wan2.1-T2V-1.3B-Diffusers): the 14B config at 12 heads, 30 layers, ffn_dim 8960.
WAN_1_3B = {**WAN_14B, "num_attention_heads": 12, "ffn_dim": 8960, "num_layers": 30}

#: HunyuanVideo 1.5 480p text-to-video (hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v): diffusers'
#: defaults in 0.42.1 except task_type (their default is "i2v"), written out for the same reason as WAN_14B.
HUNYUANVIDEO15_480P_T2V = dict(in_channels=65, out_channels=32, num_attention_heads=16, attention_head_dim=128,
                               num_layers=54, num_refiner_layers=2, mlp_ratio=4.0, patch_size=1, patch_size_t=1,
                               qk_norm="rms_norm", text_embed_dim=3584, text_embed_2_dim=1472, image_embed_dim=1152,
                               rope_theta=256.0, rope_axes_dim=(16, 56, 56), target_size=640, task_type="t2v",
                               use_meanflow=False)

FULL_CONFIGS: dict[str, dict[str, Any]] = {
    "flux": dict(guidance_embeds=True),  # Flux-dev
    "qwenimage": dict(),
    "cogvideox": dict(),  # CogVideoX-2b
    "wan": WAN_1_3B,
    "sd3": dict(num_layers=24, num_attention_heads=24, caption_projection_dim=1536, pos_embed_max_size=192),  # SD3 Medium
    "hunyuanvideo": dict(),
    "hunyuanvideo15": HUNYUANVIDEO15_480P_T2V,
}

#: the full-size layer structure at tiny widths (CPU): `full_pipeline(name, **NARROW_CONFIGS[name])` has the real
#: block counts, channels and VAE scale factor but a hidden size of 16, so a CPU test or a benchmark's `--cpu-smoke`
#: runs the code path the GPU runs (which `tiny_pipeline`'s 2 + 3 blocks and small VAE do not)
NARROW_CONFIGS: dict[str, dict[str, Any]] = {
    "flux": dict(attention_head_dim=8, num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16,
                 axes_dims_rope=(2, 2, 4)),
}

_TRANSFORMERS = {
    "flux": "FluxTransformer2DModel",
    "qwenimage": "QwenImageTransformer2DModel",
    "cogvideox": "CogVideoXTransformer3DModel",
    "wan": "WanTransformer3DModel",
    "sd3": "SD3Transformer2DModel",
    "hunyuanvideo": "HunyuanVideoTransformer3DModel",
    "hunyuanvideo15": "HunyuanVideo15Transformer3DModel",
}


def _check(name: str) -> None:
    if name not in _TRANSFORMERS:
        raise AdapterError(f"no built-in model {name!r}; known: {sorted(_TRANSFORMERS)}.")


@quiet_imports()
def tiny_transformer(name: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A tiny transformer of family `name` from config, random weights, eval mode, float32, CPU."""
    _check(name)
    import diffusers

    torch.manual_seed(seed)
    cls = getattr(diffusers, _TRANSFORMERS[name])
    return cls(**{**TINY_CONFIGS[name], **overrides}).eval()


@attrs.frozen(kw_only=True)
class FullArchitecture:
    """One published checkpoint's architecture, for `--full --arch NAME`: the family's default full size
    (`FULL_CONFIGS`) is one checkpoint, and a family's checkpoints differ in width (Wan 2.1 1.3B and 14B) or in
    layout (Wan 2.2 A14B: two experts, `transformer` for the high-noise steps and `transformer_2` for the rest)."""

    name: str
    family: str  # the zoo family (and adapter name) whose pipeline carries it
    source: str  # the Hugging Face repository whose transformer/config.json `transformer` copies
    transformer: dict[str, Any]
    experts: int = 1  # 2: `transformer_2` is a second transformer of the same config
    pipeline: dict[str, Any] = attrs.field(factory=dict)  # pipeline config (Wan 2.2: boundary_ratio)
    default_steps: int = 28  # the pipeline's own num_inference_steps default

    def describe(self) -> str:
        experts = f", {self.experts} experts" if self.experts > 1 else ""
        return f"{self.name} ({self.source}{experts})"


FULL_ARCHITECTURES: dict[str, FullArchitecture] = {arch.name: arch for arch in (
    FullArchitecture(name="wan2.1-1.3b", family="wan", source="Wan-AI/Wan2.1-T2V-1.3B-Diffusers", transformer=WAN_1_3B,
                     default_steps=50),
    FullArchitecture(name="wan2.1-14b", family="wan", source="Wan-AI/Wan2.1-T2V-14B-Diffusers", transformer=WAN_14B,
                     default_steps=50),
    # both experts are Wan 2.1 14B's config; the high-noise expert runs while t >= boundary_ratio * 1000
    FullArchitecture(name="wan2.2-a14b", family="wan", source="Wan-AI/Wan2.2-T2V-A14B-Diffusers", transformer=WAN_14B,
                     experts=2, pipeline=dict(boundary_ratio=0.875), default_steps=50),
    FullArchitecture(name="hunyuanvideo1.5-480p", family="hunyuanvideo15",
                     source="hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v",
                     transformer=HUNYUANVIDEO15_480P_T2V, default_steps=50),
)}

#: the architecture `--full` builds for a family without `--arch`
DEFAULT_ARCHITECTURE: dict[str, str] = {"wan": "wan2.1-1.3b", "hunyuanvideo15": "hunyuanvideo1.5-480p"}


def full_architecture(name: str, arch: str | None) -> FullArchitecture | None:
    """The `--arch` architecture of family `name` (its default one without `--arch`; None for a family that has
    only `FULL_CONFIGS`), or a SpecError naming the architectures that exist."""
    if arch is None:
        default = DEFAULT_ARCHITECTURE.get(name)
        return FULL_ARCHITECTURES[default] if default else None
    if arch not in FULL_ARCHITECTURES or FULL_ARCHITECTURES[arch].family != name:
        known = [a.name for a in FULL_ARCHITECTURES.values() if a.family == name]
        hint = f"for {name}: {known}" if known else f"none for {name}; all: {list(FULL_ARCHITECTURES)}"
        raise SpecError(f"--arch: expected a full-size architecture of MODEL {name!r} ({hint}), got {arch!r}.")
    return FULL_ARCHITECTURES[arch]


@quiet_imports()
def full_transformer(name: str, arch: str | None = None, **overrides: Any) -> torch.nn.Module:
    """The full-size architecture of family `name` (`arch`: one of `FULL_ARCHITECTURES`) with random weights
    (build it under a device context)."""
    _check(name)
    import diffusers

    architecture = full_architecture(name, arch)
    config = architecture.transformer if architecture is not None else FULL_CONFIGS[name]
    cls = getattr(diffusers, _TRANSFORMERS[name])
    return cls(**{**config, **overrides}).eval()


def full_transformers(name: str, arch: str | None = None) -> dict[str, torch.nn.Module]:
    """The pipeline components of the full-size architecture: `transformer`, and `transformer_2` for a
    two-expert one (each its own random weights: the experts of Wan 2.2 are two trained models)."""
    architecture = full_architecture(name, arch)
    parts = {"transformer": full_transformer(name, arch)}
    if architecture is not None and architecture.experts == 2:
        parts["transformer_2"] = full_transformer(name, arch)
    return parts


# --- pipelines ---------------------------------------------------------------------------------------------


def _tiny_vae_kl(latent_channels: int) -> torch.nn.Module:
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"), block_out_channels=(8, 8), layers_per_block=1,
        latent_channels=latent_channels, norm_num_groups=8, sample_size=32,
    ).eval()


def _flux(transformer: torch.nn.Module) -> Any:
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    vae = _tiny_vae_kl(4)
    vae.register_to_config(shift_factor=0.0, scaling_factor=1.0)
    return FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None, tokenizer=None,
                        text_encoder_2=None, tokenizer_2=None, transformer=transformer)


def _qwenimage(transformer: torch.nn.Module) -> Any:
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
    )

    vae = AutoencoderKLQwenImage(base_dim=4, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[False],
                                 latents_mean=[0.0] * 4, latents_std=[1.0] * 4).eval()
    return QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None, tokenizer=None,
                             transformer=transformer)


def _cogvideox(transformer: torch.nn.Module) -> Any:
    from diffusers import (
        AutoencoderKLCogVideoX,
        CogVideoXDDIMScheduler,
        CogVideoXPipeline,
    )

    vae = AutoencoderKLCogVideoX(
        in_channels=3, out_channels=3,
        down_block_types=("CogVideoXDownBlock3D",) * 2, up_block_types=("CogVideoXUpBlock3D",) * 2,
        block_out_channels=(8, 8), latent_channels=4, layers_per_block=1, norm_num_groups=2,
        temporal_compression_ratio=4,
    ).eval()
    return CogVideoXPipeline(tokenizer=None, text_encoder=None, vae=vae, transformer=transformer,
                             scheduler=CogVideoXDDIMScheduler())


def _wan(transformer: torch.nn.Module) -> Any:
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline

    vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True]).eval()
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    return WanPipeline(tokenizer=None, text_encoder=None, vae=vae, scheduler=scheduler, transformer=transformer)


def _hunyuanvideo15(transformer: torch.nn.Module) -> Any:
    from diffusers import AutoencoderKLHunyuanVideo15, FlowMatchEulerDiscreteScheduler, HunyuanVideo15Pipeline
    from diffusers.guiders import ClassifierFreeGuidance

    latent_channels = (transformer.config.in_channels - 1) // 2  # latents + condition latents + 1 mask channel
    vae = AutoencoderKLHunyuanVideo15(latent_channels=latent_channels, block_out_channels=(8, 8, 8), layers_per_block=1,
                                      spatial_compression_ratio=4, temporal_compression_ratio=4).eval()
    # 480p's flow shift 5 and the published guidance 6 (the guider is the pipeline's CFG: two calls per step)
    return HunyuanVideo15Pipeline(text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None, vae=vae,
                                  scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0), transformer=transformer,
                                  guider=ClassifierFreeGuidance(guidance_scale=6.0))


_PIPELINES: dict[str, Callable[[torch.nn.Module], Any]] = {
    "flux": _flux, "qwenimage": _qwenimage, "cogvideox": _cogvideox, "wan": _wan, "hunyuanvideo15": _hunyuanvideo15,
}


@quiet_imports()
def tiny_pipeline(name: str, seed: int = 0, **transformer_overrides: Any) -> Any:
    """A tiny pipeline of family `name` (flux, qwenimage, cogvideox, wan, hunyuanvideo15) on the CPU, no text
    encoders."""
    if name not in _PIPELINES:
        raise AdapterError(f"no built-in tiny pipeline {name!r}; known: {sorted(_PIPELINES)}.")
    pipe = _PIPELINES[name](tiny_transformer(name, seed=seed, **transformer_overrides))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def call_kwargs(name: str, steps: int = 4, seed: int = 0, batch: int = 1, height: int | None = None,
                width: int | None = None, **extra: Any) -> dict[str, Any]:
    """Keyword arguments for a call of `tiny_pipeline(name)`: random prompt embeddings, a seeded generator,
    small output, latents returned (no decode) unless `output_type` is given."""
    if name not in _PIPELINES:
        raise AdapterError(f"no built-in tiny pipeline {name!r}; known: {sorted(_PIPELINES)}.")
    g = torch.Generator().manual_seed(1234 + seed)
    cfg = TINY_CONFIGS[name]
    kw: dict[str, Any] = dict(num_inference_steps=steps, generator=torch.Generator().manual_seed(seed),
                              output_type="latent")
    if name == "flux":
        kw.update(prompt_embeds=torch.randn(batch, 8, cfg["joint_attention_dim"], generator=g),
                  pooled_prompt_embeds=torch.randn(batch, cfg["pooled_projection_dim"], generator=g),
                  height=height or 32, width=width or 32, guidance_scale=3.5)
    elif name == "qwenimage":
        kw.update(prompt_embeds=torch.randn(batch, 8, cfg["joint_attention_dim"], generator=g),
                  prompt_embeds_mask=torch.ones(batch, 8, dtype=torch.long),
                  height=height or 32, width=width or 32, true_cfg_scale=1.0)
    elif name == "cogvideox":
        kw.update(prompt_embeds=torch.randn(batch, cfg["max_text_seq_length"], cfg["text_embed_dim"], generator=g),
                  negative_prompt_embeds=torch.randn(batch, cfg["max_text_seq_length"], cfg["text_embed_dim"], generator=g),
                  height=height or 16, width=width or 16, num_frames=9, guidance_scale=6.0)
    elif name == "hunyuanvideo15":
        kw.update(hunyuanvideo15_embeddings(batch, 8, cfg["text_embed_dim"], 4, cfg["text_embed_2_dim"], g),
                  height=height or 16, width=width or 16, num_frames=5)
    else:  # wan
        kw.update(prompt_embeds=torch.randn(batch, 8, cfg["text_dim"], generator=g),
                  negative_prompt_embeds=torch.randn(batch, 8, cfg["text_dim"], generator=g),
                  height=height or 16, width=width or 16, num_frames=5, guidance_scale=5.0)
    kw.update(extra)
    return kw


def hunyuanvideo15_embeddings(batch: int, tokens: int, dim: int, tokens_2: int, dim_2: int,
                              g: torch.Generator) -> dict[str, torch.Tensor]:
    """HunyuanVideo 1.5's four embeddings and masks (Qwen2.5-VL and ByT5, conditional and negative): the pipeline
    runs CFG through its guider, which reads all of them. Masks all ones: every token attends (the padded length)."""
    kw: dict[str, torch.Tensor] = {}
    for prefix in ("", "negative_"):
        kw[f"{prefix}prompt_embeds"] = torch.randn(batch, tokens, dim, generator=g)
        kw[f"{prefix}prompt_embeds_mask"] = torch.ones(batch, tokens, dtype=torch.long)
        kw[f"{prefix}prompt_embeds_2"] = torch.randn(batch, tokens_2, dim_2, generator=g)
        kw[f"{prefix}prompt_embeds_mask_2"] = torch.ones(batch, tokens_2, dtype=torch.long)
    return kw


# --- full-size architectures for GPU benchmarks ------------------------------------------------------------


#: FLUX.1's VAE latent normalisation (its vae/config.json). Pipelines that encode an image (ControlNet, img2img,
#: Kontext, Fill) compute `(latents - shift_factor) * scaling_factor`: AutoencoderKL's default `shift_factor=None`
#: makes them fail with "unsupported operand type(s) for -: 'Tensor' and 'NoneType'".
FLUX_VAE_FACTORS = dict(shift_factor=0.1159, scaling_factor=0.3611)


def _scale8_vae_kl(latent_channels: int, **factors: float) -> torch.nn.Module:
    """A small AutoencoderKL with the real 8x spatial factor, so full-size pipelines size latents right; `factors`
    (shift_factor, scaling_factor) as the real VAE's config has them."""
    from diffusers import AutoencoderKL

    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
        latent_channels=latent_channels, norm_num_groups=8, sample_size=64,
    ).eval()
    if factors:
        vae.register_to_config(**factors)
    return vae


_FULL_PIPELINES = ("cogvideox", "flux", "qwenimage")


@quiet_imports()
def full_pipeline(name: str, **transformer_overrides: Any) -> Any:
    """A pipeline around the full-size transformer of `name` (random weights) with a small VAE of the right
    scale factor. Build it under `torch.device("cuda")` and `torch.set_default_dtype(torch.bfloat16)`;
    call it with `output_type="latent"` (the small VAE is not the real one)."""
    from diffusers import (
        AutoencoderKLCogVideoX,
        AutoencoderKLQwenImage,
        CogVideoXDDIMScheduler,
        CogVideoXPipeline,
        FlowMatchEulerDiscreteScheduler,
        FluxPipeline,
        QwenImagePipeline,
    )

    if name not in _FULL_PIPELINES:  # before building billions of parameters
        raise AdapterError(f"no full-size pipeline builder for {name!r}; known: {list(_FULL_PIPELINES)}.")
    transformer = full_transformer(name, **transformer_overrides)
    if name == "flux":
        vae = _scale8_vae_kl(16, **FLUX_VAE_FACTORS)
        pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True),
                            vae=vae, text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None,
                            transformer=transformer)
    elif name == "qwenimage":
        vae = AutoencoderKLQwenImage(base_dim=4, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                     temperal_downsample=[False, True, True]).eval()
        pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True), vae=vae,
                                 text_encoder=None, tokenizer=None, transformer=transformer)
    else:  # cogvideox
        vae = AutoencoderKLCogVideoX(in_channels=3, out_channels=3, down_block_types=("CogVideoXDownBlock3D",) * 4,
                                     up_block_types=("CogVideoXUpBlock3D",) * 4, block_out_channels=(8, 8, 8, 8),
                                     latent_channels=16, layers_per_block=1, norm_num_groups=2,
                                     temporal_compression_ratio=4).eval()
        pipe = CogVideoXPipeline(tokenizer=None, text_encoder=None, vae=vae, transformer=transformer,
                                 scheduler=CogVideoXDDIMScheduler())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def full_call_kwargs(name: str, steps: int = 28, height: int = 1024, width: int = 1024, seed: int = 0,
                     device: str = "cuda", dtype: torch.dtype = torch.bfloat16, narrow: bool = False,
                     **extra: Any) -> dict[str, Any]:
    """Call arguments for `full_pipeline(name)`: random prompt embeddings of the real shapes, latent output.

    `narrow`: for `full_pipeline(name, **NARROW_CONFIGS[name])`: embeddings of the narrow widths, 8 text tokens.
    """
    if name not in _FULL_PIPELINES:
        raise AdapterError(f"no full-size pipeline builder for {name!r}; known: {list(_FULL_PIPELINES)}.")
    if narrow and name not in NARROW_CONFIGS:
        raise AdapterError(f"no narrow config for {name!r}; known: {list(NARROW_CONFIGS)}.")
    g = torch.Generator(device="cpu").manual_seed(1234 + seed)
    kw: dict[str, Any] = dict(num_inference_steps=steps, height=height, width=width, output_type="latent",
                              generator=torch.Generator(device=device).manual_seed(seed))
    if name == "flux":
        cfg = NARROW_CONFIGS["flux"] if narrow else dict(joint_attention_dim=4096, pooled_projection_dim=768)
        tokens = 8 if narrow else 512
        kw.update(prompt_embeds=torch.randn(1, tokens, cfg["joint_attention_dim"], generator=g).to(device, dtype),
                  pooled_prompt_embeds=torch.randn(1, cfg["pooled_projection_dim"], generator=g).to(device, dtype),
                  guidance_scale=3.5)
    elif name == "qwenimage":
        kw.update(prompt_embeds=torch.randn(1, 64, 3584, generator=g).to(device, dtype),
                  prompt_embeds_mask=torch.ones(1, 64, dtype=torch.long, device=device), true_cfg_scale=1.0)
    elif name == "cogvideox":
        kw.update(prompt_embeds=torch.randn(1, 226, 4096, generator=g).to(device, dtype),
                  negative_prompt_embeds=torch.randn(1, 226, 4096, generator=g).to(device, dtype),
                  num_frames=9, guidance_scale=6.0)
    kw.update(extra)
    return kw


@quiet_imports()
def full_controlnet_pipeline(num_layers: int = 4, num_single_layers: int = 10, narrow: bool = False,
                             seed: int = 0) -> Any:
    """A FluxControlNetPipeline around `full_pipeline("flux")` (Flux-dev: 19 double + 38 single blocks) and one
    FluxControlNetModel of `num_layers` double and `num_single_layers` single blocks (4 + 10: `from_transformer`'s
    default; 5 + 0 and 2 + 4 are other layouts in use). Build it under `torch.device("cuda")` for the GPU.

    The ControlNet's output projections (`controlnet_blocks`, `controlnet_single_blocks`, `controlnet_x_embedder`)
    are zero-initialised by diffusers, as before training; they get Linear's default init here, so the residuals it
    adds between blocks are not zero (a trained ControlNet's are not). `narrow`: `NARROW_CONFIGS["flux"]` widths, the
    full structure on the CPU (call with `full_call_kwargs("flux", narrow=True, device="cpu", ...)`).
    """
    from diffusers import FluxControlNetModel, FluxControlNetPipeline

    widths = NARROW_CONFIGS["flux"] if narrow else {}
    torch.manual_seed(seed)
    base = full_pipeline("flux", **widths)
    controlnet = FluxControlNetModel(num_layers=num_layers, num_single_layers=num_single_layers,
                                     **{**FULL_CONFIGS["flux"], **widths}).eval()
    zeroed = [*controlnet.controlnet_blocks, *controlnet.controlnet_single_blocks, controlnet.controlnet_x_embedder]
    for linear in zeroed:
        linear.reset_parameters()
    parts = {k: v for k, v in base.components.items() if k not in ("image_encoder", "feature_extractor")}
    pipe = FluxControlNetPipeline(**parts, controlnet=controlnet)
    pipe.set_progress_bar_config(disable=True)
    return pipe


# --- variants: several transformers, ControlNet, image editing, img2img (tests and GPU benchmarks) -----------

#: tiny ControlNet configs: the tiny transformers' own (same blocks, heads, dims, rope axes)
TINY_CONTROLNET_CONFIGS: dict[str, dict[str, Any]] = {name: dict(TINY_CONFIGS[name]) for name in ("flux", "qwenimage")}

VARIANTS: tuple[str, ...] = (
    "wan22", "flux_controlnet", "flux_multicontrolnet", "qwenimage_controlnet",
    "qwenimage_edit", "qwenimage_edit_plus", "flux_kontext", "flux_img2img", "flux_fill",
)


def tiny_variant(name: str, seed: int = 0, **transformer_overrides: Any) -> Any:
    """A tiny pipeline of one of `VARIANTS` on the CPU, built from config (random weights, no text encoders).

    wan22: Wan 2.2 A14B's layout (`transformer` + `transformer_2`, `boundary_ratio=0.8`: 4 steps split 2 + 2); *_controlnet: one
    ControlNet, flux_multicontrolnet: two (FluxMultiControlNetModel; diffusers 0.42 runs one net only in QwenImageMultiControlNetModel); qwenimage_edit(_plus), flux_kontext: the
    reference image's tokens concatenated to the sequence (`zero_cond_t=True` in `transformer_overrides`: the
    Qwen-Image-Edit-2511 layout, whose prologue builds `modulate_index` every step); flux_img2img: `strength` < 1 runs fewer steps;
    flux_fill: masked-image and mask channels concatenated to the latents (transformer in_channels 16 + 16 + 16 = 48
    at this VAE's scale factor 2: latents, masked-image latents and the 2*2-pixel mask, each packed 2x2).
    """
    import diffusers

    if name not in VARIANTS:
        raise AdapterError(f"no built-in tiny variant {name!r}; known: {list(VARIANTS)}.")
    family = "wan" if name == "wan22" else name.split("_")[0]
    if name == "flux_fill":
        base = _flux(tiny_transformer("flux", seed=seed, **{"in_channels": 48, "out_channels": 16,
                                                             **transformer_overrides}))
    else:
        base = _PIPELINES[family](tiny_transformer(family, seed=seed, **transformer_overrides))
    parts = dict(base.components)
    if name == "wan22":
        pipe = diffusers.WanPipeline(**{**parts, "transformer_2": tiny_transformer("wan", seed=seed + 1)},
                                     boundary_ratio=0.8)
    elif name.endswith("controlnet"):
        cls = diffusers.FluxControlNetModel if family == "flux" else diffusers.QwenImageControlNetModel
        torch.manual_seed(seed + 7)
        nets = [cls(**TINY_CONTROLNET_CONFIGS[family]).eval() for _ in range(2 if "multi" in name else 1)]
        for net in nets:  # from_transformer-like zero init leaves the residuals zero: give them random weights
            for p in net.parameters():
                torch.nn.init.normal_(p, std=0.05)
        if "multi" in name:
            multi = diffusers.FluxMultiControlNetModel if family == "flux" else diffusers.QwenImageMultiControlNetModel
            controlnet: Any = multi(nets)
        else:
            controlnet = nets[0]
        pipe_cls = diffusers.FluxControlNetPipeline if family == "flux" else diffusers.QwenImageControlNetPipeline
        pipe = pipe_cls(**parts, controlnet=controlnet)
    elif name in ("qwenimage_edit", "qwenimage_edit_plus"):
        cls = diffusers.QwenImageEditPipeline if name == "qwenimage_edit" else diffusers.QwenImageEditPlusPipeline
        pipe = cls(**parts, processor=None)
    else:
        cls = {"flux_kontext": diffusers.FluxKontextPipeline, "flux_img2img": diffusers.FluxImg2ImgPipeline,
               "flux_fill": diffusers.FluxFillPipeline}[name]
        takes = inspect.signature(cls.__init__).parameters
        pipe = cls(**{k: v for k, v in parts.items() if k in takes})
    pipe.set_progress_bar_config(disable=True)
    return pipe


def variant_call_kwargs(name: str, steps: int = 4, seed: int = 0, height: int = 32, width: int = 32,
                        **extra: Any) -> dict[str, Any]:
    """Keyword arguments for a call of `tiny_variant(name)`: those of its family plus its conditioning input
    (control image, reference image, mask), all seeded."""
    if name not in VARIANTS:
        raise AdapterError(f"no built-in tiny variant {name!r}; known: {list(VARIANTS)}.")
    family = "wan" if name == "wan22" else name.split("_")[0]
    kw = call_kwargs(family, steps=steps, seed=seed, height=None if family == "wan" else height,
                     width=None if family == "wan" else width)
    g = torch.Generator().manual_seed(99 + seed)
    image = torch.rand(1, 3, height, width, generator=g)  # a [0, 1] image tensor
    if name.endswith("controlnet"):
        n = 2 if "multi" in name else 1
        if family == "flux":
            control = [torch.rand(1, 3, height, width, generator=g) for _ in range(n)]
            kw.update(control_image=control if n > 1 else control[0],
                      controlnet_conditioning_scale=[1.0] * n if n > 1 else 1.0,
                      control_mode=None)
        else:
            control = [torch.rand(1, 3, height, width, generator=g) for _ in range(n)]
            kw.update(control_image=control if n > 1 else control[0],
                      controlnet_conditioning_scale=[1.0] * n if n > 1 else 1.0)
    elif name in ("qwenimage_edit", "qwenimage_edit_plus"):
        # a latent-space reference (z_dim channels): the pipeline takes it as is, no resize to ~1024^2
        ref = torch.randn(1, 4, 1, height // 2, width // 2, generator=g)
        kw.update(image=[ref] if name == "qwenimage_edit_plus" else ref)
    elif name == "flux_kontext":
        kw.update(image=image, max_area=height * width, _auto_resize=False)
    elif name == "flux_img2img":
        kw.update(image=image, strength=0.6)
    elif name == "flux_fill":
        mask = torch.zeros(1, 1, height, width)
        mask[..., height // 4: 3 * height // 4, width // 4: 3 * width // 4] = 1.0
        kw.update(image=image, mask_image=mask, guidance_scale=30.0)
    kw.update(extra)
    return kw
