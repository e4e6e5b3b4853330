"""`handle.summary()`: structured (attrs) and rendered as a readable table by `str()`."""

from __future__ import annotations

from typing import Any

import attrs


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """A markdown table, columns padded so that it also reads well in a terminal."""
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


@attrs.frozen(kw_only=True)
class HookRow:
    module: str
    name: str
    feature: str


@attrs.frozen(kw_only=True)
class FeatureSummary:
    """One feature's statistics: `data` is structured (plain data), `text` is its rendering."""

    name: str
    data: dict[str, Any]
    text: str


@attrs.frozen(kw_only=True)
class Summary:
    adapter: str
    adapter_source: str
    transformer: str
    pipeline: str | None
    spec: dict[str, Any]
    hooks: tuple[HookRow, ...]
    generations: int
    features: dict[str, FeatureSummary]

    def render(self) -> str:
        on = [k for k, v in self.spec.items() if v not in (None, False)]
        head = [
            f"hookkit summary: {self.transformer}" + (f" in {self.pipeline}" if self.pipeline else " (bare transformer)"),
            f"adapter: {self.adapter} ({self.adapter_source})",
            f"features: {', '.join(on) if on else 'none (bookkeeping only)'}; generations run: {self.generations}",
            "",
        ]
        by_place: dict[tuple[str, str], list[str]] = {}
        for row in self.hooks:
            by_place.setdefault((row.feature, row.name), []).append(row.module)
        rows = [[feature, name, _compress(modules)] for (feature, name), modules in by_place.items()]
        parts = ["\n".join(head) + table(["feature", "hook", "attached to"], rows)]
        for feature in self.features.values():
            parts.append(f"\n[{feature.name}]\n{feature.text}")
        return "\n".join(parts)

    def __str__(self) -> str:
        return self.render()


def _compress(paths: list[str]) -> str:
    """`['blocks.0', 'blocks.1', 'blocks.2']` -> `blocks.{0..2}` so that long block lists stay one line."""
    groups: dict[str, list[int]] = {}
    plain: list[str] = []
    for p in paths:
        head, _, tail = p.rpartition(".")
        if head and tail.isdigit():
            groups.setdefault(head, []).append(int(tail))
        else:
            plain.append(p if p else "<transformer>")
    out = plain[:]
    for head, idx in groups.items():
        idx.sort()
        if len(idx) > 1 and idx == list(range(idx[0], idx[-1] + 1)):
            out.append(f"{head}.{{{idx[0]}..{idx[-1]}}}")
        else:
            out.extend(f"{head}.{i}" for i in idx)
    return ", ".join(out)
