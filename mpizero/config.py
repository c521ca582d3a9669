"""The engine's settings, validated when made."""

from __future__ import annotations

from dataclasses import dataclass

from .reduction import REDUCTIONS
from .stages import STAGES


@dataclass(frozen=True)
class ZeroConfig:
    """ZeRO stage, gradient reduction mode and shard alignment (in elements)."""

    stage: int = 2
    reduction: str = "exact"
    align: int = 1

    def __post_init__(self) -> None:
        if self.stage not in STAGES or isinstance(self.stage, bool):
            raise ValueError(f"stage must be one of {sorted(STAGES)}, got {self.stage!r}")
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {sorted(REDUCTIONS)}, got {self.reduction!r}")
        if not isinstance(self.align, int) or self.align < 1:
            raise ValueError(f"align must be an int >= 1, got {self.align!r}")
