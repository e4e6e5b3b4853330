"""What a row measures besides its setup: synchronized wall time, peak memory, graphs compiled, and the PSNR of
its output against the reference row's; and the caveat that goes beside timings which are no performance claim."""

from __future__ import annotations

import math
import resource
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from hookkit.errors import SpecError


def device_description(device: torch.device) -> str:
    """The device column of a timing: `NVIDIA H200 x 1` or `CPU (2 threads)` (the thread count moves CPU timings)."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} x {torch.cuda.device_count()}"
    threads = torch.get_num_threads()
    return f"CPU ({threads} thread{'s' if threads != 1 else ''})"


#: What the table says beside the timings of a tiny model measured on the CPU: a call there takes milliseconds, mostly
#: interpreter and dispatch work, so its speed-ups say nothing about a real model on a GPU.
TINY_CPU_TIMINGS = "CPU, tiny model: timings are not a performance claim; run on a GPU with --full"


def timing_caveat(device: torch.device, tiny: bool) -> str | None:
    """What a row's timings need said beside them: `TINY_CPU_TIMINGS` for a `tiny` model (zoo's, neither `--full` nor
    `--model-path`) measured on the CPU; None for anything else."""
    return TINY_CPU_TIMINGS if device.type == "cpu" and tiny else None


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device | None = None) -> tuple[float, Any]:
    """`(seconds, fn())`, `device` (default: the current CUDA device, if any) synchronized before and after
    so that queued GPU work is counted."""
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    synchronize(device)
    return time.perf_counter() - t0, out


def _dynamo_graphs() -> int:
    """Graphs torch.compile has compiled in this process so far (dynamo's `unique_graphs` counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _peak_memory_gb(device: torch.device) -> tuple[float, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9, "cuda_max_memory_allocated"
    # ru_maxrss is in KiB on Linux, bytes on macOS
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss * (1 if sys.platform == "darwin" else 1024) / 1e9, "cpu_max_rss"


def psnr(reference: torch.Tensor, output: torch.Tensor, peak: float | None = None) -> float:
    """PSNR in dB of `output` against `reference` (`math.inf` when they are equal).

    `peak` defaults to the reference's value range (1.0 for images in [0, 1]; the range for latents).
    """
    if reference.shape != output.shape:
        raise SpecError(f"psnr: shapes differ: reference {tuple(reference.shape)}, output {tuple(output.shape)}.")
    ref, out = reference.double(), output.double()
    mse = torch.mean((ref - out) ** 2).item()
    if peak is None:
        peak = (ref.max() - ref.min()).item() or 1.0
    return psnr_from_mse(mse, peak)


def psnr_from_mse(mse: float, peak: float = 1.0) -> float:
    """PSNR in dB of a mean squared error against `peak`; `math.inf` when it is 0 (bitwise-equal outputs)."""
    return math.inf if mse == 0 else 10.0 * math.log10(peak * peak / mse)
