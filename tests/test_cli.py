"""The `hookkit` command line: `demo` and `generate` on tiny models, on the CPU, no downloads.

`generate` runs in-process through `hookkit.tools.cli.main(argv)` (the console script's entry point), which
returns the exit code; `demo` runs as `python -m hookkit demo` in a subprocess, as a user would.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

import hookkit
from hookkit.tools import bench, cli, zoo
from hookkit.errors import SpecError

HAVE = bench.available_fields()
REPO = Path(__file__).resolve().parent.parent


def test_every_spec_feature_is_installed() -> None:
    assert HAVE == {"attention", "cache", "compile", "memo", "parallel", "quantize", "sync_free"}


def generate(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(["generate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


# --- demo ----------------------------------------------------------------------------------------------


def test_demo_spec_is_the_measured_dbcache_default_and_the_sync_free_loop() -> None:
    from hookkit.tools import demo

    assert demo.demo_spec() == hookkit.Spec(cache=hookkit.DBCache(), sync_free=True)


def test_demo_model_deep_draws_with_the_16_block_trained_model(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    try:
        code = cli.main(["demo", "--model", "deep", "--steps", "3", "--classes", "red circle", "--out",
                         str(tmp_path / "d.png")])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert code == 0
    assert out.startswith("hookkit demo: hookkit's trained deep Flux (stock FluxPipeline, 3 steps, 32x32")
    assert "DBCache F0B0 (middle 16 of 16 blocks), schedule 2x, no calibration (spacing 1.7, last 1)" in out


def test_demo_refuses_an_unknown_model_naming_the_image_models(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--model", "huge"]) == 2
    assert "hookkit demo --model: expected an image model (tiny or deep), got 'huge'." in capsys.readouterr().err


# --- generate: what runs on the CPU writes its file ---------------------------------------------------------


def test_generate_plain_writes_a_png_of_the_requested_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "flux.png"
    code, stdout, _ = generate(capsys, "flux", "--steps", "2", "--height", "48", "--width", "32", "--out", str(out))
    assert code == 0
    assert Image.open(out).size == (32, 48)
    assert "- Optimization: eager" in stdout
    assert "- Input: 48x32, 2 steps, batch 1, seed 0" in stdout
    assert f"- Saved: {out}" in stdout
    for label in ("Load Time", "Enable Time", "Warmup Time", "Inference Time"):
        assert re.search(rf"^- {label}: \d+\.\d\ds", stdout, re.MULTILINE), label
    assert re.search(r"^- Device: CPU \(\d+ threads?\), float32$", stdout, re.MULTILINE)


def test_generate_of_a_tiny_model_on_the_cpu_says_its_timings_are_no_performance_claim(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, stdout, _ = generate(capsys, "flux", "--steps", "2", "--out", str(tmp_path / "t.png"))
    assert code == 0
    assert re.search(r"^- Inference Time: \d+\.\d\ds\n- Note: CPU, tiny model: timings are not a performance claim; "
                     r"run on a GPU with --full\.$", stdout, re.MULTILINE)


def test_generate_default_file_name_says_model_size_and_optimization(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    code, _, _ = generate(capsys, "qwenimage", "--steps", "2")
    assert code == 0
    assert [p.name for p in tmp_path.iterdir()] == ["qwenimage.32x32.eager.png"]


def test_generate_batch_writes_one_file_per_image(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, _ = generate(capsys, "flux", "--steps", "2", "--batch", "2", "--out", str(tmp_path / "b.png"))
    assert code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b_0.png", "b_1.png"]


def test_generate_summary_flag_prints_the_handle_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, stdout, _ = generate(capsys, "flux", "--steps", "2", "--summary", "--out", str(tmp_path / "s.png"))
    assert code == 0
    assert "hookkit summary: FluxTransformer2DModel in FluxPipeline" in stdout
    assert "adapter: flux" in stdout


def test_generate_cache_with_static_mask_reports_cached_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "c.png"
    code, stdout, _ = generate(capsys, "flux", "--steps", "6", "--cache", "--cache-mask", "fast", "--cache-mode", "static",
                               "--out", str(out))
    assert code == 0 and out.is_file()
    mask = hookkit.techniques.cache.spec.resolve_steps_mask("fast", 6)
    cached = [i for i, m in enumerate(mask) if m == 0]
    assert f"- Cached Steps: {len(cached)} of 6 transformer steps, steps {cached}" in stdout
    assert "- Optimization: DBCache_F1B0_W0MC-1_R0.24_SCM-fast-static" in stdout


def test_generate_every_cache_flag_reaches_the_dbcache_spec() -> None:
    args = cli.build_parser().parse_args([
        "generate", "flux", "--cache", "--cache-fn", "2", "--cache-bn", "1", "--cache-threshold", "0.3",
        "--cache-warmup", "2", "--cache-max-continuous", "1", "--cache-taylorseer", "2", "--cache-mask", "medium"])
    assert cli.spec_from_args(args).cache == hookkit.DBCache(
        fn_blocks=2, bn_blocks=1, threshold=0.3, warmup_steps=2, max_continuous_cached_steps=1, taylorseer_order=2,
        steps_mask="medium", mask_policy="dynamic")


def test_generate_runs_with_every_cache_flag_and_names_them_in_the_tag(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    code, stdout, _ = generate(capsys, "flux", "--steps", "4", "--cache", "--cache-fn", "2", "--cache-bn", "1",
                               "--cache-threshold", "0.3", "--cache-warmup", "2", "--cache-max-continuous", "1",
                               "--cache-taylorseer", "2", "--out", str(tmp_path / "c.png"))
    assert code == 0 and (tmp_path / "c.png").is_file()
    assert "- Optimization: DBCache_F2B1_W2MC1_R0.3_TS2\n" in stdout


def test_generate_same_seed_same_image_other_seed_other_image(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    paths = {name: tmp_path / f"{name}.png" for name in ("a", "b", "c")}
    for name, seed in (("a", "3"), ("b", "3"), ("c", "4")):
        code, stdout, _ = generate(capsys, "flux", "--steps", "2", "--seed", seed, "--out", str(paths[name]))
        assert code == 0 and f"batch 1, seed {seed}" in stdout
    pixels = {name: Image.open(path).tobytes() for name, path in paths.items()}
    assert pixels["a"] == pixels["b"]
    assert pixels["a"] != pixels["c"]


@pytest.mark.parametrize(("warmup", "line"), [("0", "(0 runs; none needed without --compile)"), ("1", "(1 run)"),
                                             ("2", "(2 runs)")])
def test_generate_warmup_runs_are_counted_in_the_summary(warmup: str, line: str, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    code, stdout, _ = generate(capsys, "flux", "--steps", "2", "--warmup", warmup, "--out", str(tmp_path / "w.png"))
    assert code == 0
    assert re.search(rf"^- Warmup Time: \d+\.\d\ds {re.escape(line)}$", stdout, re.MULTILINE)


def test_generate_threads_and_dtype_show_in_the_device_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    try:
        code, stdout, _ = generate(capsys, "flux", "--steps", "2", "--threads", "1", "--dtype", "bfloat16",
                                   "--device", "cpu", "--out", str(tmp_path / "t.png"))
    finally:
        torch.set_num_threads(threads)  # --threads applies to this process
    assert code == 0 and (tmp_path / "t.png").is_file()
    assert "- Device: CPU (1 thread), bfloat16" in stdout


def test_generate_cache_on_the_6_step_tiny_model_caches_with_the_dbcache_defaults(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "d.png"
    code, stdout, _ = generate(capsys, "flux", "--steps", "6", "--cache", "--out", str(out))
    assert code == 0 and out.is_file()
    # the README's first command: DBCache(), 3 of 6 steps computed (0, 2, 5), every block skipped on the others
    assert "- Cached Steps: 3 of 6 transformer steps, steps [1, 3, 4]; block calls run: 15 of 30" in stdout
    assert "- Optimization: DBCache_F0B0_WautoMC-1_schedule2x_TS2\n" in stdout


def test_generate_cache_flags_default_to_dbcache_defaults() -> None:
    args = cli.build_parser().parse_args(["generate", "flux", "--cache"])
    assert cli.spec_from_args(args).cache == hookkit.DBCache()


def test_generate_warmup_covering_every_step_says_why_nothing_was_cached(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    code, stdout, _ = generate(capsys, "flux", "--steps", "4", "--cache", "--cache-threshold", "0.24", "--cache-warmup",
                               "8", "--summary", "full",
                               "--out", str(tmp_path / "w.png"))
    assert code == 0
    assert "- Cached Steps: 0 of 4 transformer steps: warm-up covered all 4 (warmup_steps=8)\n" in stdout
    assert "no step cached: warmup_steps=8 covers all 4 steps of this call" in stdout


def test_generate_int8_weight_only_reports_the_quantized_layers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = hookkit.Spec(quantize=hookkit.Quantize(scheme="int8_weight_only"))
    expected = hookkit.enable(zoo.tiny_pipeline("flux"), spec).summary().features["quantize"].data
    out = tmp_path / "q.png"
    code, stdout, _ = generate(capsys, "flux", "--steps", "2", "--quantize", "int8_weight_only", "--out", str(out))
    assert code == 0 and out.is_file()
    assert (f"- Quantized Linear Layers: {expected['quantized']} int8_weight_only, skipped {expected['skipped']}, "
            f"total {expected['total']}") in stdout


def test_generate_memo(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "m.png"
    code, stdout, _ = generate(capsys, "qwenimage", "--steps", "3", "--memo", "--out", str(out))
    assert code == 0 and out.is_file()
    assert re.search(r"^- Memoized Tensors: \d+ hits, \d+ misses \(prologue scope\)$", stdout, re.MULTILINE)


def test_generate_sync_free_on_a_video_model_writes_a_gif(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    frames = zoo.tiny_pipeline("cogvideox")(**zoo.call_kwargs("cogvideox", steps=2, output_type="pil")).frames[0]
    out = tmp_path / "v.gif"
    code, stdout, _ = generate(capsys, "cogvideox", "--steps", "2", "--sync-free", "--out", str(out))
    assert code == 0
    assert Image.open(out).n_frames == len(frames)
    assert "- Sync-free Loop: CogVideoXDDIMScheduler, timestep reads answered on the host: " in stdout


def test_generate_video_with_png_out_writes_one_png_per_frame(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    frames = zoo.tiny_pipeline("wan")(**zoo.call_kwargs("wan", steps=2, output_type="pil")).frames[0]
    code, _, _ = generate(capsys, "wan", "--steps", "2", "--out", str(tmp_path / "w.png"))
    assert code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"w.frame{i:03d}.png" for i in range(len(frames))]


def test_generate_frames_sets_the_length_of_the_video(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "w.gif"
    code, stdout, _ = generate(capsys, "wan", "--frames", "9", "--steps", "2", "--out", str(out))
    assert code == 0
    assert Image.open(out).n_frames == 9
    assert "- Input: 16x16, 9 frames, 2 steps, batch 1, seed 0" in stdout


@pytest.mark.slow
def test_generate_compile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "k.png"
    code, stdout, _ = generate(capsys, "flux", "--steps", "2", "--compile", "--out", str(out))
    assert code == 0 and out.is_file()
    blocks = zoo.TINY_CONFIGS["flux"]["num_layers"] + zoo.TINY_CONFIGS["flux"]["num_single_layers"]
    assert f"- Compiled: {blocks} regions, mode default" in stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU's summary line")
def test_generate_reduce_overhead_on_the_cpu_says_no_cuda_graphs_run(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    code, stdout, _ = generate(capsys, "flux", "--steps", "2", "--compile", "--compile-mode", "reduce-overhead",
                               "--out", str(tmp_path / "r.png"))
    assert code == 0
    blocks = zoo.TINY_CONFIGS["flux"]["num_layers"] + zoo.TINY_CONFIGS["flux"]["num_single_layers"]
    assert f"- Compiled: {blocks} regions, mode reduce-overhead (no CUDA graphs on this device)\n" in stdout


def test_generate_model_path_loads_a_local_folder_without_text_encoders(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "tiny-flux"
    zoo.tiny_pipeline("flux").save_pretrained(folder)
    out = tmp_path / "local.png"
    code, stdout, _ = generate(capsys, "flux", "--model-path", str(folder), "--steps", "2", "--height", "32",
                               "--width", "32", "--out", str(out))
    assert code == 0
    assert Image.open(out).size == (32, 32)
    assert f"local pipeline {folder}, no text encoder: random prompt embeddings" in stdout


def test_generate_model_path_of_another_family_names_both(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "tiny-flux"
    zoo.tiny_pipeline("flux").save_pretrained(folder)
    code, _, stderr = generate(capsys, "wan", "--model-path", str(folder), "--out", str(tmp_path / "x.png"))
    assert code == 2
    assert (f"MODEL 'wan': its adapter is for ['WanTransformer3DModel'], but {str(folder)!r} holds FluxPipeline with "
            "FluxTransformer2DModel. Pass MODEL 'flux' (or the folder alone).") in stderr


# --- generate: what cannot run here fails with hookkit's message and exit code 2 --------------------------------


@pytest.mark.parametrize(("argv", "message"), [
    (["flux", "--device", "cuda"], "--device cuda: no CUDA device is visible"),
    (["sd3"], "no tiny pipeline for sd3 yet (random-weight pipelines, tiny and --full, exist for ['cogvideox', "
              "'flux', 'hunyuanvideo15', 'qwenimage', 'wan'])"),
    (["hunyuanvideo"], "no tiny pipeline for hunyuanvideo yet"),
    (["hunyuanvideo", "--full"], "no full-size pipeline for hunyuanvideo yet"),
    (["nosuchmodel"], "MODEL: expected a shipped adapter name"),
    (["flux", "--cache-mask", "fast"], "--cache-mask fast: only with --cache"),
    (["flux", "--steps", "0"], "--steps: expected an int >= 1, got 0"),
    (["flux", "--cache", "--cache-threshold", "-1"], "DBCache.threshold: expected a number >= 0.0 or None, got -1.0"),
    (["flux", "--full", "--model-path", "/nonexistent"], "--full: builds a random-weight architecture"),
    (["flux", "--model-path", "/nonexistent"], "--model-path: expected a local pipeline folder"),
    (["flux", "--model-path", "/"], "--model-path '/': expected a diffusers pipeline folder with a readable "
                                    "model_index.json"),
    (["flux", "--prompt", "a red fox"], "--prompt 'a red fox': only with --model-path (a local pipeline with text "
                                        "encoders); tiny and --full models get random prompt embeddings. Drop "
                                        "--prompt or add --model-path."),
    (["flux", "--threads", "0"], "--threads: expected an int >= 1, got 0."),
])
def test_generate_errors_exit_2_with_a_clear_message(argv: list[str], message: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    code, stdout, stderr = generate(capsys, *argv, "--out", str(tmp_path / "x.png"))
    assert code == cli.EXIT_ERROR == 2
    assert stderr.startswith("hookkit generate: error: ")
    assert message in stderr
    assert "Traceback" not in stderr and stdout == ""
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_generate_cuda_graphs_on_the_cpu_says_it_in_cli_terms(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    code, _, stderr = generate(capsys, "flux", "--cuda-graphs", "--out", str(tmp_path / "x.png"))
    assert code == 2
    assert stderr == ("hookkit generate: error: --cuda-graphs: captures CUDA graphs and needs a CUDA device; this run "
                      "is on cpu. Drop --cuda-graphs (--compile alone compiles the repeated blocks here).\n")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_generate_fp8_on_the_cpu_fails_with_the_library_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, stderr = generate(capsys, "flux", "--quantize", "fp8_row", "--dtype", "bfloat16", "--out", str(tmp_path / "x.png"))
    assert code == 2
    assert "--quantize fp8_row needs an NVIDIA GPU with compute capability 8.9" in stderr


def test_unknown_choice_is_an_argparse_error_with_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["generate", "flux", "--quantize", "int3"])
    assert exc.value.code == 2
    assert "argument --quantize: invalid choice: 'int3'" in capsys.readouterr().err



def test_generate_suggests_the_closest_model_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["generate", "fluxx"]) == 2
    assert capsys.readouterr().err.endswith("got 'fluxx'. Did you mean 'flux'?\n")


def test_bench_names_its_model_flag_not_generates_positional(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "--model", "sd3", "--device", "cpu"]) == 2
    assert capsys.readouterr().err.startswith("hookkit bench: error: --model 'sd3': no tiny pipeline for sd3 yet")


def _generate_help(capsys: pytest.CaptureFixture[str]) -> str:
    """`generate --help`, its whitespace folded (argparse wraps to the terminal's width)."""
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    return " ".join(capsys.readouterr().out.split())


def test_generate_help_says_which_models_run_without_model_path(capsys: pytest.CaptureFixture[str]) -> None:
    help_text = _generate_help(capsys)
    assert "a model family that runs as is, with random weights (cogvideox, flux, hunyuanvideo15, qwenimage, wan); another shipped " \
           "adapter name (chroma, cogview4," in help_text
    assert "zimage) with --model-path" in help_text


def test_generate_help_describes_the_default_cache_as_the_planned_rule(capsys: pytest.CaptureFixture[str]) -> None:
    help_text = _generate_help(capsys)
    assert "--cache hookkit.DBCache(): the calibration-free planned rule, 2x less block work, TaylorSeer 2; " \
           "--cache-threshold or --cache-mask picks the threshold rule (F1B0, threshold 0.24, TaylorSeer 1)" in help_text
    assert "measured defaults" not in help_text


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_a_tiny_model_on_the_cpu_uses_one_thread_unless_threads_says_otherwise(command: str) -> None:
    threads = torch.get_num_threads()
    model = ["flux"] if command == "generate" else ["--model", "flux"]
    try:
        default = cli.build_parser().parse_args([command, *model, "--device", "cpu"])
        chosen = cli.build_parser().parse_args([command, *model, "--device", "cpu", "--threads", "2"])
        assert (cli._model_options(default, "flux").threads, cli._model_options(chosen, "flux").threads) == (1, 2)
    finally:
        torch.set_num_threads(threads)


def test_adapter_derive_says_when_a_shipped_adapter_exists_for_the_class(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["adapter", "derive", "FluxTransformer2DModel"]) == 0
    out, err = capsys.readouterr()
    assert err == ("hookkit adapter derive: a shipped adapter exists for FluxTransformer2DModel: 'flux' "
                   "(hookkit.get_adapter('flux'); enable uses it). The derived adapter follows.\n")
    assert "[[blocks]]" in out


# --- the pieces ------------------------------------------------------------------------------------------


def test_the_cli_quiets_torchs_cache_hash_warning_about_torchaos_quantized_weights() -> None:
    import warnings

    message = "Int8Tensor does not implement _stable_hash_for_caching. For PT2-compatible tensor subclasses, ..."
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli._quiet_third_party()  # what every command but `-v` ones runs first
        warnings.warn(message, UserWarning)
        warnings.warn("another UserWarning", UserWarning)
    assert [str(w.message) for w in caught] == ["another UserWarning"]


def test_optimization_tag_names_every_feature() -> None:
    spec = hookkit.Spec(cache=hookkit.DBCache(fn_blocks=2, bn_blocks=1, threshold=0.1, warmup_steps=4,
                                              max_continuous_cached_steps=2),
                        quantize=hookkit.Quantize(scheme="fp8_row"),
                        compile=hookkit.Compile(regional=True, mode="reduce-overhead", cuda_graphs="transformer"),
                        memo=True, sync_free=True)
    assert cli.optimization_tag(spec) == \
        "DBCache_F2B1_W4MC2_R0.1_TS1_fp8_row_compile-reduce-overhead-regional_cudagraphs_memo_syncfree"
    assert cli.optimization_tag(hookkit.Spec()) == "eager"


def test_console_script_entry_point_is_cli_main() -> None:
    import tomllib

    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert data["project"]["scripts"]["hookkit"] == "hookkit.tools.cli:main"


def test_bench_quality_hands_over_to_the_quality_harness(capsys: pytest.CaptureFixture[str]) -> None:
    from hookkit.tools.cli import main

    assert main(["bench", "--quality", "--list"]) == 0
    out = capsys.readouterr().out
    assert "| hookkit-F1B0-R0.12" in out and "| fbcache-R0.12" in out


@pytest.mark.parametrize("flags", [["--cache-threshold", "0.2"], ["--cache-fn", "3"], ["--cache-mode", "static"],
                                   ["--cache-fn", "1"], ["--cache-bn", "0"], ["--cache-mode", "dynamic"],
                                   ["--cache-taylorseer", "0"], ["--cache-warmup", "2"]])
def test_generate_refuses_cache_flags_without_cache(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["generate", "flux", "--steps", "2", *flags])
    assert code == 2
    assert f"hookkit generate: error: {flags[0]} {flags[1]}: only with --cache. Add --cache." in capsys.readouterr().err


def test_generate_refuses_a_compile_mode_without_compile(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["generate", "flux", "--steps", "2", "--compile-mode", "max-autotune"])
    assert code == 2
    assert ("hookkit generate: error: --compile-mode max-autotune: only with --compile or --cuda-graphs. "
            "Add --compile.") in capsys.readouterr().err


def test_verbose_flag_before_bench_quality_still_runs_the_quality_harness(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:  # argparse's --help exits
        cli.main(["-v", "bench", "--quality", "--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("usage: hookkit bench --quality")


def test_merge_of_a_missing_file_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.json"
    assert cli.main(["bench", "--merge", str(missing)]) == 2
    assert (f"hookkit bench: error: --merge {missing}: no such file; expected a JSON file written by "
            "`hookkit bench --json`.") in capsys.readouterr().err


def test_merge_of_a_json_that_is_not_a_bench_report_is_a_clear_error(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    other = tmp_path / "other.json"
    other.write_text('{"rows": []}')
    assert cli.main(["bench", "--merge", str(other)]) == 2
    assert (f"--merge {other}: expected a JSON file written by `hookkit bench --json`, but it has no 'command' "
            "key.") in capsys.readouterr().err


def test_generate_refuses_an_out_file_pil_cannot_write_before_generating(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "image"
    assert cli.main(["generate", "flux", "--steps", "2", "--out", str(out)]) == 2
    assert (f"--out {out}: expected a file name ending in an image format PIL writes (.png, .jpg, .webp, .gif, "
            f"...), got suffix 'none'. Add one, e.g. image.png.") in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_random_prompt_embeddings_exist_only_for_the_models_hookkit_knows() -> None:
    from hookkit.errors import UnsupportedError

    opts = bench.ModelOptions(name="sd3", model_path="/models/sd3-no-text-encoders")
    with pytest.raises(UnsupportedError, match=r"sd3: the pipeline in /models/sd3-no-text-encoders has no text "
                                               r"encoder, and hookkit makes random prompt embeddings only for "
                                               r"\['cogvideox', 'flux', 'hunyuanvideo15', 'qwenimage', 'wan'\]"):
        bench._embedding_call_kwargs(object(), opts, steps=2, output_type="pil")


# --- generate for a local pipeline folder: checks before the load, flags that reach the call ---------


@pytest.fixture(scope="module")
def flux_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local FluxPipeline folder saved without text encoders, as `save_pretrained` writes it."""
    folder = tmp_path_factory.mktemp("local") / "tiny-flux"
    zoo.tiny_pipeline("flux").save_pretrained(folder)
    return folder


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Counts `DiffusionPipeline.from_pretrained` calls (and still loads): the one thing these tests observe
    of the loader."""
    from diffusers import DiffusionPipeline

    calls: list[str] = []
    original = DiffusionPipeline.from_pretrained.__func__

    def counting(cls: type, path: str, *args: object, **kwargs: object) -> object:
        calls.append(str(path))
        return original(cls, path, *args, **kwargs)

    monkeypatch.setattr(DiffusionPipeline, "from_pretrained", classmethod(counting))
    return calls


def test_generate_reads_model_from_the_folder(flux_folder: Path, tmp_path: Path, loads: list[str],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    code, stdout, stderr = generate(capsys, str(flux_folder), "--steps", "2", "--out", str(tmp_path / "a.png"))
    assert code == 0, stderr
    assert loads == [str(flux_folder)]
    assert "- Model: flux (FluxTransformer2DModel in FluxPipeline)\n" in stdout
    assert f"- Weights: local pipeline {flux_folder}, no text encoder: random prompt embeddings\n" in stdout
    assert "timings are not a performance claim" not in stdout  # a real model's timings, if on the CPU


@pytest.mark.parametrize(("argv", "message"), [
    (["qwenimage", "--model-path", "{folder}"], "MODEL 'qwenimage': its adapter is for ['QwenImageTransformer2DModel']"),
    (["{folder}", "--prompt", "a red fox"], "--prompt 'a red fox': '{folder}' was saved without text encoders"),
    (["{folder}", "--negative-prompt", "blurry"], "--negative-prompt 'blurry': '{folder}' was saved without text"),
    (["{folder}", "--quantize", "fp8_row", "--dtype", "bfloat16"], "--quantize fp8_row needs an NVIDIA GPU"),
    (["{folder}", "--cpu-offload", "model"], "--cpu-offload model: offloads to the CPU from a CUDA device"),
    (["{folder}", "--lora", "/nonexistent/lora.safetensors:0.8"], "--lora /nonexistent/lora.safetensors: no such file"),
    (["{folder}", "--num-images", "0"], "--num-images: expected an int >= 1, got 0"),
    (["{folder}", "--cuda-graphs"], "--cuda-graphs: captures CUDA graphs and needs a CUDA device"),
])
def test_generate_refuses_before_loading_the_folder(argv: list[str], message: str, flux_folder: Path, tmp_path: Path,
                                                    loads: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available() and ("--quantize" in argv or "--cpu-offload" in argv or "--cuda-graphs" in argv):
        pytest.skip("checks a CPU-only refusal")
    argv = [a.replace("{folder}", str(flux_folder)) for a in argv]
    code, _, stderr = generate(capsys, *argv, "--steps", "2", "--out", str(tmp_path / "x.png"))
    assert code == 2
    assert message.replace("{folder}", str(flux_folder)) in stderr
    assert loads == []  # refused from model_index.json and the flags alone


@pytest.mark.parametrize("flag", ["--model", "MODEL"], ids=["bench", "generate"])
def test_a_folder_of_another_family_is_refused_naming_the_commands_model_flag(flux_folder: Path, flag: str) -> None:
    opts = bench.ModelOptions(name="qwenimage", model_path=str(flux_folder))
    with pytest.raises(SpecError) as error:
        bench.load_pipeline(opts) if flag == "--model" else bench.load_pipeline(opts, flag)
    assert str(error.value) == (f"--model-path {str(flux_folder)!r}: holds FluxPipeline with FluxTransformer2DModel; "
                                f"{flag} 'qwenimage' is for ['QwenImageTransformer2DModel']. Pass the matching {flag} name.")


def _folder_whose_transformer_names(tmp_path: Path, flux_folder: Path, library: str) -> tuple[Path, Path]:
    """A copy of `flux_folder` whose model_index.json gives the transformer as [library, "FluxTransformer2DModel"], and
    the marker file that importing a module of that name writes (one is put on sys.path and one in transformer/)."""
    import json
    import shutil

    folder = tmp_path / "folder"
    shutil.copytree(flux_folder, folder)
    index = json.loads((folder / "model_index.json").read_text())
    index["transformer"] = [library, "FluxTransformer2DModel"]
    (folder / "model_index.json").write_text(json.dumps(index))
    marker = tmp_path / "imported"
    code = f"open({str(marker)!r}, 'w').close()\nfrom diffusers import FluxTransformer2DModel\n"
    (tmp_path / "importable" / library).mkdir(parents=True)
    (tmp_path / "importable" / library / "__init__.py").write_text(code)
    (folder / "transformer" / f"{library}.py").write_text(code)
    return folder, marker


def test_generate_refuses_a_folder_naming_a_library_outside_diffusers_before_loading(
        flux_folder: Path, tmp_path: Path, loads: list[str], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    folder, marker = _folder_whose_transformer_names(tmp_path, flux_folder, "evil_pkg")
    (folder / "transformer" / "evil_pkg.py").unlink()  # only the package on sys.path
    monkeypatch.syspath_prepend(str(tmp_path / "importable"))
    code, _, stderr = generate(capsys, str(folder), "--out", str(tmp_path / "x.png"))
    assert (code, loads, marker.exists(), "evil_pkg" in sys.modules) == (2, [], False, False)
    assert stderr == (
        f"hookkit generate: error: --model-path '{folder}': model_index.json's 'transformer' is ['evil_pkg', "
        "'FluxTransformer2DModel']; expected a class of a library diffusers loads components from (diffusers, "
        "transformers, onnxruntime.training), got library 'evil_pkg': loading it would import 'evil_pkg' and run its "
        "code; nothing was imported. If you trust that module, import it and load the pipeline in Python, then pass it "
        "to hookkit.enable.\n")


def test_generate_refuses_a_folder_shipping_component_code_before_loading(
        flux_folder: Path, tmp_path: Path, loads: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    folder, marker = _folder_whose_transformer_names(tmp_path, flux_folder, "evil_pkg")
    code, _, stderr = generate(capsys, "--model-path", str(folder), "--out", str(tmp_path / "x.png"))
    assert (code, loads, marker.exists()) == (2, [], False)
    assert stderr == (
        f"hookkit generate: error: --model-path '{folder}': model_index.json's 'transformer' is ['evil_pkg', "
        "'FluxTransformer2DModel']; expected a class of an installed library, got custom code the folder ships "
        "(transformer/evil_pkg.py): loading it would run that file; nothing was loaded. If you trust it, load the "
        "pipeline in Python (DiffusionPipeline.from_pretrained(folder, trust_remote_code=True)) and pass it to "
        "hookkit.enable.\n")


def test_a_model_index_that_is_no_json_object_is_refused_naming_the_folder(tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "model_index.json").write_text("[1, 2]")
    code, _, stderr = generate(capsys, str(tmp_path))
    assert code == 2
    assert stderr == (f"hookkit generate: error: --model-path '{tmp_path}': expected a model_index.json holding one "
                      "JSON object (component name -> [library, class]), got a list. Pass a folder `save_pretrained` "
                      "wrote.\n")


def test_weights_that_do_not_fit_are_refused_from_the_safetensors_headers(flux_folder: Path) -> None:
    from hookkit.errors import UnsupportedError
    from hookkit.tools import local

    sizes = local.weight_bytes(flux_folder, torch.float32)
    expected = {"transformer": 4 * sum(p.numel() for p in zoo.tiny_transformer("flux").parameters())}
    assert sizes["transformer"] == expected["transformer"] and set(sizes) == {"transformer", "vae"}
    total = sum(sizes.values())
    local.check_fits(flux_folder, torch.float32, torch.device("cuda"), total, offload=None)  # fits exactly
    with pytest.raises(UnsupportedError, match=r"its weights need .* Add --cpu-offload model"):
        local.check_fits(flux_folder, torch.float32, torch.device("cuda"), total - 1, offload=None)
    # model offload needs room for the largest component only; sequential for none
    local.check_fits(flux_folder, torch.float32, torch.device("cuda"), max(sizes.values()), offload="model")
    local.check_fits(flux_folder, torch.float32, torch.device("cuda"), 0, offload="sequential")


def test_generate_refuses_a_height_the_pipeline_would_round(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, stderr = generate(capsys, "flux", "--steps", "2", "--height", "30", "--out", str(tmp_path / "h.png"))
    assert code == 2
    assert ("--height 30: FluxPipeline makes images in multiples of 4 and would silently make it 28. "
            "Pass --height 28 or 32.") in stderr


def test_generate_num_images_reaches_the_pipeline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, stdout, _ = generate(capsys, "flux", "--steps", "2", "--num-images", "3", "--out", str(tmp_path / "n.png"))
    assert code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["n_0.png", "n_1.png", "n_2.png"]
    assert "num_images_per_prompt=3" in stdout


def test_generate_guidance_scale_reaches_the_pipeline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pixels = {}
    for name, scale in (("a", "1.5"), ("b", "1.5"), ("c", "6.0")):  # the tiny Flux embeds guidance
        code, stdout, _ = generate(capsys, "flux", "--steps", "2", "--guidance-scale", scale,
                                   "--out", str(tmp_path / f"{name}.png"))
        assert code == 0 and f"guidance_scale={float(scale)!r}" in stdout
        pixels[name] = Image.open(tmp_path / f"{name}.png").tobytes()
    assert pixels["a"] == pixels["b"] and pixels["a"] != pixels["c"]


def test_negative_prompt_and_true_cfg_go_into_the_flux_call() -> None:
    from hookkit.tools import local

    pipe = zoo.tiny_pipeline("flux")
    kw = local.CallOptions(negative_prompt="blurry", true_cfg_scale=3.0, guidance_scale=2.0).call_kwargs(pipe, batch=2)
    assert kw == {"guidance_scale": 2.0, "negative_prompt": ["blurry", "blurry"], "true_cfg_scale": 3.0}


def test_lora_flag_parses_path_and_scale() -> None:
    from hookkit.tools import local

    assert [local.Lora.parse(t) for t in ("a.safetensors", "a.safetensors:0.5", "C:/x/a.safetensors", "d/b:c")] == [
        local.Lora(path="a.safetensors"), local.Lora(path="a.safetensors", scale=0.5),
        local.Lora(path="C:/x/a.safetensors"), local.Lora(path="d/b:c")]


def test_generate_loads_a_lora_before_enabling(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("peft")
    from diffusers import FluxPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    transformer = zoo.tiny_transformer("flux")
    transformer.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "to_k", "to_v"], init_lora_weights=False))
    FluxPipeline.save_lora_weights(tmp_path / "lora", transformer_lora_layers=get_peft_model_state_dict(transformer))
    lora = tmp_path / "lora" / "pytorch_lora_weights.safetensors"
    images = {}
    for name, extra in (("plain", []), ("lora", ["--lora", f"{lora}:1.0"]), ("zero", ["--lora", f"{lora}:0"])):
        code, stdout, stderr = generate(capsys, "flux", "--steps", "2", "--cache", *extra,
                                        "--out", str(tmp_path / f"{name}.png"))
        assert code == 0, stderr
        images[name] = Image.open(tmp_path / f"{name}.png").tobytes()
    assert "LoRA pytorch_lora_weights.safetensors:0" in stdout
    assert images["lora"] != images["plain"] and images["zero"] == images["plain"]


def test_generate_prompt_goes_into_the_summary_and_the_file_name() -> None:
    from hookkit.tools import local

    opts = bench.ModelOptions(name="flux", model_path="x", prompt="A cat, holding a sign!")
    assert cli.output_name(opts, "1024x1024", "eager", opts.prompt, ".png") == Path(
        "flux.a-cat-holding-a-sign.1024x1024.eager.png")
    assert local.slug("  ") == "prompt"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["model", "sequential"])
def test_generate_cpu_offload_runs_on_a_gpu(mode: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("accelerate")
    code, stdout, stderr = generate(capsys, "flux", "--steps", "2", "--cache", "--cpu-offload", mode,
                                    "--out", str(tmp_path / "o.png"))
    assert code == 0, stderr
    assert f"cpu offload {mode}" in stdout and (tmp_path / "o.png").is_file()


@pytest.mark.parametrize(("argv", "message"), [
    (["./no/such/folder"], "MODEL './no/such/folder': no such folder (a path, not a shipped adapter name)"),
    ([], f"MODEL: expected a shipped adapter name ({', '.join(sorted(hookkit.list_adapters()))}) or a local "
         "pipeline folder, got neither."),
])
def test_generate_model_argument_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, stderr = generate(capsys, *argv)
    assert code == 2 and message in stderr


# --- refused before anything is loaded or timed: sizes, output paths, timeouts, environment variables -------------


@pytest.fixture
def no_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading a pipeline, running a bench matrix or timing a row fails the test: what these tests refuse must be
    refused before any of it."""
    from hookkit.tools import trained

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("expensive work started before the refusal")

    for owner, name in ((bench, "load_pipeline"), (trained, "load_pipeline"), (bench, "run_matrix"),
                        (bench, "measure")):
        monkeypatch.setattr(owner, name, refuse)


@pytest.mark.parametrize(("flag", "value"), [("--height", "-32"), ("--height", "0"), ("--width", "0")])
def test_generate_refuses_a_size_below_one(flag: str, value: str, no_load: None,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    code, stdout, stderr = generate(capsys, "flux", flag, value)
    assert code == 2 and stdout == ""
    assert stderr == f"hookkit generate: error: {flag}: expected an int >= 1, got {value}.\n"


@pytest.mark.parametrize("command", [["generate", "flux"], ["bench", "--model", "flux"]])
def test_a_size_of_more_latent_tokens_than_the_cpu_bound_is_refused(command: list[str], no_load: None,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main([*command, "--device", "cpu", "--height", "4096", "--width", "4096"])
    assert code == 2
    assert capsys.readouterr().err == (
        f"hookkit {command[0]}: error: --height 4096 --width 4096: FluxPipeline would attend over 1,048,576 latent "
        "tokens a sample (4096x4096), above the 32,768 hookkit allows on the CPU (131,072 on a GPU): attention's "
        "time and memory grow with the square of the token count, and the longest sequence the supported families "
        "are made for is 118,800 tokens (HunyuanVideo at 1280x720, 129 frames). Pass a smaller --height/--width.\n")


def test_the_latent_token_bound_admits_the_sizes_the_families_are_made_for() -> None:
    from hookkit.errors import SpecError

    cpu, gpu = torch.device("cpu"), torch.device("cuda")  # only the type is read: no GPU needed
    bench.check_size(bench.ModelOptions(name="wan", full=True, height=480, width=832), cpu)  # 32,760 tokens
    bench.check_size(bench.ModelOptions(name="wan", full=True, height=720, width=1280), gpu)  # 75,600 tokens
    with pytest.raises(SpecError, match=r"WanPipeline would attend over 75,600 latent tokens a sample \(720x1280, 81 "
                                        r"frames\), above the 32,768 hookkit allows on the CPU"):
        bench.check_size(bench.ModelOptions(name="wan", full=True, height=720, width=1280), cpu)


def test_wan_at_480x832_and_81_frames_attends_over_32760_tokens_which_the_cpu_bound_admits() -> None:
    from hookkit.tools import local

    opts = bench.ModelOptions(name="wan", full=True, arch="wan2.1-14b", height=480, width=832, frames=81)
    pipe = bench.skeleton_pipeline(opts)
    assert local.latent_tokens(pipe, 480, 832, 81) == 21 * 30 * 52 == 32_760 <= bench.MAX_LATENT_TOKENS["cpu"]
    bench.check_size(opts, torch.device("cpu"))
    bench.check_size(opts, torch.device("cuda"))  # only the type is read: no GPU needed


def test_more_frames_than_the_cpu_bound_admits_are_refused_naming_frames(no_load: None,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["bench", "--model", "wan", "--full", "--device", "cpu", "--frames", "85"])  # 22 latent frames
    assert code == 2
    assert capsys.readouterr().err == (
        "hookkit bench: error: --frames 85: WanPipeline would attend over 34,320 latent tokens a sample (480x832, 85 "
        "frames), above the 32,768 hookkit allows on the CPU (131,072 on a GPU): attention's time and memory grow with "
        "the square of the token count, and the longest sequence the supported families are made for is 118,800 "
        "tokens (HunyuanVideo at 1280x720, 129 frames). Pass a smaller --height/--width or fewer --frames (all latent "
        "frames attend together).\n")


@pytest.mark.parametrize(("command", "fixes"), [
    (["generate", "flux"], "or --vae-tiling (the VAE decodes in tiles), "),
    (["bench", "--model", "flux"], ""),  # bench has no --vae-tiling
])
def test_a_call_whose_activations_cannot_fit_beside_the_weights_is_refused_before_loading(
        command: list[str], fixes: str, no_load: None, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(bench.models, "_available_bytes", lambda device: 10**9)
    # 16,384 latent tokens a sample, within the CPU's bound; decoding 64 images of 512x512 is not
    code = cli.main([*command, "--device", "cpu", "--height", "512", "--width", "512", "--batch", "64"])
    assert code == 2
    assert capsys.readouterr().err == (
        f"hookkit {command[0]}: error: --height 512 --width 512 --batch 64: FluxPipeline needs at least 1.1 GB on cpu "
        "for this call, and 1.0 GB are available. The largest phase is decoding: 0.2 MB of weights and 1.1 GB for the "
        "VAE's last block (64 x 8 channels x 512x512, its input and output); attention, text encoders and other "
        f"buffers come on top. Pass a smaller --height/--width or --batch, {fixes}or --dtype bfloat16.\n")


def test_vae_tiling_takes_the_full_resolution_decode_out_of_the_memory_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    from hookkit.errors import UnsupportedError

    monkeypatch.setattr(bench.models, "_available_bytes", lambda device: 10**9)
    opts = bench.ModelOptions(name="flux", height=512, width=512, batch=64)
    bench.check_memory(opts, torch.device("cpu"), tiled=True)
    with pytest.raises(UnsupportedError, match=r"The largest phase is decoding"):
        bench.check_memory(opts, torch.device("cpu"), tiled=False)


def test_the_memory_bound_counts_the_weights_and_hidden_states_of_a_full_size_model(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from hookkit.errors import UnsupportedError

    opts = bench.ModelOptions(name="flux", full=True, dtype="bfloat16", height=1024, width=1024, batch=8)
    weights = bench.full_transformer_bytes("flux", torch.bfloat16) + sum(
        2 * p.numel() for p in bench.skeleton_pipeline(opts).vae.parameters())
    hidden = 2 * 8 * 4096 * 3072 * 2  # a block's input and output: batch x tokens x channels in bfloat16
    monkeypatch.setattr(bench.models, "_available_bytes", lambda device: weights + hidden)
    bench.check_memory(opts, torch.device("cuda"))  # fits exactly; the type is all that is read: no GPU needed
    monkeypatch.setattr(bench.models, "_available_bytes", lambda device: weights + hidden - 1)
    with pytest.raises(UnsupportedError, match=r"^--height 1024 --width 1024 --batch 8: FluxPipeline needs at least "
                                               r"24\.4 GB on cuda for this call, and 24\.4 GB are available\. The "
                                               r"largest phase is denoising: 24\.0 GB of weights and 0\.4 GB of hidden "
                                               r"states \(8 x 4,096 tokens x 3072 channels"):
        bench.check_memory(opts, torch.device("cuda"))


@pytest.mark.parametrize(("argv", "message"), [
    (["wan", "--frames", "80"], "--frames 80: WanPipeline's VAE compresses time 4x and takes 4k+1 frames (the first "
                                "frame, then 4 per latent frame); got 80. Pass --frames 77 or 81."),
    (["wan", "--full", "--device", "cpu", "--frames", "3"],
     "--frames 3: WanPipeline's VAE compresses time 4x and takes 4k+1 frames (the first frame, then 4 per latent "
     "frame); got 3. Pass --frames 1 or 5."),
    (["wan", "--frames", "0"], "--frames: expected an int >= 1, got 0."),
    (["flux", "--frames", "5"], "--frames 5: FluxPipeline makes images, not videos; drop --frames."),
])
def test_generate_refuses_a_frame_count_the_pipeline_cannot_make_before_loading(
        argv: list[str], message: str, no_load: None, capsys: pytest.CaptureFixture[str]) -> None:
    code, stdout, stderr = generate(capsys, *argv)
    assert (code, stdout) == (2, "")
    assert stderr == f"hookkit generate: error: {message}\n"


@pytest.mark.parametrize(("name", "height", "width"), [("flux", 48, 32), ("wan", 32, 48)])
def test_latent_tokens_are_the_sequence_the_transformer_sees(name: str, height: int, width: int) -> None:
    from hookkit.tools import local

    pipe = zoo.tiny_pipeline(name)
    kwargs = zoo.call_kwargs(name, steps=1, height=height, width=width)
    seen: list[int] = []

    def record(module: torch.nn.Module, args: tuple[object, ...], kw: dict[str, torch.Tensor]) -> None:
        hidden = kw.get("hidden_states", args[0] if args else None)
        assert isinstance(hidden, torch.Tensor)
        if hidden.dim() == 3:  # Flux: packed (batch, tokens, channels)
            seen.append(hidden.shape[1])
        else:  # Wan: (batch, channels, frames, height, width), patched by patch_size
            pt, ph, pw = module.config.patch_size
            seen.append(hidden.shape[2] // pt * (hidden.shape[3] // ph) * (hidden.shape[4] // pw))

    pipe.transformer.register_forward_pre_hook(record, with_kwargs=True)
    pipe(**kwargs)
    assert seen[0] == local.latent_tokens(pipe, height, width, kwargs.get("num_frames", 1))


@pytest.mark.parametrize(("out", "message"), [
    ("file/sub/x.png", "--out {tmp}/file/sub/x.png: expected a path under a folder, but {tmp}/file is a file, so the "
                       "folder {tmp}/file/sub cannot be created. Pass a path under a folder."),
    ("folder.png", "--out {tmp}/folder.png: expected a file name, got an existing folder. Pass a file in it, e.g. "
                   "{tmp}/folder.png/image.png."),
])
def test_generate_refuses_an_out_path_it_cannot_write_before_loading(out: str, message: str, tmp_path: Path,
                                                                     no_load: None,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("")
    (tmp_path / "folder.png").mkdir()
    code, _, stderr = generate(capsys, "flux", "--out", str(tmp_path / out))
    assert code == 2
    assert stderr == f"hookkit generate: error: {message.format(tmp=tmp_path)}\n"


@pytest.mark.skipif(not Path("/proc/self").is_dir() or not os.access("/proc", os.W_OK),
                    reason="needs Linux's /proc writable by its permission bits (root), where mkdir fails anyway")
def test_generate_refuses_an_out_folder_that_cannot_be_made_although_its_permissions_allow(
        no_load: None, capsys: pytest.CaptureFixture[str]) -> None:
    # /proc passes os.access for root, yet nothing can be made in it: only trying tells
    code, _, stderr = generate(capsys, "flux", "--out", "/proc/hookkit-out/x.png")
    assert code == 2
    assert stderr == ("hookkit generate: error: --out /proc/hookkit-out/x.png: expected a path whose folder can be "
                      "created and written, but writing in /proc/hookkit-out failed (FileNotFoundError: No such file "
                      "or directory). Pass a path under a writable folder.\n")


def test_demo_refuses_an_out_path_under_a_file_before_loading(tmp_path: Path, no_load: None,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("")
    threads = torch.get_num_threads()
    try:
        code = cli.main(["demo", "--out", str(tmp_path / "file" / "demo.png")])
    finally:
        torch.set_num_threads(threads)  # the demo sets its thread count once it runs
    assert code == 2
    assert capsys.readouterr().err == (f"hookkit demo: error: --out {tmp_path}/file/demo.png: expected a path under a "
                                       f"folder, but {tmp_path}/file is a file. Pass a path under a folder.\n")


@pytest.mark.parametrize(("flag", "path"), [("--json", "file/report.json"), ("--out-dir", "file/rows")])
def test_bench_refuses_an_output_path_under_a_file_before_running(flag: str, path: str, tmp_path: Path, no_load: None,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("")
    assert cli.main(["bench", "--device", "cpu", flag, str(tmp_path / path)]) == 2
    assert (f"hookkit bench: error: {flag} {tmp_path / path}: expected a path under a folder, but {tmp_path}/file is "
            "a file") in capsys.readouterr().err


def test_bench_quality_refuses_an_out_variable_under_a_file_before_the_sweep(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    from hookkit.tools import quality

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the sweep started before the refusal")

    monkeypatch.setattr(quality, "run_quality", refuse)
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("OUT", str(tmp_path / "file"))
    assert cli.main(["bench", "--quality", "--quick", "--no-plot"]) == 2
    assert capsys.readouterr().err == (
        f"hookkit bench --quality: error: OUT (the default of --out: $OUT/quality) {tmp_path}/file/quality: expected "
        f"a path under a folder, but {tmp_path}/file is a file, so the folder {tmp_path}/file/quality cannot be "
        "created. Pass a path under a folder.\n")


@pytest.mark.parametrize("timeout", ["-5", "0", "nan"])
def test_bench_refuses_a_timeout_that_is_not_a_positive_number(timeout: str, no_load: None,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "--device", "cpu", "--timeout", timeout]) == 2
    assert capsys.readouterr().err == (f"hookkit bench: error: --timeout: expected a number of seconds > 0, got "
                                       f"{float(timeout):g}.\n")


def test_bench_one_creates_its_out_dir_before_timing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = tmp_path / "new" / "rows"
    existed: list[bool] = []

    def measure(config: object, opts: object, runs: int, warmup: int, folder: Path) -> dict[str, object]:
        existed.append(folder.is_dir())
        return {}

    monkeypatch.setattr(bench, "measure", measure)
    assert cli.main(["bench-one", "--config", "eager", "--model", "flux", "--out-dir", str(out_dir)]) == 0
    assert existed == [True]


def test_lora_scale_that_is_not_a_number_is_named_as_the_scale(tmp_path: Path, no_load: None,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    lora = tmp_path / "lora.safetensors"
    lora.write_bytes(b"")
    code, _, stderr = generate(capsys, "flux", "--lora", f"{lora}:abc")
    assert code == 2
    assert stderr == (f"hookkit generate: error: --lora {lora}:abc: expected PATH or PATH:SCALE with SCALE a finite "
                      f"number, got scale 'abc'. Pass e.g. --lora {lora}:0.8, or --lora {lora} for scale 1.0.\n")


def test_help_works_whatever_hookkit_bench_timeout_holds(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HOOKKIT_BENCH_TIMEOUT", "abc")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "--help"])
    assert exit_.value.code == 0
    assert "(default: $HOOKKIT_BENCH_TIMEOUT or 1800)" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("value", ["abc", "-5"])
def test_bench_names_hookkit_bench_timeout_when_it_is_no_positive_number(value: str, monkeypatch: pytest.MonkeyPatch,
                                                                         no_load: None,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HOOKKIT_BENCH_TIMEOUT", value)
    assert cli.main(["bench", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hookkit bench: error: HOOKKIT_BENCH_TIMEOUT={value!r}: expected a number of seconds > 0")


@pytest.mark.parametrize("command", [["bench", "--device", "cpu"],
                                     ["bench-one", "--config", "eager", "--model", "flux", "--out-dir", "{tmp}"]])
def test_bench_names_hookkit_bench_cold_when_it_is_not_0_or_1(command: list[str], tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch, no_load: None,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HOOKKIT_BENCH_COLD", "yes")
    assert cli.main([a.replace("{tmp}", str(tmp_path / "rows")) for a in command]) == 2
    assert capsys.readouterr().err == (
        f"hookkit {command[0]}: error: HOOKKIT_BENCH_COLD='yes': expected 1 (the row's compiler caches are fresh and "
        "empty; `hookkit bench --cold` sets it for its rows), 0 or unset, got 'yes'. Unset it, or use `hookkit bench "
        "--cold`.\n")


def test_import_hookkit_ignores_an_unknown_hookkit_log_with_a_warning_naming_it() -> None:
    proc = subprocess.run([sys.executable, "-c", "import hookkit; print('imported')"], cwd=REPO, capture_output=True,
                          text=True, env={**os.environ, "HOOKKIT_LOG": "loud"})
    assert proc.returncode == 0 and proc.stdout == "imported\n"
    assert ("UserWarning: HOOKKIT_LOG='loud': expected one of TRACE, DEBUG, INFO, SUCCESS, WARNING, ERROR, CRITICAL "
            "(any case), or unset; ignored, hookkit's log stays off. Set e.g. HOOKKIT_LOG=INFO, or unset it.") in proc.stderr


def test_parallel_names_a_torchrun_variable_that_is_not_an_int(monkeypatch: pytest.MonkeyPatch, no_load: None,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "first")):
        monkeypatch.setenv(name, value)
    code, _, stderr = generate(capsys, "flux", "--parallel", "ulysses=2")
    assert code == 2
    assert stderr == ("hookkit generate: error: --parallel: expected the environment variable LOCAL_RANK to be an int "
                      ">= 0 (torchrun sets it), got 'first'. Run under torchrun, or fix LOCAL_RANK.\n")
