"""A key that one rank changes after set-up is still agreed where it is used: at each save and each load.

Run: mpiexec -n 2 python tests/core/key_at_use.py save|load DIR
Both ranks build an engine with no key; then rank 1 sets MPIZERO_CHECKPOINT_KEY. ``save`` saves into DIR;
``load`` loads the newest checkpoint in DIR (saved without a key). Rank 0 prints ``refused: ...`` or ``done``.
"""

import os
import sys

import numpy as np
from mpi4py import MPI

from mpizero import SGD, ZeroEngine, ZeroError
from mpizero.checkpoint import store
from mpizero.checkpoint.catalog import resolve
from mpizero.checkpoint_key import KEY_VARIABLE

comm = MPI.COMM_WORLD
action, directory = sys.argv[1], sys.argv[2]
engine = ZeroEngine({"w": np.ones(5, np.float32)}, SGD(lr=0.1), comm=comm, stage=1, watchdog=30.0)
training = {"step": 1, "optimizer_steps": 1, "skipped_steps": 0, "loss_scale": None, "data": {}}
if action == "load":
    store.save(engine, directory, training)
if comm.Get_rank() == 1:
    os.environ[KEY_VARIABLE] = "only rank 1 has this key"
try:
    if action == "save":
        store.save(engine, directory, {**training, "step": 2})
    else:
        store.load(engine, resolve(directory)[0])
    outcome = "done"
except ZeroError as error:
    outcome = f"refused: {error}"
if comm.Get_rank() == 0:
    print(outcome, flush=True)
