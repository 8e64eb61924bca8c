"""Refuses, on import, a folder that shadows the installed zerofx package.

NOTE [A checkout that shadows the package]
Python looks for ``zerofx`` along ``sys.path``, where the working directory (or the script's
folder) comes before the installed package. Two kinds of folder found there shadow it:
- From inside a checkout that is not the installed one, its ``zerofx/``. The ``passes/`` and
  ``cost_models/`` beside it become ``zerofx.passes`` and ``zerofx.cost_models`` only when
  installed, so ``zerofx.passes`` is then missing (a regular install elsewhere) or another
  checkout's (an editable install of that one). ``zerofx/__init__.py`` imports this module
  before anything else: ``import zerofx`` raises ``ImportError`` naming the folder.
- From the folder above a clone named ``zerofx``, the clone itself. It has no
  ``__init__.py``, so Python imports it as an empty namespace package and runs none of
  zerofx's code: a bare ``import zerofx`` succeeds and ``zerofx.compile`` is an
  ``AttributeError``, which nothing here can improve. (A repository-root ``__init__.py`` would
  run, but pytest imports a rootdir's ``__init__.py`` as a package, which would break the test
  suite in every clone named ``zerofx``.) With an editable install, the first zerofx module
  imported through that empty package (``python -m zerofx.app.cli``, ``zerofx.app.training``,
  ``zerofx.runtime.engine``: everything that imports ``zerofx.common.errors``) loads from the install, and
  ``zerofx.common.errors`` imports this module, which raises ``ImportError`` naming the folder.
A regular install, and an editable install in setuptools' strict mode (``pip install -e .
--config-settings editable_mode=strict``), put a folder holding a regular ``zerofx`` package on
``sys.path``, which Python prefers to a namespace package: from the folder above a clone they
import the installed package, and nothing is shadowed. The default (lenient) editable install
adds a finder after the path search instead, which a namespace package found on the way beats.
A regular install, or an editable install of this checkout, used from any other folder (the
checkout's own root included) passes both checks; so does the ``zerofx`` console script from
anywhere, since it puts its own folder, not the working directory, on ``sys.path``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def check_not_shadowed(package_dir: Path) -> None:
    """Raise ``ImportError`` naming the folder unless the ``zerofx`` package imported is the
    one installed with ``package_dir``, and ``zerofx.passes`` is installed beside it (an
    editable install of a checkout) or inside it (a regular install)."""
    package = sys.modules.get("zerofx")
    if package is not None and getattr(package, "__file__", None) is None:  # an empty namespace package
        folder = Path(next(iter(package.__path__), "."))
        raise ImportError(
            f"the folder {folder} shadows the installed zerofx ({package_dir}): it has no __init__.py, so Python imported it "
            f"as an empty namespace package because {folder.parent} is on sys.path (the working directory or the script's "
            f"folder). Run Python from another folder", name="zerofx")
    spec = importlib.util.find_spec("zerofx.passes")
    found = None if spec is None or spec.origin is None else Path(spec.origin).resolve().parent
    if found in (package_dir / "passes", package_dir.parent / "passes"):
        return
    where = "is missing (this checkout is not installed)" if found is None else f"comes from {found}, another copy"
    raise ImportError(
        f"the folder {package_dir} shadows the installed zerofx: Python imported it because {package_dir.parent} is on "
        f"sys.path (the working directory or the script's folder), and zerofx.passes {where}. Run Python from another "
        f"folder, or install this checkout: pip install -e {package_dir.parent}", name="zerofx")


check_not_shadowed(Path(__file__).resolve().parent)
