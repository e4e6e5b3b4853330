"""Context parallelism (diffusers' `enable_parallelism`) as hookkit sees it: detection and global reductions.

Ranks of a context-parallel mesh each hold a sequence shard; a rank that skips blocks (a cached step) skips their
collectives, and one that computes then waits forever. Every decision that changes which collectives run must be
the same on every rank. hookkit's decisions in the loop, and why each is global:

- DBCache threshold (relative L1 of the Fn residual): numerator and denominator sums all-reduced over the group
  (`global_sums`; exact for uneven shards too, unlike a mean of ratios), one all-reduce per decided step.
- DBCache `max_accumulated_diff`: a sum of those global diffs.
- DBCache warm-up, masks, cached-step limits, "no reference yet", shape changes: step indices and global shapes.
- TaylorSeer: extrapolates each rank's own shard from step indices; elementwise, decides nothing.
- whole-transformer CUDA graphs: static-mask decisions, keyed by call count and the global input signature.
- compile: a per-rank recompilation runs the same collectives. memo, sync_free, quantize: no data-dependent
  decision in the loop.

Detection runs at every generation start, so `enable_parallelism` may come before or after `hookkit.enable`.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch


@attrs.frozen(kw_only=True)
class ParallelInfo:
    """Where a transformer runs under diffusers' context parallelism: its group and degrees."""

    #: the process group of the flattened ("ring", "ulysses") mesh: the ranks that share one sequence
    group: Any
    rank: int
    world_size: int
    ulysses: int
    ring: int
    anything: bool
    mesh: str

    def describe(self) -> dict[str, Any]:
        """Plain data for summaries."""
        return {"world_size": self.world_size, "rank": self.rank, "ulysses": self.ulysses, "ring": self.ring,
                "anything": self.anything, "mesh": self.mesh}


def context_parallel_config(module: torch.nn.Module) -> Any | None:
    """diffusers' `ContextParallelConfig` the module runs under (set by `enable_parallelism`), or None."""
    config = getattr(module, "_parallel_config", None)
    return getattr(config, "context_parallel_config", None) if config is not None else None


def parallel_info(module: torch.nn.Module) -> ParallelInfo | None:
    """The context-parallel group of `module` when diffusers' `enable_parallelism` sharded it over more than one
    rank; None otherwise (no parallelism, tensor parallelism only, or a mesh of one)."""
    cp = context_parallel_config(module)
    if cp is None or getattr(cp, "_flattened_mesh", None) is None:
        return None
    mesh = cp._flattened_mesh
    if mesh.size() <= 1:
        return None
    group = mesh.get_group()
    return ParallelInfo(group=group, rank=torch.distributed.get_rank(group), world_size=mesh.size(),
                        ulysses=cp.ulysses_degree, ring=cp.ring_degree,
                        anything=bool(cp.ulysses_anything or cp.ring_anything), mesh=str(cp._mesh))


def as_forward_sees(module: torch.nn.Module, name: str, value: Any) -> Any:
    """`value`, given to `module`'s argument `name` from outside diffusers' hooks on it, as the module's own forward
    receives it: cut the way diffusers' context-parallel split hook on `module` cuts it (Wan's plan splits the first
    block's `hidden_states`), unchanged where no such hook splits `name`. The cut is a view, with no collective."""
    registry = module.__dict__.get("_diffusers_hook")
    if registry is None or not isinstance(value, torch.Tensor):
        return value
    from diffusers.hooks.context_parallel import ContextParallelSplitHook
    from diffusers.models._modeling_parallel import ContextParallelInput

    for hook in registry.hooks.values():
        if isinstance(hook, ContextParallelSplitHook):
            cpi = hook.metadata.get(name)
            if isinstance(cpi, ContextParallelInput) and not cpi.split_output:
                value = hook._prepare_cp_input(value, cpi)
    return value


def global_sums(values: torch.Tensor, group: Any) -> torch.Tensor:
    """`values` summed over every rank of `group` (one all-reduce; a new tensor, `values` is left alone).

    Every rank of the group must call it at the same point: the callers make sure the call itself is decided by
    global facts only (see the module docstring).
    """
    out = values.clone()
    torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.SUM, group=group)
    return out


def gather_objects(obj: Any, group: Any = None) -> list[Any]:
    """`obj` from every rank of `group` (the world by default), in rank order; `[obj]` without torch.distributed."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [obj]
    out: list[Any] = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(out, obj, group=group)
    return out
