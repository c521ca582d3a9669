"""Where each element of each tensor lies in a checkpoint's rank files, derived from the partition rule.

A checkpoint records the rule, not the pieces: the world size, the shard
alignment and the groups (each a list of tensor names laid end to end, as the
engine lays them out). Rank r's file holds, group after group, the real
(unpadded) elements of its shard of that group, the shard ``Partition`` gives,
which is how the engine shards. So the manifest does not grow with the pieces,
and any rank finds any element in O(groups) without a list of every rank's pieces.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mpizero.core.layout import FlatLayout
from mpizero.core.partition import Partition


@dataclass(frozen=True)
class Run:
    """Elements ``[start, stop)`` of a tensor (flat, unpadded), at ``[at, at + stop - start)`` in ``rank``'s file."""

    rank: int
    start: int
    stop: int
    at: int


class SavedLayout:
    """The rank files' layout of a checkpoint saved by ``world_size`` ranks with these groups and alignment.

    ``shapes``: every tensor's shape by name, in the model's order (the manifest lists them so).
    """

    def __init__(
        self, shapes: Mapping[str, Sequence[int]], groups: Sequence[Sequence[str]], align: int, world_size: int
    ) -> None:
        self.world_size, self.shapes = world_size, {name: tuple(shape) for name, shape in shapes.items()}
        self.layouts = [FlatLayout.from_shapes({name: shapes[name] for name in group}) for group in groups]
        self.partitions = [Partition(layout.numel, world_size, align) for layout in self.layouts]
        self.where = {spec.name: (g, spec) for g, layout in enumerate(self.layouts) for spec in layout.specs}
        self._starts: dict[int, list[int]] = {}

    @classmethod
    def of_manifest(cls, manifest: dict) -> SavedLayout:
        """The layout a checkpoint's manifest (one that passed ``structure.check``) describes."""
        shapes = {t["name"]: t["shape"] for t in manifest["tensors"]}
        partition = manifest["partition"]
        return cls(shapes, partition["groups"], partition["align"], manifest["world_size"])

    @classmethod
    def of_engine(cls, engine) -> SavedLayout:
        """The layout ``engine``'s ranks write: its groups, alignment and world size."""
        groups = [[spec.name for spec in g.layout.specs] for g in engine.groups]
        return cls(engine.tensor_shapes(), groups, engine.config.align, engine.comm.Get_size())

    def group_starts(self, rank: int) -> list[int]:
        """Where each group's elements begin in ``rank``'s file, and (last) the file's length in elements."""
        if rank not in self._starts:
            starts = [0]
            for partition in self.partitions:
                start, stop = partition.data_range(rank)
                starts.append(starts[-1] + stop - start)
            self._starts[rank] = starts
        return self._starts[rank]

    def rank_length(self, rank: int) -> int:
        """Elements of one state in ``rank``'s file."""
        return self.group_starts(rank)[-1]

    def runs(self, name: str, start: int, stop: int) -> list[Run]:
        """Where elements ``[start, stop)`` of tensor ``name`` lie: one run per rank file that holds some."""
        g, spec = self.where[name]
        shard = self.partitions[g].shard_numel
        lo, hi = spec.offset + start, spec.offset + stop
        found = []
        for rank in range(lo // shard, (hi - 1) // shard + 1) if lo < hi else ():
            first, last = max(lo, rank * shard), min(hi, (rank + 1) * shard)
            at = self.group_starts(rank)[g] + first - rank * shard
            found.append(Run(rank, first - spec.offset, last - spec.offset, at))
        return found

    def pieces(self, rank: int) -> list[tuple[str, Run]]:
        """``rank``'s file in order: each tensor range it holds, by tensor name."""
        found = []
        for g, (layout, partition) in enumerate(zip(self.layouts, self.partitions, strict=True)):
            shard_start, shard_stop = partition.shard_range(rank)
            for _, spec, lo, hi in layout.overlaps(shard_start, shard_stop):
                at = self.group_starts(rank)[g] + lo - shard_start
                found.append((spec.name, Run(rank, lo - spec.offset, hi - spec.offset, at)))
        return found
