"""`hookkit.calibrate` and `hookkit.tune`: calibration from the user's calls, a Spec for a speed or quality target.

The arithmetic and the candidates' bookkeeping run on tiny random pipelines (fast); whether a tuned Spec meets its
target on seeds it did not see is judged on the shipped trained tiny Flux (marked slow).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import hookkit
from hookkit.errors import SpecError
from hookkit.tools import trained, zoo
from hookkit.tools.tune import _Replay, _measure, search


def flux_calls(seeds: tuple[int, ...] = (0, 1), steps: int = 6) -> list[dict[str, Any]]:
    return [zoo.call_kwargs("flux", steps=steps, seed=s) for s in seeds]


def images(pipe: Any, calls: list[dict[str, Any]]) -> list[torch.Tensor]:
    replay = _Replay(pipe, calls)
    return [replay.images(i) for i in range(len(calls))]


SPECS = [
    hookkit.DBCache(fn_blocks=0, steps_mask=(1, 1, 0, 1, 0, 1), mask_policy="static", taylorseer_order=0),
    hookkit.DBCache(fn_blocks=0, steps_mask=(1, 1, 0, 0, 0, 1), mask_policy="static", taylorseer_order=1),
]


def test_calibrate_records_a_ratio_and_a_gram_row_per_step_and_the_sigma_weights() -> None:
    pipe = zoo.tiny_pipeline("flux")
    calibration = hookkit.calibrate(pipe, flux_calls())
    assert (calibration.model, calibration.steps, calibration.calls) == ("FluxTransformer2DModel", 6, 2)
    assert len(calibration.ratios) == 6 and calibration.ratios[0] == 1.0
    assert len(calibration.gram) == 6 and all(calibration.gram[i][i] > 0 for i in range(6))
    sigmas = pipe.scheduler.sigmas.double()
    assert calibration.weights == pytest.approx((sigmas[:-1] - sigmas[1:]).abs().tolist(), rel=1e-12)


def test_calibrate_with_sensitivity_measures_each_steps_image_change_per_unit_of_residual_error() -> None:
    pipe = zoo.tiny_pipeline("flux")
    calls = flux_calls()
    replay = _Replay(pipe, calls)  # every run below draws the same noise
    calibration = hookkit.calibrate(pipe, calls, sensitivity=True)
    reference = [replay.images(i) for i in range(len(calls))]
    gram, t = calibration.gram, 3
    mask = (1, 1, 1, 0, 1, 1)  # only step 3 cached: step 2's residual reused, every block skipped
    hookkit.enable(pipe, hookkit.Spec(cache=hookkit.DBCache(fn_blocks=0, warmup_steps=0, steps_mask=mask,
                                                            mask_policy="static", taylorseer_order=0)))
    cached = [replay.images(i) for i in range(len(calls))]
    hookkit.disable(pipe)
    moved = math.sqrt(sum((c.double() - r.double()).pow(2).sum().item() for c, r in zip(cached, reference))
                      / sum(r.numel() for r in reference))
    error = math.sqrt(gram[t][t] - 2 * gram[t][t - 1] + gram[t - 1][t - 1])
    assert len(calibration.gains) == 6 and calibration.gains[0] == calibration.gains[1]
    assert calibration.gains[t] == pytest.approx(moved / error, rel=1e-9)


def test_calibrate_measures_no_gains_unless_asked() -> None:
    assert hookkit.calibrate(zoo.tiny_pipeline("flux"), flux_calls()).gains is None


def test_calibrate_refuses_a_sensitivity_that_is_no_bool() -> None:
    with pytest.raises(SpecError, match=r"^hookkit.calibrate.sensitivity: expected True or False, got 'yes'.$"):
        hookkit.calibrate(zoo.tiny_pipeline("flux"), flux_calls(), sensitivity="yes")  # type: ignore[arg-type]


def test_calibrate_with_sensitivity_leaves_the_pipeline_bitwise_stock() -> None:
    pipe = zoo.tiny_pipeline("flux")
    before = images(pipe, flux_calls())
    hookkit.calibrate(pipe, flux_calls(), sensitivity=True)
    assert hookkit.handle_of(pipe) is None
    assert all(torch.equal(a, b) for a, b in zip(before, images(pipe, flux_calls())))


def test_calibrate_leaves_the_pipeline_bitwise_stock() -> None:
    pipe = zoo.tiny_pipeline("flux")
    before = images(pipe, flux_calls())
    hookkit.calibrate(pipe, flux_calls())
    assert hookkit.handle_of(pipe) is None
    after = images(pipe, flux_calls())
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_calls_without_a_generator_are_refused_with_the_fix() -> None:
    call = zoo.call_kwargs("flux", steps=6)
    del call["generator"]
    with pytest.raises(SpecError, match=r"hookkit.tune.calls\[0\]: expected a `generator` \(or `latents`\)"):
        hookkit.tune(zoo.tiny_pipeline("flux"), [call], speedup=2.0, progress=False)


def test_calls_at_two_step_counts_are_refused() -> None:
    with pytest.raises(SpecError, match=r"expected one num_inference_steps for all calls"):
        hookkit.calibrate(zoo.tiny_pipeline("flux"), [zoo.call_kwargs("flux", steps=4), zoo.call_kwargs("flux", steps=6)])


def test_tune_needs_a_target() -> None:
    with pytest.raises(SpecError, match=r"hookkit.tune: expected a target, speedup=... \(e.g. 2.0\) or min_psnr="):
        hookkit.tune(zoo.tiny_pipeline("flux"), flux_calls(), progress=False)


def test_a_speedup_above_the_step_count_is_refused() -> None:
    with pytest.raises(SpecError, match=r"hookkit.tune.speedup: expected at most 6 .* for calls of 6 steps, got 7"):
        hookkit.tune(zoo.tiny_pipeline("flux"), flux_calls(), speedup=7.0, progress=False)


def test_a_quality_no_candidate_reaches_is_refused_with_what_was_reached() -> None:
    with pytest.raises(SpecError, match=r"expected a candidate with every PSNR >= 1000 dB, got none among 2 "
                                        r"\(fastest \d\.\d\dx, best min PSNR \d+\.\d\d dB\)"):
        search(zoo.tiny_pipeline("flux"), flux_calls(), min_psnr=1000.0, specs=SPECS)


def test_search_picks_the_best_psnr_at_the_speedup_and_the_fastest_above_the_psnr() -> None:
    pipe = zoo.tiny_pipeline("flux")
    result = search(pipe, flux_calls(), speedup=1.4, specs=SPECS)
    rows = {r.name: r for r in result.rows}
    assert [round(r.speedup, 4) for r in result.rows] == [round(6 / 4, 4), 2.0]  # 4 and 3 of 6 steps computed
    assert result.chosen is max(result.rows, key=lambda r: r.psnr_mean)
    fastest = search(pipe, flux_calls(), min_psnr=min(r.psnr_min for r in rows.values()), specs=SPECS)
    assert fastest.chosen.speedup == 2.0
    assert "* " in fastest.table() and "speed-up" in fastest.table()


def test_search_is_deterministic_and_leaves_the_pipeline_bitwise_stock() -> None:
    pipe = zoo.tiny_pipeline("flux")
    before = images(pipe, flux_calls())
    first = search(pipe, flux_calls(), speedup=1.4, specs=SPECS)
    second = search(pipe, flux_calls(), speedup=1.4, specs=SPECS)
    assert first.rows == second.rows and first.chosen == second.chosen
    after = images(pipe, flux_calls())
    assert hookkit.handle_of(pipe) is None
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_a_tuned_schedule_spec_runs_again_from_its_json_dict() -> None:
    import json

    pipe = zoo.tiny_pipeline("flux")
    spec = hookkit.tune(pipe, flux_calls(), speedup=2.0, progress=False)
    again = hookkit.Spec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert again == spec
    handle = hookkit.enable(pipe, again)
    pipe(**zoo.call_kwargs("flux", steps=6, seed=5))
    data = handle.summary().features["cache"].data
    assert data["block_calls_uncached"] / data["block_calls"] >= 2.0


@pytest.mark.slow
def test_the_tuned_spec_reaches_its_speedup_and_beats_fewer_steps_on_held_out_seeds() -> None:
    """Tuned on seeds 10-11 of the trained model, judged on seeds 100-101 that it never saw."""
    pipe = trained.load_pipeline()
    steps = 14
    tune_calls = [trained.call_kwargs([0, 3, 6], [10, 10, 10], steps=steps),
                  trained.call_kwargs([1, 4, 8], [11, 11, 11], steps=steps)]
    spec = hookkit.tune(pipe, tune_calls, speedup=2.0, progress=False)
    held = [trained.call_kwargs([2, 5, 9], [100, 100, 100], steps=steps),
            trained.call_kwargs([7, 0, 4], [101, 101, 101], steps=steps)]
    replay = _Replay(pipe, held)  # both snapshot the generators before any run: the same noise for all three
    fewer = _Replay(pipe, [dict(c, num_inference_steps=steps // 2) for c in held])
    reference = [replay.images(i) for i in range(2)]
    speedup, psnrs = _measure(replay, spec.cache, reference)
    fewer_psnrs = [10 * math.log10(1 / (fewer.images(i).double() - reference[i].double()).pow(2)[j].mean().item())
                   for i in range(2) for j in range(3)]
    assert speedup >= 2.0
    assert sum(psnrs) / len(psnrs) > sum(fewer_psnrs) / len(fewer_psnrs) + 1.0


@pytest.mark.slow  # bench runs its rows as subprocesses
def test_cli_tune_writes_a_spec_that_generate_and_bench_run(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from hookkit.tools import cli

    spec_path = tmp_path / "spec.json"
    assert cli.main(["tune", "--speedup", "2", "--seeds", "10", "--steps", "6", "--json", str(spec_path)]) == 0
    assert "chosen: schedule 2x F0" in capsys.readouterr().out
    spec = hookkit.Spec.from_dict(__import__("json").loads(spec_path.read_text()))
    assert (spec.cache.rule, spec.cache.speedup, spec.cache.calibration.steps) == ("schedule", 2.0, 6)
    assert cli.main(["generate", "flux", "--spec", str(spec_path), "--steps", "6", "--out", str(tmp_path / "x.png")]) == 0


def test_cli_generate_refuses_a_spec_file_beside_spec_flags(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from hookkit.tools import cli

    path = tmp_path / "spec.json"
    path.write_text(__import__("json").dumps(hookkit.Spec(memo=True).to_dict()))
    assert cli.main(["generate", "flux", "--spec", str(path), "--cache", "--out", str(tmp_path / "x.png")]) == 2
    assert "--spec " + str(path) + ": the file gives the whole Spec, got --cache beside it" in capsys.readouterr().err


def test_cli_bench_refuses_a_spec_file_that_is_no_json(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from hookkit.tools import cli

    path = tmp_path / "spec.json"
    path.write_text("{not json")
    assert cli.main(["bench", "--spec", str(path)]) == 2
    assert f"--spec {path}: expected a JSON file of a hookkit Spec" in capsys.readouterr().err


def test_cli_calibrate_writes_a_calibration_the_rules_load(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from hookkit.tools import cli

    path = tmp_path / "cal.json"
    assert cli.main(["calibrate", "--seeds", "10", "--steps", "4", "--json", str(path)]) == 0
    calibration = hookkit.CacheCalibration.load(path)
    assert (calibration.model, calibration.steps, calibration.calls) == ("FluxTransformer2DModel", 4, 1)
    assert f"written to {path}" in capsys.readouterr().out
    hookkit.DBCache(rule="schedule", calibration=calibration, speedup=2.0)  # a rule takes it as it is
