"""DeepSpeed's learning-rate schedulers, as functions of the optimizer step.

``lr_at(spec, step, base_lr)`` gives the learning rate for optimizer step ``step`` (0-based),
with DeepSpeed's formulas and defaults:

- WarmupLR: from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps`` (``log``:
  ``log(step + 1) / log(warmup_num_steps)``, or ``linear``), then constant.
- WarmupDecayLR: the same warm-up, then linear decay to ``warmup_min_lr`` at ``total_num_steps``.
- WarmupCosineLR: a ratio of the optimizer's lr, from ``warmup_min_ratio`` up to 1 over the
  warm-up, then a cosine down to ``cos_min_ratio`` at ``total_num_steps``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


def _warmup_gamma(step: int, warmup: int, kind: str) -> float:
    if warmup <= 0 or step >= warmup:
        return 1.0
    if kind == "log":
        return math.log(step + 1) / math.log(warmup) if warmup > 1 else 1.0
    return step / warmup


def lr_at(spec: Mapping[str, Any], step: int, base_lr: float) -> float:
    kind = spec["type"]
    p = dict(spec.get("params", {}))
    warmup = int(p.get("warmup_num_steps", 1000))
    if kind in ("WarmupLR", "WarmupDecayLR"):
        lo, hi = float(p.get("warmup_min_lr", 0.0)), float(p.get("warmup_max_lr", 0.001))
        gamma = _warmup_gamma(step, warmup, p.get("warmup_type", "log"))
        if kind == "WarmupDecayLR" and step >= warmup:
            total = int(p.get("total_num_steps", warmup + 1))
            gamma = max(0.0, (total - step) / max(1.0, total - warmup))
        return lo + (hi - lo) * gamma
    if kind == "WarmupCosineLR":
        total = int(p.get("total_num_steps", warmup + 1))
        start, end = float(p.get("warmup_min_ratio", 0.0)), float(p.get("cos_min_ratio", 0.0001))
        if step < warmup:
            ratio = start + (1 - start) * _warmup_gamma(step, warmup, p.get("warmup_type", "log"))
        else:
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            ratio = end + (1 - end) * 0.5 * (1 + math.cos(math.pi * progress))
        return base_lr * ratio
    raise ValueError(f"scheduler type {kind!r}; accepted: WarmupLR, WarmupDecayLR, WarmupCosineLR")
