"""The learning rate as a function of the optimizer step, for the schedulers the config names
(``zerofx.config.schedulers.SchedulerSpec``), with DeepSpeed's formulas and defaults:

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

from zerofx.config.schedulers import SchedulerSpec, SchedulerType, WarmupType


def _warmup_gamma(step: int, warmup: int, kind: WarmupType) -> float:
    if warmup <= 0 or step >= warmup:
        return 1.0
    if kind is WarmupType.LOG:
        return math.log(step + 1) / math.log(warmup) if warmup > 1 else 1.0
    return step / warmup


def lr_at(spec: SchedulerSpec | Mapping[str, Any], step: int, base_lr: float) -> float:
    """The learning rate at optimizer step ``step``. ``spec`` is a ``SchedulerSpec`` or a config's
    ``scheduler`` section (validated here, so a bad one raises ``ConfigError``)."""
    if not isinstance(spec, SchedulerSpec):
        spec = SchedulerSpec.from_config(spec)
    warmup = spec.warmup_num_steps
    if spec.type in (SchedulerType.WARMUP_LR, SchedulerType.WARMUP_DECAY_LR):
        lo, hi = spec.warmup_min_lr, spec.warmup_max_lr
        gamma = _warmup_gamma(step, warmup, spec.warmup_type)
        if spec.type is SchedulerType.WARMUP_DECAY_LR and step >= warmup:
            assert spec.total_num_steps is not None  # __post_init__ requires it
            total = spec.total_num_steps
            gamma = max(0.0, (total - step) / max(1.0, total - warmup))
        return lo + (hi - lo) * gamma
    assert spec.type is SchedulerType.WARMUP_COSINE_LR and spec.total_num_steps is not None
    total = spec.total_num_steps
    start, end = spec.warmup_min_ratio, spec.cos_min_ratio
    if step < warmup:
        ratio = start + (1 - start) * _warmup_gamma(step, warmup, spec.warmup_type)
    else:
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        ratio = end + (1 - end) * 0.5 * (1 + math.cos(math.pi * progress))
    return base_lr * ratio
