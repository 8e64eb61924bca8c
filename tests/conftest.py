"""Test setup, and the fast tier.

The fast tier is the structural, planning, config and single-process tests, without those
marked ``slow``:

    python -m pytest -q -n 2 --dist loadfile tests -m "not multiprocess and not inductor and not slow"

A test is marked ``multiprocess`` here, at collection, when its body or a fixture of its module
that it requests starts processes (``run_ranks``, ``subprocess``, ``mp.spawn``, a ``["train", ...]``
argument list for ``zerofx train``, torchrun), or when it carries the mark itself (a test whose
helper starts them). The full suite, ``python -m pytest -q -n 2 --dist loadfile tests``, runs everything.
"""

from __future__ import annotations

import atexit
import gc
import inspect
import os
import re
import shutil
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
# NOTE [Threads per test process]
# One torch thread per process: the two xdist workers and the up to four ranks each multi-rank
# test starts already outnumber CI's two cores, and more threads per process only add context
# switches. A caller's OMP_NUM_THREADS is kept when it is at most the cores this process may
# use (os.sched_getaffinity), and capped there otherwise: a shell set up for a larger machine
# (OMP_NUM_THREADS=16) does not oversubscribe a small one. The ranks and commands the tests
# start inherit the variable.
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
_asked = os.environ.get("OMP_NUM_THREADS", "1")
os.environ["OMP_NUM_THREADS"] = str(max(1, min(int(_asked) if _asked.isdigit() else 1, _CORES)))
# NOTE [The suite's plan cache]
# The plan cache is on, as it is for users (docs/plan-cache.md), in a directory this run
# creates and removes, shared by the xdist workers and every rank and command they start (they
# inherit the variable). Many tests build the same program again (a fresh engine that loads a
# checkpoint, the ranks of another call with the same model and config); those builds load
# it, which cuts about 15% of the CPU time of the engine tests. Every program is still built
# cold the first time, the cache's own tests check that a hit trains bit for bit like the cold
# build, and a test that checks what a cold build does or prints turns the cache off in its
# config ("zerofx": {"plan_cache": false}). A ZEROFX_PLAN_CACHE set by the caller is kept.
if "ZEROFX_PLAN_CACHE" not in os.environ:
    os.environ["ZEROFX_PLAN_CACHE"] = tempfile.mkdtemp(prefix="zerofx-test-plans-")
    _PLAN_CACHE_OWNER = os.getpid()

    @atexit.register
    def _remove_plan_cache() -> None:
        if os.getpid() == _PLAN_CACHE_OWNER:  # not in a process forked from this one
            shutil.rmtree(os.environ["ZEROFX_PLAN_CACHE"], ignore_errors=True)

# The data cache (zerofx.data.prepared.data_cache_dir): a FASTA given to zerofx train is prepared
# there on first use; the suite's goes in a directory this run creates and removes, as the plans do.
if "ZEROFX_DATA_CACHE" not in os.environ:
    os.environ["ZEROFX_DATA_CACHE"] = tempfile.mkdtemp(prefix="zerofx-test-data-")
    _DATA_CACHE_OWNER = os.getpid()

    @atexit.register
    def _remove_data_cache() -> None:
        if os.getpid() == _DATA_CACHE_OWNER:
            shutil.rmtree(os.environ["ZEROFX_DATA_CACHE"], ignore_errors=True)

# Python's cycle collector in the test processes. The planning tests build and drop FX graphs of
# millions of objects, and with the default thresholds each full collection also walked every
# object torch, transformers and zerofx made at import: 20% of tests/test_autoplan.py's time
# alone (28 s of 138 s), 13% of tests/test_planning.py's and tests/test_tiling.py's. Once the
# test modules are imported (pytest_collection_finish), the objects that exist then are moved
# out of the collector's sight for good (gc.freeze: they are modules, classes and functions,
# not garbage), and the youngest generation is collected every 2,000 allocations instead of
# 700 (GC_FIRST_GENERATION). tests/test_autoplan.py then takes 118 s, its peak resident memory
# the same. The pooled ranks do the same when they start (tests/support/dist_utils.py): four
# multi-rank files took 103 s against 110 s. Nothing that frees memory depends on it: a tensor
# is freed when its last reference goes, which is what the tests that count freed tensors
# check. A rank started for one call and the commands the tests start keep Python's defaults.
def pytest_collection_finish(session: pytest.Session) -> None:
    from tests.support.dist_utils import GC_FIRST_GENERATION

    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_FIRST_GENERATION, *gc.get_threshold()[1:])


_STARTS_PROCESSES = re.compile(r"run_ranks\(|subprocess\.|mp\.spawn|\[\s*\"train\"|torchrun|\.ci/")


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


# NOTE [The longest files first]
# pytest-xdist hands whole files to its two workers in queue order (--dist loadfile), so a long
# file started last leaves the other worker idle at the end (25 s of a 525 s run, measured).
# The queue is the collection order, longest files first (durations of the full suite on 2
# cores, 2026-12-07, every file of a second or more; a stale order only costs balance). xdist
# 3 would reorder files by their number of tests instead, which puts many quick parametrized
# cases first: pytest_configure turns that off.
LONGEST_FIRST = ("test_autoplan.py", "test_planning.py", "test_tiling.py", "test_capped.py", "test_checkpoint.py",
                 "test_core_parity.py", "test_genomic_models.py", "test_predictions.py", "test_quickstart.py", "test_train_signals.py",
                 "test_sequence_parallel.py", "test_sp_inductor.py", "test_compile.py", "test_sp_zero_compose.py", "test_sp_conv_mixers.py",
                 "test_tiling_mixers.py", "test_sp_plan_cli.py", "test_offload.py", "test_recompute.py", "test_sp_scan_mixer.py", "test_sp_batch_one.py",
                 "test_sp_recognition.py", "test_genome_data.py", "test_doc_snippets.py", "test_trust.py", "test_sp_custom_ops.py",
                 "test_cost_models.py", "test_engine_faults.py", "test_multinode.py", "test_meta_init.py", "test_bench_smoke.py",
                 "test_sp_planning.py", "test_core_passes.py", "test_hierarchical.py", "test_grad_offload.py",
                 "test_sp_checkpoint.py", "test_packaging.py", "test_genome_cli.py", "test_own_data.py", "test_hf_mamba.py",
                 "test_comm_model.py", "test_training.py", "test_plan_cache.py", "test_plan_output.py", "test_monitors.py",
                 "test_sweep.py", "test_infinity_plan.py", "test_core_api.py", "test_layers.py", "test_docs.py", "test_coverage_matrix.py",
                 "test_module_state.py")


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist 3
        config.option.loadscopereorder = False


def _file_rank(item: pytest.Item) -> int:
    name = os.path.basename(str(item.fspath))
    return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_file_rank)  # stable: within a file, and among the rest, the order stays
    for item in items:
        if _starts_processes(item):
            item.add_marker(pytest.mark.multiprocess)
