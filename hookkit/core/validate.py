"""attrs validators shared by every spec and adapter schema: one message shape everywhere.

Each raises `hookkit.errors.SpecError` as `Owner.field: expected ..., got ....` (see `errors.field_error`),
so a bad value names where it is, what was allowed and what came.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import attrs

from hookkit.errors import field_error

def owner(inst: Any) -> str:
    return type(inst).__name__


def int_field(minimum: int, maximum: int | None = None,
              allow_none: bool = False) -> Callable[[Any, attrs.Attribute, Any], None]:
    def check(inst: Any, attr: attrs.Attribute, value: Any) -> None:
        bound = (f"an int >= {minimum}" + (f" and <= {maximum}" if maximum is not None else "")
                 + (" or None" if allow_none else ""))
        if value is None and allow_none:
            return
        if isinstance(value, bool) or not isinstance(value, int):
            raise field_error(owner(inst), attr.name, value, bound)
        if value < minimum or (maximum is not None and value > maximum):
            raise field_error(owner(inst), attr.name, value, bound)

    return check


def float_field(minimum: float, allow_none: bool = False, strict: bool = False) -> Callable[[Any, attrs.Attribute, Any], None]:
    def check(inst: Any, attr: attrs.Attribute, value: Any) -> None:
        bound = f"a number {'>' if strict else '>='} {minimum}" + (" or None" if allow_none else "")
        if value is None and allow_none:
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise field_error(owner(inst), attr.name, value, bound)
        if value < minimum or (strict and value == minimum) or value != value:
            raise field_error(owner(inst), attr.name, value, bound)

    return check


def choice(*allowed: Any) -> Callable[[Any, attrs.Attribute, Any], None]:
    def check(inst: Any, attr: attrs.Attribute, value: Any) -> None:
        # `0 == False` and `1 == True`: an int must not pass for a bool choice, nor a bool for an int one
        if not any(value == a and isinstance(value, bool) == isinstance(a, bool) for a in allowed):
            raise field_error(owner(inst), attr.name, value, f"one of {allowed}")

    return check


def boolean(inst: Any, attr: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, bool):
        raise field_error(owner(inst), attr.name, value, "True or False")


def str_tuple(inst: Any, attr: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, tuple) or not all(isinstance(v, str) and v for v in value):
        raise field_error(owner(inst), attr.name, value, "a list of non-empty strings")


def to_tuple(value: Any) -> Any:
    """Lists (from TOML/JSON/dicts) become tuples so that frozen specs stay hashable; anything else passes."""
    return tuple(value) if isinstance(value, list) else value


def instance_of(cls: type | tuple[type, ...], what: str) -> Callable[[Any, attrs.Attribute, Any], None]:
    def check(inst: Any, attr: attrs.Attribute, value: Any) -> None:
        if value is not None and not isinstance(value, cls):
            raise field_error(owner(inst), attr.name, value, f"{what} or None")

    return check


def is_int(value: Any) -> bool:
    """An integer (numpy's included) that is not a bool; 1.0 is no step flag."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
