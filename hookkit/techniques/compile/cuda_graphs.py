"""Whole-transformer CUDA graphs (`cuda_graphs="transformer"`, GPU only): blocks compiled regionally, then each
transformer call captured once per input signature with `torch.cuda.CUDAGraph` and replayed while the
signature holds (inputs copied into static buffers, outputs cloned out).

Hooks inside the transformer do not run on replay, so a feature that decides per call provides
`hookkit.core.graphs.GraphDecisions` (the cache with a static mask: the decision becomes part of the graph key).
Before every call `ModelWatch` compares what the graphs captured with the model now: on a change they are captured
anew; a model moved off CUDA is refused. The call the first-call check of the adapter observes runs eagerly
(`hookkit.core.graphs.EagerCalls`): captures start at the next call. A capture that fails because the forward does
what no graph can hold (a host sync) is refused with an `UnsupportedError` naming the line (`uncapturable`).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import traceback
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, ContextManager

import attrs
import torch
import torch.utils._pytree as pytree

from hookkit.core.graphs import EagerCalls, GraphDecisions
from hookkit.core.registry import ModelHook
from hookkit.errors import UnsupportedError
from hookkit.techniques.compile.model_watch import ModelWatch
from hookkit.techniques.compile.regional import _TORCH_DIR, _clone_tensors


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


#: the error torch raises where a CUDA operation waits for the host in sync debug mode "error"
#: (`torch.cuda.set_sync_debug_mode("error")`, set by the user: then the warm-up before a capture raises it)
SYNC_ERROR = "called a synchronizing CUDA operation"
#: what torch's and CUDA's errors say when stream capture refuses an operation (CUDA's `cudaErrorStreamCapture*` and
#: `cudaErrorCapturedEvent` texts, torch's own "... during CUDA graph capture" checks)
CAPTURE_REFUSALS = (
    "when stream is capturing",  # cudaErrorStreamCaptureUnsupported: a sync, a pageable copy, a blocking call
    "error during capture",  # cudaErrorStreamCaptureInvalidated: what capture_end says after such an error
    "in a capturing stream",  # cudaErrorCapturedEvent
    "capturing blocking stream",  # cudaErrorStreamCaptureImplicit
    "cudaErrorStreamCapture",  # the enum name torch appends ("Search for `cudaErrorStreamCapture...'")
    "during CUDA graph capture",  # torch: "... during CUDA graph capture. If you need this call to be captured ..."
)
_HOOKKIT_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep
_MODE_FRAMES = frozenset({"__torch_function__", "__torch_dispatch__"})


def warm_on_side_stream(fn: Callable[[], Any], times: int) -> None:
    """Run `fn` `times` times on a side stream, as torch's CUDA-graph recipe asks before a capture (lazy
    initialisation and autotuning happen outside the graph), then make the current stream wait for it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(times):
            fn()
    torch.cuda.current_stream().wait_stream(stream)


def _refusal(error: BaseException) -> BaseException | None:
    """The first-raised error of `error`'s chain (its causes and contexts) that says capture refused an operation:
    where it happened is in its traceback (a failed capture raises again at its end, from inside torch)."""
    found, seen, current = None, set(), error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = str(current)
        if SYNC_ERROR in text or any(marker in text for marker in CAPTURE_REFUSALS):
            found = current
        current = current.__cause__ or current.__context__
    return found


def _model_frame(error: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of `error`'s traceback outside torch, hookkit and the pass-through of torch's modes
    (`__torch_function__`, `__torch_dispatch__`): the line of model or user code."""
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        path = os.path.abspath(frame.filename)
        if not path.startswith((_TORCH_DIR, _HOOKKIT_DIR)) and frame.name not in _MODE_FRAMES:
            return frame
    return None


def uncapturable(error: BaseException, module: torch.nn.Module) -> UnsupportedError | None:
    """The hookkit error for a capture of `module` that failed because its forward did something no CUDA graph can
    hold, or None when `error` is not that (it is then raised as it is)."""
    refusal = _refusal(error)
    if refusal is None:
        return None
    frame = _model_frame(refusal)
    where = (f"at {os.path.basename(frame.filename)}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"
             if frame is not None else "(no frame of the traceback is outside torch and hookkit)")
    if SYNC_ERROR in str(refusal):
        what = (f"a host synchronization {where} (a Python branch on a device tensor, .item(), .cpu(), .tolist() and "
                "nonzero wait for the GPU, which no graph can record)")
    else:
        torch_says = str(refusal).strip().splitlines()[0]
        what = (f"an operation that stream capture refuses {where}, most often a host synchronization (a Python branch "
                "on a device tensor, .item(), .cpu(), .tolist(), nonzero, torch.cuda.synchronize(), a pageable host "
                f"copy; torch: {torch_says!r})")
    return UnsupportedError(
        f"Compile.cuda_graphs='transformer': expected the forward of {type(module).__name__} (the transformer) to run "
        f"on the device alone, so that one CUDA graph can hold the whole call, got {what}. No graph was kept. Use "
        "Compile(cuda_graphs='none'): the blocks are still compiled regionally and the forward between them runs "
        "eagerly."
    )


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
        """Forget the pool once no captured graph holds it (after an invalidation or the last eviction), or after a
        failed capture.

        A pool whose graphs are all gone may still own blocks that live tensors hold; capturing into it again
        trips an internal assert of the CUDA caching allocator (`use_count > 0`), so the next capture starts a
        new pool and the old one is freed with its last block. A capture that failed may leave the allocator still
        recording into its pool (torch before 2.12 skips that bookkeeping when the capture's end raises), and the
        next capture into it would fail ("already recording to mempool_id"): the graphs kept hold the old pool."""
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
        stream = torch.cuda.current_stream()
        try:
            with torch.cuda.graph(graph, pool=pool):
                output = fn()
        finally:
            # when the capture's end raises, `torch.cuda.graph` leaves its capture stream current: every later kernel
            # would run there, and the caching allocator would hand its memory to the wrong stream
            torch.cuda.set_stream(stream)
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
            try:
                with capturing():
                    replay, output = self.backend.capture(lambda: fn(*static_args, **static_kwargs))
            except BaseException:
                if hasattr(self.backend, "release_pool"):
                    self.backend.release_pool()  # nothing is captured into a failed capture's pool again
                raise
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

    `require_cuda`: before the eager call and whenever the watch sees a change, check that the model is wholly on
    CUDA with `device_check` (default `check_on_cuda`; the feature passes the one it found when it attached, so
    that a CPU test's stand-in reaches the hooks it attaches).

    A capture that fails because the forward does what no graph can hold (a host sync: HunyuanVideo 1.5 branches
    on `torch.all(image_embeds == 0)`) raises `uncapturable`'s `UnsupportedError`, naming the line, instead of
    torch's error; the runner keeps nothing of it, and the watch stays as it was, so the next call tries again.
    """

    replaces_forward = True

    def __init__(self, runner: GraphRunner, cache: GraphDecisions | None = None, require_cuda: bool = False,
                 eager: EagerCalls | None = None,
                 device_check: Callable[[torch.nn.Module], None] | None = None) -> None:
        self.runner = runner
        self.cache = cache
        self.device_check = (device_check or check_on_cuda) if require_cuda else None
        self.eager = eager
        self.watch = ModelWatch()

    def new_forward(self, module: torch.nn.Module, call_next: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        if self.eager is not None and self.eager.eager():
            return self._eager_call(module, call_next, args, kwargs)
        reason = self.watch.check(module)
        if reason is not None:
            if self.device_check is not None:
                self.device_check(module)
            if self.runner.captured:
                self.runner.invalidate(reason)
        captured = len(self.runner.captured)
        try:
            output = self._run(call_next, args, kwargs)
        except RuntimeError as error:
            refused = uncapturable(error, module)
            if refused is None:
                raise
            raise refused from error
        if reason is not None or len(self.runner.captured) != captured:
            self.watch.arm(module)  # after a capture: what the capture itself did is part of what it captured
        return output

    def _run(self, call_next: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """The call from its graph (captured first when new), keyed and forced by the cache's decision if any."""
        if self.cache is None:
            return self.runner(call_next, args, kwargs)
        shapes = tuple(v.shape for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor))
        decision = self.cache.decision(shapes)
        output = self.runner(call_next, args, kwargs, extra_key=decision,
                             capturing=lambda: self.cache.forcing(decision))
        self.cache.replayed(decision, shapes)
        return output

    def _eager_call(self, module: torch.nn.Module, call_next: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """One call as eager mode runs it (the cache's hooks decide and record); the cache then keeps what a
        graph-served call leaves for the next ones."""
        if self.device_check is not None:
            self.device_check(module)
        self.runner.eager_calls += 1
        output = call_next(*args, **kwargs)
        if self.cache is not None:
            self.cache.adopted(tuple(v.shape for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)))
        return output
