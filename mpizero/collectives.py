"""Reduce-scatter, all-gather and all-reduce on NumPy or CuPy buffers.

Device buffers go straight to MPI when it is CUDA-aware (see ``cuda_aware``)
and are staged through host memory otherwise. Every call is counted in a
``Traffic`` log, so a step's communication volume is measured, not assumed.

The cross-rank contract of each call: the buffers have the same dtype and
length on every rank, and every rank makes the same calls in the same order.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
from mpi4py import MPI

from .arrays import array_module, is_device_array
from .cuda_aware import cuda_aware


@dataclass
class Traffic:
    """Calls per collective and the bytes of the full (unsharded) buffer each moved."""

    calls: Counter = field(default_factory=Counter)
    full_bytes: Counter = field(default_factory=Counter)

    def record(self, op: str, nbytes: int) -> None:
        self.calls[op] += 1
        self.full_bytes[op] += nbytes

    def clear(self) -> None:
        self.calls.clear()
        self.full_bytes.clear()


class Collectives:
    """The engine's collectives on one communicator, with staging and counting."""

    def __init__(self, comm: MPI.Comm) -> None:
        self.comm = comm
        self.traffic = Traffic()

    def reduce_scatter(self, send, recv) -> None:
        """Sum ``send`` (world_size * len(recv) elements) over ranks; keep this rank's block."""
        self.traffic.record("reduce_scatter", send.nbytes)
        self._call(lambda s, r: self.comm.Reduce_scatter_block(s, r, op=MPI.SUM), send, recv)

    def allreduce(self, send, recv) -> None:
        """Sum ``send`` over ranks into ``recv`` on every rank."""
        self.traffic.record("allreduce", send.nbytes)
        self._call(lambda s, r: self.comm.Allreduce(s, r, op=MPI.SUM), send, recv)

    def allgather(self, send, recv) -> None:
        """Concatenate every rank's ``send`` into ``recv`` in rank order."""
        self.traffic.record("allgather", recv.nbytes)
        self._call(lambda s, r: self.comm.Allgather(s, r), send, recv)

    def allgather_in_place(self, full) -> None:
        """All-gather into ``full``, whose block for this rank already holds its shard."""
        self.traffic.record("allgather", full.nbytes)
        self._call(lambda _, r: self.comm.Allgather(MPI.IN_PLACE, r), None, full)

    def _call(self, collective, send, recv) -> None:
        if not is_device_array(recv):
            collective(send, recv)
        elif cuda_aware():
            array_module(recv).cuda.get_current_stream().synchronize()
            collective(send, recv)
        else:
            staged_recv = np.empty(recv.shape, recv.dtype)
            if send is None:
                staged_recv[...] = recv.get()
            collective(None if send is None else send.get(), staged_recv)
            recv.set(staged_recv)
