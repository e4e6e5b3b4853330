"""hookkit: hook-based runtime optimizations for Hugging Face diffusers pipelines.

    handle = hookkit.enable(pipe, hookkit.Spec(cache=hookkit.DBCache(...), ...))
    pipe(...)
    print(handle.summary())
    hookkit.disable(pipe)  # the pipeline is exactly as before
"""

from __future__ import annotations

from hookkit import errors
from hookkit._log import set_verbosity
from hookkit.adapters import (
    AdapterSpec,
    BlockListSpec,
    get_adapter,
    list_adapters,
    register_adapter,
    resolve_adapter,
    unregister_adapter,
)
from hookkit.handle import Handle, build_plan, disable, enable, handle_of
from hookkit.specs import Compile, DBCache, Quantize, Spec

__version__ = "0.1.0.dev0"

__all__ = [
    "AdapterSpec",
    "BlockListSpec",
    "Compile",
    "DBCache",
    "Handle",
    "Quantize",
    "Spec",
    "build_plan",
    "disable",
    "enable",
    "errors",
    "get_adapter",
    "handle_of",
    "list_adapters",
    "register_adapter",
    "resolve_adapter",
    "set_verbosity",
    "unregister_adapter",
]
