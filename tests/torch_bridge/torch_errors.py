"""mpizero.torch's errors are the engine's agreed errors.

Run: mpiexec -n N python -m mpi4py tests/torch_bridge/torch_errors.py

Prints ``torch errors ok`` when every case raised the expected error on every rank.
"""

import torch
from mpi4py import MPI
from torch_models import batch, loss, make

import mpizero
from mpizero.core.step import StepOrderError
from mpizero.torch import shard

torch.set_num_threads(1)
comm = MPI.COMM_WORLD


def expect(error_type, fragment, fn):
    try:
        fn()
    except error_type as error:
        assert fragment in str(error), (fragment, str(error))
        return
    raise AssertionError(f"expected {error_type.__name__} containing {fragment!r}")


def different_initial_values():
    shard(make("mlp", seed=comm.rank if comm.size > 1 else 0), mpizero.SGD(lr=0.1), comm=comm)
    if comm.size == 1:
        raise mpizero.ZeroError("the initial parameter values differ (one rank: nothing to differ)")


def different_models():
    model = make("mlp") if comm.rank == 0 else torch.nn.Sequential(torch.nn.Linear(7, 3))
    shard(model, mpizero.SGD(lr=0.1), comm=comm)
    if comm.size == 1:
        raise mpizero.ZeroError("the parameter count differs (one rank: nothing to differ)")


class WithSpare(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp, self.spare = make("mlp"), torch.nn.Linear(2, 2)  # spare is never called: it gets no gradient

    def forward(self, x):
        return self.mlp(x)


def unused_parameter():
    model = WithSpare()
    zero = shard(model, mpizero.SGD(lr=0.1), comm=comm, stage=3)
    x, y = batch("mlp", 0, comm.rank)
    loss("mlp", model(x), y).backward()
    zero.step()


def step_without_backward():
    zero = shard(make("mlp"), mpizero.SGD(lr=0.1), comm=comm, stage=2)
    zero.step()


def zero_grad_mid_reduction():
    model = make("mlp")
    zero = shard(model, mpizero.SGD(lr=0.1), comm=comm, stage=2)
    zero.last_backward()
    x, y = batch("mlp", 0, comm.rank)
    loss("mlp", model(x), y).backward()
    expect(StepOrderError, "call step() first", zero.zero_grad)
    zero.step()


expect(mpizero.ZeroError, "initial parameter values", different_initial_values)
expect(mpizero.ZeroError, "parameter count", different_models)
expect(mpizero.ZeroError, "no gradient for 'spare.weight'", unused_parameter)
expect(mpizero.ZeroError, "no rank handed in any gradients", step_without_backward)
zero_grad_mid_reduction()
print("torch errors ok" if comm.rank == 0 else "", flush=True)
