"""Shard arithmetic: padding, each rank's slice, the owner of an element.

No MPI here, so the arithmetic is tested in plain pytest. Vocabulary:

- numel: elements of real data in a flat buffer.
- padded numel: numel rounded up to a multiple of world_size * align, so that
  every rank owns a shard of the same length (what ``Reduce_scatter_block`` and
  ``Allgather`` need).
- shard: the contiguous slice ``[rank * shard_numel, (rank + 1) * shard_numel)``
  of the padded buffer owned by one rank. The padding sits at the end of the
  buffer, so the last ranks own it; when numel < world_size some ranks own only
  padding.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Partition:
    """Split a flat buffer of ``numel`` elements evenly over ``world_size`` ranks."""

    numel: int
    world_size: int
    align: int = 1

    def __post_init__(self) -> None:
        for name in ("numel", "world_size", "align"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if self.numel < 0:
            raise ValueError(f"numel must be >= 0, got {self.numel}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.align < 1:
            raise ValueError(f"align must be >= 1, got {self.align}")

    @property
    def shard_numel(self) -> int:
        """Elements each rank owns, padding included (a multiple of align)."""
        per_rank = -(-self.numel // self.world_size)
        return -(-per_rank // self.align) * self.align

    @property
    def padded_numel(self) -> int:
        """Length of the padded flat buffer: world_size equal shards."""
        return self.shard_numel * self.world_size

    @property
    def padding(self) -> int:
        """Padding elements at the end of the flat buffer."""
        return self.padded_numel - self.numel

    def shard_range(self, rank: int) -> tuple[int, int]:
        """Return ``(start, stop)`` of rank's shard in the padded buffer."""
        self._check_rank(rank)
        start = rank * self.shard_numel
        return start, start + self.shard_numel

    def data_range(self, rank: int) -> tuple[int, int]:
        """Return ``(start, stop)`` of the real (unpadded) elements rank owns."""
        start, stop = self.shard_range(rank)
        return min(start, self.numel), min(stop, self.numel)

    def shard_padding(self, rank: int) -> int:
        """Padding elements inside rank's shard."""
        start, stop = self.data_range(rank)
        return self.shard_numel - (stop - start)

    def owner(self, index: int) -> int:
        """Return the rank that owns element ``index`` of the padded buffer."""
        if not 0 <= index < self.padded_numel:
            raise IndexError(f"index {index} outside padded buffer of {self.padded_numel}")
        return index // self.shard_numel

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} outside world of size {self.world_size}")


def split_evenly(total: int, parts: int, index: int) -> range:
    """Return the contiguous block of ``range(total)`` that part ``index`` of ``parts`` takes.

    Earlier parts take one more item when ``total`` does not divide evenly.
    """
    if not 0 <= index < parts:
        raise IndexError(f"part {index} outside {parts} parts")
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return range(start, start + base + (index < extra))
