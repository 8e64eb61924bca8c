"""Genomes as training data: a streaming FASTA reader, a DNA tokenizer and per-rank windows.

Nothing here holds a whole genome: ``read_fasta`` yields bounded chunks, and
``genome_windows`` keeps one partial window, one pending window and a bounded shuffle buffer,
so a 3 Gbp human assembly streams in the same memory as the bundled 48,502 bp lambda phage.

Tokens follow ``zerofx.common.vocab.DNA_VOCAB``: A, C, G, T are 0..3, U (RNA) reads as T, and
every other symbol is 4, N. Lowercase (soft-masked repeats) reads as uppercase. With a
``KmerTokenizer`` (``zerofx.data.tokenizers``), windows hold the Nucleotide Transformer's k-mer
ids instead, cut from each record's token stream.

NOTE [What a FASTA file must hold]
A file, plain or gzipped (the content decides, not the name), holds one or more records: a
'>name' header line, then sequence lines; blank lines and ';' comments are skipped. Refused,
each with a ``GenomeError`` naming the file: a missing or empty file (or one that decompresses
to nothing), a first line that is not a header, a file of headers with no sequence line, a
corrupt or truncated gzip stream (named with the line reached), a symbol that is not a
sequence symbol, and too many symbols that are not nucleotide codes (NOTE [Which symbols a
genome may hold]). Positions name the record and the 0-based offset of the symbol in the
record's sequence, with the line and column in the file.

NOTE [Which symbols a genome may hold]
A sequence line holds letters, '-', '*' and '.'; anything else (a digit, a space, a byte that is
not text) is not FASTA and raises ``GenomeError`` at once, naming the line. Of those symbols, the
IUPAC nucleotide codes (A C G T U, and the ambiguity codes R Y S W K M B D H V N, in either case)
are DNA; the ambiguity codes read as N. The rest (E F I J L O P Q X Z, gaps '-' and '.', stop
'*') are "foreign": a few read as N, but when they exceed ``MAX_FOREIGN_FRACTION`` of the
sequence symbols read so far, the file is refused with the count, the fraction and the first
one's record, offset, line and column. A protein FASTA has about 35% foreign letters (E, F, I,
L, P, Q), so it is refused within its first ``FOREIGN_CHECK_MIN_SYMBOLS`` symbols, which every
reader scans when it is called. Before that many symbols the fraction is too noisy to judge (a short first
contig with one gap), so it is checked only from there on, and at the end of the file whatever
its length. A file that crosses the fraction later raises while it is read, at the same line
on every rank, since every rank reads the whole file. X is foreign although RepeatMasker -x masks
repeats with it: replace it with N. ``genome_stats`` reads a whole file and counts what became N.

NOTE [How windows are assigned to ranks]
Each record is cut into non-overlapping windows of ``seq_len`` tokens; a record's tail
shorter than ``seq_len`` is dropped, so no window spans two records (two chromosomes are not
one sequence). Window i of the file goes to rank ``i % world_size``. Rank r emits window
``g * world_size + r`` only once the whole group g of ``world_size`` windows exists, so the
last incomplete group is dropped on every rank and all ranks see the same number of windows:
a rank that ran out early would hang its peers in the next collective. The rank's windows then
pass through a shuffle buffer seeded by (seed, rank), and are stacked into batches; a last
partial batch is dropped for the same reason.
"""

from __future__ import annotations

import gzip
import random
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import torch

from zerofx.data.tokenizers import KmerTokenizer
from zerofx.common.errors import ZeroFXError
from zerofx.common.limits import MAX_FOREIGN_FRACTION
from zerofx.common.vocab import DNA_VOCAB

N_TOKEN = DNA_VOCAB.index("N")
# Maps each token to its complement's token: A<->T, C<->G, N stays N.
_COMPLEMENT = torch.tensor([DNA_VOCAB.index(b) for b in "TGCAN"], dtype=torch.uint8)
# bytes.translate table: ASCII byte -> token id (as a byte); U (RNA) is T; other symbols become N.
_TOKEN_TABLE = bytes(
    DNA_VOCAB.index(chr(b).upper().replace("U", "T")) if chr(b).upper() in "ACGTU" else N_TOKEN for b in range(256)
)
# Symbols a FASTA sequence line may hold: letters in either case, gaps '-' and '.', stop '*'.
_SEQUENCE_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz-*.")
# IUPAC nucleotide codes (NC-IUB 1984): bases, U, and the ambiguity codes, which read as N.
NUCLEOTIDE_CODES = "ACGTURYSWKMBDHVN"
_NUCLEOTIDE_CHARS = frozenset(NUCLEOTIDE_CODES + NUCLEOTIDE_CODES.lower())
# MAX_FOREIGN_FRACTION (zerofx.common.limits, beside the command line's other bounds): NOTE [Which
# symbols a genome may hold].
FOREIGN_CHECK_MIN_SYMBOLS = 10_000
_GZIP_MAGIC = b"\x1f\x8b"
DEFAULT_CHUNK_CHARS = 1 << 16
DEFAULT_SHUFFLE_WINDOWS = 256


class GenomeError(ZeroFXError):
    """A genome file is missing, not FASTA, or too short for the windows asked of it."""


def bundled_genome() -> Path:
    """The Enterobacteria phage lambda genome (NC_001416.1, 48,502 bp) shipped with zerofx."""
    return Path(__file__).resolve().with_name("lambda_virus.fa.gz")


def tokenize(sequence: str) -> torch.Tensor:
    """DNA letters to token ids: a 1-D uint8 tensor, A,C,G,T -> 0..3, U -> 3 (as T) and anything
    else -> 4 (N).

    uint8 because these tensors sit in shuffle buffers; ``genome_windows`` widens to int64.
    """
    if not sequence:
        return torch.empty(0, dtype=torch.uint8)
    # Non-ASCII characters have no DNA meaning: they encode to '?' and so become N.
    data = bytearray(sequence.encode("ascii", errors="replace").translate(_TOKEN_TABLE))
    return torch.frombuffer(data, dtype=torch.uint8)


def detokenize(tokens: torch.Tensor) -> str:
    """Token ids back to letters (N for every non-ACGT symbol); the inverse of ``tokenize``."""
    return "".join(DNA_VOCAB[int(t)] for t in tokens.reshape(-1).tolist())


def reverse_complement(tokens: torch.Tensor) -> torch.Tensor:
    """The reverse complement along the last dimension: reversed, A<->T, C<->G, N stays N."""
    return _COMPLEMENT.to(tokens.device)[tokens.flip(-1).long()].to(tokens.dtype)


def _open_text(path: Path) -> IO[str]:
    """Open ``path`` for reading as text, decompressing when it starts with gzip's magic bytes
    (the content decides, not the extension, so a misnamed file still reads)."""
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == _GZIP_MAGIC:
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    # Headers may be UTF-8; an undecodable byte becomes U+FFFD, which a sequence line rejects.
    return open(path, encoding="utf-8", errors="replace")


@dataclass
class _Tally:
    """What one pass over a file has read so far; ``_sequence_lines`` updates it as it goes."""

    num_lines: int = 0  # lines that are not blank
    num_records: int = 0
    num_symbols: int = 0
    record_symbols: int = 0  # sequence symbols of the current record read so far
    num_foreign: int = 0  # symbols that are not nucleotide codes (NOTE [Which symbols a genome may hold])
    first_foreign: str = ""  # where the first one is, e.g. "'Q' in record 'sp|P1|X' at offset 4 (line 2, column 5)"


def _foreign_error(path: Path, tally: _Tally) -> GenomeError:
    return GenomeError(
        f"genome file {str(path)!r} is not DNA: {tally.num_foreign:,} of its first {tally.num_symbols:,} sequence symbols "
        f"({tally.num_foreign / tally.num_symbols:.1%}) are not nucleotide codes, more than the {MAX_FOREIGN_FRACTION:.0%} "
        f"accepted; the first is {tally.first_foreign}. Accepted: the IUPAC nucleotide codes {' '.join(NUCLEOTIDE_CODES)} "
        "in either case (a protein FASTA is refused; write N for masked or unknown bases)"
    )


def _sequence_lines(path: Path, tally: _Tally) -> Iterator[tuple[str, str]]:
    """Every sequence line of ``path`` as ``(record_name, line)``, stripped and uppercase.

    Raises ``GenomeError`` for a sequence line before the first header, a symbol that is not a
    sequence symbol, too many foreign symbols (NOTE [Which symbols a genome may hold]), and a
    corrupt or truncated gzip stream; each names the file (NOTE [What a FASTA file must hold])."""
    name: str | None = None
    lineno = 0
    try:
        with _open_text(path) as f:
            for lineno, raw in enumerate(f, start=1):
                line = raw.strip()
                if not line:
                    continue
                tally.num_lines += 1
                if line.startswith(";"):
                    continue
                if line.startswith(">"):
                    words = line[1:].split()
                    name = words[0] if words else f"record@{lineno}"
                    tally.num_records += 1
                    tally.record_symbols = 0
                    continue
                if name is None:
                    raise GenomeError(
                        f"genome file {str(path)!r} is not FASTA: its first line should be a '>name' header, got {line[:40]!r}"
                    )
                if not _NUCLEOTIDE_CHARS.issuperset(line):  # rare: the common line is all nucleotide codes
                    indent = len(raw) - len(raw.lstrip())
                    if not _SEQUENCE_CHARS.issuperset(line):
                        bad = [i for i, c in enumerate(line) if c not in _SEQUENCE_CHARS]
                        raise GenomeError(
                            f"{str(path)!r} line {lineno}: {line[bad[0]]!r} in record {name!r} at offset "
                            f"{tally.record_symbols + bad[0]} (column {indent + bad[0] + 1}) is not a sequence symbol "
                            f"({len(bad)} such on this line); accepted: IUPAC letters, '-', '.', '*'"
                        )
                    foreign = [i for i, c in enumerate(line) if c not in _NUCLEOTIDE_CHARS]
                    if not tally.num_foreign:
                        tally.first_foreign = (f"{line[foreign[0]]!r} in record {name!r} at offset {tally.record_symbols + foreign[0]} "
                                               f"(line {lineno}, column {indent + foreign[0] + 1})")
                    tally.num_foreign += len(foreign)
                tally.num_symbols += len(line)
                tally.record_symbols += len(line)
                if (
                    tally.num_foreign > MAX_FOREIGN_FRACTION * tally.num_symbols
                    and tally.num_symbols >= FOREIGN_CHECK_MIN_SYMBOLS
                ):
                    raise _foreign_error(path, tally)
                yield name, line.upper()
    except (EOFError, zlib.error, gzip.BadGzipFile) as exc:  # truncated, corrupt deflate data, bad header or CRC
        raise GenomeError(f"genome file {str(path)!r} is corrupt (gzip) after line {lineno}: {exc}") from exc
    except OSError as exc:
        raise GenomeError(f"genome file {str(path)!r} cannot be read: {exc}") from exc
    if tally.num_foreign > MAX_FOREIGN_FRACTION * tally.num_symbols:
        raise _foreign_error(path, tally)


def _check_fasta_file(path: str | Path) -> Path:
    """Raise ``GenomeError`` unless ``path`` is a readable FASTA file whose first
    ``FOREIGN_CHECK_MIN_SYMBOLS`` sequence symbols (or all, if fewer) are DNA
    (NOTE [What a FASTA file must hold])."""
    p = Path(path)
    if p.is_dir():
        raise GenomeError(f"genome file {str(p)!r} is a folder; pass a FASTA file (.fa, .fasta, optionally .gz)")
    if not p.is_file():
        raise GenomeError(f"genome file {str(p)!r} does not exist; pass a FASTA file (.fa, .fasta, optionally .gz)")
    tally = _Tally()
    lines = _sequence_lines(p, tally)
    try:
        for _ in lines:
            if tally.num_symbols >= FOREIGN_CHECK_MIN_SYMBOLS:
                break
    finally:
        lines.close()
    if tally.num_lines == 0:
        raise GenomeError(f"genome file {str(p)!r} is empty; pass a FASTA file with '>name' header lines and sequence lines")
    if tally.num_records == 0:
        raise GenomeError(f"genome file {str(p)!r} is not FASTA: it has no '>name' header line")
    if tally.num_symbols == 0:  # fewer than FOREIGN_CHECK_MIN_SYMBOLS: the whole file was read
        records = f"{tally.num_records:,} header line{'' if tally.num_records == 1 else 's'}"
        raise GenomeError(f"genome file {str(p)!r} has {records} but no sequence lines; each '>name' line is followed by its sequence")
    return p


def read_fasta(path: str | Path, *, chunk_chars: int = DEFAULT_CHUNK_CHARS) -> Iterator[tuple[str, str]]:
    """Stream ``(record_name, sequence_chunk)`` pieces from a FASTA file, plain or gzipped.

    ``record_name`` is the first word of the record's '>' header. Chunks are uppercase, hold no
    line breaks, are at most about ``chunk_chars`` long, and concatenate, per record, to the
    record's sequence. The file is checked when this is called (missing, not FASTA, not DNA in its
    first ``FOREIGN_CHECK_MIN_SYMBOLS`` symbols: ``GenomeError``); a bad sequence line later, or
    too many symbols that are not nucleotide codes, raises ``GenomeError`` naming its line.
    """
    if chunk_chars < 1:
        raise GenomeError(f"chunk_chars={chunk_chars!r} is invalid; accepted: an integer >= 1")
    return _read_fasta(_check_fasta_file(path), chunk_chars)


def _read_fasta(path: Path, chunk_chars: int, tally: _Tally | None = None) -> Iterator[tuple[str, str]]:
    tally = _Tally() if tally is None else tally
    record, name, parts, size = 0, "", [], 0
    for line_name, line in _sequence_lines(path, tally):
        if tally.num_records != record:  # the first line of a new record
            if parts:
                yield name, "".join(parts)
            record, name, parts, size = tally.num_records, line_name, [], 0
        parts.append(line)
        size += len(line)
        if size >= chunk_chars:
            yield name, "".join(parts)
            parts, size = [], 0
    if parts:
        yield name, "".join(parts)


@dataclass(frozen=True)
class GenomeStats:
    """What one whole pass over a genome file found (``genome_stats``)."""

    path: Path
    num_records: int
    num_bases: int  # sequence symbols, one token each
    num_n: int  # symbols that became N: N itself, the other ambiguity codes, and tolerated foreign symbols
    num_foreign: int  # of num_n, the symbols that are not nucleotide codes (at most MAX_FOREIGN_FRACTION)
    first_foreign: str = ""  # where the first foreign symbol is; "" when there is none

    @property
    def n_fraction(self) -> float:
        return self.num_n / self.num_bases if self.num_bases else 0.0

    def summary(self) -> str:
        """One line, e.g. "genome lambda_virus.fa.gz: 48,502 bases in 1 record, 0 N or other ambiguity codes
        (0.00%)": every symbol read as N, written N or an ambiguity code."""
        records = f"{self.num_records:,} record{'' if self.num_records == 1 else 's'}"
        line = (f"genome {self.path.name}: {self.num_bases:,} bases in {records}, {self.num_n:,} N or other ambiguity codes "
                f"({self.n_fraction:.2%})")
        if self.num_foreign:
            line += f"; {self.num_foreign:,} of them not nucleotide codes, the first {self.first_foreign}"
        return line


def genome_stats(path: str | Path) -> GenomeStats:
    """Read the whole file once (streaming, as one epoch does) and count its records, its bases
    and how many became N. Raises ``GenomeError`` as ``read_fasta`` does."""
    p = _check_fasta_file(path)
    tally = _Tally()
    num_named = 0  # A, C, G, T and U: the symbols that do not become N
    for _, chunk in _read_fasta(p, DEFAULT_CHUNK_CHARS, tally):
        num_named += sum(chunk.count(c) for c in "ACGTU")
    return GenomeStats(p, tally.num_records, tally.num_symbols, tally.num_symbols - num_named, tally.num_foreign,
                       tally.first_foreign)


def _record_tokens(path: Path, chunk_chars: int, tokenizer: KmerTokenizer | None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(record_name, tokens)`` pieces in file order; a record's pieces concatenate to its
    tokens: ``tokenize`` of each chunk, or the tokenizer's stream over the record's chunks."""
    if tokenizer is None:
        for name, chunk in _read_fasta(path, chunk_chars):
            yield name, tokenize(chunk)
        return
    current: str | None = None
    encoder = tokenizer.encoder()
    for name, chunk in _read_fasta(path, chunk_chars):
        if name != current:
            if current is not None:
                yield current, encoder.finish()  # the last record's tail k-mer, as single nucleotides
            current, encoder = name, tokenizer.encoder()
        yield name, encoder.feed(chunk)
    if current is not None:
        yield current, encoder.finish()


def _record_windows(path: Path, seq_len: int, tokenizer: KmerTokenizer | None = None) -> Iterator[torch.Tensor]:
    """Every full window of ``seq_len`` tokens, record by record, in file order ((T,): uint8,
    or the tokenizer's ``token_dtype``)."""
    current: str | None = None
    dtype = torch.uint8 if tokenizer is None else tokenizer.token_dtype
    carry = torch.empty(0, dtype=dtype)
    for name, piece in _record_tokens(path, max(DEFAULT_CHUNK_CHARS, seq_len), tokenizer):
        if name != current:  # a new record: the last record's short tail is dropped
            current, carry = name, torch.empty(0, dtype=dtype)
        tokens = torch.cat((carry, piece))
        num_full = tokens.numel() // seq_len
        for i in range(num_full):
            # A copy, not a view: a view would keep the whole chunk alive in the shuffle buffer.
            yield tokens[i * seq_len : (i + 1) * seq_len].clone()
        carry = tokens[num_full * seq_len :].clone()


# Every HOLDOUT_EVERY-th group of windows is held out for evaluation (split="eval").
HOLDOUT_EVERY = 10
SPLITS = ("all", "train", "eval")


def _rank_windows(path: Path, seq_len: int, rank: int, world_size: int, split: str = "all",
                  tokenizer: KmerTokenizer | None = None) -> Iterator[torch.Tensor]:
    """This rank's windows: window i goes to rank i % world_size, whole groups only; with a
    ``split``, group g is held out for evaluation when g % HOLDOUT_EVERY == HOLDOUT_EVERY - 1."""
    mine: torch.Tensor | None = None
    for i, window in enumerate(_record_windows(path, seq_len, tokenizer)):
        if i % world_size == rank:
            mine = window
        if i % world_size == world_size - 1:  # group complete: every rank gets one window
            assert mine is not None
            held_out = (i // world_size) % HOLDOUT_EVERY == HOLDOUT_EVERY - 1
            if split == "all" or held_out == (split == "eval"):
                yield mine
            mine = None


def _shuffled(windows: Iterator[torch.Tensor], buffer_size: int, rng: random.Random) -> Iterator[torch.Tensor]:
    """A bounded-buffer shuffle: windows leave in a random order, at most ``buffer_size`` held."""
    buffer: list[torch.Tensor] = []
    for w in windows:
        if len(buffer) < buffer_size:
            buffer.append(w)
            continue
        j = rng.randrange(buffer_size)
        yield buffer[j]
        buffer[j] = w
    rng.shuffle(buffer)
    yield from buffer


def _check_int(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise GenomeError(f"{name}={value!r} is invalid; accepted: an integer >= {low}")
    return value


def genome_windows(
    path: str | Path,
    seq_len: int,
    *,
    rank: int = 0,
    world_size: int = 1,
    batch_size: int = 1,
    seed: int = 0,
    reverse_complement: bool = False,
    shuffle_windows: int = DEFAULT_SHUFFLE_WINDOWS,
    kmer: int = 1,
    split: str = "all",
    tokenizer: KmerTokenizer | None = None,
) -> Iterator[torch.Tensor]:
    """Yield this rank's training batches: int64 tensors of shape (batch_size, seq_len).

    ``split`` = "train" leaves out every ``HOLDOUT_EVERY``-th group of windows, which
    ``split`` = "eval" yields alone: a held-out slice spread over the whole genome.

    With ``kmer`` = k > 1, each token is a non-overlapping k-mer (``kmer_tokens``): a window
    covers ``seq_len * k`` bases and the vocabulary has ``kmer_vocab_size(k)`` tokens.

    With a ``tokenizer`` (the Nucleotide Transformer's layout, ``zerofx.data.tokenizers``), each
    record is tokenized whole, as a stream, and cut into windows of ``seq_len`` of its tokens; a
    window then covers about ``seq_len * k`` bases (fewer where N or <unk> breaks the k-mers).

    Contract (see NOTE [How windows are assigned to ranks]): ranks of one ``world_size`` get
    disjoint windows and the same number of batches; the same arguments give the same batches
    in the same order. ``seed`` seeds the shuffle of this rank's windows within a buffer of
    ``shuffle_windows`` (0 keeps file order). With ``reverse_complement``, every other window
    of this rank's shard (the 2nd, 4th, ...) is replaced by its reverse complement; counting
    within the shard rather than in the file gives every rank half, whatever ``world_size``.

    Arguments and the file are checked when this is called (``GenomeError``: a missing or
    non-FASTA file, one whose first ``FOREIGN_CHECK_MIN_SYMBOLS`` symbols are not DNA, ``seq_len``
    < 2 since a window needs a next token to predict, ``rank`` outside 0..world_size-1). A genome
    too short to give this rank one batch raises ``GenomeError`` when iteration ends.
    """
    _check_int("seq_len", seq_len, 2)
    _check_int("world_size", world_size, 1)
    _check_int("batch_size", batch_size, 1)
    _check_int("shuffle_windows", shuffle_windows, 0)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise GenomeError(f"rank={rank!r} is invalid for world_size={world_size}; accepted: 0..{world_size - 1}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise GenomeError(f"seed={seed!r} is invalid; accepted: an integer")
    _check_int("kmer", kmer, 1)
    if split not in SPLITS:
        raise GenomeError(f"split={split!r} is invalid; accepted: {', '.join(SPLITS)}")
    if tokenizer is not None and (kmer != 1 or reverse_complement):
        raise GenomeError("a tokenizer takes neither kmer (it has its own k) nor reverse_complement (k-mer ids have no "
                          "token-wise complement); accepted: tokenizer alone, or kmer and reverse_complement without one")
    p = _check_fasta_file(path)
    batches = _batches(p, seq_len * kmer, rank, world_size, batch_size, seed, reverse_complement, shuffle_windows, split,
                       tokenizer)
    return batches if kmer == 1 else (kmer_tokens(b, kmer) for b in batches)


def kmer_vocab_size(k: int) -> int:
    """4**k k-mers over A, C, G, T, plus one token for any k-mer that contains an N."""
    return 4**k + 1


def kmer_tokens(tokens: torch.Tensor, k: int) -> torch.Tensor:
    """Non-overlapping k-mer ids from single-base tokens (..., L) -> (..., L // k).

    A k-mer of bases b_0..b_{k-1} (A=0, C=1, G=2, T=3) is ``sum(b_i * 4**(k-1-i))``; a k-mer
    containing N is ``4**k``. A tail shorter than k is dropped.
    """
    length = tokens.shape[-1] // k * k
    groups = tokens[..., :length].long().reshape(*tokens.shape[:-1], length // k, k)  # (..., L/k, k)
    weights = 4 ** torch.arange(k - 1, -1, -1)  # (k,)
    ids = (groups.clamp(max=3) * weights).sum(-1)
    return torch.where((groups == N_TOKEN).any(-1), torch.full_like(ids, 4**k), ids)


def _batches(
    path: Path,
    seq_len: int,
    rank: int,
    world_size: int,
    batch_size: int,
    seed: int,
    rc: bool,
    shuffle_windows: int,
    split: str = "all",
    tokenizer: KmerTokenizer | None = None,
) -> Iterator[torch.Tensor]:
    windows = _rank_windows(path, seq_len, rank, world_size, split, tokenizer)
    if rc:
        windows = (reverse_complement(w) if k % 2 else w for k, w in enumerate(windows))
    if shuffle_windows:
        # A string seed hashes the same in every process (unlike hash() of a tuple).
        windows = _shuffled(windows, shuffle_windows, random.Random(f"zerofx-genome:{seed}:{rank}"))
    batch: list[torch.Tensor] = []
    num_batches = 0
    for w in windows:
        batch.append(w)
        if len(batch) == batch_size:
            yield torch.stack(batch).long()  # (B, T)
            num_batches += 1
            batch = []
    if num_batches == 0:
        raise GenomeError(
            f"genome {str(path)!r} is too short: rank {rank} got no full batch of {batch_size} windows of "
            f"{seq_len} tokens at world size {world_size}; use a shorter seq_len, smaller batch or fewer ranks"
        )
