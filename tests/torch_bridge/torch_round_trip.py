"""A stage-3 torch model through every way its state moves, byte for byte: step(closure), gathered(writeback=True),
zero.save/zero.load and the steps after, zero.load_state_dict. launch/gpu_check.sh runs it on a GPU (cuda), on the
stand-in (cpu with MPIZERO_STANDIN=1) or on the CPU.

Run: mpiexec -n N python -m mpi4py tests/torch_bridge/torch_round_trip.py DEVICE DIRECTORY
"""

import sys

import torch
from mpi4py import MPI

from mpizero.torch import shard

device, directory = sys.argv[1], sys.argv[2]
comm = MPI.COMM_WORLD
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.GELU(), torch.nn.Linear(33, 5)).to(device)
zero = shard(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=3, comm=comm)


def batch(step: int, micro: int):
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1000 * step + 10 * micro + comm.rank)).to(device)
    return x, x[:, :5]


def train(steps: range) -> None:
    """Two backward passes a step (the first step holds them), then ``step()``."""
    for step in steps:
        for micro in range(2):
            x, y = batch(step, micro)
            out = model(x)
            assert out.device.type == device, f"the forward ran on {out.device}, not {device}"
            torch.nn.functional.mse_loss(out, y).backward()
        zero.step()
        zero.zero_grad()


def train_with_closure(step: int) -> None:
    def closure():
        for micro in range(2):
            x, y = batch(step, micro)
            torch.nn.functional.mse_loss(model(x), y).backward()

    zero.step(closure)


def full_bytes() -> dict[str, bytes]:
    return {name: t.numpy().tobytes() for name, t in zero.state_dict(all_ranks=True).items()}


train(range(2))
before = full_bytes()
train_with_closure(2)
after_closure = full_bytes()
assert after_closure != before, "step(closure) changed nothing"
with zero.gathered(writeback=True), torch.no_grad():
    model[0].weight.mul_(0.5)  # the same edit on every rank
halved = (torch.frombuffer(bytearray(after_closure["0.weight"]), dtype=torch.float32) * 0.5).numpy().tobytes()
assert full_bytes() == {**after_closure, "0.weight": halved}, "gathered(writeback=True) did not write the edit back"
saved, saved_dict = full_bytes(), zero.state_dict(all_ranks=True)
zero.save(directory)
train(range(3, 5))
continued = full_bytes()
assert continued != saved, "two more steps changed nothing: the round trips below could not fail"
zero.load(directory)
assert full_bytes() == saved, "zero.load gave other bytes than were saved"
train(range(3, 5))
assert full_bytes() == continued, "the two steps after zero.load gave other bytes than the two after the save"
zero.load_state_dict(saved_dict)
assert full_bytes() == saved, "zero.load_state_dict gave other bytes than state_dict() had"
if comm.rank == 0:
    print(
        f"round trip on {device}, stage 3, -n {comm.size}: step(closure), gathered(writeback=True), save/load, "
        "the steps after, load_state_dict: same bytes"
    )
