"""Genomes prepared once for random access: tokens memory-mapped, N runs indexed, sources pinned.

    info = prepare_genome([Source(Path("hg38.fa.gz"))], Path("hg38.zfx"))   # one pass, ~disk speed
    genome = open_prepared(Path("hg38.zfx"))          # reads the index only, never the tokens
    genome.tokens[genome.offsets[3] : genome.offsets[3] + 128]   # a window, from the page cache

NOTE [What a prepared genome holds]
A prepared directory holds three files, written to a temporary sibling folder and renamed into
place once complete, so a crash leaves either the whole directory or none:

- ``tokens.u8``: every record's tokens, one byte each (``zerofx.common.vocab.DNA_VOCAB``: A C G T
  are 0..3, N and every other symbol 4), records back to back in the order of the sources and of
  each file. Ranks map it read-only (``numpy.memmap``), so the ranks of a node share its pages
  through the page cache and a rank's own memory does not grow with the genome.
- ``n_runs.npy``: the runs of N as ``(start, end)`` rows over the concatenated tokens, and the
  count of N before each run, so the N in any window are counted with one binary search
  (``PreparedGenome.count_n``).
- ``index.json``: the format version, the tokenizer (single bases; k-mers are cut when a window
  is drawn), each record's name, source, offset and length, and each source's identity (path,
  size, modification time, SHA-256 of its bytes as read) with its counts; the SHA-256 of
  ``tokens.u8``.

Opening checks the index, that ``tokens.u8`` has the size the index says, and that every source
file still there has the size and modification time it had when prepared; a changed source
raises ``GenomeError`` naming it (prepare again). A source no longer there is fine: the prepared
directory is self-contained, and may be copied to another machine. Nothing else is read, so a
launch reaches its first step without a pass over the genome.

NOTE [One pass at disk speed]
The parser reads each file in blocks of ``BLOCK_BYTES`` (gzip and BGZF through ``gzip``) and does
per block what Python would otherwise do per symbol: ``bytes.translate`` maps every byte to its
token and deletes line breaks, ``bytes.count`` and ``bytes.find`` count foreign symbols and find
headers, and numpy finds the N runs. Memory is a few blocks whatever the record's length, so a
300 Mbp record on one line costs what a wrapped one does. The symbols accepted, and the errors,
are those of NOTE [What a FASTA file must hold] and NOTE [Which symbols a genome may hold] in
``zerofx.data.genome``. Records
are told apart by their header lines, never by their names: two records with one name stay two
records. pyfaidx and pyfastx are not used: both index the FASTA text, whose line breaks and
letters a window read must still translate per draw, and pyfaidx reads one sequence per call
through a Python loop; the uint8 tokens here are what a window needs, read straight from the map.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import shutil
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from zerofx.common.limits import MAX_FOREIGN_FRACTION
from zerofx.common.vocab import DNA_VOCAB
from zerofx.data.genome import (
    FOREIGN_CHECK_MIN_SYMBOLS,
    N_TOKEN,
    NUCLEOTIDE_CODES,
    GenomeError,
    _check_fasta_file,
)

FORMAT_VERSION = 1
TOKENS_FILE, N_RUNS_FILE, INDEX_FILE = "tokens.u8", "n_runs.npy", "index.json"
BLOCK_BYTES = 8 << 20
_FOREIGN, _INVALID = 5, 6  # translate codes besides the tokens 0..4


def _translation_table() -> bytes:
    table = bytearray([_INVALID]) * 256
    for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ-*.":
        table[ord(c)] = table[ord(c.lower())] = _FOREIGN
    for c in NUCLEOTIDE_CODES:
        table[ord(c)] = table[ord(c.lower())] = N_TOKEN
    for c, token in (("A", 0), ("C", 1), ("G", 2), ("T", 3), ("U", 3)):
        table[ord(c)] = table[ord(c.lower())] = token
    return bytes(table)


_TABLE = _translation_table()
_LINE_BREAKS = b"\r\n"
_BAD_SYMBOL = re.compile(rb"[^A-Za-z*.\-\r\n]")
_FOREIGN_SYMBOL = re.compile(rb"[EFIJLOPQXZefijlopqxz*.\-]")


@dataclass(frozen=True)
class Source:
    """One FASTA file to prepare, and its weight when windows are drawn from several."""

    path: Path
    weight: float = 1.0


class _HashingReader:
    """A raw file that hashes every byte read through it and counts them (for progress)."""

    def __init__(self, f: IO[bytes], progress: Callable[[int], None] | None) -> None:
        self.f, self.sha, self.progress = f, hashlib.sha256(), progress

    def read(self, size: int = -1) -> bytes:
        data = self.f.read(size)
        self.sha.update(data)
        if self.progress is not None and data:
            self.progress(len(data))
        return data

    def readable(self) -> bool:
        return True


@dataclass
class _Record:
    name: str
    source: int
    offset: int
    length: int = 0


_N_BYTE = bytes([N_TOKEN])


def _n_runs(tokens: bytes) -> list[tuple[int, int]]:
    """(start, end) of each run of N in ``tokens``. A genome's N lies in few runs, some long (a
    chromosome's ends, its centromere): each start is found by ``bytes.find`` (memchr, at memory
    speed) and each end by looking ahead in windows that grow fourfold, so the work is the runs'
    number and length, not an elementwise pass over the whole block."""
    view = np.frombuffer(tokens, dtype=np.uint8)
    runs, start = [], tokens.find(_N_BYTE)
    while start >= 0:
        end, width = start + 1, 64
        while end < len(tokens):
            others = np.flatnonzero(view[end:end + width] != N_TOKEN)
            if others.size:
                end += int(others[0])
                break
            end, width = min(end + width, len(tokens)), width * 4
        runs.append((start, end))
        start = tokens.find(_N_BYTE, end)
    return runs


class _Writer:
    """Appends tokens to ``tokens.u8``; collects records and N runs (global coordinates)."""

    def __init__(self, path: Path) -> None:
        self.f = open(path, "wb")
        self.sha = hashlib.sha256()
        self.size = 0
        self.records: list[_Record] = []
        self.run_starts: list[np.ndarray] = []
        self.run_ends: list[np.ndarray] = []
        self.open_run = -1  # the start of an N run that reached the end of the last write, else -1

    def new_record(self, name: str, source: int) -> None:
        self._close_run()
        self.records.append(_Record(name, source, self.size))

    def write(self, tokens: bytes) -> int:
        """Append ``tokens``; return how many of them are N."""
        num_n = tokens.count(N_TOKEN)
        if num_n:
            spans = np.array(_n_runs(tokens), dtype=np.int64).reshape(-1, 2)  # (R, 2)
            starts, ends = spans[:, 0] + self.size, spans[:, 1] + self.size
            if self.open_run >= 0 and starts[0] == self.size:  # continues the run the last write ended in
                starts[0] = self.open_run
            else:
                self._close_run()
            self.open_run = -1
            if ends[-1] == self.size + len(tokens):  # still open: the next write may extend it
                self.open_run = int(starts[-1])
                starts, ends = starts[:-1], ends[:-1]
            self.run_starts.append(starts)
            self.run_ends.append(ends)
        else:
            self._close_run()
        self.f.write(tokens)
        self.sha.update(tokens)
        self.size += len(tokens)
        self.records[-1].length += len(tokens)
        return num_n

    def _close_run(self) -> None:
        if self.open_run >= 0:
            self.run_starts.append(np.array([self.open_run]))
            self.run_ends.append(np.array([self.size]))
            self.open_run = -1

    def close(self) -> np.ndarray:
        """Close the file; the N runs as (R, 3) int64 rows: start, end, N before the run."""
        self._close_run()
        self.f.close()
        starts = np.concatenate([np.zeros(0, np.int64), *self.run_starts]).astype(np.int64)
        ends = np.concatenate([np.zeros(0, np.int64), *self.run_ends]).astype(np.int64)
        before = np.concatenate(([0], np.cumsum(ends - starts)[:-1])).astype(np.int64) if len(starts) else starts
        return np.stack((starts, ends, before), axis=1) if len(starts) else np.zeros((0, 3), np.int64)


def _open_raw(path: Path, progress: Callable[[int], None] | None) -> tuple[IO[bytes], _HashingReader]:
    raw = _HashingReader(open(path, "rb"), progress)
    magic = path.open("rb").read(2)
    stream: Any = gzip.GzipFile(fileobj=raw, mode="rb") if magic == b"\x1f\x8b" else raw  # the content decides
    return stream, raw


def _line_starting(buf: bytes, char: bytes, pos: int) -> int:
    """``buf.find(b"\\n" + char, pos)``, by a one-byte search (memchr): ``char`` (a header's
    '>' or a comment's ';') never occurs in sequence, so each hit is almost always the one."""
    i = buf.find(char, pos + 1)
    while i > 0 and buf[i - 1] != 0x0A:
        i = buf.find(char, i + 1)
    return i - 1 if i > 0 else -1


class _Parser:
    """One source file's state across blocks (NOTE [One pass at disk speed])."""

    def __init__(self, path: Path, source: int, writer: _Writer) -> None:
        self.path, self.source, self.writer = path, source, writer
        self.line = 1  # the line the next byte is on
        self.at_line_start = True
        self.header: bytearray | None = None  # the header line being read, without its '>'
        self.in_comment = False
        self.num_records = self.num_symbols = self.num_n = self.num_foreign = 0
        self.first_foreign = ""

    def feed(self, buf: bytes) -> None:
        pos, size = 0, len(buf)
        next_comment = _line_starting(buf, b";", 0)
        while pos < size:
            if self.header is not None or self.in_comment:
                end = buf.find(b"\n", pos)
                stop = size if end < 0 else end
                if self.header is not None:
                    self.header += buf[pos:stop]
                if end < 0:
                    return
                self._end_line()
                pos, self.at_line_start = end + 1, True
                self.line += 1
                continue
            if self.at_line_start and buf[pos] in b">;":
                self.in_comment = buf[pos] == ord(";")
                self.header = None if self.in_comment else bytearray()
                pos += 1
                continue
            if 0 <= next_comment < pos:
                next_comment = _line_starting(buf, b";", pos)
            end = _line_starting(buf, b">", pos)
            if next_comment >= 0 and (end < 0 or next_comment < end):
                end = next_comment
            stop = size if end < 0 else end + 1
            self._sequence(buf[pos:stop])
            pos = stop
            self.at_line_start = buf[stop - 1] == ord("\n")

    def _end_line(self) -> None:
        if self.header is not None:
            words = bytes(self.header).decode("utf-8", errors="replace").split()
            self.writer.new_record(words[0] if words else f"record@{self.line}", self.source)
            self.num_records += 1
            self.header = None
        self.in_comment = False

    def _where(self, segment: bytes, index: int) -> str:
        record = self.writer.records[-1]
        before = segment[:index]
        line = self.line + before.count(b"\n")
        column = index - before.rfind(b"\n")
        offset = record.length + len(before.translate(None, _LINE_BREAKS))
        return f"in record {record.name!r} at offset {offset} (line {line}, column {column})"

    def _sequence(self, segment: bytes) -> None:
        tokens = segment.translate(_TABLE, _LINE_BREAKS)
        if tokens and not self.writer.records:
            raise GenomeError(f"genome file {str(self.path)!r} is not FASTA: its first line should be a '>name' header, "
                              f"got {segment[:40]!r}")
        if _INVALID in tokens and (b" " in segment or b"\t" in segment):  # rare: a line indented or with trailing blanks
            segment = b"\n".join(line.strip(b" \t") for line in segment.split(b"\n"))
            tokens = segment.translate(_TABLE, _LINE_BREAKS)
        if _INVALID in tokens:
            bad = _BAD_SYMBOL.search(segment)
            assert bad is not None
            raise GenomeError(f"{str(self.path)!r}: {chr(segment[bad.start()])!r} {self._where(segment, bad.start())} is not a "
                              "sequence symbol; accepted: IUPAC letters, '-', '.', '*'")
        foreign = tokens.count(_FOREIGN)
        if foreign:
            if not self.num_foreign:
                hit = _FOREIGN_SYMBOL.search(segment)
                assert hit is not None
                self.first_foreign = f"{chr(segment[hit.start()])!r} {self._where(segment, hit.start())}"
            self.num_foreign += foreign
            tokens = tokens.replace(bytes([_FOREIGN]), bytes([N_TOKEN]))
        if tokens:
            self.num_n += self.writer.write(tokens)
            self.num_symbols += len(tokens)
        self.line += segment.count(b"\n")
        if self.num_symbols >= FOREIGN_CHECK_MIN_SYMBOLS:
            self.check_foreign()

    def check_foreign(self) -> None:
        if self.num_symbols and self.num_foreign > MAX_FOREIGN_FRACTION * self.num_symbols:
            raise GenomeError(
                f"genome file {str(self.path)!r} is not DNA: {self.num_foreign:,} of its first {self.num_symbols:,} sequence "
                f"symbols ({self.num_foreign / self.num_symbols:.1%}) are not nucleotide codes, more than the "
                f"{MAX_FOREIGN_FRACTION:.0%} accepted; the first is {self.first_foreign}. Accepted: the IUPAC nucleotide codes "
                f"{' '.join(NUCLEOTIDE_CODES)} in either case (a protein FASTA is refused; write N for masked or unknown bases)"
            )


def _identity(path: Path) -> dict[str, Any]:
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _prepare_source(source: Source, index: int, writer: _Writer, progress: Callable[[int], None] | None) -> dict[str, Any]:
    path = _check_fasta_file(source.path)  # missing, empty, headers only, not DNA at its start: the errors a FASTA gets before preparing
    identity = _identity(path)
    parser = _Parser(path, index, writer)
    stream, raw = _open_raw(path, progress)
    try:
        while block := stream.read(BLOCK_BYTES):
            parser.feed(block)
        parser.feed(b"\n")  # a last line without a line break
    except (EOFError, zlib.error, gzip.BadGzipFile) as exc:  # truncated, corrupt deflate data, bad header or CRC
        raise GenomeError(f"genome file {str(path)!r} is corrupt (gzip) after line {parser.line}: {exc}") from exc
    finally:
        raw.f.close()
    parser.check_foreign()
    return {**identity, "sha256": raw.sha.hexdigest(), "weight": source.weight, "num_records": parser.num_records,
            "num_bases": parser.num_symbols, "num_n": parser.num_n, "num_foreign": parser.num_foreign,
            "first_foreign": parser.first_foreign}


def check_weight(weight: object, where: str) -> float:
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not (weight > 0 and np.isfinite(weight)):
        raise GenomeError(f"{where}: weight {weight!r} is invalid; accepted: a finite number > 0")
    return float(weight)


def read_manifest(path: Path) -> list[Source]:
    """The sources a manifest lists: one ``PATH [WEIGHT]`` per line (tab or spaces between; a
    relative path is relative to the manifest; '#' starts a comment; the weight defaults to 1)."""
    sources = []
    for lineno, raw in enumerate(Path(path).read_text().splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) > 2:
            raise GenomeError(f"manifest {str(path)!r} line {lineno}: {line!r} has {len(fields)} fields; accepted: PATH [WEIGHT]")
        try:
            weight = float(fields[1]) if len(fields) == 2 else 1.0
        except ValueError:
            raise GenomeError(f"manifest {str(path)!r} line {lineno}: weight {fields[1]!r} is not a number; "
                              "accepted: a finite number > 0") from None
        check_weight(weight, f"manifest {str(path)!r} line {lineno}")
        sources.append(Source(Path(path).parent / fields[0], weight))
    if not sources:
        raise GenomeError(f"manifest {str(path)!r} lists no FASTA file; accepted: one 'PATH [WEIGHT]' per line")
    return sources


def is_manifest(path: Path) -> bool:
    """A manifest is named ``*.tsv`` or ``*.txt``; anything else is read as FASTA."""
    return Path(path).suffix.lower() in (".tsv", ".txt")


def prepare_genome(sources: Sequence[Source], out: Path, *, progress: Callable[[int], None] | None = None,
                   keep_existing: bool = False) -> Path:
    """Read ``sources`` once and write the prepared directory ``out`` (NOTE [What a prepared
    genome holds]); return ``out``. ``progress`` is called with each count of bytes read from the
    files. An existing prepared ``out`` is replaced (kept, with ``keep_existing``: another process
    prepared the same entry meanwhile); any other existing non-empty ``out`` is refused."""
    if not sources:
        raise GenomeError("no FASTA file to prepare; accepted: one or more FASTA files or a manifest")
    for source in sources:
        check_weight(source.weight, f"source {str(source.path)!r}")
    out = Path(out)
    if out.exists() and not (out / INDEX_FILE).is_file() and (not out.is_dir() or any(out.iterdir())):
        raise GenomeError(f"{str(out)!r} exists and is not a prepared genome; accepted: a new or empty folder, "
                          "or a folder zerofx data prepare wrote")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        writer = _Writer(tmp / TOKENS_FILE)
        try:
            infos = [_prepare_source(source, i, writer, progress) for i, source in enumerate(sources)]
        finally:
            runs = writer.close()
        np.save(tmp / N_RUNS_FILE, runs)
        index = {
            "format": FORMAT_VERSION,
            "tokenizer": {"vocab": list(DNA_VOCAB), "note": "one byte per base; k-mers are cut when a window is drawn"},
            "tokens_bytes": writer.size,
            "tokens_sha256": writer.sha.hexdigest(),
            "sources": infos,
            "records": {"name": [r.name for r in writer.records], "source": [r.source for r in writer.records],
                        "offset": [r.offset for r in writer.records], "length": [r.length for r in writer.records]},
        }
        (tmp / INDEX_FILE).write_text(json.dumps(index))
        if out.exists() and keep_existing:
            shutil.rmtree(tmp, ignore_errors=True)
            return out
        if out.exists():  # NOTE [What a prepared genome holds]: replaced whole, never half-written
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
            shutil.rmtree(old, ignore_errors=True)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


@dataclass(frozen=True)
class PreparedGenome:
    """An opened prepared directory: the token map and the index, nothing read from the tokens."""

    path: Path
    tokens: np.ndarray  # (total,) uint8, memory-mapped read-only
    names: tuple[str, ...]
    sources_of: np.ndarray  # (R,) int64: each record's source
    offsets: np.ndarray  # (R,) int64
    lengths: np.ndarray  # (R,) int64
    n_runs: np.ndarray  # (K, 3) int64: start, end, N before the run
    sources: tuple[dict[str, Any], ...]

    @property
    def num_records(self) -> int:
        return len(self.names)

    def count_n(self, start: np.ndarray | int, end: np.ndarray | int) -> np.ndarray:
        """How many N lie in ``[start, end)`` of the concatenated tokens (vectorized)."""
        return self._n_before(np.asarray(end)) - self._n_before(np.asarray(start))

    def _n_before(self, x: np.ndarray) -> np.ndarray:
        if not len(self.n_runs):
            return np.zeros_like(x)
        i = np.searchsorted(self.n_runs[:, 0], x, side="right") - 1  # the last run starting at or before x
        run = self.n_runs[np.maximum(i, 0)]
        inside = np.clip(x - run[..., 0], 0, run[..., 1] - run[..., 0])
        return np.where(i >= 0, run[..., 2] + inside, 0)

    def summaries(self) -> list[str]:
        """One line per source, as ``GenomeStats.summary`` words it."""
        lines = []
        for s in self.sources:
            records = f"{s['num_records']:,} record{'' if s['num_records'] == 1 else 's'}"
            share = s["num_n"] / s["num_bases"] if s["num_bases"] else 0.0
            line = f"genome {Path(s['path']).name}: {s['num_bases']:,} bases in {records}, {s['num_n']:,} N or other ambiguity codes ({share:.2%})"
            if s["num_foreign"]:
                line += f"; {s['num_foreign']:,} of them not nucleotide codes, the first {s['first_foreign']}"
            lines.append(line)
        return lines


def is_prepared(path: Path) -> bool:
    return (Path(path) / INDEX_FILE).is_file()


def stale_sources(path: Path) -> list[str]:
    """The sources of prepared ``path`` that changed since (size or modification time), as phrases."""
    index = json.loads((Path(path) / INDEX_FILE).read_text())
    changed = []
    for s in index["sources"]:
        p = Path(s["path"])
        if not p.is_file():
            continue  # NOTE [What a prepared genome holds]: a prepared directory stands alone
        now = _identity(p)
        if (now["size"], now["mtime_ns"]) != (s["size"], s["mtime_ns"]):
            changed.append(f"{s['path']} (was {s['size']:,} bytes, now {now['size']:,}; modified since it was prepared)")
    return changed


def open_prepared(path: Path) -> PreparedGenome:
    """Open a prepared directory (NOTE [What a prepared genome holds]); ``GenomeError`` when it is
    not one, is incomplete, or no longer matches a source file still on disk."""
    path = Path(path)
    if not is_prepared(path):
        raise GenomeError(f"{str(path)!r} is not a prepared genome (no {INDEX_FILE}); write one with "
                          "zerofx data prepare GENOME.fa --out DIR")
    index = json.loads((path / INDEX_FILE).read_text())
    if index.get("format") != FORMAT_VERSION:
        raise GenomeError(f"{str(path)!r} has prepared format {index.get('format')!r}; this zerofx reads {FORMAT_VERSION}: "
                          "prepare it again")
    changed = stale_sources(path)
    if changed:
        raise GenomeError(f"prepared genome {str(path)!r} no longer matches its FASTA: {'; '.join(changed)}; "
                          f"run zerofx data prepare again")
    size = (path / TOKENS_FILE).stat().st_size if (path / TOKENS_FILE).is_file() else -1
    if size != index["tokens_bytes"]:
        raise GenomeError(f"prepared genome {str(path)!r} is incomplete: {TOKENS_FILE} holds {size:,} bytes, its index "
                          f"says {index['tokens_bytes']:,}; prepare it again")
    records = index["records"]
    tokens = (np.memmap(path / TOKENS_FILE, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8))
    return PreparedGenome(
        path=path, tokens=tokens, names=tuple(records["name"]),
        sources_of=np.asarray(records["source"], dtype=np.int64), offsets=np.asarray(records["offset"], dtype=np.int64),
        lengths=np.asarray(records["length"], dtype=np.int64), n_runs=np.load(path / N_RUNS_FILE),
        sources=tuple(index["sources"]),
    )


def verify_prepared(path: Path) -> None:
    """Read ``tokens.u8`` whole and compare its SHA-256 with the index's (``GenomeError`` if not)."""
    index = json.loads((Path(path) / INDEX_FILE).read_text())
    sha = hashlib.sha256()
    with open(Path(path) / TOKENS_FILE, "rb") as f:
        while block := f.read(BLOCK_BYTES):
            sha.update(block)
    if sha.hexdigest() != index["tokens_sha256"]:
        raise GenomeError(f"prepared genome {str(path)!r}: {TOKENS_FILE} does not match its checksum; prepare it again")


DATA_CACHE_ENV = "ZEROFX_DATA_CACHE"


def data_cache_dir() -> Path:
    """Where a FASTA given to ``zerofx train`` is prepared on first use: ``$ZEROFX_DATA_CACHE``,
    else ``$XDG_CACHE_HOME/zerofx/genomes`` (``~/.cache/zerofx/genomes``)."""
    if os.environ.get(DATA_CACHE_ENV):
        return Path(os.environ[DATA_CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "zerofx" / "genomes"


def cached_prepare(fasta: Path, *, progress: Callable[[int], None] | None = None) -> tuple[Path, bool]:
    """The prepared form of ``fasta`` in ``data_cache_dir()``, written on first use; and whether
    it was written now. The entry is named by the file's path, size and modification time, so a
    changed file gets a new entry and is never read from a stale one."""
    fasta = _check_fasta_file(fasta)
    identity = _identity(fasta)
    key = hashlib.sha256(json.dumps([FORMAT_VERSION, identity]).encode()).hexdigest()[:24]
    out = data_cache_dir() / f"{fasta.name}-{key}"
    if is_prepared(out):
        return out, False
    try:
        prepare_genome([Source(fasta)], out, progress=progress, keep_existing=True)
    except OSError as exc:
        raise GenomeError(f"cannot prepare {str(fasta)!r} into the data cache {str(out)!r}: {exc}; set {DATA_CACHE_ENV} "
                          "to a writable folder, or run zerofx data prepare and pass --data") from None
    return out, True
