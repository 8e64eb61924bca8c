"""Test setup, and the fast tier.

The fast tier is the structural, planning, config and single-process tests:

    python -m pytest -q tests -m "not multiprocess and not inductor"

A test is marked ``multiprocess`` here, at collection, when its body or a fixture of its module
that it requests starts processes (``run_ranks``, ``subprocess``, ``mp.spawn``, ``zerofx train``,
torchrun). The full suite, ``python -m pytest -q tests``, runs everything.
"""

from __future__ import annotations

import inspect
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
# One thread per rank: the multi-process tests run several ranks on two cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")

_STARTS_PROCESSES = re.compile(r"run_ranks\(|subprocess\.|mp\.spawn|main\(\s*\[\s*\"train\"|torchrun|\.ci/")


def _source(obj: object) -> str:
    try:
        return inspect.getsource(obj)  # type: ignore[arg-type]
    except (OSError, TypeError):
        return ""


def _starts_processes(item: pytest.Item) -> bool:
    function = getattr(item, "function", None)
    module = getattr(item, "module", None)
    sources = [_source(function)] if function is not None else []
    if module is not None:
        for name in getattr(item, "fixturenames", ()):
            fixture = getattr(module, name, None)
            sources.append(_source(getattr(fixture, "__wrapped__", fixture)) if fixture is not None else "")
    return any(_STARTS_PROCESSES.search(s) for s in sources)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _starts_processes(item):
            item.add_marker(pytest.mark.multiprocess)
