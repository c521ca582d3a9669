"""A group's states in a file of the rank's own (the disk tier): read in whole for the update, mapped otherwise."""

from __future__ import annotations

import contextlib

import numpy as np

from mpizero.comm import agree
from mpizero.core.states.group_file import GRAD, STATE_DTYPE, SUMS, GroupFile, MappedStates


class InFile:
    """The states of one group over its owned range in one ``GroupFile``; the grad shard too, from its decode to
    the update, and the streamed sum between rounds of micro-batches."""

    keeps_sums = False  # offloaded runs keep no int64 sums between steps either
    reads_in = True  # the update reads the states in, one group at a time (``in_turn``)

    def __init__(self, directory: str, index: int, dtypes: dict, numel: int) -> None:
        self.file = GroupFile(directory, index, dtypes, numel)
        self._resident: dict | None = None  # the states read in for an update (``read_in``)
        self._sums_parked = False

    @property
    def disk_bytes(self) -> int:
        return self.file.nbytes

    def write_initial(self, states: dict) -> None:
        """Write the states made at set-up (the file starts as zeros: only nonzero ones; -0.0 is not zero here)."""
        self.file.write({name: a for name, a in states.items() if a.view(np.uint32).any()})

    def states(self, shared: dict):
        """The master and optimizer state shards by name: as read in for the update, else mapped as each is used."""
        if self._resident is None:
            return MappedStates(self.file, shared)
        return {**shared, **{name: a for name, a in self._resident.items() if name != GRAD}}

    @property
    def grad_shard(self):
        """The averaged gradient: as read in for the update, else mapped (read by one rank alone: the norm, torch's
        .grad), zeros with the failure remembered where that fails."""
        if self._resident is not None:
            return self._resident[GRAD]
        return self.file.mapped_or_remember(GRAD)

    def decode_target(self):
        """A new array for the step's averaged gradient, written to the file once decoded (``decoded``)."""
        return np.empty(self.file.numel, dtype=np.float32)

    def decoded(self, shard) -> None:
        self.file.write_or_remember({GRAD: shard})

    def park_sums(self, sums):
        """Write the streamed sum to the file until the group's next round or its finish; return None (freed)."""
        if sums is not None and not self._sums_parked:
            self.file.write_or_remember({SUMS: sums})
            self._sums_parked = True
            return None
        return sums

    def unpark_sums(self):
        """The streamed sum read back if it was parked, else None."""
        if not self._sums_parked:
            return None
        self._sums_parked = False
        return self.file.read_or_remember(SUMS)

    def prefetch(self, failures: list) -> None:
        """Ask the kernel to read the file ahead for the next ``read_in`` (a failure added to ``failures``)."""
        _attempt(self.file.prefetch, failures)

    @contextlib.contextmanager
    def read_in(self, failures: list):
        """The states read in whole around the update and written back after (the grad shard is not): a read that
        fails gives zeros and a write is skipped for it, the error added to ``failures``, so that every rank still
        takes part in every group's collectives and agrees on the failure afterwards."""
        arrays = _attempt(self.file.read, failures)
        names = [n for n in self.file.names if n != SUMS]
        self._resident = arrays or {n: np.zeros(self.file.numel, STATE_DTYPE) for n in names}
        try:
            yield
        finally:  # whatever ends the caller's loop, the states are mapped from the file again from now on
            self._resident = None
        if arrays is not None:  # never zeros over the states a failed read left on disk
            _attempt(lambda: self.file.write({n: a for n, a in arrays.items() if n != GRAD}), failures)

    def problem(self) -> str | None:
        """Why states read from the file may be wrong (it was deleted or cut since it was made), or None."""
        try:
            self.file.check()
        except OSError as error:
            return str(error)
        return None

    def agree_intact(self, collectives) -> None:
        """Raise the same error on every rank if any rank's file was deleted or cut (collective): what was just read
        from it (mapped pages past a cut read zeros) must not be kept."""
        agree.raise_if_any(collectives, self.problem(), "the offloaded states")

    def in_memory(self) -> dict:
        """The states read in for the update, if any, by name."""
        return self._resident or {}

    def forget_step(self) -> None:
        self._sums_parked = False


def _attempt(action, failures: list[OSError]):
    """``action()``, or None with its OSError added to ``failures``."""
    try:
        return action()
    except OSError as error:
        failures.append(error)
        return None
