"""Adapters: declarative per-model descriptions of a diffusion transformer.

An adapter says which transformer class it is for (exact class name, never a prefix), which block lists
run in which order, what each block class takes and returns, which classes are repeated (for regional
compilation), which Linear layers must never be quantized, how CFG is run, and where per-step index
tensors are built. Adapters are data: one TOML file per model family in `adapters/`, loaded and
validated into frozen attrs classes. `register_adapter()` adds one at run time.

A transformer with no adapter gets one derived from diffusers' own metadata (`_repeated_blocks` and the
block registry in `diffusers.hooks._helpers`) when that is possible.
"""

from __future__ import annotations

import inspect
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

import attrs
import torch
from loguru import logger

from hookkit.errors import AdapterError

STREAMS = ("hidden_states", "encoder_hidden_states")
CFG_STYLES = ("batched", "separate")
MEMO_SCOPES = ("none", "prologue")


def _fail(where: str, field: str, value: Any, expected: str, fix: str = "") -> AdapterError:
    msg = f"adapter {where}: field {field!r} expected {expected}, got {value!r}."
    if fix:
        msg += f" {fix}"
    return AdapterError(msg)


def _tuple(value: Any) -> Any:
    if isinstance(value, str):
        return (value,)
    return tuple(value) if isinstance(value, list) else value


def _strings(where: str, field: str, value: Any, allow_empty: bool = True) -> None:
    if not isinstance(value, tuple) or not all(isinstance(v, str) and v for v in value) or (not allow_empty and not value):
        raise _fail(where, field, value, "a list of non-empty strings" + ("" if allow_empty else " (at least one)"))


@attrs.frozen(kw_only=True)
class BlockListSpec:
    """One `nn.ModuleList` of blocks on the transformer, in execution order among the others.

    `returns` names, per return position, which stream the block returns there: Flux and Qwen-Image
    blocks return `("encoder_hidden_states", "hidden_states")`, Wan blocks `("hidden_states",)`.
    `encoder_arg` is the argument that carries the encoder (text) stream; leave it out (None) for blocks
    that take none.
    """

    attr: str
    classes: tuple[str, ...] = attrs.field(converter=_tuple)
    hidden_arg: str = "hidden_states"
    encoder_arg: str | None = None
    returns: tuple[str, ...] = attrs.field(default=("hidden_states",), converter=_tuple)

    def validate(self, where: str) -> None:
        if not isinstance(self.attr, str) or not self.attr.isidentifier():
            raise _fail(where, "blocks.attr", self.attr, "the name of an nn.ModuleList attribute of the transformer")
        _strings(where, f"blocks[{self.attr}].classes", self.classes, allow_empty=False)
        if not isinstance(self.hidden_arg, str) or not self.hidden_arg:
            raise _fail(where, f"blocks[{self.attr}].hidden_arg", self.hidden_arg, "an argument name")
        if self.encoder_arg is not None and (not isinstance(self.encoder_arg, str) or not self.encoder_arg):
            raise _fail(where, f"blocks[{self.attr}].encoder_arg", self.encoder_arg, "an argument name or absent")
        _strings(where, f"blocks[{self.attr}].returns", self.returns, allow_empty=False)
        bad = [r for r in self.returns if r not in STREAMS]
        if bad or "hidden_states" not in self.returns or len(set(self.returns)) != len(self.returns):
            raise _fail(
                where, f"blocks[{self.attr}].returns", list(self.returns),
                f"each of {STREAMS} at most once, 'hidden_states' included, in return order",
            )
        if "encoder_hidden_states" in self.returns and self.encoder_arg is None:
            raise _fail(where, f"blocks[{self.attr}].encoder_arg", None, "an argument name, since the block returns the encoder stream")

    @property
    def hidden_index(self) -> int:
        return self.returns.index("hidden_states")

    @property
    def encoder_index(self) -> int | None:
        return self.returns.index("encoder_hidden_states") if "encoder_hidden_states" in self.returns else None


@attrs.frozen(kw_only=True)
class AdapterSpec:
    """What hookkit needs to know about one transformer family. Build it in Python or load it from TOML."""

    name: str
    transformer: tuple[str, ...] = attrs.field(converter=_tuple)
    blocks: tuple[BlockListSpec, ...] = attrs.field(converter=_tuple)
    repeated_blocks: tuple[str, ...] = attrs.field(default=(), converter=_tuple)
    quant_exclude: tuple[str, ...] = attrs.field(default=(), converter=_tuple)
    cfg: str = "batched"
    memo_scope: str = "none"
    pipelines: tuple[str, ...] = attrs.field(default=(), converter=_tuple)
    source: str = "python"

    def __attrs_post_init__(self) -> None:
        where = f"{self.name!r} ({self.source})"
        if not isinstance(self.name, str) or not self.name:
            raise _fail(repr(self.name), "name", self.name, "a non-empty string")
        _strings(where, "transformer", self.transformer, allow_empty=False)
        if not isinstance(self.blocks, tuple) or not self.blocks or not all(isinstance(b, BlockListSpec) for b in self.blocks):
            raise _fail(where, "blocks", self.blocks, "at least one [[blocks]] table (BlockListSpec)")
        for block in self.blocks:
            block.validate(where)
        attrs_seen = [b.attr for b in self.blocks]
        if len(set(attrs_seen)) != len(attrs_seen):
            raise _fail(where, "blocks", attrs_seen, "each block list attribute once")
        _strings(where, "repeated_blocks", self.repeated_blocks)
        _strings(where, "quant_exclude", self.quant_exclude)
        _strings(where, "pipelines", self.pipelines)
        if self.cfg not in CFG_STYLES:
            raise _fail(where, "cfg", self.cfg, f"one of {CFG_STYLES} (one batched call per step, or one call per CFG branch)")
        if self.memo_scope not in MEMO_SCOPES:
            raise _fail(where, "memo_scope", self.memo_scope, f"one of {MEMO_SCOPES}")

    # -- matching -------------------------------------------------------------------------------------
    def matches(self, transformer: torch.nn.Module) -> bool:
        """Exact class match: `type(transformer).__name__` (or its dotted path) is listed. No prefixes."""
        cls = type(transformer)
        return cls.__name__ in self.transformer or f"{cls.__module__}.{cls.__qualname__}" in self.transformer

    def block_lists(self, transformer: torch.nn.Module) -> list[tuple[BlockListSpec, torch.nn.ModuleList]]:
        """The transformer's block lists in execution order, each with its spec (after `check`)."""
        return [(b, getattr(transformer, b.attr)) for b in self.blocks]

    def check(self, transformer: torch.nn.Module) -> None:
        """Raise `AdapterError` unless this adapter describes `transformer` exactly."""
        cls_name = type(transformer).__name__
        where = f"{self.name!r} ({self.source})"
        if not self.matches(transformer):
            raise _fail(where, "transformer", list(self.transformer), f"to list the class {cls_name!r} of the model it is used on",
                        "Use the adapter written for this class, or add the class name to `transformer`.")
        for block in self.blocks:
            modules = getattr(transformer, block.attr, None)
            if not isinstance(modules, torch.nn.ModuleList):
                raise _fail(where, "blocks.attr", block.attr, f"an nn.ModuleList attribute of {cls_name}",
                            f"{cls_name} has {type(modules).__name__ if modules is not None else 'no such attribute'}.")
            for i, module in enumerate(modules):
                if type(module).__name__ not in block.classes:
                    raise _fail(where, f"blocks[{block.attr}].classes", list(block.classes),
                                f"to list the class of {block.attr}.{i}", f"It is {type(module).__name__!r}.")
            for module_cls in {type(m) for m in modules}:
                params = inspect.signature(module_cls.forward).parameters
                for field, arg in (("hidden_arg", block.hidden_arg), ("encoder_arg", block.encoder_arg)):
                    if arg is not None and arg not in params:
                        raise _fail(where, f"blocks[{block.attr}].{field}", arg,
                                    f"an argument of {module_cls.__name__}.forward ({list(params)[1:]})")
        present = {type(m).__name__ for m in transformer.modules()}
        missing = [c for c in self.repeated_blocks if c not in present]
        if missing:
            raise _fail(where, "repeated_blocks", missing, f"classes that occur inside {cls_name}")

    # -- data -----------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "dict") -> "AdapterSpec":
        if not isinstance(data, dict):
            raise _fail(source, "<root>", data, "a table")
        known = {f.name for f in attrs.fields(cls)} - {"source"}
        unknown = sorted(set(data) - known)
        where = f"{data.get('name', '?')!r} ({source})"
        if unknown:
            raise _fail(where, unknown[0], data[unknown[0]], f"one of the known keys {sorted(known)}", "Remove or rename it.")
        for key in ("name", "transformer", "blocks"):
            if key not in data:
                raise _fail(where, key, None, "to be present")
        block_known = {f.name for f in attrs.fields(BlockListSpec)} | {"class"}
        blocks = []
        raw_blocks = data["blocks"]
        if not isinstance(raw_blocks, list):
            raise _fail(where, "blocks", raw_blocks, "a list of [[blocks]] tables")
        for raw in raw_blocks:
            if not isinstance(raw, dict):
                raise _fail(where, "blocks", raw, "a [[blocks]] table")
            bad = sorted(set(raw) - block_known)
            if bad:
                raise _fail(where, f"blocks.{bad[0]}", raw[bad[0]], f"one of {sorted(block_known)}")
            raw = dict(raw)
            if "class" in raw:
                raw["classes"] = raw.pop("class")
            if "attr" not in raw or "classes" not in raw:
                raise _fail(where, "blocks", raw, "'attr' and 'class' in every [[blocks]] table")
            blocks.append(BlockListSpec(**raw))
        return cls(**{**data, "blocks": blocks, "source": source})

    @classmethod
    def from_toml(cls, path: str | Path) -> "AdapterSpec":
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise AdapterError(f"adapter file {str(path)!r} does not exist.") from None
        except tomllib.TOMLDecodeError as exc:
            raise AdapterError(f"adapter file {str(path)!r} is not valid TOML: {exc}.") from None
        return cls.from_dict(data, source=str(path))


# --- the registry ----------------------------------------------------------------------------------------

CUSTOM_ADAPTER_HELP = (
    "Write an adapter: a TOML file with `name`, `transformer = [\"<ExactClassName>\"]` and one [[blocks]] table "
    "per nn.ModuleList of blocks in execution order (attr, class, hidden_arg, encoder_arg, returns), then call "
    "hookkit.register_adapter(path). See examples/custom_adapter.py and the files in adapters/."
)


def adapters_dir() -> Path:
    """Where the shipped adapter files are: inside the installed package, or `adapters/` of a checkout."""
    packaged = Path(str(resources.files("hookkit"))) / "_adapters"
    if packaged.is_dir():
        return packaged
    checkout = Path(__file__).resolve().parent.parent / "adapters"
    if checkout.is_dir():
        return checkout
    raise AdapterError(f"no shipped adapters found (looked in {packaged} and {checkout}); reinstall hookkit.")


class _Registry:
    def __init__(self) -> None:
        self._adapters: dict[str, AdapterSpec] = {}
        self._loaded = False

    def _load_shipped(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        for path in sorted(adapters_dir().glob("*.toml")):
            self._add(AdapterSpec.from_toml(path), replace=False)

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
    """The adapter for `transformer`'s exact class; derived from diffusers metadata if none is registered."""
    for adapter in _REGISTRY.all().values():
        if adapter.matches(transformer):
            adapter.check(transformer)
            return adapter
    derived = derive_adapter(transformer)
    derived.check(transformer)
    logger.info("derived adapter for {} from diffusers metadata", type(transformer).__name__)
    return derived


def derive_adapter(transformer: torch.nn.Module) -> AdapterSpec:
    """Build an adapter from `_repeated_blocks` and diffusers' `TransformerBlockRegistry`, or raise."""
    cls_name = type(transformer).__name__
    repeated = tuple(getattr(transformer, "_repeated_blocks", ()) or ())
    try:
        from diffusers.hooks._helpers import TransformerBlockRegistry
    except ImportError:  # pragma: no cover - diffusers always has it at >= 0.35
        TransformerBlockRegistry = None  # type: ignore[assignment]
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
        meta = None
        if TransformerBlockRegistry is not None:
            try:
                meta = TransformerBlockRegistry.get(block_cls)
            except ValueError:
                meta = None
        if meta is None:
            continue
        returns = ["", ""]
        returns[meta.return_hidden_states_index] = "hidden_states"
        if meta.return_encoder_hidden_states_index is not None:
            returns[meta.return_encoder_hidden_states_index] = "encoder_hidden_states"
        params = inspect.signature(block_cls.forward).parameters
        encoder_arg = meta.encoder_hidden_states_argument_name if meta.encoder_hidden_states_argument_name in params else None
        blocks.append(BlockListSpec(
            attr=attr, classes=(block_cls.__name__,), hidden_arg=meta.hidden_states_argument_name,
            encoder_arg=encoder_arg, returns=tuple(r for r in returns if r),
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
