"""Regional compilation, CUDA-graph safety by hooks, and whole-transformer CUDA graphs.

Regional (`Compile(regional=True)`): every instance of the adapter's repeated block classes gets
`torch.compile(block.forward)` as the *inner* callable of its hook registry, so the hooks on those blocks
(cache decisions, clones) run outside the compiled region and never become graph breaks.

CUDA-graph safety (inductor's CUDA-graph modes, `backend="cudagraphs"`): a graph output lives in memory the
next replay overwrites; hookkit marks each transformer call's start (`cudagraph_mark_step_begin`) outside
every compiled region, and clones a wholly compiled transformer's outputs.

Whole-transformer CUDA graphs (`cuda_graphs="transformer"`, GPU only): blocks compiled regionally, then each
transformer call captured once per input signature with `torch.cuda.CUDAGraph` and replayed while the
signature holds (inputs copied into static buffers, outputs cloned out). Hooks inside the transformer do not
run on replay, so a feature that decides per call provides `hookkit.core.graphs.GraphDecisions` (the cache
with a static mask: the decision becomes part of the graph key) or `SplitDecisions` (the cache with a
threshold: each call is split at the decision into a head graph ending with the statistic, one host read,
and the computed or cached tail graph, `SplitGraphHook`). Before every call `ModelWatch` compares what the
graphs captured (tensors, module tree, inner hooks, LoRA state, attention processors and backends) with the
model now: on a change they are captured anew; a model moved off CUDA is refused. The call the first-call check
of the adapter observes runs eagerly (`hookkit.core.graphs.EagerCalls`): captures start at the next call.
"""

from __future__ import annotations

import contextlib
import itertools
from collections import OrderedDict
import operator
import sys
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, ContextManager

import attrs
import torch
import torch.utils._pytree as pytree

from hookkit.core.compat import CUDA_GRAPH_MODES
from hookkit.core.feature import AttachContext, BaseFeature
from hookkit.core.graphs import EagerCalls, GraphDecisions, SplitDecisions
from hookkit.core.plan import Attachment, PlanContext, add_hook, module_at
from hookkit.core.registry import HookRegistry, ModelHook
from hookkit.core.removal import Removable, Removal
from hookkit.core.summary import SUMMARY_WIDTH, FeatureSummary, table
from hookkit.errors import HookError, SpecError, UnsupportedError
from hookkit.techniques.compile.spec import Compile

if TYPE_CHECKING:
    from hookkit.adapters import AdapterSpec

NAME = "compile"
INNER = "hookkit.compile.inner"
CLONE = "hookkit.compile.clone"
STEP_MARK = "hookkit.compile.step_mark"
GRAPH = "hookkit.compile.graph"


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


# --- whole-transformer CUDA graphs ----------------------------------------------------------------------


def signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
    """What must match for a captured graph to be replayed: tensor metadata and every non-tensor value."""
    with torch._C.DisableTorchFunction():  # metadata reads: no torch-function mode (memo's) sees them
        return _signature(args, kwargs)


def _signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
    leaves, spec = pytree.tree_flatten((args, kwargs))
    key: list[Hashable] = [str(spec)]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            key.append(("T", tuple(leaf.shape), leaf.dtype, leaf.device, leaf.stride(), leaf.requires_grad))
        else:
            try:
                hash(leaf)
                key.append(("V", type(leaf).__name__, leaf))
            except TypeError:
                key.append(("O", type(leaf).__name__, id(leaf)))
    return tuple(key)


@attrs.define
class CapturedCall:
    """One captured signature: static input buffers, the replay callable, the static outputs."""

    static_leaves: list[Any]
    replay: Callable[[], None]
    static_output: Any
    replays: int = 0
    #: device memory the capture (warm-up included) added, as the backend reports it (0 where it cannot)
    memory_bytes: int = 0


def warm_on_side_stream(fn: Callable[[], Any], times: int) -> None:
    """Run `fn` `times` times on a side stream, as torch's CUDA-graph recipe asks before a capture (lazy
    initialisation and autotuning happen outside the graph), then make the current stream wait for it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(times):
            fn()
    torch.cuda.current_stream().wait_stream(stream)


class _GraphPool:
    """One CUDA graph memory pool that every capture shares, created at the first capture after a release."""

    def __init__(self, warmup: int = 2) -> None:
        self.warmup = warmup
        self._pool: Any = None

    def pool(self) -> Any:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    def release_pool(self) -> None:
        """Forget the pool once no captured graph holds it (after an invalidation or the last eviction).

        A pool whose graphs are all gone may still own blocks that live tensors hold; capturing into it again
        trips an internal assert of the CUDA caching allocator (`use_count > 0`), so the next capture starts a
        new pool and the old one is freed with its last block."""
        self._pool = None


def release_pool_if_empty(captured: Any, backend: Any) -> None:
    """Before a capture: when no graph is kept any more, tell a pool-owning backend its pool is free."""
    if not captured and hasattr(backend, "release_pool"):
        backend.release_pool()


class CudaGraphBackend(_GraphPool):
    """Captures with `torch.cuda.CUDAGraph` on a side stream after warm-up, sharing one memory pool."""

    def memory_in_use(self) -> int:
        """Reserved device memory: what a capture adds to it is the memory its graph keeps."""
        return torch.cuda.memory_reserved()

    def capture(self, fn: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
        pool = self.pool()
        warm_on_side_stream(fn, self.warmup)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            output = fn()
        return graph.replay, output


class GraphRunner:
    """Replays one captured graph per input signature; copies inputs in and clones outputs out.

    `backend.capture(fn) -> (replay, static_output)` is injectable so that the bookkeeping is tested on
    the CPU with a stand-in backend.
    """

    def __init__(self, backend: Any, max_graphs: int | None = None) -> None:
        self.backend = backend
        #: at most `max_graphs` entries, least recently replayed first (None: no bound)
        self.max_graphs = max_graphs
        self.captured: OrderedDict[Hashable, CapturedCall] = OrderedDict()
        self.captures = 0
        self.evictions = 0
        #: calls run eagerly, neither captured nor replayed (the first-call check observed them: `EagerCalls`)
        self.eager_calls = 0
        #: why the captured graphs were dropped, one entry per invalidation (see `ModelWatch`)
        self.invalidations: list[str] = []

    def invalidate(self, reason: str) -> None:
        """Drop every captured graph: the next call of each signature captures anew (what a fresh enable does)."""
        self.captured.clear()
        self.invalidations.append(reason)

    def __call__(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                 extra_key: Hashable = None, capturing: Callable[[], ContextManager[Any]] = contextlib.nullcontext) -> Any:
        """Run `fn(*args, **kwargs)` from the graph of this signature (+ `extra_key`), capturing it first if new.

        `capturing()` is entered around warm-up and capture only (DBCache forces its decision there).
        """
        key = (signature(args, kwargs), extra_key)
        entry = self.captured.get(key)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if entry is None:
            while self.max_graphs is not None and len(self.captured) >= self.max_graphs:
                self.captured.popitem(last=False)  # the least recently replayed graph; its memory returns to the pool
                self.evictions += 1
            release_pool_if_empty(self.captured, self.backend)
            memory = getattr(self.backend, "memory_in_use", None)
            before = memory() if memory is not None else 0
            static = [leaf.clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
            static_args, static_kwargs = pytree.tree_unflatten(static, spec)
            with capturing():
                replay, output = self.backend.capture(lambda: fn(*static_args, **static_kwargs))
            used = max(0, memory() - before) if memory is not None else 0
            entry = self.captured[key] = CapturedCall(static_leaves=static, replay=replay, static_output=output,
                                                      memory_bytes=used)
            self.captures += 1
        else:
            self.captured.move_to_end(key)
            for buffer, leaf in zip(entry.static_leaves, leaves):
                if isinstance(leaf, torch.Tensor) and leaf.data_ptr() != buffer.data_ptr():
                    buffer.copy_(leaf)
        entry.replay()
        entry.replays += 1
        return _clone_tensors(entry.static_output)


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


class GraphHook(ModelHook):
    """Innermost hook on the transformer: runs the rest of the call through a `GraphRunner`.

    With a feature that decides per call (`cache`: the `GraphDecisions` DBCache provides) the decision is part
    of the graph key: a computed step and a cached step are two graphs, and the cache is told about every call
    that a graph served.

    Before every call the `ModelWatch` compares what the graphs captured with the model as it is now; on any
    change the graphs are dropped and captured anew, as a fresh enable would, after checking the model is
    still wholly on CUDA (a model moved to the CPU is refused, never captured).

    A call that `eager` (the core's `EagerCalls`: the first-call check of the adapter) claims runs as in eager
    mode, uncaptured (the cache's hooks decide it; `adopted` keeps the bookkeeping a replay keeps), so its output
    and errors are eager mode's and no graph holds the check's block observers. That is once per enable (again only
    while the check fails and stays armed): an invalidation re-captures without a second check, because what
    the watch sees change (weights, devices, dtypes, LoRA layers and scales, hooks, training mode, attention
    processors and backends) changes none of what the check confirmed (block order, each block's stream arguments
    and returns, the hidden-stream chain: the forward's code and block lists), and a replaced or appended hooked
    block is refused at the next pipeline call whatever the graphs (`Handle._check_modules`). Eager mode checks
    once per enable too.
    """

    replaces_forward = True

    def __init__(self, runner: GraphRunner, cache: GraphDecisions | None = None, require_cuda: bool = False,
                 eager: EagerCalls | None = None) -> None:
        self.runner = runner
        self.cache = cache
        self.require_cuda = require_cuda
        self.eager = eager
        self.watch = ModelWatch()

    def new_forward(self, module: torch.nn.Module, call_next: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        if self.eager is not None and self.eager.eager():
            return self._eager_call(module, call_next, args, kwargs)
        reason = self.watch.check(module)
        if reason is not None:
            if self.require_cuda:
                check_on_cuda(module)
            if self.runner.captured:
                self.runner.invalidate(reason)
        captured = len(self.runner.captured)
        if self.cache is None:
            output = self.runner(call_next, args, kwargs)
        else:
            shapes = tuple(v.shape for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor))
            decision = self.cache.decision(shapes)
            output = self.runner(call_next, args, kwargs, extra_key=decision,
                                 capturing=lambda: self.cache.forcing(decision))
            self.cache.replayed(decision, shapes)
        if reason is not None or len(self.runner.captured) != captured:
            self.watch.arm(module)  # after a capture: what the capture itself did is part of what it captured
        return output

    def _eager_call(self, module: torch.nn.Module, call_next: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """One call as eager mode runs it (the cache's hooks decide and record); the cache then keeps what a
        graph-served call leaves for the next ones."""
        if self.require_cuda:
            check_on_cuda(module)
        self.runner.eager_calls += 1
        output = call_next(*args, **kwargs)
        if self.cache is not None:
            self.cache.adopted(tuple(v.shape for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)))
        return output


# --- whole-transformer CUDA graphs split at a dynamic DBCache decision --------------------------------------


class CudaGraphSegments:
    """One Python execution captured as consecutive CUDA graphs on one side stream and one memory pool, cut
    wherever `cut()` is called (inside a hook, mid-forward). Tensors allocated by an earlier segment and read by
    a later one stay at their addresses: the later graph reads what the earlier one's replay wrote."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.graphs: list[Any] = []
        self.stream = torch.cuda.Stream()
        self._stream_ctx: Any = None

    def begin(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream())
        self._stream_ctx = torch.cuda.stream(self.stream)
        self._stream_ctx.__enter__()
        self._start()

    def _start(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(self.pool)
        self.graphs.append(graph)

    def cut(self) -> None:
        self.graphs[-1].capture_end()
        self._start()

    def end(self) -> list[Callable[[], None]]:
        """End the last segment; the replay callables, in capture order."""
        try:
            self.graphs[-1].capture_end()
        finally:
            self._stream_ctx.__exit__(None, None, None)
            torch.cuda.current_stream().wait_stream(self.stream)
        return [g.replay for g in self.graphs]


class CudaSegmentBackend(_GraphPool):
    """`SplitGraphHook`'s capture backend on CUDA: side-stream warm-up, then segmented capture, one pool."""

    def warm(self, fn: Callable[[], Any]) -> None:
        warm_on_side_stream(fn, self.warmup)

    def segments(self) -> CudaGraphSegments:
        return CudaGraphSegments(self.pool())


@attrs.define
class SplitPair:
    """The two graphs of one (signature, branch, decision): `head` runs the transformer up to and including the
    decision statistic (`stat`), `tail` the computed or the cached rest of the call, on `head`'s tensors."""

    static_leaves: list[Any]
    head: Callable[[], None]
    tail: Callable[[], None]
    stat: torch.Tensor
    static_output: Any
    replays: int = 0


class SplitGraphHook(ModelHook):
    """Innermost hook on the transformer with dynamic DBCache: each call is a head graph, one host read of the
    decision statistic, then the computed-step or the cached-step tail graph.

    One Python execution can only follow one path, so a head and a tail are captured together, as a pair per
    (input signature, CFG branch, decision). A call replays the head of the pair its branch used last (the
    decision rarely changes from one step to the next), reads the statistic, and when the decision differs,
    replays the other pair's head (so its tail reads its own head's tensors) before that tail. A pair is only
    captured once its decision is known (rules that need no statistic, or a statistic read from another pair's
    head): warming a pair up runs its path, and the computed path writes the residual and reference slots. One
    exception: when the statistic decides and no pair of the branch's signature exists yet (its last computed
    step ran eagerly, or the pairs were dropped mid-call), the cached pair is captured for its head, since its path
    writes no slot. Same rules, same statistic ops as eager DBCache, so the same decisions (tested bitwise on the
    CPU with a recording stand-in for capture).

    The call `eager` claims (the first-call check's, see `GraphHook`) runs as in eager mode, uncaptured.

    `backend`: `warm(fn)` and `segments()` (`CudaSegmentBackend` on a GPU; injectable for CPU tests).
    """

    replaces_forward = True

    def __init__(self, backend: Any, cache: Any, require_cuda: bool = False, eager: EagerCalls | None = None) -> None:
        self.backend = backend
        self.cache = cache
        self.eager = eager
        #: calls run eagerly, neither captured nor replayed (the first-call check observed them)
        self.eager_calls = 0
        self.captured: dict[Hashable, SplitPair] = {}
        #: pairs captured since attach, those dropped by an invalidation included (as `GraphRunner.captures`)
        self.captures = 0
        #: host reads of the decision statistic, and heads replayed a second time (the decision changed)
        self.reads = 0
        self.switches = 0
        self.require_cuda = require_cuda
        #: what the pairs captured besides their inputs (see `ModelWatch`); why they were dropped
        self.watch = ModelWatch()
        self.invalidations: list[str] = []

    def new_forward(self, module: torch.nn.Module, call_next: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        if self.eager is not None and self.eager.eager():
            return self._eager_call(module, call_next, args, kwargs)
        reason = self.watch.check(module)
        if reason is not None:  # the model changed since capture: every pair is captured anew, as a fresh enable would
            if self.require_cuda:
                check_on_cuda(module)
            if self.captured:
                self.captured.clear()
                self.invalidations.append(reason)
        pairs = len(self.captured)
        output = self._call(module, call_next, args, kwargs)
        if reason is not None or len(self.captured) != pairs:
            self.watch.arm(module)  # after a capture: what the capture itself did is part of what it captured
        return output

    def _call(self, module: torch.nn.Module, call_next: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        sig = signature(args, kwargs)
        branch, cached = self.cache.host_decision(sig)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if cached is None:  # the statistic decides: try the pair the branch used last
            guess = self.cache.last_cached.get(branch, False)
            pair = self.captured.get((sig, branch, guess))
            if pair is None:  # the computed pair of this signature served the step that set the reference
                guess, pair = False, self.captured.get((sig, branch, False))
            if pair is None:  # that step ran uncaptured: the cached pair's head reads the statistic, writing nothing
                guess, pair = True, self._pair(call_next, leaves, spec, sig, branch, True, head=False)
            self._load(pair, leaves)
            pair.head()
            self.reads += 1
            cached = self.cache.judge(branch, float(pair.stat.item()))  # the one host read of the step
            if cached != guess:
                self.switches += 1
                pair = self._pair(call_next, leaves, spec, sig, branch, cached, head=True)
        else:
            pair = self._pair(call_next, leaves, spec, sig, branch, cached, head=True)
        pair.tail()
        pair.replays += 1
        self.cache.finish(branch, cached, sig)
        return _clone_tensors(pair.static_output)

    def _pair(self, call_next: Callable[..., Any], leaves: list[Any], spec: Any, sig: Hashable, branch: int,
              cached: bool, head: bool) -> SplitPair:
        """The pair of this decision with this call's inputs loaded and (when `head`) its head replayed."""
        pair = self.captured.get((sig, branch, cached))
        if pair is None:
            release_pool_if_empty(self.captured, self.backend)
            pair = self.captured[(sig, branch, cached)] = self._capture(call_next, leaves, spec, branch, cached)
            self.captures += 1
        self._load(pair, leaves)
        if head:
            pair.head()
        return pair

    def _eager_call(self, module: torch.nn.Module, call_next: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """One call as eager mode runs it (the hooks decide, the statistic read eagerly); the cache then keeps what
        a pair-served call leaves for the next ones (the reference of the statistic among it)."""
        if self.require_cuda:
            check_on_cuda(module)
        self.eager_calls += 1
        sig = signature(args, kwargs)
        output = call_next(*args, **kwargs)
        self.cache.adopted(sig)
        return output

    @staticmethod
    def _load(pair: SplitPair, leaves: list[Any]) -> None:
        for buffer, leaf in zip(pair.static_leaves, leaves):
            if isinstance(leaf, torch.Tensor) and leaf.data_ptr() != buffer.data_ptr():
                buffer.copy_(leaf)

    def _capture(self, call_next: Callable[..., Any], leaves: list[Any], spec: Any, branch: int,
                 cached: bool) -> SplitPair:
        static = [leaf.clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        static_args, static_kwargs = pytree.tree_unflatten(static, spec)
        run = lambda: call_next(*static_args, **static_kwargs)  # noqa: E731
        stats: list[torch.Tensor] = []
        with self.cache.forcing((branch, cached)):
            # One plain call first, whatever the backend's warm-up: the residual and reference slots this path
            # uses are allocated (and zeroed) here, outside any capture; allocated inside one, their zeroing
            # would be part of the graph and wipe them at every replay.
            run()
            self.backend.warm(run)
            segments = self.backend.segments()

            def cut(stat: torch.Tensor) -> None:
                if stats:
                    raise HookError("SplitGraphHook: expected one DBCache decision per transformer call, got a "
                                    "second one in the same call. Use Compile(cuda_graphs='none') with this model.")
                stats.append(stat)
                segments.cut()

            self.cache.on_decision = cut
            segments.begin()
            try:
                output = run()
            finally:
                self.cache.on_decision = None
                replays = segments.end()
        if not stats or len(replays) != 2:
            raise HookError("SplitGraphHook: expected the DBCache decision inside the transformer call, the call "
                            "ended without reaching it (no middle block ran). Use Compile(cuda_graphs='none').")
        return SplitPair(static_leaves=static, head=replays[0], tail=replays[1], stat=stats[0], static_output=output)


# --- plan / attach ----------------------------------------------------------------------------------------


def regional_paths(adapter: AdapterSpec, transformer: torch.nn.Module) -> list[str]:
    """Module paths of every instance of the adapter's repeated block classes, in module order."""
    return adapter.repeated_block_paths(transformer)


#: From torchao's recommended inductor settings for quantized models (`recommended_inductor_config_setter`),
#: passed to *hookkit's own* `torch.compile` calls instead of changing the process-wide config. Its
#: coordinate-descent tuning is not added: with it, fp8 Flux-dev compilation (default mode) took far too
#: long (BENCHMARKS.md). A mode that turns it on itself (max-autotune*) keeps it, as
#: it would without quantization: the chosen mode means the same for quantized and unquantized models.
QUANTIZED_INDUCTOR_OPTIONS: dict[str, Any] = {"force_fuse_int_mm_with_mul": True}


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

        kwargs["options"] = {**list_mode_options(mode or "default"), **(QUANTIZED_INDUCTOR_OPTIONS if quantized else {})}
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


def check_spec(c: Compile) -> None:
    """Settings of `Compile` that cannot work together, refused before anything is attached (the rules that
    involve other features are in `hookkit.core.compat`)."""
    if c.cuda_graphs == "transformer":
        if c.mode in CUDA_GRAPH_MODES:
            raise SpecError(
                f"Compile.mode: expected None, 'default' or 'max-autotune-no-cudagraphs' with "
                f"cuda_graphs='transformer' (hookkit captures the graph itself), got {c.mode!r}."
            )
        if c.backend == "cudagraphs":
            raise SpecError(
                "Compile.backend: expected 'inductor', 'eager' or 'aot_eager' with cuda_graphs='transformer' "
                "(hookkit captures the whole transformer itself; the 'cudagraphs' backend would capture graphs "
                "inside that capture), got 'cudagraphs'. Use Compile(cuda_graphs='transformer') or "
                "Compile(backend='cudagraphs') alone."
            )


def check_on_cuda(transformer: torch.nn.Module) -> None:
    """`cuda_graphs="transformer"` captures the transformer's kernels: every parameter and buffer must be on
    a CUDA device, or the captured graph would miss the CPU work and every replay return stale output."""
    devices = sorted({str(t.device) for t in itertools.chain(transformer.parameters(), transformer.buffers())})
    if devices and all(d.startswith("cuda") for d in devices):
        return
    found = ", ".join(devices) or "no parameters"
    if not torch.cuda.is_available():
        raise UnsupportedError(
            f"Compile.cuda_graphs='transformer' needs a CUDA device; none is available (the transformer is on "
            f"{found}). Use cuda_graphs='none' on this machine."
        )
    raise UnsupportedError(
        f"Compile.cuda_graphs='transformer' needs a CUDA device: expected every parameter and buffer of "
        f"{type(transformer).__name__} on cuda, got {found}. Move the pipeline first (pipe.to(\"cuda\")), then "
        "call hookkit.enable."
    )


class _CompileFeature(BaseFeature):
    """Plugs compilation into `hookkit.enable`: `Spec.compile`."""

    name = NAME
    spec_class = Compile

    def plan(self, ctx: PlanContext) -> list[Attachment]:
        spec: Compile = ctx.spec.compile  # type: ignore[assignment]  # planned only when set
        check_spec(spec)
        if spec.cuda_graphs == "transformer":
            check_on_cuda(ctx.transformer)
        out: list[Attachment] = []
        cuda_graph_trees = uses_cudagraph_trees(spec)
        targets = regional_paths(ctx.adapter, ctx.transformer) if spec.regional else [""]
        if cuda_graph_trees:
            out.append(Attachment(feature=NAME, target="", name=STEP_MARK))
        for path in targets:
            out.append(Attachment(feature=NAME, target=path, name=INNER))
        if cuda_graph_trees and not spec.regional:  # the whole transformer's output is graph memory
            out.append(Attachment(feature=NAME, target="", name=CLONE))
        if spec.cuda_graphs == "transformer":
            out.append(Attachment(feature=NAME, target="", name=GRAPH))
        return out

    def attach(self, ctx: AttachContext, attachment: Attachment) -> Removable:
        spec: Compile = ctx.spec.compile  # type: ignore[assignment]
        module = module_at(ctx.transformer, attachment.target)
        state: CompileState = ctx.kept() or ctx.keep(CompileState())
        if attachment.name == INNER:
            quantized = ctx.spec.quantize is not None
            if quantized and spec.fuse_fp8_rows != "off" and spec.backend == "inductor" and state.fp8_rows is None:
                state.take("fp8_rows", shared_pass(new_fp8_rows_pass(fast=spec.fuse_fp8_rows == "fast")))
            if spec.fuse_norm_rope and spec.backend == "inductor" and state.norm_rope is None:
                state.take("norm_rope", shared_pass(new_norm_rope_pass()))
            if spec.real_rope and spec.backend == "inductor" and state.real_rope is None:
                state.take("real_rope", shared_pass(new_real_rope_pass(then=state.norm_rope)))
            return _InnerCompile(module, compile_kwargs(spec, quantized=quantized, fp8_rows=state.fp8_rows,
                                                        real_rope=state.real_rope, norm_rope=state.norm_rope))
        if attachment.name == CLONE:
            return add_hook(module, CLONE, CloneOutputsHook())
        if attachment.name == STEP_MARK:
            return add_hook(module, STEP_MARK, StepMarkHook())
        split = ctx.request(SplitDecisions)
        eager = ctx.request(EagerCalls)  # the core's first-call check: its call runs uncaptured
        if split is not None and split.dynamic:  # a threshold decides: each call split at the decision
            state.runner = SplitGraphHook(CudaSegmentBackend(), split, require_cuda=True, eager=eager)
            return add_hook(module, GRAPH, state.runner)
        runner = state.runner = GraphRunner(CudaGraphBackend(), max_graphs=spec.max_graphs)
        return add_hook(module, GRAPH, GraphHook(runner, ctx.request(GraphDecisions), require_cuda=True, eager=eager))

    def summarize(self, ctx: AttachContext) -> FeatureSummary | None:
        spec: Compile = ctx.spec.compile  # type: ignore[assignment]
        regions = [a.target for a in ctx.attachments() if a.name == INNER]
        data: dict[str, Any] = {
            "regional": spec.regional, "mode": spec.mode or "default", "regions": len(regions),
            "cuda_graphs": spec.cuda_graphs,
        }
        rows = [["regions compiled", len(regions) if spec.regional else "whole transformer"],
                ["mode", data["mode"]], ["fullgraph", spec.fullgraph]]
        if uses_cudagraph_trees(spec):
            # torch accepts reduce-overhead on the CPU and compiles without CUDA graphs: say so, once, here
            device = next(ctx.transformer.parameters()).device
            data["cudagraph_trees"] = device.type == "cuda"
            rows.append(["CUDA graph trees", "yes" if data["cudagraph_trees"] else
                         f"no: the transformer is on {device.type}, where torch.compile runs without CUDA graphs"])
        state: CompileState = ctx.kept() or CompileState()
        # A graph pass's counter is listed when it counted something, or where it could have: a 0 there says the
        # pass found nothing to rewrite; elsewhere (fp8 passes without an fp8 scheme, the CUDA-only norm+RoPE
        # kernel on the CPU) it says nothing and is left to `data`.
        device = next(ctx.transformer.parameters(), torch.empty(0)).device
        scheme = ctx.spec.quantize.scheme if ctx.spec.quantize is not None else ""
        if state.fp8_rows is not None:
            data["fp8_rows_per_graph"] = state.per_graph("fp8_rows")
            data["fp8_rows_fused"] = sum(data["fp8_rows_per_graph"])
            data["fp8_rows_arithmetic"] = "fast" if state.fp8_rows.fast else "exact"
            data["fp8_rows_shared"] = sum(state.per_graph("fp8_rows", "shared_per_graph"))
            fp8 = scheme.startswith("fp8")
            if fp8 or data["fp8_rows_fused"]:
                rows.append(["fp8 row quantizations fused (one pass)",
                             f"{data['fp8_rows_arithmetic']}: {data['fp8_rows_fused']} rewritten by this handle's "
                             "compiles (a region served from inductor's FX graph cache was rewritten when cached)"])
            if state.fp8_rows.share and (fp8 or data["fp8_rows_shared"]):
                rows.append(["fp8 row quantizations shared (same input)",
                             f"{data['fp8_rows_shared']} dropped for an identical one by this handle's compiles"])
        if state.norm_rope is not None:
            data["norm_ropes_per_graph"] = state.per_graph("norm_rope")
            data["norm_ropes_fused"] = sum(data["norm_ropes_per_graph"])
            if data["norm_ropes_fused"] or device.type in getattr(state.norm_rope, "devices", ("cuda",)):
                rows.append(["query/key RMSNorm + RoPE in one pass",
                             f"{data['norm_ropes_fused']} rewritten by this handle's compiles"])
        if state.real_rope is not None:
            data["complex_muls_per_graph"] = state.per_graph("real_rope")
            data["complex_muls_as_real"] = sum(data["complex_muls_per_graph"])
            if data["complex_muls_as_real"] or device.type == "cuda":
                rows.append(["complex products as real arithmetic (RoPE)",
                             f"{data['complex_muls_as_real']} rewritten by this handle's compiles"])
        runner = state.runner
        if isinstance(runner, GraphRunner):
            data["graphs_captured"] = runner.captures
            data["graphs_kept"] = len(runner.captured)
            data["graph_evictions"] = runner.evictions
            data["max_graphs"] = runner.max_graphs
            data["graph_replays"] = sum(e.replays for e in runner.captured.values())
            data["graph_memory_bytes"] = [e.memory_bytes for e in runner.captured.values()]
            memory = ", ".join(f"{b / 2**20:.1f}" for b in data["graph_memory_bytes"]) or "-"
            rows += [["transformer graphs captured", data["graphs_captured"]],
                     ["graphs kept / max", f"{data['graphs_kept']} / {runner.max_graphs}"],
                     ["graphs evicted", data["graph_evictions"]], ["graph replays (kept graphs)", data["graph_replays"]],
                     ["MiB per kept graph", memory]]
        elif isinstance(runner, SplitGraphHook):  # pairs of graphs split at a dynamic DBCache decision
            data["graphs_captured"] = 2 * runner.captures
            data["graphs_kept"] = 2 * len(runner.captured)
            data["graph_replays"] = sum(e.replays for e in runner.captured.values())
            data["decision_reads"], data["head_switches"] = runner.reads, runner.switches
            rows += [["transformer graphs captured", f"{data['graphs_captured']} (head + tail per decision)"],
                     ["graphs kept", data["graphs_kept"]], ["graph replays (kept graphs)", data["graph_replays"]],
                     ["decision statistic host reads", runner.reads],
                     ["heads replayed twice (decision changed)", runner.switches]]
        if runner is not None:
            data["graph_invalidations"] = len(getattr(runner, "invalidations", ()))
            data["eager_calls"] = runner.eager_calls
            rows += [["graphs dropped (model changed)", data["graph_invalidations"]],
                     ["calls run eagerly (first-call check)", runner.eager_calls]]
        return FeatureSummary(name=NAME, data=data, text=table(["setting", "value"], rows),
                              brief=table(["setting", "value"], rows, width=SUMMARY_WIDTH))


@attrs.define
class CompileState:
    """What one handle's compilation keeps: the whole-transformer graph runner, the graph passes its compiles share
    (`shared_pass`: the same objects for every enable of one configuration) and where their per-graph counts stood
    when this handle took them, so that its summary counts its own compiles only."""

    runner: GraphRunner | SplitGraphHook | None = None
    fp8_rows: Any | None = None
    real_rope: Any | None = None
    norm_rope: Any | None = None
    #: each pass's number of counted graphs when this handle took it, by the field's name
    first_graph: dict[str, int] = attrs.field(factory=dict)

    def take(self, name: str, graph_pass: Any) -> None:
        """Keep `graph_pass` as field `name`, counting its graphs from now on."""
        setattr(self, name, graph_pass)
        self.first_graph[name] = len(graph_pass.per_graph)

    def per_graph(self, name: str, counts: str = "per_graph") -> list[int]:
        """The pass's per-graph `counts` (a list it appends one entry to per graph) since this handle took it."""
        return list(getattr(getattr(self, name), counts)[self.first_graph[name]:])


#: The graph passes of every compile configuration so far, by `_pass_key`, reused by each later enable of it. Dynamo
#: keeps a compiled block for a backend equal to the one that compiled it, and inductor's backends are equal when their
#: options are, pass objects compared by identity: with new passes at each enable, every enable recompiled every block
#: until torch's recompile limit (8 per code object) failed the 8th enable, and every later compile of the class.
_SHARED_PASSES: dict[Hashable, Any] = {}


def _pass_key(graph_pass: Any) -> Hashable:
    """What makes two of hookkit's passes rewrite alike: their class, settings and the pass chained after them (one
    that is not hookkit's by identity: the kept pass holds it, so its id cannot pass to another object)."""
    from hookkit.techniques.compile.graph_pass import CountingPass

    then = graph_pass.then
    return type(graph_pass), graph_pass.settings(), _pass_key(then) if isinstance(then, CountingPass) else id(then)


def shared_pass(graph_pass: Any) -> Any:
    """`graph_pass`, or the pass an earlier enable made with the same key (then `graph_pass` is dropped): one set of
    pass objects, hence one backend, per compile configuration, so that enabling again reuses the compiled blocks."""
    return _SHARED_PASSES.setdefault(_pass_key(graph_pass), graph_pass)


def new_fp8_rows_pass(fast: bool = False) -> Any:
    """A `FusedFp8Rows` pass chained before any `post_grad_custom_post_pass` already set process-wide (hookkit's
    per-call options replace that setting for its own compiles)."""
    import torch._inductor.config as inductor_config

    from hookkit.techniques.compile.fp8_rows import FusedFp8Rows  # imports inductor: only quantized compiles

    return FusedFp8Rows(fast=fast, layer_norm=fast and ADALN_ROWS, share=ADALN_ROWS,
                        then=inductor_config.post_grad_custom_post_pass)


#: On by default: with `fuse_fp8_rows="fast"`, Linears that quantize the same input share one
#: quantization and AdaLN inputs (`layer_norm(h) * (1 + scale) + shift`) are quantized in one pass by hookkit's kernel
#: (rounding to bf16 where eager rounds: its GPU tests pass, and the trained tiny Flux compiled with it
#: keeps 43.1 dB against bf16, BENCHMARKS.md). A module switch, not a `Compile` field: benchmarks turn it off
#: (`step_profile.py`'s `+noadaln`) to measure it against inductor's own quantization.
ADALN_ROWS = True


def new_real_rope_pass(then: Any | None = None) -> Any:
    """A `RealComplexMul` pass chained before `then` (the norm-rope pass, which needs the complex rotations written as
    real arithmetic) or else before any `post_grad_custom_pre_pass` already set process-wide."""
    import torch._inductor.config as inductor_config

    from hookkit.techniques.compile.real_rope import RealComplexMul

    return RealComplexMul(then=then if then is not None else inductor_config.post_grad_custom_pre_pass)


def new_norm_rope_pass() -> Any:
    """A `FusedNormRope` pass chained before any `post_grad_custom_pre_pass` already set process-wide."""
    import torch._inductor.config as inductor_config

    from hookkit.techniques.compile.norm_rope import FusedNormRope

    return FusedNormRope(then=inductor_config.post_grad_custom_pre_pass)


class _InnerCompile(Removal):
    """Installs `torch.compile(original forward)` as a module's inner callable; removal restores it."""

    def __init__(self, module: torch.nn.Module, kwargs: dict[str, Any]) -> None:
        # Compile before `HookRegistry.of` creates a registry: if torch.compile raises, the module's
        # `__dict__` is untouched (enable's rollback never sees this attachment).
        existing = HookRegistry.of(module, create=False)
        compiled = torch.compile(existing.original_forward if existing is not None else module.forward, **kwargs)
        HookRegistry.of(module).set_inner(compiled)
        self.module: torch.nn.Module | None = module

    def _undo(self) -> None:
        registry = HookRegistry.of(self.module, create=False)
        if registry is not None:
            registry.set_inner(None)
        self.module = None


FEATURE = _CompileFeature()
