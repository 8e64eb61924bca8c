"""fp16 loss scaling: the scale the engine seeds the backward with, and its update after each step.

The engine multiplies d(loss)/d(loss) by ``scale``, divides the gradients by it before the
optimizer step, and skips a step whose gradients overflowed on any rank; ``update`` then moves the
scale by DeepSpeed's rules. The settings are ``LossScaleOptions``, parsed from the ``fp16`` section
in ``zerofx.config``. Checkpoints save and restore the scaler's plain attributes by name
(``zerofx.runtime.checkpoint``), so they are part of the on-disk format.
"""

from __future__ import annotations

from zerofx.config.options import LossScaleOptions


class LossScaler:
    """fp16 loss scaling, DeepSpeed's rules: a static scale, or a dynamic one that starts at
    ``2**initial_scale_power``, halves after ``hysteresis`` overflowing steps (never below
    ``min_loss_scale``) and doubles after ``loss_scale_window`` steps without overflow."""

    def __init__(self, scale: float, dynamic: bool, window: int, hysteresis: int, min_scale: float) -> None:
        self.scale, self.dynamic, self.window = scale, dynamic, window
        self.hysteresis, self.min_scale = hysteresis, min_scale
        self._good_steps, self._bad_left = 0, hysteresis

    @classmethod
    def from_options(cls, options: LossScaleOptions) -> LossScaler:
        static = options.loss_scale
        return cls(
            scale=static or 2.0**options.initial_scale_power,
            dynamic=static == 0,
            window=options.loss_scale_window,
            hysteresis=options.hysteresis,
            min_scale=options.min_loss_scale,
        )

    def update(self, *, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            self._good_steps = 0
            self._bad_left -= 1
            if self._bad_left <= 0:
                self.scale = max(self.scale / 2, self.min_scale)
                self._bad_left = self.hysteresis
            return
        self._good_steps += 1
        if self._good_steps % self.window == 0:
            self.scale *= 2
