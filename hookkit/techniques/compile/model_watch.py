"""What a whole-transformer CUDA graph captured besides its inputs (`ModelWatch`), read again before every replay:
tensors, the module tree, inner hooks, LoRA state, attention processors and backends. On a change the graphs are
captured anew."""

from __future__ import annotations

import itertools
import operator
import sys
from typing import Any

import torch

from hookkit.core.registry import HookRegistry


class ModelWatch:
    """What a whole-transformer graph captured besides its inputs, read again before every replay.

    A CUDA graph replays the kernels it recorded on the memory addresses it recorded; nothing of the model's
    Python state runs. So a replay is stale when, since capture, any of these changed (all watched, for the
    transformer and every submodule):

    - a parameter or buffer: which tensor object it is, the address (`data_ptr`) and in-place version counter
      (`_version`: `copy_`, `load_state_dict`, `fuse_lora` write in place) of its storage, or of each inner
      tensor of a wrapper subclass (torchao's quantized weights). A dtype or device change (`.to()`, `param.data
      = ...`, an offload hook) always puts the data in new storage, so it shows as a new address (with unified
      virtual addressing no host and device allocation share one); dtype and device are named in the report;
    - the module tree: which child modules each module has (PEFT's LoRA layers replace Linears), `training`;
    - hooks that run inside the graph: torch forward (pre) hooks and an instance `forward` of every submodule,
      hookkit's own hook chain of every module, and torch's global module hooks (hooks and `forward` of the
      transformer itself run outside the graph and are not watched);
    - PEFT LoRA state of every LoRA layer: `scaling` (`set_adapters(..., weights)`), the active adapters,
      `disable_adapters`, merged adapters;
    - attention: which processor object each module holds as `processor` (`set_attn_processor`; a plain attribute,
      not a submodule), the backend each processor dispatches to (`set_attention_backend` sets its
      `_attention_backend`), and diffusers' process-wide active backend, which processors without one of their own
      run (`attention_backend(...)`); read from `sys.modules`, never imported.

    `check()` compares a few flat lists, each built by one C-level `map` over the lists `arm()` collected (its
    cost per call is measured by `benchmarks/watch_overhead.py`, numbers in BENCHMARKS.md); only when they
    differ is the slow per-module comparison run, to say which module changed and what.
    """

    def __init__(self) -> None:
        self._module: torch.nn.Module | None = None
        self._paths: tuple[str, ...] = ()
        self._dicts: list[dict[str, Any]] = []
        self._tensor_dicts: list[dict[str, Any]] = []
        self._child_dicts: list[dict[str, Any]] = []
        self._tensor_full: list[dict[str, Any]] = []
        self._child_full: list[dict[str, Any]] = []
        self._hook_dicts: list[dict[int, Any]] = []
        self._tensors: list[torch.Tensor] = []
        self._lora: list[dict[str, Any]] = []
        self._registries: list[HookRegistry] = []
        self._attention: list[dict[str, Any]] = []
        self._state: tuple[Any, ...] | None = None
        self._detail: list[tuple[Any, ...]] = []

    def arm(self, module: torch.nn.Module) -> None:
        """Record the current state of `module` (right before a capture)."""
        with torch._C.DisableTorchFunction():
            self._arm(module)

    def _arm(self, module: torch.nn.Module) -> None:
        named = list(module.named_modules(remove_duplicate=False))
        self._module = module
        self._paths = tuple(path or "<transformer>" for path, _ in named)
        self._dicts = [m.__dict__ for _, m in named]
        self._tensor_dicts = [d[k] for d in self._dicts for k in ("_parameters", "_buffers")]
        self._child_dicts = [d["_modules"] for d in self._dicts]
        # identities are read from the dicts that had entries; one that gains its first entry changes a length
        self._tensor_full = [d for d in self._tensor_dicts if d]
        self._child_full = [d for d in self._child_dicts if d]
        # the transformer's own hooks and forward run outside the graph (they wrap hookkit's chain)
        self._hook_dicts = [d[k] for d in self._dicts[1:] for k in ("_forward_hooks", "_forward_pre_hooks")]
        self._tensors = [inner for d in self._tensor_dicts for t in d.values() if t is not None for inner in _storages(t)]
        self._lora = [d for d in self._dicts if isinstance(d.get("scaling"), dict)]
        self._registries = [r for d in self._dicts if (r := d.get("_hookkit_registry")) is not None]
        self._attention = [d for d in self._dicts if "processor" in d or "processor" in d["_modules"]]
        self._state = self._read()
        self._detail = [self._module_state(i) for i in range(len(self._dicts))]

    def check(self, module: torch.nn.Module) -> str | None:
        """None while nothing watched changed since `arm`; else what changed (and the watch must be re-armed)."""
        if self._state is None or module is not self._module:
            return "first call" if self._state is None else "another module"
        # its thousands of metadata reads (addresses, versions) bypass torch-function handling: under an active mode
        # (memo's, around the whole call) each read would be dispatched through it (several ms per call: BENCHMARKS.md)
        with torch._C.DisableTorchFunction():
            if self._read() == self._state:
                return None
            return self._describe()

    def _read(self) -> tuple[Any, ...]:
        g = torch.nn.modules.module
        tensors = self._tensors
        return (
            tuple(g._global_forward_hooks), tuple(g._global_forward_pre_hooks),
            list(map(len, self._tensor_dicts)), list(map(id, itertools.chain.from_iterable(map(dict.values, self._tensor_full)))),
            list(map(torch.Tensor.data_ptr, tensors)), list(map(_VERSION, tensors)),
            list(map(len, self._child_dicts)), list(map(id, itertools.chain.from_iterable(map(dict.values, self._child_full)))),
            list(map(_TRAINING, self._dicts)), list(map(id, map(dict.get, self._dicts, itertools.repeat("forward")))),
            list(itertools.chain.from_iterable(self._hook_dicts)),
            [(id(r._chain), id(r._inner)) for r in self._registries],
            [(tuple(d["scaling"].items()), _adapters(d.get("_active_adapter")), d.get("_disable_adapters"),
              tuple(d.get("merged_adapters", ()))) for d in self._lora],
            list(map(_processor_state, self._attention)), _active_attention_backend(),
        )

    def _module_state(self, index: int) -> tuple[Any, ...]:
        """One module's watched state, by kind (the slow path that names what changed)."""
        d = self._dicts[index]
        tensors = {f"{kind} {name}": None if t is None else (id(t), t.dtype, t.device, *(
                       (inner.data_ptr(), inner._version) for inner in _storages(t)))
                   for kind in ("_parameters", "_buffers") for name, t in d[kind].items()}
        registry = d.get("_hookkit_registry")
        hooks = (tuple(d["_forward_hooks"]), tuple(d["_forward_pre_hooks"]), id(d.get("forward"))) if index else ()
        scaling = d.get("scaling")
        lora = ((tuple(scaling.items()), _adapters(d.get("_active_adapter")), d.get("_disable_adapters"),
                 tuple(d.get("merged_adapters", ()))) if isinstance(scaling, dict) else None)
        return (("parameters and buffers", tensors), ("submodules", tuple(map(id, d["_modules"].values()))),
                ("training mode", d["training"]), ("forward hooks", hooks),
                ("hookkit hooks", (id(registry._chain), id(registry._inner)) if registry is not None else None),
                ("LoRA scales or active adapters", lora),
                ("attention processor", id(_processor(d))),
                ("attention backend", getattr(_processor(d), "_attention_backend", None)))

    def _describe(self) -> str:
        for index, before in enumerate(self._detail):
            now = self._module_state(index)
            for (kind, old), (_, new) in zip(before, now):
                if old != new:
                    return f"{self._paths[index]}: {kind} changed since capture"
        if self._state is not None and self._state[-1] != _active_attention_backend():
            return "diffusers' active attention backend changed since capture"
        return "torch's global module hooks changed since capture"


_VERSION = operator.attrgetter("_version")


def _storages(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding `tensor`'s data: itself, or the inner tensors of a wrapper subclass (torchao's
    quantized weights have no storage of their own: their `data_ptr()` raises)."""
    if type(tensor) in (torch.nn.Parameter, torch.Tensor) or not hasattr(tensor, "__tensor_flatten__"):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    return [inner for name in names for inner in _storages(getattr(tensor, name))]


_TRAINING = operator.itemgetter("training")


def _processor(module_dict: dict[str, Any]) -> Any:
    """The attention processor of a module (by its `__dict__`): a plain attribute, or a submodule for processors
    that are modules (IP-Adapter's); None for a module without one."""
    processor = module_dict.get("processor")
    return processor if processor is not None else module_dict["_modules"].get("processor")


def _processor_state(module_dict: dict[str, Any]) -> tuple[int, Any]:
    processor = _processor(module_dict)
    return id(processor), getattr(processor, "_attention_backend", None)


def _active_attention_backend() -> Any:
    """diffusers' process-wide attention backend (what a processor without its own runs); None before diffusers'
    attention dispatch is imported (then no model of it was built, so nothing captured can depend on it)."""
    dispatch = sys.modules.get("diffusers.models.attention_dispatch")
    registry = getattr(dispatch, "_AttentionBackendRegistry", None)
    return getattr(registry, "_active_backend", None)


def _adapters(active: Any) -> Any:
    return tuple(active) if isinstance(active, list) else active
