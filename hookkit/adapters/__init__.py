"""Adapters: declarative per-model descriptions of a diffusion transformer.

An adapter says which transformer class it is for (exact class name, never a prefix; a dotted path
"pkg.module.Class" names one class exactly and wins over a bare name), which block lists
run in which order, what each block class takes and returns, which classes are repeated (for regional
compilation), which Linear layers must never be quantized, how CFG is run, and where per-step index
tensors are built. Adapters are data: one TOML file per model family in `adapters/`, loaded and
validated into frozen attrs classes. `register_adapter()` adds one at run time.

A transformer with no adapter gets one derived from its own code (`hookkit.adapters.derive`: the forward's
loops over its block lists, the blocks' signatures and returns); the first transformer call confirms it
(`hookkit.core.firstcall`). `hookkit adapter derive MODEL` prints a derived adapter as TOML (`adapter_toml`).
"""

from hookkit.adapters.derive import CUSTOM_ADAPTER_HELP, adapter_toml, derive, derive_adapter
from hookkit.adapters.registry import (
    adapters_dir,
    get_adapter,
    list_adapters,
    register_adapter,
    resolve_adapter,
    unregister_adapter,
)
from hookkit.adapters.spec import CFG_STYLES, MEMO_SCOPES, STREAMS, AdapterSpec, BlockListSpec, CPGather, CPPlanEntry, CPSplit

__all__ = [
    "CFG_STYLES", "CUSTOM_ADAPTER_HELP", "adapter_toml", "derive", "MEMO_SCOPES", "STREAMS", "AdapterSpec", "BlockListSpec",
    "CPGather", "CPPlanEntry", "CPSplit", "adapters_dir",
    "derive_adapter", "get_adapter", "list_adapters", "register_adapter", "resolve_adapter", "unregister_adapter",
]
