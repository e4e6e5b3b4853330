"""hookkit.tools.quality: the metrics, the block counter, the configurations, and the harness end to end.

The harness mechanics run on an untrained model in the shipped format (static masks and FirstBlockCache at
an enormous threshold cache with any weights, so block counts are exact); one test runs it on the shipped
trained model and is skipped, with the reason, until its weights are in hookkit/trained/.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from diffusers import FluxTransformer2DModel

import hookkit
from hookkit.tools import bench, quality, trained, zoo
from hookkit.errors import SpecError
from hookkit.tools.quality import BlockCounter, QualityConfig

MISSING = trained.missing_weights()
PNG = b"\x89PNG\r\n\x1a\n"


# --- metrics ------------------------------------------------------------------------------------------------


def test_ssim_of_an_image_with_itself_is_one() -> None:
    x = torch.rand(2, 3, 32, 32)
    assert torch.allclose(quality.ssim(x, x), torch.ones(2, dtype=torch.float64), rtol=0, atol=1e-12)


def test_ssim_of_two_flat_images_is_the_luminance_term() -> None:
    """No variance anywhere: SSIM = (2ab + C1) / (a^2 + b^2 + C1) with C1 = (0.01 * range)^2."""
    a, b = 0.25, 0.75  # exact in float32
    value = quality.ssim(torch.full((1, 3, 16, 16), a), torch.full((1, 3, 16, 16), b)).item()
    c1 = 0.01**2
    assert value == pytest.approx((2 * a * b + c1) / (a * a + b * b + c1), abs=1e-9)


def test_ssim_drops_with_noise() -> None:
    x = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    noise = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    small, large = quality.ssim(x, x + 0.01 * noise).item(), quality.ssim(x, x + 0.2 * noise).item()
    assert 1 > small > large


def test_ssim_needs_images_at_least_as_large_as_its_window() -> None:
    with pytest.raises(SpecError, match="at least 11x11"):
        quality.ssim(torch.rand(1, 3, 8, 8), torch.rand(1, 3, 8, 8))


def test_psnr_of_an_error_and_of_none() -> None:
    assert bench.psnr_from_mse(0.01) == pytest.approx(20.0)
    assert bench.psnr_from_mse(0.0) == math.inf


# --- counting blocks ----------------------------------------------------------------------------------------


def tiny_flux_call(pipe, steps: int = 4) -> None:
    pipe(**zoo.call_kwargs("flux", steps=steps))


def test_block_counter_counts_every_block_of_an_uncached_call() -> None:
    pipe = zoo.tiny_pipeline("flux")
    counter = BlockCounter(pipe.transformer)
    tiny_flux_call(pipe)
    assert (counter.num_blocks, counter.calls, counter.block_calls, counter.partial_calls) == (5, 4, 20, 0)


def test_block_counter_agrees_with_hookkit_dbcache_summary() -> None:
    """Static mask 1,0,0,1: steps 1 and 2 run only the first block: 5 + 1 + 1 + 5 blocks."""
    pipe = zoo.tiny_pipeline("flux")
    counter = BlockCounter(pipe.transformer)
    handle = hookkit.enable(pipe, hookkit.Spec(cache=hookkit.DBCache(steps_mask=[1, 0, 0, 1], mask_policy="static")))
    tiny_flux_call(pipe)
    assert (counter.block_calls, counter.partial_calls) == (12, 2)
    assert handle.summary().features["cache"].data["block_calls"] == 12
    handle.remove()


def test_block_counter_sees_the_blocks_first_block_cache_skips() -> None:
    """FirstBlockCache at an enormous threshold: step 0 runs all 5 blocks, then only the first one."""
    pipe = zoo.tiny_pipeline("flux")
    counter = BlockCounter(pipe.transformer)
    undo = quality.fbcache_config(1e9).setup(pipe)
    tiny_flux_call(pipe)
    undo()
    assert (counter.block_calls, counter.partial_calls) == (8, 3)


def test_block_counter_removes_its_hooks() -> None:
    pipe = zoo.tiny_pipeline("flux")
    counter = BlockCounter(pipe.transformer)
    counter.remove()
    assert all(not m._forward_pre_hooks for m in pipe.transformer.modules())
    tiny_flux_call(pipe)
    assert counter.calls == 0 and counter.block_calls == 0


# --- configurations -----------------------------------------------------------------------------------------


def test_a_config_is_a_spec_or_a_setup_not_both() -> None:
    with pytest.raises(SpecError, match="not both"):
        QualityConfig(name="x", family="x", spec=hookkit.Spec(), setup=lambda pipe: lambda: None)
    with pytest.raises(SpecError, match="QualityConfig.spec"):
        QualityConfig(name="x", family="x", spec={"cache": None})


def test_a_config_whose_module_does_not_import_is_unavailable() -> None:
    config = QualityConfig(name="peer", family="peer", setup=lambda pipe: lambda: None,
                           requires="hookkit_no_such_module")
    assert config.unavailable() == "`import hookkit_no_such_module` fails (not installed)"


def test_default_sweep_covers_hookkit_variants_and_peers_at_the_same_thresholds() -> None:
    configs = quality.default_configs()
    names = [c.name for c in configs]
    assert len(set(names)) == len(names)
    by_family: dict[str, list] = {}
    for c in configs:
        by_family.setdefault(c.family, []).append(c.x)
    thresholds = list(quality.DEFAULT_THRESHOLDS)
    assert by_family == {
        "hookkit defaults": [hookkit.DBCache().threshold],
        "hookkit F1B0": thresholds, "hookkit F2B0": thresholds, "hookkit F1B1": thresholds,
        "hookkit F1B0 TaylorSeer-1": thresholds, "hookkit F1B0 static mask": list(quality.MASK_POLICIES),
        "diffusers FirstBlockCache": thresholds, "cache-dit F1B0": thresholds,
    }
    assert min(thresholds) == 0.04 and max(thresholds) == 0.3


# --- the harness --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def untrained_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("untrained")
    torch.manual_seed(0)
    model = trained.save_model(folder / "model.safetensors", FluxTransformer2DModel(**trained.TRANSFORMER_CONFIG),
                               trained.make_conditions(0))
    classifier = trained.save_classifier(folder / "classifier.safetensors", trained.ShapeClassifier())
    return model, classifier


def test_harness_counts_compares_and_writes_table_json_and_plot(untrained_files: tuple[Path, Path],
                                                               tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    model, classifier = untrained_files
    configs = [
        quality.hookkit_config(hookkit.DBCache(steps_mask="fast", mask_policy="static", taylorseer_order=0)),
        quality.fbcache_config(1e9),
        QualityConfig(name="peer", family="peer", setup=lambda pipe: lambda: None, requires="hookkit_no_such_module"),
    ]
    report = quality.run_quality(configs, classes=[0, 1], seeds=[0], steps=28, weights=model,
                                 classifier_weights=classifier, log=None)
    ref, masked, fbc, peer = report.rows
    # 2 samples x 28 steps x 6 blocks; the "fast" mask computes 11 of 28 steps; FBC computes only step 0.
    assert (ref.block_calls, ref.transformer_calls, ref.cached_calls) == (336, 56, 0)
    assert (masked.block_calls, masked.reported_block_calls, masked.cached_calls) == (2 * (11 * 6 + 17), 166, 34)
    assert (fbc.block_calls, fbc.cached_calls) == (2 * (6 + 27), 54)
    assert masked.block_speedup == 336 / 166 and fbc.block_speedup == 336 / 66
    assert masked.psnr_db is not None and masked.psnr_min_db <= masked.psnr_db and 0 < masked.ssim < 1
    assert (peer.status, peer.note) == ("skipped", "`import hookkit_no_such_module` fails (not installed)")

    paths = report.write(tmp_path)
    data = json.loads(paths["json"].read_text())
    assert [r["name"] for r in data["rows"]] == ["reference", "hookkit-F1B0-mask-fast-static", "fbcache-R1e+09", "peer"]
    assert data["meta"]["classes"] == ["red circle", "green square"] and data["meta"]["seeds"] == [0]
    assert "| hookkit-F1B0-mask-fast-static |" in paths["markdown"].read_text()
    assert paths["plot"].read_bytes()[:8] == PNG


def test_block_counter_without_per_block_hooks_counts_transformer_calls_only() -> None:
    pipe = zoo.tiny_pipeline("flux")
    counter = BlockCounter(pipe.transformer, per_block=False)
    tiny_flux_call(pipe)
    assert all(not m._forward_pre_hooks for m in pipe.transformer.modules() if m is not pipe.transformer)
    assert (counter.calls, counter.block_calls, counter.partial_calls) == (4, None, None)


def test_harness_counts_compiled_rows_without_hooks_inside_the_compiled_blocks(untrained_files: tuple[Path, Path]) -> None:
    """Counting hooks inside compiled blocks made dynamo recompile per block until its limit (H200 run 13): a
    compiled row counts transformer calls, and its blocks from hookkit's cache (or all of them without one)."""
    model, classifier = untrained_files
    compiled = hookkit.Compile(backend="eager")
    mask = hookkit.DBCache(steps_mask="fast", mask_policy="static", taylorseer_order=0)
    configs = [QualityConfig(name="compiled", family="x", spec=hookkit.Spec(compile=compiled)),
               QualityConfig(name="compiled+cache", family="x", spec=hookkit.Spec(compile=compiled, cache=mask))]
    torch._dynamo.reset()
    report = quality.run_quality(configs, classes=[0, 1], seeds=[0], steps=28, weights=model,
                                 classifier_weights=classifier, log=None)
    _, plain, cached = report.rows
    assert (plain.status, plain.block_calls, plain.transformer_calls, plain.cached_calls) == ("ok", 336, 56, 0)
    assert (cached.status, cached.block_calls, cached.reported_block_calls, cached.cached_calls) == ("ok", 166, 166, None)
    assert "| —/56 " in report.markdown()  # a cached compiled row: which calls skipped blocks is not counted


@pytest.mark.skipif(MISSING is not None, reason=MISSING or "")
def test_harness_runs_on_the_shipped_model_with_two_configurations(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    configs = [quality.hookkit_config(hookkit.DBCache(threshold=0.12)), quality.fbcache_config(0.12)]
    report = quality.run_quality(configs, classes=[0, 5], seeds=[0], steps=28, log=None)
    ref, dbcache, fbc = report.rows
    assert (ref.block_calls, ref.transformer_calls) == (2 * 28 * 6, 2 * 28)
    assert dbcache.status == fbc.status == "ok"
    assert dbcache.reported_block_calls == dbcache.block_calls
    # DBCache computes its 8 warm-up steps in full; FirstBlockCache at least step 0 and its first block always.
    assert 2 * (8 * 6 + 20) <= dbcache.block_calls <= ref.block_calls
    assert 2 * (6 + 27) <= fbc.block_calls <= ref.block_calls
    paths = report.write(tmp_path)
    assert {p.name for p in paths.values()} == {"quality.md", "quality.json", "quality.png"}


def test_quality_main_lists_the_sweep(capsys: pytest.CaptureFixture[str]) -> None:
    assert quality.quality_main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "hookkit-F1B0-R0.12" in out and "fbcache-R0.3" in out and "cache-dit-F1B0-R0.04" in out


def test_quality_main_refuses_an_unknown_configuration(capsys: pytest.CaptureFixture[str]) -> None:
    assert quality.quality_main(["--configs", "nope"]) == 2
    assert ("hookkit bench --quality: error: --configs: unknown configuration 'nope'; `--list` shows the known ones."
            in capsys.readouterr().err)


def test_quality_main_refuses_an_unknown_device_before_running(capsys: pytest.CaptureFixture[str]) -> None:
    assert quality.quality_main(["--device", "gpu", "--quick", "--no-plot"]) == 2
    assert "hookkit bench --quality: error: --device: expected 'cpu', 'cuda' or 'cuda:N', got 'gpu'." in \
        capsys.readouterr().err


def test_configurations_that_decide_differently_have_different_names() -> None:
    names = [quality.hookkit_config(c).name for c in (
        hookkit.DBCache(steps_mask="fast", threshold=0.08),            # dynamic mask: the threshold decides
        hookkit.DBCache(steps_mask="fast", threshold=0.2),
        hookkit.DBCache(steps_mask="fast", mask_policy="static"),      # static: the mask alone decides
        hookkit.DBCache(threshold=0.12, warmup_steps=0),
        hookkit.DBCache(threshold=0.12, max_continuous_cached_steps=3),
        hookkit.DBCache(threshold=0.12),
    )]
    assert names == ["hookkit-F1B0-TS1-mask-fast-dynamic-R0.08", "hookkit-F1B0-TS1-mask-fast-dynamic-R0.2",
                     "hookkit-F1B0-TS1-mask-fast-static", "hookkit-F1B0-TS1-W0-R0.12", "hookkit-F1B0-TS1-MC3-R0.12",
                     "hookkit-F1B0-TS1-R0.12"]


def test_quality_main_says_matplotlib_is_missing_before_the_sweep(monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    monkeypatch.setattr(quality, "run_quality", lambda *a, **k: pytest.fail("the sweep ran"))
    assert quality.quality_main(["--quick"]) == 2
    assert ("hookkit bench --quality: error: hookkit bench --quality (quality.png) needs matplotlib, which is not "
            "installed. Install it with `pip install hookkit[plot]` (or `pip install matplotlib`), or add --no-plot."
            in capsys.readouterr().err)
