"""Assertions for test suites of code built on hookkit (and of hookkit itself)."""

from __future__ import annotations

from typing import Any

from hookkit.diagnostics.host_syncs import SyncReport, profile_syncs

__all__ = ["assert_no_host_sync"]


def assert_no_host_sync(pipe: Any, skip_first_steps: int = 1, **call_kwargs: Any) -> SyncReport:
    """Run `pipe(**call_kwargs)` and raise `AssertionError` with the "count | where" table if any denoising step
    after the first `skip_first_steps` synchronizes with the host. Returns the (empty) report. GPU only.

    Also fails when no step was profiled (fewer steps than `skip_first_steps + 1`): a pass would prove nothing.
    """
    report = profile_syncs(pipe, skip_first_steps=skip_first_steps, **call_kwargs)
    if not report.steps:
        raise AssertionError(f"assert_no_host_sync: {report.render()}; run more than {skip_first_steps} steps.")
    if report.total:
        raise AssertionError(f"assert_no_host_sync: {report.total} host syncs in the denoising loop.\n{report.render()}")
    return report
