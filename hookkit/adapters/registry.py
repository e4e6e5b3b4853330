"""The adapter registry: shipped TOML files, run-time registrations, lookup by exact class."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import torch
from loguru import logger

from hookkit.adapters.derive import CUSTOM_ADAPTER_HELP, derive_adapter
from hookkit.adapters.spec import AdapterSpec
from hookkit.errors import AdapterError

def adapters_dir() -> Path:
    """Where the shipped adapter files are: inside the installed package, or `adapters/` of a checkout."""
    packaged = Path(str(resources.files("hookkit"))) / "_adapters"
    if packaged.is_dir():
        return packaged
    checkout = Path(__file__).resolve().parents[2] / "adapters"
    if checkout.is_dir():
        return checkout
    raise AdapterError(f"no shipped adapters found (looked in {packaged} and {checkout}); reinstall hookkit.")


class _Registry:
    def __init__(self) -> None:
        self._adapters: dict[str, AdapterSpec] = {}
        self._loaded = False

    def _load_shipped(self) -> None:
        # Marked loaded only once every file loaded: a broken file raises on every call, never leaving a
        # registry that silently lacks the adapters after it.
        if self._loaded:
            return
        for path in sorted(adapters_dir().glob("*.toml")):
            adapter = AdapterSpec.from_toml(path)
            if adapter.name not in self._adapters:  # a retry after an error keeps what loaded before it
                self._add(adapter, replace=False)
        self._loaded = True

    def _add(self, adapter: AdapterSpec, replace: bool) -> None:
        for other in self._adapters.values():
            if other.name == adapter.name:
                continue
            clash = set(other.transformer) & set(adapter.transformer)
            if clash:
                raise AdapterError(
                    f"adapter {adapter.name!r} ({adapter.source}) claims {sorted(clash)}, already claimed by adapter "
                    f"{other.name!r} ({other.source}). Give it another `transformer` list or remove {other.name!r} first."
                )
        if adapter.name in self._adapters and not replace:
            raise AdapterError(
                f"an adapter named {adapter.name!r} is already registered ({self._adapters[adapter.name].source}); "
                "pass replace=True to register_adapter to override it."
            )
        self._adapters[adapter.name] = adapter

    def register(self, adapter: AdapterSpec, replace: bool) -> AdapterSpec:
        self._load_shipped()
        self._add(adapter, replace)
        logger.info("registered adapter {} for {}", adapter.name, list(adapter.transformer))
        return adapter

    def unregister(self, name: str) -> None:
        self._load_shipped()
        if name not in self._adapters:
            raise AdapterError(f"no adapter named {name!r}; registered: {sorted(self._adapters)}.")
        del self._adapters[name]

    def all(self) -> dict[str, AdapterSpec]:
        self._load_shipped()
        return dict(self._adapters)


_REGISTRY = _Registry()


def register_adapter(path_or_spec: str | Path | AdapterSpec, *, replace: bool = False) -> AdapterSpec:
    """Register an adapter (a TOML path or an `AdapterSpec`) for a transformer family at run time."""
    if isinstance(path_or_spec, AdapterSpec):
        adapter = path_or_spec
    elif isinstance(path_or_spec, (str, Path)):
        adapter = AdapterSpec.from_toml(path_or_spec)
    else:
        raise AdapterError(f"register_adapter: expected a path to a .toml file or a hookkit.AdapterSpec, got {path_or_spec!r}.")
    return _REGISTRY.register(adapter, replace)


def unregister_adapter(name: str) -> None:
    """Remove a registered adapter by name (shipped ones too, until the process ends)."""
    _REGISTRY.unregister(name)


def list_adapters() -> dict[str, AdapterSpec]:
    """All registered adapters by name, the shipped ones included."""
    return _REGISTRY.all()


def get_adapter(name: str) -> AdapterSpec:
    adapters = _REGISTRY.all()
    if name not in adapters:
        raise AdapterError(f"no adapter named {name!r}; shipped and registered: {sorted(adapters)}.")
    return adapters[name]


def resolve_adapter(transformer: torch.nn.Module) -> AdapterSpec:
    """The adapter for `transformer`'s exact class; derived from diffusers metadata if none is registered.

    An adapter naming the class by dotted path beats one naming it by bare name (a same-named class of
    another module is another model); two at the same level are ambiguous and raise rather than pick one.
    """
    levels = {name: adapter.match_level(transformer) for name, adapter in _REGISTRY.all().items()}
    best = max(levels.values(), default=0)
    if best:
        names = sorted(name for name, level in levels.items() if level == best)
        if len(names) > 1:
            raise AdapterError(
                f"adapters {names} all claim {type(transformer).__module__}.{type(transformer).__qualname__}; "
                f"expected exactly one. Unregister all but one (hookkit.unregister_adapter(name))."
            )
        adapter = get_adapter(names[0])
        adapter.check(transformer)
        return adapter
    derived = derive_adapter(transformer)
    derived.check(transformer)
    logger.info("derived adapter for {} from its code", type(transformer).__name__)
    return derived
