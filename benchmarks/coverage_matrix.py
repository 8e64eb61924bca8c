"""The coverage matrix of docs/sequence-parallel.md: for each model of the test corpus, whether
zerofx captures it, shards it along the sequence, tiles it, and which parity tests train it.

    python -m benchmarks.coverage_matrix            # compute every row, print the table
    python -m benchmarks.coverage_matrix --write    # ... record it in benchmarks/results/coverage_matrix.json, the docs' table and the README's counts
    python -m benchmarks.coverage_matrix --check    # the docs' table is the recorded one, the recorded one what runs now

NOTE [The coverage matrix]
The corpus is ``CORPUS`` below: each kind of model the parity tests train, as their workers
build it (tests/support/*_workers.py), with the example batch they train it on. Capture, sequence parallelism and tiling are computed
in this process on fake tensors, as ``zerofx.compile`` would: capture records the step without
sequence parallelism; "sequence parallel" plans it at S = 2 with ``attention: "auto"`` (each
mixer's strategy, or the start of the refusal); "tiling" plans the captured forward with tiling on (``enabled: true``,
blocks of 4 tokens) and counts the ops it tiles by kind. Parity is what the suite's parity
tests declare: the ``cases`` (or ``stages``) of every ``test_parity*`` function, read from the
test files' source, each case's sequence-parallel size and stage, and the world size
``run_ranks`` launches (D x S where it holds several data groups); every one of them checks fp32
SGD within 1e-5 of plain PyTorch after 3 steps. Computing every row takes a minute or more on 2
cores, so the row list is recorded (``--write``, which also writes the docs' table and the
README's sentence counting what shards, ``readme_claim``); tests/test_coverage_matrix.py checks
the docs' table and the README's counts against the recording, the recording's parity column
and rows against the test files as they are now, and one row computed live against its recording.
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "coverage_matrix.json"
DOCS = ROOT / "docs" / "sequence-parallel.md"
README = ROOT / "README.md"
BEGIN, END = "<!-- coverage matrix: python -m benchmarks.coverage_matrix -->", "<!-- end of coverage matrix -->"
COLUMNS = ("model as users bring it", "capture", "sequence parallel (S = 2)", "tiling", "parity (fp32 SGD, 1e-5)")
TILE_BLOCK = 4  # tokens per tiled block: the corpus's sequences are 16 to 64 tokens


@dataclass(frozen=True)
class Model:
    """One model of the corpus: its name as users bring it, the parity test file and case kind
    that train it, and how the tests build it and its example batch."""

    name: str
    test: str  # tests/<file>.py
    kind: str  # the first item of the test's cases
    build: Callable[[], tuple[torch.nn.Module, tuple, dict]]


def _inputs(test: str, kind: str) -> tuple[torch.nn.Module, tuple, dict]:
    """The model of ``kind`` and its example batch, as ``test``'s workers build them for its parity cases."""
    import importlib

    worker = importlib.import_module(f"tests.support.{_WORKERS[test]}")
    if test == "tests/test_sp_recognition.py":
        ids, labels = worker.batches(1)
        return worker.model(kind), (worker.padded_ids(kind, ids[0]),), worker.keywords(kind, ids[0], labels[0])
    if test == "tests/test_sp_custom_ops.py":
        ids, labels = worker.batches(1)
        return worker.ConvOpsLM(), (ids[0],), {"labels": labels[0]}
    if test == "tests/test_hf_mamba.py":
        ids, labels, _ = worker.batches(1, 1, 16)
        return worker.hf_model(kind, adapt=False), (ids[0, 0],), {"labels": labels[0, 0]}
    ids, labels = worker.batches(1, 1, kind=kind) if test == "tests/test_sequence_parallel.py" else worker.batches(1, 1)
    mask = worker.attention_mask(kind, ids[0, 0]) if test == "tests/test_sequence_parallel.py" else {}
    return worker.model(kind), (ids[0, 0],), {"labels": labels[0, 0], **mask}


_WORKERS = {"tests/test_sequence_parallel.py": "sequence_parallel_workers", "tests/test_sp_recognition.py": "sp_recognition_workers",
            "tests/test_sp_conv_mixers.py": "sp_conv_workers", "tests/test_hf_mamba.py": "hf_mamba_workers",
            "tests/test_sp_custom_ops.py": "custom_op_workers"}
# Each parity test file's kinds, and the model each is, as users bring it.
_NAMES = {
    "tests/test_sequence_parallel.py": {"dna": "the bundled DNA LM (SDPA, rotary)", "llama": "Hugging Face Llama (SDPA)",
                                        "esm": "Hugging Face ESM, rotary (Nucleotide Transformer v2), padded"},
    "tests/test_sp_recognition.py": {
        "llama_eager": "Hugging Face Llama, eager attention", "written": "attention written out: ALiBi, a -inf causal mask",
        "gpt2": "Hugging Face GPT-2 (Conv1D over (B·T, C))", "encoder": "nn.TransformerEncoderLayer, batch first",
        "encoder_causal": "nn.TransformerEncoderLayer, causal mask", "flat_rows": "position ids and the loss over (B·T, ·) rows",
        "bert": "Hugging Face BERT (DNABERT), padded",
        "esm_absolute": "Hugging Face ESM, absolute positions (Nucleotide Transformer v1), padded",
        "spelled": "attention written out: a boolean mask filled in, the scale after the mask, 3-d bmm",
        "mha_weights": "nn.MultiheadAttention returning its weights (3-d baddbmm and bmm)",
        "fft_reference": "FFT convolution as HyenaDNA's reference spells it", "fft_ortho": "FFT convolution in ortho norms",
        "fft_long_filter": "FFT convolution, a filter longer than T cut to T",
        "fft_unsqueeze": "FFT convolution, the filter's spectrum unsqueezed",
        "cached_rotary": "rotary tables cached on the module during forward",
        "mistral": "Hugging Face Mistral", "qwen2": "Hugging Face Qwen2", "gemma": "Hugging Face Gemma (one key/value head)",
        "phi": "Hugging Face Phi", "starcoder2": "Hugging Face Starcoder2", "gpt_neox": "Hugging Face GPT-NeoX",
        "gptj": "Hugging Face GPT-J (rotary tables repeated and stacked)",
        "bigcode": "Hugging Face GPTBigCode (multi-query attention)",
        "mpt": "Hugging Face MPT (ALiBi, a boolean causal mask filled in)",
        "bloom": "Hugging Face BLOOM (ALiBi by baddbmm, the scores viewed to 4-d)", "falcon": "Hugging Face Falcon",
        "opt": "Hugging Face OPT", "roberta": "Hugging Face RoBERTa", "distilbert": "Hugging Face DistilBERT",
        "electra": "Hugging Face ELECTRA", "modernbert": "Hugging Face ModernBERT"},
    "tests/test_sp_conv_mixers.py": {"hyena": "hyena-tiny (bundled Hyena)", "striped": "striped-tiny (bundled StripedHyena 2)",
                                     "convsum": "a Conv1d and cumsum model",
                                     "longconv": "long convolutions written as direct conv1d (64 and 40 taps over 64)"},
    "tests/test_hf_mamba.py": {"mamba": "Hugging Face Mamba", "mamba2": "Hugging Face Mamba-2",
                               "jamba": "Hugging Face Jamba (attention, Mamba, MoE)"},
    "tests/test_sp_custom_ops.py": {"stages": "torch.library ops declared by their user"},
}
CORPUS = tuple(Model(name, test, kind, functools.partial(_inputs, test, kind)) for test, names in _NAMES.items()
               for kind, name in names.items())


# --------------------------------------------------------------------------- parity, from the tests' source
def _literal(node: ast.AST) -> Any:
    try:
        return ast.literal_eval(node)
    except ValueError:
        return None


def declared_parity(test: str) -> dict[str, list[tuple[int, int, int]]]:
    """The parity cases of ``test``'s ``test_parity*`` functions by kind: (world size, sequence-parallel size, stage)."""
    tree = ast.parse((ROOT / test).read_text())
    found: dict[str, list[tuple[int, int, int]]] = {}
    for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_parity")):
        cases, world = [], None
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                if node.targets[0].id == "cases":
                    cases = _literal(node.value) or []
                elif node.targets[0].id == "stages":
                    cases = [("stages", stage) for stage in _literal(node.value) or []]
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "run_ranks" and node.args:
                world = _literal(node.args[0])
        assert world is not None, f"{test}::{fn.name} launches no run_ranks(<int>, ...)"
        for case in cases:
            size = case[2] if len(case) > 2 and isinstance(case[2], int) else world  # (kind, stage, strategy): one group of all ranks
            found.setdefault(case[0], []).append((world, size, case[1]))
    return found


def parity_cell(model: Model) -> str:
    runs = sorted(set(declared_parity(model.test).get(model.kind, [])))
    if not runs:
        return "none"
    words = []
    for world, size, stage in runs:
        layout = "no sequence parallelism" if size == 1 else f"S = {size}" if world == size else f"D {world // size} × S {size}"
        words.append(f"{layout}, stage {stage}")
    return f"{'; '.join(words)} (`{model.test}`)"


# --------------------------------------------------------------------------- capture, sequence parallelism, tiling
def _first_line(exc: BaseException) -> str:
    text = str(exc).split("\n")[0]
    return text if len(text) <= 120 else text[:117] + "..."


def computed_cells(model: Model) -> tuple[str, str, str]:
    """Capture, sequence parallelism at S = 2 and tiling, computed now on fake tensors."""
    from zerofx.compiler.pipeline import StepCapture
    from zerofx.passes.plan.tiling import TilingOptions
    from zerofx.passes.plan.sequence import SequenceParallelSpec

    net, args, kwargs = model.build()
    try:
        whole = StepCapture(net, args, kwargs)
        whole.forward_record()
        capture = "ok"
    except Exception as exc:  # the cell says why
        return f"fails: {_first_line(exc)}", "—", "—"
    try:
        spec = SequenceParallelSpec(size=2, mixers=(("attention", "auto"),))
        _, plan = StepCapture(net, args, kwargs, sequence_parallel=spec).sequence_forward()
        sp = f"ok: {', '.join(f'{name} {strategy}' for name, strategy in plan.strategies)}"
    except Exception as exc:  # the refusal, by op and module
        sp = f"refused: {_first_line(exc).split(': ', 1)[-1]}"
    try:
        tiled = whole.tiling_plan(TilingOptions(enabled=True, block_size=TILE_BLOCK, attention_block_size=TILE_BLOCK))
        kinds: dict[str, int] = {}
        for op in tiled.ops if tiled is not None else ():
            kinds[op.kind] = kinds.get(op.kind, 0) + 1
        tiling = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items())) or "nothing tiled"
    except Exception as exc:
        tiling = f"refused: {_first_line(exc)}"
    return capture, sp, tiling


def row(model: Model) -> list[str]:
    return [model.name, *computed_cells(model), parity_cell(model)]


def render(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in r) + " |" for r in rows]
    return "\n".join(lines)


def docs_table() -> str:
    text = DOCS.read_text()
    return text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip()


def readme_claim(rows: list[list[str]]) -> str:
    """The README's sentence on which models shard, counted from the matrix's rows."""
    sharded = [r for r in rows if r[2].startswith("ok")]
    hf = sum(r[0].startswith("Hugging Face") for r in sharded)
    parity = sum(r[-1] != "none" for r in sharded)
    return (f"{len(sharded)} of the {len(rows)} models of the [coverage matrix](docs/sequence-parallel.md#coverage-matrix) "
            f"shard at S = 2 ({hf} Hugging Face models among them), {parity} with parity runs against plain PyTorch; "
            f"the {len(rows) - len(sharded)} others are refused naming the op and module.")


def _write_docs(rows: list[list[str]]) -> None:
    """The docs' table and the README's counts from ``rows``."""
    text = DOCS.read_text()
    DOCS.write_text(text[:text.index(BEGIN) + len(BEGIN)] + "\n" + render(rows) + "\n" + text[text.index(END):])
    lines = README.read_text().splitlines(keepends=True)
    at = [i for i, line in enumerate(lines) if "models of the [coverage matrix]" in line]
    assert len(at) == 1, "README.md holds no line (or several) with the coverage matrix's counts"
    lines[at[0]] = "  " + readme_claim(rows) + "\n"
    README.write_text("".join(lines))


def recorded() -> list[list[str]]:
    return json.loads(RESULTS.read_text())["rows"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.coverage_matrix", description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help="record the rows in benchmarks/results/coverage_matrix.json")
    parser.add_argument("--check", action="store_true", help="exit 1 unless the docs' table and the recording are what runs now")
    opts = parser.parse_args(argv)
    rows = [row(m) for m in CORPUS]
    table = render(rows)
    print(table)
    if opts.write:
        RESULTS.write_text(json.dumps({"columns": list(COLUMNS), "rows": rows}, indent=1, ensure_ascii=False) + "\n")
        _write_docs(rows)
    if opts.check and (rows != recorded() or docs_table() != table or readme_claim(rows) not in README.read_text()):
        print("the recorded matrix, the docs' table or the README's counts differ from what runs now: rerun with --write",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
