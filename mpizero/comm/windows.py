"""The node-shared windows this process holds, and when they are freed.

Freeing a window is collective (``MPI_Win_free``), so a window whose engine was
dropped cannot be freed when Python collects that engine: ranks collect at
different times. So every window is listed here when made (every rank makes
the same windows in the same order), with the ranks of its engine's
communicator and a weak reference to that engine's watchdog. The next engine
set up on the same ranks agrees which windows have lost their engine on every
rank, and all free those together; before, each stayed until exit, so a
process that sharded model after model held every one's gradient sums. The
rest are freed at exit, in the order made, unless an uncaught exception is
ending the process: MPI then aborts, and a collective would wait for ranks
that never come.
"""

from __future__ import annotations

import atexit
import sys
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI


@dataclass(eq=False)
class Held:
    """One window's owner (with a collective ``free()``), its communicator's world ranks, its engine's watchdog."""

    owner: object
    ranks: tuple[int, ...]
    watchdog: object  # a ``WeakWatchdog``: not alive once its engine is gone


_HELD: list[Held] = []


def hold(owner, ranks: tuple[int, ...], watchdog) -> None:
    """List ``owner``'s window, just made on every rank of ``ranks``; ``owner.free()`` calls ``release``."""
    _HELD.append(Held(owner, ranks, watchdog))


def release(owner) -> None:
    """``owner``'s window was freed (on every rank)."""
    _HELD[:] = [entry for entry in _HELD if entry.owner is not owner]


def held(ranks: tuple[int, ...]) -> list[Held]:
    """The windows made on these ranks and not yet freed, in the order made."""
    return [entry for entry in _HELD if entry.ranks == ranks]


def free_orphans(collectives, ranks: tuple[int, ...]) -> None:
    """Free the windows on ``ranks`` whose engine is gone on every rank (collective over those ranks: one small
    agreement, none where no window is held)."""
    candidates = held(ranks)
    if not candidates:
        return
    alive = [float(entry.watchdog.alive) for entry in candidates]
    agreed = collectives.agree(np.array([0.0, *alive]))[1:]  # maxed: alive on any rank
    with collectives.watchdog.waiting("freeing the node-shared windows of engines gone on every rank"):
        for entry, alive_anywhere in zip(candidates, agreed):
            if not alive_anywhere:
                entry.owner.free()


def _free_all_at_clean_exit() -> None:
    crashed = getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None
    if not crashed and not MPI.Is_finalized():  # a program that called MPI_Finalize itself can free nothing now
        for entry in list(_HELD):
            entry.owner.free()


# Registered when this module is first imported, before any engine's notice of its end (``departures``) is:
# exit handlers run last-registered first, so a rank tells the others it has finished before it waits, unwatched,
# in these frees (unwatched where their engines are gone).
atexit.register(_free_all_at_clean_exit)
