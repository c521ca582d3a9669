"""Bad input gets the same clear error on every rank, and odd-but-valid input just works.

Run: mpiexec -n N python -m mpi4py tests/mpi/check_robustness.py
"""

import numpy as np
from mpi4py import MPI

from mpizero import SGD, Adam, Reference, ZeroEngine, ZeroError
from mpizero.core.precision import PRECISIONS
from mpizero.training.mlp import MLP, regression_batch
from mpizero.training.trainer import Trainer

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()


def expect_error(fn, *fragments):
    try:
        fn()
    except ZeroError as error:
        assert all(f in str(error) for f in fragments), (fragments, str(error))
        return
    raise AssertionError(f"expected ZeroError containing {fragments}")


# Bad models and settings: the same error everywhere, before any data collective.
expect_error(lambda: ZeroEngine({}, SGD(lr=0.1), comm=comm), "params must be a non-empty dict")
expect_error(lambda: ZeroEngine({"w": np.zeros((0, 3), np.float32)}, SGD(lr=0.1), comm=comm), "'w' has no elements")
expect_error(lambda: ZeroEngine({"w": np.zeros(4)}, SGD(lr=0.1), comm=comm), "'w' must be float32, got float64")
expect_error(lambda: ZeroEngine({"w": [1.0, 2.0]}, SGD(lr=0.1), comm=comm), "'w' must be float32, got list")
for bad in (dict(stage=5), dict(reduction="fast"), dict(clip_norm=-1.0), dict(watchdog=0.0)):
    try:
        ZeroEngine({"w": np.zeros(4, np.float32)}, SGD(lr=0.1), comm=comm, **bad)
    except ValueError as error:
        assert str(list(bad.values())[0]) in str(error) or repr(list(bad.values())[0]) in str(error), error
    else:
        raise AssertionError(f"{bad} accepted")

# Gradients of the wrong dtype on one rank.
engine = ZeroEngine({"w": np.ones(5, np.float32)}, SGD(lr=0.1), comm=comm)
grads = {"w": np.ones(5, np.float64 if rank == size - 1 else np.float32)}
expect_error(lambda: engine.step(grads), f"rank {size - 1}", "'w' is float64[5], expected float32[5]")
expect_error(lambda: engine.step({"w": "nope"}), "'w' is a str, not an array")

# Fewer elements than ranks, non-contiguous and read-only arrays: all fine, and bitwise.
base = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
params = {"tiny": np.array([0.5, -1.5, 2.0], np.float32), "strided": base[:, ::2]}
params["strided"].flags.writeable = False
engine = ZeroEngine(params, Adam(lr=0.1), comm=comm, stage=3)
reference = Reference(params, Adam(lr=0.1))
for step in range(3):
    g = {"tiny": np.full(3, 0.25 * (step + 1), np.float32), "strided": (base[:, 1::2] * (step - 1))}
    g["strided"].flags.writeable = False
    engine.step([g] if rank == 0 else [])
    reference.step([g])
for name, value in engine.master_params().items():
    assert value.tobytes() == reference.params[name].tobytes(), name

# A micro-batch that fails to load on one rank stops every rank with the same error.
model = MLP((5, 7, 3))
engine = ZeroEngine(model.init(0), SGD(lr=0.1), comm=comm, stage=3)
trainer = Trainer(model, engine, PRECISIONS["fp32"])


def load(m):
    if m == 0:
        raise OSError("disk unplugged")
    return regression_batch(model.widths, 0, 1, m, 2)


expect_error(lambda: trainer.step(load, size), "loading data", "rank 0: micro-batch failed to load: OSError")
trainer.step(lambda m: regression_batch(model.widths, 0, 1, m, 2), size)  # and it can go on

if rank == 0:
    print("robustness ok")
