"""benchmarks/peer_goals_report.py's goal verdicts: what a lease's numbers say about each goal against the peer."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest


@pytest.fixture
def report(benchmark_script: Callable[[str], ModuleType]) -> ModuleType:
    return benchmark_script("peer_goals_report")


def doc(report: ModuleType, **rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A report document with these rows per group (`qwen_1024=[...]` for "qwen-1024"); other groups empty."""
    return {"groups": {name: {"rows": rows.get(name.replace("-", "_"), [])} for name in report.GROUPS},
            "step_profile": None}


def row(config: str, seconds: float, gb: float) -> dict[str, Any]:
    return {"config": config, "status": "ok", "latency_s": seconds, "peak_memory_gb": gb}


def verdict(report: ModuleType, document: dict[str, Any], goal_start: str) -> str:
    return next(v for goal, _, v in report.goals(document) if goal.startswith(goal_start))


def test_a_fast_qwen_image_row_without_the_peer_in_the_run_is_not_the_goal_met(report: ModuleType) -> None:
    document = doc(report, qwen_1024=[row(report.MOD, 1.068, 20.94)])
    assert verdict(report, document, "qwen-1024") == "met without the peer in this run (not the goal)"


def test_qwen_image_beside_the_peer_is_held_to_the_peers_memory_not_fluxs(report: ModuleType) -> None:
    document = doc(report, qwen_1024=[row(report.MOD, 1.068, 20.94), row(report.PEER, 1.738, 27.89)])
    assert verdict(report, document, "qwen-1024") == "met"


def test_qwen_image_two_milliseconds_over_is_missed(report: ModuleType) -> None:
    document = doc(report, qwen_1024=[row(report.MOD, 1.082, 20.94), row(report.PEER, 1.738, 27.89)])
    assert verdict(report, document, "qwen-1024") == "missed"


def test_the_uncached_step_is_the_uncached_rows_time_per_step(report: ModuleType) -> None:
    document = doc(report, flux_1024=[row(report.UNCACHED, 2.5754, 12.27)])
    measured = next(m for goal, m, _ in report.goals(document) if goal.startswith("uncached"))
    assert measured.startswith(f"pipeline 92.0 ms ({report.UNCACHED}, 2.575 s / 28)")
    assert verdict(report, document, "uncached") == "met"
