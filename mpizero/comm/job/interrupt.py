"""Ctrl-C on any one rank ends the whole job at once, with one line, as an exception on one rank does.

Python runs a signal handler only between bytecodes of the main thread, so a
rank blocked inside an MPI call would take SIGINT only when the call returns,
and a rank that did take it would leave without ``MPI_Abort`` while the others
wait for it. Here the signal reaches a thread instead, through
``signal.set_wakeup_fd``, which ends the job at once (status 130, as a shell
reports SIGINT) through ``ending``.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from mpizero.comm.job.ending import end_job

EXIT_STATUS = 128 + signal.SIGINT


def end_job_on_interrupt(rank: int) -> None:
    """From now on, SIGINT to this process ends the job with one line naming ``rank`` (main thread only)."""
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.signal(signal.SIGINT, lambda *_: None)  # a Python handler, so that the wakeup fd is written
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    threading.Thread(target=_end_when_interrupted, args=(read, rank), name="mpizero-interrupt", daemon=True).start()


def _end_when_interrupted(read: int, rank: int) -> None:
    while signal.SIGINT not in os.read(read, 64):
        pass
    print(f"mpizero: rank {rank}: interrupted (SIGINT); ending the job", file=sys.stderr, flush=True)
    end_job(EXIT_STATUS)
