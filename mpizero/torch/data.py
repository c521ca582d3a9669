"""Data the torch way: a ``DataLoader`` batch sampler that gives each rank its micro-batches of every step, with
the indices ``zero.micro_batch(index)`` needs.

Every step's global batch is ``micro_batches`` micro-batches of ``micro_batch_size`` samples, drawn in order
from one permutation of the dataset per epoch (seeded by ``seed`` and the epoch, the same on every rank; no
shuffle: the dataset's order). Micro-batch ``m`` of step ``s`` is the same samples at any world size; the ranks
share each step's micro-batches as ``split_evenly`` shares them, so each knows their global indices. Without
``drop_last`` the last step holds what is left, its last micro-batch perhaps short, and some ranks perhaps
none: run the passes inside ``zero.join()``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from mpi4py import MPI

from mpizero.core.partition import split_evenly


class StepSampler(torch.utils.data.Sampler):
    """Yields this rank's micro-batches (lists of dataset indices), step after step; ``steps(loader)`` pairs the
    loader's batches with their indices in each step's global batch.

    ``DataLoader(dataset, batch_sampler=StepSampler(len(dataset), 4, 8))`` replaces ``DistributedSampler``.
    """

    def __init__(
        self,
        dataset_size: int,
        micro_batch_size: int,
        micro_batches: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        for name, value in (("dataset_size", dataset_size), ("micro_batch_size", micro_batch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"micro_batches (per step, over all ranks) must be an int >= 1, got {micro_batches!r}")
        if (rank is None) != (world_size is None):
            raise ValueError("give rank and world_size together, or neither (then MPI's COMM_WORLD's)")
        if rank is None:
            rank, world_size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank!r} is not one of world_size {world_size!r}'s ranks")
        self.dataset_size, self.micro_batch_size, self.micro_batches = dataset_size, micro_batch_size, micro_batches
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.rank, self.world_size, self.epoch = rank, world_size, 0

    def set_epoch(self, epoch: int) -> None:
        """Draw the next passes from epoch ``epoch``'s permutation (as ``DistributedSampler.set_epoch``)."""
        self.epoch = epoch

    def __len__(self) -> int:
        """This rank's micro-batches in one epoch."""
        return sum(len(mine) for _, _, mine in self._steps())

    def __iter__(self) -> Iterator[list[int]]:
        order = self._order()
        for _, _, mine in self._steps():
            for index in mine:
                yield self._samples(order, index)

    def steps(self, loader: Iterable) -> Iterator[list[tuple[int, object]]]:
        """Each step's ``[(index in the global batch, batch), ...]`` for this rank, from ``loader``'s batches (a
        ``DataLoader`` on this sampler: its batches come in the sampler's order)."""
        batches = iter(loader)
        for _, everyone, mine in self._steps():
            yield [(index - everyone.start, next(batches)) for index in mine]

    def _samples(self, order: list[int], index: int) -> list[int]:
        """The dataset indices of micro-batch ``index`` of the epoch (numbered over the epoch)."""
        return order[index * self.micro_batch_size : (index + 1) * self.micro_batch_size]

    def _steps(self) -> Iterator[tuple[int, range, range]]:
        """Each step, its micro-batches and this rank's of them, numbered over the epoch."""
        per_step = self.micro_batch_size * self.micro_batches
        samples = self.dataset_size - (self.dataset_size % per_step if self.drop_last else 0)
        in_epoch = -(-samples // self.micro_batch_size)  # the last one may be short
        for step in range(-(-in_epoch // self.micro_batches)):
            first = step * self.micro_batches
            count = min(self.micro_batches, in_epoch - first)
            share = split_evenly(count, self.world_size, self.rank)
            yield step, range(first, first + count), range(first + share.start, first + share.stop)

    def _order(self) -> list[int]:
        """The epoch's order of the dataset: a permutation seeded by ``seed`` and the epoch, or the dataset's."""
        if not self.shuffle:
            return list(range(self.dataset_size))
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.dataset_size, generator=generator).tolist()
