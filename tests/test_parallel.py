"""Context parallelism: refusals in one process; decisions, outputs and removal in 2-process gloo runs.

The 2-process runs start `tests/cp_worker.py` twice (ranks 0 and 1, gloo on 127.0.0.1) and read back each rank's
JSON. Hard limits: gloo times out after 20 s inside the workers (a deadlock raises there), and the launcher kills
both processes after `LAUNCH_TIMEOUT_S` whatever happens, so CI never hangs.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import hookkit
from hookkit.errors import SpecError, UnsupportedError
from hookkit.tools import zoo

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("cp_worker.py")
LAUNCH_TIMEOUT_S = 240.0


@pytest.mark.parametrize("value", ["abc", "-5", "inf"])
def test_a_gloo_timeout_that_is_no_positive_number_ends_the_worker_naming_the_variable(
        value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import cp_worker

    monkeypatch.setenv("HOOKKIT_TEST_GLOO_TIMEOUT", value)
    with pytest.raises(SystemExit) as exit_:
        cp_worker.gloo_timeout_s()
    assert str(exit_.value) == (f"HOOKKIT_TEST_GLOO_TIMEOUT={value!r}: expected a number of seconds > 0 (gloo's "
                                f"timeout), got {value!r}. Set e.g. HOOKKIT_TEST_GLOO_TIMEOUT=60, or unset it for 20.")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(tmp: Path, argv: list[str], world: int = 2, timeout: float = LAUNCH_TIMEOUT_S) -> list[str]:
    """Start `world` processes of `python argv...` as ranks of one gloo group; fail (never hang) past `timeout`.

    Returns each rank's combined output. Raises `pytest.fail` with the output tails when a rank fails or time runs
    out (the processes are killed by their pid first).
    """
    port = _free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        log = open(tmp / f"rank{rank}.log", "w+")
        procs.append((subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env, stdout=log,
                                       stderr=subprocess.STDOUT), log))
    failed = None
    try:
        for proc, _ in procs:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                failed = f"timed out after {timeout:.0f} s"
                break
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    outputs = []
    for proc, log in procs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
        if failed is None and proc.returncode != 0:
            failed = f"a rank exited with {proc.returncode}"
    if failed is not None:
        tails = "\n".join(f"--- rank {r} ---\n{o[-3000:]}" for r, o in enumerate(outputs))
        pytest.fail(f"2-process run {argv}: {failed}\n{tails}")
    return outputs


@pytest.fixture(scope="module")
def ulysses(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Both ranks' results of the Ulysses-2 scenario (tiny Flux, 4 steps)."""
    tmp = tmp_path_factory.mktemp("ulysses")
    run_ranks(tmp, [str(WORKER), str(tmp), "ulysses"])
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


# --- one process: what is refused before anything is attached -----------------------------------------------------


def test_context_parallel_needs_two_ranks_per_sequence() -> None:
    with pytest.raises(SpecError, match=r"ulysses \* ContextParallel.ring: expected at least 2 ranks"):
        hookkit.ContextParallel(ulysses=1, ring=1)


def test_context_parallel_spec_round_trips_through_a_dict() -> None:
    spec = hookkit.Spec(parallel=hookkit.ContextParallel(ulysses=2, attention_backend="native"))
    assert hookkit.Spec.from_dict(spec.to_dict()) == spec


def test_parallel_refused_without_a_process_group() -> None:
    pipe = zoo.tiny_pipeline("flux")
    before = sorted(pipe.transformer.__dict__)
    with pytest.raises(UnsupportedError, match="expected an initialised torch.distributed process group"):
        hookkit.enable(pipe, hookkit.Spec(parallel=hookkit.ContextParallel(ulysses=2)))
    assert sorted(pipe.transformer.__dict__) == before
    assert hookkit.handle_of(pipe) is None


def test_parallel_refused_for_a_model_without_cp_plan_or_adapter_plan() -> None:
    with pytest.raises(UnsupportedError, match=r"got CogVideoXTransformer3DModel without one and adapter 'cogvideox' "
                                               r"without \[\[cp_plan\]\]. Add \[\[cp_plan\]\] tables to an adapter"):
        hookkit.build_plan(zoo.tiny_pipeline("cogvideox"), hookkit.Spec(parallel=hookkit.ContextParallel(ulysses=2)))


def test_a_class_without_cp_plan_uses_its_adapter_plan() -> None:
    from diffusers_configs import build

    from hookkit.techniques.parallel.hooks import resolve_cp_plan

    transformer = build("SkyReelsV2Transformer")
    adapter = hookkit.get_adapter("skyreelsv2")
    assert type(transformer)._cp_plan is None
    plan, origin, plan_from = resolve_cp_plan(transformer, adapter)
    assert (plan, origin, plan_from) == (adapter.diffusers_cp_plan(), "adapter", f"adapter 'skyreelsv2' ({adapter.source})")
    spec = hookkit.Spec(parallel=hookkit.ContextParallel(ulysses=2))
    assert hookkit.build_plan(transformer, spec).targets("parallel") == [("", "hookkit.parallel.context")]


def test_the_class_plan_wins_over_an_adapter_plan_unless_the_adapter_overrides_it() -> None:
    import attrs

    from hookkit.techniques.parallel.hooks import resolve_cp_plan

    wan = zoo.tiny_transformer("wan")
    planned = attrs.evolve(hookkit.get_adapter("wan"), cp_plan=hookkit.get_adapter("skyreelsv2").cp_plan)
    assert resolve_cp_plan(wan, planned) == (dict(type(wan)._cp_plan), "class", "diffusers (WanTransformer3DModel._cp_plan)")
    overriding = attrs.evolve(planned, cp_plan_override=True)
    assert resolve_cp_plan(wan, overriding)[:2] == (planned.diffusers_cp_plan(), "adapter")


def test_parallel_refused_for_a_backend_without_context_parallel() -> None:
    spec = hookkit.Spec(parallel=hookkit.ContextParallel(ulysses=2, attention_backend="_native_math"))
    with pytest.raises(UnsupportedError, match="got '_native_math'"):
        hookkit.build_plan(zoo.tiny_pipeline("flux"), spec)


def test_ring_refused_with_the_native_backend() -> None:
    with pytest.raises(UnsupportedError, match="log-sum-exp, which the 'native' backend's op does not return"):
        hookkit.build_plan(zoo.tiny_pipeline("flux"), hookkit.Spec(parallel=hookkit.ContextParallel(ring=2)))


def test_ulysses_refused_when_it_does_not_divide_the_heads() -> None:
    with pytest.raises(SpecError, match="divisor of FluxTransformer2DModel's 2 attention heads, got 4"):
        hookkit.build_plan(zoo.tiny_pipeline("flux"), hookkit.Spec(parallel=hookkit.ContextParallel(ulysses=4)))


def test_parse_parallel_reads_the_cli_form() -> None:
    from hookkit.tools.distributed import parse_parallel

    assert parse_parallel("ulysses=2") == hookkit.ContextParallel(ulysses=2)
    assert parse_parallel("ring=2,attention_backend=_native_cudnn") == hookkit.ContextParallel(
        ring=2, attention_backend="_native_cudnn")
    with pytest.raises(SpecError, match="expected comma-separated key=value with keys"):
        parse_parallel("degree=2")


def test_generate_parallel_outside_torchrun_exits_2_with_the_fix(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from hookkit.tools import cli

    monkeypatch.delenv("RANK", raising=False)
    assert cli.main(["generate", "flux", "--parallel", "ulysses=2", "--steps", "2"]) == 2
    assert "run under torchrun (RANK and WORLD_SIZE set)" in capsys.readouterr().err


def test_one_process_cache_makes_no_collective_and_reports_no_mesh() -> None:
    pipe = zoo.tiny_pipeline("flux")
    handle = hookkit.enable(pipe, hookkit.Spec(cache=hookkit.DBCache(threshold=0.3, warmup_steps=1)))
    pipe(**zoo.call_kwargs("flux", steps=3))
    from hookkit.techniques.cache.hooks import NAME

    data = handle.summary().features[NAME].data
    assert (data["parallel"], data["collectives"], sorted(data["branches"][0]["diffs"])) == (None, 0, [1, 2])


# --- two processes, Ulysses over gloo ---------------------------------------------------------------------------


@pytest.mark.slow
def test_cp_alone_matches_one_process(ulysses: list[dict[str, Any]]) -> None:
    assert [r["cp_alone_max_abs"] < 1e-5 for r in ulysses] == [True, True]
    assert ulysses[0]["cp_alone_digest"] == ulysses[1]["cp_alone_digest"]


@pytest.mark.slow
def test_spec_parallel_refused_on_a_transformer_diffusers_already_parallelised(ulysses: list[dict[str, Any]]) -> None:
    for r in ulysses:
        assert r["already_parallel_error"].startswith(
            "EnableError: Spec.parallel on FluxTransformer2DModel: expected a transformer diffusers has not "
            "parallelised yet, got one with enable_parallelism already applied. hookkit rides on it as it is")
        assert r["already_parallel_left_no_handle"] is True


@pytest.mark.slow
def test_attention_under_ulysses_answers_the_whole_sequence_of_each_ranks_heads(ulysses: list[dict[str, Any]]) -> None:
    for r in ulysses:
        # tiny Flux: 2 heads of 8, 64 image + 8 text tokens; after diffusers' all-to-all each rank attends with 1 head
        # over all 72 tokens, and hookkit's kernel choice answers that call
        assert [tuple(s) for s in r["attention"]["shapes"]] == [(1, 1, 72, 8)]
        assert r["attention"]["middle"] == {"steps": [1, 2], "block_calls": {"_native_math": 10},
                                            "attention_calls": {"_native_math": 10}}
        assert r["attention"]["max_abs_vs_single"] < 1e-5
    assert ulysses[0]["attention"]["digest"] == ulysses[1]["attention"]["digest"]


@pytest.mark.slow
def test_empty_spec_leaves_cp_output_bitwise_and_disable_leaves_cp_working(ulysses: list[dict[str, Any]]) -> None:
    assert [(r["spec_empty_equal"], r["after_disable_equal"]) for r in ulysses] == [(True, True), (True, True)]


@pytest.mark.slow
@pytest.mark.parametrize("order", ["hookkit_first", "cp_first"])
def test_static_mask_under_cp_caches_the_mask_steps_without_collectives(ulysses: list[dict[str, Any]],
                                                                        order: str) -> None:
    for r in ulysses:
        assert r[f"static_{order}"]["cached"] == r["static_single"]["cached"] == [2]
        assert r[f"static_{order}"]["collectives"] == 0
    assert ulysses[0][f"static_{order}"]["digest"] == ulysses[1][f"static_{order}"]["digest"]


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["magnitude", "schedule", "default", "output"])
def test_planned_rules_under_cp_cache_the_one_process_steps_without_collectives(ulysses: list[dict[str, Any]],
                                                                                rule: str) -> None:
    # schedule: step 3 is nearly step 2 (gram 0.9); default: DBCache(speedup=1.3), the calibration-free plan; output:
    # the same plan with the transformer's output extrapolated
    expected = {"magnitude": [2], "schedule": [3], "default": [2], "output": [2]}[rule]
    for r in ulysses:
        assert r[f"{rule}_hookkit_first"]["cached"] == r[f"{rule}_single"]["cached"] == expected
        assert r[f"{rule}_hookkit_first"]["collectives"] == 0
    assert ulysses[0][f"{rule}_hookkit_first"]["digest"] == ulysses[1][f"{rule}_hookkit_first"]["digest"]


@pytest.mark.slow
def test_threshold_straddles_the_ranks_local_diffs(ulysses: list[dict[str, Any]]) -> None:
    """The premise of the dynamic test: decided per rank, rank 0 and rank 1 would disagree at step 1."""
    low, high = sorted(ulysses[0]["local_diffs_step1"])
    assert low < ulysses[0]["threshold"] < high
    assert ulysses[0]["local_diffs_step1"] == ulysses[1]["local_diffs_step1"]


@pytest.mark.slow
@pytest.mark.parametrize("order", ["hookkit_first", "cp_first"])
def test_dynamic_decisions_under_cp_are_global_and_equal_to_one_process(ulysses: list[dict[str, Any]],
                                                                       order: str) -> None:
    single = ulysses[0]["dynamic_single"]
    assert 1 in single["cached"] or 1 in single["computed"]
    for r in ulysses:
        run = r[f"dynamic_{order}"]
        assert (run["cached"], run["computed"]) == (single["cached"], single["computed"])
        assert run["diffs"].keys() == single["diffs"].keys()
        assert max(abs(run["diffs"][k] - single["diffs"][k]) for k in single["diffs"]) < 1e-6
        assert run["collectives"] == len(single["diffs"])
        assert run["parallel"]["world_size"] == 2 and run["parallel"]["ulysses"] == 2
    assert ulysses[0][f"dynamic_{order}"]["digest"] == ulysses[1][f"dynamic_{order}"]["digest"]


@pytest.mark.slow
def test_ring_with_a_test_only_cpu_op_matches_one_process_and_its_decisions(ulysses: list[dict[str, Any]]) -> None:
    """Ring attention on the CPU needs an op returning the log-sum-exp: tests/cp_worker.py's `cpu_ring_op`
    (test-only, math attention under the `_native_flash` name)."""
    single = ulysses[0]["dynamic_single"]
    for r in ulysses:
        ring = r["ring"]
        assert ring["max_abs_vs_single"] < 1e-5
        assert (ring["cached"], ring["computed"]) == (single["cached"], single["computed"])
        assert ring["collectives"] == len(single["diffs"])
        assert (ring["backend"], ring["removal_state_equal"]) == ("_native_flash", True)
    assert ulysses[0]["ring"]["digest"] == ulysses[1]["ring"]["digest"]


@pytest.mark.slow
def test_uneven_shards_keep_the_statistic_exact(ulysses: list[dict[str, Any]]) -> None:
    """81 tokens split 41 + 40 (ulysses_anything): summed numerators and denominators give the one-process diff,
    where a mean of the per-rank ratios does not."""
    assert [r["uneven"]["shard_tokens"] for r in ulysses] == [41, 40]
    for r in ulysses:
        u = r["uneven"]
        assert abs(u["global"] - u["single"]) < 1e-6
        assert abs(u["mean_of_ratios"] - u["single"]) > 1e-3


@pytest.mark.slow
def test_spec_parallel_takes_the_same_decisions_and_summarises_the_mesh(ulysses: list[dict[str, Any]]) -> None:
    single = ulysses[0]["dynamic_single"]
    for rank, r in enumerate(ulysses):
        run = r["spec_parallel"]
        assert (run["cached"], run["computed"]) == (single["cached"], single["computed"])
        summary = run["summary"]
        assert (summary["ulysses"], summary["ring"], summary["attention_backend"]) == (2, 1, "native")
        assert (summary["world_size"], summary["rank"]) == (2, rank)
        assert "ulysses" in summary["mesh"] and "ring" in summary["mesh"]
    assert "context parallel: ulysses 2 x ring 1" in ulysses[0]["spec_parallel_text"]


@pytest.mark.slow
def test_spec_parallel_refuses_a_sequence_the_degree_does_not_divide(ulysses: list[dict[str, Any]]) -> None:
    for r in ulysses:
        assert r["odd_sequence_error"].startswith("UnsupportedError: FluxTransformer2DModel.forward(hidden_states): "
                                                  "context parallelism over 2 ranks splits dim 1 of size 81")


@pytest.mark.slow
def test_spec_parallel_removal_restores_every_module_and_processor(ulysses: list[dict[str, Any]]) -> None:
    assert [(r["removal_state_equal"], r["removal_parallel_config"], r["after_removal_equal_single"])
            for r in ulysses] == [(True, False, True), (True, False, True)]


# --- two processes: SkyReels-V2 by its adapter's [[cp_plan]] (diffusers 0.42.1 has no `_cp_plan` for it) ----------


@pytest.fixture(scope="module")
def adapter_plan(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Both ranks' results of tests/cp_worker.py's `adapter_plan` scenario (tiny SkyReels-V2, Ulysses 2, 4 steps)."""
    tmp = tmp_path_factory.mktemp("adapter_plan")
    run_ranks(tmp, [str(WORKER), str(tmp), "adapter_plan"])
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_adapter_plan_output_matches_one_process(adapter_plan: list[dict[str, Any]]) -> None:
    assert [r["cp_max_abs"] < 1e-5 for r in adapter_plan] == [True, True]
    assert adapter_plan[0]["cp_digest"] == adapter_plan[1]["cp_digest"]


@pytest.mark.slow
def test_adapter_plan_with_a_static_mask_caches_the_mask_steps_and_matches_one_process(
        adapter_plan: list[dict[str, Any]]) -> None:
    for r in adapter_plan:
        assert r["static"]["cached"] == r["static_single"] == [2]
        assert (r["static"]["collectives"], r["static"]["max_abs_vs_single"] < 1e-5) == (0, True)
    assert adapter_plan[0]["static"]["digest"] == adapter_plan[1]["static"]["digest"]


@pytest.mark.slow
def test_adapter_plan_summary_says_where_the_plan_came_from(adapter_plan: list[dict[str, Any]]) -> None:
    for r in adapter_plan:
        summary = r["summary"]
        assert (summary["plan_origin"], summary["plan_modules"]) == ("adapter", ["rope", "blocks.0", "proj_out"])
        assert summary["plan_from"].startswith("adapter 'skyreelsv2' (")
        assert r["plan_not_on_class_or_instance"] is True
    assert "plan: adapter 'skyreelsv2' (" in adapter_plan[0]["summary_text"]
    assert "): 'rope', 'blocks.0', 'proj_out'" in adapter_plan[0]["summary_text"]


@pytest.mark.slow
def test_adapter_plan_removal_leaves_the_model_as_it_was(adapter_plan: list[dict[str, Any]]) -> None:
    assert [(r["removal_state_equal"], r["removal_parallel_config"], r["after_removal_equal_single"],
             r["static"]["removal_state_equal"]) for r in adapter_plan] == [(True, False, True, True)] * 2


@pytest.mark.slow
def test_adapter_plan_refuses_a_sequence_the_degree_does_not_divide(adapter_plan: list[dict[str, Any]]) -> None:
    for r in adapter_plan:
        assert r["odd_sequence_error"].startswith(
            "UnsupportedError: rope (SkyReelsV2RotaryPosEmbed) output 0: context parallelism over 2 ranks splits dim 1 "
            "of size 9, expected a multiple of 2, got 9.")


@pytest.mark.slow
def test_a_class_plan_that_splits_at_the_first_block_passes_the_first_call_check(
        adapter_plan: list[dict[str, Any]]) -> None:
    """Wan's `_cp_plan` splits `blocks.0`'s input inside diffusers' hook: the check compares the block's own view."""
    for r in adapter_plan:
        assert (r["wan_class_plan"]["plan_origin"], r["wan_class_plan"]["max_abs_vs_single"] < 1e-5) == ("class", True)


@pytest.mark.slow
def test_the_first_call_check_does_not_cut_an_input_diffusers_already_cut(adapter_plan: list[dict[str, Any]]) -> None:
    """hookkit's hooks on blocks.0 inside diffusers' split hook (registered before enable_parallelism) see the cut
    input already: the check compares it as it is."""
    for r in adapter_plan:
        inner = r["inner_registry"]
        assert (inner["hookkit_outermost"], inner["first_call"], inner["max_abs_vs_single"] < 1e-5) == (
            False, "confirmed", True)


@pytest.mark.slow
def test_a_plan_with_a_wrong_gather_dim_is_refused_not_scrambled(adapter_plan: list[dict[str, Any]]) -> None:
    """diffusers alone returns a sample of the right shape and wrong values; hookkit's gather check refuses it."""
    for r in adapter_plan:
        alone = r["wrong_plan_diffusers_alone"]
        assert alone["same_shape"] is True and alone["max_abs_vs_single"] > 0.1
        assert r["wrong_plan_error"].startswith(
            "UnsupportedError: proj_out (Linear) output 0: context parallelism over 2 ranks gathered dim 2 to size 128, "
            "expected a sequence length the plan split in this call ([8]), got 128. The plan of adapter 'skyreelsv2' (")
        assert r["wrong_plan_error"].endswith(
            ") does not match the model (a wrong gather_dim or split_dim, or a split the forward never reaches). Fix its "
            "[[cp_plan]] (gather_dim, split_dim, expected_dims).")
        assert r["wrong_plan_removal_state_equal"] is True


@pytest.mark.slow
def test_a_plan_whose_gather_expects_other_dims_is_refused(adapter_plan: list[dict[str, Any]]) -> None:
    for r in adapter_plan:
        assert r["four_dims_plan_error"].startswith(
            "UnsupportedError: proj_out (Linear) output 0: expected a 4-dim tensor to gather (the plan's expected_dims), "
            "got shape (1, 8, 64). The plan of adapter 'skyreelsv2' (")
        assert r["four_dims_plan_removal_state_equal"] is True


# --- two processes: the command line as torchrun starts it ---------------------------------------------------------


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("cli")
    run_ranks(tmp, [str(WORKER), str(tmp), "cli"])
    return tmp, [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_generate_parallel_prints_and_saves_on_rank_0_only(cli_runs: tuple[Path, list[dict[str, Any]]]) -> None:
    tmp, ranks = cli_runs
    assert [r["generate_rc"] for r in ranks] == [0, 0]
    assert "- Parallel: 2 ranks, context parallel ulysses 2 x ring 1; DBCache decisions identical on every rank" \
        in ranks[0]["generate_stdout"]
    assert "Optimization: DBCache_F1B0_W1MC-1_R0.3_CP-U2R1" in ranks[0]["generate_stdout"]
    assert ranks[1]["generate_stdout"] == ""
    assert (tmp / "flux.png").is_file()


@pytest.mark.slow
def test_bench_parallel_reports_every_rank_agreeing(cli_runs: tuple[Path, list[dict[str, Any]]]) -> None:
    tmp, ranks = cli_runs
    assert [r["bench_rc"] for r in ranks] == [0, 0]
    assert ranks[1]["bench_stdout"] == ""
    rows = json.loads((tmp / "bench.json").read_text())["rows"]
    assert [(row["config"], row["status"], row.get("ranks_agree")) for row in rows] == [
        ("eager", "ok", True), ("hookkit-cache-fast", "ok", True)]
    assert [len(row["peak_memory_gb_per_rank"]) for row in rows] == [2, 2]


# --- two GPUs over NCCL (the lead's 2-GPU machine) ---------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.slow
def test_two_gpus_ulysses_and_ring_take_the_single_gpu_decisions(tmp_path: Path) -> None:
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    run_ranks(tmp_path, [str(WORKER), str(tmp_path), "gpu"])
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    low, high = sorted(ranks[0]["local_diffs_step1"])
    assert low < ranks[0]["threshold"] < high
    single = ranks[0]["single"]
    for r in ranks:
        for layout in ("ulysses", "ring"):
            assert (r[layout]["cached"], r[layout]["computed"]) == (single["cached"], single["computed"])
            assert r[layout]["collectives"] == len(single["diffs"])
    for layout in ("ulysses", "ring"):
        assert ranks[0][layout]["digest"] == ranks[1][layout]["digest"]
    for layout in ("sky_ulysses", "sky_ring"):  # SkyReels-V2 by its adapter's [[cp_plan]], bfloat16
        assert [(r[layout]["plan_origin"], r[layout]["relative_max_abs_vs_single"] < 0.05) for r in ranks] == [
            ("adapter", True)] * 2
        assert ranks[0][layout]["digest"] == ranks[1][layout]["digest"]
