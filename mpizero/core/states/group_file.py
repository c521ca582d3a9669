"""One group's offloaded states in one file: read and written whole, mapped state by state, checked before use.

Besides the update's float32 states the file holds the grad shard (``GRAD``) and
room for the group's streamed sums (``SUMS``, in the reduction's wire dtype),
which wait there between rounds of micro-batches.
"""

from __future__ import annotations

import mmap
import os
import time
import weakref
from collections.abc import Iterator, Mapping

import numpy as np

from mpizero.core.states import cut_mappings

GRAD = "grad"  # the averaged grad shard: written once decoded, read in for the update, never written back
SUMS = "sums"  # the streamed sum between rounds of a step: never read in for the update
STATE_DTYPE = np.dtype(np.float32)


class GroupFile:
    """One group's offloaded states on this rank, ``numel`` elements each, by name and dtype, in one file."""

    def __init__(self, directory: str, index: int, dtypes: dict, numel: int) -> None:
        """Make the file, all zeros (as the optimizer's states start), its blocks allocated now: a disk without
        room for the states fails here, at set-up, not in the middle of a step."""
        self.path = os.path.join(directory, f"group{index:05d}.state")
        self.dtypes = {name: np.dtype(dtype) for name, dtype in dtypes.items()}
        self.names, self.numel = tuple(self.dtypes), numel
        offsets = np.cumsum([0] + [numel * dtype.itemsize for dtype in self.dtypes.values()]).tolist()
        self._offsets, self.nbytes = dict(zip(self.names, offsets)), offsets[-1]
        self.read_bytes = self.written_bytes = 0  # by ``read`` and ``write``, and the seconds they took
        self.io_seconds = 0.0
        self.failure: OSError | None = None  # a write that failed outside the update, raised by the next read
        self._watch = cut_mappings.Watch()
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        weakref.finalize(self, os.close, self._fd)
        if self.nbytes:
            os.posix_fallocate(self._fd, 0, self.nbytes)

    def check(self) -> None:
        """Raise if the file was deleted or cut short since it was made (or while mapped: then the accesses past
        the cut read zeros): the open file would still hold the bytes, but whoever did it meant to remove or
        change them."""
        if self.failure is not None:
            raise self.failure
        status = os.fstat(self._fd)
        if status.st_nlink == 0:
            raise OSError(f"{self.path} was deleted while the run uses it")
        if status.st_size < self.nbytes:
            raise OSError(f"{self.path} was cut to {status.st_size} of its {self.nbytes} bytes while the run uses it")
        if self._watch.faulted():
            raise OSError(f"{self.path} was cut while the run had it mapped (and has been made whole since)")

    def read(self, names=None) -> dict[str, np.ndarray]:
        """States ``names`` (default: every one the update reads), read into new arrays."""
        self.check()
        start = time.perf_counter()
        names = [n for n in self.names if n != SUMS] if names is None else names
        arrays = {name: np.empty(self.numel, self.dtypes[name]) for name in names}
        for name, array in arrays.items():
            _read_fully(self._fd, memoryview(array).cast("B"), self._offsets[name])
            self.read_bytes += array.nbytes
        self.io_seconds += time.perf_counter() - start
        return arrays

    def write(self, arrays: dict[str, np.ndarray]) -> None:
        """Write the states in ``arrays`` (by name) to the file, and start writing them back to the disk now, so the
        page cache does not fill with them."""
        self.check()  # a write would make a cut file whole again, with zeros where the cut was
        start = time.perf_counter()
        for name, array in arrays.items():
            _write_fully(self._fd, memoryview(np.ascontiguousarray(array)).cast("B"), self._offsets[name])
            self.written_bytes += array.nbytes
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)
        self.io_seconds += time.perf_counter() - start

    def write_or_remember(self, arrays: dict[str, np.ndarray]) -> None:
        """``write``, from a place where a failure cannot be agreed on (``_remembering``)."""
        self._remembering(lambda: self.write(arrays))

    def read_or_remember(self, name: str) -> np.ndarray:
        """State ``name`` read in, or zeros where that fails (``_remembering``)."""
        return self._remembering(lambda: self.read([name])[name], zeros_of=name)

    def _remembering(self, action, zeros_of: str | None = None):
        """``action()``, from a place where a failure cannot be agreed on: on one, zeros shaped as state
        ``zeros_of`` (or None), and the failure remembered for the update's next read to raise, where every rank
        agrees and the step is not kept. (A ValueError is numpy's, for a mapping past a cut file's end.)"""
        try:
            return action()
        except (OSError, ValueError) as error:
            self.failure = self.failure or (error if isinstance(error, OSError) else OSError(str(error)))
            return None if zeros_of is None else np.zeros(self.numel, self.dtypes[zeros_of])

    def prefetch(self) -> None:
        """Ask the kernel to read the whole file ahead, in the background, for the next ``read``."""
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_WILLNEED)

    def mapped_or_remember(self, name: str) -> np.ndarray:
        """State ``name`` mapped, or zeros where that fails (``_remembering``)."""
        return self._remembering(lambda: self.mapped(name), zeros_of=name)

    def mapped(self, name: str) -> np.ndarray:
        """State ``name`` as a writable view of the file (its pages are read as they are touched), covered against
        a cut while it is mapped (``cut_mappings``)."""
        self.check()
        if not self.numel:
            return np.empty(0, self.dtypes[name])
        offset = self._offsets[name]
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        size = offset - start + self.numel * self.dtypes[name].itemsize
        mapping = mmap.mmap(self._fd, size, offset=start)  # the open file, whatever its path names now
        self._watch.add(mapping)
        return np.frombuffer(mapping, self.dtypes[name], self.numel, offset - start)


class MappedStates(Mapping):
    """A group's states by name (its grad shard and sums aside): ``held`` ones as they are, the file's mapped on
    first use, so that a reader of one state (a digest of the master) maps nothing else."""

    def __init__(self, store: GroupFile, held: dict) -> None:
        self._store, self._held = store, dict(held)

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._held:
            if name not in self._names():
                raise KeyError(name)
            self._held[name] = self._store.mapped(name)
        return self._held[name]

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys([*self._held, *self._names()]))

    def __len__(self) -> int:
        return len(set(self._held) | set(self._names()))

    def _names(self) -> list[str]:
        return [name for name in self._store.names if name not in (GRAD, SUMS)]


def _read_fully(fd: int, into: memoryview, offset: int) -> None:
    while len(into):
        got = os.preadv(fd, [into], offset)
        if got == 0:
            raise OSError(f"an offload file ended {len(into)} bytes early")
        into, offset = into[got:], offset + got


def _write_fully(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        done = os.pwritev(fd, [data], offset)
        data, offset = data[done:], offset + done
