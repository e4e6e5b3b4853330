"""Adapters: declarative per-model descriptions of a diffusion transformer.

An adapter says which transformer class it is for (exact class name, never a prefix; a dotted path
"pkg.module.Class" names one class exactly and wins over a bare name), which block lists
run in which order, what each block class takes and returns, which classes are repeated (for regional
compilation), which Linear layers must never be quantized, how CFG is run, and where per-step index
tensors are built. Adapters are data: one TOML file per model family in `adapters/`, loaded and
validated into frozen attrs classes. `register_adapter()` adds one at run time.

A transformer with no adapter gets one derived from diffusers' own metadata (`_repeated_blocks` and the
block registry in `diffusers.hooks._helpers`) when that is possible.
"""

from hookkit.adapters.derive import CUSTOM_ADAPTER_HELP, derive_adapter
from hookkit.adapters.registry import (
    adapters_dir,
    get_adapter,
    list_adapters,
    register_adapter,
    resolve_adapter,
    unregister_adapter,
)
from hookkit.adapters.spec import CFG_STYLES, MEMO_SCOPES, STREAMS, AdapterSpec, BlockListSpec

__all__ = [
    "CFG_STYLES", "CUSTOM_ADAPTER_HELP", "MEMO_SCOPES", "STREAMS", "AdapterSpec", "BlockListSpec", "adapters_dir",
    "derive_adapter", "get_adapter", "list_adapters", "register_adapter", "resolve_adapter", "unregister_adapter",
]
