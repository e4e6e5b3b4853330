"""Context parallelism through diffusers' own engine: `hookkit.Spec(parallel=hookkit.ContextParallel(ulysses=2))`.

On attach this calls `transformer.enable_parallelism(config=ContextParallelConfig(...), cp_plan=...)` (after
`set_attention_backend` when `attention_backend` is given); diffusers shards the sequence over a ("ring", "ulysses")
mesh by the class's `_cp_plan` or, for a class without one, the adapter's `[[cp_plan]]` (`resolve_cp_plan`; the
class is never changed). A pipeline the user parallelised with diffusers' API works as well, in either order.

Refused, with the fix: no plan at all, a head count the Ulysses degree does not divide, a backend without
context-parallel support (and ring with `native`, whose op returns no log-sum-exp), no process group or too few
ranks, a transformer already parallelised; at each call, checks around every split and gather refuse a sequence the
degree does not divide and a gathered length no split made (a plan whose dims do not match the model).

Removal restores every module's `forward`/`_diffusers_hook` entries, each attention processor's
`_parallel_config`/`_attention_backend`, diffusers' process-wide active backend and `transformer._parallel_config`;
the transformer then runs unsharded. The device mesh and its process groups stay alive (torch cannot destroy one
mesh's subgroups alone). Under torchrun, one process per GPU, same seed and inputs on every rank:

    torch.distributed.init_process_group("nccl"); torch.cuda.set_device(rank)
    handle = hookkit.enable(pipe, hookkit.Spec(parallel=hookkit.ContextParallel(ulysses=2)))
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch
from loguru import logger

from hookkit.core.feature import AttachContext, BaseFeature
from hookkit.core.parallel import context_parallel_config, parallel_info
from hookkit.core.plan import Attachment
from hookkit.core.removal import Removal
from hookkit.core.summary import FeatureSummary
from hookkit.errors import EnableError, SpecError, UnsupportedError
from hookkit.techniques.parallel.spec import ContextParallel

if TYPE_CHECKING:
    from hookkit.adapters import AdapterSpec
    from hookkit.core.plan import PlanContext

NAME = "parallel"
CONTEXT_HOOK = "hookkit.parallel.context"
#: names of hookkit's checks in diffusers' hook registries: on the transformer (outermost there: starts each forward's
#: ledger, checks its own split inputs), and per plan module id (two ids may name one module, as diffusers' names
#: are): split inputs (outermost), split outputs (innermost), gathered outputs (outermost)
CHECK_HOOK = "hookkit.parallel.check"
INPUT_CHECK_HOOK = "hookkit.parallel.check_input---{}"
OUTPUT_CHECK_HOOK = "hookkit.parallel.check_output---{}"
GATHER_CHECK_HOOK = "hookkit.parallel.check_gather---{}"
#: backends whose context-parallel forward op cannot return the log-sum-exp that ring attention merges with
#: (diffusers 0.42.1: `_native_attention_forward_op` raises for `return_lse=True`)
NO_LSE_BACKENDS = frozenset({"native"})
_MISSING = object()

__all__ = ["FEATURE"]


# --- attention processors ----------------------------------------------------------------------------------------


def _processors(transformer: torch.nn.Module) -> list[Any]:
    """The attention processors diffusers' `enable_parallelism` configures (one per attention module)."""
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention, MochiAttention

    out = []
    for module in transformer.modules():
        if isinstance(module, (Attention, MochiAttention, AttentionModuleMixin)):
            processor = getattr(module, "processor", None)
            if processor is not None:
                out.append(processor)
    return out


def current_backend(transformer: torch.nn.Module, requested: str | None = None) -> str:
    """The attention backend the processors will run (`requested` when given), as diffusers resolves it."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    if requested is not None:
        return requested.lower()
    for processor in _processors(transformer):
        if hasattr(processor, "_attention_backend"):
            backend = processor._attention_backend
            if backend is not None:
                return str(getattr(backend, "value", backend))
            break
    return str(_AttentionBackendRegistry.get_active_backend()[0].value)


def _check_backend(spec: ContextParallel, transformer: torch.nn.Module) -> str:
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    backend = current_backend(transformer, spec.attention_backend)
    known = {b.value for b in AttentionBackendName}
    if backend not in known:
        raise SpecError(f"ContextParallel.attention_backend: expected one of diffusers' backends {sorted(known)}, got "
                        f"{backend!r}. Pick one with context-parallel support, e.g. 'native' or '_native_cudnn'.")
    supported = sorted(_AttentionBackendRegistry._supports_context_parallel)
    if backend not in supported:
        raise UnsupportedError(f"ContextParallel.attention_backend: expected a backend with context-parallel support "
                               f"({supported}), got {backend!r}. Set attention_backend='native' (Ulysses) or "
                               "'_native_cudnn' (ring, CUDA).")
    if spec.ring > 1 and backend in NO_LSE_BACKENDS:
        raise UnsupportedError(f"ContextParallel.ring: ring attention merges partial results by their log-sum-exp, "
                               f"which the {backend!r} backend's op does not return (diffusers 0.42.1), got ring="
                               f"{spec.ring}. Set attention_backend='_native_cudnn' or 'flash' (CUDA), or use "
                               "ulysses instead of ring.")
    return backend


# --- the plan, and its per-call checks -------------------------------------------------------------------------------


def resolve_cp_plan(transformer: torch.nn.Module, adapter: AdapterSpec) -> tuple[dict[str, Any], str, str]:
    """The context-parallel plan `Spec.parallel` uses: (plan, origin "class" or "adapter", where it came from).

    diffusers' own `_cp_plan` of the class wins (it is kept with the model code and its tests), unless the adapter
    sets `cp_plan_override = true`; a class without one uses the adapter's `[[cp_plan]]`. Neither: refused.
    """
    cls = type(transformer).__name__
    own = getattr(transformer, "_cp_plan", None)
    theirs = adapter.diffusers_cp_plan()
    if theirs is not None and (own is None or adapter.cp_plan_override):
        return theirs, "adapter", f"adapter {adapter.name!r} ({adapter.source})"
    if own is not None:
        return dict(own), "class", f"diffusers ({cls}._cp_plan)"
    name = adapter.name
    raise UnsupportedError(
        f"Spec.parallel on {cls}: expected a context-parallel plan (diffusers' `_cp_plan` of the class: 0.42.1 has one "
        f"for Flux, Flux.2, Qwen-Image, Wan, LTX, LTX-2, ChronoEdit; or the adapter's [[cp_plan]]), got {cls} without "
        f"one and adapter {name!r} without [[cp_plan]]. Add [[cp_plan]] tables to an adapter for {cls} (see "
        "adapters/skyreelsv2.toml) and register it, or leave Spec.parallel unset for this model.")


class _Ledger:
    """The sequence lengths the plan split during one transformer forward (cleared when the next one starts): a
    gather must restore one of them, or the plan's dims do not match the model."""

    def __init__(self) -> None:
        self.sizes: list[int] = []


def _where(path: str, module: torch.nn.Module) -> str:
    return type(module).__name__ if path == "" else f"{path} ({type(module).__name__})"


def _check_split(where: str, value: Any, cpi: Any, degree: int, divisible: bool, ledger: _Ledger) -> None:
    if not isinstance(value, torch.Tensor):
        return
    if cpi.expected_dims is not None and value.dim() != cpi.expected_dims:
        return  # diffusers does not split it either
    size = value.shape[cpi.split_dim]
    if divisible and size % degree:
        raise UnsupportedError(
            f"{where}: context parallelism over {degree} ranks splits dim {cpi.split_dim} of size {size}, expected a "
            f"multiple of {degree}, got {size}. Pick a height/width (or prompt length, or frame count) whose token "
            f"count is a multiple of {degree}, or set ContextParallel(ulysses_anything=True) (or ring_anything=True).")
    ledger.sizes.append(size)


def _make_input_check(path: str, module: torch.nn.Module, inputs: dict[str, Any], degree: int, divisible: bool,
                      ledger: _Ledger, reset: bool) -> Any:
    """A diffusers hook, outermost on `module` (it sees the inputs before diffusers splits them): refuses an input
    the degree does not divide (before diffusers' bare `assert` in `EquipartitionSharder.shard`) and notes its
    length; on the transformer (`reset`) it also starts the ledger of this forward."""
    from diffusers.hooks import ModelHook as DiffusersHook

    names = list(inspect.signature(type(module).forward).parameters)[1:]
    where = _where(path, module)

    class _InputCheck(DiffusersHook):
        def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
            if reset:
                ledger.sizes.clear()
            for name, cpi in inputs.items():
                value = kwargs.get(name)
                if value is None and name in names and names.index(name) < len(args):
                    value = args[names.index(name)]
                _check_split(f"{where}.forward({name})", value, cpi, degree, divisible, ledger)
            return args, kwargs

    return _InputCheck()


def _make_output_check(path: str, module: torch.nn.Module, outputs: dict[int, Any], degree: int, divisible: bool,
                       ledger: _Ledger) -> Any:
    """A diffusers hook, innermost on `module` (it sees the outputs before diffusers splits them): the same check
    for the outputs the plan splits (`split_output`: RoPE tables)."""
    from diffusers.hooks import ModelHook as DiffusersHook

    where = _where(path, module)

    class _OutputCheck(DiffusersHook):
        def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
            values = [output] if isinstance(output, torch.Tensor) else list(output)
            for index, cpi in outputs.items():
                if index < len(values):
                    _check_split(f"{where} output {index}", values[index], cpi, degree, divisible, ledger)
            return output

    return _OutputCheck()


def _make_gather_check(path: str, module: torch.nn.Module, gathers: list[Any], degree: int, ledger: _Ledger,
                       origin: str, plan_from: str) -> Any:
    """A diffusers hook, outermost on `module` (it sees the gathered outputs): a gathered length that no split of
    this forward cut means the plan's dims do not match the model (a wrong gather_dim, a split the model never
    reached), which would otherwise return a wrongly shaped or silently scrambled sample."""
    from diffusers.hooks import ModelHook as DiffusersHook

    where = _where(path, module)
    fix = ("Fix its [[cp_plan]] (gather_dim, split_dim, expected_dims)." if origin == "adapter" else
           "Give the adapter a [[cp_plan]] that matches, with cp_plan_override = true.")

    class _GatherCheck(DiffusersHook):
        def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
            values = [output] if isinstance(output, torch.Tensor) else list(output)
            for index, cpo in enumerate(gathers):
                if cpo is None or index >= len(values) or not isinstance(values[index], torch.Tensor):
                    continue
                value = values[index]
                if cpo.expected_dims is not None and value.dim() != cpo.expected_dims:
                    raise UnsupportedError(
                        f"{where} output {index}: expected a {cpo.expected_dims}-dim tensor to gather (the plan's "
                        f"expected_dims), got shape {tuple(value.shape)}. The plan of {plan_from} does not match the "
                        f"model. {fix}")
                size = value.shape[cpo.gather_dim]
                if size not in ledger.sizes:
                    raise UnsupportedError(
                        f"{where} output {index}: context parallelism over {degree} ranks gathered dim "
                        f"{cpo.gather_dim} to size {size}, expected a sequence length the plan split in this call "
                        f"({sorted(set(ledger.sizes))}), got {size}. The plan of {plan_from} does not match the model "
                        f"(a wrong gather_dim or split_dim, or a split the forward never reaches). {fix}")
            return output

    return _GatherCheck()


# --- attach / remove ---------------------------------------------------------------------------------------------


class _ParallelAttachment(Removal):
    """What `enable_parallelism` changed, and how to take it back (see the module docstring for what is restored)."""

    def __init__(self, transformer: torch.nn.Module, spec: ContextParallel, plan: dict[str, Any], backend: str,
                 origin: str = "class", plan_from: str = "") -> None:
        self.transformer: torch.nn.Module | None = transformer
        self.spec = spec
        self.plan = plan
        self.backend = backend
        self.origin = origin
        self.plan_from = plan_from
        self.check = not spec.anything
        #: hookkit's check hooks in diffusers' registries: (module, hook name)
        self.checks: list[tuple[torch.nn.Module, str]] = []
        self.ledger = _Ledger()
        from diffusers.hooks.context_parallel import _get_submodule_by_name

        self.modules: list[torch.nn.Module] = []
        for module_id in plan:
            found = _get_submodule_by_name(transformer, module_id)
            self.modules.extend(found if isinstance(found, list) else [found])
        if transformer not in self.modules:
            self.modules.append(transformer)
        self.saved_modules = [(m, m.__dict__.get("forward", _MISSING), m.__dict__.get("_diffusers_hook", _MISSING))
                              for m in self.modules]
        self.saved_processors = [(p, p.__dict__.get("_parallel_config", _MISSING),
                                  p.__dict__.get("_attention_backend", _MISSING)) for p in _processors(transformer)]
        self.saved_config = transformer.__dict__.get("_parallel_config", _MISSING)
        from diffusers.models.attention_dispatch import _AttentionBackendRegistry

        #: `set_attention_backend` also sets diffusers' process-wide active backend
        self.saved_active = _AttentionBackendRegistry._active_backend
        self.set_active: Any = _MISSING

    def apply(self) -> None:
        transformer = self.transformer
        assert transformer is not None
        if self.spec.attention_backend is not None:
            from diffusers.models.attention_dispatch import _AttentionBackendRegistry

            transformer.set_attention_backend(self.spec.attention_backend)
            self.set_active = _AttentionBackendRegistry._active_backend
        from diffusers.hooks import HookRegistry as DiffusersRegistry
        from diffusers.hooks.context_parallel import _get_submodule_by_name
        from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

        def register(module: torch.nn.Module, hook: Any, name: str) -> None:
            DiffusersRegistry.check_if_exists_or_initialize(module).register_hook(hook, name)
            self.checks.append((module, name))

        degree, divisible = self.spec.degree, self.check
        located = []
        for path, entry in self.plan.items():
            found = _get_submodule_by_name(transformer, path)
            located.extend((path, m, entry) for m in (found if isinstance(found, list) else [found]))
        for path, module, entry in located:  # inner: registered before diffusers' split hooks
            if isinstance(entry, dict):
                outputs = {k: v for k, v in entry.items() if isinstance(v, ContextParallelInput) and v.split_output}
                if outputs:
                    register(module, _make_output_check(path, module, outputs, degree, divisible, self.ledger),
                             OUTPUT_CHECK_HOOK.format(path))
        transformer.enable_parallelism(config=self.spec.diffusers_config(), cp_plan=self.plan)
        root_inputs: dict[str, Any] = {}
        for path, module, entry in located:  # outer: registered after them
            if isinstance(entry, dict):
                inputs = {k: v for k, v in entry.items() if isinstance(v, ContextParallelInput) and not v.split_output}
                if path == "":
                    root_inputs = inputs
                elif inputs:
                    register(module, _make_input_check(path, module, inputs, degree, divisible, self.ledger, False),
                             INPUT_CHECK_HOOK.format(path))
            else:
                gathers = [entry] if isinstance(entry, ContextParallelOutput) else list(entry)
                register(module, _make_gather_check(path, module, gathers, degree, self.ledger, self.origin,
                                                    self.plan_from), GATHER_CHECK_HOOK.format(path))
        # outermost on the transformer: starts each forward's ledger, and checks the transformer's own split inputs
        register(transformer, _make_input_check("", transformer, root_inputs, degree, divisible, self.ledger, True),
                 CHECK_HOOK)

    def _undo(self) -> None:
        transformer = self.transformer
        if transformer is None:
            return
        from diffusers.hooks.context_parallel import remove_context_parallel

        for module, name in reversed(self.checks):
            registry = module.__dict__.get("_diffusers_hook")
            if registry is not None:
                registry.remove_hook(name, recurse=False)
        self.checks.clear()
        if context_parallel_config(transformer) is not None:
            remove_context_parallel(transformer, self.plan)
        for module, forward, hook_registry in self.saved_modules:
            d = module.__dict__
            current = d.get("_diffusers_hook")
            if current is not None and current is not hook_registry and not current.hooks:
                del d["_diffusers_hook"]  # diffusers made it for the context-parallel hooks and leaves it behind
                if forward is _MISSING:
                    d.pop("forward", None)
                else:
                    d["forward"] = forward
        for processor, config, backend in self.saved_processors:
            for attr, value in (("_parallel_config", config), ("_attention_backend", backend)):
                if value is _MISSING:
                    processor.__dict__.pop(attr, None)
                else:
                    processor.__dict__[attr] = value
        from diffusers.models.attention_dispatch import _AttentionBackendRegistry

        if self.set_active is not _MISSING and _AttentionBackendRegistry._active_backend == self.set_active:
            _AttentionBackendRegistry._active_backend = self.saved_active  # unless someone set another one since
        if self.saved_config is _MISSING:
            transformer.__dict__.pop("_parallel_config", None)
        else:
            transformer.__dict__["_parallel_config"] = self.saved_config
        self.transformer = None


def _world() -> tuple[bool, int]:
    available = torch.distributed.is_available() and torch.distributed.is_initialized()
    return available, torch.distributed.get_world_size() if available else 1


class _ParallelFeature(BaseFeature):
    """Plugs context parallelism into `hookkit.enable`: `Spec.parallel`."""

    name = NAME
    spec_class = ContextParallel

    def plan(self, ctx: PlanContext) -> list[Attachment]:
        spec = ctx.spec.parallel
        if spec is None:
            return []
        transformer = ctx.transformer
        cls = type(transformer).__name__
        resolve_cp_plan(transformer, ctx.adapter)
        heads = getattr(getattr(transformer, "config", None), "num_attention_heads", None)
        if isinstance(heads, int) and heads % spec.ulysses and not spec.ulysses_anything:
            raise SpecError(f"ContextParallel.ulysses: expected a divisor of {cls}'s {heads} attention heads, got "
                            f"{spec.ulysses}. Pick a divisor, or set ulysses_anything=True.")
        _check_backend(spec, transformer)
        return [Attachment(feature=NAME, target="", name=CONTEXT_HOOK)]

    def attach(self, ctx: AttachContext, attachment: Attachment) -> _ParallelAttachment:
        spec = ctx.spec.parallel
        assert spec is not None  # planned only with Spec.parallel
        transformer = ctx.transformer
        cls = type(transformer).__name__
        initialised, world = _world()
        if not initialised:
            raise UnsupportedError(
                "Spec.parallel: expected an initialised torch.distributed process group (one process per GPU), got "
                "none. Launch with `torchrun --nproc_per_node N ...` and call "
                "torch.distributed.init_process_group('nccl') (gloo on the CPU) before hookkit.enable.")
        if world < spec.degree:
            raise UnsupportedError(f"Spec.parallel: expected at least ulysses * ring = {spec.degree} ranks, got a "
                                   f"world of {world}. Launch {spec.degree} processes or lower the degrees.")
        if context_parallel_config(transformer) is not None or getattr(transformer, "_parallel_config", None):
            raise EnableError(
                f"Spec.parallel on {cls}: expected a transformer diffusers has not parallelised yet, got one with "
                "enable_parallelism already applied. hookkit rides on it as it is: drop Spec.parallel.")
        if torch.accelerator.device_count() == 0:
            raise UnsupportedError(
                "Spec.parallel: diffusers' enable_parallelism picks the device as rank % "
                "torch.accelerator.device_count(), which is 0 on a CPU-only torch build (ZeroDivisionError), got 0 "
                "accelerators. Run on GPUs; the known limit and its workaround are in the README (Multi-GPU).")
        backend = _check_backend(spec, transformer)
        plan, origin, plan_from = resolve_cp_plan(transformer, ctx.adapter)
        change = _ParallelAttachment(transformer, spec, plan, backend, origin, plan_from)
        try:
            change.apply()
        except BaseException:
            change.remove()
            raise
        ctx.keep(change)
        info = parallel_info(transformer)
        logger.info("parallel: {} context parallel ulysses {} x ring {} ({} backend) over {}, plan of {}", cls,
                    spec.ulysses, spec.ring, backend, info.mesh if info is not None else "?", plan_from)
        return change

    def summarize(self, ctx: AttachContext) -> FeatureSummary | None:
        change: _ParallelAttachment | None = ctx.kept()
        if change is None or change.transformer is None:
            return None
        info = parallel_info(change.transformer)
        spec = change.spec
        data: dict[str, Any] = {
            "ulysses": spec.ulysses, "ring": spec.ring, "anything": spec.anything, "attention_backend": change.backend,
            "world_size": info.world_size if info is not None else None, "rank": info.rank if info is not None else None,
            "mesh": info.mesh if info is not None else None, "sequence_check": change.check,
            "plan_origin": change.origin, "plan_from": change.plan_from, "plan_modules": list(change.plan),
        }
        text = (f"context parallel: ulysses {spec.ulysses} x ring {spec.ring}"
                f"{' (uneven shards allowed)' if spec.anything else ''}, attention backend {change.backend!r}\n"
                f"mesh: {data['mesh']}; this is rank {data['rank']} of {data['world_size']}\n"
                f"plan: {change.plan_from}: {', '.join(repr(m) for m in change.plan)}")
        return FeatureSummary(name=NAME, data=data, text=text)


FEATURE = _ParallelFeature()
