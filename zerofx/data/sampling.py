"""Windows drawn anywhere in a prepared genome, as a pure function of (seed, split, sample index).

    genome = open_prepared(Path("hg38.zfx"))
    train, held_out = split_regions(genome, holdout_records=("chr20",))
    sampler = WindowSampler(genome, train, window_bases=1024, seed=0, split="train")
    batch = sampler.batch(first=step * global_batch + rank * batch_size, batch_size=batch_size)  # (B, T) int64

NOTE [A window is a function of its index]
Sample j of a split is drawn from a counter-based generator: numpy's Philox keyed by a hash of
(seed, split), with j in the counter's second word, so each sample has its own stream of 2**64
draws and no two samples share one. Whichever rank, world size or process draws sample j, it
gets the same window. A run numbers its samples in the order it consumes them: micro-batch m of
a run with D data-parallel groups of B windows gives group g the samples m*B*D + g*B .. +B-1,
offset by the samples consumed before a resume. So a resume at any step costs nothing but the
count, at any world size, and goes on with the samples the uninterrupted run would have drawn.

A draw picks a source with probability proportional to its weight (among the sources with room
for a window in the split), then a start uniformly over every position of the source's
intervals where the whole window fits, so no window spans two records or leaves its interval.
A window with more than ``max_n_fraction`` of N is skipped: the next draws of the same stream
are tried, up to ``MAX_DRAWS``, after which the genome is reported as too much N. With
``reverse_complement``, one more draw of the stream decides whether the window is read on the
reverse strand (half of them are). Tokenizers apply to the window's bases: k-mer ids from
``seq_len * k`` bases, cut to ``seq_len`` ids (a window holding N gives more ids than k-mers).

NOTE [Held-out regions]
Training and evaluation draw from disjoint intervals: the held-out ones are whole records named
by the user, or a BED file's intervals, or by default the last ``HOLDOUT_SHARE`` of every
record; training takes the rest (or the training BED's intervals less the held-out ones). A
window lies wholly inside one interval, so no training window overlaps a held-out base.
Evaluation draws its own samples 0, 1, ... from the held-out intervals with split "eval": the
same windows in every run, spread over every held-out region rather than the first of the file.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from zerofx.data.genome import GenomeError
from zerofx.data.prepared import PreparedGenome
from zerofx.data.tokenizers import KmerTokenizer

HOLDOUT_SHARE = 0.1
DEFAULT_MAX_N_FRACTION = 0.1
MAX_DRAWS = 10_000
_COMPLEMENT = np.array([3, 2, 1, 0, 4], dtype=np.uint8)  # A<->T, C<->G, N stays N
_LETTERS = b"ACGTN" + bytes(251)


@dataclass(frozen=True)
class Intervals:
    """Half-open intervals ``[start, end)`` of records (indices into the genome's records)."""

    record: np.ndarray  # (K,) int64
    start: np.ndarray  # (K,) int64
    end: np.ndarray  # (K,) int64

    @staticmethod
    def of(record: Sequence[int], start: Sequence[int], end: Sequence[int]) -> Intervals:
        return Intervals(*(np.asarray(a, dtype=np.int64).reshape(-1) for a in (record, start, end)))

    def __len__(self) -> int:
        return len(self.record)


def whole_records(genome: PreparedGenome, records: np.ndarray | None = None) -> Intervals:
    records = np.arange(genome.num_records) if records is None else records
    return Intervals.of(records, np.zeros(len(records)), genome.lengths[records])


def _record_index(genome: PreparedGenome, name: str, where: str) -> int:
    hits = [i for i, n in enumerate(genome.names) if n == name]
    if not hits:
        close = ", ".join(genome.names[:5]) + (", ..." if genome.num_records > 5 else "")
        raise GenomeError(f"{where}: record {name!r} is not in the genome; its records are {close}")
    if len(hits) > 1:
        raise GenomeError(f"{where}: record {name!r} names {len(hits)} records of the genome; give its records unique names")
    return hits[0]


def read_bed(path: Path, genome: PreparedGenome) -> Intervals:
    """A BED file's intervals (the first three columns: record, 0-based start, end; 'track',
    'browser' and '#' lines skipped). ``GenomeError`` for a malformed line, an unknown record,
    or an interval empty or outside its record."""
    records, starts, ends = [], [], []
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise GenomeError(f"BED file {str(path)!r} cannot be read: {exc}") from None
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.startswith(("#", "track", "browser")):
            continue
        fields = line.split("\t") if "\t" in line else line.split()
        where = f"BED file {str(path)!r} line {lineno}"
        try:
            start, end = int(fields[1]), int(fields[2])
        except (IndexError, ValueError):
            raise GenomeError(f"{where}: {line[:60]!r} is not 'record start end'; accepted: BED, 0-based, end exclusive") from None
        record = _record_index(genome, fields[0], where)
        length = int(genome.lengths[record])
        if not 0 <= start < end <= length:
            raise GenomeError(f"{where}: interval {fields[0]}:{start}-{end} is outside its record, which holds {length:,} "
                              f"bases; accepted: 0 <= start < end <= {length:,}")
        records.append(record)
        starts.append(start)
        ends.append(end)
    if not records:
        raise GenomeError(f"BED file {str(path)!r} holds no interval; accepted: lines 'record<TAB>start<TAB>end'")
    return Intervals.of(records, starts, ends)


def subtract(a: Intervals, b: Intervals) -> Intervals:
    """The parts of ``a``'s intervals that no interval of ``b`` covers."""
    records, starts, ends = [], [], []
    for r, s, e in zip(a.record.tolist(), a.start.tolist(), a.end.tolist()):
        cuts = sorted((bs, be) for br, bs, be in zip(b.record.tolist(), b.start.tolist(), b.end.tolist()) if br == r and bs < e and be > s)
        for cs, ce in cuts:
            if cs > s:
                records.append(r)
                starts.append(s)
                ends.append(cs)
            s = max(s, ce)
        if s < e:
            records.append(r)
            starts.append(s)
            ends.append(e)
    return Intervals.of(records, starts, ends)


def split_regions(genome: PreparedGenome, *, train_bed: Path | None = None, holdout_records: Sequence[str] = (),
                  holdout_bed: Path | None = None) -> tuple[Intervals, Intervals]:
    """(training intervals, held-out intervals), disjoint (NOTE [Held-out regions])."""
    if holdout_records and holdout_bed is not None:
        raise GenomeError("held-out records and a held-out BED file were both given; accepted: one of them")
    if holdout_records:
        held = whole_records(genome, np.array([_record_index(genome, n, "held-out records") for n in holdout_records]))
    elif holdout_bed is not None:
        held = read_bed(holdout_bed, genome)
    else:
        tail = (genome.lengths * HOLDOUT_SHARE).astype(np.int64)
        held = Intervals.of(np.arange(genome.num_records), genome.lengths - tail, genome.lengths)
    train = read_bed(train_bed, genome) if train_bed is not None else whole_records(genome)
    return subtract(train, held), held


def _key(seed: int, split: str) -> np.ndarray:
    digest = hashlib.sha256(f"zerofx-window:{seed}:{split}".encode()).digest()
    return np.frombuffer(digest[:16], dtype=np.uint64).copy()


class WindowSampler:
    """Draws windows of ``window_bases`` bases from ``intervals`` (NOTE [A window is a function of its index])."""

    def __init__(self, genome: PreparedGenome, intervals: Intervals, *, window_bases: int, seed: int, split: str,
                 seq_len: int | None = None, tokenizer: KmerTokenizer | None = None, reverse_complement: bool = False,
                 max_n_fraction: float = DEFAULT_MAX_N_FRACTION) -> None:
        if not 0 <= max_n_fraction <= 1:
            raise GenomeError(f"max_n_fraction={max_n_fraction!r} is invalid; accepted: a number in 0..1")
        self.genome, self.window_bases, self.split = genome, window_bases, split
        self.seq_len = window_bases if seq_len is None else seq_len
        self.tokenizer, self.reverse_complement = tokenizer, reverse_complement
        self.max_n = int(max_n_fraction * window_bases)
        self.key = _key(seed, split)
        room = intervals.end - intervals.start - window_bases + 1  # (K,) window starts that fit
        fits = room > 0
        if not fits.any():
            longest = int((intervals.end - intervals.start).max()) if len(intervals) else 0
            raise GenomeError(f"a window of {window_bases:,} bases is longer than every {split} region of {str(genome.path)!r} "
                              f"(the longest holds {longest:,} bases); use a shorter --seq-len or other regions")
        record = intervals.record[fits]
        self._first = genome.offsets[record] + intervals.start[fits]  # (K',) global start of each interval's first window
        source = genome.sources_of[record]
        self._room_cum: list[np.ndarray] = []
        self._where: list[np.ndarray] = []
        weights = []
        for s, info in enumerate(genome.sources):
            mine = np.flatnonzero(source == s)
            if len(mine):
                self._where.append(mine)
                self._room_cum.append(np.cumsum(room[fits][mine]))
                weights.append(float(info["weight"]))
        self._source_cum = np.cumsum(weights) / sum(weights)

    def start(self, index: int) -> tuple[int, bool]:
        """Sample ``index``'s global start in the token map, and whether it is reverse-complemented."""
        rng = np.random.Generator(np.random.Philox(key=self.key, counter=np.array([0, index, 0, 0], dtype=np.uint64)))
        for _ in range(MAX_DRAWS):
            s = int(np.searchsorted(self._source_cum, rng.random(), side="right")) if len(self._room_cum) > 1 else 0
            s = min(s, len(self._room_cum) - 1)
            cum = self._room_cum[s]
            u = int(rng.integers(int(cum[-1])))
            i = int(np.searchsorted(cum, u, side="right"))
            start = int(self._first[self._where[s][i]] + u - (cum[i - 1] if i else 0))
            rc = bool(rng.integers(2)) if self.reverse_complement else False
            if self.max_n >= self.window_bases or int(self.genome.count_n(start, start + self.window_bases)) <= self.max_n:
                return start, rc
        raise GenomeError(f"{MAX_DRAWS:,} draws from the {self.split} regions of {str(self.genome.path)!r} found no window of "
                          f"{self.window_bases:,} bases with at most {self.max_n:,} N; the regions are mostly N: raise "
                          "--max-n-fraction or pass regions that hold sequence (--bed)")

    def window(self, index: int) -> np.ndarray:
        """Sample ``index``'s bases ((window_bases,) uint8 tokens, a copy)."""
        start, rc = self.start(index)
        bases = np.array(self.genome.tokens[start : start + self.window_bases])
        return _COMPLEMENT[bases[::-1]] if rc else bases

    def batch(self, first: int, batch_size: int) -> torch.Tensor:
        """Samples ``first`` .. ``first + batch_size - 1`` as (batch_size, seq_len) int64 token ids."""
        rows = [self.window(first + b) for b in range(batch_size)]
        if self.tokenizer is None:
            return torch.from_numpy(np.stack(rows)).long()  # (B, T)
        return torch.stack([self.tokenizer.encode(row.tobytes().translate(_LETTERS).decode())[: self.seq_len] for row in rows])
