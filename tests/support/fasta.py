"""Writing FASTA files for the tests, plain or gzip-compressed."""

from __future__ import annotations

import gzip
from pathlib import Path


def write_fasta(path: Path, text: str, *, gz: bool = False) -> Path:
    """Write ``text`` to ``path`` (gzip-compressed with ``gz``) and return ``path``."""
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path
