# Run: mpiexec -n 4 python examples/torch_quickstart.py   (or plain `python examples/torch_quickstart.py`)
import torch
from mpi4py import MPI

import mpizero
from mpizero.progress import progress
from mpizero.torch import shard

comm = MPI.COMM_WORLD
torch.manual_seed(0)  # same seed on every rank: identical initial parameters
model = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
zero = shard(model, mpizero.AdamW(lr=0.02, weight_decay=0.0), stage=3)  # comm defaults to COMM_WORLD
true_w = torch.tensor([[2.0], [-1.0], [0.5]])

for step in progress(range(300), "torch_quickstart", show=comm.rank == 0):  # a line on stderr every 5 s
    x = torch.randn(64, 3, generator=torch.Generator().manual_seed(1000 * step + comm.rank))  # this rank's batch
    loss = torch.nn.functional.mse_loss(model(x), x @ true_w + 0.3)
    loss.backward()  # one backward = one contribution
    zero.step()  # the mean over every contribution of every rank; update; publish
    zero.zero_grad()

probe = model(torch.eye(3)) - model(torch.zeros(1, 3))  # stage 3 gathers each layer for its forward
if comm.rank == 0:
    print("slopes", probe.detach().ravel().numpy().round(1), "loss below 0.01:", loss.item() < 0.01)
