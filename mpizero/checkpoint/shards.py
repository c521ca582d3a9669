"""Rank files: the pieces of each tensor a rank owns, as flat float32 ``.npy`` files, and reading them back.

``rankRRRRR-STATE.npy`` holds rank R's pieces of STATE (``master`` or an
optimizer state) back to back, padding stripped. A rank file is opened only
after its size, sha256, dtype and shape match the manifest, and never unpickled.
"""

from __future__ import annotations

import bisect
import hashlib
import os
from dataclasses import dataclass

import numpy as np

from mpizero.checkpoint.manifest import CheckpointError
from mpizero.checkpoint.structure import file_name


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` of tensor ``name`` (flat, unpadded), at ``[at, at + stop - start)`` in a rank file."""

    name: str
    start: int
    stop: int
    at: int


def rank_pieces(engine) -> list[tuple[Piece, dict]]:
    """This rank's shard, tensor by tensor: ``(piece, its arrays by state name)``."""
    pieces, at = [], 0
    for piece in engine.shard_pieces():
        pieces.append((Piece(piece.spec.name, piece.start, piece.stop, at), piece.arrays))
        at += piece.stop - piece.start
    return pieces


def sha256(path: str) -> str:
    """The sha256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def open_array(path: str, name: str, meta: dict) -> np.ndarray:
    """Memory-map one rank file after checking it against its manifest entry ``meta``; never unpickle."""
    full, field = os.path.join(path, name), f"manifest field files[{name!r}]"
    if not os.path.isfile(full):
        raise CheckpointError(f"{full}: missing")
    size = os.path.getsize(full)
    if size != meta["bytes"]:
        raise CheckpointError(f"{full}: {size} bytes, {field}.bytes says {meta['bytes']} (truncated or replaced)")
    if sha256(full) != meta["sha256"]:
        raise CheckpointError(f"{full}: checksum mismatch with {field}.sha256 (the file changed after the save)")
    try:
        with open(full, "rb") as f:
            version = np.lib.format.read_magic(f)
            readers = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
            if version not in readers:
                raise ValueError(f".npy format version {version} is not one mpizero writes")
            shape, _, dtype = readers[version](f)
    except ValueError as error:
        raise CheckpointError(f"{full}: not a readable .npy file ({error})") from None
    if dtype.hasobject:
        raise CheckpointError(f"{full}: holds Python objects that would need pickle to load; refusing")
    if dtype != np.float32 or list(shape) != meta["shape"]:
        raise CheckpointError(f"{full}: {dtype}{list(shape)}, {field} says float32{meta['shape']}")
    return np.load(full, mmap_mode="r", allow_pickle=False)


class PieceReader:
    """Read any range of any tensor's state from a checkpoint, touching only the files that hold it.

    The manifest must have passed ``structure.check``: its pieces tile every tensor.
    """

    def __init__(self, path: str, manifest: dict) -> None:
        self.path, self.manifest = path, manifest
        self.pieces: dict[str, list[tuple[int, Piece]]] = {}
        for rank, rank_pieces_of in enumerate(manifest["pieces"]):
            for p in rank_pieces_of:
                self.pieces.setdefault(p["name"], []).append((rank, Piece(**p)))
        for spans in self.pieces.values():  # they tile the tensor: sorted by start, they are sorted by stop too
            spans.sort(key=lambda rank_piece: rank_piece[1].start)
        self.starts = {name: [piece.start for _, piece in spans] for name, spans in self.pieces.items()}
        self.opened: dict[str, np.ndarray] = {}

    def read(self, state: str, name: str, start: int, stop: int, out) -> None:
        """Fill ``out`` (length stop - start) with elements ``[start, stop)`` of tensor ``name``'s ``state``.

        The pieces of a tensor are about one per rank: finding the first by bisection keeps a read O(log N).
        """
        spans = self.pieces.get(name, [])
        for index in range(max(bisect.bisect_right(self.starts.get(name, []), start) - 1, 0), len(spans)):
            rank, piece = spans[index]
            if piece.start >= stop:
                break
            lo, hi = max(start, piece.start), min(stop, piece.stop)
            if lo < hi:
                source = self._file(rank, state)
                out[lo - start : hi - start] = source[piece.at + lo - piece.start : piece.at + hi - piece.start]

    def _file(self, rank: int, state: str) -> np.ndarray:
        name = file_name(rank, state)
        if name not in self.opened:
            self.opened[name] = open_array(self.path, name, self.manifest["files"][name])
        return self.opened[name]
