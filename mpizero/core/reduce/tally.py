"""What one rank hands in for one group during a step: its count, largest magnitudes, kept elements, any problem.

Gradients are folded into the sum as they come and then dropped, so the few
numbers ranks must agree on at the end of the step are kept here as they pass:
the count, per tensor the largest magnitude (the encode reports it, as a float32
bit pattern) and whether any element was kept beyond the cap, whether a pass only
measured, and the first problem.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from mpizero.arrays import array_module, read_back
from mpizero.core.reduce.exact import magnitude_of_bits

GRAD_DTYPE = np.dtype(np.float32)
FIXED_FIELDS = 5  # count, problem, measured, and the optimizer digest with its negation (the engine's)


class GroupTally:
    """This rank's count of contributions, per-tensor maxima and kept flags, and first problem, for one group."""

    def __init__(self, specs, xp, spill=None) -> None:
        self.specs, self.xp = specs, xp
        self.spill = spill  # on a device: the group's spill, whose device stats hold its maxima and counts
        self.in_device_stats = False  # a contribution's maxima and counts went to the device stats
        self.count = self.seen = 0
        self.top_bits = [0] * len(specs)
        self.kept = [False] * len(specs)
        self.pending: list = []  # device scalars (top, outside) of contributions not yet copied to the host
        self.measured = False  # a contribution was only measured (``Engine.accumulate(keep=False)``)
        self.unheld = False  # a contribution's left-out elements were not held (``Keep.REDO``)
        self.problem: str | None = None

    def check(self, grads, known_names) -> bool:
        """Check one contribution's contract; return whether it may be encoded (False once any problem was seen)."""
        problem = contribution_problem(grads, self.specs, known_names, self.seen, self.xp)
        self.seen += 1
        self.problem = self.problem or (problem and f"bad gradients: {problem}")
        return self.problem is None

    def record(self, tops, outside) -> None:
        """Count one contribution: its largest magnitude's bits and how many elements were left out, per tensor."""
        self.count += 1
        if tops is None:  # folded into the device stats by the group's encode (``group_encode``)
            self.in_device_stats = True
            return
        if tops and not isinstance(tops[0], int):
            self.pending.append((tops, outside))
            return
        self.fold(tops, outside)

    def fold(self, tops, outside) -> None:
        """Fold one contribution's maxima (as bit patterns) and left-out counts, per tensor, into the tally."""
        for index, (top, left_out) in enumerate(zip(tops, outside)):
            self.top_bits[index] = max(self.top_bits[index], int(top))
            self.kept[index] |= int(left_out) > 0

    def note(self, problem: str) -> None:
        """Record a problem found outside any one contribution (e.g. gradients that are not a list)."""
        self.problem = self.problem or problem

    @property
    def maxima(self) -> np.ndarray:
        """This rank's largest magnitude per tensor (inf where a NaN or Inf was seen)."""
        settle_pending([self])
        return np.array([magnitude_of_bits(bits) for bits in self.top_bits], dtype=np.float64)

    def agreement_row(self, digest: float) -> np.ndarray:
        """``(count, problem, measured, digest, -digest, kept per tensor, maximum per tensor)``: what
        ``Collectives.agree`` sums (the count) and maxes (the rest). Kept is 1 where this rank held what was left
        out, 2 where it did not (``unheld``): the step must then run again."""
        maxima = self.maxima
        fixed = [self.count, self.problem is not None, self.measured, digest, -digest]
        kept = [(2.0 if self.unheld else 1.0) * k for k in self.kept]
        return np.array([*fixed, *kept, *maxima], dtype=np.float64)


def settle_pending(tallies) -> None:
    """Copy the device maxima and counts of every contribution the ``tallies`` hold to the host in one transfer:
    the step's first agreement takes every group's, not one copy per group. A spill past its slots leaves its
    elements unheld: the step must run again."""
    for tally in tallies:
        if tally.in_device_stats:  # the device stats are read back once, whatever the number of groups
            n = len(tally.specs)
            row = tally.spill.device.of_group(tally.spill.index)
            tally.fold(row[:n].tolist(), row[n : 2 * n].tolist())
            tally.unheld |= int(row[2 * n]) > tally.spill.slots
    waiting = [tally for tally in tallies if tally.pending]
    if not waiting:
        return
    values = iter(read_back([v for tally in waiting for tops, outside in tally.pending for v in (*tops, *outside)]))
    for tally in waiting:
        for _ in tally.pending:
            tops = [next(values) for _ in tally.specs]
            tally.fold(tops, [next(values) for _ in tally.specs])
        tally.pending = []


def contribution_problem(grads, specs, known_names, index: int, xp) -> str | None:
    """What is wrong with one contribution for these tensors, whose params live in ``xp``'s memory (None when
    nothing is): a host gradient handed to a device engine, or the reverse, is one of them."""
    if not isinstance(grads, Mapping):
        return f"contribution {index} is a {type(grads).__name__}, not a dict of gradients"
    unknown = sorted(set(grads) - set(known_names))
    if unknown:
        return f"contribution {index} has gradients for unknown parameters {unknown[:3]}"
    for spec in specs:
        g = grads.get(spec.name)
        if g is None:
            return f"contribution {index} has no gradient for {spec.name!r}"
        if not hasattr(g, "dtype") or not hasattr(g, "shape"):
            return f"contribution {index}: gradient {spec.name!r} is a {type(g).__name__}, not an array"
        if array_module(g) is not xp:
            return (
                f"contribution {index}: gradient {spec.name!r} is a {type(g).__module__}.{type(g).__name__}, but "
                f"the parameters live in {xp.__name__} arrays (move it there first)"
            )
        if tuple(g.shape) != spec.shape or g.dtype != GRAD_DTYPE:
            return (
                f"contribution {index}: gradient {spec.name!r} is {g.dtype}{list(g.shape)}, "
                f"expected {GRAD_DTYPE}{list(spec.shape)}"
            )
    return None
