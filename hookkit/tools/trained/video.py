"""The small trained *video* model: a stock `WanTransformer3DModel` in a stock `WanPipeline`.

Caching rules chosen on images must be judged on video trajectories too (Wan's UniPC multistep solver, its
flow shift, a 3D token grid), and no trained video weights can be downloaded here. So hookkit trains one:

- clips of `FRAMES` frames, 32x32, of the same ten classes as the image models (`shapes.render(frames=...)`: the
  shape moves in a straight line and turns), conditioned on the image models' class embeddings (4 tokens of 64);
- `PatchVAE3D` is Wan's causal layout without weights: latent frame 0 holds frame 0 alone (repeated `TEMPORAL`
  times, as Wan's VAE encodes the first frame alone), latent frame k the `TEMPORAL` frames 4k-3..4k, each
  pixel-unshuffled by 2. 9 frames are a (48, 3, 16, 16) latent; with Wan's (1, 2, 2) patches, 192 tokens;
- Wan's scheduler: UniPC multistep with flow sigmas, `flow_shift` 3 (Wan 2.1 at 480p).

`hookkit.tools.trained` loads it as model "video"; `benchmarks/train_tiny_wan.py` trains it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hookkit.core.quiet import quiet_imports

with quiet_imports():
    from diffusers import ConfigMixin, ModelMixin
    from diffusers.configuration_utils import register_to_config

from hookkit.errors import SpecError

#: frames of a clip (Wan needs 1 + a multiple of `TEMPORAL`)
FRAMES = 9
#: frames per latent frame after the first (Wan's VAE: 4)
TEMPORAL = 4
#: pixels per latent pixel along each side
SPATIAL = 2
LATENT_CHANNELS = 3 * SPATIAL * SPATIAL * TEMPORAL
#: Latent normalisation as the image models': model latents = (raw - MEAN) / STD (WanPipeline decodes with
#: `latents * std + mean`, reading `latents_std` as the standard deviation).
LATENT_MEAN = -0.57
LATENT_STD = 1.0 / 3.0

#: The transformer: 8 blocks of 4 heads x 32 (128 hidden), Wan 2.1's layout (RMSNorm across heads, normed
#: cross-attention), text conditioning 64 wide as the image models'.
VIDEO_TRANSFORMER_CONFIG: dict[str, Any] = dict(
    patch_size=[1, 2, 2], num_attention_heads=4, attention_head_dim=32, in_channels=LATENT_CHANNELS,
    out_channels=LATENT_CHANNELS, text_dim=64, freq_dim=64, ffn_dim=512, num_layers=8, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6,
)

#: Wan 2.1's scheduler at 480p: UniPC on flow sigmas shifted by 3.
VIDEO_SCHEDULER_CONFIG: dict[str, Any] = dict(
    prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=3.0,
)


class PatchVAE3D(ModelMixin, ConfigMixin):
    """A deterministic, weightless video "VAE" with Wan's causal frame layout.

    It implements what `WanPipeline` uses of `AutoencoderKLWan`: `config.z_dim`, `config.scale_factor_temporal`,
    `config.scale_factor_spatial`, `config.latents_mean` / `config.latents_std` (per channel) and
    `decode(latents, return_dict=False)[0]`, returning (B, 3, frames, H, W) in [-1, 1]. `encode` is its inverse
    and returns raw latents; the training script normalises them as `(raw - mean) / std`.
    """

    @register_to_config
    def __init__(self, z_dim: int = LATENT_CHANNELS, scale_factor_temporal: int = TEMPORAL,
                 scale_factor_spatial: int = SPATIAL, latents_mean: tuple[float, ...] | None = None,
                 latents_std: tuple[float, ...] | None = None) -> None:
        super().__init__()
        if z_dim != 3 * scale_factor_spatial**2 * scale_factor_temporal:
            raise SpecError(f"PatchVAE3D.z_dim: expected 3 x scale_factor_spatial**2 x scale_factor_temporal = "
                            f"{3 * scale_factor_spatial**2 * scale_factor_temporal}, got {z_dim}.")
        # The pipeline reads these lists from the config; register_to_config stored the Nones, so fill them in.
        self.register_to_config(latents_mean=list(latents_mean or [LATENT_MEAN] * z_dim),
                                latents_std=list(latents_std or [LATENT_STD] * z_dim))
        self.register_buffer("anchor", torch.zeros(()), persistent=False)  # a device and dtype for the pipeline

    def encode(self, video: torch.Tensor) -> torch.Tensor:
        """Video (B, 3, 1 + k * temporal, H, W) in [-1, 1] -> raw latents (B, z_dim, 1 + k, H / s, W / s)."""
        t, s = self.config.scale_factor_temporal, self.config.scale_factor_spatial
        b, c, f, h, w = video.shape
        if (f - 1) % t:
            raise SpecError(f"PatchVAE3D.encode: expected 1 + a multiple of {t} frames, got {f}.")
        frames = nn.functional.pixel_unshuffle(video.transpose(1, 2).reshape(b * f, c, h, w), s)
        frames = frames.reshape(b, f, -1, h // s, w // s)  # (B, F, 3 s^2, h, w)
        first = frames[:, :1].expand(b, t, *frames.shape[2:])  # frame 0 alone, in every slot
        groups = torch.cat([first, frames[:, 1:]], dim=1).reshape(b, 1 + (f - 1) // t, -1, h // s, w // s)
        return groups.transpose(1, 2).contiguous()

    def decode(self, latents: torch.Tensor, return_dict: bool = True) -> Any:
        """Raw latents -> video (B, 3, frames, H, W) in [-1, 1]; frame 0 is the mean of its slots."""
        t, s = self.config.scale_factor_temporal, self.config.scale_factor_spatial
        b, z, n, h, w = latents.shape
        slots = latents.transpose(1, 2).reshape(b, n, t, z // t, h, w)
        frames = torch.cat([slots[:, :1].mean(dim=2), slots[:, 1:].reshape(b, (n - 1) * t, z // t, h, w)], dim=1)
        f = frames.shape[1]
        video = nn.functional.pixel_shuffle(frames.reshape(b * f, z // t, h, w), s)
        video = video.reshape(b, f, 3, h * s, w * s).transpose(1, 2)
        if return_dict:
            from diffusers.models.autoencoders.vae import DecoderOutput

            return DecoderOutput(sample=video)
        return (video,)


@quiet_imports()
def make_video_scheduler() -> Any:
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(**VIDEO_SCHEDULER_CONFIG)


@quiet_imports()
def build_video_pipeline(transformer: nn.Module) -> Any:
    """A stock `WanPipeline` around `transformer` with `PatchVAE3D`, Wan's scheduler and no text encoder."""
    from diffusers import WanPipeline

    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=PatchVAE3D(), scheduler=make_video_scheduler(),
                       transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe
