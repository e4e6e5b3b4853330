"""Hook core and one file per technique.

- `registry.py`: `ModelHook`, `HookRegistry` (ordered, named hooks per module; exact restoration).
- `methods.py`: instance-level method patches for schedulers and pipelines.
- one file per technique, each with a frozen spec (in `hookkit.spec`), its hooks, a public `apply_*`
  function and a `FEATURE` object that plugs it into `hookkit.enable`.
"""

from __future__ import annotations

import importlib
from typing import Any

from hookkit.core.registry import HookRegistry, ModelHook, registry_names

__all__ = ["HookRegistry", "ModelHook", "registered_features", "registry_names"]


#: Technique modules in attach order (after the core clock). Each defines `FEATURE`. Quantization first
#: (it swaps weights), then context parallelism (diffusers' hooks around the transformer), compile last (it
#: wraps the forwards the other hooks surround).
TECHNIQUES: tuple[str, ...] = ("quantize.torchao", "parallel", "memo", "sync_free", "cache.hooks", "compile.hooks")


def registered_features() -> list[Any]:
    """The `FEATURE` object of every technique module, in attach order."""
    return [importlib.import_module(f"hookkit.techniques.{name}").FEATURE for name in TECHNIQUES]
