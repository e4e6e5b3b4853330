"""Every error hookkit raises on purpose.

Messages name *where* (the field, module path or adapter key), *what was expected*, *what came*, and
*the fix*, because the person reading them is usually three layers away from the code that raised.
"""

from __future__ import annotations

from typing import TypeVar


class HookkitError(Exception):
    """Base class: catch this to catch anything hookkit raises deliberately."""


class SpecError(HookkitError, ValueError):
    """A feature spec (`Spec`, `DBCache`, `Quantize`, `Compile`, ...) got a value it cannot use."""


class AdapterError(HookkitError, ValueError):
    """An adapter file or `AdapterSpec` is malformed, or does not match the transformer it is used on."""


class HookError(HookkitError, RuntimeError):
    """A hook could not be registered or removed (duplicate name, unknown name, wrong target)."""


class EnableError(HookkitError, RuntimeError):
    """`hookkit.enable` / `hookkit.disable` was used on something it cannot hook, or twice."""


class UnsupportedError(HookkitError, RuntimeError):
    """A feature needs something this machine or installation does not have (a GPU, a compute capability, a package)."""


E = TypeVar("E", bound=HookkitError)


def field_error(owner: str, field: str, value: object, expected: str, fix: str = "",
                error: type[E] = SpecError) -> E:  # type: ignore[assignment]
    """The one shape of a bad-value error, for specs and adapters alike: `owner.field: expected ..., got ....`

    Args:
        owner: where the value is: a class name (`"DBCache"`) or an adapter (`"adapter 'flux' (flux.toml)"`).
        field: the field's name or path inside `owner` (`"threshold"`, `"blocks[transformer_blocks].returns"`).
        value: what came.
        expected: what is allowed, as a phrase (`"an int >= 0"`).
        fix: one sentence on how to fix it, when the expectation alone does not say.
        error: the `HookkitError` subclass to build (`SpecError` for specs, `AdapterError` for adapters).
    """
    msg = f"{owner}.{field}: expected {expected}, got {value!r}."
    if fix:
        msg += f" {fix}"
    return error(msg)
