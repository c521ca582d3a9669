"""Rank 0 never joins step 1's collectives; the others' watchdog must report and end the job.

Run: mpiexec -n N python -m mpi4py tests/launch/hang.py   (N >= 2)
"""

import time

import numpy as np
from mpi4py import MPI

from mpizero import SGD, ZeroEngine

comm = MPI.COMM_WORLD
engine = ZeroEngine({"w": np.ones(8, np.float32)}, SGD(lr=0.1), comm=comm, stage=2, watchdog=2.0)
if comm.Get_rank() == 0:
    time.sleep(120)  # diverged: busy elsewhere, never enters the step
else:
    engine.step({"w": np.ones(8, np.float32)})
