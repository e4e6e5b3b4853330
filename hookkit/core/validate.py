"""attrs validators shared by every spec and adapter schema: one message shape everywhere.

Each raises `hookkit.errors.SpecError` as `Owner.field: expected ..., got ....` (see `errors.field_error`),
so a bad value names where it is, what was allowed and what came.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import numbers
from collections.abc import Callable
from typing import Any

import attrs

from hookkit.errors import SpecError, field_error


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


def closest(name: str, valid: Any) -> str:
    """' Did you mean 'x'?' for the valid name closest to `name` (difflib), or ''."""
    match = difflib.get_close_matches(str(name), list(valid), n=1, cutoff=0.6)
    return f" Did you mean {match[0]!r}?" if match else ""


def plain(value: Any) -> Any:
    """numpy scalars and arrays as the Python values they hold (np.float32(0.1) -> 0.1, np.int64(2) -> 2,
    np.array([1, 0]) -> [1, 0], np.bool_ -> bool), so that every field takes them as it takes Python values and
    `to_dict()` stays JSON; anything else passes unchanged."""
    if type(value).__module__ == "numpy" and callable(getattr(value, "tolist", None)):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        items = [plain(v) for v in value]
        return type(value)(items) if any(a is not b for a, b in zip(items, value)) else value
    return value


def strict_init(cls: type) -> type:
    """Make an attrs class's `__init__` refuse misuse with a `SpecError` instead of Python's bare `TypeError`:
    positional arguments, an unknown (e.g. misspelled) field, a missing required one. Each message lists the
    valid fields and, for a misspelling, the closest one. numpy values are taken as Python values (`plain`)."""
    original = cls.__init__
    fields = [a for a in attrs.fields(cls) if a.init]
    names = tuple(a.alias for a in fields)
    required = tuple(a.alias for a in fields if a.default is attrs.NOTHING)
    valid = f"valid fields: {', '.join(names)}"

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        where = cls.__name__
        if args:
            example = f"{where}({names[0]}=...)" if names else f"{where}()"
            raise SpecError(f"{where}: expected keyword arguments only, got {len(args)} positional ({args!r:.80}). "
                            f"Name each one, e.g. {example}; {valid}.")
        for key in kwargs:
            if key not in names:
                raise SpecError(f"{where}.{key}: expected one of the fields of {where}, got the unknown field {key!r}."
                                f"{closest(key, names)} {valid[0].upper()}{valid[1:]}.")
        missing = [n for n in required if n not in kwargs]
        if missing:
            raise SpecError(f"{where}.{missing[0]}: expected a value (the field is required), got none. "
                            f"Pass it, e.g. {where}({missing[0]}=...); {valid}.")
        original(self, **{k: plain(v) for k, v in kwargs.items()})

    cls.__init__ = __init__  # type: ignore[misc]
    return cls


def callable_name(fn: Any) -> str:
    """How `to_dict()` writes a callable field: a callable that is data writes its own text (`hookkit_expression`:
    hookkit.filters' predicates, read back without importing anything); a module-level function or class
    'module:qualname', importable again by `resolve_callable` (with `trust_code`); a lambda, a local function or
    another object its repr (the record says what it was; `from_dict` refuses it)."""
    expression = getattr(fn, "hookkit_expression", None)
    if isinstance(expression, str):
        return expression
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str) and "<" not in qualname:
        return f"{module}:{qualname}"
    return f"<{fn!r}>"


def resolve_callable(owner_name: str, field: str, text: str, trust_code: bool = False) -> Any:
    """The callable `callable_name` wrote as 'module:qualname'; SpecError when the text names none.

    Importing a module runs its code, and calling what it names runs more, so a name is resolved only with
    `trust_code` (the caller's say-so that the text comes from someone whose code it would run anyway, as diffusers'
    `trust_remote_code`), hookkit's own modules included: data names code only as a hookkit.filters predicate."""
    module_name, _, qualname = text.partition(":")
    fix = (f"Pass the callable itself ({owner_name}({field}=my_function)); to_dict() writes a callable as "
           "'module:qualname', readable back only for module-level functions.")
    if not module_name or not qualname or text.startswith("<"):
        raise field_error(owner_name, field, text, "a callable or a 'module:qualname' string", fix)
    if not trust_code:
        raise field_error(owner_name, field, text,
                          "a hookkit.filters predicate as text (e.g. \"all_of(is_linear(), by_name('*.ff.*'))\"), or "
                          "a 'module:qualname' with trust_code=True",
                          f"Resolving it would import {module_name!r} and run its code; nothing was imported. If you "
                          "trust where the dict came from, pass Spec.from_dict(data, trust_code=True), or pass the "
                          f"callable itself ({owner_name}({field}=my_function)).")
    try:
        value: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            value = getattr(value, part)
    except (ImportError, AttributeError, ValueError, TypeError) as exc:
        raise field_error(owner_name, field, text, f"an importable 'module:qualname' ({type(exc).__name__}: {exc})",
                         fix) from None
    if not callable(value):
        raise field_error(owner_name, field, text, "a 'module:qualname' naming a callable", fix)
    return value
