"""A hang watchdog: if a collective waits too long, say which one, where, and end the job.

Each rank watches its own waits. When one collective has waited ``seconds``,
the rank prints ``rank R: waited S s in OP (CONTEXT)`` and exits with status 3;
``mpiexec`` then ends the other ranks, which print their own lines if they
were waiting too. Off unless ``seconds`` is set.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

EXIT_STATUS = 3


class Watchdog:
    """Ends the process when a wait inside ``waiting`` outlasts ``seconds``."""

    def __init__(self, seconds: float | None, rank: int) -> None:
        self.seconds, self.rank = seconds, rank
        self.context = "set-up"
        self._current: tuple[str, float] | None = None
        if seconds is not None:
            threading.Thread(target=self._watch, name="mpizero-watchdog", daemon=True).start()

    @contextlib.contextmanager
    def waiting(self, op: str):
        """Mark the enclosed block as waiting in collective ``op``."""
        self._current = (op, time.monotonic())
        try:
            yield
        finally:
            self._current = None

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.seconds / 4))
            current = self._current
            if current is not None and time.monotonic() - current[1] > self.seconds:
                op, since = current
                print(
                    f"mpizero watchdog: rank {self.rank}: waited {time.monotonic() - since:.1f} s in {op} "
                    f"({self.context}); ending the job",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(EXIT_STATUS)
