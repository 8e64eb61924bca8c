"""``zerofx data prepare``: read FASTA files once into a random-access folder for ``zerofx train
--data`` (``zerofx.data.prepared``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from zerofx.app.commands.common import existing
from zerofx.common.units import format_bytes


def add_parser(sub: Any) -> None:
    p = sub.add_parser("data", help="prepare genomes once for training (zerofx data prepare)",
                       description="Genome data for zerofx train.")
    data_sub = p.add_subparsers(dest="data_command", metavar="DATA_COMMAND", required=True, help="prepare")
    p = data_sub.add_parser("prepare", help="read FASTA files once into a random-access folder for zerofx train --data",
                            description="Read one or more FASTA files (plain, gzip or BGZF) in one pass and write a folder "
                                        "of memory-mapped tokens, record offsets and names, the runs of N and the source files' "
                                        "identity and checksums; zerofx train --data reads it without reading the genome again "
                                        "(docs/training.md).")
    p.add_argument("inputs", metavar="FASTA_OR_MANIFEST", type=existing("input", "a FASTA file or a manifest"), nargs="+",
                   help="FASTA files (.fa, .fasta, optionally .gz), or a manifest (*.tsv or *.txt) with one 'PATH [WEIGHT]' "
                        "per line: windows are drawn from each source in proportion to its weight, a finite number > 0 "
                        "(default 1; relative paths are relative to the manifest)")
    p.add_argument("--out", type=Path, required=True,
                   help="the folder to write: new, empty, or one this command wrote before (replaced whole once the new "
                        "one is complete)")
    p.add_argument("--verify", action="store_true", help="after writing, read the tokens back and check their SHA-256")
    p.add_argument("--quiet", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Prepare FASTA files (or a manifest's) once for random access (``zerofx.data.prepared``)."""
    import time

    from tqdm import tqdm

    from zerofx.data.prepared import Source, is_manifest, open_prepared, prepare_genome, read_manifest, verify_prepared

    sources = [s for path in args.inputs for s in (read_manifest(path) if is_manifest(path) else [Source(path)])]
    total = sum(s.path.stat().st_size for s in sources if s.path.is_file())
    t0 = time.perf_counter()
    with tqdm(total=total, unit="B", unit_scale=True, desc="prepare", file=sys.stderr, disable=args.quiet) as bar:
        out = prepare_genome(sources, args.out, progress=bar.update)
    elapsed = time.perf_counter() - t0
    genome = open_prepared(out)
    if args.verify:
        verify_prepared(out)
    for line in genome.summaries():
        print(line)
    print(f"wrote {out}: {genome.num_records:,} records, {int(genome.lengths.sum()):,} tokens, {len(genome.n_runs):,} runs of N; "
          f"read {format_bytes(total)} in {elapsed:.1f} s ({total / max(elapsed, 1e-9) / 1e6:,.1f} MB/s); train with "
          f"zerofx train --data {out}")
    return 0
