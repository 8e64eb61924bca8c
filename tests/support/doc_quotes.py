"""The pages' fenced blocks, and whether a quoted output is what a command printed: for
tests/test_doc_snippets.py, and for the tests that run a documented command at a smaller size
and check its quote by shape (tests/test_sp_plan_cli.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # of the opening fence, from 1
    language: str  # the fence's info string: bash, python, or "" for quoted output
    text: str

    @property
    def first(self) -> str:
        return self.text.splitlines()[0] if self.text else ""


def doc_blocks() -> list[Block]:
    """Every fenced block of README.md and docs/*.md, in page order."""
    out = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        i = 0
        while i < len(lines):
            m = re.match(r"^```(\w*)\s*$", lines[i])
            if m is None:
                i += 1
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            out.append(Block(str(page.relative_to(ROOT)), i + 1, m.group(1), "\n".join(lines[i + 1:end])))
            i = end + 1
    return out


def quoted_block(page: str, start: str) -> Block:
    """The one plain ``` block of ``page`` whose first line starts with ``start``."""
    blocks = [b for b in doc_blocks() if b.page == page and b.language == "" and b.first.startswith(start)]
    assert len(blocks) == 1, f"{page}: {len(blocks)} quoted blocks start with {start!r}"
    return blocks[0]


def split_command(block: Block) -> tuple[str, list[str]]:
    """A quote that starts with its command, ``$ zerofx ARGS \\`` and continuation lines: the
    command (``zerofx ...``, continuations joined, a trailing ``# comment`` kept) and the quoted
    lines after it."""
    m = re.match(r"\$ ((?:.*\\\n)*.*)(?:\n|$)", block.text)
    assert m is not None and m.group(1).startswith("zerofx "), f"{block.page}:{block.line} does not start with '$ zerofx '"
    return m.group(1).replace("\\\n", " "), block.text[m.end():].splitlines()


# NOTE [Quoted output matches by line]
# A quoted block matches what the command prints when its lines appear there in order, the
# first anywhere (a quote may start part way), each next one on the next printed line,
# leading spaces aside (a quote of a graph's code leaves out its indent). A
# line that is "..." alone stands for any number of printed lines; "..." inside a line
# stands for any text there ("…" is printed text, as in a bucket's label). Every other
# character must be as printed, numbers included: zerofx plan computes its figures from the
# cost models and a fixed profile, not from the machine it runs on, so they are the same
# everywhere, and a change to the cost models or the passes that moves one fails here.
# A quote checked by shape (``shape=True``) is one whose command runs in the suite at a
# smaller size, or whose figures are the machine's (a search's seconds, a step's tokens/s):
# there a number matches any number, the unit after it any unit of the same kind (a time, a
# size), the word after it its singular or plural, two or more spaces any such run (a table's
# padding), three or more dashes any such run (its rule), and an autoplan candidate ("stage 2,
# K 8, offload none, ...") any candidate; every other word must be as printed.
_NUMBER = r"\d(?:[\d,]*\d)?(?:\.\d+)?"
_UNITS = {"time": ("ns", "µs", "us", "ms", "s"), "size": ("B", "KiB", "MiB", "GiB", "TiB", "bytes")}
_UNIT = re.compile(rf"^({_NUMBER}) ({'|'.join(u for units in _UNITS.values() for u in units)})\b")
# One candidate of zerofx plan --auto (zerofx/planner/space.py, Candidate.label, with what its
# evaluation adds): any of them, in a quote checked by shape.
CANDIDATE = (r"stage \d(?:, sp \d+)?, K \d+, offload \w+, tiling \w+(?: \([^)]*\))?(?:, recompute \w+)?(?:, inductor)?, "
             r"micro \d+ x \d+(?: \(\d+ activations? recomputed\))?")


def shape_pattern(line: str) -> str:
    """The regular expression a quoted line checked by shape stands for (NOTE [Quoted output
    matches by line]); "..." inside it is already cut out by the caller."""
    out, i = [], 0
    while i < len(line):
        rest = line[i:]
        if m := re.match(CANDIDATE, rest):
            out.append(CANDIDATE)
        elif m := _UNIT.match(rest):
            kind = next(units for units in _UNITS.values() if m.group(2) in units)
            out.append(f"{_NUMBER} (?:{'|'.join(map(re.escape, kind))})")
        elif m := re.match(rf"^{_NUMBER} (\w+?)s?\b", rest):
            out.append(f"{_NUMBER} {re.escape(m.group(1))}s?")
        elif m := re.match(_NUMBER, rest):
            out.append(_NUMBER)
        elif m := re.match(r" {2,}", rest):
            out.append(" +")
        elif m := re.match(r"-{3,}", rest):
            out.append("-+")
        else:
            m = re.match(r".", rest, flags=re.S)
            out.append(re.escape(m.group(0)))
        i += m.end()
    return "".join(out)


def quoted_mismatch(quoted: list[str], printed: list[str], *, shape: bool = False) -> str | None:
    """Where ``quoted`` stops matching ``printed``, or None (NOTE [Quoted output matches by line])."""
    at, gap = 0, True
    printed = [p.strip() for p in printed]
    for line in (q.strip() for q in quoted):
        if line.strip() == "...":
            gap = True
            continue
        pattern = re.compile(".*".join(shape_pattern(part) if shape else re.escape(part) for part in line.split("...")))
        hits = [i for i in range(at, len(printed) if gap else min(at + 1, len(printed))) if pattern.fullmatch(printed[i])]
        if not hits:
            return f"quoted {line!r} is not printed" + (f" after {printed[at - 1]!r}" if at else "") + (
                "" if gap else f"; printed there: {printed[at] if at < len(printed) else '(the end)'!r}")
        at, gap = hits[0] + 1, False
    return None
