"""Memoized index tensors: build small host-data tensors once, not at every denoising step.

Why: some transformers build index tensors from Python lists in their prologue at every call (Qwen-Image's
`modulate_index = torch.tensor([...], device=...)`). On a CUDA device each is a pageable host-to-device
copy: the CPU waits until the GPU has drained its queue. The values depend only on the call's shapes.

How: `MemoMode`, a `TorchFunctionMode`, answers `torch.tensor`/`torch.as_tensor` calls whose data are plain
Python (keyed by value, scalar types and float bits, dtype, device and call site) from a `MemoTable`, in the scope
the adapter names (`memo_scope = "prologue"`: from the transformer's entry to its first block), so blocks
run with no mode on the stack. Factories that launch a kernel (`arange`, `zeros`) are left alone.

Contract: a memoized tensor goes back to the call site that built it (code, instruction, n-th call in this
prologue run), never to another call, even for equal values; an in-place change or `requires_grad_()` is
detected (version counter) and the entry rebuilt. Entries are built outside inference
mode and never evicted while the handle lives (a captured CUDA graph reads their memory at every replay);
past `MAX_ENTRIES` values, new ones are built normally. With `Compile(regional=False)` the prologue itself is
compiled and memo attaches nothing (`hookkit.core.compat`).

    memo = apply_memo(pipe.transformer)     # standalone; or hookkit.enable(pipe, hookkit.Spec(memo=True))
    pipe(...); print(memo.table.stats()); memo.remove()
"""

from __future__ import annotations

import array
import struct
import sys
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

import attrs
import torch
from loguru import logger
from torch.overrides import TorchFunctionMode

from hookkit.core import compat
from hookkit.core.feature import AttachContext, BaseFeature
from hookkit.core.modes import ModeScope
from hookkit.core.plan import Attachment, PlanContext, add_hook, flat_blocks, module_at
from hookkit.core.registry import Args, Kwargs, ModelHook
from hookkit.core.removal import Removable
from hookkit.core.summary import FeatureSummary, table
from hookkit.errors import AdapterError, HookError

if TYPE_CHECKING:
    from hookkit.adapters import AdapterSpec

NAME = "memo"
PROLOGUE_HOOK = "hookkit.memo.prologue"
FIRST_BLOCK_HOOK = "hookkit.memo.first_block"
#: distinct (value, dtype, device) entries kept per table; later new values are built and not stored
MAX_ENTRIES = 1024
#: the factories memoized: both copy host data to the device
FACTORIES: frozenset[Callable[..., Any]] = frozenset({torch.tensor, torch.as_tensor})

__all__ = ["FEATURE", "MemoHandle", "MemoMode", "MemoTable", "apply_memo", "freeze"]


# --- keys ------------------------------------------------------------------------------------------------------

_INT, _FLOAT, _BOOL, _INTS, _FLOATS, _BOOLS, _SEQ = range(7)


def freeze(data: Any) -> Hashable | None:
    """A hashable key that is equal for two values iff `torch.tensor` builds the same tensor from them.

    Plain Python only: int, float, bool and lists/tuples of them, nested. Types are part of the key (1, 1.0
    and True differ in dtype) and floats are keyed by their bits (0.0 and -0.0 differ). None otherwise.
    """
    kind = type(data)
    if kind is int:
        return (_INT, data)
    if kind is float:
        return (_FLOAT, struct.pack("<d", data))
    if kind is bool:
        return (_BOOL, data)
    if kind is list or kind is tuple:
        kinds = set(map(type, data))
        if len(kinds) == 1:  # fast paths for flat, homogeneous lists (the usual index list)
            only = kinds.pop()
            if only is int:
                return (_INTS, tuple(data))
            if only is float:
                return (_FLOATS, array.array("d", data).tobytes())
            if only is bool:
                return (_BOOLS, tuple(data))
        items = tuple(map(freeze, data))
        if any(item is None for item in items):
            return None
        return (_SEQ, items)
    return None


def _device_key(device: Any) -> torch.device:
    """The device a factory call with `device=device` builds on (None: the default device)."""
    resolved = torch.get_default_device() if device is None else torch.device(device)
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def _unchanged(tensor: torch.Tensor, version: int) -> bool:
    """False once a caller modified the shared tensor: in place (its version counter moved) or `requires_grad_()`."""
    return tensor._version == version and not tensor.requires_grad


# --- the table and the mode --------------------------------------------------------------------------------


@attrs.define
class MemoStats:
    """Counts since the table was made (all calls)."""

    #: calls answered from the table
    hits: int = 0
    #: calls that built a tensor and stored it
    misses: int = 0
    #: entries rebuilt because their tensor had been modified in place (or made to require grad)
    rebuilt: int = 0
    #: factory calls seen but not memoizable (non-plain data, other arguments)
    passed: int = 0
    #: memoizable calls built and not stored because the table was full
    overflow: int = 0


class MemoTable:
    """Memoized factory results, keyed by (factory, value, dtype, device). Never evicts (see the module doc)."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._entries: dict[Hashable, tuple[torch.Tensor, int]] = {}
        self.counts = MemoStats()
        #: calls per call site in the current pass: the n-th call of a site is its own entry
        self._site_calls: dict[tuple[Any, int], int] = {}

    def begin_pass(self) -> None:
        """A new pass (a prologue run): every call site counts its calls from 0 again."""
        self._site_calls.clear()

    def _site(self, caller: Any) -> tuple[Any, int, int]:
        """(code, instruction, n): the n-th call, in this pass, from `caller`'s current instruction."""
        site = (caller.f_code, caller.f_lasti) if caller is not None else (None, -1)
        n = self._site_calls.get(site, 0)
        self._site_calls[site] = n + 1
        return (*site, n)

    def __len__(self) -> int:
        return len(self._entries)

    def key(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
            caller: Any = None) -> Hashable | None:
        """The key of a factory call from frame `caller`, or None when it must not be memoized."""
        if len(args) != 1:  # both take the data only positionally
            return None
        dtype, device = kwargs.get("dtype"), kwargs.get("device")
        if any(k not in ("dtype", "device") and v is not False and v is not None for k, v in kwargs.items()):
            return None  # requires_grad=True, pin_memory=True, out=...: build normally
        if dtype is not None and not isinstance(dtype, torch.dtype):
            return None
        data = freeze(args[0])
        if data is None:
            return None
        dtype_key = dtype if dtype is not None else ("default", torch.get_default_dtype())
        return (func, data, dtype_key, _device_key(device), self._site(caller))

    def call(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], caller: Any = None) -> Any:
        """`func(*args, **kwargs)` called from frame `caller`, answered from the table when the call is memoizable."""
        key = self.key(func, args, kwargs, caller)
        if key is None:
            self.counts.passed += 1
            return func(*args, **kwargs)
        found = self._entries.get(key)
        if found is not None:
            tensor, version = found
            if _unchanged(tensor, version):
                self.counts.hits += 1
                return tensor
            self.counts.rebuilt += 1
        elif len(self._entries) >= self.max_entries:
            self.counts.overflow += 1
            return func(*args, **kwargs)
        else:
            self.counts.misses += 1
        with torch.inference_mode(False):  # a normal tensor: it has a version counter, and autograd may use it later
            tensor = func(*args, **kwargs)
        self._entries[key] = (tensor, tensor._version)
        return tensor

    def clear(self) -> None:
        self._entries.clear()
        self._site_calls.clear()

    def stats(self) -> dict[str, int]:
        return {**attrs.asdict(self.counts), "entries": len(self._entries)}


class MemoMode(TorchFunctionMode):
    """Answers `torch.tensor` / `torch.as_tensor` calls from a `MemoTable`; passes everything else on."""

    def __init__(self, table: MemoTable) -> None:
        super().__init__()
        self.table = table

    def __enter__(self) -> MemoMode:
        self.table.begin_pass()  # entering the mode starts a pass (a prologue run)
        return super().__enter__()

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if func in FACTORIES:
            # the factory's caller: torch calls this method straight from the C factory
            return self.table.call(func, args, kwargs or {}, sys._getframe(1))
        return func(*args, **(kwargs or {}))


# --- hooks -------------------------------------------------------------------------------------------------


class MemoPrologueHook(ModelHook):
    """On the transformer: opens the scope at entry; closes it at exit (also on an exception) if still open."""

    replaces_forward = True

    def __init__(self, scope: ModeScope, first_block: torch.nn.Module) -> None:
        self.scope = scope
        self.first_block = first_block

    def new_forward(self, module: torch.nn.Module, call_next: Callable[..., Any], args: Args, kwargs: Kwargs) -> Any:
        # traced into a graph (constants are baked in), or the closing hook would be: stand aside
        if torch.compiler.is_compiling() or getattr(self.first_block, "_compiled_call_impl", None) is not None:
            return call_next(*args, **kwargs)
        opened = self.scope.open()
        try:
            return call_next(*args, **kwargs)
        finally:
            if opened:
                self.scope.close()

    def on_detach(self, module: torch.nn.Module) -> None:
        self.scope.close()


class MemoFirstBlockHook(ModelHook):
    """On the first block: closes the scope, so that no block runs under the mode."""

    def __init__(self, scope: ModeScope) -> None:
        self.scope = scope

    def pre_forward(self, module: torch.nn.Module, args: Args, kwargs: Kwargs) -> tuple[Args, Kwargs]:
        self.scope.close()
        return args, kwargs


# --- public API ----------------------------------------------------------------------------------------------


class MemoHandle:
    """What `apply_memo` returns: the table (`.table.stats()`) and `.remove()`."""

    def __init__(self, scope: ModeScope, removals: list[Removable]) -> None:
        self.scope = scope
        self.table = scope.mode.table
        self._removals = removals

    def remove(self) -> None:
        """Detach both hooks (the transformer is exactly as before) and drop the table."""
        self.scope.close()
        while self._removals:
            self._removals.pop().remove()
        self.table.clear()


def _first_block_path(adapter: AdapterSpec, transformer: torch.nn.Module) -> str:
    blocks = flat_blocks(adapter, transformer)
    if not blocks:
        raise AdapterError(f"adapter {adapter.name!r}.blocks: expected at least one block in "
                           f"{type(transformer).__name__}, got none (memo ends its scope at the first block). "
                           "Declare the transformer's block lists in the adapter's `blocks`, or leave memo off.")
    return blocks[0][0]


def apply_memo(transformer: torch.nn.Module, adapter: AdapterSpec | None = None,
               table: MemoTable | None = None) -> MemoHandle:
    """Memoize host-data index tensors in `transformer`'s prologue (entry to first block); no handle needed.

    The first block comes from the adapter (resolved from the transformer's class when not given).
    """
    from hookkit.adapters import resolve_adapter

    if not isinstance(transformer, torch.nn.Module):
        raise HookError(f"apply_memo.transformer: expected a torch.nn.Module, got {type(transformer).__name__}. "
                        "Pass the transformer itself (pipe.transformer).")
    adapter = adapter if adapter is not None else resolve_adapter(transformer)
    scope = ModeScope(MemoMode(table if table is not None else MemoTable()))
    path = _first_block_path(adapter, transformer)
    first_block = module_at(transformer, path)
    removals: list[Removable] = [add_hook(transformer, PROLOGUE_HOOK, MemoPrologueHook(scope, first_block))]
    try:
        removals.append(add_hook(first_block, FIRST_BLOCK_HOOK, MemoFirstBlockHook(scope), position=0))
    except BaseException:
        removals.pop().remove()
        raise
    return MemoHandle(scope, removals)


# --- feature ---------------------------------------------------------------------------------------------------


def _inactive_reason(spec: Spec, adapter: AdapterSpec) -> str | None:
    """Why memo attaches nothing for this spec and adapter, or None when it attaches."""
    if adapter.memo_scope == "none":
        return f"adapter {adapter.name!r} declares memo_scope='none' (no per-step host-data tensors known)"
    return compat.inactive_reason(NAME, spec, adapter)


class _MemoFeature(BaseFeature):
    """Plugs memoization into `hookkit.enable`: `Spec.memo`, scoped by the adapter's `memo_scope`."""

    name = NAME
    spec_class = bool

    def plan(self, ctx: PlanContext) -> list[Attachment]:
        if _inactive_reason(ctx.spec, ctx.adapter) is not None:
            return []  # the summary says why
        path = _first_block_path(ctx.adapter, ctx.transformer)
        return [Attachment(feature=NAME, target="", name=PROLOGUE_HOOK, params=(("first_block", path),)),
                Attachment(feature=NAME, target=path, name=FIRST_BLOCK_HOOK)]

    def attach(self, ctx: AttachContext, attachment: Attachment) -> Removable:
        scope: ModeScope | None = ctx.kept()
        if scope is None:
            scope = ctx.keep(ModeScope(MemoMode(MemoTable())))
            logger.info("memo: torch.tensor/as_tensor with plain Python data memoized in the {} prologue",
                        ctx.plan.transformer_class)
        if attachment.name == PROLOGUE_HOOK:
            first_block = module_at(ctx.transformer, attachment.param("first_block"))
            return add_hook(ctx.transformer, PROLOGUE_HOOK, MemoPrologueHook(scope, first_block))
        return add_hook(module_at(ctx.transformer, attachment.target), FIRST_BLOCK_HOOK, MemoFirstBlockHook(scope),
                        position=0)

    def summarize(self, ctx: AttachContext) -> FeatureSummary | None:
        scope: ModeScope | None = ctx.kept()
        if scope is None:
            reason = _inactive_reason(ctx.spec, ctx.adapter) or "nothing attached"
            data: dict[str, Any] = {"scope": ctx.adapter.memo_scope, "attached": False, "reason": reason}
            return FeatureSummary(name=NAME, data=data, text=f"{reason}: nothing attached")
        stats = scope.mode.table.stats()
        data = {"scope": ctx.adapter.memo_scope, "attached": True, **stats}
        text = table(["scope", "hits", "misses", "rebuilt", "not memoizable", "table full", "entries"],
                     [[data["scope"], stats["hits"], stats["misses"], stats["rebuilt"], stats["passed"], stats["overflow"],
                       stats["entries"]]])
        return FeatureSummary(name=NAME, data=data, text=text)


FEATURE = _MemoFeature()
