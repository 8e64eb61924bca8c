"""Sizes in bytes, read and written the one way every zerofx table and message uses.

A leaf: no torch, so the command line parses ``--budget 80GiB`` before anything heavy loads.
Output is always in binary units (KiB = 1024 B), whatever unit the input used.
"""

from __future__ import annotations

import math
import re

from zerofx.common.errors import ConfigError

_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_READ_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "PB": 1e15,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "PIB": 2**50}


def format_bytes(n: float) -> str:
    """Bytes with the largest binary unit that keeps the number under 1024, to three significant
    digits, trailing zeros dropped: ``512 B``, ``1.25 KiB``, ``386 KiB``, ``4 GiB``, ``1010 KiB``
    (1000 to 1023 keep four digits rather than show ``0.98 MiB``), never an exponent."""
    if n < 0:
        return "-" + format_bytes(-n)
    if n < 1024:
        return f"{n:.0f} B"
    value, unit = float(n), 0
    while unit < len(_BINARY_UNITS) - 1:
        value /= 1024
        unit += 1
        text = _three_digits(value)
        if float(text) < 1024:
            return f"{text} {_BINARY_UNITS[unit]}"
    return f"{_three_digits(value)} {_BINARY_UNITS[-1]}"


def format_seconds(s: float) -> str:
    """A duration in the unit that keeps it readable, to three significant digits and never an
    exponent: ``0.42 ms``, ``34.2 ms``, ``1.5 s``, ``34.2 s``, ``12.5 min``."""
    if s < 0:
        return "-" + format_seconds(-s)
    if s < 1:
        ms = s * 1e3
        return f"{_three_digits(ms)} ms" if ms >= 1 else f"{ms:.2g} ms"
    if s < 600:
        return f"{_three_digits(s)} s"
    return f"{_three_digits(s / 60)} min"


def binary_unit(n: float) -> tuple[str, int]:
    """The binary unit ``format_bytes`` writes ``n`` bytes in, and its size in bytes: for an axis
    or a column whose values share one unit."""
    name = format_bytes(abs(n)).rsplit(" ", 1)[1]
    return name, 1024 ** _BINARY_UNITS.index(name)


def _three_digits(value: float) -> str:
    """``value`` (>= 1) to three significant digits, without an exponent or trailing zeros."""
    decimals = 0 if value >= 99.95 else 1 if value >= 9.995 else 2
    text = f"{value:.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def parse_bytes(text: str | float) -> float:
    """'80GiB', '1.5 TB', '123' or a number -> bytes; reads back whatever ``format_bytes`` writes."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        try:
            finite = math.isfinite(text)
        except OverflowError:  # an int too large for a float
            finite = False
        if not finite:
            raise ConfigError(f"cannot read {text!r} as a size: it is not finite; accepted: a finite number of bytes")
        return float(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _READ_UNITS:
        raise ConfigError(f"cannot read {text!r} as a size; accepted: a number with an optional unit among B, KB, MB, GB, TB, PB, KiB, MiB, GiB, TiB, PiB")
    size = float(m.group(1)) * _READ_UNITS[m.group(2).upper()]
    if not math.isfinite(size):
        raise ConfigError(f"cannot read {text!r} as a size: it is not finite; accepted: a finite number of bytes")
    return size
