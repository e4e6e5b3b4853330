"""Kernel timing shared by the micro-benchmarks (attention_kernels.py, norm_rope.py, rowwise_quant.py).

A kernel alone is timed on the GPU with CUDA events, so host work is not counted, and, where it can be captured, as
CUDA-graph replays, so that launch overhead is not counted either. On the CPU (the scripts' test path) the host clock
times plain calls. Every time is milliseconds per call of `fn`.

    from benchmarks.timing import summary, time_graph_replays
    timed = time_graph_replays(lambda: kernel(x), repeats=20, warmup=3)
    summary(timed.times_ms)  # {"median_ms": ..., "min_ms": ..., "max_ms": ...}
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

#: what `Timed.how` says: the clock and the form of the calls
HOST_CLOCK = "host clock"
EVENTS_PLAIN = "CUDA events, plain calls"
EVENTS_GRAPH = "CUDA events, graph replays"


@dataclass(frozen=True)
class Timed:
    """Times of one kernel and how they were taken.

    Args:
        times_ms: milliseconds per call of the timed function, one entry per repeat.
        how: the clock and the form of the calls (HOST_CLOCK, EVENTS_PLAIN, EVENTS_GRAPH, or EVENTS_PLAIN with the
            reason the capture failed), which the scripts record beside the numbers.
    """

    times_ms: list[float]
    how: str


def time_calls(fn: Callable[[], Any], repeats: int, warmup: int, device: str = "cuda") -> list[float]:
    """Milliseconds of each of `repeats` plain calls of `fn`, after `warmup` untimed calls.

    Args:
        fn: the work to time, called with no arguments.
        repeats: timed calls (one time each).
        warmup: untimed calls first (compilation, autotuning, allocator warm-up).
        device: "cuda" to time each call by CUDA events on the current stream (host work not counted), "cpu" to time
            it by the host clock.
    """
    for _ in range(warmup):
        fn()
    out: list[float] = []
    if device == "cpu":
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            out.append((time.perf_counter() - start) * 1e3)
        return out
    torch.cuda.synchronize()
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end))
    return out


def _capture(fn: Callable[[], Any], calls: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `calls` calls of `fn`, after one call on a side stream (capture needs warmed-up kernels)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def time_graph_replays(fn: Callable[[], Any], repeats: int, warmup: int, *, device: str = "cuda",
                       calls_per_replay: int = 1, fallback: bool = True) -> Timed:
    """Milliseconds per call of `fn`, as CUDA-graph replays timed by CUDA events; plain calls where capture fails.

    Args:
        fn: the work to time, called with no arguments; captured as it is (static inputs and outputs).
        repeats: timed replays (one time each).
        warmup: untimed calls before the capture.
        device: "cuda", or "cpu" for plain calls on the host clock (no capture).
        calls_per_replay: calls of `fn` in the graph; each time is a replay's divided by it (several calls per replay
            make a microsecond kernel's time independent of the replay's own launch).
        fallback: when capture fails, time plain calls and say so in `how` (False: raise the capture's error).
    """
    if device == "cpu":
        return Timed(time_calls(fn, repeats, warmup, device="cpu"), HOST_CLOCK)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    try:
        graph = _capture(fn, calls_per_replay)
    except Exception as error:  # noqa: BLE001 - a kernel that cannot be captured is timed uncaptured
        if not fallback:
            raise
        torch.cuda.synchronize()
        return Timed(time_calls(fn, repeats, 0), f"{EVENTS_PLAIN} (capture failed: {type(error).__name__})")
    graph.replay()
    times = time_calls(graph.replay, repeats, 0)
    return Timed([t / calls_per_replay for t in times], EVENTS_GRAPH)


def summary(times_ms: list[float]) -> dict[str, float]:
    """Median, min and max of some times (milliseconds); raises ValueError on none.

    Args:
        times_ms: the times, e.g. `Timed.times_ms`.
    """
    if not times_ms:
        raise ValueError("benchmarks.timing.summary: expected at least one time, got none; time with repeats >= 1")
    return {"median_ms": statistics.median(times_ms), "min_ms": min(times_ms), "max_ms": max(times_ms)}
