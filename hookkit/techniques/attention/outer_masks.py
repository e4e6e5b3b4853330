"""Padding masks built as the outer AND of one validity row, recognized from the ops that build them.

Why: HunyuanVideo 1.5's processor hands SDPA a `[B, 1, S, S]` boolean mask of every (valid query, valid key) pair, built
in every block as

    rows = valid.view(B, 1, 1, S).repeat(1, 1, S, 1)
    mask = (rows & rows.transpose(2, 3)).bool()

hookkit's kernels take such a mask, but reading it costs: it is 1.2 GB at 480x832x81 (34,745 tokens), built in every
block and classified tile by tile in every call (about 2.7 ms a block on an H100, BENCHMARKS.md). The same attention is
attention over the row's valid keys (`hooks.run_with_validity_row`: the kernel unmasked over them, reordered first
and counted) with the padding queries' rows set to 0, as SDPA gives a row with no allowed key. Under `torch.compile` the `[B, 1, S, S]` mask then feeds nothing and inductor
drops its build.

How it is known, not guessed: `OuterMasks` watches the block's torch calls (the attention mode's `__torch_function__`)
and follows one mask from the `repeat` of a `[B, 1, 1, S]` boolean row through `transpose(2, 3)`, the `&` of the two
and `bool()`; SDPA's mask is taken as the row only where it is that very tensor, for self-attention of S queries and S
keys. Any in-place op or `out=` while a mask is followed (on anything: an alias may reach the row or the mask) stops
following it, and the call gets the full mask as before.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["OuterMasks"]


def _repeats(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """`Tensor.repeat`'s sizes, passed as varargs or as one sequence."""
    sizes = args[1:]
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list, torch.Size)):
        return tuple(sizes[0])
    return tuple(sizes)


def _in_place_functions() -> tuple[Any, ...]:
    """The torch methods and functions that may write into an existing tensor: named with a trailing `_` (`fill_`,
    `masked_fill_`, `relu_`), `__setitem__` and the augmented operators (`__iand__`, `__iadd__`, ...)."""
    found: list[Any] = []
    for owner in (torch.Tensor, torch):
        for name in dir(owner):
            writes = (name.endswith("_") and not name.startswith("__")) or name == "__setitem__" or (
                name.startswith("__i") and name[3:-2] in _AUGMENTED)
            function = getattr(owner, name, None) if writes else None
            if callable(function):
                found.append(function)
    return tuple(found)


#: the operators whose augmented form (`__iand__`, ...) writes in place
_AUGMENTED = ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor", "lshift",
              "rshift")
#: `_in_place_functions` as a tuple (what dynamo traces `in` on: it cannot hash torch's builtins) and as a set (eager)
_IN_PLACE = _in_place_functions()
_IN_PLACE_SET = frozenset(_IN_PLACE)


def _in_place(func: Any, kwargs: dict[str, Any]) -> bool:
    """Whether a torch call may write into an existing tensor (`_in_place_functions`, or an `out=` argument)."""
    if kwargs.get("out") is not None:
        return True
    if torch.compiler.is_compiling():
        return func in _IN_PLACE
    return func in _IN_PLACE_SET


class OuterMasks:
    """Follows one outer-AND padding mask through the ops that build it (module docstring); one per attention mode,
    cleared at every block call and every SDPA call."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Forget the mask followed, if any."""
        #: the `[B, 1, 1, S]` boolean row, `rows` its repeat over S queries, `cols` their transpose, `mask` their AND
        self.row: torch.Tensor | None = None
        self.rows: torch.Tensor | None = None
        self.cols: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None

    def observe(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """Note what the torch call `func(*args, **kwargs)`, which returned `out`, does to the mask followed."""
        if self.rows is None:
            if func is torch.Tensor.repeat:
                row = args[0]
                if (row.dtype == torch.bool and row.dim() == 4 and row.shape[1] == 1 and row.shape[2] == 1
                        and _repeats(args) == (1, 1, row.shape[3], 1)):
                    self.row, self.rows = row, out
            return
        if _in_place(func, kwargs):
            self.clear()
            return
        first = args[0] if args else None
        if func is torch.Tensor.transpose or func is torch.transpose:
            if first is self.rows and sorted(d % 4 for d in args[1:3]) == [2, 3]:
                self.cols = out
        elif func is torch.Tensor.__and__ or func is torch.Tensor.bitwise_and or func is torch.bitwise_and:
            pair = args[:2]
            if self.cols is not None and len(pair) == 2 and (
                    (pair[0] is self.rows and pair[1] is self.cols) or (pair[0] is self.cols and pair[1] is self.rows)):
                self.mask = out
        elif func is torch.Tensor.bool:
            if self.mask is not None and first is self.mask:
                self.mask = out

    def take(self, mask: Any, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor | None:
        """The `[B, 1, 1, S]` validity row whose outer AND `mask` is, where SDPA's `mask` is the mask followed and the
        call is self-attention over its S tokens (`[B, H, S, D]` query and key); else None. Forgets the mask either
        way: each block builds its own."""
        row, followed = self.row, self.mask
        self.clear()
        if followed is None or mask is not followed or row is None:
            return None
        b, _, _, s = row.shape
        if query.dim() != 4 or key.dim() != 4 or query.shape[0] != b or query.shape[2] != s or key.shape[2] != s:
            return None
        return row
