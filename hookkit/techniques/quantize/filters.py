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
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable

import torch

from hookkit.errors import SpecError

LayerFilter = Callable[[torch.nn.Module, str], bool]

__all__ = ["LayerFilter", "Predicate", "all_of", "any_of", "by_name", "divisible_by", "is_linear", "min_features", "not_"]


class Predicate:
    """A named `(module, fqn) -> bool`. Immutable; calling it never changes anything."""

    __slots__ = ("_fn", "_text")

    def __init__(self, fn: LayerFilter, text: str) -> None:
        self._fn = fn
        self._text = text

    def __call__(self, module: torch.nn.Module, fqn: str) -> bool:
        return bool(self._fn(module, fqn))

    def __repr__(self) -> str:
        return self._text


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
                     f"all_of({', '.join(repr(f) for f in filters)})")


def any_of(*filters: LayerFilter) -> Predicate:
    """True when at least one predicate is (left to right, stopping at the first True)."""
    _check_filters("any_of", filters)
    return Predicate(lambda module, fqn: any(f(module, fqn) for f in filters),
                     f"any_of({', '.join(repr(f) for f in filters)})")


def not_(f: LayerFilter) -> Predicate:
    """The negation of one predicate."""
    _check_filters("not_", (f,))
    return Predicate(lambda module, fqn: not f(module, fqn), f"not_({f!r})")
