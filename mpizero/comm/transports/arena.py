"""Host buffers summed straight out of the node-shared window they were encoded into: on one host, or in two levels.

The send buffer of a reduce-scatter or all-reduce comes from ``Collectives.shared_buffer``, this rank's segment of
a ``SharedArena``; every rank of the host reads every segment, so nothing is copied into MPI. On several nodes
with the same number of ranks each, ``TwoLevelArena`` sums inside each node from the window and then across
nodes by MPI among ranks of the same local index, and gathers the same way (``hierarchical``). Every element is
still summed exactly once, so int64 sums keep their bits.
"""

from __future__ import annotations

from mpizero.comm.pending import Pending
from mpizero.comm.transports.base import Transport


class Arena(Transport):
    """Reductions out of one host's shared window (blocking); gathers do not go this way."""

    def __init__(self, arena) -> None:
        self.arena = arena

    def reduce_scatter(self, send, recv, blocking: bool) -> Pending:
        self.arena.reduce_scatter(send, recv)
        return Pending()

    def allreduce(self, send, recv, blocking: bool) -> Pending:
        self.arena.allreduce(send, recv)
        return Pending()


class TwoLevelArena(Transport):
    """Reduce-scatters out of each node's shared window, then across nodes (blocking); all-gathers across nodes,
    then inside each node through a window (the across-node part nonblocking); all-reduces go by MPI."""

    two_level = True

    def __init__(self, levels, arena=None) -> None:
        self.levels, self.arena = levels, arena

    def reduce_scatter(self, send, recv, blocking: bool) -> Pending:
        self.levels.reduce_scatter(self.arena, send, recv)
        return Pending()

    def allgather(self, send, recv, blocking: bool) -> Pending:
        request, finish = self.levels.start_allgather(send, recv)
        return Pending(request, finish, keep=(send, recv))
