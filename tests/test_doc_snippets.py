"""Every ```bash and ```python block in README.md and docs/*.md is run or checked by the suite,
or marked in the page as a fragment; the outputs the docs quote are what the commands print.

``BLOCKS`` says how each block is run, keyed by its page and the start of its first line:

- ``Run``: as written, after the substitutions it lists (smaller sizes). Python runs in this
  process (a model spec a page defines must build what examples/own_models.py builds); each
  ``zerofx`` command runs in this process through ``zerofx.app.cli.main`` and must exit 0, in
  a folder holding small stand-ins for the genomes the page names (``GRCh38.fa.gz``, ...) and
  the configs the pages define in their text (``page_configs``: "`pf2.json` holding `{...}`").
  A ``zerofx train`` command trains for real: every check it makes in the calling process, then
  its ranks' training loop on the suite's pool of gloo ranks (``_train_on_the_pool``), for 2
  steps unless it names ``--steps``; what it prints is what docs/training.md's "What is printed
  and logged" says, by shape, and so are the keys of its ``train_log.jsonl``.
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
in a plain block and compares the quoted lines (NOTE [Quoted output matches by line] in
tests/support/doc_quotes.py), numbers included; a quoted ``$ zerofx ...`` block of a search or
a solve of a minute or more runs at a smaller size (``SHAPED``, or in another test:
``SHAPED_ELSEWHERE``) and is compared by shape, every word as printed. Commands in
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

from tests.support.doc_quotes import PAGES, ROOT, Block, doc_blocks, quoted_block, quoted_mismatch, split_command

FRAGMENT = "# fragment:"


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
_SHORTER_WINDOWS = (("--seq-len 1024", "--seq-len 64"),)
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
    ("docs/training.md", "# your genome, the bundled model"): Run((("--model 25m --seq-len 1024", "--model tiny --seq-len 64"),)),
    ("docs/training.md", "zerofx data prepare hg38.fa.gz"): Run(_SHORTER_WINDOWS),
    ("docs/training.md", "printf 'hg38.fa.gz"): Run(_SHORTER_WINDOWS),
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


TRAIN_STEPS = 2  # a documented ``zerofx train`` that does not name --steps trains this many


def _run_command(command: str) -> str:
    """Run one command line of a block; return what it printed. A ``zerofx train`` trains for
    real (``_train_on_the_pool``), ``TRAIN_STEPS`` steps unless it names --steps, and prints
    what docs/training.md says it prints (``check_training_output``)."""
    argv = _argv(command)
    if argv[0] == "zerofx":
        if argv[1] == "train" and "--steps" not in argv:
            argv += ["--steps", str(TRAIN_STEPS)]
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = cli.main(argv[1:])
        assert code == 0, f"{command!r} exited {code}:\n{out.getvalue()[-2000:]}"
        if argv[1] == "train":
            check_training_output(argv[2:], out.getvalue())
        return out.getvalue()
    assert command.startswith(_SHELL), f"a command the docs test does not run: {command!r}"
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{command!r} exited {done.returncode}: {done.stderr[-2000:]}"
    return done.stdout


def _train_on_the_pool(worker: Callable[..., None], args: tuple[Any, ...], *, nprocs: int, **kwargs: Any) -> None:
    """In place of ``training.launch_ranks``: the ranks ``zerofx train`` would spawn, as ranks of
    the suite's pool (tests/support/dist_utils.py), each running the spawned rank's training loop
    in the current folder; prints what rank 0 printed (stdout and stderr, as a terminal shows
    them). The other ranks print nothing."""
    from tests.support import doc_workers
    from tests.support.dist_utils import run_ranks

    opts = args[0]
    assert worker is training._train_worker and nprocs == opts.world_size
    printed = run_ranks(nprocs, doc_workers.train_rank, opts, str(Path.cwd()))
    assert not "".join(printed[1:]).strip(), f"ranks 1.. printed:\n{''.join(printed[1:])[-2000:]}"
    print(printed[0], end="")


def _printed_and_logged() -> dict[str, Any]:
    """What docs/training.md's "What is printed and logged" quotes, by what it is."""
    text = (ROOT / "docs" / "training.md").read_text()
    section = " ".join(text.split("\n## What is printed and logged\n")[1].split("\n## ")[0].split())
    spans = re.findall(r"`([^`]+)`", section)

    def span(start: str) -> list[str]:
        found = [s for s in spans if s.startswith(start)]
        assert found, f"docs/training.md's 'What is printed and logged' quotes no line starting {start!r}"
        return found

    phases = re.search(r"setup phases with their times \(`(\w+)`, `(\w+)`, `(\w+)`; or one `(\w+)` line", section)
    per_step = re.search(r"one JSON object per step \(([^)]*)\)", section)
    evaluation = re.search(r"one for the evaluation \(([^)]*)\)", section)
    assert phases and per_step and evaluation, "docs/training.md's 'What is printed and logged' changed its form"
    training_line = re.fullmatch(r"training (\S+) \(\.\.\.\) at (.+?): (.+) on genome (\S+), batch (.+)", span("training ")[0])
    assert training_line, "docs/training.md's quoted 'training ...' line changed its form"
    return {
        "genome": span("genome ")[0], "training": training_line, "phases": phases.groups()[:3], "cache": phases[4],
        "step": span("step ")[0], "saved": span("saved checkpoint ")[0],
        "eval": span("eval on held-out windows")[0], "eval_mlm": span("eval on masked tokens")[0],
        "log_step": re.findall(r"`(\w+)`", per_step[1]), "log_eval": re.findall(r"`(\w+)`", evaluation[1]),
    }


def check_training_output(args: list[str], printed: str) -> None:
    """What ``zerofx train ARGS`` printed, run in the current folder, is what docs/training.md's
    "What is printed and logged" says, in its order, by shape (NOTE [Quoted output matches by
    line]): a genome line per source, the run's line (the quoted one in full for the run it
    quotes, else with its model, objective, genome and vocabulary its own), the setup phases
    (or the plan cache's line), a line per step, the saved checkpoint with --output-dir, the
    evaluation; and with --output-dir, train_log.jsonl's records hold the keys the page names."""
    from zerofx.data.prepared import open_prepared

    doc = _printed_and_logged()
    opts = cli.build_parser().parse_args(["train", *args])
    model, steps = opts.model or "tiny", opts.steps
    sources = len(open_prepared(Path(opts.data)).sources) if opts.data else 1
    model_quoted, at, objective, genome, batch = doc["training"].groups()
    training_line = doc["training"][0]
    if not (model == model_quoted and opts.fasta is None and opts.data is None):  # the run the page quotes, else its frame
        training_line = f"training {model} (...) at {at}: ... on genome ..., batch {batch.split(', ')[0]}, ..."
    genome = doc["genome"].replace(doc["genome"].split(":")[0], "genome ...", 1)
    evaluation = doc["eval_mlm"] + " ..." if opts.objective == "mlm" else doc["eval"]
    phases = [[f"{p} ..." for p in doc["phases"]], [f"{doc['cache']} ..."]]
    steps_lines = [doc["step"]] * steps
    saved = ["...", doc["saved"]] if opts.output_dir else []
    lines = printed.splitlines()
    mismatches = []
    for setup in phases:
        quoted = [*[genome] * sources, "...", training_line, "...", *setup, "...", *steps_lines, *saved, "...", evaluation]
        mismatches.append(quoted_mismatch(quoted, lines, shape=True))
    assert None in mismatches, f"zerofx train {shlex.join(args)}: {mismatches[0]}\nprinted:\n{printed[-3000:]}"
    assert re.findall(r"^step (\d+)/(\d+) ", printed, flags=re.M) == [(str(k), str(steps)) for k in range(1, steps + 1)], printed
    if opts.output_dir:
        records = [json.loads(r) for r in (Path(opts.output_dir) / "train_log.jsonl").read_text().splitlines()]
        assert [set(r) for r in records] == [set(doc["log_step"])] * steps + [set(doc["log_eval"]) | {"time"}], records


# A config a page names is defined in its text: "`pf2.json` holding `{...}`", "`notile.json`
# holds `{...}`", "`zerofx plan ... --config recompute.json` with `{...}`", "`... --config
# offload-param.json`, the config above with `"bf16": {...}`" (the page's last ```json block
# before it, with that key added), or a comment on the command's line, "--config auto.json ...
# # {...}". A name with "{S}" is a family ("`sp{S}.json` holds `{... "size": S}}}`"): each
# member a page names, S written in.
_CONFIG_IN_PROSE = re.compile(r"(?P<name>[\w{}-]+\.json)`(?P<above>, the config above)? (?:holding|holds|with) `(?P<json>[^`]+)`")
_CONFIG_IN_COMMENT = re.compile(r"--config (?P<name>[\w-]+\.json)\b[^#\n]*# (?P<json>\{.*\})\s*$", flags=re.M)


def page_configs() -> dict[str, dict[str, Any]]:
    """Every config the pages define in their text, by file name; one name defined twice must
    be the same config."""
    found: dict[str, dict[str, Any]] = {}
    families: dict[str, str] = {}

    def define(name: str, config: dict[str, Any], where: str) -> None:
        assert found.setdefault(name, config) == config, f"{where}: {name} is defined otherwise on another page"

    for page in PAGES:
        text, where = page.read_text(), str(page.relative_to(ROOT))
        flat = " ".join(text.split())
        for m in _CONFIG_IN_PROSE.finditer(flat):
            if "{S}" in m["name"]:
                families[m["name"]] = m["json"]
                continue
            body = json.loads(m["json"] if m["json"].startswith("{") else "{" + m["json"] + "}")
            if m["above"]:
                above = re.findall(r"```json (.*?) ```", flat[:m.start()])
                assert above, f"{where}: {m['name']} is 'the config above', but no ```json block is above it"
                body = {**json.loads(above[-1]), **body}
            define(m["name"], body, where)
        for m in _CONFIG_IN_COMMENT.finditer(text):
            define(m["name"], json.loads(m["json"]), where)
    for family, template in families.items():
        named = set(re.findall(re.escape(family).replace(r"\{S\}", r"(\d+)"), " ".join(p.read_text() for p in PAGES)))
        for size in named:
            define(family.replace("{S}", size), json.loads(template.replace(": S}", f": {size}}}")), family)
    return found


def test_configs_are_taken_from_the_pages() -> None:
    """The configs the pages define (``page_configs``) are the ones the commands run with; each
    is one zerofx takes, and every ``--config X.json`` of a command the suite runs is among them."""
    from zerofx.config import parse_config

    configs = page_configs()
    assert configs["notile.json"] == {"zerofx": {"tiling": {"enabled": False}}}  # the extraction itself works
    assert configs["sp4.json"]["zerofx"]["sequence_parallel"] == {"size": 4}
    assert configs["offload-param.json"]["bf16"] == {"enabled": True} and "offload_param" in configs["offload-param.json"]["zero_optimization"]
    for config in configs.values():
        parse_config(config)
    run = [b.text for b in CODE if isinstance(_entry(b), Run)] + [" ".join(a) for a in OUTPUTS.values() if isinstance(a, list)]
    run += [split_command(quoted_block(*key))[0] for key in SHAPED]
    named = {n for text in run for n in re.findall(r"--config (\S+\.json)", text) if "/" not in n}
    assert named <= set(configs), f"configs the commands name that no page defines: {sorted(named - set(configs))}"


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
    (tmp_path / "benchmarks").symlink_to(ROOT / "benchmarks")
    for name, config in page_configs().items():
        (tmp_path / name).write_text(json.dumps(config))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _block_param(block: Block) -> Any:
    """A block that runs a shell command (``_SHELL``) or trains (``zerofx train``, on the pool's
    ranks) starts processes: marked ``multiprocess``, as tests/conftest.py marks the tests that do."""
    starts = isinstance(_entry(block), Run) and any(c.startswith(_SHELL) or c.startswith("zerofx train ")
                                                    for c in _commands(block.text, ()))
    return pytest.param(block, marks=[pytest.mark.multiprocess] if starts else [], id=f"{block.page}:{block.line}")


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
    monkeypatch.setattr(training, "launch_ranks", _train_on_the_pool)
    monkeypatch.chdir(ROOT if block.page == "docs/design.md" else user_folder)
    for command in _commands(block.text, how.subs):
        printed = _run_command(command)
        assert printed.strip() or _argv(command)[0] != "grep", f"{command!r} found nothing"


_README_SMALLER = (("--model small", "--model tiny"), ("--steps 80", "--steps 2"), ("--seq-len 512", "--seq-len 64"))


@pytest.mark.multiprocess
def test_readme_first_command_trains_and_says_what_to_do_when_run_again(user_folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """README.md's first command ends in a ``zerofx train``, run here at a smaller size: it
    trains as docs/training.md says, and the same command again starts no rank and prints one
    line saying how to train further (tests/test_quickstart.py checks the installing part)."""
    first = next(b for b in CODE if b.page == "README.md" and b.language == "bash").text
    command = first.split("&&")[-1].strip()
    assert command.startswith("zerofx train "), first
    for old, new in _README_SMALLER:
        assert old in command, f"README.md's first command no longer has {old!r}"
        command = command.replace(old, new)
    monkeypatch.setattr(training, "launch_ranks", _train_on_the_pool)
    _run_command(command)
    monkeypatch.setattr(training, "launch_ranks", lambda *args, **kwargs: pytest.fail("a second run started ranks"))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(_argv(command)[1:]) == 0
    again = out.getvalue()
    assert again.count("\n") == 1 and "is at step 2 = --steps 2: nothing to train. Pass --steps 4" in again, again


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
# the block starts with the command itself, "$ zerofx ...", run as ``_run_command`` runs it (a
# ``zerofx train`` trains on the pool's ranks); a function where the command trains (it prints
# what the command prints, from what it lowers). They run in ``user_folder``.
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
    ("docs/autoplan.md", "$ zerofx train --config auto.json"): None,
    ("docs/recompute.md", "recompute (all): 46 of 46"): _RECOMPUTE_ALL,
    ("docs/recompute.md", "memory per rank: persistent model state 199 KiB"): _RECOMPUTE_ALL,
    ("docs/offload.md", "offload_param: parameter shards per tier"): ["plan", "25m", "--world-size", "2", "--config", "offload-param.json"],
    ("docs/recompute.md", "decision: recompute (auto)"): [*_RECOMPUTE_ALL[:-1], "recompute-auto.json"],
    ("docs/design.md", "rank 0 graphs at ZeRO stage 3"): _tiny_train_graphs,
    ("docs/design.md", "new_empty_default = torch.ops.aten.new_empty"): _tiny_train_graphs,
}


def test_quoted_mismatch_reads_ellipses() -> None:
    printed = ["a 1", "b 2 … 3", "c", "d 4.5 ms"]
    assert quoted_mismatch(["a 1", "b 2 … 3", "...", "d 4.5 ms"], printed) is None
    assert quoted_mismatch(["a 1", "...", "d ... ms"], printed) is None
    assert quoted_mismatch(["a 1", "d 4.5 ms"], printed) == "quoted 'd 4.5 ms' is not printed after 'a 1'; printed there: 'b 2 … 3'"
    assert quoted_mismatch(["a 1", "...", "d 4.6 ms"], printed) is not None
    assert quoted_mismatch(["c", "d 4.5 ms"], printed) is None  # a quote that starts part way
    assert quoted_mismatch(["c", "a 1"], printed) is not None


def test_quoted_mismatch_by_shape() -> None:
    """By shape, numbers, their units and plurals, padding, rules and autoplan candidates are
    any such; the words are as printed."""
    assert quoted_mismatch(["searched 64 candidates (9 planned and lowered, 3 captures) in 13.0 s"],
                           ["searched 31 candidates (4 planned and lowered, 1 capture) in 2.9 s"], shape=True) is None
    quote = ["chosen: stage 2, K 8, offload none, tiling off, recompute auto, micro 1 x 1 (78 activations recomputed): peak 6.69 GiB",
             "#    candidate    tokens/s", "---  ---------  --------", "1    stage 2, sp 2, K 8, offload none, tiling off, micro 1 x 2  7,047,254"]
    printed = ["chosen: stage 0, K 1024, offload none, tiling config, micro 1 x 1: peak 863 KiB",
               "#    candidate                 tokens/s", "---  ---------------  -----------",
               "1    stage 0, K 1024, offload cpu, tiling auto, micro 1 x 1  858,845,710"]
    assert quoted_mismatch(quote, printed, shape=True) is None
    assert quoted_mismatch(quote, printed) is not None
    assert quoted_mismatch(["step 3/20 loss 2.4268 (0.062 s/step, 4,142 tokens/s)"], ["step 1/2 loss 8.3 (1 s/step, 17 tokens/s)"], shape=True) is None
    assert quoted_mismatch(["peak 6.69 GiB"], ["peak 6.69 ms"], shape=True) is not None  # a size is no time
    assert quoted_mismatch(["in 13.0 s"], ["after 13.0 s"], shape=True) is not None  # words are as printed



def _output_param(key: tuple[str, str]) -> Any:
    """A quote of ``zerofx train`` trains on the pool's ranks: marked ``multiprocess``."""
    trains = key[1].startswith("$ zerofx train ")
    return pytest.param(key, marks=[pytest.mark.multiprocess] if trains else [], id=f"{key[0]}:{key[1][:20]}")


@pytest.mark.parametrize("key", [_output_param(k) for k in sorted(OUTPUTS)])
def test_quoted_output_is_what_the_command_prints(key: tuple[str, str], user_folder: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    block, argv = quoted_block(*key), OUTPUTS[key]
    quoted = block.text.splitlines()
    if callable(argv):
        mismatch = quoted_mismatch(quoted, argv().splitlines())
        assert mismatch is None, f"{block.page}:{block.line} ({argv.__name__}): {mismatch}"
        return
    if argv is None:  # "$ zerofx ARGS \\\n    MORE ARGS" and then the output, run as ``_run_command`` runs it
        command, quoted = split_command(block)
        monkeypatch.setattr(training, "launch_ranks", _train_on_the_pool)
        printed = _run_command(command)
    else:
        command = shlex.join(["zerofx", *argv])
        assert cli.main(argv) == 0
        printed = capsys.readouterr().out
    mismatch = quoted_mismatch(quoted, printed.splitlines())
    assert mismatch is None, f"{block.page}:{block.line} ({command}): {mismatch}"


# Quoted "$ zerofx ..." blocks whose command runs here at a smaller size (the substitutions, made
# in the command and the quote alike), or whose figures are the machine's: checked by shape
# (NOTE [Quoted output matches by line]), in ``user_folder``; a ``zerofx train`` trains on the
# pool's ranks and prints what docs/training.md says as well (``_run_command``).
SHAPED: dict[tuple[str, str], tuple[tuple[str, str], ...]] = {
    # 1 capture and 4 lowerings of tiny, not 3 captures and 9 lowerings of the 20-block 1b (13-16 s)
    ("docs/autoplan.md", "$ zerofx plan 1b --auto"): (("plan 1b", "plan tiny --seq-len 64"),),
    # the same with tiling kept as notile.json sets it, not 105 candidates of small at 1,024 tokens (about a minute)
    ("docs/autoplan.md", "$ zerofx plan small --auto"): (("small", "tiny"), ("--world-size 8", "--world-size 1024"),
                                                         ("--seq-len 1024", "--seq-len 64"), ("--budget 24MiB", "--budget 8GiB")),
}
# Quoted stderr, checked by shape against what a SHAPED command wrote there: a search's progress.
SHAPED_STDERR: dict[tuple[str, str], tuple[str, str]] = {
    ("docs/autoplan.md", "zerofx plan --auto: "): ("docs/autoplan.md", "$ zerofx plan 1b --auto"),
}
# Quotes another test checks by shape, from what a smaller run of the same code prints.
SHAPED_ELSEWHERE: dict[tuple[str, str], str] = {
    # the solve's 11 captures of a one-block hyena-tiny at S = 2, not of the 25m model at S = 4 (minutes)
    ("docs/planner.md", "$ zerofx plan 25m --world-size 8 --config sp4.json"):
        "tests/test_sp_plan_cli.py::test_solve_seq_len_at_sequence_parallel_size_2_fits_and_one_multiple_past_does_not",
    # a search stopped before its first candidate, not after 12 of them
    ("docs/autoplan.md", "stopped early by the time limit"):
        "tests/test_plan_output.py::test_plan_auto_stops_at_its_time_limit_with_the_best_so_far",
}


@pytest.mark.parametrize("key", [_output_param(k) for k in SHAPED])
def test_quoted_output_has_the_shape_of_what_the_command_prints(key: tuple[str, str], user_folder: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    block = quoted_block(*key)
    text = block.text
    for old, new in SHAPED[key]:
        assert old in text, f"{block.page}:{block.line}: substitution {old!r} matches nothing"
        text = text.replace(old, new)
    command, quoted = split_command(Block(block.page, block.line, "", text))
    monkeypatch.setattr(training, "launch_ranks", _train_on_the_pool)
    mismatch = quoted_mismatch(quoted, _run_command(command).splitlines(), shape=True)
    assert mismatch is None, f"{block.page}:{block.line} ({command}): {mismatch}"
    err = capsys.readouterr().err.splitlines()
    for stderr_key in (k for k, run in SHAPED_STDERR.items() if run == key):
        stderr_block = quoted_block(*stderr_key)
        mismatch = quoted_mismatch(stderr_block.text.splitlines(), err, shape=True)
        assert mismatch is None, f"{stderr_block.page}:{stderr_block.line} (the stderr of {command}): {mismatch}"


@pytest.mark.parametrize("key", sorted(SHAPED_ELSEWHERE), ids=lambda k: f"{k[0]}:{k[1][2:30]}")
def test_quoted_output_checked_elsewhere_is(key: tuple[str, str]) -> None:
    """The named test exists and checks this quote: it names the page and the quote's start."""
    path, name = SHAPED_ELSEWHERE[key].split("::")
    source = (ROOT / path).read_text()
    body = re.search(rf"^def {name}\(.*?(?=^def |\Z)", source, flags=re.M | re.S)
    assert body, f"{SHAPED_ELSEWHERE[key]} does not exist"
    assert key[0] in body[0] and key[1] in body[0], f"{SHAPED_ELSEWHERE[key]} does not check {key}"
    quoted_block(*key)


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
    (``$ zerofx ...``) is in OUTPUTS, SHAPED or SHAPED_ELSEWHERE; every other command's flags parse with its
    program's parser."""
    if block.first.startswith("$ "):
        checked = (*OUTPUTS, *SHAPED, *SHAPED_ELSEWHERE)
        assert any(page == block.page and block.first.startswith(start) for page, start in checked), (
            f"{block.page}:{block.line} quotes a command's output that OUTPUTS, SHAPED and SHAPED_ELSEWHERE do not check")
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
