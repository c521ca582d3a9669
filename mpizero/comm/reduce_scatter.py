"""A faster reduce-scatter for large host buffers: ``Reduce_scatter_block`` in cache-sized pieces.

MPICH's ``Reduce_scatter_block`` slows down for messages of tens of MiB on one
host (README, "Performance"). Here the buffer is cut into pieces of about
``PIECE_BYTES``: each rank's block contributes the same columns to a piece,
packed contiguously, and each piece is one ``Reduce_scatter_block`` whose
result lands straight in the rank's output. Every element is still summed by
MPI exactly once, so int64 (exact) sums are the same bits as one big call.

``MPIZERO_REDUCE_SCATTER`` chooses the algorithm for host buffers: ``auto``
(default: the zero-copy shared-memory path of ``shared`` when every rank is on
one host and the engine encoded into the arena, else pieces for buffers of at
least ``THRESHOLD_BYTES``, else one call), ``shared``, ``pieces`` or ``mpi``.
"""

from __future__ import annotations

import os

import numpy as np
from mpi4py import MPI

PIECE_BYTES = 1 << 22
THRESHOLD_BYTES = 1 << 26  # measured: one call wins at 32 MiB, pieces at 128 MiB
ENV_VAR = "MPIZERO_REDUCE_SCATTER"
CHOICES = ("auto", "shared", "pieces", "mpi")


def setting() -> str:
    """The algorithm the environment asks for, checked."""
    value = os.environ.get(ENV_VAR, "auto")
    if value not in CHOICES:
        raise ValueError(f"{ENV_VAR} must be one of {CHOICES}, got {value!r}")
    return value


def allows_shared() -> bool:
    return setting() in ("auto", "shared")


def use_pieces(nbytes: int) -> bool:
    """Decide, from the environment and the buffer size, whether to reduce in pieces."""
    chosen = setting()
    return chosen == "pieces" or (chosen in ("auto", "shared") and nbytes >= THRESHOLD_BYTES)


def reduce_scatter_in_pieces(comm, send: np.ndarray, recv: np.ndarray, piece_bytes: int = PIECE_BYTES) -> None:
    """Sum ``send`` (size * len(recv) elements) over ranks into ``recv``, one cache-sized piece at a time."""
    size, block = comm.Get_size(), recv.size
    blocks = send.reshape(size, block)
    columns = max(1, piece_bytes // (send.itemsize * size))
    packed = np.empty((size, min(columns, block)), dtype=send.dtype)
    for start in range(0, block, columns):
        stop = min(start + columns, block)
        piece = (
            packed[:, : stop - start] if stop - start == packed.shape[1] else np.empty((size, stop - start), send.dtype)
        )
        piece[...] = blocks[:, start:stop]
        comm.Reduce_scatter_block(piece, recv[start:stop], op=MPI.SUM)
