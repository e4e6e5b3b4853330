"""benchmarks/: named suites, the one queue runner of a GPU lease, the shared GPU environment and kernel timing.

All on the CPU: the queue's commands that need no GPU, the suites' registry checked against the tree, and the
timing helper's host-clock path (its CUDA paths run in the GPU suites).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
SUITES = sorted(BENCHMARKS.glob("suites/*.sh"))
QUEUE = BENCHMARKS / "queue.sh"


def bash(*args: str, env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", *args], capture_output=True, text=True, timeout=60, cwd=cwd,
                          env={**os.environ, **(env or {})})


# --- the suites --------------------------------------------------------------------------------------------------


def test_the_registry_holds_the_suites_that_replace_the_work_log_queues() -> None:
    names = {path.stem for path in SUITES}
    assert {"gpu-tests", "peers-flux-1024-cold", "peers-flux-1024", "peers-flux-512", "peers-flux-256",
            "peers-qwen-1024", "step-profile", "fp8-rows", "matrix-flux-1024", "context-parallel",
            "caching-fronts", "video-rows"} <= names


def test_no_runner_stands_apart_from_the_queue() -> None:
    """Every shell script of benchmarks/ is the queue, a suite or a sourced library: no runner with its own start."""
    assert sorted(path.name for path in BENCHMARKS.glob("*.sh")) == ["gpu_env.sh", "queue.sh", "suite_lib.sh"]


#: the documents that tell how to run a benchmark
DOCS = [ROOT / "BENCHMARKS.md", ROOT / "README.md", ROOT / "CONTRIBUTING.md", BENCHMARKS / "results" / "README.md",
        *sorted((ROOT / "docs").rglob("*.md"))]


#: a `VAR=value` word among a queue's suites (a setting of the suites after it)
SETTING = re.compile(r"[A-Za-z_]\w*=")
_WORD = r"(?:[A-Za-z_]\w*=[^\s`]+|[\w-]+)"
#: the words after `queue.sh start` or `run` in a document, over line continuations
QUEUE_WORDS = rf"benchmarks/queue\.sh (?:start|run) ({_WORD}(?:(?:[ \t]+|[ \t]*\\\n[ \t]*){_WORD})*)"


def test_every_benchmark_script_and_suite_the_docs_name_exists() -> None:
    missing = []
    for doc in (d for d in DOCS if d.is_file()):
        text = doc.read_text()
        named = set(re.findall(r"\bbenchmarks/[\w-]+\.(?:sh|py)\b", text))
        missing += [f"{doc.name}: {path}" for path in sorted(named) if not (ROOT / path).is_file()]
        for words in re.findall(QUEUE_WORDS, text):
            missing += [f"{doc.name}: suite {word}" for word in words.replace("\\", " ").split()
                        if word != "--" and not SETTING.match(word)
                        and not (BENCHMARKS / "suites" / f"{word}.sh").is_file()]
    assert missing == []


@pytest.mark.parametrize("suite", SUITES, ids=lambda path: path.stem)
def test_every_suite_says_what_it_measures_and_sources_the_shared_settings(suite: Path) -> None:
    lines = suite.read_text().splitlines()
    assert lines[0] == "#!/usr/bin/env bash"
    assert lines[1].startswith("# ") and len(lines[1]) <= 120, "line 2: the one-line description `list` prints"
    assert 'source "$(dirname "$0")/../suite_lib.sh"' in lines


@pytest.mark.parametrize("suite", SUITES, ids=lambda path: path.stem)
def test_every_script_and_test_file_a_suite_names_exists(suite: Path) -> None:
    named = set(re.findall(r"\b((?:benchmarks|tests)/[\w./-]+\.(?:py|sh))", suite.read_text()))
    assert [path for path in sorted(named) if not (ROOT / path).is_file()] == []


def test_kernel_times_writes_the_json_and_log_and_notes_each_kernels_line(tmp_path: Path) -> None:
    # the attention suites' one process of benchmarks/attention_kernels.py; here on the CPU (Triton's interpreter),
    # its shape replaced after `--`, and python3 the test's own interpreter
    env = {"OUT": str(tmp_path), "TRITON_INTERPRET": "1",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    done = bash("-c", 'source benchmarks/suite_lib.sh && kernel_times cpu_rows 120 hookkit_int8 sdpa_cudnn -- '
                      '--device cpu --tokens 96 --heads 1 --dim 64 --repeats 2 --warmup 1', env=env)
    assert done.returncode == 0, done.stderr
    rows = [r["kernel"] for r in json.loads((tmp_path / "cpu_rows.json").read_text())["results"]]
    assert rows == ["hookkit_int8", "sdpa_cudnn"] and (tmp_path / "cpu_rows.log").is_file()
    note = done.stdout.strip()
    assert " cpu_rows rc 0 hookkit_int8 1 96 " in note and ";sdpa_cudnn 1 96 " in note


def test_every_suite_passes_bash_syntax_check() -> None:
    scripts = [*SUITES, QUEUE, BENCHMARKS / "suite_lib.sh", BENCHMARKS / "gpu_env.sh"]
    failed = {path.name: done.stderr for path in scripts if (done := bash("-n", str(path))).returncode != 0}
    assert failed == {}


#: what names a file after the work that made it, not what it holds: a session, an issue, a numbered run, a GPU
#: index, a numbered seed of a work log
WORK_LOG_NAME = re.compile(r"session|issue|run[-_ ]?\d|gpu\d|seed[-_ ]?0\d\d", re.IGNORECASE)


@pytest.mark.parametrize("name, flagged", [
    ("session-12/flux.json", True), ("issue40.log", True), ("run7.json", True), ("run-26.log", True),
    ("run 3.txt", True), ("gpu1.txt", True), ("seed_003.png", True), ("seed-012.json", True),
    ("runner.py", False), ("gpu_tests.log", False), ("gpus.txt", False), ("nvidia-h200-x2/flux-512-alone.json", False),
    ("test_syncs.py", False), ("seeds-0-3.json", False),
])
def test_the_work_log_name_pattern_flags_sessions_issues_runs_gpus_and_seeds(name: str, flagged: bool) -> None:
    assert bool(WORK_LOG_NAME.search(name)) is flagged


def test_no_file_in_benchmarks_or_tests_is_named_after_a_work_log_session_run_or_issue() -> None:
    names = [path.relative_to(ROOT).as_posix() for folder in (BENCHMARKS, ROOT / "tests") for path in folder.rglob("*")
             if "__pycache__" not in path.parts]
    assert names and [n for n in names if WORK_LOG_NAME.search(n)] == []


# --- the results index --------------------------------------------------------------------------------------------

RESULTS = BENCHMARKS / "results"


def indexed_folders() -> set[str]:
    """The folders benchmarks/results/README.md's table names: each `folder/` in backticks of a row's first column."""
    rows = [line for line in (RESULTS / "README.md").read_text().splitlines() if line.startswith("| `")]
    return {name.rstrip("/") for row in rows for name in re.findall(r"`([^`]+/)`", row.split(" | ")[0])}


def test_the_results_index_names_folders_at_the_first_and_second_level() -> None:
    assert {"cpu", "caching-front-cpu", "vs-cache-dit-h200/wan21-14b-480x832x81"} <= indexed_folders()


def test_every_folder_the_results_index_names_exists() -> None:
    assert sorted(name for name in indexed_folders() if not (RESULTS / name).is_dir()) == []


def test_every_results_folder_is_in_the_index() -> None:
    """A folder directly under benchmarks/results/ is named itself, or is a group whose entries are all named."""
    indexed = indexed_folders()
    unindexed = []
    for folder in sorted(path for path in RESULTS.iterdir() if path.is_dir()):
        if folder.name in indexed or not any(path.is_file() for path in folder.rglob("*")):
            continue
        entries = [path.relative_to(RESULTS).as_posix() for path in sorted(folder.iterdir())]
        named = [entry for entry in entries if entry in indexed]
        unindexed += [entry for entry in entries if entry not in indexed] if named else [f"{folder.name}/"]
    assert unindexed == []


def test_every_results_link_of_benchmarks_md_points_into_an_indexed_folder_that_exists() -> None:
    indexed = indexed_folders()
    links = re.findall(r"\]\(benchmarks/results/([^)#\s]*)\)", (ROOT / "BENCHMARKS.md").read_text())
    assert len(links) > 20
    outside = [link for link in sorted(set(links)) if link not in ("", "README.md")
               and not any(link.rstrip("/") == name or link.startswith(f"{name}/") for name in indexed)]
    missing = [link for link in sorted(set(links)) if not (RESULTS / link).exists()]
    assert (outside, missing) == ([], [])


# --- the queue runner --------------------------------------------------------------------------------------------


def test_the_queue_without_arguments_prints_its_usage_and_exits_2() -> None:
    done = bash(str(QUEUE))
    assert done.returncode == 2
    assert done.stderr.startswith("usage: bash benchmarks/queue.sh list\n")
    assert "bash benchmarks/queue.sh start SUITE... [-- SUITE...]" in done.stderr


def test_start_without_a_suite_prints_the_usage_and_exits_2(tmp_path: Path) -> None:
    done = bash(str(QUEUE), "start", env={"W": str(tmp_path / "w")})
    assert done.returncode == 2 and done.stderr.startswith("usage:")
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("verb", ["start", "run"])
def test_an_unknown_suite_is_refused_before_anything_runs_naming_the_known_ones(verb: str, tmp_path: Path) -> None:
    done = bash(str(QUEUE), verb, "peers-flux-512", "flux-1024", env={"W": str(tmp_path / "w")})
    assert done.returncode == 2
    known = " ".join(path.stem for path in SUITES)
    assert done.stderr == f"queue.sh: unknown suite 'flux-1024'; known suites: {known} \n"
    assert not (tmp_path / "w").exists()


def test_list_prints_every_suite_with_its_description() -> None:
    done = bash(str(QUEUE), "list")
    assert done.returncode == 0
    listed = {line.split()[0]: line.split(None, 1)[1] for line in done.stdout.splitlines()}
    assert listed == {path.stem: path.read_text().splitlines()[1][2:] for path in SUITES}


def test_a_setting_word_among_the_suites_holds_for_the_suites_after_it(tmp_path: Path) -> None:
    """`run first ROWS=b second`: the second suite sees ROWS=b, the first the environment's ROWS."""
    fake = tmp_path / "repo" / "benchmarks"
    (fake / "suites").mkdir(parents=True)
    shutil.copy(QUEUE, fake / "queue.sh")
    shutil.copy(BENCHMARKS / "gpu_env.sh", fake / "gpu_env.sh")
    for name in ("first", "second"):
        (fake / "suites" / f"{name}.sh").write_text('#!/usr/bin/env bash\n# echoes ROWS\necho "$ROWS" > "$OUT/rows"\n')
    env = {**fake_python(tmp_path, imports=True), "W": str(tmp_path / "w"), "ROWS": "a"}
    done = bash(str(fake / "queue.sh"), "run", "first", "ROWS=b,c", "second", env=env)
    assert done.returncode == 0, done.stderr
    res = tmp_path / "w" / "res"
    assert (res / "first" / "rows").read_text() == "a\n"
    assert (res / "second" / "rows").read_text() == "b,c\n"


def test_a_started_queue_keeps_a_setting_that_holds_spaces_one_word(tmp_path: Path) -> None:
    """`start "GPU_TESTS=a.py b.py" first`: the suite sees both files, not a suite named `b.py`."""
    fake = tmp_path / "repo" / "benchmarks"
    (fake / "suites").mkdir(parents=True)
    shutil.copy(QUEUE, fake / "queue.sh")
    shutil.copy(BENCHMARKS / "gpu_env.sh", fake / "gpu_env.sh")
    (fake / "suites" / "first.sh").write_text('#!/usr/bin/env bash\n# echoes GPU_TESTS\necho "$GPU_TESTS" > "$OUT/tests"\n')
    env = {**fake_python(tmp_path, imports=True), "W": str(tmp_path / "w")}
    done = bash(str(fake / "queue.sh"), "start", "GPU_TESTS=a.py b.py", "first", env=env)
    assert done.returncode == 0, done.stderr
    res = tmp_path / "w" / "res"
    for _ in range(100):
        if (res / "lane0.done").exists():
            break
        time.sleep(0.1)
    assert (res / "first" / "tests").read_text() == "a.py b.py\n"
    assert "b.py start" not in (res / "queue.log").read_text()


def test_setting_words_alone_are_no_suite_and_print_the_usage(tmp_path: Path) -> None:
    done = bash(str(QUEUE), "run", "ROWS=b", env={"W": str(tmp_path / "w")})
    assert done.returncode == 2 and done.stderr.startswith("usage:")
    assert not (tmp_path / "w").exists()


def finished_queue(w: Path) -> None:
    """A queue folder as `start` leaves it once its one suite has exited: what `collect` reads."""
    res = w / "res"
    (res / "gpu-tests").mkdir(parents=True)
    (res / "lanes").write_text("1\n")
    (res / "lane0.done").write_text("done\n")
    (res / "queue.log").write_text("[10:00:00] gpu-tests start\n[10:00:05] gpu-tests exit 0 after 5 s\n")
    (res / "gpu-tests" / "suite.log").write_text("12 passed in 4.9s\n")
    (res / "gpu-tests" / "suite.rc").write_text("0 5\n")
    (res / "gpu-tests" / "row.pt").write_bytes(b"a tensor the collect leaves out")


def test_collect_in_a_fresh_shell_writes_summary_log_and_results_to_out(tmp_path: Path) -> None:
    finished_queue(tmp_path / "w")
    out = tmp_path / "out"
    done = bash(str(QUEUE), "collect", "0", env={"W": str(tmp_path / "w"), "OUT": str(out)})
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["queue.log", "results.tgz", "summary.md"]
    summary = (out / "summary.md").read_text()
    assert "## gpu-tests: exit 0 after 5 s\n" in summary and "12 passed in 4.9s" in summary
    with tarfile.open(out / "results.tgz") as tar:
        names = tar.getnames()
    assert "./gpu-tests/suite.log" in names and "./gpu-tests/row.pt" not in names


def test_collect_says_so_when_no_queue_was_started(tmp_path: Path) -> None:
    done = bash(str(QUEUE), "collect", "0", env={"W": str(tmp_path / "w"), "OUT": str(tmp_path / "out")})
    assert done.returncode == 1
    assert done.stderr == f"queue.sh: no queue in {tmp_path / 'w'} (start one first)\n"


# --- the shared GPU environment ----------------------------------------------------------------------------------


def fake_python(tmp_path: Path, imports: bool) -> dict[str, str]:
    """PATH with a `python3` whose `-c` import check succeeds or fails (no real import is tried)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f"#!/bin/sh\nexit {0 if imports else 1}\n")
    (bin_dir / "python3").chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


def test_gpu_wheels_downloads_the_pinned_packages_for_the_gpu_machines_python_and_flashinfer_on_request(
        benchmark_script: Callable[[str], ModuleType], tmp_path: Path) -> None:
    wheels = benchmark_script("gpu_wheels")
    (download,) = wheels.commands(tmp_path, flashinfer=False)
    assert download[1:5] == ["-m", "pip", "download", "-q"] and "--no-deps" in download
    assert download[download.index("--python-version") + 1] == "3.12"
    assert download[-6:] == ["-d", str(tmp_path), "diffusers==0.42.1", "torchao==0.17.0", "loguru==0.7.3",
                             "cache-dit==1.5.3"]
    _, site = wheels.commands(tmp_path, flashinfer=True)
    assert site[1].endswith("benchmarks/flashinfer_site.py") and site[2:] == ["--out",
                                                                             str(tmp_path / "flashinfer-site.tar.gz")]


def test_gpu_wheels_prints_its_commands_and_runs_nothing_with_print(
        benchmark_script: Callable[[str], ModuleType], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wheels = benchmark_script("gpu_wheels")
    assert wheels.main(["--whl", str(tmp_path / "w"), "--flashinfer", "--print"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2 and not (tmp_path / "w").exists()


def test_gpu_env_puts_the_site_folder_and_the_given_checkout_on_the_python_path(tmp_path: Path) -> None:
    done = bash("-c", 'source benchmarks/gpu_env.sh && gpu_env /snap/repo && echo "$PYTHONPATH $PYTHONUNBUFFERED"',
                env=fake_python(tmp_path, imports=True))
    assert done.returncode == 0 and done.stdout == "/tmp/site:/snap/repo 1\n"


def test_gpu_env_unpacks_the_flashinfer_site_archive_into_the_site_folder_once(tmp_path: Path) -> None:
    whl, package = tmp_path / "whl", tmp_path / "src" / "flashinfer"
    (package / "data" / "include").mkdir(parents=True)
    (package / "__init__.py").write_text("__version__ = '0.2.14'\n")
    whl.mkdir()
    with tarfile.open(whl / "flashinfer-site.tar.gz", "w:gz") as tar:
        tar.add(package, arcname="flashinfer")
    env = {**fake_python(tmp_path, imports=True), "WHL": str(whl), "GPU_SITE": str(tmp_path / "site")}
    done = bash("-c", 'source benchmarks/gpu_env.sh && gpu_env /snap/repo && echo "$PYTHONPATH"', env=env)
    assert done.returncode == 0 and done.stdout == f"{tmp_path / 'site'}:/snap/repo\n"
    unpacked = tmp_path / "site" / "flashinfer" / "__init__.py"
    assert unpacked.read_text() == "__version__ = '0.2.14'\n"
    unpacked.write_text("kept\n")  # a later call leaves what is there
    assert bash("-c", "source benchmarks/gpu_env.sh && gpu_env", env=env).returncode == 0
    assert unpacked.read_text() == "kept\n"


def test_gpu_env_keeps_the_prebuilt_flashinfer_kernels_that_load_and_removes_the_others(tmp_path: Path) -> None:
    import _ctypes

    whl, aot = tmp_path / "whl", tmp_path / "src" / "flashinfer" / "data" / "aot"
    for name in ("loads", "broken"):
        (aot / name).mkdir(parents=True)
    shutil.copyfile(_ctypes.__file__, aot / "loads" / "loads.so")  # a shared library any Python can load
    (aot / "broken" / "broken.so").write_text("not a shared library\n")
    whl.mkdir()
    with tarfile.open(whl / "flashinfer-site.tar.gz", "w:gz") as tar:
        tar.add(aot.parent.parent, arcname="flashinfer")
    bin_dir = tmp_path / "bin"  # a python3 that runs scripts from stdin and passes the package import check
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/bin/sh\n[ "$1" = "-" ] && exec {sys.executable} "$@"\nexit 0\n')
    (bin_dir / "python3").chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "WHL": str(whl), "GPU_SITE": str(tmp_path / "site")}
    done = bash("-c", "source benchmarks/gpu_env.sh && gpu_env", env=env)
    assert done.returncode == 0, done.stderr
    kept = tmp_path / "site" / "flashinfer" / "data" / "aot"
    assert sorted(p.name for p in kept.iterdir()) == ["loads"]
    assert done.stderr.startswith("gpu_env.sh: prebuilt broken.so does not load here (")
    assert done.stderr.endswith("); FlashInfer compiles it at first use\n")


def test_gpu_env_without_the_packages_or_wheels_fails_saying_what_to_carry(tmp_path: Path) -> None:
    env = {**fake_python(tmp_path, imports=False), "WHL": str(tmp_path / "no-wheels")}
    done = bash("-c", "source benchmarks/gpu_env.sh && gpu_env", env=env)
    assert done.returncode == 1
    assert done.stderr == (f"gpu_env.sh: diffusers, torchao, loguru and cache_dit do not all import and "
                           f"{tmp_path / 'no-wheels'} holds no wheels; carry .whl (or set WHL to a folder of wheels); "
                           "python benchmarks/gpu_wheels.py fills .whl\n")


# --- the peer report reads the suites' folders -------------------------------------------------------------------


@pytest.fixture
def report(benchmark_script: Callable[[str], ModuleType]) -> ModuleType:
    return benchmark_script("peer_goals_report")


def test_the_peer_report_reads_each_group_from_its_suites_folders(report: ModuleType, tmp_path: Path) -> None:
    (tmp_path / "peers-qwen-1024").mkdir()
    (tmp_path / "autotune-flux-1024").mkdir()
    (tmp_path / "step-profile").mkdir()
    (tmp_path / "peers-qwen-1024" / f"{report.MOD}.json").write_text(json.dumps({"config": report.MOD, "status": "ok"}))
    (tmp_path / "autotune-flux-1024" / f"{report.AUTOTUNE}.json").write_text(
        json.dumps({"config": report.AUTOTUNE, "status": "ok"}))
    (tmp_path / "step-profile" / "step_profile.json").write_text(json.dumps({"rows": []}))
    doc = report.collect(tmp_path)
    qwen = {r["config"]: r["status"] for r in doc["groups"]["qwen-1024"]["rows"]}
    flux = {r["config"]: r["status"] for r in doc["groups"]["flux-1024"]["rows"]}
    assert qwen == {report.FAST: "not reached", report.MOD: "ok", report.PEER: "not reached"}
    assert flux[report.AUTOTUNE] == "ok" and flux[report.FAST] == "not reached"
    assert doc["step_profile"] == {"rows": []} and doc["quality"] is None and doc["held_memory"] is None


def test_the_peer_report_counts_no_row_whose_output_was_non_finite(report: ModuleType) -> None:
    rows = [{"config": report.FAST, "status": "ok", "latency_s": 0.5, "nonfinite": 3},
            {"config": report.PEER, "status": "ok", "latency_s": 1.0, "nonfinite": 0}]
    assert report._ok(rows, report.FAST) is None and report._ok(rows, report.PEER) == rows[1]


# --- kernel timing -----------------------------------------------------------------------------------------------


@pytest.fixture
def timing() -> ModuleType:
    from benchmarks import timing

    return timing


def test_graph_replay_timing_on_the_cpu_times_plain_calls_by_the_host_clock(timing: ModuleType) -> None:
    calls: list[int] = []
    timed = timing.time_graph_replays(lambda: (calls.append(1), time.sleep(0.001)), repeats=5, warmup=2, device="cpu")
    assert len(calls) == 7  # 2 warm-up calls, then 5 timed
    assert len(timed.times_ms) == 5 and all(t >= 1.0 for t in timed.times_ms)  # each call sleeps 1 ms
    assert timed.how == "host clock"


def test_plain_call_timing_on_the_cpu_returns_one_time_per_repeat_after_the_warm_up(timing: ModuleType) -> None:
    calls: list[int] = []
    times = timing.time_calls(lambda: (calls.append(1), time.sleep(0.001)), repeats=3, warmup=1, device="cpu")
    assert len(calls) == 4 and len(times) == 3 and all(t >= 1.0 for t in times)


def test_summary_is_the_median_min_and_max(timing: ModuleType) -> None:
    assert timing.summary([3.0, 1.0, 2.0, 10.0]) == {"median_ms": 2.5, "min_ms": 1.0, "max_ms": 10.0}


def test_summary_of_no_times_says_how_to_get_some(timing: ModuleType) -> None:
    with pytest.raises(ValueError, match="expected at least one time, got none; time with repeats >= 1"):
        timing.summary([])


# --- the FlashInfer and FMHA v2 archives for the GPU machine ---------------------------------------------------


@pytest.mark.parametrize("script,flag", [("flashinfer_site", "--aot-python"), ("fmha_v2_site", "--python")])
def test_an_archive_builder_refuses_a_python_that_does_not_exist(
        benchmark_script: Callable[[str], ModuleType], tmp_path: Path, capsys: pytest.CaptureFixture[str], script: str,
        flag: str) -> None:
    site = benchmark_script(script)
    with pytest.raises(SystemExit):
        site.parse_args([flag, str(tmp_path / "python3.12")])
    assert (f"{flag}: expected a Python interpreter, got {tmp_path / 'python3.12'} (no such file)"
            in capsys.readouterr().err)


def test_the_kernels_are_prebuilt_by_the_given_python_for_hopper_with_the_package_on_its_path(
        benchmark_script: Callable[[str], ModuleType], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site = benchmark_script("flashinfer_site")
    runs: list[tuple[list[str], dict[str, str]]] = []
    monkeypatch.setattr(site.subprocess, "run", lambda cmd, env, check: runs.append((cmd, env)))
    monkeypatch.setenv("CUDA_HOME", "/opt/cuda-13.0")
    python = tmp_path / "bin" / "python"
    site.prebuild(python, tmp_path / "site" / "flashinfer", "64,128", tmp_path)
    [(cmd, env)] = runs
    assert cmd == [str(python), site.__file__, "--build-aot-into", str(tmp_path / "site" / "flashinfer"),
                   "--aot-heads", "64,128"]
    assert (env["PYTHONPATH"], env["TORCH_CUDA_ARCH_LIST"], env["FLASHINFER_WORKSPACE_BASE"]) == (
        str(tmp_path / "site"), "9.0a", str(tmp_path / "jit"))
    assert env["PATH"].startswith(f"{tmp_path / 'bin'}:/opt/cuda-13.0/bin:")


def _fp8_dispatch_header(tile_128: tuple[int, int, int]) -> str:
    """The part of FlashInfer's `hopper/quantization/prefill_sm90.cuh` the tile builder edits: the single-sequence
    dispatch, heads of 64 first (a tile the builder must leave alone), then heads of 128 with `tile_128`."""
    dispatch = "    SingleFP8PrefillWithKVCacheKernelTraitsDispatched<\n" \
        "        FP8AttentionKernelTraits<true, HEAD_DIM,\n" \
        "                                 /*CTA_Q_=*/{},\n                                 /*CTA_KV_=*/{},\n" \
        "                                 /*NUM_STAGES_=*/{}, typename Params::DTypeQ>\n"
    return ("cudaError_t SingleFP8PrefillWithKVCacheDispatched(Params& params, cudaStream_t stream) {\n"
            "  static_assert(HEAD_DIM == 64 || HEAD_DIM == 128 || HEAD_DIM == 256);\n"
            "  if constexpr (HEAD_DIM == 64) {\n" + dispatch.format(192, 128, 4) +
            "  } else if constexpr (HEAD_DIM == 128) {\n" + dispatch.format(*tile_128) + "  }\n}\n")


def test_the_tile_builder_puts_the_tile_in_the_fp8_dispatch_for_heads_of_128_only(
        benchmark_script: Callable[[str], ModuleType], tmp_path: Path) -> None:
    tiles = benchmark_script("flashinfer_fp8_tiles")
    header = tmp_path / "prefill_sm90.cuh"
    header.write_text(_fp8_dispatch_header((128, 192, 2)))
    tiles.patch(header, *tiles.tile("q192kv128s3"))
    assert header.read_text() == _fp8_dispatch_header((192, 128, 3))


def test_the_tile_builder_refuses_a_header_whose_dispatch_it_does_not_know(
        benchmark_script: Callable[[str], ModuleType], tmp_path: Path) -> None:
    tiles = benchmark_script("flashinfer_fp8_tiles")
    header = tmp_path / "prefill_sm90.cuh"
    header.write_text(_fp8_dispatch_header((128, 128, 2)))
    with pytest.raises(SystemExit, match="fp8 dispatch for heads of 128 is not the one this script patches"):
        tiles.patch(header, 128, 256, 2)


@pytest.mark.parametrize("name,why", [("q128kv200s2", "multiples of 64"), ("q128kv256s5", "stages 1-4"),
                                      ("128x256", "expected a tile like q128kv256s2")])
def test_the_tile_builder_refuses_a_tile_flashinfers_fp8_kernel_cannot_take(
        benchmark_script: Callable[[str], ModuleType], name: str, why: str) -> None:
    tiles = benchmark_script("flashinfer_fp8_tiles")
    with pytest.raises(tiles.argparse.ArgumentTypeError, match=why):
        tiles.tile(name)


def test_the_kernel_benchmark_prepares_a_kernels_inputs_once_per_input_tensors(
        benchmark_script: Callable[[str], ModuleType]) -> None:
    import torch

    kernels = benchmark_script("attention_kernels")
    prepared: list[int] = []

    def prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
        prepared.append(len(prepared))
        return prepared[-1]

    alone = kernels.prepared_once(prepare, lambda q, k, v, n: q + n)
    q, k, v = torch.zeros(2), torch.zeros(2), torch.zeros(2)
    assert [alone(q, k, v).tolist() for _ in range(3)] == [[0.0, 0.0]] * 3  # timed calls: prepared once
    assert alone(torch.ones(2), k, v).tolist() == [2.0, 2.0] and prepared == [0, 1]  # new inputs: prepared again


def test_the_kernel_benchmark_refuses_a_flashinfer_module_folder_that_does_not_exist(
        benchmark_script: Callable[[str], ModuleType], tmp_path: Path) -> None:
    kernels = benchmark_script("attention_kernels")
    with pytest.raises(SystemExit, match=f"expected a folder of prebuilt FlashInfer modules, got {tmp_path / 'no'}"):
        kernels.use_flashinfer_modules(tmp_path / "no")


# --- the FMHA v2 archive for the GPU machine ----------------------------------------------------------------------


def test_gpu_env_unpacks_the_fmha_v2_archive_into_the_site_folder_once(tmp_path: Path) -> None:
    whl, src = tmp_path / "whl", tmp_path / "src"
    for folder in ("fmha_v2", "tvm_ffi"):
        (src / folder).mkdir(parents=True)
    (src / "fmha_v2" / "fmha_v2_e4m3.so").write_text("module\n")
    (src / "tvm_ffi" / "__init__.py").write_text("")
    whl.mkdir()
    with tarfile.open(whl / "fmha-v2-site.tar.gz", "w:gz") as tar:
        for folder in ("fmha_v2", "tvm_ffi"):
            tar.add(src / folder, arcname=folder)
    env = {**fake_python(tmp_path, imports=True), "WHL": str(whl), "GPU_SITE": str(tmp_path / "site")}
    assert bash("-c", "source benchmarks/gpu_env.sh && gpu_env", env=env).returncode == 0
    module = tmp_path / "site" / "fmha_v2" / "fmha_v2_e4m3.so"
    assert module.read_text() == "module\n" and (tmp_path / "site" / "tvm_ffi" / "__init__.py").is_file()
    module.write_text("kept\n")  # a later call leaves what is there
    assert bash("-c", "source benchmarks/gpu_env.sh && gpu_env", env=env).returncode == 0
    assert module.read_text() == "kept\n"


@pytest.mark.parametrize("heads,message", [("128,x", "--heads: expected comma-separated head sizes, got '128,x'"),
                                           ("0", "--heads: expected positive head sizes, got '0'")])
def test_the_fmha_v2_archive_refuses_head_sizes_that_are_not_positive_integers(
        benchmark_script: Callable[[str], ModuleType], capsys: pytest.CaptureFixture[str], heads: str,
        message: str) -> None:
    site = benchmark_script("fmha_v2_site")
    with pytest.raises(SystemExit):
        site.parse_args(["--python", sys.executable, "--heads", heads])
    assert message in capsys.readouterr().err


def test_the_fmha_v2_archive_keeps_tvm_ffis_runtime_and_leaves_out_what_builds_against_it(
        benchmark_script: Callable[[str], ModuleType], tmp_path: Path) -> None:
    site = benchmark_script("fmha_v2_site")
    wheel = tmp_path / "tvm.whl"
    names = ["tvm_ffi/__init__.py", "tvm_ffi/core.so", "tvm_ffi/lib/libtvm_ffi.so", "tvm_ffi/lib/libtvm_ffi_testing.so",
             "tvm_ffi/include/tvm/ffi/c_api.h", "tvm_ffi/src/ffi/object.cc", "tvm_ffi/cython/core.pyx",
             "apache_tvm_ffi-0.1.15.dist-info/METADATA"]
    with zipfile.ZipFile(wheel, "w") as archive:
        for name in names:
            archive.writestr(name, name)
    site.extract(wheel, tmp_path / "out", keep=("tvm_ffi/",), skip=site.TVM_FFI_SKIP)
    kept = sorted(str(p.relative_to(tmp_path / "out")) for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert kept == ["tvm_ffi/__init__.py", "tvm_ffi/core.so", "tvm_ffi/lib/libtvm_ffi.so",
                    "tvm_ffi/lib/libtvm_ffi_testing.so"]


def test_fmha_v2s_packed_input_holds_q_smoothed_k_and_v_each_within_an_e4m3_step(
        benchmark_script: Callable[[str], ModuleType]) -> None:
    import torch

    kernels = benchmark_script("attention_kernels")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 40, 64, generator=g).to(torch.bfloat16) for _ in range(3))
    k = k + 4.0  # a channel offset every token shares: smoothing takes it out
    packed, scales = kernels.packed_e4m3(q, k, v)
    assert packed.shape == (2 * 40, 3, 3, 64) and packed.dtype == torch.float8_e4m3fn
    smoothed = k.float() - k.float().mean(dim=2, keepdim=True)
    for i, (t, scale) in enumerate(zip((q.float(), smoothed, v.float()), scales, strict=True)):
        assert scale == float(t.abs().amax()) / 448.0
        restored = packed[:, i].float().unflatten(0, (2, 40)).transpose(1, 2) * scale  # back to [B, H, N, D]
        assert ((restored - t).abs() <= t.abs() * 2.0 ** -4 + scale * 2.0 ** -9).all()


def test_the_own_arithmetic_benchmark_finds_a_kernel_computing_its_arithmetic_and_one_that_does_not(
        benchmark_script: Callable[[str], ModuleType], monkeypatch: pytest.MonkeyPatch) -> None:
    from flashinfer_stand_in import StandIn, applying_first_heads_scales

    from hookkit.techniques.attention import flashinfer_fa3

    bench = benchmark_script("attention_own_arithmetic")
    module = StandIn()
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    argv = ["--kernels", "flashinfer_fp8", "--kinds", "gaussian", "offsets", "--dims", "32", "128", "--tokens", "68",
            "--heads", "3", "--device", "cpu"]
    rows = bench.main(argv)
    assert [(r["kind"], r["dim"], r["tokens"], r["calls"]) for r in rows] == [
        ("gaussian", 32, 68, 1), ("gaussian", 128, 68, 1), ("offsets", 32, 68, 1), ("offsets", 128, 68, 1)]
    assert all(r["kernel_vs_mirror"] < 0.005 < r["kernel_vs_fp32"] for r in rows)  # its arithmetic, to rounding
    assert all(r["worst_head_ratio"] == pytest.approx(1.0, abs=0.02) for r in rows)  # errs as its arithmetic does
    monkeypatch.setattr(module, "single_prefill_with_kv_cache",
                        applying_first_heads_scales(module.single_prefill_with_kv_cache))
    wrong = {(r["kind"], r["dim"]): r for r in bench.main(argv)}
    for dim in (32, 128):  # heads of different ranges show it, and its worst head errs beyond enable's bound
        assert wrong[("offsets", dim)]["kernel_vs_mirror"] > 0.2
        assert wrong[("offsets", dim)]["worst_head_ratio"] > flashinfer_fa3.CHECK_BOUND[True]


def test_the_own_arithmetic_benchmark_runs_enables_check_heads_with_the_offsets_in_one_tensor_at_a_time(
        benchmark_script: Callable[[str], ModuleType], monkeypatch: pytest.MonkeyPatch) -> None:
    from flashinfer_stand_in import StandIn, applying_first_heads_scales

    bench = benchmark_script("attention_own_arithmetic")
    module = StandIn()
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    argv = ["--kernels", "flashinfer_fp8", "--kinds", "check", "check-q", "check-k", "check-v", "--dims", "64",
            "--tokens", "68", "--device", "cpu"]
    rows = bench.main(argv)
    assert [(r["kind"], r["calls"], len(r["head_ratios"])) for r in rows] == [
        ("check", 1, 4), ("check-q", 1, 4), ("check-k", 1, 4), ("check-v", 1, 4)]
    for r in rows:  # a kernel computing its arithmetic errs as it on every head, to the rounding of its bf16 output
        assert r["head_ratios"] == pytest.approx([1.0] * 4, abs=0.08), r  # (1.07x on check-v's smoothed head 2)
    monkeypatch.setattr(module, "single_prefill_with_kv_cache",
                        applying_first_heads_scales(module.single_prefill_with_kv_cache))
    for r in bench.main(argv):  # the first head's scales on every head: each other head (another range) is off
        assert r["head_ratios"][0] == pytest.approx(1.0, abs=0.05) and min(r["head_ratios"][1:]) > 4, r


def test_the_quality_benchmarks_mirror_mode_answers_unmasked_sdpa_with_hookkit_fp8s_arithmetic(
        benchmark_script: Callable[[str], ModuleType]) -> None:
    import torch
    import torch.nn.functional as F

    from hookkit.techniques.attention import fp8_triton

    bench = benchmark_script("quality_attention")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 32, generator=g).to(torch.bfloat16) for _ in range(3))
    mask = torch.ones(40, 40, dtype=torch.bool)
    with bench.MirrorSDPA() as mode:
        answered = F.scaled_dot_product_attention(q, k, v)
        masked = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.equal(answered, fp8_triton.reference(q, k, v))  # the mirror's output, not SDPA's
    assert not torch.equal(answered, F.scaled_dot_product_attention(q, k, v))
    assert torch.equal(masked, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))  # a mask runs SDPA
    assert (mode.answered, mode.passed) == (1, 1)


def test_the_own_arithmetic_benchmark_reports_a_kernel_that_cannot_run_as_a_row(
        benchmark_script: Callable[[str], ModuleType], monkeypatch: pytest.MonkeyPatch) -> None:
    bench = benchmark_script("attention_own_arithmetic")
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # not installed
    rows = bench.main(["--kernels", "flashinfer_fp8", "--kinds", "gaussian", "--dims", "64", "--tokens", "40",
                       "--device", "cpu"])
    assert rows == [{"kernel": "flashinfer_fp8", "kind": "gaussian", "dim": 64, "tokens": 40, "calls": 1,
                     "error": "ModuleNotFoundError: import of flashinfer halted; None in sys.modules"}]


def test_the_nonfinite_locator_names_the_first_module_and_attention_call_that_turn_nan(
        benchmark_script: Callable[[str], ModuleType]) -> None:
    import torch

    from hookkit.tools.bench import models

    bench = benchmark_script("first_nonfinite")
    opts = models.ModelOptions(name="hunyuanvideo15", steps=1, device="cpu")
    pipe = models.load_pipeline(opts)
    with torch.no_grad():
        pipe.transformer.transformer_blocks[1].attn.to_v.weight[0, 0] = float("inf")
    report = bench.locate(pipe, opts, None)
    first = report["transformer_calls"][0]
    assert (report["output_finite"], report["first_call"], first["first_module"]) == (
        False, 0, "transformer_blocks.1")
    attention = first["attention"]
    assert (attention["module"], attention["inputs_finite"], attention["mask"]["dtype"]) == (
        "transformer_blocks.1", False, "torch.bool")
    assert list(first["block_max"]) == ["transformer_blocks.0", "transformer_blocks.1"]


def test_the_nonfinite_locator_finds_nothing_in_a_finite_call_and_counts_rows_without_keys(
        benchmark_script: Callable[[str], ModuleType]) -> None:
    import torch

    from hookkit.tools.bench import models

    bench = benchmark_script("first_nonfinite")
    opts = models.ModelOptions(name="hunyuanvideo15", steps=1, device="cpu")
    report = bench.locate(models.load_pipeline(opts), opts, "math")
    assert (report["output_finite"], report["first_call"], report["sdpa"]) == (True, None, "math")
    assert [(r["first_module"], r["attention"]) for r in report["transformer_calls"]] == [(None, None)] * 2
    mask = torch.tensor([[True, False], [False, False]])
    assert bench.rows_without_keys(mask) == 1 and bench.rows_without_keys(None) == 0


@pytest.mark.slow
def test_the_masked_call_check_runs_the_kernel_on_hunyuanvideo15s_own_padding_masked_call(tmp_path: Path) -> None:
    out = tmp_path / "masked_call.json"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "masked_attention_call.py"), "--frames", "1", "--height",
                           "256", "--width", "256", "--heads", "0", "--out", str(out)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    # 16 x 16 latent tokens, 256 ByT5 and 1,000 Qwen2.5-VL tokens valid, then the 729 image tokens, padding in t2v
    assert (report["shape"], report["valid"], report["padding_mask"]) == ([1, 16, 2241, 128], 1512, True)
    [row] = report["rows"]
    assert (row["head"], row["nonfinite"], row["padding_rows_max_abs"]) == (0, 0, 0.0)
    assert row["mean_rel_error_valid_rows"] < 0.05  # the kernel's bound at Wan's shape


KERNEL_WATCH = """
import json, sys
import torch
sys.path.insert(0, "benchmarks")
import first_nonfinite
from hookkit.techniques.attention import fp8_triton

real = fp8_triton.attention

def nan_under_a_mask(q, k, v, scale=None, mask=None, **options):  # a kernel that misreads masks: row 5 of head 1
    out = real(q, k, v, scale, mask, **options)
    if mask is not None:
        out[0, 1, 5, 3] = float("nan")
    return out

fp8_triton.attention = nan_under_a_mask
calls = []
first_nonfinite.watch_kernel("fp8_triton", calls)
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 2, 80, 32, generator=g).to(torch.bfloat16) for _ in range(3))
valid = torch.arange(80) < 70
fp8_triton.attention(q, k, v)
fp8_triton.attention(q, k, v, None, (valid[:, None] & valid[None, :])[None, None])
fp8_triton.attention(q, k, v, None, (valid[:, None] & valid[None, :])[None, None])
print(json.dumps(calls))
"""


def test_the_nonfinite_locator_records_the_kernels_first_nonfinite_call_and_the_same_call_unmasked(
        interpreted: Callable[[str], Any]) -> None:
    first, second, third = interpreted(KERNEL_WATCH)
    assert first == {"call": 0, "nonfinite_values": 0} and third == {"call": 2, "nonfinite_values": 1}
    assert {k: second[k] for k in ("nonfinite_values", "nonfinite_rows", "heads_with_nonfinite", "first_rows",
                                   "valid_prefix", "prefix_nonfinite_values", "unmasked_nonfinite_values",
                                   "sdpa_nonfinite_values", "inputs_finite")} == {
        "nonfinite_values": 1, "nonfinite_rows": 1, "heads_with_nonfinite": 1, "first_rows": [5], "valid_prefix": 70,
        "prefix_nonfinite_values": 0, "unmasked_nonfinite_values": 0, "sdpa_nonfinite_values": 0,
        "inputs_finite": True}
    assert second["mask"] == {"dtype": "torch.bool", "shape": [1, 1, 80, 80], "stride": [6400, 6400, 80, 1],
                              "rows_without_keys": 10, "keys_allowed": 4900}
