"""The ZeRO stage table: which training state each stage shards.

The engine asks this table; no other module tests a stage number.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sharding:
    """What one ZeRO stage keeps as a per-rank shard instead of a full replica."""

    optimizer: bool
    grads: bool
    params: bool

    @property
    def gradient_collective(self) -> str:
        """Reduce-scatter when only a shard of the averaged gradient is needed."""
        return "reduce_scatter" if self.optimizer else "allreduce"


STAGES: dict[int, Sharding] = {
    0: Sharding(optimizer=False, grads=False, params=False),
    1: Sharding(optimizer=True, grads=False, params=False),
    2: Sharding(optimizer=True, grads=True, params=False),
    3: Sharding(optimizer=True, grads=True, params=True),
}


def sharding(stage: int) -> Sharding:
    """Return the stage's row of the table, or raise naming the valid stages."""
    try:
        return STAGES[stage]
    except (KeyError, TypeError):
        raise ValueError(f"stage must be one of {sorted(STAGES)}, got {stage!r}") from None
