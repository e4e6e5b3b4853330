"""Spec + adapter -> a plan (pure data) -> attachments.

`build_plan` only reads: it resolves which hooks go where and returns a `Plan` you can print, compare
and test as data. `enable` then performs it (`Handle._attach`), collecting one removable per attachment; if
any step fails, everything attached so far is removed in reverse order and the error is re-raised.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs
import torch

from hookkit.core.registry import HookRegistry, ModelHook
from hookkit.core.removal import Removable, Removal
from hookkit.errors import HookError

if TYPE_CHECKING:
    from hookkit.adapters import AdapterSpec

#: a `hookkit.Spec`. The core types it as `Any` rather than importing it: `hookkit.Spec` composes every technique's
#: spec, and the core imports no technique, not even for type hints (`tests/test_architecture.py`).
AnySpec = Any

__all__ = ["AnySpec", "Attachment", "HookRemoval", "Plan", "PlanContext", "Removable", "add_hook", "flat_blocks", "module_at"]


@attrs.frozen(kw_only=True)
class Attachment:
    """One thing to attach: `feature` puts hook `name` on `target` (a module path under the transformer,
    `""` for the transformer itself, or `pipeline.<attr>.<method>` for a method patch)."""

    feature: str
    target: str
    name: str
    params: tuple[tuple[str, Any], ...] = ()

    def param(self, key: str, default: Any = None) -> Any:
        return dict(self.params).get(key, default)


@attrs.frozen(kw_only=True)
class Plan:
    adapter: AdapterSpec
    spec: AnySpec
    transformer_class: str
    has_pipeline: bool
    attachments: tuple[Attachment, ...]

    def targets(self, feature: str | None = None) -> list[tuple[str, str]]:
        """`(target, name)` pairs in attach order, optionally for one feature: handy in tests."""
        return [(a.target, a.name) for a in self.attachments if feature is None or a.feature == feature]


@attrs.frozen(kw_only=True)
class PlanContext:
    """What a feature may look at while planning (read only)."""

    spec: AnySpec
    adapter: AdapterSpec
    transformer: torch.nn.Module
    pipeline: Any | None
    #: False for the second and later transformers of a pipeline (Wan 2.2's `transformer_2`): pipeline-level
    #: attachments (scheduler patches and listeners) belong to the first transformer's plan alone, since a
    #: scheduler method carries one hookkit patch and one pipeline call is one generation for all of them
    scheduler_owner: bool = True


class HookRemoval(Removal):
    """Removes one named hook from one module; removing the last hook restores the module."""

    def __init__(self, module: torch.nn.Module, name: str) -> None:
        self.module: torch.nn.Module | None = module
        self.name = name

    def _undo(self) -> None:
        registry = HookRegistry.of(self.module, create=False)
        if registry is not None and self.name in registry:
            registry.remove(self.name)
        self.module = None


def add_hook(module: torch.nn.Module, name: str, hook: ModelHook, position: int | None = None) -> HookRemoval:
    """Register `hook` on `module` and return what removes it."""
    HookRegistry.of(module).register(name, hook, position=position)
    return HookRemoval(module, name)


def module_at(root: torch.nn.Module, path: str) -> torch.nn.Module:
    """`root.get_submodule(path)` with an error that names the path."""
    try:
        return root.get_submodule(path) if path else root
    except AttributeError:
        raise HookError(f"{type(root).__name__} has no submodule {path!r}; the adapter or plan is out of date.") from None


def flat_blocks(adapter: AdapterSpec, transformer: torch.nn.Module) -> list[tuple[str, Any, torch.nn.Module]]:
    """Every block in execution order: `(module path, BlockListSpec, block)` across all block lists."""
    out = []
    for spec, modules in adapter.block_lists(transformer):
        for i, block in enumerate(modules):
            out.append((f"{spec.attr}.{i}", spec, block))
    return out
