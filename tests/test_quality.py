"""hookkit.tools.quality: the metrics, the block counter, the configurations, and the harness end to end.

The harness mechanics run on an untrained model in the shipped format (static masks and FirstBlockCache at
an enormous threshold cache with any weights, so block counts are exact); one test runs it on the shipped
trained model and is skipped, with the reason, until its weights are in hookkit/trained/.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import attrs
import pytest
import torch
from diffusers import FluxTransformer2DModel

import hookkit
from hookkit.tools import bench, front, quality, trained, zoo
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
        "hookkit defaults": [hookkit.DBCache().speedup],
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


@pytest.mark.slow
def test_harness_counts_compiled_rows_without_hooks_inside_the_compiled_blocks(untrained_files: tuple[Path, Path]) -> None:
    """Counting hooks inside compiled blocks makes dynamo recompile per block until its limit: a
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


# --- work in executed block FLOPs ---------------------------------------------------------------------------


class _ToyBlock(torch.nn.Module):
    """attn: 4 -> 8 -> 4 (2 * 3 * 4 * 8 + 2 * 3 * 8 * 4 = 384 FLOPs for 3 rows); proj: 4 -> 4 (96 FLOPs)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(self.attn(x))


class _ToyTransformer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_ToyBlock(), _ToyBlock()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_measure_block_flops_gives_each_child_its_flops_per_call() -> None:
    toy, x = _ToyTransformer(), torch.randn(3, 4)
    flops = quality.measure_block_flops(toy, lambda: (toy(x), toy(x)), blocks=toy.blocks)  # two calls: per call
    assert flops == quality.BlockFlops(children=((384, 96), (384, 96)), own=(0, 0))
    assert flops.per_call == 960


def test_block_counter_credits_exactly_the_children_that_ran() -> None:
    """Call 1 runs everything (960); call 2 reuses block 1's attention as PAB does, by a replaced forward (480 + 96);
    call 3 also skips block 0 whole, as a block cache does (96)."""
    toy, x = _ToyTransformer(), torch.randn(3, 4)
    flops = quality.BlockFlops(children=((384, 96), (384, 96)), own=(0, 0))
    counter = BlockCounter(toy, flops=flops, blocks=toy.blocks)
    with torch.no_grad():
        toy(x)
        cached = toy.blocks[1].attn(x)
        toy.blocks[1].attn.forward = lambda h: cached
        toy(x)
        toy.blocks[0].forward = lambda h: h
        toy(x)
    assert (counter.calls, counter.executed_flops, counter.block_calls, counter.partial_calls) == (3, 1632, 5, 2)


# --- peers ----------------------------------------------------------------------------------------------------

PEERS = [quality.fbcache_config(0.1), front.magcache_config(0.06, steps=4), front.taylorseer_config(2),
         front.taylorseer_config(2, lite=True), front.fastercache_config(2), front.pab_config(2),
         quality.cache_dit_config(0.1, warmup_steps=1)]


@pytest.mark.parametrize("config", PEERS, ids=[c.name for c in PEERS])
def test_a_peer_configs_undo_leaves_the_pipeline_bitwise_stock(config: QualityConfig) -> None:
    if config.unavailable():
        pytest.skip(config.unavailable())
    pipe = zoo.tiny_pipeline("flux")
    stock = pipe(**zoo.call_kwargs("flux", steps=4)).images  # a stock call adds diffusers' `_diffusers_hook` itself
    keys = {name: sorted(m.__dict__) for name, m in pipe.transformer.named_modules()}
    undo = config.setup(pipe)
    pipe(**zoo.call_kwargs("flux", steps=4))
    undo()
    assert {name: sorted(m.__dict__) for name, m in pipe.transformer.named_modules()} == keys
    assert torch.equal(pipe(**zoo.call_kwargs("flux", steps=4)).images, stock)


def test_seacache_is_listed_and_skipped_with_its_reason() -> None:
    assert front.seacache_config().unavailable().startswith("FluxPipeline enters cache_context without the step index")


# --- the front ------------------------------------------------------------------------------------------------


def _point(name: str, speedup: float | None, psnr: float | None, status: str = "ok",
           psnr_min: float | None = None) -> quality.QualityRow:
    return quality.QualityRow(name=name, family="f", kind="peer", description="", x=None, status=status,
                              flops_speedup=speedup, psnr_mean_db=psnr, psnr_min_db=psnr_min)


def test_pareto_front_keeps_the_rows_nothing_beats_on_speed_and_psnr() -> None:
    rows = [_point("a", 1.2, 40.0), _point("b", 1.5, 38.0), _point("c", 1.5, 36.0),   # c: b is as fast, better
            _point("d", 2.0, 38.0),                                                   # d beats b: faster, as good
            _point("e", 3.0, 25.0), _point("f", 2.5, 24.0),                           # f: e is faster and better
            _point("g", 4.0, 20.0, status="failed"), _point("h", None, 50.0),         # not run / no FLOP count
            _point("i", 3.0, 25.0)]                                                   # equal to e: e came first
    assert [r.name for r in front.pareto_front(rows)] == ["a", "d", "e"]


def test_best_at_a_target_is_the_best_psnr_at_that_speedup_or_more() -> None:
    frontier = front.pareto_front([_point("a", 1.2, 40.0), _point("d", 2.0, 38.0), _point("e", 3.0, 25.0)])
    assert [None if (r := front.best_at(frontier, t)) is None else r.name for t in (1.5, 2.0, 3.0, 3.5)] == \
        ["d", "d", "e", None]


def test_front_table_gives_each_family_its_best_psnr_and_worst_sample_per_target() -> None:
    rows = (quality.QualityRow(name="reference", family="reference", kind="reference", description="", x=None,
                               status="ok"),
            _point("a", 1.6, 40.0, psnr_min=31.0), _point("b", 2.2, 30.0, psnr_min=22.5))
    meta = dict(model_name="tiny", steps=28, classes=["x"], seeds=[100], device="cpu", dtype="float32")
    table = front.FrontReport(quality=quality.QualityReport(rows=rows, meta=meta)).table_rows()
    assert table == {"f": {
        "max_speedup": 2.2,
        "1.5": dict(name="a", x=None, flops_speedup=1.6, psnr_mean_db=40.0, psnr_min_db=31.0),
        "2": dict(name="b", x=None, flops_speedup=2.2, psnr_mean_db=30.0, psnr_min_db=22.5),
        "3": None}}


def test_fewer_steps_rows_for_the_28_and_14_step_schedules() -> None:
    assert [c.steps for c in front.fewer_steps_configs(28)] == [21, 18, 14, 11, 9]
    assert [c.steps for c in front.fewer_steps_configs(14)] == [10, 7, 5]


def test_extra_specs_come_from_a_json_file_of_spec_dicts(tmp_path: Path) -> None:
    spec = hookkit.Spec(cache=hookkit.DBCache(threshold=0.3, taylorseer_order=0))
    path = tmp_path / "specs.json"
    path.write_text(json.dumps([{"name": "new-rule", "family": "hookkit new", "x": 0.3, "spec": spec.to_dict()}]))
    (config,) = front.load_specs(path)
    assert (config.name, config.family, config.x, config.spec) == ("new-rule", "hookkit new", 0.3, spec)


def test_extra_specs_refuse_an_unknown_key(tmp_path: Path) -> None:
    path = tmp_path / "specs.json"
    path.write_text(json.dumps([{"name": "r", "spec": {}, "colour": "red"}]))
    with pytest.raises(SpecError, match=r"\[0\]: unknown key 'colour'"):
        front.load_specs(path)


def test_evaluation_seeds_must_be_held_out_from_the_tuning_seeds() -> None:
    with pytest.raises(SpecError, match=r"expected evaluation seeds >= 100 .* got \[3\]"):
        front.run_front(seeds=[3, 100], configs=[])
    with pytest.raises(SpecError, match=r"disjoint from the evaluation seeds, got \[100\]"):
        front.run_front(seeds=[100], calibration_seeds=[100], configs=[])


def test_a_model_other_than_tiny_needs_a_load_pipeline_that_takes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from hookkit.errors import UnsupportedError

    monkeypatch.setattr(trained, "load_pipeline", lambda device="cpu", dtype=torch.float32, path=None: None)
    with pytest.raises(UnsupportedError, match="load_pipeline takes no model= argument yet"):
        quality.TrainedModel(name="deep").pipeline()


@pytest.mark.slow
@pytest.mark.skipif(MISSING is not None, reason=MISSING or "")
def test_front_end_to_end_on_the_shipped_model(tmp_path: Path) -> None:
    """2 classes x 1 held-out seed, 8 steps: hookkit, diffusers' FirstBlockCache and 6 steps instead of 8."""
    configs = [quality.hookkit_config(hookkit.DBCache(threshold=0.3)), quality.fbcache_config(0.3),
               *front.fewer_steps_configs(8, counts=[6])]
    report = front.run_front(steps=8, classes=[0, 5], seeds=[100], configs=configs, log=None)
    ref, cached, fbc, fewer = report.quality.rows
    per_call = report.quality.meta["block_flops_per_call"]
    assert ref.block_flops == 2 * 8 * per_call and ref.flops_speedup == 1.0
    assert (fewer.steps, fewer.block_flops, fewer.flops_speedup) == (6, 2 * 6 * per_call, 8 / 6)
    assert fewer.psnr_mean_db < 100 and cached.status == fbc.status == "ok"
    assert set(report.table_rows()) == {"hookkit F1B0 TaylorSeer-1", "diffusers FirstBlockCache", "fewer steps"}
    paths = report.write(tmp_path, plot=importlib.util.find_spec("matplotlib") is not None)
    data = json.loads(paths["json"].read_text())
    assert [r["name"] for r in data["rows"]] == ["reference", "hookkit-F1B0-TS1-R0.3", "fbcache-R0.3", "steps-6"]
    assert data["fronts"]["fewer steps"] == ["steps-6"]


def test_rows_whose_decisions_read_no_image_run_in_one_batch_and_threshold_rows_alone() -> None:
    cal = hookkit.CacheCalibration(steps=4, gram=tuple(tuple(1.0 if i == j else 0.0 for j in range(4)) for i in range(4)))
    batched = [front.fewer_steps_configs(28, [14])[0], front.taylorseer_config(3, lite=True),
               quality.hookkit_config(hookkit.DBCache(steps_mask="fast", mask_policy="static")),
               quality.hookkit_config(hookkit.DBCache(rule="schedule", calibration=cal, speedup=2.0)),
               quality.cache_dit_config(0.08, steps_mask="fast", steps=28)]
    alone = [quality.hookkit_config(hookkit.DBCache(threshold=0.12)), quality.fbcache_config(0.12),
             quality.cache_dit_config(0.12), quality.cache_dit_config(0.08, steps_mask="fast", steps=28,
                                                                      mask_policy="dynamic")]
    assert [c.one_batch for c in batched] == [True] * 5
    assert [c.one_batch for c in alone] == [False] * 4


@pytest.mark.slow
@pytest.mark.skipif(MISSING is not None, reason=MISSING or "")
def test_a_row_run_in_one_batch_gives_each_sample_the_psnr_and_work_of_batch_one() -> None:
    configs = [front.taylorseer_config(3, lite=True), *front.fewer_steps_configs(8, counts=[6])]
    batched = quality.run_quality(configs, classes=[0, 5], seeds=[100], steps=8, log=None)
    alone = quality.run_quality([attrs.evolve(configs[0], batched=False)],
                                classes=[0, 5], seeds=[100], steps=8, log=None)
    lite, fewer = batched.rows[1:]
    lite_alone = alone.rows[1]
    assert (lite.batched, fewer.batched, lite_alone.batched) == (True, True, False)
    assert (lite.block_flops, lite.transformer_calls) == (lite_alone.block_flops, lite_alone.transformer_calls)
    assert lite.per_sample["psnr_db"] == pytest.approx(lite_alone.per_sample["psnr_db"], abs=0.01)
    assert fewer.block_flops == 2 * 6 * batched.meta["block_flops_per_call"]


def _front_file(path: Path, family: str, names: list[str], seeds: list[int] = [100]) -> Path:
    ref = quality.QualityRow(name="reference", family="reference", kind="reference", description="", x=None,
                             status="ok")
    rows = (ref, *[attrs.evolve(_point(n, 2.0, 40.0, psnr_min=35.0), family=family) for n in names])
    meta = dict(model_name="tiny", steps=28, classes=["x"], seeds=seeds, device="cpu", dtype="float32")
    path.mkdir()
    report = front.FrontReport(quality=quality.QualityReport(rows=rows, meta=meta))
    (path / "front.json").write_text(json.dumps(report.to_dict()))
    return path


def test_fronts_split_by_family_merge_into_one_report(tmp_path: Path) -> None:
    a = _front_file(tmp_path / "a", "fewer steps", ["steps-14"])
    b = _front_file(tmp_path / "b", "diffusers MagCache", ["magcache-R0.24", "magcache-R0.5"])
    merged = front.merge_fronts([a, b / "front.json"])
    assert [r.name for r in merged.quality.rows] == ["reference", "steps-14", "magcache-R0.24", "magcache-R0.5"]
    assert list(merged.table_rows()) == ["fewer steps", "diffusers MagCache"]


def test_merging_fronts_of_other_seeds_or_one_family_twice_is_refused(tmp_path: Path) -> None:
    a = _front_file(tmp_path / "a", "fewer steps", ["steps-14"])
    b = _front_file(tmp_path / "b", "fewer steps", ["steps-11"])
    c = _front_file(tmp_path / "c", "diffusers MagCache", ["magcache-R0.24"], seeds=[101])
    with pytest.raises(SpecError, match="family 'fewer steps' is in .*a/front.json and .*b/front.json"):
        front.merge_fronts([a, b])
    with pytest.raises(SpecError, match=r"c/front.json ran with other seeds \(\[101\]\) than the first \(\[100\]\)"):
        front.merge_fronts([a, c])


def test_front_main_merges_split_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    a = _front_file(tmp_path / "a", "fewer steps", ["steps-14"])
    b = _front_file(tmp_path / "b", "diffusers MagCache", ["magcache-R0.24"])
    merged = front.merge_fronts([a, b])
    monkeypatch.setattr(front.FrontReport, "write", lambda self, out, plot=True: {"json": Path(out) / "front.json"})
    assert front.front_main(["--merge", str(a), str(b), "--out", str(tmp_path / "m"), "--no-plot"]) == 0
    assert capsys.readouterr().out.startswith(merged.markdown())
