"""A world of one rank: nothing leaves the process and nothing is staged."""

from __future__ import annotations

from mpizero.comm.pending import Pending


class Local:
    """Every collective over one rank is a copy from ``send`` to ``recv`` on the buffer's own device; in place, it
    is nothing."""

    two_level = False

    def reduce_scatter(self, send, recv, blocking: bool) -> Pending:
        return self._copy(send, recv)

    def allreduce(self, send, recv, blocking: bool) -> Pending:
        return self._copy(send, recv)

    def allgather(self, send, recv, blocking: bool) -> Pending:
        return self._copy(send, recv)

    @staticmethod
    def _copy(send, recv) -> Pending:
        if send is not None:
            recv[...] = send  # the sum, or the gathering, of one rank's buffer
        return Pending()
