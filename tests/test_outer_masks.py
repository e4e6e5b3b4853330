"""`outer_masks.OuterMasks`: a padding mask built as the outer AND of one validity row (HunyuanVideo 1.5's processor
builds one in every block) is recognized from the ops that build it, and only from those.

Each test runs the ops under a torch-function mode that hands every call to the tracker, as the attention mode does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from hookkit.techniques.attention.outer_masks import OuterMasks, _in_place

B, H, S, D = 2, 3, 10, 8


class Watching(TorchFunctionMode):
    """Hands every torch call to `masks.observe`, as `KernelMode` does outside SDPA."""

    def __init__(self, masks: OuterMasks) -> None:
        super().__init__()
        self.masks = masks

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.masks.observe(func, args, kwargs, out)
        return out


def valid_row() -> torch.Tensor:
    """A `[B, S]` text mask: the first 7 and 4 tokens valid."""
    return torch.arange(S)[None, :] < torch.tensor([[7], [4]])


def processor_mask(text_mask: torch.Tensor) -> torch.Tensor:
    """HunyuanVideo 1.5's processor's lines, as diffusers 0.42 writes them (`HunyuanVideo15AttnProcessor2_0`)."""
    attention_mask = torch.nn.functional.pad(text_mask, (S - text_mask.shape[1], 0), value=True)
    attention_mask = attention_mask.bool()
    self_attn_mask_1 = attention_mask.view(B, 1, 1, S).repeat(1, 1, S, 1)
    self_attn_mask_2 = self_attn_mask_1.transpose(2, 3)
    return (self_attn_mask_1 & self_attn_mask_2).bool()


def qk(keys: int = S) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(B, H, S, D), torch.zeros(B, H, keys, D)


def built_under(masks: OuterMasks, build: Callable[[], torch.Tensor]) -> torch.Tensor:
    with Watching(masks):
        return build()


def test_the_processors_mask_is_taken_as_its_validity_row() -> None:
    masks = OuterMasks()
    mask = built_under(masks, lambda: processor_mask(valid_row()))
    row = masks.take(mask, *qk())
    assert row is not None and row.shape == (B, 1, 1, S)
    assert torch.equal(row & row.transpose(2, 3), mask)


def test_the_and_in_either_order_and_a_negative_transpose_are_the_same_mask() -> None:
    masks = OuterMasks()

    def build() -> torch.Tensor:
        rows = valid_row().view(B, 1, 1, S).repeat(1, 1, S, 1)
        return torch.bitwise_and(rows.transpose(-1, -2), rows)

    mask = built_under(masks, build)
    assert torch.equal(masks.take(mask, *qk()), valid_row().view(B, 1, 1, S))


def test_a_repeat_of_other_sizes_is_not_followed() -> None:
    masks = OuterMasks()

    def build() -> torch.Tensor:
        rows = valid_row().view(B, 1, 1, S).repeat(1, 2, S, 1)  # two heads of rows: not the row's outer AND's shape
        return rows & rows.transpose(2, 3)

    assert masks.take(built_under(masks, build), *qk()) is None


def test_a_transpose_of_other_dimensions_is_not_followed() -> None:
    masks = OuterMasks()

    def build() -> torch.Tensor:
        rows = valid_row().view(B, 1, 1, S).repeat(1, 1, S, 1)
        return rows & rows.transpose(1, 2).transpose(1, 2)

    assert masks.take(built_under(masks, build), *qk()) is None


def test_an_and_with_another_mask_is_not_followed() -> None:
    masks = OuterMasks()

    def build() -> torch.Tensor:
        rows = valid_row().view(B, 1, 1, S).repeat(1, 1, S, 1)
        rows.transpose(2, 3)
        return rows & torch.ones(B, 1, S, S, dtype=torch.bool).tril()

    assert masks.take(built_under(masks, build), *qk()) is None


def test_a_write_into_the_mask_after_its_build_stops_following_it() -> None:
    masks = OuterMasks()

    def build() -> torch.Tensor:
        mask = processor_mask(valid_row())
        mask[0, 0, 0, S - 1] = True  # no longer the outer AND of any row
        return mask

    assert masks.take(built_under(masks, build), *qk()) is None


def test_a_write_into_the_row_after_its_repeat_stops_following_the_mask() -> None:
    masks = OuterMasks()

    def build() -> torch.Tensor:
        row = valid_row().view(B, 1, 1, S)
        rows = row.repeat(1, 1, S, 1)
        row.fill_(True)  # the repeat copied the row: the row taken would no longer be the mask's
        return rows & rows.transpose(2, 3)

    assert masks.take(built_under(masks, build), *qk()) is None


def test_an_out_argument_stops_following_the_mask() -> None:
    masks = OuterMasks()

    def build() -> torch.Tensor:
        mask = processor_mask(valid_row())
        torch.logical_not(mask, out=torch.empty_like(mask))
        return mask

    assert masks.take(built_under(masks, build), *qk()) is None


def test_a_copy_of_the_mask_is_not_taken() -> None:
    masks = OuterMasks()
    mask = built_under(masks, lambda: processor_mask(valid_row()).clone())
    assert masks.take(mask, *qk()) is None


def test_cross_attention_over_other_keys_is_not_taken() -> None:
    masks = OuterMasks()
    mask = built_under(masks, lambda: processor_mask(valid_row()))
    assert masks.take(mask, *qk(keys=S + 1)) is None


def test_take_forgets_the_mask_each_block_builds_its_own() -> None:
    masks = OuterMasks()
    mask = built_under(masks, lambda: processor_mask(valid_row()))
    assert masks.take(mask, *qk()) is not None
    assert masks.take(mask, *qk()) is None
    assert (masks.row, masks.rows, masks.cols, masks.mask) == (None, None, None, None)


def test_the_writing_calls_are_the_in_place_methods_setitem_augmented_operators_and_out() -> None:
    t = torch.Tensor
    assert [_in_place(f, {}) for f in (t.masked_fill_, t.fill_, t.__setitem__, t.__iand__, torch.relu_)] == [True] * 5
    assert [_in_place(f, {}) for f in (t.transpose, t.__and__, t.bool, t.repeat, t.__index__, t.__invert__)] == [
        False] * 6
    assert _in_place(torch.logical_not, {"out": torch.empty(1)}) and not _in_place(torch.logical_not, {"out": None})
