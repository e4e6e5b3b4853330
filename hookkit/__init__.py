"""hookkit: hook-based runtime optimizations for Hugging Face diffusers pipelines.

    handle = hookkit.enable(pipe, hookkit.Spec(cache=hookkit.DBCache(...), ...))
    pipe(...)
    print(handle.summary())
    hookkit.disable(pipe)  # the pipeline is exactly as before
"""

from __future__ import annotations

from hookkit import errors
from hookkit.diagnostics import testing
from hookkit.techniques.quantize import filters
from hookkit.core.log import set_verbosity
from hookkit.adapters import (
    AdapterSpec,
    BlockListSpec,
    get_adapter,
    list_adapters,
    register_adapter,
    resolve_adapter,
    unregister_adapter,
)
from hookkit.core.handle import Handle, disable, handle_of
from hookkit.features import build_plan, enable
from hookkit.spec import Spec
from hookkit.techniques.attention.spec import Attention
from hookkit.techniques.cache.calibration import CacheCalibration
from hookkit.techniques.cache.hooks import plot_cache_diffs
from hookkit.techniques.cache.spec import DBCache
from hookkit.techniques.compile.spec import Compile
from hookkit.techniques.parallel.spec import ContextParallel
from hookkit.techniques.quantize.spec import Quantize
from hookkit.diagnostics.host_syncs import SyncReport, profile_syncs

__version__ = "0.1.0.dev0"


def calibrate(pipe: object, calls: list, *, sensitivity: bool = False, progress: bool = False) -> CacheCalibration:
    """One uncached run of `calls` on `pipe`: the `CacheCalibration` DBCache's "magnitude" and "schedule" rules read
    (with `sensitivity`, one more run per step: the per-step gains). See `hookkit.tools.tune.calibrate` (imported on
    first use: `import hookkit` loads no tooling)."""
    from hookkit.tools.tune import calibrate as run

    return run(pipe, calls, sensitivity=sensitivity, progress=progress)


def tune(pipe: object, calls: list, *, speedup: float | None = None, min_psnr: float | None = None,
         progress: bool = True) -> Spec:
    """The caching Spec with the best PSNR at >= `speedup`, or the fastest above `min_psnr`, measured on `calls`.
    See `hookkit.tools.tune.tune` (imported on first use: `import hookkit` loads no tooling)."""
    from hookkit.tools.tune import tune as run

    return run(pipe, calls, speedup=speedup, min_psnr=min_psnr, progress=progress)


__all__ = [
    "AdapterSpec",
    "Attention",
    "BlockListSpec",
    "CacheCalibration",
    "Compile",
    "ContextParallel",
    "DBCache",
    "Handle",
    "Quantize",
    "Spec",
    "SyncReport",
    "build_plan",
    "calibrate",
    "disable",
    "enable",
    "errors",
    "filters",
    "get_adapter",
    "handle_of",
    "list_adapters",
    "plot_cache_diffs",
    "profile_syncs",
    "register_adapter",
    "resolve_adapter",
    "set_verbosity",
    "testing",
    "tune",
    "unregister_adapter",
]
