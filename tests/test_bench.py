"""`hookkit bench`: a matrix of configurations, one process each, as a markdown table and JSON.

The matrix test runs the real thing (`python -m hookkit bench` spawning `bench-one` processes) on the tiny
Flux model with two configurations; the others test its pieces in-process.
"""

from __future__ import annotations

import importlib.util
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import attrs
import pytest
import torch

import hookkit
from hookkit.tools import bench, cli, zoo
from hookkit.errors import SpecError

REPO = Path(__file__).resolve().parent.parent
HAVE = bench.available_fields()
#: the second row of the matrix test: a hookkit configuration that changes the output, when installed
SECOND = "hookkit-cache-fast" if "cache" in HAVE else "hookkit"
TOP_KEYS = {"command", "environment", "model", "runs", "warmup", "memory", "notes", "rows"}


@pytest.mark.slow
def test_bench_two_configurations_writes_a_table_and_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "hookkit", "bench", "--model", "flux", "--configs", f"eager,{SECOND}", "--steps", "6",
         "--runs", "2", "--warmup", "1", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert set(data) == TOP_KEYS
    assert data["model"] == {"name": "flux", "full": False, "model_path": None, "steps": 6, "height": None,
                             "width": None, "batch": 1, "seed": 0, "dtype": "float32", "output": "pt"}
    assert (data["runs"], data["warmup"], data["notes"]) == (2, 1, [])
    assert [row["config"] for row in data["rows"]] == ["eager", SECOND]
    for row in data["rows"]:
        assert tuple(row) == bench.ROW_KEYS
        assert row["status"] == "ok", row["note"]
        assert len(row["latencies_s"]) == 2
        assert row["latency_s"] == statistics.median(row["latencies_s"])
        assert row["peak_memory_gb"] > 0 and row["memory_kind"] == "cpu_max_rss"
    eager, second = data["rows"]
    assert eager["speedup"] == 1.0 and eager["identical"] is True and eager["psnr_db"] is None
    assert second["speedup"] == pytest.approx(eager["latency_s"] / second["latency_s"])
    if SECOND == "hookkit-cache-fast":
        mask = hookkit.techniques.cache.spec.resolve_steps_mask("fast", 6)
        assert second["identical"] is False and math.isfinite(second["psnr_db"])
        assert second["features"]["cache"]["branches"]["0"]["cached"] == [i for i, m in enumerate(mask) if m == 0]
    else:
        assert second["identical"] is True

    lines = proc.stdout.splitlines()
    assert lines[0].startswith("hookkit bench: flux (tiny), the model's default size, 6 steps, batch 1, float32, CPU")
    header = next(i for i, line in enumerate(lines) if line.startswith("| config "))
    assert [cell.strip() for cell in lines[header].split("|")[1:-1]] == [
        "config", "median latency (s)", "spread min–max (s)", "warm-up (s)", "peak mem (GB)", "speed-up",
        "PSNR vs eager (dB)", "notes"]
    body = lines[header + 2:header + 4]
    assert [line.split("|")[1].strip() for line in body] == ["eager", SECOND]
    assert lines[header + 4:header + 5] in ([], [""])
    assert body[0].split("|")[7].strip() == "reference"
    low, high = min(eager["latencies_s"]), max(eager["latencies_s"])
    assert body[0].split("|")[3].strip() == f"{low:.4f}–{high:.4f}"
    assert "[1/2] eager" in proc.stderr and f"[2/2] {SECOND}" in proc.stderr


def test_bench_one_measures_in_process_and_saves_the_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = tmp_path / "row.json"
    code = cli.main(["bench-one", "--config", "hookkit", "--model", "flux", "--steps", "2", "--runs", "1",
                     "--warmup", "0", "--out-dir", str(tmp_path), "--result", str(result)])
    assert code == 0
    row = json.loads(result.read_text())
    assert json.loads(capsys.readouterr().out) == row
    assert (row["config"], row["kind"], row["status"]) == ("hookkit", "hookkit", "ok")
    output = torch.load(tmp_path / "hookkit.pt")
    assert output.shape == (1, 3, 32, 32) and output.dtype == torch.float32


def _compile_row(tmp_path: Path, warmup: int) -> dict:
    opts = bench.ModelOptions(name="flux", steps=2)
    torch._dynamo.reset()  # dynamo caches per code object: an earlier test's graphs would be reused
    return bench.measure(bench.CONFIGS["hookkit-compile"], opts, runs=1, warmup=warmup, out_dir=tmp_path)


def test_a_row_counts_the_graphs_its_configuration_compiled(tmp_path: Path) -> None:
    row = _compile_row(tmp_path, warmup=1)
    # one graph for the double block; two for the single block, whose first instance gets a contiguous
    # hidden_states and the others a strided view (dynamo's "stride mismatch" recompile) -- as stock diffusers
    assert (row["status"], row["compiled_graphs"], row["graphs_compiled_while_timed"]) == ("ok", 3, 0)


def test_a_graph_compiled_during_the_timed_runs_is_flagged_in_the_table(tmp_path: Path) -> None:
    row = _compile_row(tmp_path, warmup=0)
    assert (row["compiled_graphs"], row["graphs_compiled_while_timed"]) == (3, 3)
    assert "3 graph(s) compiled during the timed runs: add warm-up" in bench.markdown_table([row])


def test_a_hookkit_row_the_compat_table_refuses_for_the_model_is_skipped_before_its_process() -> None:
    config = bench.CONFIGS["hookkit-fp8+cache-fast+cuda-graphs"]  # whole-transformer graphs
    reason = config.unavailable(torch.device("cuda"), bench.available_fields(), hookkit.get_adapter("hunyuanvideo15"))
    assert reason is not None and reason.startswith(
        "refused on hunyuanvideo15: Compile.cuda_graphs: expected 'none' on 'hunyuanvideo15', whose forward waits for "
        "the host outside its blocks")
    assert config.unavailable(torch.device("cuda"), bench.available_fields(), hookkit.get_adapter("wan")) is None


def test_a_row_whose_attention_fell_back_to_sdpa_says_so_with_the_reasons() -> None:
    row = _timed_row("hookkit-fp8+compile+fp8-attention", [1.0, 1.0, 1.0])
    row["features"] = {"attention": {
        "fallbacks": {"middle/hookkit_fp8/dropout": 4},  # eager blocks, per call
        "compiled_call_sites": {"hookkit_fp8": 1, "hookkit_fp8/attention mask (torch.float32, (1, 1, 8, 8))": 2}}}
    assert ("attention fell back to SDPA: attention mask (torch.float32, (1, 1, 8, 8)) (2x), dropout (4x)"
            in bench.markdown_table([row]))


def test_a_row_whose_attention_kernel_answered_every_call_has_no_fallback_note() -> None:
    row = _timed_row("hookkit-fp8+compile+fp8-attention", [1.0, 1.0, 1.0])
    row["features"] = {"attention": {"fallbacks": {}, "compiled_call_sites": {"hookkit_fp8": 2}}}
    assert "fell back" not in bench.markdown_table([row])


def test_a_row_whose_kernel_took_padding_masks_as_rows_says_how_many() -> None:
    row = _timed_row("hookkit-fp8+cache-fast+compile+fp8-attention", [1.0, 1.0, 1.0])
    row["features"] = {"attention": {"fallbacks": {}, "compiled_call_sites": {"hookkit_fp8": 1},
                                     "padding_masks_as_rows": {"calls": {"middle/hookkit_fp8": 3},
                                                               "compiled_call_sites": {"hookkit_fp8": 1}}}}
    assert "padding masks taken as validity rows: 3 calls, 1 compiled call site" in bench.markdown_table([row])


def test_a_row_whose_kernel_took_no_padding_mask_as_a_row_has_no_such_note() -> None:
    row = _timed_row("hookkit-fp8+compile+fp8-attention", [1.0, 1.0, 1.0])
    row["features"] = {"attention": {"fallbacks": {}, "compiled_call_sites": {"hookkit_fp8": 2},
                                     "padding_masks_as_rows": {"calls": {}, "compiled_call_sites": {}}}}
    assert "validity rows" not in bench.markdown_table([row])


def test_a_two_expert_rows_table_names_each_experts_cached_steps() -> None:
    """Each expert of Wan 2.2 keeps its own residuals: the second one computes its first step whatever the mask."""
    from hookkit.tools.bench.runner import _companion_data, _summary_data

    pipe = zoo.tiny_variant("wan22")
    handle = hookkit.enable(pipe, hookkit.Spec(cache=hookkit.DBCache(
        fn_blocks=1, bn_blocks=0, warmup_steps=0, steps_mask=(1, 0, 0, 0, 0, 1), mask_policy="static",
        taylorseer_order=0)))
    pipe(**zoo.call_kwargs("wan", steps=6))  # boundary 0.8: steps 0-2 on transformer, 3-5 on transformer_2
    row = _timed_row("hookkit-cache", [1.0, 1.0, 1.0])
    row.update(features=_summary_data(handle), companion_features=_companion_data(handle))
    assert list(row["companion_features"]) == ["transformer_2"]
    # per transformer call (CFG: two a step): transformer caches steps 1 and 2; transformer_2 computes step 3 (the
    # mask's 0: no residual of its own yet), caches 4 and computes 5
    assert "cached 4/6 steps; transformer_2: cached 2/6 steps" in bench.markdown_table([row])


def test_the_step_mask_restarts_at_each_experts_first_step_as_cache_dit_counts_them() -> None:
    from hookkit.tools.bench.row import expert_steps_mask

    # the tiny Wan 2.2 (boundary 0.8) runs steps 0-2 on transformer and 3-5 on transformer_2
    assert expert_steps_mask(zoo.tiny_variant("wan22"), (1, 0, 0, 1, 0, 1), 6) == (1, 0, 0, 1, 0, 0)
    assert expert_steps_mask(zoo.tiny_pipeline("wan"), (1, 0, 0, 1, 0, 1), 6) is None  # one transformer


def test_a_hookkit_row_on_a_two_expert_pipeline_computes_the_steps_the_peer_computes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    seen: dict[str, hookkit.Spec] = {}
    monkeypatch.setattr(hookkit, "enable", lambda pipe, spec: seen.setdefault("spec", spec))
    ctx = SimpleNamespace(pipe=zoo.tiny_variant("wan22"), opts=SimpleNamespace(num_steps=lambda: 6), handle=None)
    bench.CONFIGS["hookkit-cache-fast"].setup(ctx)
    assert seen["spec"].cache.steps_mask == (1, 0, 0, 1, 0, 0)


def test_a_configuration_that_cannot_run_here_becomes_a_skipped_row_without_a_process(tmp_path: Path) -> None:
    device = torch.device("cpu")
    configs, notes = bench.select_configs(["full-compile-ro"], device)
    assert [c.name for c in configs] == ["eager", "full-compile-ro"]
    assert notes == ["eager: added as the reference for speed-up and PSNR"]
    row = bench.measure(configs[1], bench.ModelOptions(name="flux", device="cpu"), 1, 0, tmp_path)
    assert (row["status"], row["note"]) == ("skipped", "needs a CUDA device")
    assert list(tmp_path.iterdir()) == []


def test_a_failing_configuration_is_a_row_with_the_error_not_a_crash(tmp_path: Path) -> None:
    # CogVideoX has no _repeated_blocks: stock regional compilation refuses it
    opts = bench.ModelOptions(name="cogvideox", device="cpu", steps=2)
    row = bench.measure(bench.CONFIGS["regional-compile"], opts, 1, 0, tmp_path)
    assert row["status"] == "failed"
    assert row["note"].startswith("UnsupportedError: CogVideoXTransformer3DModel has no _repeated_blocks")
    assert row["latency_s"] is None and list(tmp_path.iterdir()) == []


def _report(device: str, rows: list[dict]) -> dict:
    return {"command": ["hookkit", "bench"], "environment": {"device": device}, "model": {"name": "flux"},
            "runs": 3, "warmup": 2, "memory": "m", "notes": [], "rows": rows}


def _row(config: str, latency: float) -> dict:
    row = bench._empty_row(bench.CONFIGS[config], "ok", "")
    row["latency_s"] = latency
    return row


def test_merge_keeps_the_first_eager_as_reference_and_recomputes_speed_ups() -> None:
    first = _report("H200", [_row("eager", 5.0), _row("regional-compile", 4.0)])
    second = _report("H200", [_row("eager", 5.2), _row("hookkit-cache-fast", 2.0), _row("regional-compile", 9.0)])
    merged = bench.merge_reports([first, second])
    assert [(r["config"], r["latency_s"]) for r in merged["rows"]] == [
        ("eager", 5.0), ("regional-compile", 4.0), ("hookkit-cache-fast", 2.0)]
    assert merged["rows"][2]["speedup"] == 2.5
    assert merged["command"] == [["hookkit", "bench"], ["hookkit", "bench"]]


def test_merge_refuses_runs_of_different_machines() -> None:
    with pytest.raises(SpecError, match="file 2 ran on 'CPU', file 1 on 'H200'"):
        bench.merge_reports([_report("H200", [_row("eager", 1.0)]), _report("CPU", [_row("eager", 1.0)])])


NO_EAGER_NOTE = ("no eager row (--no-eager): no speed-up or PSNR here; `hookkit bench --merge` with a run that has "
                 "one gives speed-ups against it")


def test_merge_takes_a_group_run_without_eager_against_the_first_files_eager() -> None:
    first = _report("H200", [_row("eager", 5.0), _row("regional-compile", 4.0)])
    second = _report("H200", [_row("hookkit-cache-fast", 2.0)])  # `--no-eager`: no reference of its own
    second["notes"] = [NO_EAGER_NOTE]
    merged = bench.merge_reports([first, second])
    assert [(r["config"], r["speedup"]) for r in merged["rows"]][2] == ("hookkit-cache-fast", 2.5)
    assert merged["notes"] == ["rows of a run without its eager row (--no-eager): speed-up against file 1's eager "
                               "row, no PSNR"]


def test_merge_refuses_a_first_file_without_its_eager_row() -> None:
    with pytest.raises(SpecError, match=r"--merge: expected file 1 to start with its eager row \(the reference of "
                                        r"every speed-up\), got 'regional-compile' first; put a run without "
                                        r"--no-eager first\."):
        bench.merge_reports([_report("H200", [_row("regional-compile", 4.0)]), _report("H200", [_row("eager", 5.0)])])


def test_without_eager_only_the_named_rows_run_and_a_note_says_so() -> None:
    configs, notes = bench.select_configs(["regional-compile", SECOND], torch.device("cpu"), eager=False)
    assert [c.name for c in configs] == ["regional-compile", SECOND]
    assert notes == [NO_EAGER_NOTE]


def test_without_eager_the_rows_must_be_named() -> None:
    with pytest.raises(SpecError, match=r"--no-eager: expected the rows to run in --configs"):
        bench.select_configs(None, torch.device("cpu"), eager=False)


def test_rows_without_an_eager_row_get_no_speed_up_psnr_or_reference_cell(tmp_path: Path) -> None:
    rows = [_row("regional-compile", 4.0), _row(SECOND, 2.0)]
    for row in rows:
        row["peak_memory_gb"] = 1.0
    from hookkit.tools.bench.runner import _compare

    _compare(rows, tmp_path, None)
    assert [(r["speedup"], r["psnr_db"]) for r in rows] == [(None, None), (None, None)]
    body = bench.markdown_table(rows).splitlines()[2:]
    assert [line.split("|")[7].strip() for line in body] == ["—", "—"]


def test_rows_without_an_eager_row_still_count_their_non_finite_output_values(tmp_path: Path) -> None:
    rows = [_row("regional-compile", 4.0), _row(SECOND, 2.0)]
    for row in rows:
        row["peak_memory_gb"] = 1.0
    torch.save(torch.tensor([0.0, 1.0, 2.0]), tmp_path / "regional-compile.pt")
    torch.save(torch.tensor([0.0, float("nan"), float("-inf")]), tmp_path / f"{SECOND}.pt")
    from hookkit.tools.bench.runner import _compare

    _compare(rows, tmp_path, None)
    assert [(r["nonfinite"], r["speedup"], r["psnr_db"]) for r in rows] == [(0, None, None), (2, None, None)]
    second = bench.markdown_table(rows).splitlines()[3].split("|")
    assert second[8].strip() == "2 non-finite output values: no PSNR"


def _compared(tmp_path: Path, eager: torch.Tensor, second: torch.Tensor) -> list[dict]:
    """The eager row and SECOND compared from their saved outputs, as `hookkit bench` compares its rows."""
    from hookkit.tools.bench.runner import _compare

    rows = [_row("eager", 4.0), _row(SECOND, 2.0)]
    for row, output in zip(rows, (eager, second), strict=True):
        row["peak_memory_gb"] = 1.0
        torch.save(output, tmp_path / f"{row['config']}.pt")
    _compare(rows, tmp_path, None)
    return rows


def test_a_row_whose_output_has_nan_gets_no_psnr_and_says_how_many_values(tmp_path: Path) -> None:
    eager = torch.arange(8.0)
    rows = _compared(tmp_path, eager, torch.tensor([0.0, float("nan"), 2, 3, float("inf"), 5, 6, 7]))
    assert [(r["nonfinite"], r["psnr_db"], r["identical"]) for r in rows] == [(0, None, True), (2, None, False)]
    second = bench.markdown_table(rows).splitlines()[3].split("|")
    assert (second[7].strip(), second[8].strip()) == ("—", "2 non-finite output values: no PSNR")


def test_a_row_whose_output_has_nan_gets_no_speedup_in_the_table(tmp_path: Path) -> None:
    rows = _compared(tmp_path, torch.arange(4.0), torch.tensor([0.0, float("nan"), 2, 3]))
    assert rows[1]["speedup"] == 2.0  # kept in the JSON: the time was measured
    second = bench.markdown_table(rows).splitlines()[3].split("|")
    assert second[6].strip() == "— (non-finite output)"


def test_an_eager_reference_with_nan_gives_no_row_a_psnr(tmp_path: Path) -> None:
    rows = _compared(tmp_path, torch.tensor([0.0, float("nan"), 2, 3]), torch.tensor([0.0, 1, 2, 3]))
    assert [(r["nonfinite"], r["psnr_db"], r["speedup"]) for r in rows] == [(1, None, 1.0), (0, None, 2.0)]
    eager = bench.markdown_table(rows).splitlines()[2].split("|")
    assert (eager[7].strip(), eager[8].strip()) == ("reference (non-finite)", "1 non-finite output value: no PSNR")


@pytest.mark.parametrize("rows,status", [
    ([("eager", "failed"), (SECOND, "ok")], 1),  # the eager row decides where there is one
    ([("eager", "ok"), (SECOND, "failed")], 0),
    ([("regional-compile", "skipped"), (SECOND, "ok")], 0),  # without it: any row that ran
    ([("regional-compile", "skipped"), (SECOND, "failed")], 1),
])
def test_bench_fails_when_eager_failed_or_without_eager_when_no_row_ran(rows: list[tuple[str, str]],
                                                                         status: int) -> None:
    from hookkit.tools.cli import _bench_status

    assert _bench_status([bench._empty_row(bench.CONFIGS[name], state, "") for name, state in rows]) == status


def test_default_matrix_keeps_what_runs_here_and_notes_the_rest() -> None:
    device = torch.device("cpu")
    configs, notes = bench.select_configs(None, device)
    have = bench.available_fields()
    runnable = [c.name for c in bench.CONFIGS.values() if c.unavailable(device, have) is None]
    assert [c.name for c in configs] == runnable and runnable[0] == "eager"
    assert sorted(n.split(":")[0] for n in notes) == sorted(set(bench.CONFIGS) - set(runnable))
    assert "regional-compile-ro: skipped (needs a CUDA device)" in notes


def test_unknown_configuration_is_a_field_error_naming_the_known_ones() -> None:
    with pytest.raises(SpecError, match=r"--configs: unknown configuration 'turbo'; known: \['eager', "):
        bench.select_configs(["eager", "turbo"], torch.device("cpu"))


def test_a_typo_in_a_configuration_name_gets_the_closest_match() -> None:
    with pytest.raises(SpecError, match=r"unknown configuration 'hookkit-cache-fsat'; did you mean 'hookkit-cache-fast'\? "):
        bench.select_configs(["eager", "hookkit-cache-fsat"], torch.device("cpu"))


def _timed_row(config: str, latencies: list[float]) -> dict:
    row = _row(config, statistics.median(latencies))
    row.update(latencies_s=latencies, peak_memory_gb=1.0, warmup_s=0.0)
    return row


def test_a_row_whose_spread_exceeds_the_difference_it_claims_is_flagged() -> None:
    eager = _timed_row("eager", [1.00, 1.05, 1.40])          # spread 0.40
    noisy = _timed_row("regional-compile", [0.80, 0.90, 0.95])  # claims 0.15 s faster: inside eager's spread
    clear = _timed_row("hookkit-cache-fast", [0.40, 0.41, 0.42])  # claims 0.64 s: larger than either spread
    assert bench.unresolved(noisy, eager) == ("not resolved: spread 0.4000 s > the 0.1500 s difference to eager "
                                              "(a busy host? more --runs)")
    assert bench.unresolved(clear, eager) is None
    assert bench.unresolved(eager, eager) is None
    table = bench.markdown_table([eager, noisy, clear]).splitlines()
    assert "not resolved" in table[3] and "not resolved" not in table[2] + table[4]
    assert table[3].split("|")[3].strip() == "0.8000–0.9500"


def test_a_row_without_timed_runs_has_no_spread() -> None:
    assert bench.spread(_row("eager", 1.0)) is None
    assert bench.unresolved(_row("hookkit", 1.0), _timed_row("eager", [1.0, 2.0])) is None


# --- timings of a tiny model on the CPU are labelled ---------------------------------------------------------------


def test_only_a_tiny_model_on_the_cpu_gets_a_timing_caveat() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # only compared, never used
    assert bench.timing_caveat(cpu, tiny=True) == ("CPU, tiny model: timings are not a performance claim; run on a "
                                                   "GPU with --full")
    assert (bench.timing_caveat(cpu, tiny=False), bench.timing_caveat(cuda, tiny=True)) == (None, None)


def test_a_tiny_cpu_row_carries_the_timing_caveat(tmp_path: Path) -> None:
    row = bench.measure(bench.CONFIGS["eager"], bench.ModelOptions(name="flux", steps=2), runs=1, warmup=0,
                        out_dir=tmp_path)
    assert (row["status"], row["timing_caveat"]) == ("ok", bench.TINY_CPU_TIMINGS)


def test_the_table_of_tiny_cpu_rows_says_above_and_below_that_timings_are_no_performance_claim() -> None:
    eager, cached = _timed_row("eager", [0.016, 0.017, 0.018]), _timed_row("hookkit-cache-fast", [0.020, 0.021, 0.022])
    for row, speedup in ((eager, 1.0), (cached, 0.017 / 0.021)):
        row.update(speedup=speedup, timing_caveat=bench.TINY_CPU_TIMINGS)
    lines = bench.markdown_table([eager, cached]).splitlines()
    assert lines[:2] == ["Note: CPU, tiny model: timings are not a performance claim; run on a GPU with --full.", ""]
    assert lines[-2:] == ["", "¹ CPU, tiny model: timings are not a performance claim; run on a GPU with --full."]
    body = [[cell.strip() for cell in line.split("|")[1:-1]] for line in lines[4:6]]
    assert [(cells[1], cells[5]) for cells in body] == [("0.0170 ¹", "1.00x ¹"), ("0.0210 ¹", "0.81x ¹")]


def test_a_table_without_the_caveat_is_the_bare_table() -> None:
    lines = bench.markdown_table([_timed_row("eager", [1.0, 1.1, 1.2])]).splitlines()
    assert lines[0].startswith("| config ") and len(lines) == 3 and "¹" not in lines[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_bench_full_without_a_gpu_is_refused_up_front() -> None:
    import time

    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "hookkit", "bench", "--full", "--model", "flux"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode == 2
    assert proc.stderr.startswith("hookkit bench: error: --full flux: no CUDA device is visible")
    assert "[1/" not in proc.stderr  # no row was started
    assert elapsed < 60  # the interpreter start and the import only (seconds; a loaded CI host is slower)


def test_hookkit_rows_run_exactly_when_their_features_and_packages_are_installed() -> None:
    cuda = torch.device("cuda")  # only compared, never used
    for config in bench.CONFIGS.values():
        if config.kind == "hookkit":
            needs = config.needs_module
            modules = (needs,) if isinstance(needs, str) else (needs or ())
            installed = all(importlib.util.find_spec(m) is not None for m in modules)
            assert (config.unavailable(cuda, HAVE) is None) == (config.fields <= HAVE and installed), config.name


def test_each_hookkit_row_declares_exactly_the_spec_fields_it_turns_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """`fields` decides whether a row runs here; a row that turned on an undeclared feature would fail late."""
    specs: list[hookkit.Spec] = []
    monkeypatch.setattr(hookkit, "enable", lambda pipe, spec: specs.append(spec))
    defaults = hookkit.Spec()
    for config in bench.CONFIGS.values():
        if config.kind == "hookkit":
            config.setup(bench.RunContext(pipe=None, opts=None))
            on = {f.name for f in attrs.fields(hookkit.Spec) if getattr(specs[-1], f.name) != getattr(defaults, f.name)}
            assert on == set(config.fields), config.name


def test_the_fastest_row_combines_a_static_mask_fp8_and_transformer_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    specs: list[hookkit.Spec] = []
    monkeypatch.setattr(hookkit, "enable", lambda pipe, spec: specs.append(spec))
    bench.CONFIGS["hookkit-fp8+cache-fast+cuda-graphs"].setup(bench.RunContext(pipe=None, opts=None))
    spec = specs[0]
    assert (spec.cache.steps_mask, spec.cache.mask_policy, spec.cache.taylorseer_order) == ("fast", "static", 0)
    assert (spec.quantize.scheme, spec.compile.cuda_graphs, spec.memo) == ("fp8_row", "transformer", True)


def test_cache_dit_with_regional_compile_caches_the_mask_inside_compiled_blocks(tmp_path: Path) -> None:
    pytest.importorskip("cache_dit")
    torch._dynamo.reset()
    opts = bench.ModelOptions(name="flux", steps=28)
    row = bench.measure(bench.CONFIGS["cache-dit+compile"], opts, runs=1, warmup=1, out_dir=tmp_path)
    mask = hookkit.techniques.cache.spec.resolve_steps_mask("fast", 28)
    assert (row["status"], row["kind"], row["compiled_graphs"], row["graphs_compiled_while_timed"]) == ("ok", "peer", 3, 0)
    assert row["features"]["cache"]["branches"]["cond"]["cached"] == [i for i, m in enumerate(mask) if m == 0]


def test_cache_dit_counts_each_experts_steps_from_0_and_the_per_expert_mask_computes_its_steps() -> None:
    """What `expert_steps_mask` assumes of cache-dit, checked on the tiny Wan 2.2 (steps 0-2 on `transformer`, 3-5 on
    `transformer_2`): on the same "fast" mask, hookkit's rows compute the steps cache-dit's rows compute."""
    cache_dit = pytest.importorskip("cache_dit")
    from hookkit.tools.bench.peers import cache_dit_steps
    from hookkit.tools.bench.row import expert_steps_mask

    mask = hookkit.techniques.cache.spec.resolve_steps_mask("fast", 6)
    peer = zoo.tiny_variant("wan22")
    cache_dit.enable_cache(peer, cache_config=cache_dit.DBCacheConfig(
        Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=0.12, max_warmup_steps=0,
        enable_separate_cfg=True, steps_computation_mask=list(mask), steps_computation_policy="static"))
    peer(**zoo.call_kwargs("wan", steps=6))
    stats = cache_dit.summary(peer, logging=False)
    # each expert's own step count: transformer_2's 0 is the pipeline's step 3
    assert [cache_dit_steps(stats[i:i + 1])["branches"]["cond"] for i in (0, 1)] == [
        {"cached": [1, 2], "computed": [0]}, {"cached": [1, 2], "computed": [0]}]
    pipe = zoo.tiny_variant("wan22")
    handle = hookkit.enable(pipe, hookkit.Spec(cache=hookkit.DBCache(
        fn_blocks=1, bn_blocks=0, warmup_steps=0, steps_mask=expert_steps_mask(pipe, mask, 6), mask_policy="static",
        taylorseer_order=0)))
    pipe(**zoo.call_kwargs("wan", steps=6))
    summary = handle.summary()
    assert [(s.features["cache"].data["branches"][0]["computed"], s.features["cache"].data["branches"][0]["cached"])
            for s in (summary, *summary.companions)] == [([0], [1, 2]), ([3], [4, 5])]


def test_psnr() -> None:
    ref = torch.zeros(2, 3, 4, 4)
    assert bench.psnr(ref, ref.clone(), peak=1.0) == math.inf
    assert bench.psnr(ref, ref + 0.1, peak=1.0) == pytest.approx(20.0)
    assert bench.psnr(torch.tensor([0.0, 2.0]), torch.tensor([0.0, 2.2])) == pytest.approx(10 * math.log10(4 / 0.02))
    with pytest.raises(SpecError, match="shapes differ"):
        bench.psnr(ref, torch.zeros(2, 3))


def test_json_is_strict_even_for_non_finite_statistics() -> None:
    text = bench.to_json({"psnr_db": None, "features": {"dbcache": {"diffs": [0.5, math.inf, math.nan]}}})
    assert json.loads(text) == {"psnr_db": None, "features": {"dbcache": {"diffs": [0.5, "inf", "nan"]}}}


@pytest.mark.parametrize("extra", [{"full": True}, {"full": True, "arch": "wan2.2-a14b", "frames": 9},
                                   {"model_path": "/models/wan", "prompt": "a red fox in the snow"}])
def test_model_options_round_trip_through_the_bench_one_flags(extra: dict) -> None:
    opts = bench.ModelOptions(name="wan", device="cpu", dtype="bfloat16", steps=5, height=48, width=64,
                              batch=2, seed=3, threads=1, **extra)
    args = cli.build_parser().parse_args(["bench-one", "--config", "eager", "--out-dir", "x", *opts.to_argv()])
    threads = torch.get_num_threads()
    try:
        assert cli._model_options(args, args.model) == opts
    finally:
        torch.set_num_threads(threads)  # _model_options applies --threads to this process


def test_full_size_call_kwargs_follow_the_transformer_config() -> None:
    """The prompt embeddings of --full are shaped by the transformer's config, read at call time (checked
    on the tiny config: the full one is 12B parameters)."""
    transformer = hookkit.tools.zoo.tiny_transformer("flux")
    pipe = type("P", (), {"transformer": transformer})()
    kwargs = bench.call_kwargs(pipe, bench.ModelOptions(name="flux", full=True, device="cpu", steps=3), "latent")
    assert kwargs["prompt_embeds"].shape == (1, bench.FULL_TEXT_TOKENS["flux"], transformer.config.joint_attention_dim)
    assert kwargs["pooled_prompt_embeds"].shape == (1, transformer.config.pooled_projection_dim)
    assert (kwargs["num_inference_steps"], kwargs["output_type"]) == (3, "latent")


@pytest.mark.parametrize(("name", "extra", "separate"), [
    ("flux", {}, False),                                    # guidance is embedded: one call per step
    ("qwenimage", {}, False),                               # true_cfg_scale=1.0, no negative prompt
    ("qwenimage", {"true_cfg_scale": 4.0}, True),           # true CFG: conditional then unconditional call
    ("wan", {}, True),                                      # negative prompt, guidance 5.0, two calls
    ("wan", {"guidance_scale": 1.0}, False),                # guidance off: one call
    ("hunyuanvideo15", {}, True),                           # the pipeline's guider: CFG 6.0, two calls
])
def test_cache_dit_is_told_whether_cfg_runs_as_separate_calls(name: str, extra: dict, separate: bool) -> None:
    from hookkit.tools import zoo

    kwargs = zoo.call_kwargs(name, steps=2, **extra)
    if name == "qwenimage" and "true_cfg_scale" in extra:
        kwargs["negative_prompt_embeds"] = kwargs["prompt_embeds"].clone()
        kwargs["negative_prompt_embeds_mask"] = kwargs["prompt_embeds_mask"].clone()
    assert bench.separate_cfg_calls(zoo.tiny_pipeline(name), kwargs) is separate


def _cache_dit_stat(cached: list[int], cfg_cached: list[int], executed: int, separate: bool) -> object:
    """A stand-in for cache-dit's `CacheStats` with the fields `bench.cache_dit_steps` reads."""
    from types import SimpleNamespace

    config = SimpleNamespace(enable_separate_cfg=separate)
    return SimpleNamespace(cached_steps=cached, cfg_cached_steps=cfg_cached, accumulated_executed_steps=executed,
                           cache_options={"cache_config": config})


def test_cache_dit_steps_read_like_hookkit_dbcache_data() -> None:
    data = bench.cache_dit_steps([_cache_dit_stat([2, 4], [], executed=6, separate=False)])
    assert data == {"source": "cache-dit", "branches": {"cond": {"cached": [2, 4], "computed": [0, 1, 3, 5]}}}
    assert bench.cache_stats({"cache": data}) == (2, 6)


def test_cache_dit_steps_count_both_branches_with_separate_cfg() -> None:
    data = bench.cache_dit_steps([_cache_dit_stat([3], [1, 3], executed=4, separate=True)])
    assert data["branches"] == {"cond": {"cached": [3], "computed": [0, 1, 2]},
                                "uncond": {"cached": [1, 3], "computed": [0, 2]}}
    assert bench.cache_stats({"cache": data}) == (3, 8)


def test_full_size_weights_are_counted_without_allocating_them() -> None:
    # Flux-dev: 11,901,408,320 parameters (counted on the meta device), two bytes each in bfloat16
    assert bench.full_transformer_bytes("flux", torch.bfloat16) == 23_802_816_640


def test_a_full_size_model_that_cannot_fit_is_refused_before_it_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    from hookkit.errors import UnsupportedError

    monkeypatch.setattr(bench.models, "_available_bytes", lambda device: 20 * 10**9)
    with pytest.raises(UnsupportedError, match=r"^--full flux: the full-size transformer needs 47.6 GB in float32, "
                                               r"cpu has 20.0 GB available. Run it on a GPU with enough memory, "
                                               r"or drop --full for the tiny model.$"):
        bench.load_pipeline(bench.ModelOptions(name="flux", full=True, device="cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_full_size_on_a_cpu_nobody_asked_for_is_refused_before_it_is_built() -> None:
    from hookkit.errors import UnsupportedError

    with pytest.raises(UnsupportedError, match=r"^--full wan: no CUDA device is visible, and the full-size wan "
                                               r"transformer \(1\.4 B parameters\) takes minutes per denoising step "
                                               r"on the CPU\. Run it on a CUDA GPU, drop --full for the tiny model, or "
                                               r"pass --device cpu to run it on the CPU anyway\.$"):
        bench.load_pipeline(bench.ModelOptions(name="wan", full=True))


def test_a_gpu_benchmark_script_without_cuda_ends_with_one_line_saying_what_runs_instead(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as end:
        bench.require_cuda("quant_flux.py", "On the CPU: hookkit generate flux --quantize int8_weight_only.")
    assert end.value.code == ("quant_flux.py: needs a CUDA device (full-size architectures on the GPU); none is "
                              "visible. On the CPU: hookkit generate flux --quantize int8_weight_only.")


def test_a_failed_rows_note_with_a_pipe_keeps_the_table_columns() -> None:
    row = bench._empty_row(bench.CONFIGS["hookkit"], "failed", "RuntimeError: a | b")
    header, _, line = bench.markdown_table([row]).splitlines()
    assert line.count("|") == header.count("|")
    assert "failed: RuntimeError: a / b" in line


# --- the strongest peer's row, cold starts --------------------------------------------------------------


class _FakeCacheDit:
    """Records what `_cache_dit_fp8_compile` hands cache-dit (cache-dit is not installable on this CPU box)."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, dict]] = []

    def enable_cache(self, pipe: object, **kwargs: object) -> object:
        self.calls.append((pipe, kwargs))
        return pipe

    @staticmethod
    def QuantizeConfig(**kwargs: object) -> dict:  # noqa: N802 (cache-dit's class name)
        return {"QuantizeConfig": kwargs}

    @staticmethod
    def DBCacheConfig(**kwargs: object) -> dict:  # noqa: N802
        return {"DBCacheConfig": kwargs}

    @staticmethod
    def summary(pipe: object, logging: bool = False) -> list:
        return []


def test_cache_dit_fp8_row_passes_its_own_per_row_fp8_to_enable_cache_then_compiles_the_blocks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeCacheDit()
    monkeypatch.setitem(sys.modules, "cache_dit", fake)
    pipe = hookkit.tools.zoo.tiny_pipeline("flux")
    compiled: list[dict] = []
    monkeypatch.setattr(pipe.transformer, "compile_repeated_blocks", lambda **kw: compiled.append(kw))
    config = bench.CONFIGS["cache-dit+fp8+compile"]
    assert (config.kind, config.needs_cuda, config.needs_module) == ("peer", True, "cache_dit")
    config.setup(bench.RunContext(pipe=pipe, opts=bench.ModelOptions(name="flux", steps=28)))
    [(target, kwargs)] = fake.calls
    assert target is pipe
    assert kwargs["quantize_config"] == {"QuantizeConfig": {"quant_type": "float8_per_row"}}
    assert kwargs["cache_config"]["DBCacheConfig"]["steps_computation_mask"] == list(
        hookkit.techniques.cache.spec.resolve_steps_mask("fast", 28))
    assert compiled == [{"fullgraph": True}]


def test_cache_dit_without_fp8_passes_no_quantize_config(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeCacheDit()
    monkeypatch.setitem(sys.modules, "cache_dit", fake)
    bench.CONFIGS["cache-dit"].setup(bench.RunContext(pipe=hookkit.tools.zoo.tiny_pipeline("flux"),
                                                      opts=bench.ModelOptions(name="flux", steps=6)))
    assert "quantize_config" not in fake.calls[0][1]


def row_specs(monkeypatch: pytest.MonkeyPatch, *names: str) -> list[hookkit.Spec]:
    """The hookkit specs the named rows enable (hookkit.enable recorded, nothing run)."""
    specs: list[hookkit.Spec] = []
    monkeypatch.setattr(hookkit, "enable", lambda pipe, spec: specs.append(spec))
    for name in names:
        bench.CONFIGS[name].setup(bench.RunContext(pipe=None, opts=None))
    return specs


def test_the_hookkit_cache_row_runs_the_documented_default_dbcache(monkeypatch: pytest.MonkeyPatch) -> None:
    [spec] = row_specs(monkeypatch, "hookkit-cache")
    assert spec == hookkit.Spec(cache=hookkit.DBCache())


def test_the_cachedit_settings_row_runs_cachedits_common_dynamic_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    [spec] = row_specs(monkeypatch, "hookkit-cache-cachedit-settings")
    assert spec == hookkit.Spec(cache=hookkit.DBCache(fn_blocks=1, bn_blocks=0, threshold=0.12, warmup_steps=8,
                                                      max_continuous_cached_steps=3, taylorseer_order=0))


def test_the_modulation_row_is_the_fastest_row_with_the_modulation_linears_quantized(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fastest, modulation = row_specs(
        monkeypatch, "hookkit-fp8+cache-fast+cuda-graphs", "hookkit-fp8-mod+cache-fast+cuda-graphs")
    assert modulation.quantize == attrs.evolve(fastest.quantize, include_modulation=True)
    assert (modulation.cache, modulation.compile, modulation.memo) == (fastest.cache, fastest.compile, fastest.memo)


def test_the_autotune_row_is_the_modulation_row_with_autotuned_regions(monkeypatch: pytest.MonkeyPatch) -> None:
    modulation, autotune = row_specs(
        monkeypatch, "hookkit-fp8-mod+cache-fast+cuda-graphs", "hookkit-fp8-mod+cache-fast+cuda-graphs+autotune")
    assert autotune == attrs.evolve(modulation, compile=attrs.evolve(modulation.compile,
                                                                     mode="max-autotune-no-cudagraphs"))


def test_the_uncached_row_is_the_modulation_row_without_its_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    modulation, uncached = row_specs(
        monkeypatch, "hookkit-fp8-mod+cache-fast+cuda-graphs", "hookkit-fp8-mod+cuda-graphs")
    assert uncached == attrs.evolve(modulation, cache=None)


@pytest.mark.parametrize(("suffix", "change"), [
    ("rows-exact", {"fuse_fp8_rows": "exact"}), ("rows-off", {"fuse_fp8_rows": "off"}),
    ("rope-complex", {"real_rope": False}),
])
def test_a_variant_row_is_the_modulation_row_with_one_compile_setting_changed(
        suffix: str, change: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    modulation, variant = row_specs(
        monkeypatch, "hookkit-fp8-mod+cache-fast+cuda-graphs", f"hookkit-fp8-mod+cache-fast+cuda-graphs+{suffix}")
    assert variant == attrs.evolve(modulation, compile=attrs.evolve(modulation.compile, **change))


def test_cold_env_points_every_compiler_cache_at_a_new_empty_folder(tmp_path: Path) -> None:
    env = bench.cold_env(tmp_path / "row", {"PATH": "/bin", "TORCHINDUCTOR_CACHE_DIR": "/warm"})
    assert set(env) == {"PATH", "HOOKKIT_BENCH_COLD", *bench.COLD_CACHE_VARS}
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "row" / "torchinductor_cache_dir")
    assert env["TRITON_CACHE_DIR"] == str(tmp_path / "row" / "triton_cache_dir")
    assert all(list(Path(env[v]).iterdir()) == [] for v in bench.COLD_CACHE_VARS)
    with pytest.raises(FileExistsError):  # never an old folder: a reused one would not be cold
        bench.cold_env(tmp_path / "row", {})


@pytest.mark.slow
def test_a_cold_row_runs_on_its_own_fresh_caches_and_reports_time_to_first_image(tmp_path: Path) -> None:
    """An uncompiled row keeps this fast (a cold inductor compile of even the tiny Flux takes minutes on 2
    cores); what is checked is that the row's process saw new folders, gone after the row."""
    row = bench._run_child(bench.CONFIGS["hookkit"], bench.ModelOptions(name="flux", steps=2), runs=1, warmup=1,
                           timeout_s=600, out_dir=tmp_path, cold=True)
    assert row["status"] == "ok", row["note"]
    folders = [row["cold"][var] for var in bench.COLD_CACHE_VARS]
    assert len(set(folders)) == 2 and all(f.startswith(tempfile.gettempdir()) for f in folders)
    assert not any(Path(f).exists() for f in folders)
    assert row["cold"]["files_written"] == {var: 0 for var in bench.COLD_CACHE_VARS}
    assert row["time_to_first_image_s"] == row["setup_s"] + row["first_call_s"]
    assert 0 < row["first_call_s"] <= row["warmup_s"]
    assert f"cold caches: first image {row['time_to_first_image_s']:.1f} s after enable" in bench.markdown_table([row])


def test_a_warm_row_reports_no_cold_caches(tmp_path: Path) -> None:
    row = bench.measure(bench.CONFIGS["eager"], bench.ModelOptions(name="flux", steps=2), runs=1, warmup=0,
                        out_dir=tmp_path)
    assert row["cold"] is None
    assert row["first_call_s"] == row["latencies_s"][0]  # no warm-up: the first timed call is the first call


def test_the_dynamic_row_caches_the_fast_masks_steps_through_the_threshold() -> None:
    """Its step set must be the static row's, so that their times differ only by the cost of deciding."""
    from hookkit.techniques.cache.spec import resolve_steps_mask

    pipe = hookkit.tools.zoo.tiny_pipeline("flux")
    specs: list[hookkit.Spec] = []
    with pytest.MonkeyPatch.context() as m:
        m.setattr(hookkit, "enable", lambda p, spec: specs.append(spec))
        bench.CONFIGS["hookkit-fp8+cache-dyn+cuda-graphs"].setup(bench.RunContext(pipe=None, opts=None))
    handle = hookkit.enable(pipe, hookkit.Spec(cache=specs[0].cache))
    pipe(**hookkit.tools.zoo.call_kwargs("flux", steps=28))
    [branch] = handle.summary().features["cache"].data["branches"].values()
    mask = resolve_steps_mask("fast", 28)
    assert branch["cached"] == [i for i, m in enumerate(mask) if m == 0]
    assert sorted(branch["diffs"]) == branch["cached"]  # each decided by a measured diff, not by the mask


# --- the video rows, full-size Wan ---------------------------------------------------------------


def test_the_video_group_is_the_video_matrix_with_eager_first() -> None:
    configs, notes = bench.select_configs(["video"], torch.device("cuda"))  # only the type is read
    assert [c.name for c in configs] == ["eager", "regional-compile", "fbcache", "magcache", "cache-dit+fp8+compile",
                                         "cache-dit+fp8+compile+sage", "hookkit-fp8+cuda-graphs",
                                         "hookkit-fp8+cache-fast+cuda-graphs", "hookkit-fp8+compile+fp8-attention",
                                         "hookkit-fp8+cache-fast+compile+fp8-attention",
                                         "hookkit-fp8+cache-fast-output+compile+fp8-attention",
                                         "hookkit-fp8+compile+flashinfer-attention",
                                         "hookkit-fp8+compile+flashinfer-fp8-attention",
                                         "hookkit-fp8+cache-fast+compile+flashinfer-fp8-attention",
                                         "hookkit-fp8+cache-fast-output+compile+flashinfer-fp8-attention"]
    assert notes == []


def test_the_output_row_caches_the_fast_steps_running_nothing_of_the_transformer_on_a_cached_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    seen: list[hookkit.Spec] = []
    monkeypatch.setattr(hookkit, "enable", lambda pipe, spec: seen.append(spec))
    for kernel in ("", "flashinfer-"):
        seen.clear()
        for name in (f"hookkit-fp8+cache-fast-output+compile+{kernel}fp8-attention",
                     f"hookkit-fp8+cache-fast+compile+{kernel}fp8-attention"):
            bench.CONFIGS[name].setup(SimpleNamespace(pipe=None, handle=None))
        output, residual = seen
        assert (output.cache.extrapolate, output.cache.fn_blocks, output.cache.steps_mask) == ("output", 0, "fast")
        assert (residual.cache.extrapolate, residual.cache.fn_blocks, residual.cache.steps_mask) == ("residual", 1,
                                                                                                     "fast")
        assert attrs.evolve(output, cache=None) == attrs.evolve(residual, cache=None)  # everything else alike


def test_the_fa3_rows_are_the_flashinfer_rows_with_fa3s_own_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    seen: list[hookkit.Spec] = []
    monkeypatch.setattr(hookkit, "enable", lambda pipe, spec: seen.append(spec))
    for row in ("hookkit-fp8+compile+{}-fp8-attention", "hookkit-fp8+cache-fast-output+compile+{}-fp8-attention"):
        seen.clear()
        for kernel in ("fa3", "flashinfer"):
            bench.CONFIGS[row.format(kernel)].setup(SimpleNamespace(pipe=None, handle=None))
        fa3, flashinfer = seen
        assert (fa3.attention.low_precision, flashinfer.attention.low_precision) == ("fa3_fp8", "flashinfer_fp8")
        assert attrs.evolve(fa3, attention=None) == attrs.evolve(flashinfer, attention=None)
        assert bench.CONFIGS[row.format("fa3")].needs_module == "flash_attn_interface"


def test_the_fastest_image_row_with_fp8_attention_runs_it_under_transformer_graphs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from hookkit.core import compat

    from types import SimpleNamespace

    seen: dict[str, hookkit.Spec] = {}
    monkeypatch.setattr(hookkit, "enable", lambda pipe, spec: seen.setdefault("spec", spec))
    bench.CONFIGS["hookkit-fp8-mod+cache-fast+cuda-graphs+fp8-attention"].setup(SimpleNamespace(pipe=None, handle=None))
    spec = seen["spec"]
    assert spec.attention == hookkit.Attention(low_precision="hookkit_fp8")
    assert spec.compile.cuda_graphs == "transformer" and spec.cache.mask_policy == "static"
    assert [r.features for r, _ in compat.outcome(spec, hookkit.get_adapter("flux")) if r.outcome == "refused"] == []


def test_a_row_needing_several_packages_names_the_first_one_missing() -> None:
    row = bench.CONFIGS["cache-dit+fp8+compile+sage"]
    assert row.needs_module == ("cache_dit", "sageattention")
    missing = [name for name in row.needs_module if importlib.util.find_spec(name) is None]
    expected = f"{missing[0]} is not installed" if missing else None
    assert row.unavailable(torch.device("cuda"), frozenset()) == expected


@pytest.mark.parametrize(("name", "arch", "parameters"), [
    ("wan", "wan2.1-1.3b", 1_418_996_800),
    ("wan", "wan2.1-14b", 14_288_491_584),
    ("wan", "wan2.2-a14b", 2 * 14_288_491_584),  # two experts of the 14B config
    ("hunyuanvideo15", "hunyuanvideo1.5-480p", 8_326_608_160),
])
def test_full_size_video_architectures_build_on_the_meta_device_with_their_parameter_counts(
        name: str, arch: str, parameters: int) -> None:
    assert bench.full_transformer_parameters(name, arch) == parameters


def test_the_full_size_wan_default_is_the_1_3b_architecture() -> None:
    assert bench.full_transformer_parameters("wan") == bench.full_transformer_parameters("wan", "wan2.1-1.3b")


def test_wan22_a14b_is_a_pipeline_of_two_experts_switching_at_the_boundary_ratio() -> None:
    pipe = bench.skeleton_pipeline(bench.ModelOptions(name="wan", full=True, arch="wan2.2-a14b"))
    assert pipe.config.boundary_ratio == 0.875
    assert pipe.transformer_2 is not pipe.transformer
    assert dict(pipe.transformer_2.config) == dict(pipe.transformer.config)
    assert pipe.transformer.config.num_layers == 40 and pipe.transformer.device.type == "meta"


def test_full_size_wan_runs_its_pipelines_50_steps_by_default() -> None:
    assert bench.ModelOptions(name="wan", full=True, arch="wan2.1-14b").num_steps() == 50
    assert bench.ModelOptions(name="wan", full=True, arch="wan2.1-14b", steps=6).num_steps() == 6
    assert bench.ModelOptions(name="flux", full=True).num_steps() == 28


@pytest.mark.parametrize(("opts", "message"), [
    (bench.ModelOptions(name="wan", arch="wan2.1-14b"),
     "--arch wan2.1-14b: names a full-size architecture, only with --full. Add --full."),
    (bench.ModelOptions(name="flux", full=True, arch="wan2.1-14b"),
     "--arch: expected a full-size architecture of MODEL 'flux' (none for flux; all: ['wan2.1-1.3b', 'wan2.1-14b', "
     "'wan2.2-a14b', 'hunyuanvideo1.5-480p']), got 'wan2.1-14b'."),
    (bench.ModelOptions(name="wan", full=True, arch="wan2.1-7b"),
     "--arch: expected a full-size architecture of MODEL 'wan' (for wan: ['wan2.1-1.3b', 'wan2.1-14b', "
     "'wan2.2-a14b']), got 'wan2.1-7b'."),
])
def test_an_architecture_of_another_family_or_without_full_is_refused(opts: bench.ModelOptions, message: str) -> None:
    with pytest.raises(SpecError) as error:
        bench.check_model(opts)
    assert str(error.value) == message


def test_the_peer_row_computes_hookkits_fast_mask_at_any_step_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """cache-dit's own "fast" mask at 6 steps computes 0, 1, 2, 5; hookkit's cached row computes 0, 3, 5."""
    fake = _FakeCacheDit()
    monkeypatch.setitem(sys.modules, "cache_dit", fake)
    pipe = hookkit.tools.zoo.tiny_pipeline("wan")
    monkeypatch.setattr(pipe.transformer, "compile_repeated_blocks", lambda **kw: None)
    bench.CONFIGS["cache-dit+fp8+compile"].setup(bench.RunContext(pipe=pipe, opts=bench.ModelOptions(name="wan", steps=6)))
    config = fake.calls[0][1]["cache_config"]["DBCacheConfig"]
    assert config["steps_computation_mask"] == [1, 0, 0, 1, 0, 1]
    assert config["enable_separate_cfg"] is True  # Wan's CFG: two transformer calls per step


def _diffusers_hooks(transformer: torch.nn.Module) -> set[str]:
    return {name for module in transformer.modules() if hasattr(module, "_diffusers_hook")
            for name in module._diffusers_hook.hooks}


@pytest.mark.parametrize(("config", "hooks"), [
    ("fbcache", {"fbc_leader_block_hook", "fbc_block_hook"}),
    ("magcache", {"mag_cache_leader_block_hook", "mag_cache_block_hook"}),
])
def test_a_stock_cache_row_sets_up_both_experts_of_wan22(config: str, hooks: set[str]) -> None:
    pipe = hookkit.tools.zoo.tiny_variant("wan22")
    bench.CONFIGS[config].setup(bench.RunContext(pipe=pipe, opts=bench.ModelOptions(name="wan", steps=4)))
    assert _diffusers_hooks(pipe.transformer) == hooks
    assert _diffusers_hooks(pipe.transformer_2) == hooks


def test_the_magcache_row_runs_the_tiny_wan(tmp_path: Path) -> None:
    row = bench.measure(bench.CONFIGS["magcache"], bench.ModelOptions(name="wan", steps=4, frames=5), runs=1,
                        warmup=0, out_dir=tmp_path)
    assert (row["status"], row["kind"]) == ("ok", "stock"), row["note"]
    assert torch.load(tmp_path / "magcache.pt").shape == (1, 5, 3, 16, 16)  # decoded: (batch, frames, rgb, h, w)


def test_hunyuanvideo15_at_480x848_and_121_frames_is_31_latent_frames_of_30_by_53_tokens() -> None:
    from hookkit.tools import local

    pipe = bench.skeleton_pipeline(bench.ModelOptions(name="hunyuanvideo15", full=True))
    assert local.latent_tokens(pipe, 480, 848, 121) == 31 * 30 * 53 == 49_290


def test_the_tiny_hunyuanvideo15_runs_through_a_bench_row(tmp_path: Path) -> None:
    row = bench.measure(bench.CONFIGS["hookkit-cache-fast"], bench.ModelOptions(name="hunyuanvideo15", steps=6),
                        runs=1, warmup=0, out_dir=tmp_path)
    assert row["status"] == "ok", row["note"]
    mask = hookkit.techniques.cache.spec.resolve_steps_mask("fast", 6)
    cached = [i for i, m in enumerate(mask) if m == 0]
    assert {name: b["cached"] for name, b in row["features"]["cache"]["branches"].items()} == {0: cached, 1: cached}


# --- benchmarks/profile_config.py: a configuration that cannot run here ends in one line ------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fp8 default runs where CUDA is")
def test_profile_config_on_the_cpu_refuses_its_fp8_default_in_one_line(benchmark_script, capsys) -> None:
    assert benchmark_script("profile_config").main(["--tiny"]) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", "profile_config.py: error: --config hookkit-fp8+compile: needs a CUDA device (this run: "
                              "cpu). Pick one that runs here (`hookkit bench --list`), e.g. --config hookkit-compile.\n")


def test_profile_config_profiles_a_video_pipeline_at_the_frames_it_is_given(benchmark_script, capsys) -> None:
    assert benchmark_script("profile_config").main(["--tiny", "--model", "wan", "--frames", "5", "--config", "eager",
                                                    "--warmup", "1", "--rows", "3"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("eager on wan (tiny, 5 frames, 4 steps), CPU")


def test_profile_config_sums_the_host_operators_by_group_on_the_cpu(benchmark_script, capsys) -> None:
    assert benchmark_script("profile_config").main(["--tiny", "--model", "wan", "--frames", "5", "--config", "eager",
                                                    "--warmup", "1", "--rows", "3"]) == 0
    line = capsys.readouterr().out.splitlines()[3]
    groups = dict(part.rsplit(" ", 1) for part in line.removeprefix("host operator ms by group: ").split(", "))
    assert list(groups) == ["attention", "activation quantization", "GEMMs", "RoPE", "norms+modulation", "other"]
    assert float(groups["attention"]) > 0 and float(groups["GEMMs"]) > 0  # the tiny Wan's SDPA and Linears ran


def test_profile_config_ends_a_hookkit_refusal_in_one_line_naming_its_model_flag(benchmark_script, capsys) -> None:
    assert benchmark_script("profile_config").main(["--tiny", "--model", "sd3", "--config", "hookkit"]) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", "profile_config.py: error: --model 'sd3': no tiny pipeline for sd3 yet (random-weight "
                              "pipelines, tiny and --full, exist for ['cogvideox', 'flux', 'hunyuanvideo15', 'qwenimage', "
                              "'wan']). Pass --model-path with a local sd3 checkpoint folder instead.\n")
