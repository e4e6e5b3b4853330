"""Whole-transformer CUDA graphs split at a dynamic DBCache decision (`SplitDecisions`: the cache with a
threshold): each call is a head graph ending with the decision statistic, one host read, and the computed or the
cached tail graph (`SplitGraphHook`), so that a threshold still decides every step under CUDA graphs."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import attrs
import torch
import torch.utils._pytree as pytree

from hookkit.core.graphs import EagerCalls
from hookkit.core.registry import ModelHook
from hookkit.errors import HookError
from hookkit.techniques.compile.cuda_graphs import (
    _GraphPool,
    check_on_cuda,
    release_pool_if_empty,
    signature,
    uncapturable,
    warm_on_side_stream,
)
from hookkit.techniques.compile.model_watch import ModelWatch
from hookkit.techniques.compile.regional import _clone_tensors


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
    `require_cuda` and `device_check`: as `GraphHook`'s.
    """

    replaces_forward = True

    def __init__(self, backend: Any, cache: Any, require_cuda: bool = False, eager: EagerCalls | None = None,
                 device_check: Callable[[torch.nn.Module], None] | None = None) -> None:
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
        self.device_check = (device_check or check_on_cuda) if require_cuda else None
        #: what the pairs captured besides their inputs (see `ModelWatch`); why they were dropped
        self.watch = ModelWatch()
        self.invalidations: list[str] = []

    def new_forward(self, module: torch.nn.Module, call_next: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        if self.eager is not None and self.eager.eager():
            return self._eager_call(module, call_next, args, kwargs)
        reason = self.watch.check(module)
        if reason is not None:  # the model changed since capture: every pair is captured anew, as a fresh enable would
            if self.device_check is not None:
                self.device_check(module)
            if self.captured:
                self.captured.clear()
                self.invalidations.append(reason)
        pairs = len(self.captured)
        try:
            output = self._call(module, call_next, args, kwargs)
        except RuntimeError as error:
            refused = uncapturable(error, module)  # what `GraphHook` raises for a forward no graph can hold
            if refused is None:
                raise
            raise refused from error
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
            try:
                pair = self.captured[(sig, branch, cached)] = self._capture(call_next, leaves, spec, branch, cached)
            except BaseException:
                if hasattr(self.backend, "release_pool"):
                    self.backend.release_pool()  # nothing is captured into a failed capture's pool again
                raise
            self.captures += 1
        self._load(pair, leaves)
        if head:
            pair.head()
        return pair

    def _eager_call(self, module: torch.nn.Module, call_next: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """One call as eager mode runs it (the hooks decide, the statistic read eagerly); the cache then keeps what
        a pair-served call leaves for the next ones (the reference of the statistic among it)."""
        if self.device_check is not None:
            self.device_check(module)
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
