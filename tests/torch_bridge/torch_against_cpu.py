"""mpizero.torch on DEVICE, one line per parameter dtype and stage: ``digest DTYPE STAGE HEX`` of the masters and
the optimizer state. launch/gpu_check.sh and
tests/device/test_against_cpu.py compare the lines of a run on cuda (or the stand-in: cpu with MPIZERO_STANDIN=1)
with those of a run on the CPU.

The model only multiplies and adds tensors of one shape (no matrix product, no sum over a batch), and its loss's
gradient is ``2 * out``: each operation rounds once, by IEEE rules, on any device, so its gradients are the same
bits on CUDA as on the CPU, and a difference is mpizero's. (The torch users' models, torch_users.py, use matrix
products, which CUDA sums in another order than the CPU.)

Run: mpiexec -n N python -m mpi4py tests/torch_bridge/torch_against_cpu.py DEVICE
"""

import hashlib
import sys

import torch
from mpi4py import MPI

import mpizero
from mpizero.core.precision import PRECISIONS
from mpizero.torch import shard

device, comm = sys.argv[1], MPI.COMM_WORLD
torch.manual_seed(0)  # the same random state on every rank, as mpizero.torch checks
WIDTH, MICRO_BATCHES = 17, 5


class Scale(torch.nn.Module):
    """``x * weight + bias``, element by element."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(WIDTH, generator=generator))
        self.bias = torch.nn.Parameter(torch.randn(WIDTH, generator=generator))

    def forward(self, x):
        return x * self.weight + self.bias


def micro_batch(step: int, m: int):
    return torch.randn(WIDTH, generator=torch.Generator().manual_seed(100 * step + m)).to(device)


def backward(model, step: int) -> None:
    for m in mpizero.split_evenly(MICRO_BATCHES, comm.size, comm.rank):
        out = model(micro_batch(step, m))
        (out * out).sum().backward()


def digest(zero) -> str:
    h = hashlib.blake2b(digest_size=8)
    for values in zero.master_params().values():
        h.update(values.tobytes())
    for _, state in sorted(zero.optimizer_state_dict()["state"].items()):
        for _, tensor in sorted(state.items()):
            h.update(tensor.detach().cpu().numpy().tobytes())
    return h.hexdigest()


for dtype in (PRECISIONS[name].param_dtype for name in ("fp32", "fp16", "bf16")):
    for stage in range(4):
        model = torch.nn.Sequential(Scale(1), Scale(2), Scale(3)).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        zero = shard(model, optimizer, stage=stage, comm=comm, param_dtype=dtype.name)
        for step in range(2):  # a plain loop (ranks make uneven passes: join), then step(closure)
            with zero.join():
                backward(model, step)
            zero.step()
            zero.zero_grad()
        zero.step(lambda model=model: backward(model, 2))
        line = f"digest {dtype.name} {stage} {digest(zero)}"
        if comm.rank == 0:
            print(line, flush=True)
