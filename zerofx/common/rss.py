"""Resident memory of this process, as the benchmarks, ``zerofx train`` and the tests report it.

NOTE [VmHWM, not ru_maxrss]
``getrusage(RUSAGE_SELF).ru_maxrss`` is not this process's own peak: Linux keeps it across fork
and exec, so a rank spawned by a 1 GiB parent reports at least 1 GiB whatever it does. VmHWM in
``/proc/self/status`` (the resident high-water mark) starts from the process's own first page.
"""

from __future__ import annotations

from pathlib import Path


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024  # the file gives kB
    raise RuntimeError(f"/proc/self/status has no {field} field")


def peak_rss_bytes() -> int:
    """This process's peak resident set size in bytes (VmHWM)."""
    return _status_bytes("VmHWM")


def current_rss_bytes() -> int:
    """This process's resident set size now, in bytes (VmRSS)."""
    return _status_bytes("VmRSS")


def reset_peak_rss_bytes() -> int:
    """Reset this process's high-water mark to its resident set now (Linux's ``clear_refs``
    with 5), and return that resident set in bytes; VmHWM then tells how far it rose since."""
    Path("/proc/self/clear_refs").write_text("5")
    return current_rss_bytes()
