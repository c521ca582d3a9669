"""One rank raises inside ``zero.gathered(writeback=True)`` while the others write back: the job must end at
once (mpi4py aborts on the uncaught exception), not wait in a collective the raising rank never joins.

Run: mpiexec -n N python -m mpi4py tests/torch_bridge/torch_gathered_raise.py STAGE
"""

import sys

import torch
from mpi4py import MPI
from torch_models import make

import mpizero
from mpizero.torch import shard

torch.set_num_threads(1)
comm = MPI.COMM_WORLD
zero = shard(make("mlp"), mpizero.SGD(lr=0.1), comm=comm, stage=int(sys.argv[1]), watchdog=600)
with zero.gathered(writeback=True), torch.no_grad():
    zero.model[0].weight.add_(1.0)
    if comm.rank == comm.size - 1:
        raise KeyError("only the last rank raises inside gathered()")
print("left gathered()", flush=True)
