"""A transformer whose forward no CUDA graph can hold, under `Compile(cuda_graphs="transformer")`.

HunyuanVideo 1.5's forward branches in Python on `torch.all(image_embeds == 0)`: a host sync, which stream capture
refuses. Its adapter declares it (`host_syncs`), so enable refuses whole-transformer graphs up front; without the
declaration (how these tests check it is true) hookkit turns the capture's failure into an `UnsupportedError` that
names the transformer, the line of the model that did it and the fix; nothing of the failed capture is kept, a next
call is refused alike, and removal restores the model.

CUDA capture is GPU-only, so the CPU tests use stand-ins for the capture backend that raise torch's own errors where
the GPU raises them: a host read of a tensor's value (aten's `_local_scalar_dense`: `bool()`, `.item()`) inside the
capture raises torch's stream-capture error, and the capture's end raises again while it is handled, as
`torch.cuda.graph` does. The `gpu` tests at the end run the real thing.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hookkit
from hookkit.core.registry import HookRegistry
from hookkit.errors import UnsupportedError
from hookkit.techniques.compile.cuda_graphs import GraphHook, GraphRunner
from hookkit.techniques.compile.hooks import GRAPH
from hookkit.tools import zoo

#: torch's error at a host sync in sync debug mode "error" (`torch.cuda.set_sync_debug_mode("error")`)
SYNC_ERROR = "called a synchronizing CUDA operation"
#: torch's errors when a stream capture meets a host sync: the operation's, then the capture end's
CAPTURE_UNSUPPORTED = ("CUDA error: operation not permitted when stream is capturing\n"
                       "Search for `cudaErrorStreamCaptureUnsupported' in "
                       "https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html for more information.")
CAPTURE_INVALIDATED = "CUDA error: operation failed due to a previous error during capture"
FIX = ("No graph was kept. Use Compile(cuda_graphs='none'): the blocks are still compiled regionally and the forward "
       "between them runs eagerly.")


class HostReadsRaise(TorchDispatchMode):
    """Raises `RuntimeError(text)` at every read of a tensor's value by the host (aten's `_local_scalar_dense`, which
    `bool()`, `.item()`, `int()` and `float()` reach and which on a CUDA tensor waits for the GPU): on the CPU, what
    such a read does inside a stream capture, or anywhere in sync debug mode "error"."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text
        self.raised = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (torch's signature)
        if func is torch.ops.aten._local_scalar_dense.default:
            self.raised = True
            raise RuntimeError(self.text)
        return func(*args, **(kwargs or {}))


class StandInBackend:
    """`CudaGraphBackend` on the CPU: two warm-up calls, then the capture runs the call once more with host reads
    raising torch's stream-capture error, and raises torch's second error while that one is handled (as
    `torch.cuda.graph`'s end does); a replay re-runs the call into the same output memory. `sync_debug_mode_error`:
    the process is in sync debug mode "error", so the warm-up's host reads raise torch's sync error first. `events`
    records captures and pool releases in order."""

    def __init__(self, sync_debug_mode_error: bool = False) -> None:
        self.warm_up_mode = HostReadsRaise(SYNC_ERROR) if sync_debug_mode_error else None
        self.events: list[str] = []

    def release_pool(self) -> None:
        self.events.append("release")

    def capture(self, fn: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
        self.events.append("capture")
        for _ in range(2):
            if self.warm_up_mode is not None:
                with self.warm_up_mode:
                    fn()
            else:
                fn()
        try:
            with HostReadsRaise(CAPTURE_UNSUPPORTED):
                output = fn()
        except RuntimeError:
            raise RuntimeError(CAPTURE_INVALIDATED)  # noqa: B904 (the capture's end, raising inside the handling)

        def replay() -> None:
            for static, new in zip(torch.utils._pytree.tree_leaves(output), torch.utils._pytree.tree_leaves(fn())):
                static.copy_(new)

        return replay, output


class BranchesOnAValue(torch.nn.Module):
    """A transformer-like module whose forward branches in Python on a tensor's value, as HunyuanVideo 1.5's does."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, image_embeds: torch.Tensor) -> torch.Tensor:
        if torch.all(image_embeds == 0):
            x = x * 0.5
        return self.proj(x)


def line_of(function: Callable[..., Any], code: str) -> int:
    """The line number in its file of the line of `function` that reads `code`."""
    lines, first = inspect.getsourcelines(function)
    return first + [line.strip() for line in lines].index(code)


def graphed(module: torch.nn.Module, backend: StandInBackend) -> GraphRunner:
    """`module` with a `GraphHook` on the stand-in backend (as `Compile(cuda_graphs="transformer")` attaches it)."""
    runner = GraphRunner(backend)
    HookRegistry.of(module).register(GRAPH, GraphHook(runner))
    return runner


def refusal_of(module: torch.nn.Module, *args: Any) -> UnsupportedError:
    with pytest.raises(UnsupportedError) as err:
        module(*args)
    return err.value


# --- what the error says ---------------------------------------------------------------------------------------


def test_a_host_sync_in_the_forward_is_refused_naming_the_transformer_the_line_and_the_fix() -> None:
    module = BranchesOnAValue()
    graphed(module, StandInBackend())
    error = refusal_of(module, torch.ones(2, 4), torch.zeros(2, 4))
    where = f"{os.path.basename(__file__)}:{line_of(BranchesOnAValue.forward, 'if torch.all(image_embeds == 0):')}"
    assert str(error) == (
        "Compile.cuda_graphs='transformer': expected the forward of BranchesOnAValue (the transformer) to run on the "
        "device alone, so that one CUDA graph can hold the whole call, got an operation that stream capture refuses at "
        f"{where} in forward: if torch.all(image_embeds == 0):, most often a host synchronization (a Python branch on "
        "a device tensor, .item(), .cpu(), .tolist(), nonzero, torch.cuda.synchronize(), a pageable host copy; torch: "
        f"'CUDA error: operation not permitted when stream is capturing'). {FIX}")


def test_the_refusal_keeps_torchs_errors_as_its_cause() -> None:
    module = BranchesOnAValue()
    graphed(module, StandInBackend())
    error = refusal_of(module, torch.ones(2, 4), torch.zeros(2, 4))
    assert str(error.__cause__) == CAPTURE_INVALIDATED  # the capture end's error, raised while handling the first
    assert str(error.__cause__.__context__) == CAPTURE_UNSUPPORTED


def test_a_host_sync_raised_by_sync_debug_mode_error_is_named_a_host_synchronization() -> None:
    module = BranchesOnAValue()
    graphed(module, StandInBackend(sync_debug_mode_error=True))
    error = refusal_of(module, torch.ones(2, 4), torch.zeros(2, 4))
    where = f"{os.path.basename(__file__)}:{line_of(BranchesOnAValue.forward, 'if torch.all(image_embeds == 0):')}"
    assert str(error) == (
        "Compile.cuda_graphs='transformer': expected the forward of BranchesOnAValue (the transformer) to run on the "
        "device alone, so that one CUDA graph can hold the whole call, got a host synchronization at "
        f"{where} in forward: if torch.all(image_embeds == 0): (a Python branch on a device tensor, .item(), .cpu(), "
        f".tolist() and nonzero wait for the GPU, which no graph can record). {FIX}")


def test_an_error_of_the_forward_that_is_no_capture_refusal_is_raised_as_it_is() -> None:
    class ShapeError(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ torch.ones(3, 3)

    module = ShapeError()
    graphed(module, StandInBackend())
    with pytest.raises(RuntimeError) as err:
        module(torch.ones(2, 4))
    assert type(err.value) is RuntimeError and str(err.value).startswith("mat1 and mat2 shapes cannot be multiplied")


# --- what a failed capture leaves --------------------------------------------------------------------------------


def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def branch(x: torch.Tensor) -> torch.Tensor:
    return x * 2 if bool(x.sum() > 0) else x


def test_a_failed_capture_keeps_no_graph_and_the_next_capture_starts_a_new_pool_beside_the_kept_graphs() -> None:
    # a failed capture may leave torch's allocator recording into its pool ("already recording to mempool_id" at the
    # next capture into it, torch < 2.12): the graphs kept hold the old pool, new captures start another
    backend = StandInBackend()
    runner = GraphRunner(backend)
    runner(double, (torch.ones(2),), {})
    with pytest.raises(RuntimeError, match=CAPTURE_INVALIDATED):
        runner(branch, (torch.ones(3),), {})
    assert torch.equal(runner(double, (torch.full((2,), 3.0),), {}), torch.full((2,), 6.0))  # the kept graph replays
    runner(double, (torch.ones(4),), {})
    assert backend.events == ["release", "capture", "capture", "release", "capture"]
    assert runner.captures == 2 and len(runner.captured) == 2


def test_a_second_call_after_a_refusal_is_refused_alike_and_captures_nothing() -> None:
    module = BranchesOnAValue()
    runner = graphed(module, StandInBackend())
    first = refusal_of(module, torch.ones(2, 4), torch.zeros(2, 4))
    second = refusal_of(module, torch.ones(2, 4), torch.zeros(2, 4))
    assert str(second) == str(first)
    assert (runner.captures, len(runner.captured)) == (0, 0)


# --- HunyuanVideo 1.5 through the feature (the stand-in backend) ---------------------------------------------------

#: whole-transformer graphs as on the GPU; fullgraph=False only because Dynamo does not trace under the stand-in's
#: TorchDispatchMode (it runs those frames eagerly; a CUDA stream capture records the compiled kernels instead)
CPU_GRAPHS = hookkit.Compile(cuda_graphs="transformer", backend="eager", fullgraph=False)


@pytest.fixture
def graph_stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """`Compile(cuda_graphs="transformer")` on the CPU: the real feature and hooks, `StandInBackend` for capture, the
    CUDA-device check off."""
    from hookkit.techniques.compile import hooks

    monkeypatch.setattr(hooks, "CudaGraphBackend", StandInBackend)
    monkeypatch.setattr(hooks, "check_on_cuda", lambda transformer: None)


def undeclared() -> Any:
    """HunyuanVideo 1.5's adapter without its `host_syncs`, which refuse whole-transformer graphs at enable: so the
    capture itself meets them (the check that what the adapter declares is what the model does)."""
    import attrs

    from hookkit.adapters import get_adapter

    return attrs.evolve(get_adapter("hunyuanvideo15"), host_syncs=())


def test_hunyuanvideo15_with_whole_transformer_graphs_is_refused_at_enable_naming_its_host_syncs() -> None:
    with pytest.raises(hookkit.errors.SpecError) as err:
        hookkit.enable(zoo.tiny_pipeline("hunyuanvideo15"), hookkit.Spec(compile=CPU_GRAPHS))
    assert str(err.value) == (
        "Compile.cuda_graphs: expected 'none' on 'hunyuanvideo15', whose forward waits for the host outside its blocks "
        "(a Python branch on torch.all(image_embeds == 0) (`if is_t2v:`); boolean-mask indexing that moves the valid "
        "text and image tokens first (`image[image_mask]`, ...)): no CUDA graph can capture that; got 'transformer'. "
        "Use Compile(cuda_graphs='none'): its blocks are still compiled regionally.")


def hunyuanvideo15_refusal(pipe: Any) -> UnsupportedError:
    with pytest.raises(UnsupportedError) as err:
        pipe(**zoo.call_kwargs("hunyuanvideo15", steps=2))
    return err.value


def test_hunyuanvideo15_is_refused_at_its_host_sync(graph_stand_in: None) -> None:
    from diffusers.models.transformers import transformer_hunyuan_video15 as model_file

    pipe = zoo.tiny_pipeline("hunyuanvideo15")
    hookkit.enable(pipe, hookkit.Spec(compile=CPU_GRAPHS), adapter=undeclared())
    error = hunyuanvideo15_refusal(pipe)
    line = line_of(model_file.HunyuanVideo15Transformer3DModel.forward, "if is_t2v:")
    where = f"transformer_hunyuan_video15.py:{line}"
    assert str(error).startswith(
        "Compile.cuda_graphs='transformer': expected the forward of HunyuanVideo15Transformer3DModel (the transformer) "
        "to run on the device alone, so that one CUDA graph can hold the whole call, got an operation that stream "
        f"capture refuses at {where} in forward: if is_t2v:, most often a host synchronization (")


def test_hunyuanvideo15_after_the_refusal_keeps_no_graph_and_is_refused_again(graph_stand_in: None) -> None:
    pipe = zoo.tiny_pipeline("hunyuanvideo15")
    handle = hookkit.enable(pipe, hookkit.Spec(compile=CPU_GRAPHS), adapter=undeclared())
    first = hunyuanvideo15_refusal(pipe)
    assert str(hunyuanvideo15_refusal(pipe)) == str(first)
    data = handle.summary().features["compile"].data
    assert (data["graphs_captured"], data["graphs_kept"], data["eager_calls"]) == (0, 0, 1)


def test_hunyuanvideo15_after_the_refusal_is_restored_exactly_by_remove(graph_stand_in: None) -> None:
    pipe = zoo.tiny_pipeline("hunyuanvideo15")
    reference = pipe(**zoo.call_kwargs("hunyuanvideo15", steps=2)).frames
    before = {path: set(m.__dict__) for path, m in pipe.transformer.named_modules()}
    handle = hookkit.enable(pipe, hookkit.Spec(compile=CPU_GRAPHS), adapter=undeclared())
    hunyuanvideo15_refusal(pipe)
    handle.remove()
    assert {path: set(m.__dict__) for path, m in pipe.transformer.named_modules()} == before
    assert torch.equal(pipe(**zoo.call_kwargs("hunyuanvideo15", steps=2)).frames, reference)


class RefusingSegments:
    """`CudaGraphSegments` on the CPU for a capture that meets a host read: the read raises torch's stream-capture
    error, and the end of the capture (in the hook's `finally`) raises torch's second error."""

    def __init__(self) -> None:
        self.mode = HostReadsRaise(CAPTURE_UNSUPPORTED)

    def begin(self) -> None:
        self.mode.__enter__()

    def cut(self) -> None:
        pass

    def end(self) -> list[Callable[[], None]]:
        self.mode.__exit__(None, None, None)
        if not self.mode.raised:
            raise AssertionError("RefusingSegments stands in for captures that meet a host read; this one met none")
        raise RuntimeError(CAPTURE_INVALIDATED)


class SplitStandInBackend:
    """`CudaSegmentBackend` on the CPU (graphs split at a DBCache threshold's decision), whose captures are refused."""

    def warm(self, fn: Callable[[], Any]) -> None:
        fn()

    def segments(self) -> RefusingSegments:
        return RefusingSegments()


def test_hunyuanvideo15_under_graphs_split_at_a_dbcache_threshold_is_refused_alike(
        graph_stand_in: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from hookkit.techniques.compile import hooks

    monkeypatch.setattr(hooks, "CudaSegmentBackend", SplitStandInBackend)
    pipe = zoo.tiny_pipeline("hunyuanvideo15")
    handle = hookkit.enable(pipe, hookkit.Spec(cache=hookkit.DBCache(threshold=0.1, taylorseer_order=0),
                                               compile=CPU_GRAPHS), adapter=undeclared())
    error = hunyuanvideo15_refusal(pipe)
    assert "HunyuanVideo15Transformer3DModel (the transformer)" in str(error)
    assert "got an operation that stream capture refuses at transformer_hunyuan_video15.py:" in str(error)
    data = handle.summary().features["compile"].data
    assert (data["graphs_captured"], data["decision_reads"]) == (0, 0)  # split graphs' counters: none captured


# --- on a GPU ------------------------------------------------------------------------------------------------------
# Each runs in a fresh Python (`in_own_process`): a refused capture can leave torch's caching allocator recording into
# the failed capture's pool (torch before 2.12), which must not reach the GPU tests that run after it in one process.


def in_own_process(body: Callable[[], None]) -> None:
    """Run `body`, a function of this file, in a fresh Python; fail with its stderr."""
    here = Path(__file__).resolve()
    script = f"import sys; sys.path.insert(0, {str(here.parent)!r}); import {here.stem} as t; t.{body.__name__}()"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          cwd=here.parents[1])
    assert done.returncode == 0, done.stderr[-3000:]


def cuda_refusal(module: torch.nn.Module, backend: Any) -> UnsupportedError:
    HookRegistry.of(module).register(GRAPH, GraphHook(GraphRunner(backend)))
    return refusal_of(module, torch.ones(2, 4, device="cuda"), torch.zeros(2, 4, device="cuda"))


def _gpu_a_host_sync_in_the_capture_is_refused_naming_its_line() -> None:
    from hookkit.techniques.compile.cuda_graphs import CudaGraphBackend

    error = cuda_refusal(BranchesOnAValue().cuda(), CudaGraphBackend())
    line = line_of(BranchesOnAValue.forward, "if torch.all(image_embeds == 0):")
    assert (f"got an operation that stream capture refuses at {os.path.basename(__file__)}:{line} in forward: "
            "if torch.all(image_embeds == 0):, most often a host synchronization") in str(error)
    assert "torch: 'CUDA error: operation not permitted when stream is capturing'" in str(error)


def _gpu_a_refused_capture_leaves_the_callers_stream_current() -> None:
    # torch.cuda.graph leaves its capture stream current when the capture's end raises
    from hookkit.techniques.compile.cuda_graphs import CudaGraphBackend

    cuda_refusal(BranchesOnAValue().cuda(), CudaGraphBackend())
    assert torch.cuda.current_stream() == torch.cuda.default_stream()


def _gpu_after_a_refused_capture_the_kept_graph_and_a_new_capture_replay_right() -> None:
    # the next capture starts a new pool: torch < 2.12 may still be recording into the refused capture's pool
    from hookkit.techniques.compile.cuda_graphs import CudaGraphBackend

    runner = GraphRunner(CudaGraphBackend())
    plain = torch.nn.Linear(4, 4).cuda()
    runner(plain, (torch.zeros(2, 4, device="cuda"),), {})
    with pytest.raises(RuntimeError, match="error during capture|when stream is capturing"):
        runner(BranchesOnAValue().cuda(), (torch.ones(1, 4, device="cuda"), torch.zeros(1, 4, device="cuda")), {})
    runner(plain, (torch.zeros(3, 4, device="cuda"),), {})
    for rows in (2, 3):
        x = torch.randn(rows, 4, device="cuda")
        torch.testing.assert_close(runner(plain, (x,), {}), plain(x))
    assert (runner.captures, len(runner.captured)) == (2, 2)


def _gpu_hunyuanvideo15_is_refused_at_its_host_sync_and_runs_after_remove() -> None:
    from diffusers.models.transformers import transformer_hunyuan_video15 as model_file

    def call(pipe: Any) -> torch.Tensor:
        kwargs = {k: v.to("cuda", torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v
                  for k, v in zoo.call_kwargs("hunyuanvideo15", steps=2).items()}
        return pipe(**kwargs).frames

    pipe = zoo.tiny_pipeline("hunyuanvideo15").to("cuda", torch.bfloat16)
    reference = call(pipe)
    handle = hookkit.enable(pipe, hookkit.Spec(compile=hookkit.Compile(cuda_graphs="transformer", backend="eager")),
                            adapter=undeclared())
    with pytest.raises(UnsupportedError) as err:
        call(pipe)
    line = line_of(model_file.HunyuanVideo15Transformer3DModel.forward, "if is_t2v:")
    where = f"transformer_hunyuan_video15.py:{line} in forward: if is_t2v:"
    assert f"got an operation that stream capture refuses at {where}, most often a host" in str(err.value)
    handle.remove()
    assert torch.equal(call(pipe), reference)



@pytest.mark.gpu
@pytest.mark.parametrize("body", [
    _gpu_a_host_sync_in_the_capture_is_refused_naming_its_line,
    _gpu_a_refused_capture_leaves_the_callers_stream_current,
    _gpu_after_a_refused_capture_the_kept_graph_and_a_new_capture_replay_right,
    _gpu_hunyuanvideo15_is_refused_at_its_host_sync_and_runs_after_remove,
], ids=lambda body: body.__name__.removeprefix("_gpu_"))
def test_gpu_refused_captures_each_in_its_own_process(body: Callable[[], None]) -> None:
    in_own_process(body)
