"""A hang watchdog: if a collective waits too long, or for a rank that has finished, say so and end the job.

Each rank watches its own waits, from a thread that runs whatever the main
thread is blocked in. When one collective has waited ``seconds``, the rank
prints ``rank R: waited S s in OP (CONTEXT)`` and ends the job with status 3
(``ending``); the other ranks print their own lines if they were waiting too.
The time limit is off unless ``seconds`` is set.

A wait that has lasted ``GRACE`` seconds while another rank is known to have
finished (``departures``) can never end: it ends the job at once, naming that
rank. The grace lets a collective the finished rank took part in complete
here. Waits while this rank's own program is ending (exit-time clean-up) are
left to the time limit; the thread then hands on this rank's own notice.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import weakref

from mpi4py import MPI

from mpizero.comm.job.departures import Departures, for_ranks
from mpizero.comm.job.ending import end_job

EXIT_STATUS = 3
GRACE = 2.0
FINISHED_HINT = (
    "a collective call only this rank made must be made on every rank, not under `if rank == 0:` (saving, "
    "save_pretrained, state_dict(), an evaluation at stage 3), and every rank must run the same steps"
)
POLL = 0.25


class Watchdog:
    """Ends the process when a wait inside ``waiting`` outlasts ``seconds``, or waits for a finished rank."""

    def __init__(self, seconds: float | None, comm: MPI.Comm) -> None:
        """Watch this rank's waits on ``comm`` (collective: it sets up the notices of finished ranks)."""
        self.seconds, self.rank = seconds, comm.Get_rank()
        self.context = "set-up"
        self._current: tuple[str, float] | None = None
        self.departures: Departures | None = None
        if seconds is not None or comm.Get_size() > 1:
            pause = POLL if seconds is None else min(POLL, seconds / 4)
            watch = threading.Thread(target=_watch, args=(weakref.ref(self), pause), name="mpizero-watchdog")
            watch.daemon = True
            watch.start()
        with self.waiting("set-up: a communicator for notices of finished ranks"):
            self.departures = for_ranks(comm)

    @contextlib.contextmanager
    def waiting(self, op: str):
        """Mark the enclosed block as waiting in collective ``op``."""
        self._current = (op, time.monotonic())
        try:
            yield
        finally:
            self._current = None

    def look(self, program: threading.Thread, heard_at: float | None) -> float | None:
        """One look at the wait in progress (from the watchdog's thread): end the job if it waited too long, or
        for a rank that finished. ``heard_at``: when a finished rank was first heard of; returned, updated."""
        departures, current, now = self.departures, self._current, time.monotonic()
        if departures is not None and not program.is_alive():  # exit-time clean-up may wait: tell others first
            departures.leave()
        if current is None:
            return heard_at
        if self.seconds is not None and now - current[1] > self.seconds:
            self._end(f"waited {now - current[1]:.1f} s in {current[0]} ({self.context})")
        finished = departures.finished() if departures is not None and program.is_alive() else []
        heard_at = heard_at or (now if finished else None)
        if finished and now - max(current[1], heard_at) > GRACE:
            who = f"rank {finished[0]}" if len(finished) == 1 else f"ranks {finished}"
            self._end(
                f"{who} finished (exited or called MPI_Finalize) while this rank waits in {current[0]} ({self.context})"
                f"; {FINISHED_HINT}"
            )
        return heard_at

    def _end(self, why: str) -> None:
        print(f"mpizero watchdog: rank {self.rank}: {why}; ending the job", file=sys.stderr, flush=True)
        if self.departures is not None:
            self.departures.leave()  # the next rank hears of it at once, whatever the launcher does
        end_job(EXIT_STATUS)


class WeakWatchdog:
    """A watchdog held without keeping it alive, by what outlives its engine until exit (shared-memory arenas,
    freed then): waits are watched while the watchdog lives, and not after, so its thread can end with it."""

    def __init__(self, watchdog: Watchdog) -> None:
        self._ref = weakref.ref(watchdog)

    @property
    def alive(self) -> bool:
        """Whether the watchdog (and so its engine) still exists."""
        return self._ref() is not None

    def waiting(self, op: str):
        """The watchdog's ``waiting(op)`` while it lives; nothing after."""
        watchdog = self._ref()
        return contextlib.nullcontext() if watchdog is None else watchdog.waiting(op)


def _watch(ref: weakref.ref, pause: float) -> None:
    """The watchdog's thread: a look every ``pause`` seconds, until the watchdog is gone with its engine, so that a
    process that made many engines does not keep a thread polling for each."""
    program, heard_at = threading.main_thread(), None
    while True:
        time.sleep(pause)
        watchdog = ref()
        if watchdog is None:
            return
        heard_at = watchdog.look(program, heard_at)
        del watchdog  # held only while it looks
