"""Compiling the adapter's repeated blocks (or the whole transformer) and keeping inductor's CUDA-graph modes safe.

Regional (`Compile(regional=True)`): every instance of the adapter's repeated block classes gets
`torch.compile(block.forward)` as the *inner* callable of its hook registry, so the hooks on those blocks
(cache decisions, clones) run outside the compiled region and never become graph breaks.

One backend per compile configuration (`region_compiler`): torch.compile makes a new backend at each call, which
dynamo keeps in a process-wide table until `torch._dynamo.reset()`; hookkit builds the backend and its dynamo context
once per configuration and compiles every region of every enable with it, so enabling again reuses the compiled
blocks and leaves nothing behind.

CUDA-graph safety (inductor's CUDA-graph modes, `backend="cudagraphs"`): a graph output lives in memory the
next replay overwrites; hookkit marks each transformer call's start (`cudagraph_mark_step_begin`) outside
every compiled region, and clones a wholly compiled transformer's outputs.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

import attrs
import torch
import torch.utils._pytree as pytree

from hookkit.core.compat import CUDA_GRAPH_MODES
from hookkit.core.registry import HookRegistry, ModelHook
from hookkit.core.removal import Removal
from hookkit.errors import UnsupportedError
from hookkit.techniques.compile.spec import Compile

if TYPE_CHECKING:
    from hookkit.adapters import AdapterSpec


def _clone_tensors(tree: Any) -> Any:
    return pytree.tree_map_only(torch.Tensor, lambda t: t.clone(), tree)


class CloneOutputsHook(ModelHook):
    """Clones a compiled callable's tensor outputs outside it, so a CUDA-graph replay cannot overwrite them."""

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        return _clone_tensors(output)


class StepMarkHook(ModelHook):
    """Marks a cudagraph-tree iteration boundary at every transformer call."""

    def pre_forward(self, module: torch.nn.Module, args: Any, kwargs: Any) -> Any:
        torch.compiler.cudagraph_mark_step_begin()
        return args, kwargs


def regional_paths(adapter: AdapterSpec, transformer: torch.nn.Module) -> list[str]:
    """Module paths of every instance of the adapter's repeated block classes, in module order."""
    return adapter.repeated_block_paths(transformer)


#: From torchao's recommended inductor settings for quantized models (`recommended_inductor_config_setter`),
#: passed to *hookkit's own* `torch.compile` calls instead of changing the process-wide config. Its
#: coordinate-descent tuning is not added: with it, fp8 Flux-dev compilation (default mode) took far too
#: long (BENCHMARKS.md). A mode that turns it on itself (max-autotune*) keeps it, as
#: it would without quantization: the chosen mode means the same for quantized and unquantized models.
QUANTIZED_INDUCTOR_OPTIONS: dict[str, Any] = {"force_fuse_int_mm_with_mul": True}


#: what AOTAutograd's cache says, once per process, of a tensor subclass without a stable cache hash: torchao's
#: quantized weights (Int8Tensor, Float8Tensor, ...) have none, and its default hash works; nothing to act on
SUBCLASS_CACHE_HASH_WARNING = r".*_stable_hash_for_caching"


def quiet_subclass_cache_hash_warning() -> None:
    """Ignore AOTAutograd's `... does not implement _stable_hash_for_caching` warning about torchao's quantized
    weights, exactly that message. Process-wide: the compile, and so the warning, comes at the first call after
    enable, and filtering around every call would cost each one; `filterwarnings` replaces an identical filter, so
    enabling again adds none."""
    warnings.filterwarnings("ignore", message=SUBCLASS_CACHE_HASH_WARNING, category=UserWarning)


def compile_kwargs(spec: Compile, quantized: bool = False, fp8_rows: Any | None = None,
                   real_rope: Any | None = None, norm_rope: Any | None = None) -> dict[str, Any]:
    """torch.compile arguments; a quantized model also gets torchao's inductor options, scoped to this call.

    A torch.compile call takes a mode or options, not both, so where options are needed (a quantized model, a
    graph pass) the mode is spelled as torch's own options for it (`torch._inductor.list_mode_options(mode)`, e.g.
    reduce-overhead's `triton.cudagraphs=True`, which keeps the cudagraph trees that hookkit's step mark is planned
    for). `fp8_rows` (a `FusedFp8Rows` pass) becomes the call's `post_grad_custom_post_pass`, `real_rope` (a
    `RealComplexMul` pass) its `post_grad_custom_pre_pass`, or `norm_rope` (a `FusedNormRope` pass) without one (with
    both, `norm_rope` runs chained after `real_rope`: see `new_real_rope_pass`).
    """
    kwargs: dict[str, Any] = {"fullgraph": spec.fullgraph, "dynamic": spec.dynamic, "backend": spec.backend}
    if spec.backend != "inductor":  # modes and options are inductor's
        return kwargs
    mode = None if spec.mode in (None, "default") else spec.mode
    pre_pass = real_rope if real_rope is not None else norm_rope
    if quantized or pre_pass is not None:
        # imported here: importing inductor is slow, and only compiles with options need it
        from torch._inductor import list_mode_options

        kwargs["options"] = {**list_mode_options(mode or "default"),
                             **(QUANTIZED_INDUCTOR_OPTIONS if quantized else {})}
        if fp8_rows is not None:
            kwargs["options"]["post_grad_custom_post_pass"] = fp8_rows
        if pre_pass is not None:
            kwargs["options"]["post_grad_custom_pre_pass"] = pre_pass
    elif mode is not None:
        kwargs["mode"] = mode
    return kwargs


def uses_cudagraph_trees(spec: Compile) -> bool:
    """Whether torch.compile replays cudagraph trees: inductor's CUDA-graph modes, or the "cudagraphs"
    backend (torch/_dynamo/backends/cudagraphs.py runs `torch._inductor.cudagraph_trees` too). Their
    outputs are graph memory, so they need hookkit's step mark (and output clone when whole)."""
    return spec.backend == "cudagraphs" or spec.mode in CUDA_GRAPH_MODES


@attrs.frozen(eq=False)
class RegionCompiler:
    """One compile configuration's backend and the dynamo context that compiles with it (what `torch.compile` builds
    anew at each call), shared by every region and every enable of that configuration: `region_compiler`."""

    #: `compile_kwargs` as a key: the backend's name, mode, fullgraph, dynamic and options (graph passes by identity)
    key: Hashable
    #: what dynamo compiles with and compares a cached block's backend against (torch's inductor or named wrapper)
    backend: Any
    #: `torch._dynamo.optimize(backend, ...)`: called with a function, returns it compiled (as torch.compile does)
    context: Callable[[Callable[..., Any]], Callable[..., Any]]

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        return self.context(fn)


#: The compiler of every compile configuration so far, by `compiler_key`. Each torch.compile call builds a new backend
#: object and dynamo keeps every one in a process-wide table until `torch._dynamo.reset()`: a server toggling hookkit
#: grew that table by one backend per region at each enable. Few configurations, so few entries.
_COMPILERS: dict[Hashable, RegionCompiler] = {}


def compiler_key(kwargs: dict[str, Any]) -> Hashable:
    """`compile_kwargs` as a dict key. Option values compare as torch compares backends (by `==`, so hookkit's graph
    passes, shared per configuration by `hooks.shared_pass`, by identity); an unhashable value by its repr."""
    def value(v: Any) -> Any:
        try:
            hash(v)
        except TypeError:
            return repr(v)
        return v

    options = kwargs.get("options") or {}
    return (kwargs["backend"], kwargs.get("mode"), kwargs["fullgraph"], kwargs["dynamic"],
            tuple(sorted((k, value(v)) for k, v in options.items())))


def region_compiler(kwargs: dict[str, Any]) -> RegionCompiler:
    """The compiler for `compile_kwargs`: the one an earlier enable of the same configuration built, else a new one
    (also after `torch._dynamo.reset()`, which forgets every backend, as a fresh torch.compile would)."""
    key = compiler_key(kwargs)
    compiler = _COMPILERS.get(key)
    if compiler is None or not _dynamo_lists(compiler.backend):
        compiler = _COMPILERS[key] = _new_compiler(kwargs, key)
    return compiler


def _new_compiler(kwargs: dict[str, Any], key: Hashable) -> RegionCompiler:
    """The backend and context `torch.compile(fn, **kwargs)` would build (torch/__init__.py: `compile`), built once."""
    mode, options, dynamic = kwargs.get("mode"), kwargs.get("options"), kwargs["dynamic"]
    if kwargs["backend"] == "inductor":
        backend = torch._TorchCompileInductorWrapper(mode, options, dynamic)
    else:
        backend = torch._TorchCompileWrapper(kwargs["backend"], mode, options, dynamic)
    context = torch._dynamo.optimize(backend=backend, nopython=kwargs["fullgraph"], dynamic=dynamic)
    return RegionCompiler(key=key, backend=backend, context=context)


def _dynamo_lists(backend: Any) -> bool:
    """Whether dynamo's table of backends (the one `torch._dynamo.reset()` clears, resetting each) still holds
    `backend` (by its id, as dynamo files it); True where this torch keeps no such table."""
    from torch._dynamo import eval_frame

    table = getattr(eval_frame, "cached_backends", None)
    return table is None or table.get(id(backend)) is backend


#: torch's own source folder: frames there are torch's (dynamo's polyfills, modes), not the model's
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def graph_break_error(path: str, kind: str, error: BaseException) -> UnsupportedError:
    """The hookkit error for a region that torch.compile could not trace as one graph under `fullgraph=True`:
    dynamo's reason, the line of model code where it stopped, and the fix (`Compile(fullgraph=False)`). `path` is the
    module's path in the transformer ("" for the transformer itself), `kind` its class name."""
    text = str(error).strip()
    lines = text.splitlines() or [type(error).__name__]
    reason = lines[0].strip()[:300]
    explanation = next((line.strip() for line in lines[1:4] if line.strip().startswith("Explanation:")), None)
    if explanation is not None:
        reason += f" ({explanation[len('Explanation:'):].strip()})"
    frames = [frame for frame in re.findall(r'File "([^"]+)", line (\d+), in (\S+)',
                                            text.rsplit("from user code:", 1)[-1])
              if not os.path.abspath(frame[0]).startswith(_TORCH_DIR)]  # dynamo's polyfills are not the model's
    where = f" at {os.path.basename(frames[-1][0])}:{frames[-1][1]} in {frames[-1][2]}" if frames else ""
    what = f"{path} ({kind})" if path else f"the transformer ({kind})"
    return UnsupportedError(
        f"Compile(fullgraph=True): expected the forward of {what} to compile as one graph, got a graph break{where}: "
        f"{reason}. Use Compile(fullgraph=False): torch.compile then compiles it in pieces around what it cannot "
        "trace (each break runs eagerly)."
    )


class _InnerCompile(Removal):
    """Installs `compiler(original forward)` as a module's inner callable; removal restores it. With `fullgraph`, a
    graph break is raised as hookkit's `graph_break_error` (naming the module at `path`), not as dynamo's traceback."""

    def __init__(self, module: torch.nn.Module, compiler: Callable[[Callable[..., Any]], Callable[..., Any]],
                 path: str = "", fullgraph: bool = False) -> None:
        # Compile before `HookRegistry.of` creates a registry: if compiling raises, the module's `__dict__` is
        # untouched (enable's rollback never sees this attachment).
        existing = HookRegistry.of(module, create=False)
        compiled = compiler(existing.original_forward if existing is not None else module.forward)
        if fullgraph:
            compiled = _naming_graph_breaks(compiled, path, type(module).__name__)
        HookRegistry.of(module).set_inner(compiled)
        self.module: torch.nn.Module | None = module

    def _undo(self) -> None:
        registry = HookRegistry.of(self.module, create=False)
        if registry is not None:
            registry.set_inner(None)
        self.module = None


def _naming_graph_breaks(compiled: Callable[..., Any], path: str, kind: str) -> Callable[..., Any]:
    """`compiled`, raising `graph_break_error` where dynamo refuses a graph break under fullgraph: `Unsupported`
    (what it cannot trace), `UserError` (a value read from a tensor that Python control flow or a size depends on)."""
    from torch._dynamo.exc import Unsupported, UserError

    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return compiled(*args, **kwargs)
        except (Unsupported, UserError) as error:
            raise graph_break_error(path, kind, error) from error

    run.__wrapped__ = compiled  # type: ignore[attr-defined]
    return run
