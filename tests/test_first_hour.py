"""The first hour of a new user: defaults that cache on short schedules, a demo that shows a
picture, quiet imports, messages that say what to do."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

import hookkit
from hookkit.techniques.cache.spec import auto_warmup_steps
from hookkit.tools import demo
from test_dbcache import drive, stub, steps

REPO = Path(__file__).resolve().parent.parent


# --- 1. warm-up scaled to the step count -------------------------------------------------------------------


def test_auto_warmup_is_8_from_28_steps_and_the_same_share_rounded_up_below() -> None:
    assert {n: auto_warmup_steps(n) for n in (1, 3, 4, 6, 7, 8, 10, 11, 20, 27, 28, 50)} == {
        1: 1, 3: 1, 4: 2, 6: 2, 7: 2, 8: 3, 10: 3, 11: 4, 20: 6, 27: 8, 28: 8, 50: 8}
    assert auto_warmup_steps(None) == 8  # unknown step count: the 28-step value


def test_default_dbcache_caches_on_a_6_step_call() -> None:
    model, handle = stub(hookkit.DBCache(threshold=0.5))  # warmup_steps=None: 2 of 6
    drive(model, handle, [1.0] * 6)
    assert steps(handle) == ([0, 1], [2, 3, 4, 5])


def test_default_dbcache_warms_up_8_steps_at_28() -> None:
    model, handle = stub(hookkit.DBCache(threshold=0.5))
    drive(model, handle, [1.0] * 28)
    assert steps(handle) == (list(range(8)), list(range(8, 28)))


def test_explicit_warmup_is_taken_as_given_even_when_it_covers_every_step() -> None:
    model, handle = stub(hookkit.DBCache(threshold=0.5, warmup_steps=8))
    drive(model, handle, [1.0] * 6)
    summary = handle.summary().features["cache"]
    assert steps(handle) == ([0, 1, 2, 3, 4, 5], [])
    assert summary.data["no_cache_reason"] == (
        "warmup_steps=8 covers all 6 steps of this call: no step may be cached. Set DBCache(warmup_steps=...) "
        "below 6, or leave it None (scaled to the step count).")
    assert "no step cached: warmup_steps=8 covers all 6 steps" in summary.text


def test_summary_says_when_the_threshold_rejected_every_step() -> None:
    model, handle = stub(hookkit.DBCache(threshold=0.1, warmup_steps=1))
    drive(model, handle, [1.0, 2.0, 4.0])  # diffs 1.0 and 1.0 (relative to the last computed step)
    assert handle.summary().features["cache"].data["no_cache_reason"] == (
        "every measured diff (2 of them, smallest 1) was at or above threshold 0.1. Random weights rarely cache "
        "(judge with trained weights); a higher threshold caches more steps at lower fidelity.")


def test_summary_has_no_reason_when_a_step_was_cached() -> None:
    model, handle = stub(hookkit.DBCache(threshold=0.5))
    drive(model, handle, [1.0] * 6)
    assert handle.summary().features["cache"].data["no_cache_reason"] is None


def test_the_reason_is_logged_once_per_handle(capfd: pytest.CaptureFixture[str]) -> None:
    model, handle = stub(hookkit.DBCache(threshold=0.5, warmup_steps=8))
    hookkit.set_verbosity("WARNING")
    try:
        for _ in range(3):
            drive(model, handle, [1.0] * 6)
    finally:
        hookkit.set_verbosity(None)
    assert capfd.readouterr().err.count("cache: warmup_steps=8 covers all 6 steps") == 1


def test_warmup_none_is_accepted_and_other_types_are_refused_naming_the_field() -> None:
    assert hookkit.DBCache().warmup_steps is None
    with pytest.raises(hookkit.errors.SpecError, match=r"DBCache.warmup_steps: expected an int >= 0 or None, got 2.5"):
        hookkit.DBCache(warmup_steps=2.5)


# --- 3. the demo ------------------------------------------------------------------------------------------


def test_demo_saves_a_labelled_grid_of_plain_and_hookkit_images(tmp_path: Path) -> None:
    out = tmp_path / "grid.png"
    proc = subprocess.run([sys.executable, "-m", "hookkit", "demo", "--steps", "10", "--classes",
                           "red circle,blue ring", "--out", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr == ""  # no library chatter, no progress bars
    lines = proc.stdout.splitlines()
    assert lines[-1] == f"Saved the side-by-side grid: {out.resolve()}"  # `make demo` ends with where the PNG is
    assert "after hookkit.disable: output bitwise equal to the plain run: True" in proc.stdout
    assert "hookkit summary: FluxTransformer2DModel in FluxPipeline" in proc.stdout
    panels = demo.read_panels(out)
    assert [(p["row"], p["label"], p["steps"]) for p in panels] == [
        ("plain", "red circle", 10), ("plain", "blue ring", 10), ("hookkit", "red circle", 10),
        ("hookkit", "blue ring", 10)]
    assert all(p["cached"] == 0 and p["psnr"] is None for p in panels[:2])
    assert all(p["cached"] >= 1 and p["psnr"] > 20 for p in panels[2:])  # trained weights cache at 10 steps
    assert Image.open(out).size == (150 + 2 * (32 * demo.SCALE + 12) + 12, 56 + 2 * (32 * demo.SCALE + 58 + 12))


def test_demo_grid_panels_are_the_generated_images(tmp_path: Path) -> None:
    images = [torch.rand(3, 32, 32, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    panels = [demo.Panel(row=r, label=name, seconds=0.5, cached=c, steps=28, psnr=p)
              for r, c, p in (("plain", 0, None), ("hookkit", 16, 41.0)) for name in ("red circle", "cyan circle")]
    path = demo.save_grid(images[:2], images[2:], panels, "title", tmp_path / "g.png")
    grid = torch.from_numpy(__import__("numpy").array(Image.open(path))).permute(2, 0, 1)
    s = demo.SCALE
    first = grid[:, 56:56 + 32 * s:s, 150:150 + 32 * s:s]  # top-left panel, one sample per image pixel
    assert torch.equal(first, (images[0] * 255).round().to(torch.uint8))
    assert json.loads(Image.open(path).text[demo.PANELS_KEY])[3] == {
        "row": "hookkit", "label": "cyan circle", "seconds": 0.5, "cached": 16, "steps": 28, "psnr": 41.0}
    assert panels[3].caption() == ["0.50 s", "cached 16/28", "PSNR 41.0 dB"]


def test_demo_refuses_an_unknown_class_before_loading_the_model(capsys: pytest.CaptureFixture[str]) -> None:
    from hookkit.tools import cli

    assert cli.main(["demo", "--classes", "red cirle"]) == 2
    assert "red cirle" in capsys.readouterr().err


# --- 6. quiet imports ------------------------------------------------------------------------------------


def test_import_hookkit_and_building_its_pipelines_print_nothing_on_stderr() -> None:
    code = ("import hookkit; from hookkit.tools import zoo, trained; zoo.tiny_pipeline('flux'); "
            "zoo.tiny_pipeline('qwenimage'); trained.load_pipeline()")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr == ""


def test_hookkits_own_first_import_of_torchao_prints_nothing_on_stderr() -> None:
    code = ("from hookkit.techniques.quantize.torchao import make_config; "
            "make_config('int8_weight_only'); make_config('mxfp8')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr == ""


def test_import_hookkit_does_not_import_torchao_or_diffusers_models() -> None:
    code = "import sys, hookkit; print(sorted(m for m in ('torchao', 'diffusers.models') if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.stdout.strip() == "[]" and proc.stderr == ""


def test_quiet_imports_puts_logger_levels_back() -> None:
    import logging

    from hookkit.core.quiet import quiet_imports

    logging.getLogger("torchao").setLevel(logging.INFO)
    try:
        with quiet_imports():
            assert logging.getLogger("torchao").level == logging.ERROR
        assert logging.getLogger("torchao").level == logging.INFO
    finally:
        logging.getLogger("torchao").setLevel(logging.NOTSET)


# --- 7. messages -----------------------------------------------------------------------------------------


def test_a_pipeline_call_after_enabling_the_bare_transformer_says_enable_the_pipeline_first() -> None:
    from hookkit.tools import zoo

    pipe = zoo.tiny_pipeline("flux")
    hookkit.enable(pipe.transformer, hookkit.Spec(cache=hookkit.DBCache()))
    try:
        with pytest.raises(hookkit.errors.SpecError) as exc:
            pipe(**zoo.call_kwargs("flux", steps=2))
    finally:
        hookkit.disable(pipe.transformer)
    message = str(exc.value)
    assert message.startswith("DBCache on FluxTransformer2DModel: hookkit was enabled on the bare transformer")
    # the pipeline fix comes before the bare-transformer one
    assert message.index("hookkit.enable(pipe, spec)") < message.index("handle.generation")


def _tiny_unet() -> torch.nn.Module:
    from diffusers import UNet2DModel

    return UNet2DModel(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(8, 16),
                       norm_num_groups=4, down_block_types=("DownBlock2D", "DownBlock2D"),
                       up_block_types=("UpBlock2D", "UpBlock2D"))


def test_a_unet_pipeline_is_refused_saying_unets_are_not_supported_and_why() -> None:
    from diffusers import DDPMPipeline, DDPMScheduler

    pipe = DDPMPipeline(unet=_tiny_unet(), scheduler=DDPMScheduler())
    with pytest.raises(hookkit.errors.EnableError, match=r"^hookkit.enable: UNets are not supported, because hookkit's "
                                                          r"techniques work on a diffusion transformer's list of "
                                                          r"same-shaped blocks.*got DDPMPipeline, which denoises with "
                                                          r"a UNet \(UNet2DModel\)"):
        hookkit.enable(pipe, hookkit.Spec())


def test_a_bare_unet_is_refused_the_same_way() -> None:
    with pytest.raises(hookkit.errors.EnableError, match=r"UNets are not supported, because .* got a bare UNet "
                                                          r"\(UNet2DModel\)"):
        hookkit.enable(_tiny_unet(), hookkit.Spec())


def test_dbcache_with_diffusers_first_block_cache_enabled_before_is_refused_at_enable() -> None:
    from diffusers.hooks import FirstBlockCacheConfig

    from hookkit.tools import zoo

    pipe = zoo.tiny_pipeline("flux")
    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.1))
    with pytest.raises(hookkit.errors.UnsupportedError, match=r"DBCache on FluxTransformer2DModel: diffusers' "
                                                               r"FirstBlockCacheConfig is enabled on it too.*"
                                                               r"disable_cache\(\) first"):
        hookkit.enable(pipe, hookkit.Spec(cache=hookkit.DBCache()))
    assert hookkit.handle_of(pipe) is None
    hookkit.enable(pipe, hookkit.Spec()).remove()  # without DBCache both coexist


def test_dbcache_with_diffusers_first_block_cache_enabled_after_is_refused_at_the_next_call() -> None:
    from diffusers.hooks import FirstBlockCacheConfig

    from hookkit.tools import zoo

    pipe = zoo.tiny_pipeline("flux")
    handle = hookkit.enable(pipe, hookkit.Spec(cache=hookkit.DBCache()))
    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.1))
    with pytest.raises(hookkit.errors.UnsupportedError, match=r"FirstBlockCacheConfig is enabled on it too"):
        pipe(**zoo.call_kwargs("flux", steps=2))
    pipe.transformer.disable_cache()
    pipe(**zoo.call_kwargs("flux", steps=2))  # runs again once diffusers' cache is off
    handle.remove()
