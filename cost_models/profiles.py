"""Hardware profiles as files: the comm and compute specs a planner takes, saved and loaded as
JSON. ``zerofx calibrate`` writes one for the current machine; ``zerofx plan --profile``
reads it (or a built-in name)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from zerofx.cost_models.comm import PROFILES as COMM_PROFILES
from zerofx.cost_models.comm import CommSpec
from zerofx.cost_models.compute import DEVICES, DeviceSpec
from zerofx.common.errors import ConfigError

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
        return CommSpec(**data["comm"]), DeviceSpec(**data["device"])
    except (KeyError, TypeError) as exc:
        raise ConfigError(f"profile file {name_or_path!r} is not a zerofx profile: {exc}") from exc
