"""A collective in flight: what ``Collectives`` hands back, completed by ``wait``."""

from __future__ import annotations


class Pending:
    """A nonblocking collective in flight; ``wait`` completes it (and copies staged data back)."""

    def __init__(self, request=None, finish=None, keep=(), staged: int = 0) -> None:
        self.request, self.finish, self.keep = request, finish, keep  # keep: buffers MPI still reads
        self.staged = staged  # bytes copied between device and host to move it, both ways
        self.op, self.watchdog, self.traffic = "", None, None

    def wait(self) -> None:
        if self.request is not None:
            with self.watchdog.waiting(self.op), self.traffic.timed(self.op):
                self.request.Wait()
            self.request = None
        if self.finish is not None:
            self.finish()
            self.finish = None
        self.keep = ()
