"""Where two runs' buffers first differ in their raw bytes: the check behind every ``bitwise`` that verify prints."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mpizero.arrays import bits
from mpizero.core.held import on_host


@dataclass(frozen=True)
class Mismatch:
    """The first element where this rank's state differs from what it is compared with."""

    step: int
    rank: int
    what: str
    tensor: str
    index: tuple
    engine_value: float
    reference_value: float
    sides: tuple[str, str] = ("engine", "reference")

    def __str__(self) -> str:
        mine, theirs = self.sides
        return (
            f"MISMATCH at step {self.step} on rank {self.rank}: {self.what} {self.tensor}{list(self.index)} "
            f"{mine} {self.engine_value!r} != {theirs} {self.reference_value!r}"
        )


def first_difference(step: int, rank: int, pairs, sides: tuple[str, str] = Mismatch.sides) -> Mismatch | None:
    """The first element whose raw bytes differ, over ``(what, group, flat start, buffer, expected)`` pairs (the
    expected values cast to the buffer's dtype), or None."""
    for what, group, start, mine, expected in pairs:
        mine = on_host(mine)  # a device's bfloat16 words as bfloat16
        expected = on_host(expected).astype(mine.dtype)
        differ = np.flatnonzero(
            (bits(mine).reshape(mine.size, -1) != bits(expected).reshape(mine.size, -1)).any(axis=1)
        )
        if differ.size:
            i = int(differ[0])
            tensor, index = group.layout.locate(start + i)
            return Mismatch(step, rank, what, tensor, index, float(mine[i]), float(expected[i]), sides)
    return None
