"""A group's states in memory: the master and optimizer state shards and the grad shard as arrays of the group's."""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np

from mpizero.core.states.group_file import GRAD, SUMS
from mpizero.core.states.in_file import InFile


class InMemory:
    """The states of one group over its owned range, held as arrays (on the host or a device)."""

    keeps_sums = True  # owner sums may stay mapped between steps
    reads_in = False  # the update finds the states here
    disk_bytes = 0

    def __init__(self, states: dict, grad_shard) -> None:
        self._states, self.grad_shard = states, grad_shard

    def states(self, shared: dict):
        """The master (``shared`` holds it where it is the params themselves) and optimizer state shards by name."""
        return {**shared, **self._states}

    def add(self, arrays: dict) -> None:
        """Hold more states (the optimizer's, made zero at set-up)."""
        self._states.update(arrays)

    def decode_target(self):
        """Where the step's averaged gradient is decoded: the grad shard itself."""
        return self.grad_shard

    def decoded(self, shard) -> None:
        """The grad shard holds the step's averaged gradient: nothing to move."""

    def park_sums(self, sums):
        """Between rounds the streamed sum stays where it is: return it."""
        return sums

    def unpark_sums(self):
        """Nothing was parked."""
        return None

    def prefetch(self, failures: list) -> None:
        """Nothing to read ahead."""

    def read_in(self, failures: list):
        """The states are in memory already: nothing to read in or write back around the update."""
        return nullcontext()

    def problem(self) -> None:
        """Memory is not cut from under the run."""

    def agree_intact(self, collectives) -> None:
        """Nothing to agree on: memory is not cut from under the run."""

    def in_memory(self) -> dict:
        """Every state array held now by name, the grad shard as ``GRAD``."""
        return {**self._states, GRAD: self.grad_shard}

    def forget_step(self) -> None:
        """Nothing of a step is kept here."""

    def to_file(self, directory: str, index: int, wire_dtype) -> InFile:
        """Move the states and the grad shard to a file of their own in ``directory`` (host groups only), freeing
        them here; the file has room for the streamed sums in ``wire_dtype`` too."""
        numel = self.grad_shard.size
        dtypes = {**dict.fromkeys([*self._states, GRAD], np.float32), SUMS: wire_dtype}
        place = InFile(directory, index, dtypes, numel)
        place.write_initial(self._states)
        self._states, self.grad_shard = {}, None
        return place
