"""Notices that a rank has finished, so ranks left waiting in a collective for it end at once.

A rank whose program ends (its main thread returns, it raises without
``python -m mpi4py``, or it calls ``MPI_Finalize``) can never join another
collective. When it finishes it sends one small notice to the next rank of the
communicator (``rank + 1``, wrapping), naming itself and every finished rank it
had heard of; so the first rank still running after any run of finished ranks
knows them, and at any world size each rank sends one message. The watchdog
(``watchdog``) reads the notice while its rank waits.

The notice travels on a duplicate of the communicator, so it never meets the
program's own messages. A rank finishes once, whatever number of engines it
made: one ``Departures`` serves every communicator over the same ranks
(``for_ranks``), so a process with a hundred engines sends one notice per
group of ranks at exit, not a hundred in turn. It needs
``MPI_THREAD_MULTIPLE`` (mpi4py's default): the watchdog's thread sends and
receives it while the main thread may be blocked inside MPI. Otherwise, and on
one rank, there is nothing to do.
"""

from __future__ import annotations

import atexit
import json
import threading

from mpi4py import MPI

from mpizero.comm.job.ranks import world_ranks

TAG = 7
NOTICE_BYTES = 256  # a JSON list of the first finished ranks
SHOWN = 8  # finished ranks a notice names at most
SEND_SECONDS = 1.0  # how long a finishing rank tries to hand its notice over


_BY_RANKS: dict[tuple[int, ...], Departures] = {}


def for_ranks(comm: MPI.Comm) -> Departures:
    """The notices of ``comm``'s ranks: made (collectively) at the first call for these ranks in this order, then
    shared; every rank of ``comm`` makes the same calls, so all make it or none does."""
    ranks = world_ranks(comm)
    if ranks not in _BY_RANKS:
        _BY_RANKS[ranks] = Departures(comm)
    return _BY_RANKS[ranks]


class Departures:
    """The finished ranks this rank has heard of, and its own notice when it finishes."""

    def __init__(self, comm: MPI.Comm) -> None:
        """Duplicate ``comm`` (collective) and start listening to the previous rank."""
        self.rank, size = comm.Get_rank(), comm.Get_size()
        self.active = size > 1 and MPI.Query_thread() == MPI.THREAD_MULTIPLE
        self.comm = comm.Dup() if size > 1 else None  # on every rank alike: Dup is collective
        self.heard: list[int] = []
        self._lock, self._closed = threading.Lock(), not self.active
        if self.active:
            self.comm.Set_errhandler(MPI.ERRORS_RETURN)  # a rank that is gone must not end this one's exit
            self._next, self._previous = (self.rank + 1) % size, (self.rank - 1) % size
            self._buffer = bytearray(NOTICE_BYTES)
            self._request = self.comm.Irecv(self._buffer, source=self._previous, tag=TAG)
            _at_finalize(self)

    def finished(self) -> list[int]:
        """The ranks known to have finished (empty while none is); from the watchdog's thread."""
        with self._lock:
            if not self._closed and not self.heard and self._request.Test():
                self.heard = json.loads(bytes(self._buffer).rstrip(b"\0"))
        return self.heard

    def leave(self) -> None:
        """Tell the next rank that this one has finished (once); stop listening."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._request.Test():
                self.heard = json.loads(bytes(self._buffer).rstrip(b"\0"))
            else:
                self._request.Cancel()
                self._request.Wait()
            notice = json.dumps([*self.heard, self.rank][:SHOWN]).encode()
            _send_briefly(self.comm, notice, self._next)


def _send_briefly(comm: MPI.Comm, notice: bytes, dest: int) -> None:
    """Send ``notice`` to ``dest``, giving up after ``SEND_SECONDS`` (it may have finished and gone)."""
    try:
        request = comm.Isend(notice, dest=dest, tag=TAG)
        deadline = MPI.Wtime() + SEND_SECONDS
        while not request.Test():
            if MPI.Wtime() > deadline:
                request.Cancel()
                request.Wait()
                return
    except MPI.Exception:
        return


_LEAVING: list[Departures] = []


def _at_finalize(departures: Departures) -> None:
    """Send ``departures``' notice when the interpreter exits, or first thing in an explicit ``MPI_Finalize``
    (which frees ``MPI_COMM_SELF``, and so its attributes, before anything else)."""
    if not _LEAVING:
        atexit.register(_leave_all)
        MPI.COMM_SELF.Set_attr(MPI.Comm.Create_keyval(delete_fn=_leave_all), None)
    _LEAVING.append(departures)


def _leave_all(*_) -> int:
    for departures in _LEAVING:
        departures.leave()
    return MPI.SUCCESS
