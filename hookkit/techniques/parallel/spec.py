"""The `ContextParallel` spec: pure data, validated when built; its hooks and `FEATURE` are in `hooks.py`, so
that `hookkit.Spec` composes it without importing diffusers' parallel engine or the core's feature contract."""

from __future__ import annotations

from typing import Any, ClassVar

import attrs

from hookkit.core.validate import boolean, int_field
from hookkit.errors import SpecError

__all__ = ["ContextParallel"]


def _check_str_or_none(inst: Any, attr: attrs.Attribute, value: Any) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise SpecError(f"ContextParallel.{attr.name}: expected a diffusers attention backend name (e.g. 'native', "
                        f"'_native_cudnn', 'flash') or None, got {value!r}.")


@attrs.frozen(kw_only=True)
class ContextParallel:
    """Sequence (context) parallelism over torch.distributed, run by diffusers' `enable_parallelism`.

    Args:
        ulysses: Ulysses degree: ranks that exchange heads for sequence with all-to-alls around attention. Must
            divide the attention head count (unless `ulysses_anything`).
        ring: ring degree: ranks that pass key/value shards around a ring (needs an attention backend whose op
            returns the log-sum-exp: `_native_cudnn`, `flash`, `_native_flash`, `sage`, not `native`).
            `ulysses * ring` ranks share one sequence; at least 2.
        ulysses_anything: let Ulysses split sequence lengths and head counts it does not divide (uneven shards;
            only with `ring=1`).
        ring_anything: let ring attention split sequence lengths it does not divide (only with `ulysses=1`).
        attention_backend: set on the transformer (`set_attention_backend`) before enabling; None keeps the one it
            has (diffusers' default: `native`). Restored on removal.
        convert_to_fp32: ring attention merges partial outputs and log-sum-exps in float32 (diffusers' default).
    """

    NAME: ClassVar[str] = "parallel"
    ulysses: int = attrs.field(default=1, validator=int_field(1))
    ring: int = attrs.field(default=1, validator=int_field(1))
    ulysses_anything: bool = attrs.field(default=False, validator=boolean)
    ring_anything: bool = attrs.field(default=False, validator=boolean)
    attention_backend: str | None = attrs.field(default=None, validator=_check_str_or_none)
    convert_to_fp32: bool = attrs.field(default=True, validator=boolean)

    def __attrs_post_init__(self) -> None:
        if self.ulysses * self.ring < 2:
            raise SpecError(f"ContextParallel.ulysses * ContextParallel.ring: expected at least 2 ranks per sequence, "
                            f"got ulysses={self.ulysses} * ring={self.ring} = {self.ulysses * self.ring}. Set ulysses=2 "
                            "(or ring=2), or leave Spec.parallel unset for one process.")
        if self.ulysses_anything and self.ring > 1:
            raise SpecError(f"ContextParallel.ulysses_anything: expected ring=1 with it (diffusers' rule), got "
                            f"ring={self.ring}. Use ring=1 or drop ulysses_anything.")
        if self.ulysses_anything and self.ulysses < 2:
            raise SpecError("ContextParallel.ulysses_anything: expected ulysses >= 2 with it, got ulysses=1. "
                            "Raise ulysses or drop ulysses_anything.")
        if self.ring_anything and (self.ulysses > 1 or self.ring < 2):
            raise SpecError(f"ContextParallel.ring_anything: expected ring >= 2 and ulysses=1 with it, got "
                            f"ring={self.ring}, ulysses={self.ulysses}. Fix the degrees or drop ring_anything.")

    @property
    def degree(self) -> int:
        """Ranks that share one sequence."""
        return self.ulysses * self.ring

    @property
    def anything(self) -> bool:
        return self.ulysses_anything or self.ring_anything

    def diffusers_config(self) -> Any:
        """The `diffusers.ContextParallelConfig` this spec stands for (a new one each time: diffusers fills it in)."""
        from diffusers import ContextParallelConfig

        return ContextParallelConfig(ulysses_degree=self.ulysses, ring_degree=self.ring,
                                     ulysses_anything=self.ulysses_anything, ring_anything=self.ring_anything,
                                     convert_to_fp32=self.convert_to_fp32)
