# Run: mpiexec -n 4 python examples/quickstart.py   (or plain `python examples/quickstart.py`)
import numpy as np
from mpi4py import MPI

import mpizero
from mpizero.progress import progress

comm = MPI.COMM_WORLD
rng = np.random.default_rng(0)  # same seed on every rank: identical initial parameters
params = {"w": rng.standard_normal((3, 1)).astype(np.float32), "b": np.zeros(1, np.float32)}
engine = mpizero.ZeroEngine(params, mpizero.Adam(lr=0.05), comm=comm, stage=3)
true_w = np.array([[2.0], [-1.0], [0.5]], dtype=np.float32)

for step in progress(range(300), "quickstart", show=comm.rank == 0):  # a line on stderr every 5 s
    x = np.random.default_rng([step, comm.rank]).standard_normal((32, 3)).astype(np.float32)  # this rank's batch
    with engine.gathered() as p:  # the full parameters: at stage 3 gathered here and freed after
        err = x @ p["w"] + p["b"] - (x @ true_w + 0.3)
    engine.step({"w": 2 * x.T @ err / len(x), "b": 2 * err.mean(axis=0)})  # mean over ranks; update; publish

with engine.gathered() as p:
    if comm.rank == 0:
        print("w", p["w"].ravel().round(2), "b", p["b"].round(2), "bytes held by rank 0:", engine.memory())
