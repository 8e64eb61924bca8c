"""The house rules the import-linter contracts (NOTE [Layers] in pyproject.toml) cannot state:
user-facing errors are ``ZeroFXError`` subclasses, and no module imports zerofx code inside a
function to dodge an import cycle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("zerofx", "passes", "cost_models")


def _modules() -> list[Path]:
    return sorted(p for folder in LIBRARY for p in (ROOT / folder).rglob("*.py"))


def _is_zerofx_import(node: ast.AST) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.level == 0 and (node.module or "").split(".")[0] == "zerofx"
    return isinstance(node, ast.Import) and any(a.name.split(".")[0] == "zerofx" for a in node.names)


def test_errors_for_bad_input_are_zerofx_errors() -> None:
    """No bare ``ValueError`` or ``TypeError`` is raised by the library: each error for bad input
    is a ``ZeroFXError`` subclass (zerofx/common/errors.py), which is a ``ValueError``, so
    ``except ValueError`` still catches it and ``except ZeroFXError`` catches every one."""
    bare = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and isinstance(node.exc.func, ast.Name) \
                    and node.exc.func.id in ("ValueError", "TypeError"):
                bare.append(f"{path.relative_to(ROOT)}:{node.lineno} raises {node.exc.func.id}")
    assert not bare, "\n".join(bare)


def test_no_function_level_imports_outside_the_app_and_lazy_exports() -> None:
    """Imports of zerofx code sit at the top of each module, where the layers contract sees them
    and a cycle fails at once. Two places import inside functions on purpose: ``zerofx/app/``,
    which keeps ``zerofx --help`` and the torch-free commands from loading torch (NOTE [A command
    line that answers at once] in zerofx/app/cli.py), and the packages' ``__init__.py`` that export
    names lazily (PEP 562) for the same reason."""
    found = []
    for path in _modules():
        rel = path.relative_to(ROOT)
        if rel.parts[:2] == ("zerofx", "app") or path.name == "__init__.py":
            continue
        for fn in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found += [f"{rel}:{n.lineno} {ast.unparse(n)}" for n in ast.walk(fn) if _is_zerofx_import(n)]
    assert not found, "imports inside functions:\n" + "\n".join(found)


def test_each_folder_under_zerofx_is_a_layer_of_the_contract() -> None:
    """Every sub-package of zerofx is named in the layers contract, and zerofx/ itself holds only
    the package's plumbing (its ``__init__``, version and checkout guard). The planner is named
    module by module, in two layers (NOTE [Layers]): every module of it is named, so a new one
    is placed on purpose, and its ``__init__`` imports nothing of zerofx, which the contract
    would not see."""
    import tomllib

    contract = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]
    named = {part.strip() for layer in contract["layers"] for part in layer.replace(":", "|").split("|")}
    folders = {f"zerofx.{p.name}" for p in (ROOT / "zerofx").iterdir() if (p / "__init__.py").is_file()}
    assert folders | {"zerofx.passes", "zerofx.cost_models"} == {".".join(n.split(".")[:2]) for n in named}
    planner = {f"zerofx.planner.{p.stem}" for p in (ROOT / "zerofx" / "planner").glob("*.py") if p.name != "__init__.py"}
    assert planner == {n for n in named if n.startswith("zerofx.planner.")}
    init = ast.parse((ROOT / "zerofx" / "planner" / "__init__.py").read_text())
    assert not [n for n in ast.walk(init) if isinstance(n, (ast.Import, ast.ImportFrom))]
    loose = sorted(p.name for p in (ROOT / "zerofx").glob("*.py"))
    assert loose == ["__init__.py", "_checkout.py", "_version.py"]


def test_parsing_a_config_imports_no_sequence_parallelism_tiling_or_analysis(tmp_path: Path) -> None:
    """``import zerofx.config`` takes the options' and plans' types from ``zerofx.passes.plan``
    (the bottom of the passes, NOTE [Layers]) and loads no module of ``zerofx.passes.sequence``
    (the mixers, ring attention, the sequence analysis), ``zerofx.passes.tiling`` or
    ``zerofx.passes.analysis``: the schema reads the mixers' config keys from
    ``zerofx.passes.plan.sequence``."""
    probe = "import sys, zerofx.config; print(' '.join(sorted(m for m in sys.modules if m.startswith('zerofx.passes'))))"
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    loaded = done.stdout.split()
    assert "zerofx.passes.plan.sequence" in loaded and "zerofx.passes.plan.tiling" in loaded, loaded
    heavy = [m for m in loaded if f"{m}.".startswith(("zerofx.passes.sequence.", "zerofx.passes.tiling.", "zerofx.passes.analysis."))]
    assert not heavy, f"import zerofx.config loads {heavy}"
