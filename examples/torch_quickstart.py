# Run: mpiexec -n 4 python examples/torch_quickstart.py   (or plain `python examples/torch_quickstart.py`)
import torch
from mpi4py import MPI

import mpizero
from mpizero.torch import shard

comm = MPI.COMM_WORLD
torch.manual_seed(0)  # same seed on every rank: identical initial parameters
model = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
zero = shard(model, mpizero.AdamW(lr=0.02, weight_decay=0.0), stage=3)  # comm defaults to COMM_WORLD

true_w = torch.tensor([[2.0], [-1.0], [0.5]])
for step in range(300):
    for micro in range(2):  # this rank's micro-batches: one backward = one contribution
        data = torch.Generator().manual_seed(1000 * step + 10 * comm.rank + micro)
        x = torch.randn(32, 3, generator=data)
        loss = torch.nn.functional.mse_loss(model(x), x @ true_w + 0.3)
        loss.backward()
    zero.step()  # the mean over every contribution of every rank; update; publish
    zero.zero_grad()

with torch.no_grad():
    probe = model(torch.eye(3)) - model(torch.zeros(1, 3))  # stage 3 gathers each layer for its forward
if comm.rank == 0:
    print("slopes", probe.ravel().numpy().round(1), "loss below 0.01:", loss.item() < 0.01)
    print("bytes held by rank 0:", zero.memory())
