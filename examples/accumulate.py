# Run: mpiexec -n 4 python examples/accumulate.py   (or plain `python examples/accumulate.py`)
import numpy as np
from mpi4py import MPI

import mpizero
from mpizero.progress import progress

comm = MPI.COMM_WORLD
rng = np.random.default_rng(0)  # same seed on every rank: identical initial parameters
params = {"w": rng.standard_normal((3, 1)).astype(np.float32), "b": np.zeros(1, np.float32)}
engine = mpizero.ZeroEngine(params, mpizero.Adam(lr=0.05), comm=comm, stage=3)

true_w = np.array([[2.0], [-1.0], [0.5]], dtype=np.float32)
for step in progress(range(300), "accumulate", show=comm.rank == 0):  # a line on stderr every 5 s
    redo = True
    while redo:  # rarely (always on the first step) the scale must be measured first: the same batches again
        for micro in range(2):  # this rank's micro-batches: each folded in as soon as computed, then dropped
            data = np.random.default_rng([step, comm.rank, micro])
            x = data.standard_normal((16, 3)).astype(np.float32)
            y = x @ true_w + 0.3
            with engine.gathered() as p:  # full parameters; at stage 3 gathered here, freed after
                err = x @ p["w"] + p["b"] - y
            engine.accumulate({"w": 2 * x.T @ err / len(x), "b": 2 * err.mean(axis=0)})  # local grads in
        redo = engine.step().redo  # the mean over every micro-batch of every rank; update; publish

with engine.gathered() as p:
    if comm.rank == 0:
        print("w", p["w"].ravel().round(2), "b", p["b"].round(2))
if comm.rank == 0:
    print("bytes held by rank 0:", engine.memory())
