"""The one place that chooses how a collective's bytes move (``transports``), per call, from the agreed paths."""

from __future__ import annotations

import os

from mpizero.arrays import is_device_array
from mpizero.comm import cuda_aware
from mpizero.comm.transports.arena import Arena, TwoLevelArena
from mpizero.comm.transports.local import Local
from mpizero.comm.transports.mpi import CudaAwareMPI, HostMPI
from mpizero.comm.transports.staged import PageableStaging, PinnedStaging, requested_staging


class Router:
    """Chooses the transport of each collective: at one rank ``Local``; a device buffer by the agreed device path
    (``DEVICE_TRANSPORTS``: ``cuda-aware``, ``pinned`` or ``pageable``); a host buffer out of a node-shared arena
    by ``Arena`` (in two levels where the paths say so); a host gather in two levels likewise; any other host
    buffer by MPI."""

    def __init__(self, comm, paths, levels) -> None:
        """``paths``: the agreed ``CommPaths`` at set-up (where host buffers go in pieces, and how device buffers
        travel, never change; whether reductions go through the shared arena may: ``route`` takes the paths
        now); ``levels``: the ``hierarchical.TwoLevel`` communicators where the paths go in two levels, else None.
        Nothing here refers back to the ``Collectives`` that owns it, so an engine dropped is freed at once."""
        self.levels = levels
        self.local = Local() if comm.Get_size() == 1 else None
        self.host = HostMPI(comm, paths.pieces_from_bytes)
        self.device = DEVICE_TRANSPORTS[paths.device](comm, self.host)

    @staticmethod
    def on_host(a) -> bool:
        """Whether ``a`` is a host buffer, which the host-only paths (shared arena, pieces, two levels) take."""
        return not is_device_array(a)

    def route(self, op: str, send, recv, arena, paths):
        """The transport for ``op`` (``reduce_scatter``, ``allreduce``, ``allgather``, ``alltoall``) of ``send``
        into ``recv``; ``arena``: the node-shared arena ``send`` lies in, if any; ``paths``: the agreed paths now."""
        if self.local is not None:
            return self.local
        if not self.on_host(recv):
            return self.device
        two_level = paths.two_level
        if two_level and (op == "allgather" or (op == "reduce_scatter" and arena is not None)):
            return TwoLevelArena(self.levels, arena)
        if arena is not None and not two_level:
            return Arena(arena)
        return self.host


DEVICE_TRANSPORTS = {  # the agreed ``CommPaths.device`` -> how device buffers travel (``host``: a job settled for
    # host buffers, whose stray device buffer is copied through pageable memory)
    "cuda-aware": lambda comm, host: CudaAwareMPI(comm),
    "pinned": lambda comm, host: PinnedStaging(host, comm.Get_rank(), comm.Get_size()),
    "pageable": lambda comm, host: PageableStaging(host),
    "host": lambda comm, host: PageableStaging(host),
}


def device_path(on_device: bool, environ=os.environ) -> str:
    """The ``DEVICE_TRANSPORTS`` name this rank asks for: ``host`` for host buffers; on a device ``cuda-aware``
    where MPI is (``cuda_aware``), else the staging ``MPIZERO_STAGING`` asks for (``pinned`` by default)."""
    if not on_device:
        return "host"
    return "cuda-aware" if cuda_aware.cuda_aware() else requested_staging(environ)
