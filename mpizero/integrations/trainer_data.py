"""The Trainer's training data on mpizero: every rank walks every micro-batch of the epoch, loading only its own.

transformers' ``Trainer`` counts micro-batches: it takes ``gradient_accumulation_steps`` of them per optimizer
step (fewer at the end of an epoch), sizes the run by their number and resumes by skipping them. ``SlotSampler``
keeps that count the same at every world size: it yields every micro-batch of the epoch in the order one
process would train them, as dataset indices on the rank that owns it (``StepSampler``'s deal) and as an empty
list on the others, which ``OwnedCollate`` turns into None. So the ``i``-th micro-batch the Trainer takes in a
step is, on every rank, micro-batch ``i`` of the step's global batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from mpizero.torch.data import StepSampler


class SlotSampler(StepSampler):
    """Every micro-batch of the epoch in order: this rank's as lists of dataset indices, the others' as ``[]``."""

    def __len__(self) -> int:
        """The epoch's micro-batches, over all ranks."""
        return sum(len(everyone) for _, everyone, _ in self._steps())

    def __iter__(self) -> Iterator[list[int]]:
        order = self._order()
        for _, everyone, mine in self._steps():
            for index in everyone:
                yield self._samples(order, index) if index in mine else []


class OwnedCollate:
    """``collate`` for this rank's micro-batches; None for an empty list of samples (another rank's)."""

    def __init__(self, collate: Callable) -> None:
        self.collate = collate

    def __call__(self, samples: list):
        return self.collate(samples) if samples else None


class EpochLoader(torch.utils.data.DataLoader):
    """A ``DataLoader`` whose ``set_epoch`` (which the Trainer calls) reaches its ``SlotSampler``."""

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)


@dataclass(frozen=True)
class Slot:
    """One micro-batch of a step as ``training_step`` gets it: its index in the step's global batch, the step's
    number of micro-batches, and the batch (None on the ranks that do not own it)."""

    index: int
    count: int
    batch: dict | None
