"""The coverage matrix of docs/sequence-parallel.md is what ``python -m benchmarks.coverage_matrix``
gives (NOTE [The coverage matrix] in benchmarks/coverage_matrix.py): the docs' table is the
recorded one, the README's counts are the recording's, the recording names the corpus and the
parity runs the test files declare now, every parity case of those files is a row, and rows
computed now are the recorded ones."""

from __future__ import annotations

import pytest

from benchmarks import coverage_matrix as matrix


def test_the_docs_table_is_the_recorded_matrix() -> None:
    assert matrix.docs_table() == matrix.render(matrix.recorded())


def test_the_readme_counts_are_the_recorded_matrix() -> None:
    """README.md's claim on which models shard is counted from the recording: a model added, or
    one that starts or stops sharding or gains a parity run, changes it (``--write`` rewrites it)."""
    claim = matrix.readme_claim(matrix.recorded())
    assert claim in matrix.README.read_text(), claim
    rows = [["m", "ok", "ok: attention ring", "", "none"], ["n", "ok", "refused: ...", "", "none"]]
    assert matrix.readme_claim(rows).startswith("1 of the 2 models") and "0 with parity runs" in matrix.readme_claim(rows)


def test_the_recording_names_the_corpus_and_the_parity_the_tests_declare() -> None:
    """Parity is read from the test files as they are now: a parity case added, moved or dropped
    there changes this column, and the recording must be written again."""
    rows = matrix.recorded()
    assert [r[0] for r in rows] == [m.name for m in matrix.CORPUS]
    assert [r[-1] for r in rows] == [matrix.parity_cell(m) for m in matrix.CORPUS]


def test_every_parity_case_of_the_corpus_files_is_a_row() -> None:
    kinds = {(m.test, m.kind) for m in matrix.CORPUS}
    missing = sorted((test, kind) for test in {m.test for m in matrix.CORPUS} for kind in matrix.declared_parity(test)
                     if (test, kind) not in kinds)
    assert not missing, f"parity cases with no row in benchmarks/coverage_matrix.py's CORPUS: {missing}"


@pytest.mark.parametrize("kind", ["written", "stages"])
def test_a_row_computed_now_is_the_recorded_one(kind: str) -> None:
    """Written-out attention (ring, chosen by auto) and the declared custom ops, on fake tensors: a few seconds."""
    index = next(i for i, m in enumerate(matrix.CORPUS) if m.kind == kind)
    assert matrix.row(matrix.CORPUS[index]) == matrix.recorded()[index]


def test_a_refusal_reads_as_its_op_and_module() -> None:
    """A model sequence parallelism refuses gets the refusal's words, not an ok."""
    from tests.test_sp_custom_ops import UndeclaredLM

    model = matrix.Model("undeclared", "tests/test_sp_custom_ops.py", "none",
                         lambda: (UndeclaredLM(), *matrix.CORPUS[-1].build()[1:]))
    capture, sp, _ = matrix.computed_cells(model)
    assert capture == "ok" and sp.startswith("refused: sequence parallelism cannot shard zerofx_test::undeclared_conv in module"), sp
    assert matrix.parity_cell(model) == "none"
