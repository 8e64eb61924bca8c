"""Prepared genomes (zerofx/data/prepared.py), windows drawn anywhere (zerofx/data/sampling.py),
``zerofx data prepare`` and ``zerofx train``'s data (zerofx/app/train_data.py)."""

from __future__ import annotations

import itertools
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.fasta import write_fasta
from zerofx.app.cli import main
from zerofx.app.training import TrainOptions, _cycle_batches, check_train_options, data_order_note
from zerofx.common.errors import UsageError
from zerofx.data.genome import N_TOKEN, GenomeError, tokenize
from zerofx.data.prepared import Source, open_prepared, prepare_genome, read_manifest
from zerofx.data.sampling import WindowSampler, split_regions
from zerofx.data.tokenizers import KmerTokenizer

SEQ_LEN = 64


def _assembly(tmp_path: Path, *, gz: bool = False) -> tuple[Path, list[tuple[str, str]]]:
    """A FASTA shaped like an assembled genome: every record starts with a long run of N (as
    chromosomes do), soft-masked lowercase, IUPAC codes, two consecutive records of one name,
    and one record on a single line. Returns the file and its (name, sequence) records."""
    rng = random.Random(0)
    records = []
    for i in range(6):
        body = "".join(rng.choice("ACGT") for _ in range(1500))
        body = body[:300] + body[300:600].lower() + "RYKM" + body[604:]  # soft-masked repeats, ambiguity codes
        records.append(("chrDup" if i in (2, 3) else f"chr{i}", "N" * 3000 + body + "n" * 200))
    lines = []
    for i, (name, seq) in enumerate(records):
        wrapped = seq if i == 4 else "\n".join(seq[j : j + 60] for j in range(0, len(seq), 60))  # chr4 on one line
        lines.append(f">{name} assembled\n{wrapped}\n")
    return write_fasta(tmp_path / ("genome.fa.gz" if gz else "genome.fa"), "".join(lines), gz=gz), records


def test_prepare_keeps_every_record_and_counts_n_in_any_window(tmp_path: Path) -> None:
    path, records = _assembly(tmp_path, gz=True)
    genome = open_prepared(prepare_genome([Source(path)], tmp_path / "prepared"))
    # Two records of one name stay two records (the streaming reader merged them).
    assert genome.names == tuple(name for name, _ in records)
    want = np.concatenate([tokenize(seq).numpy() for _, seq in records])
    assert np.array_equal(np.asarray(genome.tokens), want)
    assert genome.lengths.tolist() == [len(seq) for _, seq in records]
    is_n = np.concatenate(([0], np.cumsum(want == N_TOKEN)))
    rng = np.random.default_rng(0)
    starts = rng.integers(0, len(want) - 200, 500)
    ends = starts + rng.integers(0, 200, 500)
    assert np.array_equal(genome.count_n(starts, ends), is_n[ends] - is_n[starts])
    assert genome.summaries() == [f"genome genome.fa.gz: {len(want):,} bases in 6 records, {int((want == N_TOKEN).sum()):,} N or other ambiguity codes "
                                  f"({(want == N_TOKEN).mean():.2%})"]


def test_train_windows_are_sequence_from_the_first_step(tmp_path: Path) -> None:
    """Every record starts with 3,000 N: in file order, the first windows of every rank were N.
    Drawn from the whole genome with N windows skipped, the first step trains on sequence, on
    both ranks, and the held-out windows hold sequence too."""
    path, _ = _assembly(tmp_path)
    opts = check_train_options(TrainOptions(fasta=path, seq_len=SEQ_LEN, world_size=2))
    for rank in range(2):
        inputs, _ = next(_cycle_batches(opts, rank))
        assert (inputs == N_TOKEN).float().mean(dim=1).max() <= 0.1
    genome = open_prepared(opts.data)
    _, held = split_regions(genome)
    evaluation = WindowSampler(genome, held, window_bases=SEQ_LEN, seed=0, split="eval")
    assert (evaluation.batch(0, 8) == N_TOKEN).float().mean(dim=1).max() <= 0.1


def test_a_window_is_a_function_of_its_index(tmp_path: Path) -> None:
    """Sample j is the same at any world size; a resume from the samples consumed continues the
    uninterrupted run's data without drawing what came before."""
    path, _ = _assembly(tmp_path)
    two = check_train_options(TrainOptions(fasta=path, seq_len=SEQ_LEN, world_size=2, batch_size=2))
    one = check_train_options(TrainOptions(fasta=path, seq_len=SEQ_LEN, world_size=1, batch_size=2))
    streams = [list(itertools.islice(_cycle_batches(two, rank), 3)) for rank in range(2)]
    # The world-2 run's samples in order: step 0 rank 0, step 0 rank 1, step 1 rank 0, ...
    world2 = torch.cat([streams[rank][step][0] for step in range(3) for rank in range(2)])
    world1 = torch.cat([x for x, _ in itertools.islice(_cycle_batches(one, 0), 6)])
    assert torch.equal(world1, world2)
    # Resumed after 2 steps of world 2 (8 samples), at world 1: the uninterrupted order goes on.
    resumed = torch.cat([x for x, _ in itertools.islice(_cycle_batches(one, 0, first_sample=8), 2)])
    assert torch.equal(resumed, world2[8:])
    assert not torch.equal(world2[0], world2[1])
    other_seed = check_train_options(TrainOptions(fasta=path, seq_len=SEQ_LEN, world_size=1, batch_size=2, seed=1))
    assert not torch.equal(next(_cycle_batches(other_seed, 0))[0], world1[:2])


def test_held_out_regions_never_overlap_training_windows(tmp_path: Path) -> None:
    path, records = _assembly(tmp_path)
    genome = open_prepared(prepare_genome([Source(path)], tmp_path / "prepared"))
    bed = tmp_path / "held.bed"
    bed.write_text("track name=held\nchr1\t3000\t4000\nchr5\t3500\t4700\n")
    for kwargs, held_records in (({"holdout_records": ("chr0", "chr4")}, {0, 4}), ({"holdout_bed": bed}, {1, 5}), ({}, set(range(6)))):
        train, held = split_regions(genome, **kwargs)
        draws = {split: WindowSampler(genome, regions, window_bases=SEQ_LEN, seed=3, split=split, max_n_fraction=1.0)
                 for split, regions in (("train", train), ("eval", held))}
        covered = np.zeros(len(genome.tokens), dtype=bool)
        for r, s, e in zip(held.record, held.start, held.end):
            covered[genome.offsets[r] + s : genome.offsets[r] + e] = True
        eval_records = set()
        for j in range(300):
            start, _ = draws["train"].start(j)
            assert not covered[start : start + SEQ_LEN].any()
            start, _ = draws["eval"].start(j)
            assert covered[start : start + SEQ_LEN].all()
            eval_records.add(int(np.searchsorted(genome.offsets, start, side="right") - 1))
        assert eval_records == held_records  # evaluation spreads over every held-out region, not the first


def test_sources_are_drawn_by_weight_and_reverse_complemented(tmp_path: Path) -> None:
    a = write_fasta(tmp_path / "a.fa", ">a\n" + "A" * 4000 + "\n")
    c = write_fasta(tmp_path / "c.fa", ">c\n" + "C" * 1000 + "\n")
    manifest = tmp_path / "species.tsv"
    manifest.write_text(f"# path weight\n{a.name}\t1\n{c.name}\t3\n")
    genome = open_prepared(prepare_genome(read_manifest(manifest), tmp_path / "both"))
    train, _ = split_regions(genome)
    draw = WindowSampler(genome, train, window_bases=32, seed=0, split="train", reverse_complement=True)
    firsts = np.array([draw.window(j)[0] for j in range(4000)])  # A=0, C=1, G=2, T=3
    # Weighted 1:3 although source a is 4 times longer; half of each read on the reverse strand.
    assert abs(np.isin(firsts, (1, 2)).mean() - 0.75) < 0.03
    assert abs((firsts == 2).mean() - 0.375) < 0.03 and abs((firsts == 3).mean() - 0.125) < 0.03
    tokenizer = KmerTokenizer(6)
    ids = WindowSampler(genome, train, window_bases=6 * 8, seq_len=8, seed=0, split="train", tokenizer=tokenizer).batch(0, 4)
    assert ids.shape == (4, 8) and set(ids.flatten().tolist()) <= {tokenizer.token_to_id("A" * 6), tokenizer.token_to_id("C" * 6)}


def test_bad_data_is_refused_by_name(tmp_path: Path) -> None:
    path, _ = _assembly(tmp_path)
    prepared = prepare_genome([Source(path)], tmp_path / "prepared")
    genome = open_prepared(prepared)
    bed = tmp_path / "bad.bed"
    bed.write_text("chr1\t100\t99999\n")
    with pytest.raises(GenomeError, match=r"line 1: interval chr1:100-99999 is outside its record, which holds 4,700 bases"):
        split_regions(genome, holdout_bed=bed)
    bed.write_text("chrDup\t0\t10\n")
    with pytest.raises(GenomeError, match=r"record 'chrDup' names 2 records"):
        split_regions(genome, train_bed=bed)
    with pytest.raises(GenomeError, match=r"record 'chrX' is not in the genome"):
        split_regions(genome, holdout_records=("chrX",))
    manifest = tmp_path / "m.tsv"
    manifest.write_text(f"{path.name}\t0\n")
    with pytest.raises(GenomeError, match=r"line 1: weight 0.0 is invalid; accepted: a finite number > 0"):
        read_manifest(manifest)
    with pytest.raises(GenomeError, match=r"a window of 9,000 bases is longer than every train region .* 4,230 bases"):
        WindowSampler(genome, split_regions(genome)[0], window_bases=9000, seed=0, split="train")
    with pytest.raises(UsageError, match=r"is longer than every train region"):
        check_train_options(TrainOptions(data=prepared, seq_len=9000, model="examples/own_models.py:esm_mlm", objective="mlm"))
    with pytest.raises(UsageError, match=r"--fasta and --data were both given"):
        check_train_options(TrainOptions(fasta=path, data=prepared))
    all_n = write_fasta(tmp_path / "n.fa", ">n\n" + "N" * 5000 + "\n")
    with pytest.raises(UsageError, match=r"found no window of 64 bases with at most 6 N; .* raise --max-n-fraction"):
        check_train_options(TrainOptions(fasta=all_n, seq_len=SEQ_LEN))
    # The FASTA changes after it was prepared: the prepared folder is refused, naming it.
    path.write_text(path.read_text() + ">late\nACGT\n")
    os.utime(path, ns=(1, 1))
    with pytest.raises(GenomeError, match=r"no longer matches its FASTA: .*genome.fa \(was .* bytes, now"):
        open_prepared(prepared)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(GenomeError, match=r"exists and is not a prepared genome"):
        prepare_genome([Source(path)], tmp_path / "other")


def test_resume_note_names_the_regrouping(tmp_path: Path) -> None:
    opts = check_train_options(TrainOptions(seq_len=SEQ_LEN, world_size=1))
    meta = {"world_size": 2, "stage": 3}
    note = data_order_note(meta, opts)
    assert note is not None and "go on in the uninterrupted run's order, 2 a micro-step instead of 4" in note


def test_cli_prepares_then_trains_on_held_out_records(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    path, _ = _assembly(tmp_path)
    out = tmp_path / "genome.zfx"
    assert main(["data", "prepare", str(path), "--out", str(out), "--quiet", "--verify"]) == 0
    printed = capfd.readouterr().out
    assert "in 6 records" in printed and f"zerofx train --data {out}" in printed and "MB/s" in printed
    assert main(["train", "--data", str(out), "--holdout-records", "chr0,chr4", "--world-size", "1", "--steps", "2",
                 "--seq-len", str(SEQ_LEN), "--reverse-complement", "--collective-timeout", "60"]) == 0
    printed = capfd.readouterr().out
    assert "step 2/2 loss" in printed and "eval on held-out windows (8 batches over 1 ranks)" in printed
    assert "genome genome.fa: " in printed and "on genome genome.fa," in printed
