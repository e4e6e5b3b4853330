"""diffusers' own tiny transformer test configs (`tests/data/diffusers_transformers.json`), built from data.

`configs()` names every stored config; `build(name)` makes the model (seeded, eval mode) and `inputs(name)` a fresh
set of its dummy inputs (fresh every call: some models fill a state object they are given).
"""

from __future__ import annotations

import functools
import importlib
import json
from pathlib import Path
from typing import Any

import torch

DATA = Path(__file__).parent / "data" / "diffusers_transformers.json"


@functools.cache
def _data() -> dict[str, Any]:
    return json.loads(DATA.read_text())


def configs() -> list[str]:
    return sorted(_data()["configs"])


def entry(name: str) -> dict[str, Any]:
    return _data()["configs"][name]


def model_class(name: str) -> type[torch.nn.Module]:
    import diffusers

    return getattr(diffusers, entry(name)["class"])


def _decode(value: Any, gen: torch.Generator, init: dict[str, Any]) -> Any:
    if isinstance(value, list):
        return [_decode(v, gen, init) for v in value]
    if isinstance(value, dict):
        if "__tensor__" in value:
            t = value["__tensor__"]
            dtype = getattr(torch, t["dtype"])
            if "values" in t:
                return torch.tensor(t["values"], dtype=dtype).reshape(t["shape"])
            return torch.randn(t["shape"], generator=gen, dtype=torch.float32).to(dtype)
        if "__tuple__" in value:
            return tuple(_decode(v, gen, init) for v in value["__tuple__"])
        if "__items__" in value:
            return {_decode(k, gen, init): _decode(v, gen, init) for k, v in value["__items__"]}
        if "__object__" in value:
            module, _, cls = value["__object__"].rpartition(".")
            obj_cls = getattr(importlib.import_module(module), cls)
            return obj_cls(init["num_layers"])  # WanAnimate2KVCache(num_layers), the only one stored
        return {k: _decode(v, gen, init) for k, v in value.items()}
    return value


def init_dict(name: str) -> dict[str, Any]:
    return _decode(entry(name)["init"], torch.Generator().manual_seed(0), {})


def build(name: str, **overrides: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    model = model_class(name)(**{**init_dict(name), **overrides})
    return model.eval()


def inputs(name: str, seed: int = 0) -> dict[str, Any]:
    init = entry(name)["init"]
    return _decode(entry(name)["inputs"], torch.Generator().manual_seed(seed), init)


def torchvision_shim() -> Any:
    """What Cosmos's `transformer_cosmos.transforms` provides (it resizes its padding mask with torchvision, which the test
    environment lacks): the same nearest resize, for setting there when the module has no `transforms`."""
    import types

    def resize(mask: torch.Tensor, size: list[int], interpolation: Any = None) -> torch.Tensor:
        return torch.nn.functional.interpolate(mask, size=size, mode="nearest")

    return types.SimpleNamespace(functional=types.SimpleNamespace(resize=resize),
                                 InterpolationMode=types.SimpleNamespace(NEAREST="nearest"))

