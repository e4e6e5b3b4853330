"""Torch-function mode scopes whose ends are hooks, not a `with` block.

Memo opens a mode at the transformer's entry and closes it at the first block; the sync-free loop opens
one when the transformer returns and closes it at `scheduler.step`. Either end may be skipped by an
exception, and other code may push modes on top, so closing takes the mode off the stack wherever it is.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode


def push_mode(mode: TorchFunctionMode) -> None:
    """Push `mode` on this thread's torch-function mode stack (what `with mode:` does on entry)."""
    mode.__enter__()


def remove_mode(mode: TorchFunctionMode) -> bool:
    """Take `mode` off the stack wherever it is, leaving the others in order. False if it was not there.

    Normally `mode` is on top and this is one pop. If code pushed another mode above it and did not pop it
    (it raised), the modes above are popped, `mode` is dropped, and they are pushed back.
    """
    stack = torch.overrides._get_current_function_mode_stack()
    if not any(m is mode for m in stack):
        return False
    above: list[TorchFunctionMode] = []
    while True:
        top = torch.overrides._pop_mode()
        if top is mode:
            break
        above.append(top)
    for m in reversed(above):
        torch.overrides._push_mode(m)
    return True


class ModeScope:
    """Pushes and removes one mode, at most once at a time.

    `close()` is safe to call any number of times and takes the mode off the stack wherever it is.
    """

    def __init__(self, mode: TorchFunctionMode) -> None:
        self.mode = mode
        self.active = False

    def open(self) -> bool:
        """Push the mode unless it is already on; True if this call pushed it."""
        if self.active:
            return False
        push_mode(self.mode)
        self.active = True
        return True

    def close(self) -> None:
        if self.active:
            self.active = False
            remove_mode(self.mode)
