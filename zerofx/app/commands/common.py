"""What the subcommands share: the argument types that check a flag as it is read (before a
command imports torch), the bounds they check against, the output-file check, the model a
``MODEL_SPEC`` argument may name, the ``--profile`` loader and the import freeze. Imports no torch
(NOTE [A command line that answers at once] in zerofx/app/cli.py).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zerofx.common.errors import UsageError, ZeroFXError
from zerofx.common.paths import probe_writable
from zerofx.common.units import parse_bytes
from zerofx.models.sizes import MODEL_SIZES

SIZES = ", ".join(MODEL_SIZES)
MODEL_HELP = f"a bundled model size ({SIZES}; docs/models.md) or FILE.py:CALLABLE / MODULE:CALLABLE returning (model, example_inputs)"


# NOTE [Freezing the imports]
# Importing torch and the Dynamo stack leaves about 320,000 GC-tracked objects. gc.freeze
# (Python's documented API for this) moves them out of the cyclic collector's reach, so the full
# collections that capture's allocations trigger, and the interpreter's exit, stop rescanning
# them: 1.5-2.5 s of `zerofx plan`'s 10 s budget on the 20B model. It also keeps the forked
# 2-block capture (NOTE [Planning the two captures in parallel]) from touching, and so copying,
# their pages. The commands import torch after parsing (NOTE [A command line that answers at
# once]), so the freeze comes where a command has made its imports, not at start-up. Only as the
# program (argv from sys.argv): a caller that runs main() in its own process, as the tests do,
# keeps its collector as it was.
def freeze_imports(args: argparse.Namespace) -> None:
    """Freeze the collector's view of what a command imported, when running as the program."""
    if getattr(args, "as_program", False):
        gc.freeze()


def check_output_file(flag: str, path: Path) -> None:
    """Raise ``UsageError`` unless ``path`` can be written: not a folder, in an existing folder
    that accepts a new file. Commands call it before their slow work (capture, measuring), so a
    typo in the folder costs nothing. The probe is a real file created and removed, since
    ``os.access`` answers yes to root on a read-only mount or folder."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{flag} {str(path)!r} is a folder; accepted: a file path in an existing, writable folder")
    folder = path.parent
    if not folder.is_dir():
        raise UsageError(f"{flag} {str(path)!r}: folder {str(folder)!r} does not exist; create it or give a path in an existing folder")
    try:
        probe_writable(folder)
    except OSError as exc:
        raise UsageError(f"{flag} {str(path)!r}: cannot create a file in folder {str(folder)!r} ({exc.strerror}); "
                         "accepted: a path in a writable folder") from exc
    if path.exists() and not os.access(path, os.W_OK):
        raise UsageError(f"{flag} {str(path)!r} exists and is read-only; accepted: a writable file or a new path")


def load_profile_arg(profile: str) -> tuple[Any, Any]:
    """The ``(CommSpec, DeviceSpec)`` that ``--profile`` names: built in, or a file from ``zerofx calibrate``."""
    from zerofx.cost_models.profiles import load_profile

    try:
        return load_profile(profile)
    except ValueError as exc:
        raise UsageError(f"--profile: {exc}") from exc


# The largest world size zerofx plans for is zerofx.common.limits.MAX_WORLD_SIZE (2**20 ranks), far
# beyond the largest clusters built and far inside the int64 group size the functional
# collectives take (2**63 fails in C++); a bound that catches a typo (an extra 0) costs nothing.
# Local ranks (train, calibrate) are processes on this machine, each with torch loaded (a few
# hundred MiB) and cpu_count / world_size threads: beyond 256 they only contend. torchrun's
# world size is not bounded by this.
MAX_LOCAL_RANKS = 256


def existing(what: str, accepted: str, *, folder: bool = False) -> Callable[[str], Path]:
    """An argparse ``type=``: a path that exists as a file (or, with ``folder``, a folder),
    checked when the arguments are read, before a command imports torch (seconds, more on a
    loaded machine); argparse names the flag in the error."""

    def parse(text: str) -> Path:
        path = Path(text)
        if not path.exists():
            raise argparse.ArgumentTypeError(f"{what} {text!r} does not exist; accepted: {accepted}")
        if path.is_dir() != folder:
            raise argparse.ArgumentTypeError(f"{what} {text!r} is a {'file' if folder else 'folder'}; accepted: {accepted}")
        return path

    return parse


CONFIG_ARG = existing("config file", "a DeepSpeed-style JSON file")


def int_arg(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse ``type=``: an integer in low..high; argparse names the flag in the error."""
    accepted = f"an integer >= {low}" if high is None else f"an integer in {low}..{high}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}; accepted: {accepted}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{value} is out of range; accepted: {accepted}")
        return value

    return parse


def float_arg(low: float, high: float | None = None, *, low_inclusive: bool = True) -> Callable[[str], float]:
    """An argparse ``type=``: a finite number in range (float() alone takes 'nan', 'inf', '1e999')."""
    accepted = f"a finite number {'>=' if low_inclusive else '>'} {low:g}" + ("" if high is None else f" and <= {high:g}")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid number: {text!r}; accepted: {accepted}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text} is not a finite number; accepted: {accepted}")
        if not (value >= low if low_inclusive else value > low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{text} is out of range; accepted: {accepted}")
        return value

    return parse


def bytes_arg(text: str) -> float:
    """An argparse ``type=`` for --budget: a size such as 80GiB or "10 GiB", finite and above 0."""
    negative = text.strip().startswith("-")  # a size with a sign is out of range, not unreadable
    try:
        value = parse_bytes(text.strip()[1:] if negative else text)
    except ZeroFXError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if negative or not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is out of range; accepted: a finite size above 0, e.g. 80GiB")
    return value

