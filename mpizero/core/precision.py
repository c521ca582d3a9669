"""Mixed precision: the dtype parameters are held and gathered in, and fp16 loss scaling.

Master weights and optimizer state are always float32 shards. Models compute in
float32 on parameters rounded to the param dtype. With fp16, gradients are
stored in float16 (so they can overflow), and a dynamic loss scale keeps them
in range; a step whose gradients overflow on any rank is skipped on all.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np


@dataclass(frozen=True)
class Precision:
    """How one precision mode holds parameters and gradients, and where it runs."""

    name: str
    param_dtype: np.dtype
    grad_dtype: np.dtype
    loss_scaling: bool

    def engine_settings(self) -> dict:
        """The ``ZeroEngine`` settings this precision needs: the param dtype, and skipping overflowed steps."""
        return {"param_dtype": self.param_dtype.name, "on_nonfinite": "skip" if self.loss_scaling else "raise"}


PRECISIONS = {
    "fp32": Precision("fp32", np.dtype(np.float32), np.dtype(np.float32), False),
    "bf16": Precision("bf16", np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32), False),
    "fp16": Precision("fp16", np.dtype(np.float16), np.dtype(np.float16), True),
}


@dataclass
class LossScaler:
    """Dynamic loss scale: halve on overflow, double after ``growth_interval`` good steps."""

    scale: float = 2.0**16
    growth_interval: int = 50
    good_steps: int = 0

    def update(self, overflowed: bool) -> None:
        if overflowed:
            self.scale = max(self.scale / 2, 1.0)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= 2
            self.good_steps = 0
