"""Every ```bash and ```python block in README.md and docs/*.md is run or checked by the suite,
or marked in the page as a fragment; the outputs the docs quote are what the commands print.

``BLOCKS`` says how each block is run, keyed by its page and the start of its first line:

- ``Run``: as written, after the substitutions it lists (smaller sizes). Python runs in this
  process (a model spec a page defines must build what examples/own_models.py builds); each
  ``zerofx`` command runs in this process through ``zerofx.app.cli.main`` and must exit 0, in
  a folder holding small stand-ins for the files the page names (``GRCh38.fa.gz``, ``ds.json``,
  ...). A ``zerofx train`` command runs every check ``zerofx train`` makes in the calling
  process (flags, genome, model spec, vocabulary, config, output folder) and prepares the
  genome, then stops where the ranks would start.
- ``Flags``: each command's flags are parsed by the parser of the program it starts (a
  benchmark's, torchrun's, zerofx's, pytest's files and markers); for runs of minutes or hours
  and for commands of a cluster.
- ``Elsewhere``: a named test in another file runs it.
- A block whose first line is ``# fragment: ...`` is a part of a program, and that line names
  every name the fragment reads without defining it. A Python fragment runs up to the first
  statement that reads one, and the ``zerofx.`` names and ``engine.`` methods it uses exist; a
  bash fragment names only flags its subcommand takes.

A block in neither ``BLOCKS`` nor marked fails ``test_every_block_is_run_or_marked``, so a new
page's commands cannot go unchecked. ``OUTPUTS`` runs the commands whose output a page quotes
in a plain block and compares the quoted lines (NOTE [Quoted output matches by line]); a
quoted ``$ zerofx ...`` block not run is listed in ``NOT_RUN`` with the reason. Commands in
plain blocks parse; a synopsis names exactly its subcommand's flags; flags in inline commands
exist, and so do the inline ``zerofx.x`` names (a config key or an importable name); each
```json block is a config zerofx takes. What docs/training.md says esm_mlm can learn is computed
from the bundled genome.
"""
from __future__ import annotations

import argparse
import contextlib
import gzip
import importlib
import io
import json
import math
import re
import shlex
import subprocess
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable

import pytest

from zerofx.app import cli, training
from zerofx.runtime.engine import Engine

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FRAGMENT = "# fragment:"


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


# --------------------------------------------------------------------------- how blocks run
@dataclass(frozen=True)
class Run:
    subs: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Flags:
    subs: tuple[tuple[str, str], ...] = ()
    in_user_folder: bool = False  # else in the repository, where the benchmarks' paths are


@dataclass(frozen=True)
class Elsewhere:
    test: str  # "tests/test_x.py::test_name"


_QUICKSTART = "tests/test_quickstart.py::"
_SMALLER_1B = (('DNA_LM_SIZES["1b"]', 'DNA_LM_SIZES["tiny"]'),)
BLOCKS: dict[tuple[str, str], Run | Flags | Elsewhere] = {
    ("README.md", "python3 -m venv .venv"): Elsewhere(_QUICKSTART + "test_ci_runs_the_readme_commands_in_a_fresh_venv"),
    ("README.md", "python -m pytest -q -n 2"): Elsewhere(_QUICKSTART + "test_ci_runs_the_readme_commands_in_a_fresh_venv"),
    ("README.md", "import torch"): Elsewhere(_QUICKSTART + "test_readme_python_blocks_run_as_written"),
    ("README.md", '"""zerofx\'s training API on 2 ranks'): Elsewhere(_QUICKSTART + "test_quickstart_under_torchrun"),
    ("docs/api.md", "import torch, zerofx"): Run(_SMALLER_1B),
    ("docs/benchmarks.md", "python -m benchmarks."): Flags(),
    ("docs/benchmarks.md", "MALLOC_MMAP_THRESHOLD_="): Flags(),
    ("docs/capped.md", "MALLOC_MMAP_THRESHOLD_="): Flags(),
    ("docs/checkpoints.md", "zerofx consolidate"): Elsewhere("tests/test_checkpoint.py::test_consolidate_cli"),
    ("docs/config.md", "zerofx config-schema"): Run(),
    ("docs/design.md", "grep -rnE"): Run(),
    ("docs/predictions.md", "python -m benchmarks.bench_predictions"): Flags(),
    ("docs/testing.md", "python -m pytest"): Flags(),
    ("docs/training.md", "# your genome, the bundled model"): Run(),
    ("docs/training.md", "zerofx data prepare hg38.fa.gz"): Run(),
    ("docs/training.md", "printf 'hg38.fa.gz"): Run(),
    ("docs/training.md", "import torch"): Run(),
    ("docs/training.md", "zerofx train --model examples/own_models.py:"): Run(),
    ("docs/training.md", "# on each of 2 nodes"): Flags(in_user_folder=True),
    ("docs/training.md", "#!/bin/bash"): Flags((('"$SLURM_NNODES"', "2"), ('"$HEAD:29500"', "head:29500"), ('"$SLURM_JOB_ID"', "1")),
                                             in_user_folder=True),
}


def _entry(block: Block) -> Run | Flags | Elsewhere | None:
    found = [how for (page, start), how in BLOCKS.items() if page == block.page and block.first.startswith(start)]
    assert len(found) <= 1, f"{block.page}:{block.line}: more than one BLOCKS entry starts its first line"
    return found[0] if found else None


CODE = [b for b in doc_blocks() if b.language in ("bash", "python")]


def test_every_block_is_run_or_marked() -> None:
    loose = [f"{b.page}:{b.line} {b.first!r}" for b in CODE if not b.first.startswith(FRAGMENT) and _entry(b) is None]
    assert not loose, ("blocks neither run (an entry in BLOCKS of tests/test_doc_snippets.py) nor marked "
                       f"'{FRAGMENT} ...' on their first line:\n" + "\n".join(loose))
    used = {(b.page, start) for b in CODE for (page, start) in BLOCKS if page == b.page and b.first.startswith(start)}
    assert used == set(BLOCKS), f"BLOCKS entries that match no block: {sorted(set(BLOCKS) - used)}"


def _commands(text: str, subs: tuple[tuple[str, str], ...]) -> list[str]:
    """The block's command lines: continuations joined, substitutions made, comment lines dropped."""
    for old, new in subs:
        assert old in text, f"substitution {old!r} matches nothing"
        text = text.replace(old, new)
    joined = re.sub(r"\\\n\s*", " ", text)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _argv(command: str) -> list[str]:
    """The program's arguments, without a leading ``$`` prompt, ``VAR=value`` settings, ``srun`` and ``nice``."""
    argv = shlex.split(command, comments=True)
    while argv and (re.match(r"^[A-Z_]+=", argv[0]) or argv[0] in ("srun", "$")):
        argv = argv[1:]
    if argv[:2] == ["nice", "-n"]:
        argv = argv[3:]
    return argv


class _Parsed(Exception):
    """Raised in place of running a program once its flags are parsed."""


def _parse_only(monkeypatch: pytest.MonkeyPatch) -> None:
    original = argparse.ArgumentParser.parse_args

    def parse_args(self: argparse.ArgumentParser, args: Any = None, namespace: Any = None) -> argparse.Namespace:
        raise _Parsed(original(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)


def _check_flags(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Parse ``argv`` with its program's own parser; an unknown flag or a bad value fails."""
    if argv[0] == "zerofx":
        cli.build_parser().parse_args(argv[1:])
    elif argv[:3] == ["python", "-m", "pytest"]:
        _check_pytest(argv[3:])
    elif argv[:2] == ["python", "-m"] and argv[2].startswith("benchmarks."):
        main = importlib.import_module(argv[2]).main
        with monkeypatch.context() as m:
            _parse_only(m)
            m.setattr("sys.argv", [argv[2], *argv[3:]])
            with pytest.raises(_Parsed):
                main(argv[3:]) if main.__code__.co_argcount else main()
    elif argv[0] == "torchrun":
        from torch.distributed.run import get_args_parser

        args = get_args_parser().parse_args(argv[1:])
        assert args.module and args.training_script == "zerofx.app.cli", argv
        _check_flags(["zerofx", *args.training_script_args], monkeypatch)
    else:
        raise AssertionError(f"no parser for {argv[0]!r}: {shlex.join(argv)}")


def _check_pytest(args: list[str]) -> None:
    """pytest's arguments: the files exist and ``-m`` names registered markers."""
    import tomllib

    markers = {m.split(":")[0] for m in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]}
    i = 0
    while i < len(args):
        a = args[i]
        if a in ("-n", "--dist", "-m"):
            if a == "-m":
                named = set(re.findall(r"\w+", args[i + 1])) - {"not", "and", "or"}
                assert named <= markers, f"-m names unregistered markers {named - markers}"
            i += 2
            continue
        assert a.startswith("-") or (ROOT / a).exists(), f"pytest argument {a!r}: no such file"
        i += 1


_SHELL = ("printf ", "grep ")  # run by bash, in the folder the block runs in


def _run_command(command: str, launched: list[training.TrainOptions]) -> str:
    """Run one command line of a block; return what it printed."""
    argv = _argv(command)
    if argv[0] == "zerofx":
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = cli.main(argv[1:])
        assert code == 0, f"{command!r} exited {code}:\n{out.getvalue()[-2000:]}"
        if argv[1] == "train":
            assert launched, f"{command!r} started no ranks"
            launched.clear()
        return out.getvalue()
    assert command.startswith(_SHELL), f"a command the docs test does not run: {command!r}"
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{command!r} exited {done.returncode}: {done.stderr[-2000:]}"
    return done.stdout


@pytest.fixture
def user_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder holding small stand-ins for the files the pages name (genomes whose records share
    names, as assemblies do; a config) and ``examples/``; ``zerofx train`` there stops where the
    ranks would start."""
    import random

    (tmp_path / "examples").symlink_to(ROOT / "examples")
    rng = random.Random(0)

    def genome(name: str, records: tuple[str, ...]) -> None:
        with gzip.open(tmp_path / name, "wt") as f:
            for record in records:
                f.write(f">{record}\n" + "".join(rng.choice("ACGT") for _ in range(12_000)) + "\n")

    genome("GRCh38.fa.gz", ("chr1", "chr2"))
    genome("hg38.fa.gz", ("chr1", "chr20", "chr21"))
    genome("mm39.fa.gz", ("chr1",))
    genome("danRer11.fa.gz", ("chr1",))
    (tmp_path / "ds.json").write_text((ROOT / "examples" / "dna_lm_zero3.json").read_text())
    (tmp_path / "benchmarks").symlink_to(ROOT / "benchmarks")
    configs = {  # the configs the pages name, as they give them
        "recompute.json": {"zerofx": {"recompute": True}},
        "recompute-auto.json": {"zerofx": {"recompute": "auto", "memory_budget": "570KiB"}},
        "pf2.json": {"zero_optimization": {"stage": 3}, "zerofx": {"prefetch_distance": 2}},
        "gas2.json": {"zero_optimization": {"stage": 3}, "gradient_accumulation_steps": 2, "train_micro_batch_size_per_gpu": 1},
        "offload-param.json": {"bf16": {"enabled": True}, "zero_optimization": {
            "stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True, "buffer_count": 5, "max_in_cpu": 1e6},
            "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme"}}},
        "notile.json": {"zerofx": {"tiling": {"enabled": False}}},
        "auto.json": {"zerofx": {"auto": True, "memory_budget": "1GiB", "tiling": {"enabled": False}}},
        **{f"sp{s}.json": {"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
                           **({"zerofx": {"sequence_parallel": {"size": s}}} if s > 1 else {})} for s in (1, 2, 4)},
    }
    for name, config in configs.items():
        (tmp_path / name).write_text(json.dumps(config))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _block_param(block: Block) -> Any:
    """A block that runs a shell command (``_SHELL``) starts a process: marked ``multiprocess``,
    as tests/conftest.py marks the tests that do."""
    shell = isinstance(_entry(block), Run) and any(c.startswith(_SHELL) for c in _commands(block.text, ()))
    return pytest.param(block, marks=[pytest.mark.multiprocess] if shell else [], id=f"{block.page}:{block.line}")


@pytest.mark.parametrize("block", [_block_param(b) for b in CODE if _entry(b) is not None])
def test_block(block: Block, user_folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    how = _entry(block)
    if isinstance(how, Elsewhere):
        path, name = how.test.split("::")
        assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), flags=re.M), f"{how.test} does not exist"
        return
    if isinstance(how, Flags):
        monkeypatch.chdir(user_folder if how.in_user_folder else ROOT)
        for command in _commands(block.text, how.subs):
            if not command.startswith(("HEAD=",)):  # a shell variable the next line reads
                _check_flags(_argv(command), monkeypatch)
        return
    if block.language == "python":
        text = block.text
        for old, new in how.subs:
            assert old in text, f"substitution {old!r} matches nothing"
            text = text.replace(old, new)
        namespace: dict[str, Any] = {"__name__": "__doc__"}
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(text, f"{block.page}:{block.line}", "exec"), namespace)
        _same_as_the_examples(namespace)
        return
    launched: list[training.TrainOptions] = []
    monkeypatch.setattr(training, "launch_ranks", lambda worker, args, **kw: launched.append(args[0]))
    monkeypatch.chdir(ROOT if block.page == "docs/design.md" else user_folder)
    for command in _commands(block.text, how.subs):
        printed = _run_command(command, launched)
        assert printed.strip() or _argv(command)[0] != "grep", f"{command!r} found nothing"


def _same_as_the_examples(namespace: dict[str, Any]) -> None:
    """A spec a page defines under the name of one in examples/own_models.py builds the same model
    (parameter names and shapes, config) and the same example inputs."""
    import examples.own_models as own

    for name, fn in namespace.items():
        if callable(fn) and getattr(fn, "__module__", None) == "__doc__" and hasattr(own, name):
            (doc_model, doc_inputs), (model, inputs) = fn(), getattr(own, name)()
            shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
            assert {n: tuple(p.shape) for n, p in doc_model.named_parameters()} == shapes, name
            assert doc_model.config.to_dict() == model.config.to_dict(), name
            assert {k: tuple(v.shape) for k, v in doc_inputs.items()} == {k: tuple(v.shape) for k, v in inputs.items()}, name


# --------------------------------------------------------------------------- fragments
_ZEROFX_NAME = re.compile(r"\bzerofx(?:\.\w+)+")


def _resolve(dotted: str) -> object:
    parts = dotted.split(".")
    obj: object = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            obj = importlib.import_module(".".join(parts[: i + 1]))
    return obj


@pytest.mark.parametrize("block", [b for b in CODE if b.first.startswith(FRAGMENT) and b.language == "python"],
                         ids=lambda b: f"{b.page}:{b.line}")
def test_python_fragment_runs_up_to_what_it_needs(block: Block) -> None:
    """Its first line names every name the fragment reads but does not define; it runs statement
    by statement up to the first that reads one; the ``zerofx.`` names and ``engine.`` methods
    it uses exist."""
    import ast
    import builtins

    tree = ast.parse(block.text)
    defined = {a.asname or a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    defined |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    read = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    unnamed = sorted(name for name in read - defined - set(dir(builtins)) if not re.search(rf"\b{name}\b", block.first))
    assert not unnamed, f"{block.page}:{block.line} reads {unnamed}, which it neither defines nor names on its first line"
    namespace: dict[str, Any] = {"__name__": "__doc__"}
    for statement in tree.body:
        try:
            exec(compile(ast.Module([statement], []), f"{block.page}:{block.line}", "exec"), namespace)
        except NameError as exc:
            assert re.search(rf"\b{exc.name}\b", block.first), f"{block.page}:{block.line} needs {exc.name!r}; its first line should say so"
            break
    for dotted in _ZEROFX_NAME.findall(block.text):
        _resolve(dotted)  # an AttributeError or ImportError names what is gone
    missing = [m for m in re.findall(r"\bengine\.(\w+)", block.text) if not hasattr(Engine, m)]
    assert not missing, f"{block.page}:{block.line} calls Engine methods that do not exist: {missing}"


# --------------------------------------------------------------------------- quoted output
# The commands whose output a page quotes in a plain ``` block, keyed as BLOCKS is; None where
# the block starts with the command itself, "$ zerofx ..."; a function where the command trains
# (it prints what the command prints, from what it lowers). They run in ``user_folder``.
_RECOMPUTE_ALL = ["plan", "tiny", "--world-size", "2", "--stage", "3", "--seq-len", "64", "--config", "recompute.json"]


def _tiny_train_graphs() -> str:
    """What ``zerofx train --print-graph-code`` prints of rank 0's graphs for the tiny model at
    stage 3 on 2 ranks: its graphs lowered as training lowers them (the default config, a batch
    of 2 x 128), from meta tensors and without a process group, whose name the graphs then hold
    in place of the group's, '0'."""
    import types

    import torch

    import zerofx
    from zerofx.models import DNA_LM_SIZES, DNADecoderLM

    opts = training.TrainOptions(model="tiny", stage=3)
    with torch.device("meta"):
        model = DNADecoderLM(DNA_LM_SIZES["tiny"])
    ids = torch.zeros(2, opts.seq_len, dtype=torch.long, device="meta")
    program = zerofx.compile(model, world_size=opts.world_size, stage=3, config=training._parse_run_config(opts))
    graphs = program.graph_modules(0, example_inputs=(ids,), example_kwargs={"labels": ids})
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        training._print_graph(types.SimpleNamespace(graph_modules=lambda: graphs, rank=0, stage=3), code=True)
    return out.getvalue().replace("'zerofx_planning_group'", "'0'")


OUTPUTS: dict[tuple[str, str], list[str] | Callable[[], str] | None] = {
    ("docs/plan.md", "model small: DNADecoderLM"): ["plan", "small", "--world-size", "2", "--stage", "3"],
    ("docs/plan.md", "optimizer step of 2 micro-batches"): ["plan", "small", "--world-size", "2", "--config", "gas2.json"],
    ("docs/plan.md", "model 1b: DNADecoderLM"): ["plan", "1b", "--world-size", "1024", "--stage", "3"],
    ("docs/planner.md", "model 25m: DNADecoderLM"): ["plan", "25m", "--world-size", "2", "--stage", "3", "--budget", "2GiB"],
    ("docs/planner.md", "decision: prefetch distance lowered"): [
        "plan", "small", "--world-size", "2", "--seq-len", "128", "--config", "pf2.json", "--budget", "14MiB"],
    ("docs/planner.md", "  stage    params    grads"): ["estimate", "--params", "7.5e9", "--world-size", "64"],
    ("docs/planner.md", "model examples/model_specs.py:decoder_20b"): [
        "plan", "examples/model_specs.py:decoder_20b", "--world-size", "512", "--stage", "3", "--budget", "80GiB"],
    ("docs/infinity.md", "$ zerofx estimate --params 1e12"): None,
    ("docs/recompute.md", "recompute (all): 46 of 46"): _RECOMPUTE_ALL,
    ("docs/recompute.md", "memory per rank: persistent model state 199 KiB"): _RECOMPUTE_ALL,
    ("docs/offload.md", "offload_param: parameter shards per tier"): ["plan", "25m", "--world-size", "2", "--config", "offload-param.json"],
    ("docs/recompute.md", "decision: recompute (auto)"): [*_RECOMPUTE_ALL[:-1], "recompute-auto.json"],
    ("docs/design.md", "rank 0 graphs at ZeRO stage 3"): _tiny_train_graphs,
    ("docs/design.md", "new_empty_default = torch.ops.aten.new_empty"): _tiny_train_graphs,
}


def _quoted_mismatch(quoted: list[str], printed: list[str]) -> str | None:
    """Where ``quoted`` stops matching ``printed``, or None (NOTE [Quoted output matches by line])."""
    # NOTE [Quoted output matches by line]
    # A quoted block matches what the command prints when its lines appear there in order, the
    # first anywhere (a quote may start part way), each next one on the next printed line,
    # leading spaces aside (a quote of a graph's code leaves out its indent). A
    # line that is "..." alone stands for any number of printed lines; "..." inside a line
    # stands for any text there ("…" is printed text, as in a bucket's label). Every other
    # character must be as printed, numbers included: zerofx plan computes its figures from the
    # cost models and a fixed profile, not from the machine it runs on, so they are the same
    # everywhere, and a change to the cost models or the passes that moves one fails here.
    at, gap = 0, True
    printed = [p.strip() for p in printed]
    for line in (q.strip() for q in quoted):
        if line.strip() == "...":
            gap = True
            continue
        pattern = re.compile(".*".join(re.escape(part) for part in line.split("...")))
        hits = [i for i in range(at, len(printed) if gap else min(at + 1, len(printed))) if pattern.fullmatch(printed[i])]
        if not hits:
            return f"quoted {line!r} is not printed" + (f" after {printed[at - 1]!r}" if at else "") + (
                "" if gap else f"; printed there: {printed[at] if at < len(printed) else '(the end)'!r}")
        at, gap = hits[0] + 1, False
    return None


def test_quoted_mismatch_reads_ellipses() -> None:
    printed = ["a 1", "b 2 … 3", "c", "d 4.5 ms"]
    assert _quoted_mismatch(["a 1", "b 2 … 3", "...", "d 4.5 ms"], printed) is None
    assert _quoted_mismatch(["a 1", "...", "d ... ms"], printed) is None
    assert _quoted_mismatch(["a 1", "d 4.5 ms"], printed) == "quoted 'd 4.5 ms' is not printed after 'a 1'; printed there: 'b 2 … 3'"
    assert _quoted_mismatch(["a 1", "...", "d 4.6 ms"], printed) is not None
    assert _quoted_mismatch(["c", "d 4.5 ms"], printed) is None  # a quote that starts part way
    assert _quoted_mismatch(["c", "a 1"], printed) is not None


@pytest.mark.parametrize("key", sorted(OUTPUTS), ids=lambda k: f"{k[0]}:{k[1][:20]}")
def test_quoted_output_is_what_the_command_prints(key: tuple[str, str], user_folder: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    page, start = key
    blocks = [b for b in doc_blocks() if b.page == page and b.language == "" and b.first.startswith(start)]
    assert len(blocks) == 1, f"{page}: {len(blocks)} quoted blocks start with {start!r}"
    quoted, argv = blocks[0].text, OUTPUTS[key]
    if callable(argv):
        mismatch = _quoted_mismatch(quoted.splitlines(), argv().splitlines())
        assert mismatch is None, f"{page}:{blocks[0].line} ({argv.__name__}): {mismatch}"
        return
    if argv is None:  # "$ zerofx ARGS \\\n    MORE ARGS" and then the output
        command = re.match(r"\$ zerofx ((?:.*\\\n)*.*)\n", quoted)
        assert command is not None, f"{page}:{blocks[0].line} does not start with '$ zerofx '"
        argv, quoted = shlex.split(command.group(1).replace("\\\n", " ")), quoted[command.end():]
    assert cli.main(argv) == 0
    mismatch = _quoted_mismatch(quoted.splitlines(), capsys.readouterr().out.splitlines())
    assert mismatch is None, f"{page}:{blocks[0].line} (zerofx {shlex.join(argv)}): {mismatch}"


# --------------------------------------------------------------------------- what esm_mlm learns
def test_esm_mlm_expectation_is_the_bundled_genomes_6mer_statistics() -> None:
    """docs/training.md's bounds for examples/own_models.py:esm_mlm on the bundled genome: the
    uniform loss ln 4107, the entropy of the training region's 6-mer frequencies, and the
    perplexity those frequencies (add-one smoothed) give on the held-out last 10%."""
    from zerofx.data.genome import bundled_genome, read_fasta
    from zerofx.data.tokenizers import KmerTokenizer

    text = " ".join((ROOT / "docs" / "training.md").read_text().split())  # lines joined as rendered
    sequence = "".join(chunk for _, chunk in read_fasta(bundled_genome())).upper()
    cut = len(sequence) * 9 // 10

    def kmers(region: str) -> Counter[str]:  # every reading frame, as windows start anywhere
        return Counter(region[i:i + 6] for frame in range(6) for i in range(frame, len(region) - 5, 6))

    train, held = kmers(sequence[:cut]), kmers(sequence[cut:])
    total = sum(train.values())
    entropy = -sum(n / total * math.log(n / total) for n in train.values())
    smoothed = total + 4**6
    held_perplexity = math.exp(-sum(n * math.log((train[k] + 1) / smoothed) for k, n in held.items()) / sum(held.values()))
    vocab = KmerTokenizer(6).vocab_size
    assert f"ln {vocab} = {math.log(vocab):.2f}" in text
    assert f"6-mer frequencies is {entropy:.2f}" in text
    assert f"near the {round(held_perplexity, -2):,.0f} that the training region's" in text


@pytest.mark.parametrize("block", [b for b in CODE if b.first.startswith(FRAGMENT) and b.language == "bash"],
                         ids=lambda b: f"{b.page}:{b.line}")
def test_bash_fragment_names_flags_that_exist(block: Block) -> None:
    """A command's form with placeholders (``zerofx plan MODEL_SPEC --auto ... [--profile X]``)
    names only flags its subcommand takes."""
    for line in _commands(block.text, ()):
        argv = _argv(line)
        assert argv[0] == "zerofx", f"{block.page}:{block.line}: a fragment of {argv[0]!r}, which this test cannot check"
        named, flags = set(re.findall(r"--[\w-]+", line)), _subcommand_flags(argv[1])
        assert named <= flags, f"{block.page}:{block.line} names flags zerofx {argv[1]} lacks: {sorted(named - flags)}"


# --------------------------------------------------------------------------- commands in plain blocks
_COMMAND = re.compile(r"^(\$ )?([A-Z_]+=\S+ +)*(nice -n \d+ +)?(zerofx|python -m|torchrun) ")
# Quoted "$ zerofx ..." blocks whose output OUTPUTS does not check, and why.
NOT_RUN: dict[tuple[str, str], str] = {
    ("docs/autoplan.md", "$ zerofx plan 1b --auto"): "a search of 13-16 s",
    ("docs/autoplan.md", "$ zerofx plan small --auto"): "a search of about a minute",
    ("docs/autoplan.md", "$ zerofx train --config auto.json"): "it trains on 2 ranks",
    ("docs/planner.md", "$ zerofx plan 25m --world-size 8 --config sp4.json"): "a solve of minutes, capturing the 25m model 11 times",
}
PLAIN = [b for b in doc_blocks() if b.language == "" and _COMMAND.match(b.first)
         and not re.search(r"\S: ", b.first.split(" #")[0])]  # not output whose first line starts "zerofx plan tiny --auto: ..."


def _subcommand_flags(name: str) -> set[str]:
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {s for s in subparsers.choices[name]._option_string_actions if s.startswith("--") and s != "--help"}


@pytest.mark.parametrize("block", PLAIN, ids=lambda b: f"{b.page}:{b.line}")
def test_commands_in_plain_blocks_are_checked(block: Block, user_folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A command in a plain ``` block: a synopsis (``zerofx SUB MODEL_SPEC [--flag X] ...``) names
    each of the subcommand's flags and no other; a command quoted with its output
    (``$ zerofx ...``) is in OUTPUTS or NOT_RUN; every other command's flags parse with its
    program's parser."""
    if block.first.startswith("$ "):
        assert any(page == block.page and block.first.startswith(start) for page, start in (*OUTPUTS, *NOT_RUN)), (
            f"{block.page}:{block.line} quotes a command's output that OUTPUTS does not check and NOT_RUN does not excuse")
        commands = [re.match(r"(?:.*\\\n)*.*", block.text).group(0).replace("\\\n", " ")]
    else:
        commands = _commands(block.text, ())
    synopsis = re.match(r"zerofx ([\w-]+) .*(\[|\b[A-Z][A-Z_]+\b)", block.text)
    if synopsis:
        named = set(re.findall(r"--[\w-]+", block.text))
        flags = _subcommand_flags(synopsis.group(1))
        assert named <= flags, f"{block.page}:{block.line} names flags zerofx {synopsis.group(1)} lacks: {sorted(named - flags)}"
        assert flags <= named, f"{block.page}:{block.line} leaves out flags of zerofx {synopsis.group(1)}: {sorted(flags - named)}"
        return
    for command in commands:
        _check_flags(_argv(command), monkeypatch)


def test_flags_in_inline_commands_exist() -> None:
    """Each ``--flag`` in an inline `zerofx SUB ...` of the pages' prose is one SUB takes."""
    named_wrong = []
    for page in PAGES:
        prose = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
        for sub, rest in re.findall(r"`zerofx (plan|estimate|train|consolidate|calibrate|config-schema)\b([^`]*)`", prose):
            wrong = set(re.findall(r"--[a-z][\w-]*", rest)) - _subcommand_flags(sub) - {"--help"}
            named_wrong += [f"{page.relative_to(ROOT)}: `zerofx {sub}{rest}` names {sorted(wrong)}"] if wrong else []
    assert not named_wrong, "flags the subcommand does not take:\n" + "\n".join(named_wrong)


def test_dotted_names_in_the_prose_exist() -> None:
    """Each inline `zerofx.x.y` or `zero_optimization.x` of the pages' prose is a config key
    (``zerofx config-schema``) or a Python name that imports."""
    from zerofx.config.schema import schema_rows

    keys = {row[0] for row in schema_rows()}
    missing = []
    for page in PAGES:
        prose = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
        for span in re.findall(r"`([^`\n]*)`", prose):
            for dotted in re.findall(r"(?<![\w/.])(?:zerofx|zero_optimization)(?:\.[A-Za-z_]\w*)+", span):
                try:
                    assert dotted in keys or _resolve(dotted) is not None
                except (ImportError, AttributeError):
                    missing.append(f"{page.relative_to(ROOT)}: {dotted}")
    assert not missing, "neither a config key nor an importable name:\n" + "\n".join(sorted(set(missing)))


@pytest.mark.parametrize("block", [b for b in doc_blocks() if b.language == "json"], ids=lambda b: f"{b.page}:{b.line}")
def test_json_block_is_a_config_zerofx_takes(block: Block) -> None:
    """Each ```json block is a config ``parse_config`` accepts (one that starts with a key, as
    ``"zerofx": {...}``, is a part of one): a renamed or retired key fails here."""
    from zerofx.config import parse_config

    text = block.text if block.text.lstrip().startswith("{") else "{" + block.text + "}"
    parse_config(json.loads(text))
