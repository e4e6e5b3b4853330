"""Context parallelism (diffusers' `enable_parallelism`) as seen by hookkit: detection and global reductions.

hookkit does not shard anything itself: diffusers' context-parallel hooks split the sequence over a device mesh
(`ContextParallelConfig(ulysses_degree=..., ring_degree=...)`) and gather it back at the output. What hookkit must
do is make every decision that changes *which collectives run* identical on every rank of that mesh: a rank that
skips the middle blocks (a cached step) no longer enters their all-to-alls, and a rank that computes waits for it
forever (a deadlock under Ulysses; a size mismatch under ring).

Decisions hookkit makes inside the denoising loop, and why each is the same on every rank:

- DBCache rule 8 (relative L1 of the Fn residual against the threshold): each rank only holds its sequence shard,
  so the statistic is reduced over the context-parallel group (`global_sums`): the numerator sum|r - r_ref| and the
  denominator sum|r_ref| separately, which is exact for uneven shards (`ulysses_anything`) too, where averaging the
  per-rank ratios is not. One all-reduce of two numbers per decided step; then every rank reads the same value.
- DBCache `max_accumulated_diff`: a sum of those global diffs, hence global.
- DBCache rules 1-7 (warm-up, mask, cached-step limits, "no reference yet", shape changes): functions of the step
  index and of the global input shapes, which every rank shares (a shard's shape follows from the global one).
- TaylorSeer: extrapolates each rank's own residual shard from step indices; elementwise, decides nothing.
- whole-transformer CUDA graphs with DBCache: the decision comes from the static mask before the call (no
  statistic at all); graph keys are the global call's branch and shapes.
- compile: Dynamo guards and recompilations are per rank, but a recompiled graph runs the same collectives, so a
  rank that recompiles does not change which collectives run; whole-transformer CUDA graphs are warmed up, captured
  and replayed by call count and global input signature, the same on every rank.
- memo, sync_free, quantize: make no data-dependent decision in the loop (memo's tables are keyed by Python values
  that come from global shapes; sync_free maps timesteps; quantization is done before the first call).

Detection runs at every generation start (the first DBCache decision of a call), so `enable_parallelism` may come
before or after `hookkit.enable`.
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
