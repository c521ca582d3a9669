"""Device buffers through host memory around MPI, where MPI is not CUDA-aware: pinned, in chunks, or pageable."""

from __future__ import annotations

import numpy as np

from mpizero.arrays import array_module
from mpizero.comm.pending import Pending
from mpizero.comm.transports.base import Transport
from mpizero.comm.transports.staging import CHUNK_BYTES, CupyCopies, PlainCopies, staged_in_chunks
from mpizero.errors import ZeroError

STAGING_ENV_VAR = "MPIZERO_STAGING"
STAGINGS = ("pinned", "pageable")


def requested_staging(environ) -> str:
    """How device buffers are staged when MPI is not CUDA-aware: ``pinned`` (default) or ``pageable``."""
    value = environ.get(STAGING_ENV_VAR) or "pinned"
    if value not in STAGINGS:
        raise ZeroError(f"{STAGING_ENV_VAR} must be one of {', '.join(STAGINGS)}, got {value!r}")
    return value


class PinnedStaging(Transport):
    """Device buffers staged through page-locked host buffers in chunks, the copies on a side stream overlapped
    with MPI (``staging``); the call is complete when it returns."""

    def __init__(self, mpi, rank: int, world_size: int) -> None:
        self.mpi, self.rank, self.world_size = mpi, rank, world_size
        self.chunk_bytes = CHUNK_BYTES  # tests make it small to cut buffers at odd places
        self._copies: dict = {}  # array module -> its staging copies (pinned buffers, side stream)

    def run(self, op: str, send, recv, blocking: bool) -> Pending:
        def collective(host_send, host_recv):
            return self.mpi.call(op, host_send, host_recv, True)

        copies = self._copies_for(recv)
        blocks = (self.world_size, self.world_size) if op == "alltoall" else None
        moved = staged_in_chunks(
            collective, send, recv, self.rank, self.world_size, copies, self.chunk_bytes, blocks=blocks
        )
        return Pending(staged=moved)

    def _copies_for(self, recv):
        xp = array_module(recv)
        if xp not in self._copies:
            self._copies[xp] = PlainCopies() if xp is np else CupyCopies(xp)
        return self._copies[xp]


class PageableStaging(Transport):
    """Device buffers copied to new host arrays and back (``get`` and ``set``); nonblocking calls stay
    nonblocking."""

    def __init__(self, mpi) -> None:
        self.mpi = mpi

    def run(self, op: str, send, recv, blocking: bool) -> Pending:
        staged_send = None if send is None else send.get()
        staged_recv = np.empty(recv.shape, recv.dtype)
        if send is None:
            staged_recv[...] = recv.get()
        moved = staged_recv.nbytes * 2 if send is None else send.nbytes + staged_recv.nbytes
        request = self.mpi.call(op, staged_send, staged_recv, blocking)
        return Pending(request, lambda: recv.set(staged_recv), keep=(staged_send,), staged=moved)
