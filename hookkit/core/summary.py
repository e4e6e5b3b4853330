"""`handle.summary()`: structured (attrs) and rendered as a readable table by `str()`."""

from __future__ import annotations

import re
import textwrap
from typing import Any

import attrs

#: columns a brief summary (`Summary.render(full=False)`, what `hookkit generate --summary` prints) fits in
SUMMARY_WIDTH = 100
#: lines a wrapped table cell keeps in a brief summary before it is cut with "…"
BRIEF_CELL_LINES = 3
#: the narrowest a column is squeezed to when a table is fitted to a width
_MIN_COLUMN = 8


def table(headers: list[str], rows: list[list[Any]], width: int | None = None, max_lines: int | None = None) -> str:
    """A markdown table, columns padded so that it also reads well in a terminal.

    Args:
        headers: the column names.
        rows: the cells, one list per row.
        width: None (default): one line per row, as wide as the cells need (a markdown table other tools read).
            An int: the widest columns are narrowed until every line fits `width` characters, and their cells
            wrapped onto continuation lines (the other cells of those lines left empty), so that a terminal does
            not fold the table.
        max_lines: with `width`, the lines a wrapped cell keeps; a longer cell ends in "…" on its last one.
    """
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    if width is not None:
        widths = _fitted(widths, width)
    lines = []
    for i, r in enumerate(cells):
        wrapped = [_wrap(c, w, max_lines) for c, w in zip(r, widths)]
        for k in range(max(len(w) for w in wrapped)):
            parts = [(w[k] if k < len(w) else "").ljust(n) for w, n in zip(wrapped, widths)]
            lines.append("| " + " | ".join(parts) + " |")
        if i == 0:  # below the header: the separator
            lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def _fitted(widths: list[int], width: int) -> list[int]:
    """Column widths whose table lines (`| a | b |`: 3 characters per column and 1) fit `width`, taking from the
    widest column first; no column goes below `_MIN_COLUMN` (nor below its natural width, when that is smaller)."""
    out = list(widths)
    while sum(out) + 3 * len(out) + 1 > width:
        widest = max(range(len(out)), key=lambda i: out[i])
        if out[widest] <= _MIN_COLUMN:
            break
        out[widest] -= 1
    return out


def _wrap(cell: str, width: int, max_lines: int | None) -> list[str]:
    """`cell` on lines of at most `width` characters (after ", " and spaces where it can, else mid-word)."""
    if len(cell) <= width:
        return [cell]
    lines = textwrap.wrap(cell, width, break_on_hyphens=False) or [""]
    if max_lines is not None and len(lines) > max_lines:
        lines = lines[:max_lines]
        lines[-1] = lines[-1][: width - 1] + "…"
    return lines


def fit_lines(text: str, width: int = SUMMARY_WIDTH) -> str:
    """`text` with every line longer than `width` cut to it, ending in "…" (the last guard of a brief summary)."""
    return "\n".join(line if len(line) <= width else line[: width - 1] + "…" for line in text.splitlines())


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "/")  # a "|" inside a cell (an error message, say) would split it


@attrs.frozen(kw_only=True)
class HookRow:
    module: str
    name: str
    feature: str


@attrs.frozen(kw_only=True)
class FeatureSummary:
    """One feature's statistics: `data` is structured (plain data), `text` is its rendering.

    Args:
        name: the feature's name (the `Spec` field).
        data: its statistics as plain data.
        text: its full rendering (`str(handle.summary())`).
        brief: a rendering that fits `SUMMARY_WIDTH` columns, details left out (`Summary.render(full=False)`);
            None when `text` is already that.
    """

    name: str
    data: dict[str, Any]
    text: str
    brief: str | None = None


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
    #: nn.ModuleLists of the transformer outside the adapter's [[blocks]], with the reason
    left_out: dict[str, str] = attrs.field(factory=dict)
    #: the first-call check of the adapter: "confirmed", "pending" or "not checked"
    first_call: str = "not checked"
    adapter_notes: tuple[str, ...] = ()
    #: the pipeline attribute holding this transformer ("transformer", "transformer_2"); None when bare
    component: str | None = None
    #: the summaries of the pipeline's other transformers (Wan 2.2's `transformer_2`), in pipeline order
    companions: tuple[Summary, ...] = ()

    def render(self, full: bool = True) -> str:
        """The summary as text.

        Args:
            full: True (default, `str()`): every detail (each quantized layer, every counter), lines as long as
                their tables need. False: what fits `SUMMARY_WIDTH` columns: tables wrapped, long cells cut after
                `BRIEF_CELL_LINES` lines, each feature's `brief` rendering (`hookkit generate --summary`).
        """
        text = self._render_one(full)
        for other in self.companions:
            text += "\n\n" + other._render_one(full)
        return text if full else fit_lines(text)

    def _render_one(self, full: bool = True) -> str:
        on = [k for k, v in self.spec.items() if v not in (None, False)]
        where = f" (pipe.{self.component})" if self.component and (self.companions or self.component != "transformer") else ""
        head = [
            f"hookkit summary: {self.transformer}{where}" + (f" in {self.pipeline}" if self.pipeline else " (bare transformer)"),
            f"adapter: {self.adapter} ({self.adapter_source}); first-call check: {self.first_call}",
            f"features: {', '.join(on) if on else 'none (bookkeeping only)'}; generations run: {self.generations}",
            "",
        ]
        by_place: dict[tuple[str, str], list[str]] = {}
        for row in self.hooks:
            by_place.setdefault((row.feature, row.name), []).append(row.module)
        rows = [[feature, name, _compress(modules)] for (feature, name), modules in by_place.items()]
        fit: dict[str, Any] = {} if full else {"width": SUMMARY_WIDTH, "max_lines": BRIEF_CELL_LINES}
        parts = ["\n".join(head) + table(["feature", "hook", "attached to"], rows, **fit)]
        if self.left_out:
            parts.append("\nblock lists the adapter leaves out:\n" + table(
                ["list", "why"], [[name, reason] for name, reason in self.left_out.items()], **fit))
        for note in self.adapter_notes:
            parts.append(f"adapter note: {note}")
        for feature in self.features.values():
            text = feature.text if full or feature.brief is None else feature.brief
            parts.append(f"\n[{feature.name}]\n{text}")
        return "\n".join(parts)

    def __str__(self) -> str:
        return self.render()


_FIRST_INDEX = re.compile(r"(^|\.)(\d+)(\.|$)")


def path_template(path: str) -> tuple[str, int | None]:
    """`transformer_blocks.3.attn.to_q` -> (`transformer_blocks.{}.attn.to_q`, 3): the first index only."""
    match = _FIRST_INDEX.search(path)
    if match is None:
        return path, None
    return path[: match.start(2)] + "{}" + path[match.end(2):], int(match.group(2))


def render_indices(template: str, indices: list[int]) -> str:
    """Fill a `path_template` with a set of indices: `{0..18}` for a run, `{1,4}` otherwise."""
    idx = sorted(set(indices))
    if len(idx) == 1:
        text = str(idx[0])
    elif idx == list(range(idx[0], idx[-1] + 1)):
        text = f"{{{idx[0]}..{idx[-1]}}}"
    else:
        text = "{" + ",".join(map(str, idx)) + "}"
    return template.replace("{}", text, 1)


def _compress(paths: list[str]) -> str:
    """`['blocks.0.ff', 'blocks.1.ff', '']` -> `<transformer>, blocks.{0..1}.ff`: long path lists stay one line."""
    groups: dict[str, list[int]] = {}
    out: list[str] = []
    for p in paths:
        template, index = path_template(p)
        if index is None:
            out.append(p if p else "<transformer>")
        else:
            groups.setdefault(template, []).append(index)
    out.extend(render_indices(t, idx) for t, idx in groups.items())
    return ", ".join(out)
