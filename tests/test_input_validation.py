"""Bad input to the ``zerofx`` command line and the genome reader becomes one clear error
(issue 20: FASTA content, ``--batch-size`` vs the config, numbers that are not finite, model specs
that exit or raise, output paths, huge world sizes, corrupt gzip, help text).

Every CLI case runs ``zerofx.app.cli.main`` in this process and fails before any capture, process
or measurement starts, so the file runs in seconds.
"""

from __future__ import annotations

import argparse
import gzip
import os
import random
import sys
from pathlib import Path

import pytest

import zerofx
from zerofx.app.cli import build_parser, main
from zerofx.common.limits import MAX_WORLD_SIZE
from zerofx.data.genome import (
    FOREIGN_CHECK_MIN_SYMBOLS,
    MAX_FOREIGN_FRACTION,
    GenomeError,
    bundled_genome,
    genome_stats,
    genome_windows,
    read_fasta,
    tokenize,
)
from zerofx.common.errors import UsageError
from zerofx.app.training import TrainOptions, check_train_options

# The 20 amino acids: about 35% of a protein's residues (E, F, I, L, P, Q) are not nucleotide codes.
AMINO_ACIDS = "ACDEFGHIKLMNPQRSTVWY"


def _error_line(capsys: pytest.CaptureFixture[str]) -> str:
    """The CLI's stderr, checked to be one 'zerofx: error:' line with no traceback."""
    err = capsys.readouterr().err
    assert err.startswith("zerofx: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def _dna(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice("ACGT") for _ in range(n))


def _fasta(path: Path, records: dict[str, str], width: int = 60) -> Path:
    lines = []
    for name, seq in records.items():
        lines.append(f">{name} description")
        lines += [seq[i : i + width] for i in range(0, len(seq), width)]
    path.write_text("\n".join(lines) + "\n")
    return path


# --------------------------------------------------------------------------- item 13: FASTA content
def test_protein_fasta_is_refused_with_count_fraction_and_first_position(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    rng = random.Random(0)
    proteins = {f"sp|P{i:05d}|PROT": "M" + "".join(rng.choice(AMINO_ACIDS) for _ in range(299)) for i in range(100)}
    path = _fasta(tmp_path / "proteins.fa", proteins)
    first_foreign = next(i for i, c in enumerate(proteins["sp|P00000|PROT"]) if c in "EFILPQ")
    with pytest.raises(GenomeError) as info:
        read_fasta(path)  # refused when called: within the first FOREIGN_CHECK_MIN_SYMBOLS symbols
    message = str(info.value)
    assert "proteins.fa" in message and "not nucleotide codes" in message and "%" in message
    assert f"record 'sp|P00000|PROT' at offset {first_foreign} (line 2, column {first_foreign + 1})" in message
    count, total = message.split(" are not")[0].split(": ")[-1].split(" of its first ")
    assert int(total.split()[0].replace(",", "")) >= FOREIGN_CHECK_MIN_SYMBOLS
    assert 0.25 < int(count.replace(",", "")) / int(total.split()[0].replace(",", "")) < 0.45
    # zerofx train refuses it in the parent, before any rank starts.
    assert main(["train", "--fasta", str(path), "--seq-len", "64"]) == 2
    assert "not nucleotide codes" in _error_line(capsys)


def test_mostly_foreign_symbols_are_refused_but_a_few_become_n(tmp_path: Path) -> None:
    # 5% of X, Q, Z, '*', '-' scattered through DNA: refused, with the first one's position.
    rng = random.Random(1)
    seq = "".join(rng.choice("XQZ*-") if i % 20 == 7 else c for i, c in enumerate(_dna(20_000)))
    with pytest.raises(GenomeError, match=r"are not nucleotide codes.*record 'chr1' at offset 7 \(line 2, column 8\)"):
        read_fasta(_fasta(tmp_path / "noisy.fa", {"chr1": seq}))
    # A short file is judged at its end: 1 gap in 50 symbols is 2%.
    with pytest.raises(GenomeError, match="1 of its first 50 sequence symbols"):
        list(read_fasta(_fasta(tmp_path / "short.fa", {"x": _dna(49) + "-"})))
    # Below MAX_FOREIGN_FRACTION they read as N, and genome_stats counts them.
    num_foreign = int(20_000 * MAX_FOREIGN_FRACTION) // 2
    quiet = "".join("X" if i % (20_000 // num_foreign) == 3 else c for i, c in enumerate(_dna(20_000)))
    path = _fasta(tmp_path / "quiet.fa", {"chr1": quiet})
    tokens = tokenize("".join(chunk for _, chunk in read_fasta(path)))
    assert int((tokens == 4).sum()) == num_foreign
    stats = genome_stats(path)
    assert (stats.num_bases, stats.num_n, stats.num_foreign) == (20_000, num_foreign, num_foreign)
    assert f"{num_foreign} of them not nucleotide codes, the first 'X' in record 'chr1' at offset 3 (line 2, column 4)" in stats.summary()


def test_iupac_nucleotide_codes_are_accepted_u_reads_as_t(tmp_path: Path) -> None:
    codes = "ACGTURYSWKMBDHVN"
    path = _fasta(tmp_path / "iupac.fa", {"rna": (codes + codes.lower()) * 400})
    sequence = "".join(chunk for _, chunk in read_fasta(path))
    assert tokenize(sequence[:5]).tolist() == [0, 1, 2, 3, 3]  # U is T
    assert tokenize("uU").tolist() == [3, 3]
    stats = genome_stats(path)
    assert (stats.num_records, stats.num_bases, stats.num_foreign) == (1, 32 * 400, 0)
    assert stats.num_n == 11 * 2 * 400  # R Y S W K M B D H V N in both cases
    assert next(genome_windows(path, 64, shuffle_windows=0)).shape == (1, 64)


def test_genome_stats_line_for_the_bundled_genome() -> None:
    stats = genome_stats(bundled_genome())
    assert stats.summary() == "genome lambda_virus.fa.gz: 48,502 bases in 1 record, 0 N or other ambiguity codes (0.00%)"


# --------------------------------------------------------------------------- item 6: corrupt gzip
def _gzip_of_dna(path: Path) -> bytes:
    data = gzip.compress(f">chr1\n{_dna(50_000)}\n".encode())
    path.write_bytes(data)
    return data


def test_gzip_corrupted_near_its_start_names_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = bytearray(_gzip_of_dna(tmp_path / "ok.fa.gz"))
    for i in range(12, 40):  # inside the first deflate block's header: zlib.error before the fix
        data[i] ^= 0xFF
    path = tmp_path / "corrupt.fa.gz"
    path.write_bytes(bytes(data))
    with pytest.raises(GenomeError, match=r"'.*corrupt\.fa\.gz' is corrupt \(gzip\)"):
        read_fasta(path)
    assert main(["train", "--fasta", str(path)]) == 2
    assert "corrupt.fa.gz" in _error_line(capsys)


def test_gzip_truncated_names_the_file(tmp_path: Path) -> None:
    data = _gzip_of_dna(tmp_path / "ok.fa.gz")
    path = tmp_path / "truncated.fa.gz"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(GenomeError, match=r"truncated\.fa\.gz' is corrupt \(gzip\).*ended before"):
        list(read_fasta(path))


# --------------------------------------------------------------------------- item 14: --batch-size vs the config
def test_batch_size_flag_must_agree_with_the_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "ds.json"
    cfg.write_text('{"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}')
    assert main(["train", "--config", str(cfg), "--batch-size", "8", "--world-size", "2"]) == 2
    err = _error_line(capsys)
    assert "--batch-size 8" in err and "train_micro_batch_size_per_gpu=2" in err
    # Agreeing values, or no flag, are fine.
    assert check_train_options(TrainOptions(config=cfg, world_size=2, seq_len=64, batch_size=2)).batch_size == 2
    assert check_train_options(TrainOptions(config=cfg, world_size=2, seq_len=64)).batch_size == 2


def test_batch_rule_mismatch_and_micro_batch_derived_from_train_batch_size(tmp_path: Path) -> None:
    cfg = tmp_path / "ds.json"
    cfg.write_text('{"train_batch_size": 6, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}')
    with pytest.raises(UsageError, match=r"train_batch_size=6 is not .*micro_batch_size_per_gpu=2 x "
                                         r"gradient_accumulation_steps=1 x world size 2 = 4 \(DeepSpeed's rule\)"):
        check_train_options(TrainOptions(config=cfg, world_size=2, seq_len=64))
    # Only train_batch_size: the micro-batch is what DeepSpeed's rule leaves, 12 / (2 x 2) = 3.
    cfg.write_text('{"train_batch_size": 12, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 3}}')
    assert check_train_options(TrainOptions(config=cfg, world_size=2, seq_len=64)).batch_size == 3
    with pytest.raises(UsageError, match=r"--batch-size 2 disagrees .*train_batch_size=12 / \(gradient_accumulation_steps=2"):
        check_train_options(TrainOptions(config=cfg, world_size=2, seq_len=64, batch_size=2))
    with pytest.raises(UsageError, match="not divisible by gradient_accumulation_steps=2 x world size 4"):
        check_train_options(TrainOptions(config=cfg, world_size=4, seq_len=64))


# --------------------------------------------------------------------------- item 9: numbers
@pytest.mark.parametrize(
    "argv, flag, accepted",
    [
        (["estimate", "--params", "nan", "--world-size", "8"], "--params", "a finite number > 0"),
        (["estimate", "--params", "inf", "--world-size", "8"], "--params", "a finite number > 0"),
        (["estimate", "--params", "1e999", "--world-size", "8"], "--params", "a finite number > 0"),
        (["estimate", "--params", "-5", "--world-size", "8"], "--params", "a finite number > 0"),
        (["estimate", "--params", "1e9", "--world-size", "0"], "--world-size", f"an integer in 1..{MAX_WORLD_SIZE}"),
        (["train", "--lr", "inf"], "--lr", "a finite number >= 0"),
        (["train", "--lr", "nan"], "--lr", "a finite number >= 0"),
        (["train", "--lr=-1e-3"], "--lr", "a finite number >= 0"),
        (["train", "--seed", "-1"], "--seed", "an integer in 0..18446744073709551615"),
        (["train", "--steps", "0"], "--steps", "an integer >= 1"),
        (["train", "--save-every", "0", "--output-dir", "x"], "--save-every", "an integer >= 1"),
        (["train", "--world-size", "100000"], "--world-size", "an integer in 1..256"),
        (["train", "--keep-last", "0", "--output-dir", "x"], "--keep-last", "an integer >= 1"),
        (["train", "--collective-timeout", "0"], "--collective-timeout", "a finite number > 0"),
        (["train", "--collective-timeout", "nan"], "--collective-timeout", "a finite number > 0"),
        (["train", "--schedule-steps", "0"], "--schedule-steps", "an integer >= 1"),
        (["plan", "tiny", "--auto", "--world-size", "2", "--budget", "2MiB", "--time-limit", "0"], "--time-limit", "a finite number > 0"),
        (["calibrate", "--repeats", "0"], "--repeats", "an integer >= 1"),
        (["calibrate", "--world-size", "100000"], "--world-size", "an integer in 1..256"),
        (["plan", "tiny", "--world-size", "2", "--stage", "3", "--rank", "-1"], "--rank", "an integer >= 0"),
        (["plan", "tiny", "--world-size", "2", "--stage", "3", "--budget", "0GiB"], "--budget", "a finite size above 0"),
        (["plan", "tiny", "--world-size", "2", "--stage", "3", "--max-seq-len", "0"], "--max-seq-len", "an integer >= 1"),
        (["plan", "tiny", "--world-size", "2", "--stage", "3", "--batch-size", "0"], "--batch-size", "an integer >= 1"),
    ],
)
def test_numeric_flags_are_finite_and_in_range(argv: list[str], flag: str, accepted: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = _error_line(capsys)
    assert f"argument {flag}: " in err and f"accepted: {accepted}" in err


def test_train_options_api_refuses_a_lr_that_is_not_finite() -> None:
    for lr in (float("inf"), float("nan")):
        with pytest.raises(UsageError, match="--lr .* accepted: a finite number >= 0"):
            check_train_options(TrainOptions(lr=lr, seq_len=64))


@pytest.mark.parametrize("world_size", [10**9, 2**63])
def test_huge_world_size_is_refused_with_the_range(world_size: int, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "tiny", "--world-size", str(world_size), "--stage", "3"]) == 2
    assert f"{world_size} is out of range; accepted: an integer in 1..{MAX_WORLD_SIZE}" in _error_line(capsys)
    assert build_parser().parse_args(["plan", "tiny", "--world-size", str(MAX_WORLD_SIZE)]).world_size == MAX_WORLD_SIZE


def test_schedule_steps_needs_a_scheduler(capsys: pytest.CaptureFixture[str]) -> None:
    """--schedule-steps sets the config scheduler's total_num_steps: a run with none is told so before any rank starts."""
    assert main(["train", "--schedule-steps", "40"]) == 2
    assert "--schedule-steps sets the config's scheduler.params.total_num_steps; this run has no scheduler" in _error_line(capsys)


# --------------------------------------------------------------------------- item 15 and model specs
def _spec(tmp_path: Path, body: str, name: str = "make") -> str:
    path = tmp_path / "user_model.py"
    path.write_text("import sys\nimport torch\nimport torch.nn as nn\n\n" + body)
    return f"{path}:{name}"


EXIT_IN_CALLABLE = "def make():\n    sys.exit(0)\n"
RAISE_IN_CALLABLE = "def make():\n    raise RuntimeError('no GPU here')\n"
EXIT_AT_IMPORT = "sys.exit(3)\n\ndef make():\n    pass\n"
SYNTAX_ERROR = "def make(:\n    pass\n"
EXIT_IN_FORWARD = """
class Exits(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        sys.exit(0)


def make():
    return Exits(), (torch.randn(2, 4),)
"""


@pytest.mark.parametrize(
    "body, message",
    [
        (EXIT_IN_CALLABLE, "called sys.exit(0) (at user_model.py:6) while zerofx called make()"),
        (RAISE_IN_CALLABLE, "raised RuntimeError: no GPU here (at user_model.py:6) while zerofx called make()"),
        (EXIT_AT_IMPORT, "called sys.exit(3) (at user_model.py:5) while zerofx imported"),
        (SYNTAX_ERROR, "raised SyntaxError"),
        (EXIT_IN_FORWARD, "called sys.exit(0) (at user_model.py:12) while zerofx traced the model's forward"),
    ],
    ids=["exit-in-callable", "raise-in-callable", "exit-at-import", "syntax-error", "exit-in-forward"],
)
def test_model_spec_that_exits_or_raises_is_an_error(body: str, message: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    spec = _spec(tmp_path, body)
    assert main(["plan", spec, "--world-size", "2", "--stage", "3"]) == 2
    err = _error_line(capsys)
    assert f"model spec {spec!r}" in err and message in err
    if body is EXIT_IN_FORWARD:  # estimate captures the forward too
        assert main(["estimate", spec, "--world-size", "2"]) == 2
        assert message in _error_line(capsys)


@pytest.mark.parametrize(
    "body, message",
    [
        ("class Empty(nn.Module):\n    def forward(self, x):\n        return x.sum()\n\n"
         "def make():\n    return Empty(), (torch.randn(2, 4),)\n", "Empty has no parameters"),
        ("def make():\n    m = nn.Linear(4, 4).requires_grad_(False)\n    return m, (torch.randn(2, 4),)\n",
         "Linear has 2 parameters, all frozen (requires_grad=False)"),
    ],
    ids=["no-parameters", "all-frozen"],
)
def test_model_spec_with_nothing_to_train(body: str, message: str, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _spec(tmp_path, body)
    monkeypatch.setattr(zerofx, "compile", _must_not_run)  # refused when the spec loads, before capture
    assert main(["plan", spec, "--world-size", "2", "--stage", "3"]) == 2
    err = _error_line(capsys)
    assert f"model spec {spec!r}: {message}" in err and "at least one trainable parameter" in err


IDS_ALONE = """
class WithLabels(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(5, 8)
        self.head = nn.Linear(8, 5)

    def forward(self, ids, labels=None):
        logits = self.head(self.embed(ids))
        return logits if labels is None else nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


class LogitsOnly(WithLabels):
    def forward(self, ids):
        return self.head(self.embed(ids))


def make():
    return WithLabels(), (torch.zeros(2, 16, dtype=torch.long),)


def logits_only():
    return LogitsOnly(), (torch.zeros(2, 16, dtype=torch.long),)
"""


def test_plan_takes_a_spec_that_returns_the_input_ids_alone(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``(model, (ids,))`` plans the call ``zerofx train`` makes, ``model(ids, labels=ids)``; a
    model that cannot take labels is told what it returned by shape, not by torch's tracing type."""
    assert main(["plan", _spec(tmp_path, IDS_ALONE), "--world-size", "2", "--stage", "3"]) == 0
    assert "summary:" in capsys.readouterr().out
    assert main(["plan", _spec(tmp_path, IDS_ALONE, "logits_only"), "--world-size", "2", "--stage", "3"]) == 2
    err = _error_line(capsys)
    assert "cannot find the loss in the model's output (a tensor of shape (2, 16, 5))" in err and "Tensor" not in err


# --------------------------------------------------------------------------- item 5: output paths
def _must_not_run(*args: object, **kwargs: object) -> None:
    raise AssertionError("the output path should have been refused before any work")


def test_plot_to_a_missing_folder_is_refused_before_planning(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zerofx, "compile", _must_not_run)
    png = tmp_path / "missing" / "timeline.png"
    assert main(["plan", "tiny", "--world-size", "2", "--stage", "3", "--plot", str(png)]) == 2
    err = _error_line(capsys)
    assert f"--plot {str(png)!r}" in err and "does not exist" in err
    assert main(["plan", "tiny", "--world-size", "2", "--stage", "3", "--plot", str(tmp_path)]) == 2
    assert "is a folder" in _error_line(capsys)


def test_calibrate_out_to_a_missing_folder_is_refused_before_measuring(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import zerofx.app.calibrate

    monkeypatch.setattr(zerofx.app.calibrate, "calibrate", _must_not_run)
    out = tmp_path / "missing" / "profile.json"
    assert main(["calibrate", "--out", str(out)]) == 2
    err = _error_line(capsys)
    assert f"--out {str(out)!r}" in err and "does not exist" in err


def test_output_to_a_read_only_folder_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import zerofx.app.calibrate

    folder = tmp_path / "read_only"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        if os.access(folder, os.W_OK):  # root ignores the mode: try sysfs, where no one may create a file
            folder = Path("/sys")
            if not folder.is_dir() or os.access(folder, os.W_OK) and _can_create_in(folder):
                pytest.skip("no folder this user cannot write to")
        monkeypatch.setattr(zerofx.app.calibrate, "calibrate", _must_not_run)
        assert main(["calibrate", "--out", str(folder / "profile.json")]) == 2
        assert "cannot create a file in folder" in _error_line(capsys)
        monkeypatch.setattr(zerofx, "compile", _must_not_run)
        assert main(["plan", "tiny", "--world-size", "2", "--stage", "3", "--plot", str(folder / "t.png")]) == 2
        assert "cannot create a file in folder" in _error_line(capsys)
    finally:
        (tmp_path / "read_only").chmod(0o755)


def _can_create_in(folder: Path) -> bool:
    try:
        (folder / ".zerofx-test-probe").touch()
    except OSError:
        return False
    (folder / ".zerofx-test-probe").unlink()
    return True


# --------------------------------------------------------------------------- item 7: help
def test_every_command_and_flag_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert commands.help and set(commands.choices) == {"plan", "estimate", "config-schema", "calibrate", "train", "consolidate", "data"}
    todo = [((name,), sub) for name, sub in commands.choices.items()]
    while todo:  # commands with commands of their own (zerofx data prepare) too
        names, sub = todo.pop()
        for action in sub._actions:
            assert action.help and action.help != argparse.SUPPRESS, f"zerofx {' '.join(names)} {action.option_strings or action.dest}"
            if isinstance(action, argparse._SubParsersAction):
                todo += [((*names, name), nested) for name, nested in action.choices.items()]
        assert main([*names, "--help"]) == 0
        assert f"usage: zerofx {' '.join(names)}" in capsys.readouterr().out
    # Numeric flags state their range.
    assert main(["plan", "--help"]) == 0
    assert f"1..{MAX_WORLD_SIZE}" in capsys.readouterr().out


def test_a_library_that_wraps_sys_exit_does_not_hide_the_users_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """wandb, once ``wandb.init`` has run, replaces ``sys.exit`` with its own hook: the error
    still names the line in the user's model spec, not the hook's."""
    import sysconfig

    hook_file = Path(sysconfig.get_paths()["purelib"]) / "some_logger" / "hooks.py"  # compiled with that name; never written
    namespace: dict = {}
    exec(compile("import sys\n_exit = sys.exit\ndef exit(code=None):\n    _exit(code)\n", str(hook_file), "exec"), namespace)
    monkeypatch.setattr(sys, "exit", namespace["exit"])
    spec = _spec(tmp_path, EXIT_IN_CALLABLE)
    assert main(["plan", spec, "--world-size", "2", "--stage", "3"]) == 2
    err = _error_line(capsys)
    assert "called sys.exit(0) (at user_model.py:6) while zerofx called make()" in err, err
