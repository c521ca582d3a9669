"""A process that makes many engines, one after another: they share one notice of this rank's end, an engine
freed leaves no watchdog thread polling behind it, and its node-shared windows are freed when the next engine
is set up (collectively, once it is gone on every rank), not kept until exit.

Run: mpiexec -n N python -m mpi4py tests/launch/many_engines.py (rank 0 prints every rank's line)
"""

import gc
import threading
import time

import numpy as np
from mpi4py import MPI

import mpizero
from mpizero.comm import windows
from mpizero.comm.job.departures import for_ranks
from mpizero.comm.job.ranks import world_ranks

ENGINES = 20
comm = MPI.COMM_WORLD
ranks = world_ranks(comm)


def watchdog_threads() -> int:
    return sum(thread.name == "mpizero-watchdog" for thread in threading.enumerate())


for _ in range(ENGINES):
    engine = mpizero.ZeroEngine({"w": np.ones(8, np.float32)}, mpizero.SGD(lr=0.1), comm=comm, stage=2)
    for _ in range(2):  # the second step streams (the first has no scale yet): on one host, into node-shared sums
        engine.reduce_round(0, {"w": np.full(8, 0.5, np.float32)})
        engine.start_reduce(0)
        engine.finish_step()
    running, per_engine = watchdog_threads(), len(windows.held(ranks))
    del engine
gc.collect()
deadline = time.monotonic() + 30
while watchdog_threads() and time.monotonic() < deadline:
    time.sleep(0.1)
copy = comm.Dup()
shared = for_ranks(comm) is for_ranks(copy)
after, left = watchdog_threads(), len(windows.held(ranks))
line = (
    f"rank {comm.rank}: watched while an engine lived {running > 0}, threads after {after}; shared {shared}; "
    f"windows {per_engine} per engine, {left} left"
)
lines = comm.gather(line)
if comm.rank == 0:
    print("\n".join(lines))
copy.Free()
