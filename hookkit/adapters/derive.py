"""Adapters derived from diffusers' own metadata, for transformers no adapter file names."""

from __future__ import annotations

import inspect

import torch

from hookkit.adapters.spec import AdapterSpec, BlockListSpec, _block_metadata, _registered_returns
from hookkit.errors import AdapterError

CUSTOM_ADAPTER_HELP = (
    "Write an adapter: a TOML file with `name`, `transformer = [\"<ExactClassName>\"]` and one [[blocks]] table "
    "per nn.ModuleList of blocks in execution order (attr, class, hidden_arg, encoder_arg, returns), then call "
    "hookkit.register_adapter(path). See examples/custom_adapter.py and the files in adapters/."
)


def derive_adapter(transformer: torch.nn.Module) -> AdapterSpec:
    """Build an adapter from `_repeated_blocks` and diffusers' `TransformerBlockRegistry`, or raise."""
    cls_name = type(transformer).__name__
    declared = getattr(transformer, "_repeated_blocks", None) or ()
    present = {type(m).__name__ for m in transformer.modules()}
    # diffusers may name classes that only some configurations build; those are no region of this model
    repeated = tuple(c for c in ((declared,) if isinstance(declared, str) else declared) if c in present)
    blocks: list[BlockListSpec] = []
    for attr, child in transformer.named_children():
        if not isinstance(child, torch.nn.ModuleList) or len(child) == 0:
            continue
        classes = {type(m) for m in child}
        if len(classes) != 1:
            continue
        block_cls = classes.pop()
        if repeated and block_cls.__name__ not in repeated:
            continue
        meta = _block_metadata(block_cls)
        if meta is None:
            continue
        params = inspect.signature(block_cls.forward).parameters
        encoder_arg = meta.encoder_hidden_states_argument_name if meta.encoder_hidden_states_argument_name in params else None
        blocks.append(BlockListSpec(
            attr=attr, classes=(block_cls.__name__,), hidden_arg=meta.hidden_states_argument_name,
            encoder_arg=encoder_arg, returns=tuple(_registered_returns(meta)),
        ))
    if not blocks:
        raise AdapterError(
            f"no adapter for {cls_name} and none can be derived: it has no block list whose class diffusers "
            f"registers in TransformerBlockRegistry{' and names in _repeated_blocks' if repeated else ''}. "
            + CUSTOM_ADAPTER_HELP
        )
    return AdapterSpec(
        name=f"derived:{cls_name}", transformer=(cls_name,), blocks=tuple(blocks),
        repeated_blocks=repeated or tuple(dict.fromkeys(c for b in blocks for c in b.classes)),
        source="derived from diffusers metadata",
    )
