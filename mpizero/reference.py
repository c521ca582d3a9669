"""The single-rank reference: plain data-parallel training, no MPI, no sharding.

It receives every contribution of every simulated rank, averages them the way
the chosen reduction defines the average, and applies the optimizer to the full
vector of each tensor. Every distributed result is compared with it bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from . import exact


class Reference:
    """Full float32 parameters and optimizer state, updated one tensor at a time."""

    def __init__(self, params: Mapping, optimizer, reduction: str = "exact", groups=None) -> None:
        self.params = {name: np.array(a, dtype=np.float32) for name, a in params.items()}
        self.optimizer = optimizer
        self.reduction = reduction
        self.groups = [list(params)] if groups is None else [list(g) for g in groups]
        self.state = {n: {s: np.zeros_like(p) for s in optimizer.state_names} for n, p in self.params.items()}
        self.step_count = 0

    def step(self, contributions: Sequence[Mapping]) -> None:
        """Average all ranks' contributions and update every tensor."""
        self.step_count += 1
        for names in self.groups:
            grads = self.average(contributions, names)
            for name in names:
                self.optimizer.update(self.params[name], grads[name], self.state[name], self.step_count)

    def average(self, contributions: Sequence[Mapping], names) -> dict[str, np.ndarray]:
        """Return the mean gradient of one group's tensors over all contributions."""
        count = len(contributions)
        if self.reduction == "native":
            return {n: _fold(c[n] for c in contributions) / np.float32(count) for n in names}
        largest = max(exact.max_abs(c[n]) for c in contributions for n in names)
        scale = exact.exponent_for(largest, count)
        result = {}
        for name in names:
            total = np.empty(contributions[0][name].size, dtype=np.int64)
            exact.sum_into(total, [c[name].reshape(-1) for c in contributions], scale)
            result[name] = np.empty(contributions[0][name].shape, dtype=np.float32)
            exact.decode(total, scale, count, result[name])
        return result


def _fold(arrays) -> np.ndarray:
    """Sum float32 arrays left to right: ((a0 + a1) + a2) + ..."""
    arrays = iter(arrays)
    total = np.array(next(arrays), dtype=np.float32)
    for a in arrays:
        total += a
    return total
