"""The quality harness and the fronts on the video model: clips compared frame by frame, SeaCache swept where it runs,
and every row's work counted on a WanPipeline as on a FluxPipeline.

The harness runs on an untrained video model in the shipped format; the shipped video model's front is a benchmark
(BENCHMARKS.md, "Caching at equal quality on the trained video model").
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import WanTransformer3DModel

import hookkit
from hookkit.tools import front, quality, trained
from hookkit.tools.quality import TrainedModel
from hookkit.tools.trained import video


@pytest.fixture(scope="module")
def untrained_video_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    transformer = WanTransformer3DModel(**video.VIDEO_TRANSFORMER_CONFIG).eval()
    path = tmp_path_factory.mktemp("video-weights") / "model.safetensors"
    return trained.save_model(path, transformer, trained.make_conditions(0), {"config": video.VIDEO_TRANSFORMER_CONFIG})


def test_ssim_of_clips_is_the_mean_of_their_frames_ssim() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.rand(2, 4, 3, 16, 16, generator=g)
    y = (x + 0.1 * torch.randn(x.shape, generator=g)).clamp(0, 1)
    per_frame = torch.stack([quality.ssim(x[:, f], y[:, f]) for f in range(4)], dim=1)
    assert torch.allclose(quality.ssim(x, y), per_frame.mean(dim=1), rtol=0, atol=1e-12)


def test_seacache_runs_on_the_video_model_over_its_sweep_and_stays_skipped_on_flux(untrained_video_file: Path) -> None:
    source = TrainedModel(name="video", weights=untrained_video_file)
    names = [c.name for c in front.front_configs(6, source, [(0, 0)]) if c.family == "diffusers SeaCache"]
    assert names == ["seacache-R0.1-K2", "seacache", "seacache-R0.5-K2", "seacache-R0.5-K4", "seacache-R1-K4",
                     "seacache-R2-K6"]
    assert all(front.seacache_config(t, k, video=True).unavailable() is None for t, k in front.SEACACHE_SWEEP)
    image = TrainedModel(name="tiny")
    skipped = [c for c in front.front_configs(6, image, [(0, 0)]) if c.family == "diffusers SeaCache"]
    assert [c.name for c in skipped] == ["seacache"] and skipped[0].unavailable() is not None


def test_the_harness_counts_and_compares_clips_on_the_video_model(untrained_video_file: Path) -> None:
    """A static mask computing 2 of 4 steps runs 2 x 8 blocks per clip of the reference's 4 x 8; the clips come out
    (B, 9, 3, 32, 32) and are compared frame by frame; the tables name the model."""
    cache = hookkit.DBCache(steps_mask=[1, 0, 1, 0], mask_policy="static", warmup_steps=0, taylorseer_order=0,
                            fn_blocks=0)
    report = quality.run_quality([quality.hookkit_config(cache, name="mask-1010")], classes=[0, 5], seeds=[100],
                                 steps=4, weights=untrained_video_file, model="video", log=None)
    ref, row = report.row("reference"), report.row("mask-1010")
    assert (ref.block_calls, row.block_calls, row.block_speedup) == (2 * 4 * 8, 2 * 2 * 8, 2.0)
    assert row.status == "ok" and row.psnr_db is not None and 0 < row.ssim < 1
    assert report.meta["model_label"] == "video Wan"
    assert report.markdown().startswith("Quality vs speed on hookkit's trained video Wan (2 classes x 1 seeds, 4 steps")


def test_model_label_of_a_report_from_before_labels_is_its_name_and_flux() -> None:
    assert quality.model_label({"model_name": "deep"}) == "deep Flux"
    assert quality.model_label({"model_name": "video", "model_label": "video Wan"}) == "video Wan"


def test_a_front_with_cfg_guides_every_call_and_says_so(untrained_video_file: Path) -> None:
    """`cfg_scale` > 1: two transformer calls a step (the class and the null class), in every row and the table."""
    cache = hookkit.DBCache(steps_mask=[1, 0, 1], mask_policy="static", warmup_steps=0, taylorseer_order=0,
                            fn_blocks=0)
    report = front.run_front(model="video", steps=3, classes=[2], seeds=[100], weights=untrained_video_file,
                             configs=[quality.hookkit_config(cache, name="mask-101")], log=None, cfg_scale=5.0)
    ref, row = report.quality.row("reference"), report.quality.row("mask-101")
    assert (ref.transformer_calls, ref.block_calls, row.block_calls) == (6, 6 * 8, 4 * 8)
    assert report.quality.meta["cfg_scale"] == 5.0
    assert "trained video Wan, 3 steps with CFG 5, 1 classes x seeds [100]" in report.markdown()


def _taylorseer_hooked(pipe) -> list[str]:
    return [n for n, m in pipe.transformer.named_modules()
            if hasattr(m, "_diffusers_hook") and m._diffusers_hook.get_hook("taylorseer_cache") is not None]


def test_diffusers_taylorseer_defaults_hook_no_wan_attention_so_the_front_names_them(untrained_video_file: Path) -> None:
    """diffusers' default patterns must match a whole module name ending in "attn"; Wan's are attn1 and attn2. The
    front's named rows (`WAN_ATTENTION_IDENTIFIERS`) hook all 16 of the 8 blocks."""
    pipe = trained.load_pipeline(path=untrained_video_file, model="video")
    undo = front.taylorseer_config(2).setup(pipe)
    assert _taylorseer_hooked(pipe) == []
    undo()
    named = front.taylorseer_config(2, identifiers=front.WAN_ATTENTION_IDENTIFIERS)
    undo = named.setup(pipe)
    assert _taylorseer_hooked(pipe) == [f"blocks.{i}.attn{k}" for i in range(8) for k in (1, 2)]
    undo()
    assert (named.name, named.family) == ("taylorseer-named-N2", "diffusers TaylorSeerCache (Wan attention names)")
