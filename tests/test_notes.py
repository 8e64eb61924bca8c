"""Every ``NOTE [title]`` the code or the docs point to is defined once, where its invariant is
enforced: a line that is the note's title alone (a comment ``# NOTE [title]``, or a docstring
line ``NOTE [title]``), in zerofx/, passes/, cost_models/, benchmarks/, tests/ or pyproject.toml."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFINING = [*(ROOT / d for d in ("zerofx", "passes", "cost_models", "benchmarks", "tests")), ROOT / "pyproject.toml"]
REFERRING = [*DEFINING, ROOT / "examples", ROOT / "docs", ROOT / "README.md"]

_DEFINITION = re.compile(r'^\s*(?:#\s*|"""\s*)?NOTE \[([^\]]+)\]\s*$')
_REFERENCE = re.compile(r"NOTE \[([^\]]+)\]")
_PLACEHOLDERS = {"title", "...", "{title}"}  # how this file and the docs write "a note"


def _files(paths: list[Path]) -> list[Path]:
    out = []
    for p in paths:
        out += [p] if p.is_file() else [f for f in p.rglob("*") if f.suffix in (".py", ".md", ".toml") and "__pycache__" not in f.parts]
    return out


def _definitions() -> Counter[str]:
    found: Counter[str] = Counter()
    for f in _files(DEFINING):
        for line in f.read_text().splitlines():
            m = _DEFINITION.match(line)
            if m:
                found[m.group(1)] += 1
    return found


def test_every_note_is_defined_once() -> None:
    twice = {title: n for title, n in _definitions().items() if n > 1}
    assert not twice, f"notes defined more than once: {twice}"


def test_every_note_reference_resolves() -> None:
    defined = set(_definitions())
    dangling = []
    for f in _files(REFERRING):
        for number, line in enumerate(f.read_text().splitlines(), start=1):
            for title in _REFERENCE.findall(line):
                # A title written across a line break is matched by its first words.
                if title not in _PLACEHOLDERS and title not in defined and not any(d.startswith(title) for d in defined):
                    dangling.append(f"{f.relative_to(ROOT)}:{number}: NOTE [{title}]")
    assert not dangling, "references to notes that are not defined:\n" + "\n".join(dangling)


def test_design_doc_indexes_every_note() -> None:
    index = (ROOT / "docs" / "design.md").read_text()
    missing = sorted(title for title in _definitions() if f"| {title} |" not in index)
    assert not missing, f"docs/design.md's NOTE index lacks: {missing}"
