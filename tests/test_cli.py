"""The `hookkit` command line: `demo` and `generate` on tiny models, on the CPU, no downloads.

`generate` runs in-process through `hookkit.tools.cli.main(argv)` (the console script's entry point), which
returns the exit code; `demo` runs as `python -m hookkit demo` in a subprocess, as a user would.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

import hookkit
from hookkit.tools import bench, cli, zoo

HAVE = bench.available_fields()
REPO = Path(__file__).resolve().parent.parent


def test_every_spec_feature_is_installed() -> None:
    assert HAVE == {"cache", "compile", "memo", "parallel", "quantize", "sync_free"}


def generate(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(["generate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


# --- demo ----------------------------------------------------------------------------------------------


def test_demo_prints_summary_timings_and_bitwise_equality_after_disable() -> None:
    proc = subprocess.run([sys.executable, "-m", "hookkit", "demo", "--steps", "8", "--runs", "1"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "hookkit summary: FluxTransformer2DModel in FluxPipeline" in out
    assert "| core      | hookkit.clock" in out
    assert re.search(r"^\| plain diffusers \| \d+\.\d{4} +\| 1\.00x", out, re.MULTILINE)
    assert re.search(r"^\| hookkit +\| \d+\.\d{4} +\| \d+\.\d\dx", out, re.MULTILINE)
    assert "after hookkit.disable: output bitwise equal to the plain run: True" in out
    assert "plain   1/1" in proc.stderr  # diffusers' progress bar, labelled per run
    assert "[cache]" in out


def test_demo_spec_uses_the_installed_cpu_features() -> None:
    spec = cli.demo_spec(HAVE)
    assert spec.cache is not None and spec.cache.steps_mask == "fast" and spec.cache.mask_policy == "static"
    assert spec.memo is True and spec.sync_free is True
    assert spec.compile is None and spec.quantize is None


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
    assert "- Optimization: DBCache_F1B0_W0MC-1_R0.12_SCM-fast-static" in stdout


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


@pytest.mark.parametrize(("warmup", "line"), [("0", "(0 runs)"), ("1", "(1 run)"), ("2", "(2 runs)")])
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


def test_generate_dynamic_cache_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "d.png"
    code, stdout, _ = generate(capsys, "flux", "--steps", "4", "--cache", "--out", str(out))
    assert code == 0 and out.is_file()
    # 8 warm-up steps (seed 002's W8) cover all 4: nothing may be cached
    assert "- Cached Steps: 0 of 4 transformer steps;" in stdout
    assert "- Optimization: DBCache_F1B0_W8MC3_R0.12_TS1\n" in stdout  # TaylorSeer order 1, the DBCache default


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
    assert (f"--model-path {str(folder)!r}: holds FluxPipeline with FluxTransformer2DModel; MODEL 'wan' is for "
            "['WanTransformer3DModel']") in stderr


# --- generate: what cannot run here fails with hookkit's message and exit code 2 --------------------------------


@pytest.mark.parametrize(("argv", "message"), [
    (["flux", "--device", "cuda"], "--device cuda: no CUDA device is visible"),
    (["sd3"], "no tiny pipeline for sd3 yet (random-weight pipelines, tiny and --full, exist for ['cogvideox', "
              "'flux', 'qwenimage', 'wan'])"),
    (["hunyuanvideo"], "no tiny pipeline for hunyuanvideo yet"),
    (["hunyuanvideo", "--full"], "no full-size pipeline for hunyuanvideo yet"),
    (["nosuchmodel"], "MODEL: expected a shipped adapter name"),
    (["flux", "--cache-mask", "fast"], "--cache-mask fast: only with --cache"),
    (["flux", "--steps", "0"], "--steps: expected an int >= 1, got 0"),
    (["flux", "--cache", "--cache-threshold", "-1"], "DBCache.threshold: expected a number >= 0.0, got -1.0"),
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
def test_generate_cuda_graphs_on_the_cpu_fails_with_the_library_error(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    code, _, stderr = generate(capsys, "flux", "--cuda-graphs", "--out", str(tmp_path / "x.png"))
    assert code == 2
    assert "Compile.cuda_graphs='transformer' needs a CUDA device" in stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_generate_fp8_on_the_cpu_fails_with_the_library_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, stderr = generate(capsys, "flux", "--quantize", "fp8_row", "--dtype", "bfloat16", "--out", str(tmp_path / "x.png"))
    assert code == 2
    assert "Quantize.scheme='fp8_row' needs an NVIDIA GPU with compute capability 8.9" in stderr


def test_unknown_choice_is_an_argparse_error_with_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["generate", "flux", "--quantize", "int3"])
    assert exc.value.code == 2
    assert "argument --quantize: invalid choice: 'int3'" in capsys.readouterr().err


# --- the pieces ------------------------------------------------------------------------------------------


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
                                               r"\['cogvideox', 'flux', 'qwenimage', 'wan'\]"):
        bench._embedding_call_kwargs(object(), opts, steps=2, output_type="pil")
