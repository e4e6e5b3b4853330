"""Regenerate `diffusers_transformers.json` from diffusers' own transformer tests (a maintenance tool; no test runs it).

Usage (needs a checkout of diffusers' `tests/` folder, e.g. `git archive <commit> tests | tar x -C /tmp/dtests`):

    python tests/data/extract_diffusers_configs.py /tmp/dtests <commit> > tests/data/diffusers_transformers.json

For every `*TesterConfig` class of `tests/models/transformers/` it records the init dict (`get_init_dict()`) and the
dummy inputs (`get_dummy_inputs()`), one entry per distinct (model class, init dict). One entry was edited by hand
after extraction, marked `changed` with why (PRX: its test config has 302 M parameters). Tensors are stored as data:
integral values (ids, masks, timesteps) exactly, others by shape and dtype (regenerated from a seeded generator).
Test-only packages the test modules import (accelerate, peft, ...) are stubbed: only the dicts are read.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import inspect
import json
import os
import sys
from typing import Any
from unittest import mock

import torch

STUBBED = ("accelerate", "peft", "parameterized", "bitsandbytes", "gguf", "optimum", "auto_round", "modelopt")


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec: Any) -> Any:
        module = mock.MagicMock(name=spec.name)
        module.__path__, module.__spec__ = [], spec
        return module

    def exec_module(self, module: Any) -> None:
        pass


class _StubFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(name, _StubLoader(), is_package=True)
        return None


def encode(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu()
        entry: dict[str, Any] = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
        integral = not t.is_floating_point() or bool(torch.equal(t, t.round()))
        if integral and t.numel() <= 100_000:
            entry["values"] = t.tolist()
        return {"__tensor__": entry}
    if isinstance(value, (list, tuple)):
        return {"__tuple__": [encode(v) for v in value]} if isinstance(value, tuple) else [encode(v) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):  # OmniGen's input_image_sizes has int keys
            return {"__items__": [[encode(k), encode(v)] for k, v in value.items()]}
        return {k: encode(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    # a state object the model fills in (WanAnimate2's KV cache): its class, rebuilt fresh for every call
    return {"__object__": f"{type(value).__module__}.{type(value).__qualname__}"}


def main(tests_root: str, commit: str) -> None:
    sys.meta_path.append(_StubFinder())
    sys.path.insert(0, tests_root)
    folder = os.path.join(tests_root, "tests", "models", "transformers")
    entries: dict[str, Any] = {}
    seen: set[tuple[str, str]] = set()
    for filename in sorted(os.listdir(folder)):
        if not filename.startswith("test_") or not filename.endswith(".py"):
            continue
        module = importlib.import_module(f"tests.models.transformers.{filename[:-3]}")
        for name, obj in vars(module).items():
            if not inspect.isclass(obj) or obj.__module__ != module.__name__ or not name.endswith("TesterConfig"):
                continue
            config = obj.__new__(obj)
            try:
                model_class = config.model_class
                init, inputs = config.get_init_dict(), config.get_dummy_inputs()
            except Exception as exc:  # noqa: BLE001 - a config that needs a GPU or a download
                print(f"skipped {filename}:{name}: {exc}", file=sys.stderr)
                continue
            key = (model_class.__name__, json.dumps(encode(init), sort_keys=True))
            if key in seen:
                continue
            seen.add(key)
            entries[name.removesuffix("TesterConfig")] = {
                "class": model_class.__name__, "test": f"tests/models/transformers/{filename}:{name}",
                "init": encode(init), "inputs": encode(inputs),
            }
    json.dump({"origin": f"huggingface/diffusers@{commit} tests/models/transformers (run against diffusers 0.42.1)",
               "configs": entries}, sys.stdout, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
