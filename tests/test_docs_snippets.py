"""The documentation's code runs: every ```python block of README.md and docs/*.md, and every link between the docs.

Convention (CONTRIBUTING.md, "Documentation"): a block fenced ```python runs on the CPU in a few seconds with a tiny
pipeline and asserts what it claims; a block that cannot (it needs a GPU, several processes or a model folder) is
fenced ```python no-run and is only read. Each runnable block is one test, its id `file:line`, run in a fresh
namespace with one CPU thread, so that a snippet copied alone into a script behaves as it does here.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SNIPPET_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINKED_FILES = [*SNIPPET_FILES, ROOT / "BENCHMARKS.md", ROOT / "CONTRIBUTING.md", ROOT / "ARCHITECTURE.md",
                ROOT / "benchmarks" / "results" / "README.md"]
FENCE = re.compile(r"^```(\S*)(?:[ \t]+(\S+))?[ \t]*$")


def code_blocks(path: Path) -> list[tuple[int, str, str, str]]:
    """(line of the opening fence, language, tag after it, code) for every fenced block of `path`."""
    blocks, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m and m.group(1):
            start, body = i + 1, []
            i += 1
            while i < len(lines) and lines[i].rstrip() != "```":
                body.append(lines[i])
                i += 1
            blocks.append((start, m.group(1), m.group(2) or "", "\n".join(body) + "\n"))
        i += 1
    return blocks


def runnable_blocks() -> list:
    params = []
    for path in SNIPPET_FILES:
        for line, lang, tag, code in code_blocks(path):
            if lang == "python" and tag == "":
                rel = path.relative_to(ROOT).as_posix()
                params.append(pytest.param(rel, line, code, id=f"{rel}:{line}"))
    return params


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("rel, line, code", runnable_blocks())
def test_the_snippet_runs(rel: str, line: int, code: str, one_thread: None, tmp_path: Path,
                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # a snippet that writes a file writes it here
    exec(compile(code, f"{rel}:{line}", "exec"), {"__name__": "__docs__"})


def test_every_python_block_is_runnable_or_marked_no_run() -> None:
    wrong = [f"{p.relative_to(ROOT)}:{line}: ```{lang} {tag}".strip()
             for p in SNIPPET_FILES for line, lang, tag, _ in code_blocks(p)
             if lang in ("python", "py", "python3") and (lang, tag) not in (("python", ""), ("python", "no-run"))]
    assert wrong == []


@pytest.mark.parametrize("page", sorted(p.name for p in (ROOT / "docs").glob("*.md")))
def test_every_docs_page_has_a_runnable_snippet(page: str) -> None:
    blocks = code_blocks(ROOT / "docs" / page)
    assert any(lang == "python" and tag == "" for _, lang, tag, _ in blocks), page


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: lower case, characters other than letters, digits, marks, '_', '-' and
    spaces dropped (so '²', '×', ',', '.', '/', '+' vanish), spaces to '-'."""
    text = re.sub(r"`", "", heading.strip().lower())
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LM" or unicodedata.category(c) == "Nd")
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        m = re.match(r"^#{1,6} (.+)$", line)
        if m and not in_code:
            a = github_anchor(m.group(1))
            n = seen.get(a, 0)
            seen[a] = n + 1
            out.add(a if n == 0 else f"{a}-{n}")
    return out


LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("doc", [p.relative_to(ROOT).as_posix() for p in LINKED_FILES])
def test_every_local_link_and_anchor_resolves(doc: str) -> None:
    path = ROOT / doc
    broken = []
    for target in LINK.findall(path.read_text()):
        if re.match(r"^[a-z]+:", target):
            continue  # http(s), mailto: not checked here
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(target)
    assert broken == []
