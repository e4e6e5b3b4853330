"""Instance-level method patches for objects that are not modules (schedulers, pipelines).

A patch writes one entry into `obj.__dict__` and `remove()` restores what was there before (usually:
nothing). The class is never touched, so two pipelines of one class stay independent.

The entry is a `PatchedMethod` object rather than a closure because pipelines copy schedulers
(`copy.deepcopy(self.scheduler)` in LTX-2's audio loop, SkyReels-V2's diffusion forcing): a function is copied by
reference, so the copy would drive the original scheduler and hookkit's per-call state. A copy gets its own,
unpatched method instead; pickling a patched object is refused with the fix.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

from hookkit.core.removal import MISSING, Removal, restore_entry
from hookkit.errors import HookError

_MARK = "__hookkit_patch__"


class PatchedMethod:
    """The callable hookkit puts in `obj.__dict__[name]`: runs `fn`, copies as the unpatched method."""

    __hookkit_patch__ = True

    def __init__(self, fn: Callable[..., Any], original: Callable[..., Any], obj: Any, name: str, saved: Any,
                 owner: Any = None) -> None:
        functools.update_wrapper(self, original)
        self._fn, self._obj, self._name, self._saved = fn, obj, name, saved
        #: who made the patch (the core's scheduler patches: their `Handle`), for finding it from the object
        self.owner = owner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._fn(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        twin = memo.get(id(self._obj))  # copy.deepcopy makes the object's copy before copying its __dict__
        if twin is None:
            raise HookError(f"copy.deepcopy of hookkit's patched {type(self._obj).__name__}.{self._name} alone: "
                            "expected it copied with its object. Copy the object instead.")
        if self._saved is MISSING:  # what the copy would have had without hookkit: the class's method
            return getattr(type(twin), self._name).__get__(twin, type(twin))
        return copy.deepcopy(self._saved, memo)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise HookError(f"pickle of {type(self._obj).__name__}: expected an object without hookkit patches, got "
                        f"{self._name} patched by a live hookkit handle. Remove hookkit first (handle.remove() or "
                        "hookkit.disable(...)), then pickle.")


class MethodPatch(Removal):
    """Replace `obj.name` on the instance with `make_wrapper(original)`; undo with `remove()`."""

    def __init__(self, obj: Any, name: str, make_wrapper: Callable[[Callable[..., Any]], Callable[..., Any]],
                 owner: Any = None) -> None:
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
        self._saved = obj.__dict__.get(name, MISSING)
        self._wrapper = PatchedMethod(make_wrapper(original), original, obj, name, self._saved, owner)
        obj.__dict__[name] = self._wrapper

    def _undo(self) -> None:
        """Restore what was there, unless something replaced hookkit's patch since (then leave theirs alone)."""
        restore_entry(self.obj.__dict__, self.name, self._wrapper, self._saved)
        self.obj = None
