"""A model's units and groups as runs of identical ones, so sizes are predicted without listing every unit.

A model of ``L`` layers is a few units with ``L`` alike between them; ``Run``
names one unit (its tensors' element counts, in order) and how many follow
alike. ``group_runs`` gives the groups ``trainer.make_groups`` would make, as
runs too: at stage 3 one group per unit; at stages 0-2 buckets of at most
``bucket_elems`` elements filled in backward order. Every bucket starts empty,
so the buckets inside a run of alike units repeat with a period of whole units
once a bucket starts again at the same tensor of a unit: ``group_runs`` finds
that period and counts the repeats instead of making them, so its cost does not
grow with ``L``. Only the count of each group matters to the formulas, not the order.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from mpizero.core.stages import groups_by_unit


@dataclass(frozen=True)
class Run:
    """``count`` alike units or groups in a row; ``tensors``: each tensor's element count, in order."""

    tensors: tuple[int, ...]
    count: int


def group_runs(units: list[Run], stage: int, bucket_elems: int) -> list[Run]:
    """The groups ``make_groups`` makes of these units at ``stage``, each with how many times it occurs."""
    if groups_by_unit(stage):
        return [unit for unit in units if unit.count]
    return _buckets([unit for unit in reversed(units) if unit.count and unit.tensors], bucket_elems)


def _buckets(units: list[Run], limit: int) -> list[Run]:
    """Fill buckets greedily as ``make_groups`` does: a new bucket when the next tensor would pass ``limit``."""
    made: list[tuple[int, ...]] = []
    repeats: Counter = Counter()
    current: list[int] = []
    size = 0  # elements in the current bucket
    for run in units:
        whole, k = sum(run.tensors), len(run.tensors)
        u = t = 0  # the next tensor: tensor t of unit u of this run
        seen: dict[int, tuple[int, int]] = {}  # tensor index at a bucket start -> (unit, buckets made by then)
        while u < run.count:
            if not current and whole:
                if t in seen:
                    u0, i0 = seen.pop(t)
                    cycles = (run.count - 1 - u) // (u - u0)
                    repeats.update({bucket: n * cycles for bucket, n in Counter(made[i0:]).items()})
                    u += cycles * (u - u0)
                seen[t] = (u, len(made))
            if t == 0 and whole and size + whole <= limit:  # whole units fit: add them at once
                m = min((limit - size) // whole, run.count - u)
                current.extend(run.tensors * m)
                size, u = size + m * whole, u + m
                continue
            if current and size + run.tensors[t] > limit:
                made.append(tuple(current))
                current, size = [], 0
                continue
            current.append(run.tensors[t])
            size, t = size + run.tensors[t], t + 1
            if t == k:
                t, u = 0, u + 1
    if current:
        made.append(tuple(current))
    counts = Counter(made) + repeats
    return [Run(tensors, n) for tensors, n in counts.items()]
