"""Composable layer predicates for quantization: `(module, fqn) -> bool`, the shape torchao's
`quantize_(model, config, filter_fn=...)` calls.

Each builder returns a `Predicate`: a plain callable with a readable `repr`, so that a user's own
selection shows up legibly in `handle.summary()`. Combine them with `all_of`, `any_of` and `not_`::

    from hookkit.techniques.quantize.filters import all_of, by_name, divisible_by, min_features, not_

    attention_only = all_of(by_name("*.attn.*"), not_(by_name("*.to_out.*")), divisible_by(16), min_features(64))
    hookkit.enable(pipe, hookkit.Spec(quantize=hookkit.Quantize(scheme="fp8_row", filter_fn=attention_only)))

`fqn` is the module path under the model handed to `quantize_` (the transformer, for hookkit), e.g.
`transformer_blocks.3.attn.to_q`; the root is `""`. Predicates about features (`min_features`,
`divisible_by`) are False for anything that is not an `nn.Linear`.

A predicate built from these builders alone is data: its text (`repr`) is what `Spec.to_dict` writes, and `parse`
builds it back from the text without importing or evaluating anything.
"""

from __future__ import annotations

import ast
import fnmatch
from collections.abc import Callable

import torch

from hookkit.errors import SpecError

LayerFilter = Callable[[torch.nn.Module, str], bool]

__all__ = ["LayerFilter", "Predicate", "all_of", "any_of", "by_name", "divisible_by", "is_linear", "min_features",
           "not_", "parse"]


class Predicate:
    """A named `(module, fqn) -> bool`. Immutable; calling it never changes anything."""

    __slots__ = ("_data", "_fn", "_text")

    def __init__(self, fn: LayerFilter, text: str, data: bool = True) -> None:
        self._fn = fn
        self._text = text
        self._data = data

    def __call__(self, module: torch.nn.Module, fqn: str) -> bool:
        return bool(self._fn(module, fqn))

    def __repr__(self) -> str:
        return self._text

    @property
    def hookkit_expression(self) -> str | None:
        """The text `parse` builds this predicate back from (what `Spec.to_dict` writes), or None when it combines
        a callable that is not such a predicate (a lambda, a function of yours): that has no text form."""
        return self._text if self._data else None


def _data(filters: tuple[LayerFilter, ...]) -> bool:
    return all(isinstance(f, Predicate) and f.hookkit_expression is not None for f in filters)


def _check_filters(where: str, filters: tuple[LayerFilter, ...]) -> None:
    if not filters:
        raise SpecError(f"hookkit.techniques.quantize.filters.{where}: expected at least one predicate, got none. "
                        f"Pass one or more, e.g. {where}(by_name('*.attn.*'), min_features(64)).")
    for f in filters:
        if not callable(f):
            raise SpecError(f"hookkit.techniques.quantize.filters.{where}: expected callables (module, fqn) -> bool, got "
                            f"{type(f).__name__} {f!r}. Wrap name patterns in by_name(...), e.g. "
                            f"{where}(by_name('*.attn.*')).")


def _positive_int(where: str, n: object) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise SpecError(f"hookkit.techniques.quantize.filters.{where}: expected an int >= 1, got {type(n).__name__} {n!r}. "
                        f"Pass a positive int, e.g. {where}(16).")
    return n


def is_linear() -> Predicate:
    """True for `nn.Linear` modules (subclasses included)."""
    return Predicate(lambda module, fqn: isinstance(module, torch.nn.Linear), "is_linear()")


def by_name(*patterns: str) -> Predicate:
    """True when the module path matches any `fnmatch` pattern (`*` also matches dots: `*.attn.*`)."""
    if not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise SpecError(f"hookkit.techniques.quantize.filters.by_name: expected one or more non-empty pattern strings, got {patterns!r}. "
                        "Pass fnmatch patterns on module paths, e.g. by_name('*.attn.*', 'proj_out').")

    def match(module: torch.nn.Module, fqn: str) -> bool:
        return any(fnmatch.fnmatchcase(fqn, p) for p in patterns)

    return Predicate(match, f"by_name({', '.join(repr(p) for p in patterns)})")


def min_features(n: int) -> Predicate:
    """True for a Linear whose smaller side (`min(in_features, out_features)`) is at least `n`: tiny
    layers gain nothing from quantization and lose accuracy."""
    n = _positive_int("min_features", n)

    def big_enough(module: torch.nn.Module, fqn: str) -> bool:
        return isinstance(module, torch.nn.Linear) and min(module.in_features, module.out_features) >= n

    return Predicate(big_enough, f"min_features({n})")


def divisible_by(n: int) -> Predicate:
    """True for a Linear whose `in_features` and `out_features` are both multiples of `n` (fp8 and NVFP4
    kernels need 16, MX formats 32; torchao silently skips or rejects the rest)."""
    n = _positive_int("divisible_by", n)

    def divisible(module: torch.nn.Module, fqn: str) -> bool:
        return isinstance(module, torch.nn.Linear) and module.in_features % n == 0 and module.out_features % n == 0

    return Predicate(divisible, f"divisible_by({n})")


def all_of(*filters: LayerFilter) -> Predicate:
    """True when every predicate is (evaluated left to right, stopping at the first False)."""
    _check_filters("all_of", filters)
    return Predicate(lambda module, fqn: all(f(module, fqn) for f in filters),
                     f"all_of({', '.join(repr(f) for f in filters)})", _data(filters))


def any_of(*filters: LayerFilter) -> Predicate:
    """True when at least one predicate is (left to right, stopping at the first True)."""
    _check_filters("any_of", filters)
    return Predicate(lambda module, fqn: any(f(module, fqn) for f in filters),
                     f"any_of({', '.join(repr(f) for f in filters)})", _data(filters))


def not_(f: LayerFilter) -> Predicate:
    """The negation of one predicate."""
    _check_filters("not_", (f,))
    return Predicate(lambda module, fqn: not f(module, fqn), f"not_({f!r})", _data((f,)))


#: the builders a predicate's text may call (`parse`)
BUILDERS: dict[str, Callable[..., Predicate]] = {f.__name__: f for f in (
    is_linear, by_name, min_features, divisible_by, all_of, any_of, not_)}


def is_expression(text: str) -> bool:
    """Whether `text` reads as a call of one of `BUILDERS` (`by_name('*.ff.*')`), rather than a 'module:qualname'."""
    name, paren, _ = text.strip().partition("(")
    return bool(paren) and name.strip() in BUILDERS


def parse(text: str, where: str = "filter_fn") -> Predicate:
    """The predicate `text` writes (a predicate's `repr`: `all_of(is_linear(), by_name('*.ff.*'))`): calls of
    `BUILDERS` on string and int literals, nothing else. It is read as data (`ast`), never evaluated or imported, so
    a Spec read from a file can carry it without `trust_code`.

    Args:
        text: the predicate's text.
        where: the field it came from, for the error (`Quantize.filter_fn`).
    """
    def build(node: ast.AST) -> object:
        if isinstance(node, ast.Constant) and type(node.value) in (str, int):
            return node.value
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in BUILDERS
                and not node.keywords):
            return BUILDERS[node.func.id](*(build(arg) for arg in node.args))
        raise SpecError(f"{where}: expected a predicate of hookkit.filters as text: calls of {', '.join(BUILDERS)} on "
                        f"string and int literals, e.g. \"all_of(is_linear(), by_name('*.ff.*'))\"; got {text!r}, "
                        f"which has {ast.unparse(node)!r} there. Write it with those builders only, or pass the "
                        "callable itself.")

    try:
        tree = ast.parse(text.strip(), mode="eval")
        predicate = build(tree.body)
    except SpecError:
        raise
    except (SyntaxError, RecursionError, MemoryError, ValueError) as exc:  # ValueError: a null byte in the text
        raise SpecError(f"{where}: expected a predicate of hookkit.filters as text, e.g. "
                        f"\"all_of(is_linear(), by_name('*.ff.*'))\"; got {text!r}, which does not parse "
                        f"({type(exc).__name__}). Fix the text, or pass the callable itself.") from None
    if not isinstance(predicate, Predicate):
        raise SpecError(f"{where}: expected a predicate of hookkit.filters as text, got {text!r}, a "
                        f"{type(predicate).__name__} literal. Write e.g. \"by_name('*.ff.*')\".")
    return predicate
