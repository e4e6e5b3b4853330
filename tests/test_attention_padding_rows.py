"""HunyuanVideo 1.5's padding mask reaches hookkit's kernels as its validity row (`outer_masks`), eagerly and under
regional compile, with the same output; and the kernel under that row gives what it gives under the full mask.

On the CPU hookkit's fp8 kernel runs only in Triton's interpreter, so the pipeline tests answer its op with a stand-in
(torch's SDPA math, recording the mask it is given) and let the kernel take the CPU's float32 calls; the kernel's own
arithmetic under the row is checked in the interpreter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import hookkit
from hookkit.tools import zoo

FP8_EVERY_STEP = hookkit.Attention(low_precision="hookkit_fp8", full_first=0, full_last=0)
#: the tiny HunyuanVideo 1.5's self-attention: its video, text and image tokens
TOKENS = 773


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """hookkit_fp8's op answered by SDPA's math on the CPU; the masks' shapes it is given, in order."""
    from hookkit.techniques.attention import hooks

    shapes: list[tuple[int, ...]] = []

    def op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None = None,
           mask: torch.Tensor | None = None) -> torch.Tensor:
        if not torch.compiler.is_compiling():  # (a list append in a trace would be guarded on: a recompile a call)
            shapes.append(tuple(mask.shape) if mask is not None else ())
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)

    real = hooks.unsupported

    def unsupported(kernel: str, a: dict[str, Any]) -> str | None:
        reason = real(kernel, a)  # the CPU's and float32's refusals lifted: the stand-in takes them
        return None if reason in ("not on CUDA", "dtype torch.float32") else reason

    monkeypatch.setattr(hooks, "fp8_attention", op)
    monkeypatch.setattr(hooks, "unsupported", unsupported)
    monkeypatch.setattr(hooks, "check_kernels", lambda *args, **kwargs: None)
    return shapes


def tiny() -> Any:
    """The tiny HunyuanVideo 1.5 pipeline with heads of 32, a size hookkit's fp8 kernel takes."""
    return zoo.tiny_pipeline("hunyuanvideo15", attention_head_dim=32, rope_axes_dim=(8, 12, 12))


def run(pipe: Any) -> torch.Tensor:
    return pipe(**zoo.call_kwargs("hunyuanvideo15", steps=1)).frames


def test_the_padding_mask_reaches_the_kernel_as_its_validity_row(stand_in: list[tuple[int, ...]]) -> None:
    expected = run(tiny())
    pipe = tiny()
    handle = hookkit.enable(pipe, hookkit.Spec(attention=FP8_EVERY_STEP))
    out = run(pipe)
    # 2 blocks x 2 CFG branches, each given the [B, 1, 1, S] row, not the [B, 1, S, S] mask
    assert stand_in == [(1, 1, 1, TOKENS)] * 4
    assert handle.summary().features["attention"].data["padding_masks_as_rows"] == {
        "calls": {"middle/hookkit_fp8": 4}, "compiled_call_sites": {}}
    # the padding queries' rows are set to 0 after the kernel, as SDPA's math gives a row with no allowed key
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)


def test_without_the_row_the_same_calls_take_the_full_mask(stand_in: list[tuple[int, ...]],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from hookkit.techniques.attention.outer_masks import OuterMasks

    monkeypatch.setattr(OuterMasks, "take", lambda self, mask, query, key: None)
    pipe = tiny()
    handle = hookkit.enable(pipe, hookkit.Spec(attention=FP8_EVERY_STEP))
    run(pipe)
    assert stand_in == [(1, 1, TOKENS, TOKENS)] * 4
    assert handle.summary().features["attention"].data["padding_masks_as_rows"]["calls"] == {}


def test_under_regional_compile_the_row_is_traced_without_graph_breaks_or_recompiles(
        stand_in: list[tuple[int, ...]]) -> None:
    expected = run(tiny())
    pipe = tiny()
    handle = hookkit.enable(pipe, hookkit.Spec(attention=FP8_EVERY_STEP, compile=hookkit.Compile(backend="eager")))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    out = run(pipe)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    run(pipe)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    assert dict(torch._dynamo.utils.counters["graph_break"]) == {}
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # the second call traced nothing new
    data = handle.summary().features["attention"].data
    assert data["compiled_call_sites"] == {"hookkit_fp8": 1}
    assert data["padding_masks_as_rows"] == {"calls": {}, "compiled_call_sites": {"hookkit_fp8": 1}}


def test_a_block_that_raises_leaves_no_mask_held(stand_in: list[tuple[int, ...]],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from hookkit.core.registry import HookRegistry
    from hookkit.techniques.attention import hooks

    def failing(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError("kernel failed")

    monkeypatch.setattr(hooks, "run_with_validity_row", failing)
    pipe = tiny()
    hookkit.enable(pipe, hookkit.Spec(attention=FP8_EVERY_STEP))
    with pytest.raises(RuntimeError, match="kernel failed"):
        run(pipe)
    hook = HookRegistry.of(pipe.transformer.transformer_blocks[0]).get(hooks.BLOCK_HOOK)
    masks = hook.shared.modes["hookkit_fp8"].masks
    assert (masks.row, masks.rows, masks.cols, masks.mask) == (None, None, None, None)


ROW_INTERPRETED = """
import json
import torch
from hookkit.techniques.attention import fp8_triton, hooks

g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(2, 1, 80, 32, generator=g).to(torch.bfloat16) for _ in range(3))
valid = torch.arange(80)[None, :] < torch.tensor([[50], [70]])  # padding last, as HunyuanVideo 1.5's
row = valid.view(2, 1, 1, 80)
mask = row & row.transpose(2, 3)
a = {"query": q, "key": k, "value": v, "scale": None}
by_row = hooks.run_with_validity_row("hookkit_fp8", a, row).float()
by_mask = fp8_triton.attention(q, k, v, mask=mask).float()
mirror = fp8_triton.reference(q, k, v, mask=mask).float()
rows = valid[:, None, :, None].expand_as(by_row)
print(json.dumps({"off mirror": ((by_row - mirror)[rows].abs().max() / mirror.abs().max()).item(),
                  "off full mask": ((by_row - by_mask)[rows].abs().max() / by_mask.abs().max()).item(),
                  "padding rows": by_row[~rows].abs().max().item()}))
"""


def test_the_fp8_kernel_under_the_row_gives_the_full_masks_attention_in_tritons_interpreter(
        interpreted: Callable[[str], Any]) -> None:
    result = interpreted(ROW_INTERPRETED)
    # the same pairs: on the valid rows within the kernel's own bound of its mirror and of its full-mask call (a
    # query block holding padding rows visits its key blocks in another order), the padding rows exactly 0
    assert result["off mirror"] < 0.03 and result["off full mask"] < 0.03, result
    assert result["padding rows"] == 0.0
