"""What every transport offers: the four collectives, each by default one ``run`` of the operation's name."""

from __future__ import annotations

from mpizero.comm.pending import Pending


class Transport:
    """``reduce_scatter``, ``allreduce``, ``allgather`` and ``alltoall`` of ``send`` into ``recv``
    (``allgather``'s ``send`` None: in place), ``blocking`` or not, each returning a ``Pending``; ``two_level``:
    whether the bytes cross nodes in two levels (for the traffic count)."""

    two_level = False

    def reduce_scatter(self, send, recv, blocking: bool) -> Pending:
        return self.run("reduce_scatter", send, recv, blocking)

    def allreduce(self, send, recv, blocking: bool) -> Pending:
        return self.run("allreduce", send, recv, blocking)

    def allgather(self, send, recv, blocking: bool) -> Pending:
        return self.run("allgather", send, recv, blocking)

    def alltoall(self, send, recv, blocking: bool) -> Pending:
        return self.run("alltoall", send, recv, blocking)

    def run(self, op: str, send, recv, blocking: bool) -> Pending:
        raise NotImplementedError(f"{type(self).__name__} has no {op}")
