"""The docs agree with the tree and the code: every relative link in README.md, docs/*.md and
benchmarks/results/README.md reaches an existing file (and heading, when it names one), every
file in benchmarks/results/ is listed in that folder's index, and docs/design.md's table of the
compile spine names zerofx/compiler/pipeline.py's stages and pass lists, in order."""

from __future__ import annotations

import ast
import inspect
import re
import types
from pathlib import Path

from zerofx.compiler import pipeline

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), RESULTS / "README.md"]

_FENCE = re.compile(r"^(```|~~~).*?^\1", flags=re.S | re.M)
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6} (.+?)\s*$", flags=re.M)


def _prose(text: str) -> str:
    """``text`` without its fenced code blocks and inline code, where brackets are not links."""
    return re.sub(r"`[^`\n]*`", "", _FENCE.sub("", text))


def _anchors(page: Path) -> set[str]:
    """The heading anchors GitHub gives ``page``: lower case, punctuation dropped, spaces as
    hyphens, a repeated anchor suffixed -1, -2 and so on."""
    seen: dict[str, int] = {}
    out = set()
    for title in _HEADING.findall(_FENCE.sub("", page.read_text())):
        slug = re.sub(r"[^\w\- ]", "", title.replace("`", "").strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_every_relative_link_resolves() -> None:
    broken = []
    for page in PAGES:
        for target in _LINK.findall(_prose(page.read_text())):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "links that reach nothing:\n" + "\n".join(broken)


def test_every_result_is_in_the_index() -> None:
    index = RESULTS / "README.md"
    linked = {(RESULTS / t.partition("#")[0]).resolve() for t in _LINK.findall(_prose(index.read_text()))}
    unlisted = sorted(f.name for f in RESULTS.iterdir() if f.is_file() and f != index and f.resolve() not in linked)
    assert not unlisted, f"benchmarks/results/README.md does not list: {unlisted}"


def _pass_names(list_fn: types.FunctionType) -> list[str]:
    """The pass names ``list_fn`` returns with every optional pass switched on: a stand-in plan
    whose attributes are all set, and each boolean keyword ``True``."""
    plan = types.SimpleNamespace(recompute=None, param_offload=object(), offload_grads=True, reduce_scatter_by_all_to_all=True)
    args, kwargs = [], {}
    for p in inspect.signature(list_fn).parameters.values():
        if p.default is inspect.Parameter.empty:
            value = plan if p.name == "plan" else "group"
            args.append(value) if p.kind is p.POSITIONAL_OR_KEYWORD else kwargs.__setitem__(p.name, value)
        elif isinstance(p.default, bool):
            kwargs[p.name] = True
    return [name for name, _ in list_fn(*args, **kwargs)]


def _stage_passes() -> dict[str, list[str]]:
    """Per stage, the passes its ``run_stage(stage, run_passes, gm, <list>(...))`` calls apply,
    in the order those calls appear in zerofx/compiler/pipeline.py."""
    out: dict[str, list[str]] = {}
    calls = [n for n in ast.walk(ast.parse(Path(pipeline.__file__).read_text()))
             if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "run_stage"]
    for node in sorted(calls, key=lambda n: (n.lineno, n.col_offset)):
        stage, runner, *rest = node.args
        if getattr(runner, "id", None) != "run_passes":
            continue
        for arg in rest:
            name = getattr(getattr(arg, "func", None), "id", "")
            if name.endswith("_passes"):
                names = _pass_names(getattr(pipeline, name))
                out.setdefault(stage.value, []).extend(n for n in names if n not in out.get(stage.value, []))
    return out


def test_design_stage_table_matches_the_pipeline() -> None:
    """The table under "The compile spine" (whose rows tests/test_pipeline.py holds to
    ``pipeline.STAGES``): each row names the ``*_pass`` rewrites its stage applies, in the order
    it applies them."""
    design = (ROOT / "docs" / "design.md").read_text()
    section = design.split("## The compile spine", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:-1] for line in section.splitlines() if line.startswith("| ") and not line.startswith("| stage")]
    documented = {cells[0].strip(): re.findall(r"`(\w+_pass)`", cells[1]) for cells in rows}
    run = _stage_passes()
    assert set(run) <= set(pipeline.STAGES) and run, run
    for stage in pipeline.STAGES:
        named = documented.get(stage, [])
        assert named == run.get(stage, []), f"stage {stage}: docs/design.md names {named}, the pipeline runs {run.get(stage, [])}"
