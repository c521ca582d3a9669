"""A save that runs out of disk names the OS error on every rank and leaves no partial checkpoint behind.

Run: mpiexec -n N python -m mpi4py tests/checkpoint/full_disk.py DIR
DIR is a disk with room for one save of this engine (about 40 KiB) and not two: the engine saves at step 2, then
at step 4; rank 0 prints the second save's agreed error (``refused: ...``) and what DIR holds after it, but the
run's hidden lock file. (``train`` refuses such a run before its first step; a disk that others fill meanwhile
is met here, at the save.)
"""

import os
import sys

import numpy as np
from checkpoint_reads import SHAPES, engine_at
from mpi4py import MPI

from mpizero.checkpoint import store

rank = MPI.COMM_WORLD.Get_rank()


def save_twice(directory: str) -> None:
    engine = engine_at(1, seed=1)
    outcome = "saved twice"
    for step in (2, 4):
        rng = np.random.default_rng([step, rank])
        engine.step([{name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}])
        training = {"step": step, "optimizer_steps": step, "skipped_steps": 0, "loss_scale": None, "data": {}}
        try:
            store.save(engine, directory, training, keep=2)
        except store.CheckpointError as error:
            outcome = f"refused: {error}"
    if rank == 0:
        print(outcome, flush=True)
        print("holds", sorted(name for name in os.listdir(directory) if not name.startswith(".")), flush=True)


if __name__ == "__main__":
    save_twice(sys.argv[1])
