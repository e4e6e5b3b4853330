"""What `hookkit generate` tells a first-time user: an input image and VAE options refused or used as asked,
summaries that fit 100 columns, CFG branches by name, why nothing was cached, unknown flags answered by the
command they were given to. Tiny models on the CPU, in-process through `hookkit.tools.cli.main`."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import diffusers
import pytest
from PIL import Image

import hookkit
from hookkit.core.summary import SUMMARY_WIDTH, table
from hookkit.errors import UnsupportedError
from hookkit.techniques.cache.hooks import branch_names
from hookkit.tools import bench, cli, local, zoo
from test_dbcache import drive, stub


def generate(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(["generate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def no_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building or loading a pipeline fails the test: what these tests refuse must be refused before it."""
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a pipeline was built before the refusal")

    monkeypatch.setattr(bench, "load_pipeline", refuse)


@pytest.fixture
def png(tmp_path: Path) -> Path:
    path = tmp_path / "input.png"
    Image.new("RGB", (32, 32), (200, 30, 40)).save(path)
    return path


@pytest.fixture(scope="module")
def img2img_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local FluxImg2ImgPipeline folder (tiny, random weights, no text encoders)."""
    folder = tmp_path_factory.mktemp("local") / "tiny-flux-img2img"
    zoo.tiny_variant("flux_img2img").save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def flux_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local FluxPipeline folder (text to image: takes no input image)."""
    folder = tmp_path_factory.mktemp("local") / "tiny-flux"
    zoo.tiny_pipeline("flux").save_pretrained(folder)
    return folder


# --- --image ---------------------------------------------------------------------------------------------


def test_image_goes_into_an_img2img_pipeline_call_as_a_pil_image(img2img_folder: Path, png: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[Any] = []
    original = diffusers.FluxImg2ImgPipeline.__call__

    @functools.wraps(original)  # keeps the signature hookkit reads
    def recording(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("image"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(diffusers.FluxImg2ImgPipeline, "__call__", recording)
    code, stdout, stderr = generate(capsys, str(img2img_folder), "--image", str(png), "--steps", "2", "--height", "32",
                                    "--width", "32", "--threads", "1", "--out", str(tmp_path / "out.png"))
    assert code == 0, stderr
    assert len(seen) == 1 and isinstance(seen[0], Image.Image)
    assert (seen[0].mode, seen[0].size, seen[0].tobytes()) == ("RGB", (32, 32), Image.open(png).tobytes())
    assert f"- Input: 32x32, 2 steps, batch 1, seed 0; image {png}\n" in stdout


def test_image_for_the_tiny_models_is_refused_before_building_them(png: Path, no_load: None,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    code, _, stderr = generate(capsys, "flux", "--image", str(png))
    assert code == 2
    assert stderr == (
        "hookkit generate: error: --image: the tiny and --full models hookkit builds are text-to-image and "
        "text-to-video pipelines, which take no input image. Pass --model-path to a local edit or img2img pipeline "
        "folder (e.g. FluxKontextPipeline, FluxImg2ImgPipeline, QwenImageEditPipeline), or drop --image.\n")


@pytest.mark.parametrize("name", bench.tiny_models())
def test_no_tiny_pipeline_takes_an_image_as_the_refusal_says(name: str) -> None:
    assert not local.takes_image(type(zoo.tiny_pipeline(name)))


def test_image_for_a_folder_whose_pipeline_takes_none_is_refused_before_loading(
        flux_folder: Path, png: Path, no_load: None, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, stderr = generate(capsys, str(flux_folder), "--image", str(png))
    assert code == 2
    assert stderr == (f"hookkit generate: error: --image: FluxPipeline (the pipeline in {str(flux_folder)!r}) takes "
                      "no input image; only edit and img2img pipelines (those whose __call__ takes `image`) do. Drop "
                      "--image, or pass such a pipeline's folder.\n")


def test_a_missing_image_is_refused_before_building(tmp_path: Path, no_load: None,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    code, _, stderr = generate(capsys, "flux", "--image", str(tmp_path / "none.png"))
    assert code == 2
    assert stderr == (f"hookkit generate: error: --image {tmp_path / 'none.png'}: expected an image file (.png, .jpg, "
                      ".webp, ...), got no such file. Pass the path of an existing image.\n")


def test_a_file_that_is_no_image_is_refused_before_building(tmp_path: Path, no_load: None,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "notes.png"
    text.write_text("not an image")
    code, _, stderr = generate(capsys, "flux", "--image", str(text))
    assert code == 2
    assert stderr.startswith(f"hookkit generate: error: --image {text}: expected an image PIL can read, got a file it "
                             "cannot (cannot identify image file")
    assert stderr.endswith("). Pass a .png, .jpg or .webp image.\n")


# --- --vae-tiling / --vae-slicing ----------------------------------------------------------------------------


def test_vae_flags_call_enable_tiling_and_enable_slicing_before_the_run(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    calls: list[str] = []
    for method in ("enable_tiling", "enable_slicing"):
        original = getattr(diffusers.AutoencoderKL, method)
        monkeypatch.setattr(diffusers.AutoencoderKL, method,
                            lambda self, _m=method, _f=original: (calls.append(_m), _f(self))[1])
    code, stdout, stderr = generate(capsys, "flux", "--steps", "2", "--vae-tiling", "--vae-slicing",
                                    "--out", str(tmp_path / "v.png"))
    assert code == 0, stderr
    assert calls == ["enable_tiling", "enable_slicing"]
    assert "- Input: 32x32, 2 steps, batch 1, seed 0; vae-tiling, vae-slicing\n" in stdout


def test_enable_vae_options_sets_the_vaes_own_switches() -> None:
    pipe = zoo.tiny_pipeline("flux")
    local.enable_vae_options(pipe, ("--vae-tiling", "--vae-slicing"))
    assert (pipe.vae.use_tiling, pipe.vae.use_slicing) == (True, True)


def test_a_vae_without_tiling_is_refused_naming_it() -> None:
    class PlainVAE:
        def enable_slicing(self) -> None: ...

    class SomePipeline:
        vae = PlainVAE()

    with pytest.raises(UnsupportedError) as info:
        local.enable_vae_options(SomePipeline(), ("--vae-tiling",))
    assert str(info.value) == "--vae-tiling: SomePipeline's VAE (PlainVAE) does not implement enable_tiling(). " \
                              "Drop --vae-tiling."


def test_vae_tiling_with_full_is_refused_before_building(no_load: None, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, stderr = generate(capsys, "flux", "--full", "--device", "cpu", "--vae-tiling")
    assert code == 2
    assert stderr == ("hookkit generate: error: --vae-tiling: --full skips decoding (the output is latents), so the "
                      "VAE never runs. Drop --vae-tiling, or drop --full.\n")


# --- summaries ---------------------------------------------------------------------------------------------


def test_table_fitted_to_a_width_wraps_its_widest_column_onto_continuation_lines() -> None:
    text = table(["name", "attached to"], [["quantize", "blocks.{0..1}.to_q, blocks.{0..1}.to_k, blocks.{0..1}.to_v"]],
                 width=40)
    assert text == (
        "| name     | attached to               |\n"
        "|----------|---------------------------|\n"
        "| quantize | blocks.{0..1}.to_q,       |\n"
        "|          | blocks.{0..1}.to_k,       |\n"
        "|          | blocks.{0..1}.to_v        |")


def test_table_cell_cut_after_max_lines_ends_in_an_ellipsis() -> None:
    text = table(["a", "b"], [["x", "one two three four five six"]], width=16, max_lines=2)
    assert text.splitlines()[2:] == ["| x | one two  |", "|   | three…   |"]


def test_table_without_a_width_keeps_one_line_per_row() -> None:
    assert table(["a"], [["x" * 150]]).splitlines()[2] == "| " + "x" * 150 + " |"


def test_summary_flag_prints_a_summary_no_line_of_which_is_wider_than_100(tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    code, stdout, _ = generate(capsys, "flux", "--steps", "4", "--cache", "--quantize", "int8_weight_only",
                               "--summary", "--out", str(tmp_path / "s.png"))
    assert code == 0
    summary = stdout.split("hookkit generate summary")[0]
    assert max(len(line) for line in summary.splitlines()) <= SUMMARY_WIDTH
    assert "each layer, quantized or skipped and why: the full summary" in summary
    assert "transformer_blocks.{0..1}.norm1.linear" not in summary  # the per-layer table is a detail
    assert "(every detail: --summary full)" in summary


def test_summary_full_prints_every_quantized_layer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, stdout, _ = generate(capsys, "flux", "--steps", "2", "--quantize", "int8_weight_only", "--summary", "full",
                               "--out", str(tmp_path / "s.png"))
    assert code == 0
    assert "| transformer_blocks.{0..1}.norm1.linear          | 2     | 16 -> 96  | skipped   | excluded by name" \
        in stdout


def test_compile_summary_on_the_cpu_without_fp8_lists_no_fp8_or_rope_counter() -> None:
    pipe = zoo.tiny_pipeline("flux")
    handle = hookkit.enable(pipe, hookkit.Spec(compile=hookkit.Compile(), quantize=hookkit.Quantize(
        scheme="int8_weight_only", keep_original="cpu")))
    compiled = handle.summary().features["compile"]
    assert [line.split("|")[1].strip() for line in compiled.text.splitlines()[2:]] == [
        "regions compiled", "mode", "fullgraph"]
    assert compiled.data["fp8_rows_fused"] == 0  # still counted in the structured data
    handle.remove()


@pytest.mark.parametrize(("pipeline", "names"), [
    (diffusers.FluxPipeline, ("cond", "uncond")), (diffusers.WanPipeline, ("cond", "uncond")),
    (diffusers.CogVideoXPipeline, ("cond_uncond",)), (diffusers.HunyuanVideo15Pipeline, ())])
def test_branch_names_are_the_pipelines_own_cache_context_names(pipeline: type, names: tuple[str, ...]) -> None:
    assert branch_names(pipeline.__new__(pipeline)) == names


def test_generate_counts_cfg_branches_apart_under_their_names(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    code, stdout, _ = generate(capsys, "wan", "--steps", "6", "--cache", "--cache-mask", "fast", "--cache-mode",
                               "static", "--out", str(tmp_path / "w.gif"))
    assert code == 0
    mask = hookkit.techniques.cache.spec.resolve_steps_mask("fast", 6)
    cached = [i for i, m in enumerate(mask) if m == 0]
    assert (f"- Cached Steps: {2 * len(cached)} of 12 transformer calls (2 CFG branches, one call per step each); "
            f"block calls run: ") in stdout
    assert f"\n  - cond: {len(cached)} of 6 steps cached, steps {cached}\n" in stdout
    assert f"\n  - uncond: {len(cached)} of 6 steps cached, steps {cached}\n" in stdout


# --- why nothing was cached ----------------------------------------------------------------------------------


def test_generate_says_in_its_default_output_why_nothing_was_cached(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    code, stdout, _ = generate(capsys, "flux", "--steps", "4", "--cache", "--cache-threshold", "0.24",
                               "--cache-warmup", "8", "--out", str(tmp_path / "w.png"))
    assert code == 0
    assert "- Cached Steps: 0 of 4 transformer steps: warm-up covered all 4 (warmup_steps=8)\n" in stdout


def test_the_brief_reason_names_warmup_threshold_and_smallest_diff() -> None:
    model, handle = stub(hookkit.DBCache(threshold=0.1, warmup_steps=1))
    drive(model, handle, [1.0, 2.0, 4.0])  # diffs 1.0 and 1.0 (relative to the last computed step)
    assert handle.summary().features["cache"].data["no_cache_brief"] == \
        "warm-up covered 1, threshold 0.1 never reached (smallest diff 1)"


def test_verbose_log_says_why_nothing_was_cached_once_at_summary_time(capfd: pytest.CaptureFixture[str]) -> None:
    model, handle = stub(hookkit.DBCache(threshold=0.1, warmup_steps=1))
    hookkit.set_verbosity("INFO")
    try:
        drive(model, handle, [1.0, 2.0, 4.0])
        assert "0 of 3 steps cached" not in capfd.readouterr().err  # not while it runs
        for _ in range(2):
            handle.summary()
    finally:
        hookkit.set_verbosity(None)
    err = capfd.readouterr().err
    assert err.count("cache: 0 of 3 steps cached: warm-up covered 1, threshold 0.1 never reached (smallest diff 1)") \
        == 1


def test_a_run_that_cached_has_no_brief_reason() -> None:
    model, handle = stub(hookkit.DBCache(threshold=0.5))
    drive(model, handle, [1.0] * 6)
    assert handle.summary().features["cache"].data["no_cache_brief"] is None


# --- small messages ------------------------------------------------------------------------------------------


def test_a_misspelt_flag_gets_generates_usage_and_the_closest_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["generate", "flux", "--guidence-scale", "3"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.startswith("usage: hookkit generate [-h]")
    assert err.endswith("hookkit generate: error: unrecognized arguments: --guidence-scale 3 (--guidence-scale: did "
                        "you mean --guidance-scale?)\n")


def test_an_unknown_flag_of_a_nested_command_gets_that_commands_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["adapter", "derive", "FluxTransformer2DModel", "--trust-remot-code"])
    err = capsys.readouterr().err
    assert err.startswith("usage: hookkit adapter derive [-h]")
    assert err.endswith("did you mean --trust-remote-code?)\n")


def test_bench_one_runs_but_is_not_in_the_top_level_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "bench-one" not in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench-one", "--help"])
    assert exit_.value.code == 0 and "(internal) one configuration of `hookkit bench`" in capsys.readouterr().out


def test_summary_takes_brief_or_full_only(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["generate", "flux", "--summary", "all"])
    assert "argument --summary: invalid choice: 'all' (choose from 'brief', 'full')" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["FluxKontextPipeline", "FluxImg2ImgPipeline", "QwenImageEditPipeline"])
def test_the_pipelines_the_image_refusal_names_take_an_image(name: str) -> None:
    assert local.takes_image(getattr(diffusers, name))
