"""``zerofx train``'s data: the prepared genome a run reads, and its training and held-out samplers.

A run reads a prepared genome (NOTE [What a prepared genome holds] in ``zerofx.data.prepared``):
``--data DIR`` from ``zerofx data prepare``, or the ``--fasta`` file (the bundled lambda phage by
default) prepared into the data cache on first use. Windows come from ``WindowSampler`` (NOTE [A
window is a function of its index] in ``zerofx.data.sampling``): a rank's micro-batch m of a run
that had consumed ``first_sample`` samples when it started holds the samples
``first_sample + m * B * D + g * B`` and the next B - 1, for data-parallel group g of D.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch
from tqdm import tqdm

from zerofx.common.errors import UsageError
from zerofx.data.genome import GenomeError
from zerofx.data.prepared import PreparedGenome, cached_prepare, open_prepared
from zerofx.data.sampling import WindowSampler, split_regions
from zerofx.data.tokenizers import KmerTokenizer

LARGE_SOURCE_BYTES = 64 << 20  # a FASTA this large announces its preparation on stderr


class DataOptions(Protocol):
    """The fields of ``TrainOptions`` the data reads."""

    fasta: Path | None
    data: Path | None
    seq_len: int
    seed: int
    bed: Path | None
    holdout_records: tuple[str, ...]
    holdout_bed: Path | None
    max_n_fraction: float
    reverse_complement: bool


def resolve_data(fasta: Path | None, data: Path | None) -> Path:
    """The prepared directory a run reads: ``data``, or ``fasta`` prepared into the cache."""
    if data is not None:
        open_prepared(data)  # checks it, and that it still matches its sources
        return Path(data)
    assert fasta is not None
    size = fasta.stat().st_size if fasta.is_file() else 0
    bar = tqdm(total=size, unit="B", unit_scale=True, desc=f"preparing {fasta.name}", file=sys.stderr,
               disable=size < LARGE_SOURCE_BYTES or not sys.stderr.isatty())
    path, written = cached_prepare(fasta, progress=bar.update)
    bar.close()
    if written and size >= LARGE_SOURCE_BYTES:
        print(f"prepared {fasta} into {path} (once: later runs read it from there; zerofx data prepare makes one "
              "anywhere)", file=sys.stderr, flush=True)
    return path


def window_bases(opts: DataOptions, tokenizer: KmerTokenizer | None) -> int:
    """Bases per window: ``seq_len``, or ``seq_len * k`` for k-mer ids (cut to ``seq_len`` ids)."""
    return opts.seq_len * (1 if tokenizer is None else tokenizer.k)


def sampler(opts: DataOptions, genome: Path | PreparedGenome, split: str, tokenizer: KmerTokenizer | None) -> WindowSampler:
    """The run's sampler of ``split`` ("train" or "eval") over its regions (NOTE [Held-out regions])."""
    opened = genome if isinstance(genome, PreparedGenome) else open_prepared(genome)
    train, held = split_regions(opened, train_bed=opts.bed, holdout_records=opts.holdout_records, holdout_bed=opts.holdout_bed)
    return WindowSampler(opened, train if split == "train" else held, window_bases=window_bases(opts, tokenizer),
                         seq_len=opts.seq_len, seed=opts.seed, split=split, tokenizer=tokenizer,
                         reverse_complement=opts.reverse_complement and split == "train", max_n_fraction=opts.max_n_fraction)


def check_data(opts: DataOptions, genome: Path, tokenizer: KmerTokenizer | None) -> None:
    """``UsageError`` naming the flag when the regions or the first window cannot be drawn."""
    try:
        sampler(opts, genome, "train", tokenizer).batch(0, 1)
    except GenomeError as exc:
        raise UsageError(str(exc)) from None


def batch_starts(*, first: int, group: int, groups: int, batch_size: int) -> Iterator[int]:
    """The index of the first sample of each of group ``group``'s batches from ``first`` on,
    forever: its batch holds that sample and the next ``batch_size - 1``."""
    index = first + group * batch_size
    while True:
        yield index
        index += batch_size * groups


def sample_batches(draw: WindowSampler, *, first: int, group: int, groups: int, batch_size: int) -> Iterator[torch.Tensor]:
    """Group ``group``'s batches of ``draw``'s samples from ``first`` on, forever."""
    for index in batch_starts(first=first, group=group, groups=groups, batch_size=batch_size):
        yield draw.batch(index, batch_size)
