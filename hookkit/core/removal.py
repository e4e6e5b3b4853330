"""What every attachment returns: one `remove()` that undoes it once, and is a no-op after that.

Handles are removed in reverse order on `handle.remove()` and again by enable's rollback, so every
removal must be safe to call twice. `Removal` holds that rule once; subclasses write `_undo()` only.
`restore_entry` is the one "give the old value back unless someone replaced ours since" rule shared by
the hook registry (a module's `forward`) and method patches (a scheduler's `step`).
"""

from __future__ import annotations

import abc
from typing import Any, Protocol

#: "the instance dict had no entry": restored by deleting the entry
MISSING: Any = object()


class Removable(Protocol):
    def remove(self) -> None: ...


class Removal(abc.ABC):
    """Base of hookkit's removal objects: `remove()` runs `_undo()` until it has succeeded once."""

    _removed: bool = False

    @property
    def removed(self) -> bool:
        return self._removed

    def remove(self) -> None:
        """Undo the attachment; a second call does nothing."""
        if self._removed:
            return
        self._undo()
        self._removed = True

    @abc.abstractmethod
    def _undo(self) -> None:
        """Undo what the attachment did (each subclass says what); run at most once successfully."""


def restore_entry(namespace: dict[str, Any], name: str, ours: Any, saved: Any) -> bool:
    """Put `saved` back as `namespace[name]` (delete it when `saved is MISSING`) if `ours` is still there.

    Another library that wrapped or replaced the entry after hookkit keeps its own (removing it would
    silently turn it off). Returns whether the entry was hookkit's.
    """
    if namespace.get(name) is not ours:
        return False
    if saved is MISSING:
        namespace.pop(name, None)
    else:
        namespace[name] = saved
    return True
