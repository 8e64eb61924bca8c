"""Hardware profiles as files: the comm and compute specs a planner takes, saved and loaded as
JSON. ``zerofx calibrate`` writes one for the current machine; ``zerofx plan --profile``
reads it (or a built-in name)."""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import asdict
from pathlib import Path

from zerofx.cost_models.comm import PROFILES as COMM_PROFILES
from zerofx.cost_models.comm import CommSpec
from zerofx.cost_models.compute import DEVICES, DeviceSpec
from zerofx.common.errors import ConfigError

# The size of the tensor ``zerofx calibrate`` allocates to time a new tensor's page faults, and
# the ``fresh_min_bytes`` it records where ``MALLOC_MMAP_THRESHOLD_`` is unset (NOTE [New
# tensors' pages] in cost_models/compute.py).
FRESH_PROBE_BYTES = 8 * 2**20


# NOTE [A profile holds for its allocator]
# A CPU profile's page-fault cost and memory curve are glibc's under the ``MALLOC_MMAP_THRESHOLD_``
# it was calibrated with, which it records as ``fresh_min_bytes``: with the threshold at 256 KiB
# every larger tensor is a fresh mapping whose pages fault in, without it freed blocks are
# reused. A profile calibrated under one and used to plan ranks that run under the other prices
# every op's page faults wrongly; on this project's machine a profile calibrated without the
# threshold predicted the capped benchmark's ranks, which run with it, at 0.81 of their measured
# step. Loading a calibrated CPU profile into a process whose threshold differs warns once.
def allocator_mismatch(device: DeviceSpec, threshold: str | None) -> str | None:
    """Why ``device`` (a calibrated CPU profile) does not hold for a process whose
    ``MALLOC_MMAP_THRESHOLD_`` is ``threshold`` (None or "" where unset), or None where it does
    (NOTE [A profile holds for its allocator])."""
    if not device.name.startswith("calibrated-cpu") or not device.fresh_min_bytes:
        return None
    running = int(threshold) if threshold and threshold.isdigit() and int(threshold) else None
    recorded = int(device.fresh_min_bytes)
    if recorded == (running or FRESH_PROBE_BYTES):
        return None
    under = "with MALLOC_MMAP_THRESHOLD_ unset" if recorded == FRESH_PROBE_BYTES else f"with MALLOC_MMAP_THRESHOLD_={recorded}"
    runs = f"MALLOC_MMAP_THRESHOLD_={running}" if running else "MALLOC_MMAP_THRESHOLD_ unset"
    return (f"was calibrated {under}, and this process runs with {runs}: its page-fault and memory figures hold for the "
            f"allocator it was calibrated under; run zerofx calibrate under the same setting as the ranks")


_WARNED: set[tuple[str, str]] = set()


BUILTIN = {"cpu": ("cpu-gloo", "cpu-core"), "h100": ("8xH100-nvlink-ib400", "h100"), "h200": ("8xH200-nvlink-ib400", "h200")}


def save_profile(path: Path, comm: CommSpec, device: DeviceSpec) -> None:
    path.write_text(json.dumps({"comm": asdict(comm), "device": asdict(device)}, indent=1))


def load_profile(name_or_path: str) -> tuple[CommSpec, DeviceSpec]:
    """A built-in profile by name (``cpu``, ``h100``, ``h200``) or a JSON file from ``zerofx calibrate``."""
    if name_or_path in BUILTIN:
        comm, device = BUILTIN[name_or_path]
        return COMM_PROFILES[comm], DEVICES[device]
    path = Path(name_or_path)
    if not path.is_file():
        raise ConfigError(f"profile {name_or_path!r} is neither a built-in ({', '.join(BUILTIN)}) nor a file")
    data = json.loads(path.read_text())
    try:
        comm, device = CommSpec(**data["comm"]), DeviceSpec(**data["device"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"profile file {name_or_path!r} is not a zerofx profile: {exc}") from exc
    threshold = os.environ.get("MALLOC_MMAP_THRESHOLD_", "")
    if (mismatch := allocator_mismatch(device, threshold)) and (name_or_path, threshold) not in _WARNED:
        _WARNED.add((name_or_path, threshold))  # NOTE [A profile holds for its allocator]
        warnings.warn(f"profile {name_or_path!r} {mismatch}", stacklevel=2)
    return comm, device
