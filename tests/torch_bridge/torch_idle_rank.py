"""A rank with no micro-batch in a step, inside ``join()``, at stages 2 and 3.

Run: mpiexec -n N python -m mpi4py tests/torch_bridge/torch_idle_rank.py

3 global micro-batches a step: at 4 ranks the last has none and only takes part in the others' reductions
and gathers from ``join()``. Prints ``digest STAGE HEX`` of the final masters (rank 0) after 3 steps, so runs at
different world sizes can be compared.
"""

import hashlib

import torch
from mpi4py import MPI

import mpizero
from mpizero.torch import shard

torch.set_num_threads(1)
comm = MPI.COMM_WORLD
MICRO_BATCHES, STEPS = 3, 3

for stage in (2, 3):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    zero = shard(model, optimizer, stage=stage)
    mine = mpizero.split_evenly(MICRO_BATCHES, comm.size, comm.rank)
    for step in range(STEPS):
        with zero.join():
            for index in mine:
                x = torch.randn(8, 3, generator=torch.Generator().manual_seed(100 * step + index))
                model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    masters = zero.master_params()
    if comm.rank == 0:
        sha = hashlib.sha256(b"".join(masters[name].tobytes() for name in sorted(masters)))
        print(f"digest {stage} {sha.hexdigest()}", flush=True)
