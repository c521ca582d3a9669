"""Rank files: one per rank, every state of that rank's shard, verified block by block as it is read.

``rankRRRRR.bin`` holds rank R's elements (``layout.SavedLayout.pieces``) as
little-endian float32, one row per state (``master``, then each optimizer
state), then the sha256 of each ``block_bytes`` block of those rows. The
manifest lists, per rank, the sha256 of that digest table: it seals the table,
the table seals each block, so a reader checks any byte range it reads by
reading that range's blocks and the table, never the whole file. Nothing is
unpickled; there is no header to parse.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterable
from typing import BinaryIO

import numpy as np

from mpizero.checkpoint.placement import SavedLayout
from mpizero.errors import CheckpointError

DIGEST = hashlib.sha256().digest_size
BLOCK_BYTES = 1 << 14  # 16 KiB: a reshard reads at most one block more at each end of a run; tables add 0.2%
ELEMENT = np.dtype("<f4")


def file_name(rank: int) -> str:
    """The rank file holding every state of rank ``rank``'s shard."""
    return f"rank{rank:05d}.bin"


def blocks(data_bytes: int, block_bytes: int) -> int:
    """Blocks in a rank file of ``data_bytes`` bytes of rows."""
    return -(-data_bytes // block_bytes)


def file_bytes(length: int, states: int, block_bytes: int) -> int:
    """Size of a rank file holding ``length`` elements of each of ``states`` states: rows, then the digest table."""
    data = length * states * ELEMENT.itemsize
    return data + blocks(data, block_bytes) * DIGEST


class BlockHasher:
    """Digests of each ``block_bytes`` block of a byte stream, fed in pieces of any size."""

    def __init__(self, block_bytes: int) -> None:
        self.block_bytes, self.digests, self._block, self._filled = block_bytes, [], hashlib.sha256(), 0

    def update(self, data: memoryview) -> None:
        while len(data):
            take = min(len(data), self.block_bytes - self._filled)
            self._block.update(data[:take])
            self._filled, data = self._filled + take, data[take:]
            if self._filled == self.block_bytes:
                self._close_block()

    def table(self) -> bytes:
        """The digest table: every block's sha256, the last (short) block's included."""
        if self._filled:
            self._close_block()
        return b"".join(self.digests)

    def _close_block(self) -> None:
        self.digests.append(self._block.digest())
        self._block, self._filled = hashlib.sha256(), 0


def write_rank_file(f: BinaryIO, rows: Iterable[Iterable[np.ndarray]], block_bytes: int) -> str:
    """Write each row (its arrays back to back, as float32) then the digest table; return the table's sha256.

    Written through Python's file object, so a full disk raises ENOSPC naming no file (the caller adds it).
    """
    hasher = BlockHasher(block_bytes)
    for row in rows:
        for array in row:
            data = memoryview(np.ascontiguousarray(array, dtype=ELEMENT)).cast("B")
            hasher.update(data)
            f.write(data)
    table = hasher.table()
    f.write(table)
    return hashlib.sha256(table).hexdigest()


class RankFile:
    """One rank file, opened for reading: its size and digest table checked on open, each block as it is read."""

    def __init__(self, path: str, length: int, states: int, block_bytes: int, root: str) -> None:
        self.path, self.length, self.block_bytes = path, length, block_bytes
        self.data_bytes = length * states * ELEMENT.itemsize
        self.bytes_read, self._cached = 0, (-1, b"")
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO must not block the open
        except FileNotFoundError:
            raise CheckpointError(f"{path}: missing") from None
        except OSError as error:  # a symlink loop, a socket, no permission
            raise CheckpointError(f"{path}: cannot read it ({error.strerror or error})") from None
        try:
            self.table = self._checked_table(file_bytes(length, states, block_bytes), root)
        except BaseException:
            self.close()
            raise

    def _checked_table(self, expected: int, root: str) -> bytes:
        """The digest table, once the file is a regular file of the ``expected`` size and the table matches ``root``."""
        info = os.fstat(self.fd)
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError(f"{self.path}: not a regular file")
        if info.st_size != expected:
            raise CheckpointError(
                f"{self.path}: {info.st_size} bytes, the manifest's layout says {expected} (truncated or replaced)"
            )
        table = self._pread(self.data_bytes, expected - self.data_bytes)
        if hashlib.sha256(table).hexdigest() != root:
            raise CheckpointError(f"{self.path}: its digest table does not match the manifest (the file changed)")
        return table

    def read(self, row: int, start: int, stop: int, out: np.ndarray) -> None:
        """Fill ``out`` with elements ``[start, stop)`` of row ``row``, reading and checking only their blocks."""
        first = (row * self.length + start) * ELEMENT.itemsize
        last = (row * self.length + stop) * ELEMENT.itemsize
        into = memoryview(out.view(np.uint8).reshape(-1))
        position = first
        while position < last:
            index = position // self.block_bytes
            block = self._block(index)
            lo, hi = position - index * self.block_bytes, min(last - index * self.block_bytes, len(block))
            into[position - first : position - first + hi - lo] = block[lo:hi]
            position += hi - lo

    def _block(self, index: int) -> bytes:
        """Block ``index``, checked against its digest (the last one read is kept: runs often share a block)."""
        if self._cached[0] != index:
            start = index * self.block_bytes
            data = self._pread(start, min(self.block_bytes, self.data_bytes - start))
            if hashlib.sha256(data).digest() != self.table[index * DIGEST : (index + 1) * DIGEST]:
                raise CheckpointError(
                    f"{self.path}: bytes [{start}, {start + len(data)}) do not match their digest (the file changed)"
                )
            self._cached = (index, data)
        return self._cached[1]

    def _pread(self, offset: int, size: int) -> bytes:
        try:
            data = os.pread(self.fd, size, offset)
        except OSError as error:
            raise CheckpointError(f"{self.path}: cannot read it ({error.strerror or error})") from None
        if len(data) != size:
            raise CheckpointError(f"{self.path}: ended at byte {offset + len(data)}, before {offset + size}")
        self.bytes_read += size
        return data

    def close(self) -> None:
        os.close(self.fd)


class CheckpointReader:
    """Read any range of any tensor's state from a checkpoint, touching only the blocks that hold it.

    ``manifest`` must have passed ``structure.check``. ``bytes_read``: every byte read from rank files so far.
    """

    def __init__(self, path: str, manifest: dict) -> None:
        self.path, self.manifest, self.layout = path, manifest, SavedLayout.of_manifest(manifest)
        self.rows = {state: row for row, state in enumerate(manifest["states"])}
        self.opened: dict[int, RankFile] = {}

    def read(self, state: str, wanted: Iterable[tuple[str, int, int, np.ndarray]]) -> None:
        """Fill each ``out`` of ``wanted`` ``(name, start, stop, out)`` with elements ``[start, stop)`` of tensor
        ``name``'s ``state`` (float32), reading each rank file's blocks in ascending order, so each once."""
        runs = [
            (run, out[run.start - start : run.stop - start])
            for name, start, stop, out in wanted
            for run in self.layout.runs(name, start, stop)
        ]
        for run, out in sorted(runs, key=lambda found: (found[0].rank, found[0].at)):
            self._file(run.rank).read(self.rows[state], run.at, run.at + run.stop - run.start, out)

    def verify(self, ranks: Iterable[int]) -> None:
        """Check these ranks' files (their size and digest table) without reading their elements."""
        for rank in ranks:
            self._file(rank)

    def empty_files(self) -> list[int]:
        """The ranks whose files hold no element (they own only padding): the last ranks, if any.

        No load reads them, so a load checks them on purpose: a signed checkpoint is then checked whole.
        """
        empty = []
        for rank in reversed(range(self.layout.world_size)):
            if self.layout.rank_length(rank):
                break
            empty.append(rank)
        return empty

    @property
    def bytes_read(self) -> int:
        return sum(f.bytes_read for f in self.opened.values())

    def _file(self, rank: int) -> RankFile:
        if rank not in self.opened:
            m = self.manifest
            path = os.path.join(self.path, file_name(rank))
            length = self.layout.rank_length(rank)
            self.opened[rank] = RankFile(path, length, len(m["states"]), m["block_bytes"], m["files"][rank])
        return self.opened[rank]

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        for f in self.opened.values():
            f.close()
        self.opened.clear()


def bytes_to_read(layout: SavedLayout, wanted: Iterable[tuple[str, int, int]], states: int, block_bytes: int) -> int:
    """Bytes ``CheckpointReader.read`` reads to fill ``wanted`` (name, start, stop) of every state, state by state.

    It reads each touched file's digest table, and each block a run touches once: it meets a file's blocks in
    ascending order (runs sorted within a state, states in file order) and keeps the last one it read.
    """
    wanted, touched = list(wanted), {}
    for row in range(states):
        for name, start, stop in wanted:
            for run in layout.runs(name, start, stop):
                base = (row * layout.rank_length(run.rank) + run.at) * ELEMENT.itemsize
                end = base + (run.stop - run.start) * ELEMENT.itemsize
                touched.setdefault(run.rank, set()).update(range(base // block_bytes, (end - 1) // block_bytes + 1))
    total = 0
    for rank, indices in touched.items():
        data = layout.rank_length(rank) * states * ELEMENT.itemsize
        total += blocks(data, block_bytes) * DIGEST + sum(min(block_bytes, data - i * block_bytes) for i in indices)
    return total
