"""The genome data pipeline (zerofx/data/genome.py) and the ``zerofx`` command line (zerofx/app/cli.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.fasta import write_fasta

from zerofx.app.cli import main
from zerofx.data.genome import (
    GenomeError,
    bundled_genome,
    detokenize,
    genome_windows,
    read_fasta,
    reverse_complement,
    tokenize,
)
from zerofx.common.errors import ZeroFXError
from zerofx.models import MODEL_SIZES
from zerofx.common.vocab import DNA_VOCAB

LAMBDA_BP = 48_502



def _windows(path: Path, seq_len: int, **kw: object) -> list[torch.Tensor]:
    """Every window a call yields, one (T,) tensor each, in order."""
    return [w for batch in genome_windows(path, seq_len, **kw) for w in batch]


# --------------------------------------------------------------------------- FASTA and tokens
def test_bundled_genome_reads_whole_and_only_acgt() -> None:
    pieces = list(read_fasta(bundled_genome(), chunk_chars=4096))
    sequence = "".join(chunk for _, chunk in pieces)
    assert len(sequence) == LAMBDA_BP
    assert set(sequence) == set("ACGT")
    assert {name for name, _ in pieces} == {"gi|9626243|ref|NC_001416.1|"}
    assert len(pieces) > 1 and max(len(c) for _, c in pieces) < 4096 + 100  # streamed in chunks


def test_read_fasta_multi_record_lowercase_wrapping(tmp_path: Path) -> None:
    text = ">chr1 first record\nacgt\nNNAC\n\n>chr2\nGGTT\nca\n"
    for gz in (False, True):
        path = write_fasta(tmp_path / ("x.fa.gz" if gz else "x.fa"), text, gz=gz)
        records: dict[str, str] = {}
        for name, chunk in read_fasta(path, chunk_chars=3):
            records[name] = records.get(name, "") + chunk
        assert records == {"chr1": "ACGTNNAC", "chr2": "GGTTCA"}


def test_tokenizer_maps_acgt_and_everything_else_to_n() -> None:
    assert DNA_VOCAB == ("A", "C", "G", "T", "N")
    assert tokenize("ACGTacgt").tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert tokenize("NnRYKMSWBDHV-").tolist() == [4] * 13
    assert tokenize("").numel() == 0
    assert detokenize(tokenize("acgTRN")) == "ACGTNN"


def test_reverse_complement() -> None:
    tokens = tokenize("AACGTN")
    assert detokenize(reverse_complement(tokens)) == "NACGTT"
    assert torch.equal(reverse_complement(reverse_complement(tokens)), tokens)
    batch = torch.stack([tokenize("ACGT"), tokenize("AAAN")]).long()  # (2, 4)
    assert [detokenize(row) for row in reverse_complement(batch)] == ["ACGT", "NTTT"]
    assert reverse_complement(batch).dtype == torch.long


# --------------------------------------------------------------------------- windows and shards
def test_rank_shards_are_disjoint_equal_and_deterministic() -> None:
    path, seq_len, world = bundled_genome(), 128, 3
    shards = [_windows(path, seq_len, rank=r, world_size=world, batch_size=2) for r in range(world)]
    per_rank = (LAMBDA_BP // seq_len) // world // 2 * 2  # whole groups, then whole batches
    assert [len(s) for s in shards] == [per_rank] * world
    seen = [detokenize(w) for s in shards for w in s]
    assert len(set(seen)) == len(seen)  # no window on two ranks
    sequence = "".join(c for _, c in read_fasta(path))
    assert all(sequence.find(w) % seq_len == 0 for w in seen)  # aligned, non-overlapping windows
    again = _windows(path, seq_len, rank=1, world_size=world, batch_size=2)
    assert all(torch.equal(a, b) for a, b in zip(again, shards[1]))
    other_seed = _windows(path, seq_len, rank=1, world_size=world, batch_size=2, seed=1)
    assert sorted(map(detokenize, other_seed)) == sorted(map(detokenize, shards[1]))
    assert [detokenize(w) for w in other_seed] != [detokenize(w) for w in shards[1]]


def test_window_batches_shape_and_dtype() -> None:
    batch = next(genome_windows(bundled_genome(), 64, batch_size=4))
    assert batch.shape == (4, 64) and batch.dtype == torch.long
    assert int(batch.max()) <= 3  # lambda has no N


def test_reverse_complement_augmentation_every_other_window() -> None:
    kw = dict(rank=0, world_size=2, batch_size=1, shuffle_windows=0)
    plain = _windows(bundled_genome(), 32, **kw)
    augmented = _windows(bundled_genome(), 32, reverse_complement=True, **kw)
    assert len(plain) == len(augmented)
    for k, (p, a) in enumerate(zip(plain, augmented)):
        assert torch.equal(a, reverse_complement(p) if k % 2 else p)


def test_windows_do_not_span_records(tmp_path: Path) -> None:
    path = write_fasta(tmp_path / "two.fa", ">a\nAAAAAC\n>b\nGGGGGT\n")
    assert [detokenize(w) for w in _windows(path, 4, shuffle_windows=0)] == ["AAAA", "GGGG"]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(seq_len=1), "seq_len=1"),
        (dict(seq_len=64, rank=2, world_size=2), "rank=2"),
        (dict(seq_len=64, world_size=0), "world_size=0"),
        (dict(seq_len=64, batch_size=0), "batch_size=0"),
    ],
)
def test_bad_window_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(GenomeError, match=match):
        genome_windows(bundled_genome(), **kwargs)


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(GenomeError, match="does not exist"):
        read_fasta(tmp_path / "missing.fa")
    with pytest.raises(GenomeError, match="not FASTA"):
        genome_windows(write_fasta(tmp_path / "x.csv", "a,b\n1,2\n"), 64)
    (tmp_path / "bin.fa").write_bytes(bytes(range(256)))
    with pytest.raises(GenomeError, match="not FASTA"):
        read_fasta(tmp_path / "bin.fa")
    with pytest.raises(GenomeError, match="line 2"):
        list(read_fasta(write_fasta(tmp_path / "bad.fa", ">x\nAC1GT\n")))
    with pytest.raises(GenomeError, match="too short"):
        list(genome_windows(write_fasta(tmp_path / "short.fa", ">x\nACGT\n"), 8))
    assert issubclass(GenomeError, ZeroFXError) and issubclass(GenomeError, ValueError)


# --------------------------------------------------------------------------- CLI
def test_cli_plan_1b_at_world_size_1024(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "1b", "--world-size", "1024", "--stage", "3", "--seq-len", "256", "--budget", "4GiB"]) == 0
    out = capsys.readouterr().out
    assert "ZeRO stage 3, world size 1024" in out
    assert "1,011,970,048 parameters" in out
    # 20 identical blocks: planned by folding (zerofx.planner.folding), rows of the 2-block capture.
    assert "'blocks' holds 20 identical blocks" in out and "(one row per collective" in out and "x19" in out
    assert "all_gather" in out and "reduce_scatter" in out
    assert "budget 4 GiB: fits" in out and "estimated step" in out


def test_cli_estimate_matches_the_paper(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--params", "7.5e9", "--world-size", "64", "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    gb = [round(data["per_device_bytes"][s] / 1e9, 1) for s in "0123"]
    assert gb == [120.0, 31.4, 16.6, 1.9]  # ZeRO paper, Figure 1
    assert main(["estimate", "--params", "20e9", "--world-size", "8", "--stage", "3"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1].split()[-2:] == ["37.3", "GiB"]  # 320e9 bytes -> 40e9 (37.3 GiB) per device
    assert main(["estimate", "small", "--world-size", "8", "--offload", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "on cpu" in out and "activation peak" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["0", "1", "2", "3"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["plan", "13b", "--world-size", "8", "--stage", "3"], "accepted: " + ", ".join(MODEL_SIZES)),
        (["plan", "tiny", "--world-size", "0", "--stage", "3"], "argument --world-size: 0 is out of range"),
        (["plan", "tiny", "--world-size", "8", "--stage", "4"], "--stage 4"),
        (["estimate", "tiny", "--world-size", "8", "--stage", "-1"], "--stage -1"),
        (["estimate", "--world-size", "8"], "exactly one of --params P and --model MODEL"),
        (["plan", "tiny", "--world-size", "8", "--stage", "3", "--solve", "seq_len"], "--solve seq_len needs --budget"),
        (["plan", "tiny", "--world-size", "8", "--stage", "3", "--budget", "lots"], "cannot read 'lots' as a size"),
        (["plan", "tiny", "--world-size", "8", "--stage", "3", "--profile", "tpu"], "neither a built-in"),
        (["train", "--model", "tinny"], "did you mean tiny"),
        (["train", "--world-size", "0"], "argument --world-size: 0 is out of range"),
        (["train", "--seq-len", "1"], "argument --seq-len: 1 is out of range"),
        (["train", "--fasta", "/nonexistent/genome.fa"], "does not exist"),
        (["plan", "tiny", "--world-size", "two"], "invalid int value"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_cli_bad_input_is_one_line_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("zerofx: error: ") and message in captured.err
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err


def test_cli_help(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--help"], ["plan", "--help"], ["estimate", "--help"], ["train", "--help"], ["calibrate", "--help"], ["consolidate", "--help"]):
        assert main(argv) == 0
        assert "usage: zerofx" in capsys.readouterr().out
    assert main(["train", "--help"]) == 0
    assert "--print-graph" in capsys.readouterr().out


def test_cli_train_two_gloo_ranks_stage3(capfd: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # capfd, not capsys: the spawned ranks write to the inherited file descriptors.
    run = tmp_path / "run"
    assert main(["train", "--world-size", "2", "--stage", "3", "--steps", "3", "--seq-len", "64", "--output-dir", str(run),
                 "--save-every", "1", "--keep-last", "2", "--collective-timeout", "60"]) == 0
    out = capfd.readouterr().out
    losses = [float(line.split()[3]) for line in out.splitlines() if line.startswith("step ")]
    assert len(losses) == 3 and "step 3/3 loss" in out
    # Untrained, the model guesses about uniformly over 5 tokens: ln 5 = 1.609.
    assert abs(losses[0] - 1.609) < 0.1 and losses[-1] < losses[0]
    assert "genome lambda_virus.fa.gz: 48,502 bases in 1 record, 0 N or other ambiguity codes (0.00%)" in out
    # --keep-last 2: the first of three saves is deleted once the third is complete.
    assert sorted(p.name for p in run.glob("step-*")) == ["step-00000002", "step-00000003"]


def test_kmer_tokens_and_windows() -> None:
    from zerofx.data.genome import bundled_genome, genome_windows, kmer_tokens, kmer_vocab_size, tokenize

    tokens = tokenize("ACGTNAcgTT")
    # AC -> 0*4+1, GT -> 2*4+3, NA -> has N, cg -> 1*4+2, TT -> 3*4+3
    assert kmer_tokens(tokens, 2).tolist() == [1, 11, 16, 6, 15]
    assert kmer_tokens(tokens, 3).tolist() == [0 * 16 + 1 * 4 + 2, 64, 1 * 16 + 2 * 4 + 3]  # ACG, TNA (N), cgT; tail dropped
    assert kmer_vocab_size(3) == 65
    batch = next(iter(genome_windows(bundled_genome(), 32, kmer=3, batch_size=2, shuffle_windows=0)))
    single = next(iter(genome_windows(bundled_genome(), 96, batch_size=2, shuffle_windows=0)))
    assert batch.shape == (2, 32) and torch.equal(batch, kmer_tokens(single, 3))
    assert int(batch.max()) < kmer_vocab_size(3)


def test_config_schema_is_generated_from_the_validator(capsys: pytest.CaptureFixture[str]) -> None:
    from zerofx.config.schema import SCHEMA

    assert main(["config-schema", "--format", "json"]) == 0
    keys = {row["key"]: row for row in json.loads(capsys.readouterr().out)}
    assert set(SCHEMA) <= set(keys)
    assert keys["zero_optimization.stage"]["accepted"] == "0, 1, 2 or 3"
    assert keys["fp16.initial_scale_power"]["acted_on"] is True or keys["fp16.initial_scale_power"]["acted_on"] == "yes"
    assert keys["zero_optimization.offload_optimizer.device"]["acted_on"] == "yes"
    assert keys["zero_optimization.offload_param.device"]["acted_on"] == "yes"
    assert keys["zero_optimization.offload_param.buffer_size"]["acted_on"] == "read, warns"


def test_train_takes_the_micro_batch_from_the_config(tmp_path: Path) -> None:
    from zerofx.app.training import TrainOptions, check_train_options

    cfg = tmp_path / "ds.json"
    cfg.write_text('{"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 2}}')
    opts = check_train_options(TrainOptions(config=cfg, seq_len=64))
    assert opts.batch_size == 3 and opts.stage == 2
    # A --batch-size that disagrees with the config is an error naming both (issue 20, item 14).
    with pytest.raises(ZeroFXError, match="--batch-size 1 disagrees .* train_micro_batch_size_per_gpu=3"):
        check_train_options(TrainOptions(config=cfg, seq_len=64, batch_size=1))
    assert check_train_options(TrainOptions(seq_len=64)).batch_size == 2


def test_train_banner_names_the_data_and_sequence_layout(tmp_path: Path) -> None:
    from zerofx.app.training import TrainOptions, _batch_phrase, check_train_options

    cfg = tmp_path / "sp.json"
    cfg.write_text('{"zero_optimization": {"stage": 3}, "zerofx": {"world_size": 4, "sequence_parallel": {"size": 2}}}')
    opts = check_train_options(TrainOptions(model="striped-tiny", config=cfg, seq_len=64, world_size=4))
    assert _batch_phrase(opts) == (f"batch {opts.batch_size}x64 tokens per sequence group (2 data x 2 sequence ranks, "
                                   f"{opts.batch_size}x32 positions per rank)")
    plain = check_train_options(TrainOptions(model="striped-tiny", seq_len=64, world_size=2))
    assert _batch_phrase(plain) == f"batch {plain.batch_size}x64 tokens per rank"
