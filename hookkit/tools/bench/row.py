"""What a row of the bench matrix is: its configuration (`BenchConfig`: how to set a freshly built pipeline up,
and what that needs), the `RunContext` the setup sees, and the keys of the result row a measurement fills in."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

import hookkit
from hookkit.core import compat
from hookkit.errors import SpecError
from hookkit.techniques.cache.spec import resolve_steps_mask
from hookkit.tools.bench.models import ModelOptions


@attrs.define
class RunContext:
    """What a configuration's setup sees and leaves behind (the hookkit handle, notes for the table)."""

    pipe: Any
    opts: ModelOptions
    handle: Any = None
    #: feature data of a configuration that is not hookkit's, read after the timed runs (cache-dit's steps)
    features: Callable[[], dict[str, Any]] | None = None
    #: the same per further transformer of the pipeline (Wan 2.2's `transformer_2`), by component name
    companion_features: Callable[[], dict[str, dict[str, Any]]] | None = None


def expert_steps_mask(pipe: Any, mask: Sequence[int], steps: int) -> tuple[int, ...] | None:
    """`mask` restarted at each expert's first step of a two-expert pipeline (Wan 2.2: `transformer` on the timesteps
    at or above `boundary_ratio * num_train_timesteps`, `transformer_2` below), or None for a one-transformer pipeline.

    Why: cache-dit counts the steps of each expert's blocks from 0 and indexes its step mask with that count, while
    hookkit's mask is indexed by the pipeline step. Given this mask, hookkit's rows compute the steps cache-dit's
    rows compute (at 6 steps, "fast" (1, 0, 0, 1, 0, 1) with experts on steps 0-1 and 2-5 becomes (1, 0, 1, 0, 0, 1)).
    """
    import copy

    ratio = getattr(getattr(pipe, "config", None), "boundary_ratio", None)
    if getattr(pipe, "transformer_2", None) is None or ratio is None:
        return None
    scheduler = copy.deepcopy(pipe.scheduler)  # set_timesteps writes into the scheduler
    scheduler.set_timesteps(steps, device="cpu")
    boundary = ratio * scheduler.config.num_train_timesteps
    experts = [0 if float(t) >= boundary else 1 for t in scheduler.timesteps]
    out, start = [], 0
    for i, expert in enumerate(experts):
        if i and expert != experts[i - 1]:
            start = i
        out.append(int(mask[i - start]))
    return tuple(out)


@attrs.frozen
class HookkitSetup:
    """A hookkit row's setup: `hookkit.enable(pipe, make_spec())`. On a two-expert pipeline (Wan 2.2) a static
    "fast" cache mask restarts at each expert's first step, as cache-dit counts steps, so both compute the same ones.
    The Spec factory is kept so that a row the compat table refuses for the model is skipped before its process
    starts (`BenchConfig.unavailable`).

    Args:
        make_spec: builds the row's `hookkit.Spec`.
    """

    make_spec: Callable[[], Any]

    def __call__(self, ctx: RunContext) -> None:
        spec = self.make_spec()
        cache = spec.cache
        two_experts = getattr(ctx.pipe, "transformer_2", None) is not None
        if two_experts and cache is not None and cache.steps_mask == "fast":  # the peer's computed steps
            steps = ctx.opts.num_steps()
            per_expert = expert_steps_mask(ctx.pipe, resolve_steps_mask("fast", steps), steps)
            if per_expert is not None:
                spec = attrs.evolve(spec, cache=attrs.evolve(cache, steps_mask=per_expert))
        ctx.handle = hookkit.enable(ctx.pipe, spec)


@attrs.frozen(kw_only=True)
class BenchConfig:
    """One row of the matrix: how to set a freshly built pipeline up, and what it needs."""

    name: str
    kind: str  # "stock" | "peer" | "hookkit"
    description: str
    setup: Callable[[RunContext], None]
    fields: frozenset[str] = frozenset()  # hookkit Spec fields it needs
    needs_cuda: bool = False
    needs_module: str | tuple[str, ...] | None = None  # a package the row imports (or several)

    def unavailable(self, device: torch.device, have: frozenset[str], adapter: Any = None) -> str | None:
        """Why this configuration cannot run here, or None when it can; with the model's `adapter`, a hookkit row
        whose Spec the compat table refuses for it (`hookkit.core.compat`) is named with the refusal, before any
        process builds the model."""
        missing = sorted(self.fields - have)
        if missing:
            return f"hookkit has no feature for Spec.{missing[0]} in this installation"
        if self.needs_cuda and device.type != "cuda":
            return "needs a CUDA device"
        if self.needs_module is not None:
            import importlib.util

            names = (self.needs_module,) if isinstance(self.needs_module, str) else self.needs_module
            for name in names:
                if importlib.util.find_spec(name) is None:
                    return f"{name} is not installed"
        if adapter is not None and isinstance(self.setup, HookkitSetup):
            try:
                compat.check(self.setup.make_spec(), adapter)
            except SpecError as exc:
                return f"refused on {adapter.name}: {exc}"
        return None


# --- one measurement (in the child process) ----------------------------------------------------------------

ROW_KEYS = ("config", "kind", "description", "status", "note", "load_s", "setup_s", "warmup_s", "latency_s",
            "latencies_s", "peak_memory_gb", "memory_kind", "speedup", "psnr_db", "identical", "nonfinite", "features",
            "companion_features", "compiled_graphs", "graphs_compiled_while_timed", "first_call_s", "time_to_first_image_s", "cold",
            "timing_caveat")


def _empty_row(config: BenchConfig, status: str, note: str) -> dict[str, Any]:
    """A row with no measurement: `status` "skipped" or "failed", `note` says why."""
    row: dict[str, Any] = {key: None for key in ROW_KEYS}
    row.update(config=config.name, kind=config.kind, description=config.description, status=status,
               note=note[:300], latencies_s=[], identical=False, features={}, companion_features={})
    return row
