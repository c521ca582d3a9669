"""MPI's own collectives, on the buffers MPI reads: host arrays, or device arrays where MPI is CUDA-aware."""

from __future__ import annotations

from mpi4py import MPI

from mpizero.arrays import array_module
from mpizero.comm.pending import Pending
from mpizero.comm.transports.base import Transport
from mpizero.comm.transports.pieces import reduce_scatter_in_pieces


class HostMPI(Transport):
    """MPI on host buffers; a large host reduce-scatter goes in cache-sized pieces (``reduce_scatter``), from
    ``pieces_from_bytes`` bytes (the agreed paths'), blocking."""

    def __init__(self, comm: MPI.Comm, pieces_from_bytes) -> None:
        self.comm, self.pieces_from_bytes = comm, pieces_from_bytes

    def call(self, op: str, send, recv, blocking: bool):
        """Start ``op`` on buffers MPI reads; return its request, or None once done (blocking)."""
        if op == "reduce_scatter":
            call = self.comm.Reduce_scatter_block if blocking else self.comm.Ireduce_scatter_block
            return call(send, recv, op=MPI.SUM)
        if op == "allreduce":
            return (self.comm.Allreduce if blocking else self.comm.Iallreduce)(send, recv, op=MPI.SUM)
        if op == "alltoall":
            return (self.comm.Alltoall if blocking else self.comm.Ialltoall)(send, recv)
        if send is None:
            return self.comm.Allgather(MPI.IN_PLACE, recv)
        return (self.comm.Allgather if blocking else self.comm.Iallgather)(send, recv)

    def reduce_scatter(self, send, recv, blocking: bool) -> Pending:
        if send.nbytes >= self.pieces_from_bytes:
            reduce_scatter_in_pieces(self.comm, send, recv)
            return Pending()
        return self.run("reduce_scatter", send, recv, blocking)

    def run(self, op: str, send, recv, blocking: bool) -> Pending:
        return Pending(self.call(op, send, recv, blocking), keep=(send, recv))


class CudaAwareMPI(HostMPI):
    """MPI on device buffers, which a CUDA-aware MPI reads itself once the current stream has written them."""

    def __init__(self, comm: MPI.Comm) -> None:
        super().__init__(comm, float("inf"))  # device buffers never go in host pieces

    def run(self, op: str, send, recv, blocking: bool) -> Pending:
        self.written(recv)
        return super().run(op, send, recv, blocking)

    @staticmethod
    def written(recv) -> None:
        """Wait until the current stream has run the work queued on it: MPI reads and writes device memory outside
        any stream, so the kernels writing ``send`` (or still touching ``recv``) must be done first."""
        array_module(recv).cuda.get_current_stream().synchronize()
