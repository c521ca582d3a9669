"""A process that makes many engines, one after another: they share one notice of this rank's end, and an engine
freed leaves no watchdog thread polling behind it.

Run: mpiexec -n N python -m mpi4py tests/mpi/many_engines.py (rank 0 prints every rank's line)
"""

import gc
import threading
import time

import numpy as np
from mpi4py import MPI

import mpizero
from mpizero.comm.departures import for_ranks

ENGINES = 20
comm = MPI.COMM_WORLD


def watchdog_threads() -> int:
    return sum(thread.name == "mpizero-watchdog" for thread in threading.enumerate())


for _ in range(ENGINES):
    engine = mpizero.ZeroEngine({"w": np.ones(8, np.float32)}, mpizero.SGD(lr=0.1), comm=comm, stage=1)
    engine.step({"w": np.full(8, 0.5, np.float32)})
    running = watchdog_threads()
    del engine
gc.collect()
deadline = time.monotonic() + 30
while watchdog_threads() and time.monotonic() < deadline:
    time.sleep(0.1)
copy = comm.Dup()
shared = for_ranks(comm) is for_ranks(copy)
after = watchdog_threads()
line = f"rank {comm.rank}: watched while an engine lived {running > 0}, threads after {after}; shared {shared}"
lines = comm.gather(line)
if comm.rank == 0:
    print("\n".join(lines))
copy.Free()
