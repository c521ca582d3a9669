"""Named parameter tensors laid end to end in one flat buffer.

A layout depends only on the tensors' names and shapes, never on the world
size, so the same element has the same flat index at every rank count.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from math import prod


@dataclass(frozen=True)
class TensorSpec:
    """One tensor's name, shape and place in the flat buffer."""

    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def stop(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class FlatLayout:
    """Tensors in order, each a contiguous run of a flat buffer."""

    specs: tuple[TensorSpec, ...]

    @classmethod
    def from_shapes(cls, shapes: Mapping[str, tuple[int, ...]]) -> FlatLayout:
        """Lay the tensors out in the mapping's order."""
        specs, offset = [], 0
        for name, shape in shapes.items():
            spec = TensorSpec(name, tuple(int(d) for d in shape), offset)
            specs.append(spec)
            offset = spec.stop
        return cls(tuple(specs))

    @property
    def numel(self) -> int:
        return self.specs[-1].stop if self.specs else 0

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.specs)

    def views(self, flat) -> dict:
        """Return ``{name: view}`` onto ``flat`` (NumPy or CuPy), shaped like each tensor."""
        return {s.name: flat[s.offset : s.stop].reshape(s.shape) for s in self.specs}

    def overlaps(self, start: int, stop: int) -> list[tuple[int, TensorSpec, int, int]]:
        """Return ``(index, spec, lo, hi)`` for each tensor that ``[start, stop)`` cuts, ``[lo, hi)`` flat."""
        found = []
        for index, spec in enumerate(self.specs):
            lo, hi = max(start, spec.offset), min(stop, spec.stop)
            if lo < hi:
                found.append((index, spec, lo, hi))
        return found

    def locate(self, index: int) -> tuple[str, tuple[int, ...]]:
        """Return the tensor name and multi-index of flat element ``index``, or padding."""
        for spec in self.specs:
            if spec.offset <= index < spec.stop:
                return spec.name, _unravel(index - spec.offset, spec.shape)
        return "<padding>", (index - self.numel,)


def _unravel(index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    coords = []
    for dim in reversed(shape):
        index, coord = divmod(index, dim)
        coords.append(coord)
    return tuple(reversed(coords))
