"""How a buffer travels in a collective: the one object the comm layer asks (STYLE point 18).

Settled once at set-up from the agreed paths (``paths.CommPaths.device``) and
the world size, then asked for every array collective:

- local: a world of one rank. Nothing leaves the process and nothing is
  staged: a reduce-scatter, all-reduce or all-gather over one rank is a copy
  from send to recv on the buffer's own device; in place, it is nothing.
- host: NumPy buffers go to MPI as they are.
- cuda-aware: device buffers go to MPI once the current stream has written them.
- pinned: device buffers are staged through page-locked host buffers in
  chunks, the copies on a side stream overlapped with MPI (``staging``);
  the call is complete when it returns.
- pageable: device buffers are copied to new host arrays and back (``get`` and
  ``set``); nonblocking calls stay nonblocking. Also what a device buffer gets
  in a job settled for host buffers.

Every choice moves the same bytes into recv, so every path gives the same bits.
"""

from __future__ import annotations

import numpy as np

from mpizero.arrays import array_module, is_device_array
from mpizero.comm.pending import Pending
from mpizero.comm.staging import CHUNK_BYTES, CupyCopies, PlainCopies, staged_in_chunks
from mpizero.errors import ZeroError

STAGING_ENV_VAR = "MPIZERO_STAGING"
STAGINGS = ("pinned", "pageable")


def requested_staging(environ) -> str:
    """How device buffers are staged when MPI is not CUDA-aware: ``pinned`` (default) or ``pageable``."""
    value = environ.get(STAGING_ENV_VAR) or "pinned"
    if value not in STAGINGS:
        raise ZeroError(f"{STAGING_ENV_VAR} must be one of {', '.join(STAGINGS)}, got {value!r}")
    return value


class Transport:
    """Moves one collective's buffers: local at one rank, else by where the buffer lives and the agreed path."""

    def __init__(self, device: str, rank: int, world_size: int, traffic) -> None:
        """``device``: the agreed ``CommPaths.device``; ``traffic``: where staged bytes are counted."""
        self.device, self.rank, self.world_size, self.traffic = device, rank, world_size, traffic
        self.local = world_size == 1
        self.chunk_bytes = CHUNK_BYTES  # of pinned staging; tests make it small to cut buffers at odd places
        self._copies: dict = {}  # array module -> its staging copies (pinned buffers, side stream)

    def on_host(self, a) -> bool:
        """Whether ``a`` is a host buffer, which the host-only paths (shared arena, pieces, two levels) take."""
        return not is_device_array(a)

    def start(self, op: str, collective, send, recv) -> Pending:
        """Start ``collective(send, recv)`` (a request, a Pending, or None) with the buffers where MPI can use them."""
        if self.local:
            if send is not None:
                recv[...] = send  # the sum, or the gathering, of one rank's buffer: on its own device
            return Pending()
        if self.on_host(recv):
            started = collective(send, recv)
            return started if isinstance(started, Pending) else Pending(started, keep=(send, recv))
        if self.device == "cuda-aware":
            array_module(recv).cuda.get_current_stream().synchronize()
            return Pending(collective(send, recv), keep=(send, recv))
        if self.device == "pinned":
            copies = self._copies_for(recv)
            moved = staged_in_chunks(collective, send, recv, self.rank, self.world_size, copies, self.chunk_bytes)
            self.traffic.staged[op] += moved
            return Pending()
        return self._pageable(op, collective, send, recv)

    def _pageable(self, op: str, collective, send, recv) -> Pending:
        staged_send = None if send is None else send.get()
        staged_recv = np.empty(recv.shape, recv.dtype)
        if send is None:
            staged_recv[...] = recv.get()
        self.traffic.staged[op] += staged_recv.nbytes * 2 if send is None else send.nbytes + staged_recv.nbytes
        request = collective(staged_send, staged_recv)
        return Pending(request, lambda: recv.set(staged_recv), keep=(staged_send,))

    def _copies_for(self, recv):
        xp = array_module(recv)
        if xp not in self._copies:
            self._copies[xp] = PlainCopies() if xp is np else CupyCopies(xp)
        return self._copies[xp]
