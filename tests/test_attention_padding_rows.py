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
#: of which valid (the mask's row): the video and the prompt's text tokens; the 729 image tokens are padding
VALID = 44


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """hookkit's kernels' ops answered by SDPA's math on the CPU; what each call is given, in order: the mask's shape
    for a masked call, (kernel, counts) for a call that takes each batch element's first `counts` keys."""
    from hookkit.techniques.attention import hooks

    calls: list[Any] = []

    def stand_in_op(kernel: str) -> Callable[..., torch.Tensor]:
        def op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None = None,
               mask: torch.Tensor | None = None, key_counts: torch.Tensor | None = None) -> torch.Tensor:
            if key_counts is not None:
                mask = (torch.arange(key.shape[2])[None, :] < key_counts[:, None])[:, None, None, :]
            if not torch.compiler.is_compiling():  # (a list append in a trace would be guarded on: a recompile a call)
                calls.append((kernel, key_counts.tolist()) if key_counts is not None
                             else tuple(mask.shape) if mask is not None else ())
            return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)
        return op

    real = hooks.unsupported

    def unsupported(kernel: str, a: dict[str, Any]) -> str | None:
        reason = real(kernel, a)  # the CPU's and float32's refusals lifted: the stand-in takes them
        return None if reason in ("not on CUDA", "dtype torch.float32") else reason

    monkeypatch.setattr(hooks, "fp8_attention", stand_in_op("hookkit_fp8"))
    monkeypatch.setattr(hooks, "int8_attention", stand_in_op("hookkit_int8"))
    monkeypatch.setattr(hooks, "unsupported", unsupported)
    monkeypatch.setattr(hooks, "check_kernels", lambda *args, **kwargs: None)
    return calls


def tiny() -> Any:
    """The tiny HunyuanVideo 1.5 pipeline with heads of 32, a size hookkit's fp8 kernel takes."""
    return zoo.tiny_pipeline("hunyuanvideo15", attention_head_dim=32, rope_axes_dim=(8, 12, 12))


def run(pipe: Any) -> torch.Tensor:
    return pipe(**zoo.call_kwargs("hunyuanvideo15", steps=1)).frames


def test_the_padding_mask_reaches_the_kernel_as_its_validity_row(stand_in: list[Any]) -> None:
    expected = run(tiny())
    pipe = tiny()
    handle = hookkit.enable(pipe, hookkit.Spec(attention=FP8_EVERY_STEP))
    out = run(pipe)
    # 2 blocks x 2 CFG branches, each given its count of valid keys (the row's), not the [B, 1, S, S] mask
    assert stand_in == [("hookkit_fp8", [VALID])] * 4
    assert handle.summary().features["attention"].data["padding_masks_as_rows"] == {
        "calls": {"middle/hookkit_fp8": 4}, "compiled_call_sites": {}}
    # the padding queries' rows are set to 0 after the kernel, as SDPA's math gives a row with no allowed key
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)


def test_without_the_row_the_same_calls_take_the_full_mask(stand_in: list[Any],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from hookkit.techniques.attention.outer_masks import OuterMasks

    monkeypatch.setattr(OuterMasks, "take", lambda self, mask, query, key: None)
    pipe = tiny()
    handle = hookkit.enable(pipe, hookkit.Spec(attention=FP8_EVERY_STEP))
    run(pipe)
    assert stand_in == [(1, 1, TOKENS, TOKENS)] * 4
    assert handle.summary().features["attention"].data["padding_masks_as_rows"]["calls"] == {}


def test_under_regional_compile_the_row_is_traced_without_graph_breaks_or_recompiles(
        stand_in: list[Any]) -> None:
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


def test_a_block_that_raises_leaves_no_mask_held(stand_in: list[Any],
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
    # the same pairs: on the valid rows within the kernel's own bound of its mirror and of its full-mask call (another
    # launch: the unmasked kernel over the valid keys, on larger tiles), the padding rows exactly 0
    assert result["off mirror"] < 0.03 and result["off full mask"] < 0.03, result
    assert result["padding rows"] == 0.0


@pytest.mark.parametrize("kernel", ["hookkit_fp8", "hookkit_int8"])
def test_keys_valid_anywhere_are_taken_first_in_their_order_and_counted(stand_in: list[Any], kernel: str) -> None:
    """The row need not be a prefix: K and V are reordered so that each batch element's valid keys come first, and
    the op is given their count; the result is SDPA's under the outer-AND mask (padding rows 0)."""
    from hookkit.techniques.attention import hooks

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 10, 8, generator=g) for _ in range(3))
    valid = torch.tensor([[1, 0, 1, 1, 0, 0, 1, 0, 1, 1], [0, 0, 1, 1, 1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    row = valid.view(2, 1, 1, 10)
    out = hooks.run_with_validity_row(kernel, {"query": q, "key": k, "value": v, "scale": None}, row)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=row & row.transpose(2, 3))
    expected = expected.masked_fill(~row.transpose(2, 3), 0.0)  # SDPA's math gives NaN to a row with no key
    assert stand_in == [(kernel, [6, 7])]
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)


KEY_COUNTS_INTERPRETED = """
import json
import torch
import torch.nn.functional as F
from hookkit.techniques.attention import fp8_triton, hooks

g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(2, 2, 300, 32, generator=g).to(torch.bfloat16) for _ in range(3))
valid = torch.rand(2, 300, generator=g) < 0.6  # valid keys anywhere
valid[1] = torch.arange(300) < 129  # a prefix one key past a 128-key block
row = valid.view(2, 1, 1, 300)
a = {"query": q, "key": k, "value": v, "scale": None}
out = hooks.run_with_validity_row("hookkit_fp8", a, row).float()
order = torch.argsort((~valid).to(torch.uint8), dim=1, stable=True)[:, None, :, None].expand_as(k)
first = (torch.arange(300)[None, :] < valid.sum(dim=1)[:, None]).view(2, 1, 1, 300)
mirror = fp8_triton.reference(q, k.gather(2, order), v.gather(2, order), mask=first, block_m=128,
                              block_n=128).float()
exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=row)
rows = valid[:, None, :, None].expand_as(out)
print(json.dumps({"counts": valid.sum(dim=1).tolist(),
                  "off mirror": ((out - mirror)[rows].abs().max() / mirror[rows].abs().max()).item(),
                  "mean rel": ((out - exact)[rows].abs().mean() / exact[rows].abs().mean()).item(),
                  "padding rows": out[~rows].abs().max().item()}))
"""


def test_the_fp8_kernel_over_the_valid_keys_computes_its_mirrors_arithmetic_in_tritons_interpreter(
        interpreted: Callable[[str], Any]) -> None:
    result = interpreted(KEY_COUNTS_INTERPRETED)
    assert result["counts"][1] == 129
    # the kernel's arithmetic on the reordered keys (the unmasked launch's 128 x 128 tiles, the loop ending at the
    # count): within its bounds of its mirror and of exact attention, as the unmasked kernel's; padding rows 0
    assert result["off mirror"] < 0.03 and result["mean rel"] < 0.05, result
    assert result["padding rows"] == 0.0


INT8_KEY_COUNTS_INTERPRETED = """
import json
import torch
import torch.nn.functional as F
from hookkit.techniques.attention import hooks, int8_triton

g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(2, 2, 300, 32, generator=g).to(torch.bfloat16) for _ in range(3))
valid = torch.rand(2, 300, generator=g) < 0.6  # valid keys anywhere
valid[1] = torch.arange(300) < 65  # a prefix one key past a 64-key block
row = valid.view(2, 1, 1, 300)
a = {"query": q, "key": k, "value": v, "scale": None}
out = hooks.run_with_validity_row("hookkit_int8", a, row).float()
order = torch.argsort((~valid).to(torch.uint8), dim=1, stable=True)[:, None, :, None].expand_as(k)
first = (torch.arange(300)[None, :] < valid.sum(dim=1)[:, None]).view(2, 1, 1, 300)
masked = int8_triton.attention(q, k.gather(2, order), v.gather(2, order), mask=first).float()
exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=row)
rows = valid[:, None, :, None].expand_as(out)
print(json.dumps({"counts": valid.sum(dim=1).tolist(),
                  "off masked kernel": (out - masked)[rows].abs().max().item(),
                  "mean rel": ((out - exact)[rows].abs().mean() / exact[rows].abs().mean()).item(),
                  "padding rows": out[~rows].abs().max().item()}))
"""


def test_the_int8_kernel_over_the_valid_keys_computes_its_masked_calls_arithmetic_in_tritons_interpreter(
        interpreted: Callable[[str], Any]) -> None:
    result = interpreted(INT8_KEY_COUNTS_INTERPRETED)
    assert result["counts"][1] == 65
    # the masked kernel's arithmetic under the count's mask, bitwise (the same quantization, and a prefix's key blocks
    # visited in the same order), within the int8 kernel's bound of exact attention (1.5 %); padding rows 0
    assert result["off masked kernel"] == 0.0 and result["mean rel"] < 0.015, result
    assert result["padding rows"] == 0.0


@pytest.mark.parametrize("module", ["fp8_triton", "int8_triton"])
@pytest.mark.parametrize("counts,mask", [(torch.tensor([3], dtype=torch.int64), None),
                                         (torch.tensor([3, 3], dtype=torch.int32), None),
                                         (torch.tensor([3], dtype=torch.int32), torch.ones(1, 1, 1, 8, dtype=torch.bool))])
def test_key_counts_other_than_one_int32_count_a_batch_element_without_a_mask_are_refused(
        module: str, counts: torch.Tensor, mask: torch.Tensor | None) -> None:
    kernels = pytest.importorskip(f"hookkit.techniques.attention.{module}")
    q = torch.zeros(1, 2, 8, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=rf"{module}.attention: key_counts takes no mask and an int32 tensor of "
                                         r"shape \(1,\) on cpu"):
        kernels.attention(q, q, q, mask=mask, key_counts=counts)
