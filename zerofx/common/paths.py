"""Checks on the paths a command writes, made before its slow work. A leaf: no torch."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def probe_writable(folder: Path) -> None:
    """Create and remove a file in ``folder``; ``OSError`` when that fails. A real file, since
    ``os.access`` answers yes to root on a read-only mount or folder."""
    fd, probe = tempfile.mkstemp(dir=folder, prefix=".zerofx-write-check-")
    os.close(fd)
    os.unlink(probe)
