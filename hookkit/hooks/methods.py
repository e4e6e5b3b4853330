"""Instance-level method patches for objects that are not modules (schedulers, pipelines).

A patch writes one entry into `obj.__dict__` and `remove()` restores what was there before (usually:
nothing). The class is never touched, so two pipelines of one class stay independent.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from hookkit.errors import HookError

_MISSING = object()
_MARK = "__hookkit_patch__"


class MethodPatch:
    """Replace `obj.name` on the instance with `make_wrapper(original)`; undo with `remove()`."""

    def __init__(self, obj: Any, name: str, make_wrapper: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        original = getattr(obj, name, None)
        if not callable(original):
            raise HookError(f"{type(obj).__name__}.{name}: expected a method to patch, found {original!r}.")
        if getattr(original, _MARK, False):
            raise HookError(
                f"{type(obj).__name__}.{name}: expected a method hookkit has not patched, got one a live hookkit "
                "handle patched: this object is shared with a pipeline hookkit is enabled on. Give each pipeline its "
                "own (e.g. pipe.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)), or disable "
                "hookkit on the other pipeline first."
            )
        self.obj: Any = obj
        self.name = name
        self._saved = obj.__dict__.get(name, _MISSING)
        wrapper = functools.wraps(original)(make_wrapper(original))
        setattr(wrapper, _MARK, True)
        obj.__dict__[name] = wrapper

    def remove(self) -> None:
        if self.obj is None:
            return
        d = self.obj.__dict__
        if self._saved is _MISSING:
            d.pop(self.name, None)
        else:
            d[self.name] = self._saved
        self.obj = None
