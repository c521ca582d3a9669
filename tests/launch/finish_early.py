"""Ranks that finish, or hang, while others wait in a collective: the waiting ranks end the job in seconds.

Run: mpiexec -n N python tests/launch/finish_early.py MODE   (N >= 2; plain python, not -m mpi4py)
``exit``, ``finalize``, ``raise``: rank 1 leaves the training loop after step 1 (the program ends, it calls
MPI_Finalize, or it raises); the others enter step 2 and wait for it, with a 600 s watchdog.
``staggered``: every rank trains 2 steps and finishes normally, rank 0 five seconds after the others: exit 0.
``slow``: rank 1 takes 60 s to compute what the ranks agree at set-up, while the others wait (2 s watchdog).
"""

import sys
import time

import numpy as np
from mpi4py import MPI

from mpizero import SGD, ZeroEngine
from mpizero.comm.job import identity

comm = MPI.COMM_WORLD
rank, mode = comm.Get_rank(), sys.argv[1]
if mode == "slow" and rank == 1:
    fields = identity.fields
    identity.fields = lambda: time.sleep(60) or fields()
watchdog = 2.0 if mode == "slow" else 600.0
engine = ZeroEngine({"w": np.ones(40, np.float32)}, SGD(lr=0.1), comm=comm, stage=2, watchdog=watchdog)
for step in (1, 2):
    engine.step({"w": np.full(40, step, np.float32)})
    if rank == 1 and step == 1 and mode == "finalize":
        MPI.Finalize()
        sys.exit(0)
    if rank == 1 and step == 1 and mode == "exit":
        sys.exit(0)
    if rank == 1 and step == 1 and mode == "raise":
        raise RuntimeError("rank 1 stops here")
if rank == 0:
    time.sleep(5)  # staggered: the others finish first, and wait at exit for rank 0
    print("finished", flush=True)
