"""`handle.summary()`: structured (attrs) and rendered as a readable table by `str()`."""

from __future__ import annotations

import re
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
    return str(value).replace("|", "/")  # a "|" inside a cell (an error message, say) would split it


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
    #: nn.ModuleLists of the transformer outside the adapter's [[blocks]], with the reason
    left_out: dict[str, str] = attrs.field(factory=dict)
    #: the first-call check of the adapter: "confirmed", "pending" or "not checked"
    first_call: str = "not checked"
    adapter_notes: tuple[str, ...] = ()
    #: the pipeline attribute holding this transformer ("transformer", "transformer_2"); None when bare
    component: str | None = None
    #: the summaries of the pipeline's other transformers (Wan 2.2's `transformer_2`), in pipeline order
    companions: tuple[Summary, ...] = ()

    def render(self) -> str:
        text = self._render_one()
        for other in self.companions:
            text += "\n\n" + other._render_one()
        return text

    def _render_one(self) -> str:
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
        parts = ["\n".join(head) + table(["feature", "hook", "attached to"], rows)]
        if self.left_out:
            parts.append("\nblock lists the adapter leaves out:\n" + table(
                ["list", "why"], [[name, reason] for name, reason in self.left_out.items()]))
        for note in self.adapter_notes:
            parts.append(f"adapter note: {note}")
        for feature in self.features.values():
            parts.append(f"\n[{feature.name}]\n{feature.text}")
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
