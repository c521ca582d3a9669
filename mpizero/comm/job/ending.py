"""Ending the whole job from one rank, whatever its main thread is blocked in.

``MPI_Abort`` asks the launcher to end every rank of the job; it is the path
an exception takes too. A rank that only exited would rely on the launcher
noticing the exit, and ``mpiexec`` did not, twice in some hundred runs, leaving
the other ranks waiting. Should the abort itself not end this process within
``ABORT_SECONDS`` (its main thread holding MPI, say), the process exits anyway.
"""

from __future__ import annotations

import os
import threading

from mpi4py import MPI

ABORT_SECONDS = 5.0


def end_job(status: int) -> None:
    """End every rank of the job with exit ``status`` (from any thread); never returns."""
    fallback = threading.Timer(ABORT_SECONDS, os._exit, (status,))
    fallback.daemon = True
    fallback.start()
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.COMM_WORLD.Abort(status)
    os._exit(status)
