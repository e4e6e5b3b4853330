"""Building diffusers models on torch's meta device (sizes and geometry without weights) without leaving meta tensors
behind in diffusers' modules.

Why: inside `with torch.device("meta")` every tensor created is a meta tensor, the module-level constants of a module
first imported there included. diffusers makes some when imported (MagCache's `FLUX_MAG_RATIOS`, the fp4 table of its
BFL quantizer), so a skeleton built before anything else in a process left them on meta for the rest of it, and a
later real run failed on them ("Tensor.item() cannot be called on meta tensors"). `meta_device()` imports those
packages first.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator

import torch

from hookkit.core.quiet import quiet_imports

#: diffusers' packages whose modules create tensors when imported (all of their submodules load with them)
TENSORS_AT_IMPORT = ("diffusers.hooks", "diffusers.quantizers")


@contextlib.contextmanager
def meta_device() -> Iterator[None]:
    """torch's default device set to meta inside the block, after `TENSORS_AT_IMPORT` are imported."""
    with quiet_imports():
        for name in TENSORS_AT_IMPORT:
            importlib.import_module(name)
    with torch.device("meta"):
        yield
