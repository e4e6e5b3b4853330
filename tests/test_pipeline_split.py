"""benchmarks/pipeline_split.py: where a pipeline call's time goes (its GPU columns need CUDA; the bookkeeping and the
host columns run on the CPU)."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest
import torch

from hookkit.tools import bench


@pytest.fixture(scope="module")
def split(benchmark_script: Callable[[str], ModuleType]) -> ModuleType:
    return benchmark_script("pipeline_split")


def test_host_intervals_run_from_each_call_to_the_next_and_the_last_to_the_end(split: ModuleType) -> None:
    clock = split.CallClock(cuda=False)
    clock.host = [1.0, 1.5, 1.75]
    gpu, host = split.intervals_ms(clock, None, 2.0)
    assert (gpu, host) == ([], [500.0, 250.0, 250.0])


def test_runs_are_combined_call_by_call(split: ModuleType) -> None:
    assert split._median_lists([[1.0, 9.0], [3.0, 5.0], [2.0, 7.0]]) == [2.0, 7.0]
    assert split._median_lists([]) == []


def test_the_clock_marks_every_transformer_call_of_a_pipeline_call(split: ModuleType) -> None:
    opts = bench.ModelOptions(name="flux", steps=5, device="cpu")
    with torch.no_grad():
        row = split.measure(bench.CONFIGS["hookkit-cache-fast"], opts, runs=2, warmup=1, sleep_ms=0.0, sleep_at=1)
    # one host interval per denoising step; no GPU columns on the CPU
    assert len(row["host_per_call_ms"]) == 5 and all(ms > 0 for ms in row["host_per_call_ms"])
    assert row["gpu_per_call_ms"] == [] and "gpu_only_span_s" not in row and len(row["wall_all_s"]) == 2
    assert row["features"]["cache"]["branches"]  # the hookkit handle's summary data is kept
