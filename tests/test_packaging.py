"""The installed import names are zerofx, zerofx.passes and zerofx.cost_models: the repository's
top-level passes/ and cost_models/ never land in site-packages under generic names."""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CHECK = """
import importlib, sys
for generic in ("passes", "cost_models"):
    try:
        importlib.import_module(generic)
    except ImportError:
        continue
    sys.exit(f"{generic} is importable")
import zerofx.passes, zerofx.cost_models, zerofx.passes.plan
print(zerofx.passes.__file__)
"""


def _check(python: str, cwd: Path) -> str:
    done = subprocess.run([python, "-c", CHECK], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr + done.stdout
    return done.stdout.strip()


@pytest.mark.multiprocess  # _check runs a subprocess
def test_editable_install_exposes_only_zerofx_names(tmp_path: Path) -> None:
    # Outside the repository, so the current folder does not put passes/ on sys.path.
    assert Path(_check(sys.executable, tmp_path)) == ROOT / "passes" / "__init__.py"


def _see_this_interpreters_packages(python: str) -> None:
    """Let the venv at ``python`` import torch and its dependencies from the interpreter that runs
    the tests, wherever that one has them: its own venv (as the README installs), a folder another
    ``.pth`` file added, the user site or the system. A ``.pth`` file lists the folders on this
    interpreter's ``sys.path`` after the venv's own, so the wheel installed into the venv is found
    first. The checkout is left out (its ``passes/`` would be importable under that generic name),
    and the listed folders' own ``.pth`` files are not run, so this interpreter's editable install
    of zerofx stays out too."""
    checkout = {ROOT, ROOT / "tests"}
    folders = [f for f in sys.path if f and Path(f).is_dir() and Path(f).resolve() not in checkout]
    own = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True, timeout=60).stdout.strip()
    Path(own, "zerofx-test-parent-env.pth").write_text("".join(f"{f}\n" for f in folders))


def test_wheel_installs_passes_under_zerofx(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(ROOT)],
                   check=True, timeout=300, capture_output=True)
    (wheel,) = wheels.glob("zerofx-*.whl")
    env = tmp_path / "venv"
    venv.create(env, with_pip=True)
    python = str(env / "bin" / "python")
    _see_this_interpreters_packages(python)
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True, timeout=300, capture_output=True)
    installed = Path(_check(python, tmp_path))
    assert env in installed.parents and installed.parent.name == "passes" and installed.parent.parent.name == "zerofx"


def test_private_torch_imports_live_in_the_compat_module() -> None:
    """Every import of a private torch module (a dotted name with a part starting with ``_``)
    is in zerofx/passes/_compat.py, the one file to touch when torch moves them."""
    import re

    private = re.compile(r"^\s*(?:from|import)\s+((?:torch|functorch)(?:\.\w+)*)", re.M)
    offenders = []
    for folder in ("zerofx", "passes", "cost_models"):
        for path in (ROOT / folder).rglob("*.py"):
            if path == ROOT / "passes" / "_compat.py":
                continue
            for module in private.findall(path.read_text()):
                if any(part.startswith("_") for part in module.split(".")):
                    offenders.append(f"{path.relative_to(ROOT)}: {module}")
    assert not offenders, offenders


def test_every_package_folder_is_installed() -> None:
    """setuptools installs exactly the packages ``[tool.setuptools] packages`` names, so every
    folder with an ``__init__.py`` under zerofx/, passes/ and cost_models/ is named there (a
    feature folder of passes/ left out would be missing from every regular install)."""
    import tomllib

    named = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = set()
    for folder, package in (("zerofx", "zerofx"), ("passes", "zerofx.passes"), ("cost_models", "zerofx.cost_models")):
        for init in (ROOT / folder).rglob("__init__.py"):
            on_disk.add(".".join([package, *init.parent.relative_to(ROOT / folder).parts]))
    assert on_disk == named, (sorted(on_disk - named), sorted(named - on_disk))
