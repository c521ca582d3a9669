"""A faster reduce-scatter for large host buffers: ``Reduce_scatter_block`` in cache-sized pieces.

MPICH's ``Reduce_scatter_block`` slows down for messages of tens of MiB on one
host (README, "Performance"). Here the buffer is cut into pieces of about
``PIECE_BYTES``: each rank's block contributes the same columns to a piece,
packed contiguously, and each piece is one ``Reduce_scatter_block`` whose
result lands straight in the rank's output. Every element is still summed by
MPI exactly once, so int64 (exact) sums are the same bits as one big call.
Which buffers go this way is settled in ``paths``.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

PIECE_BYTES = 1 << 22


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
