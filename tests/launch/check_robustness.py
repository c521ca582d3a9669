"""Bad input gets the same clear error on every rank, and odd-but-valid input just works.

Run: mpiexec -n N python -m mpi4py tests/launch/check_robustness.py
"""

import os

import numpy as np
from mpi4py import MPI

from mpizero import SGD, Adam, Reference, ZeroEngine, ZeroError
from mpizero.core.precision import PRECISIONS
from mpizero.core.step import StepOrderError
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

# Calls out of order: a clear error, and the engine stays usable.
engine = ZeroEngine(
    {"a": np.ones(3, np.float32), "b": np.ones(5, np.float32)}, SGD(lr=0.1), comm=comm, groups=[["a"], ["b"]]
)
ones = {"a": np.ones(3, np.float32), "b": np.ones(5, np.float32)}
try:
    engine.finish_step()
except StepOrderError as error:
    assert "finish_step() called with no start_reduce()" in str(error), error
else:
    raise AssertionError("finish_step before any start_reduce accepted")
engine.start_reduce(0, [ones])
try:
    engine.start_reduce(0, [ones])
except StepOrderError as error:
    assert "start_reduce(0) called twice" in str(error), error
else:
    raise AssertionError("start_reduce twice accepted")
engine.start_reduce(1, [ones])
assert not engine.finish_step().skipped

# An unknown gradient name is an error on every rank, not silently ignored.
expect_error(
    lambda: engine.step({**ones, "zzz": np.ones(2, np.float32)} if rank == 0 else ones), "unknown parameters ['zzz']"
)

# Each group keeps its own contribution count: group a averages 1 per rank, group b 2 per rank.
groups_engine = ZeroEngine(dict(ones), Adam(lr=0.1), comm=comm, groups=[["a"], ["b"]], stage=2)
ref_a, ref_b = Reference({"a": ones["a"]}, Adam(lr=0.1)), Reference({"b": ones["b"]}, Adam(lr=0.1))
ga = {"a": np.full(3, 0.5 + rank, np.float32)}
gb = [{"b": np.full(5, 0.25 * (rank + k), np.float32)} for k in (1, 2)]
groups_engine.start_reduce(0, [ga])
groups_engine.start_reduce(1, gb)
groups_engine.finish_step()
ref_a.step([{"a": np.full(3, 0.5 + r, np.float32)} for r in range(size)])
ref_b.step([{"b": np.full(5, 0.25 * (r + k), np.float32)} for r in range(size) for k in (1, 2)])
master = groups_engine.master_params()
assert master["a"].tobytes() == ref_a.params["a"].tobytes() and master["b"].tobytes() == ref_b.params["b"].tobytes()

# The native float32 sum overflowing is a non-finite result: raised, or the step skipped, on every rank.
huge = [{"w": np.full(4, 3e38, np.float32)}] * 2
native = ZeroEngine({"w": np.ones(4, np.float32)}, SGD(lr=0.1), comm=comm, reduction="native")
expect_error(lambda: native.step(huge), "non-finite averaged gradient (the float32 sum overflowed)")
native = ZeroEngine({"w": np.ones(4, np.float32)}, SGD(lr=0.1), comm=comm, reduction="native", on_nonfinite="skip")
assert native.step(huge).skipped and native.master_params()["w"].tolist() == [1.0] * 4
assert not native.step({"w": np.ones(4, np.float32)}).skipped

# Ranks whose environments ask for different communication paths are refused at set-up.
if size > 1:
    os.environ["MPIZERO_REDUCE_SCATTER"] = "mpi" if rank == 1 else "auto"
    expect_error(
        lambda: ZeroEngine({"w": np.ones(4, np.float32)}, SGD(lr=0.1), comm=comm),
        "ranks disagree on the environment's MPIZERO_REDUCE_SCATTER",
    )
    del os.environ["MPIZERO_REDUCE_SCATTER"]

# Gradients accumulated before step(list) with no scale predicted yet: held (copied) and the step taken whole; a
# caller that can hand them in again (can_redo) gets a measuring pass and redo instead. Both equal the reference.
first, second = {"w": np.full(4, 0.5 + rank, np.float32)}, {"w": np.full(4, -0.25 * rank, np.float32)}
mixed_reference = Reference({"w": np.ones(4, np.float32)}, Adam(lr=0.1))
mixed_reference.step(
    [g for r in range(size) for g in ({"w": np.full(4, 0.5 + r, np.float32)}, {"w": np.full(4, -0.25 * r, np.float32)})]
)
held = ZeroEngine({"w": np.ones(4, np.float32)}, Adam(lr=0.1), comm=comm, stage=2)
held.accumulate(first)
assert not held.step([second]).redo
redoing = ZeroEngine({"w": np.ones(4, np.float32)}, Adam(lr=0.1), comm=comm, stage=2)
redoing.accumulate(first, can_redo=True)
assert redoing.step([second]).redo  # measured only: the caller hands the step in again
redoing.accumulate(first, can_redo=True)
assert not redoing.step([second]).redo
for engine in (held, redoing):
    assert engine.master_params()["w"].tobytes() == mixed_reference.params["w"].tobytes()

# Accumulated and round-reduced gradients of one group cannot be mixed in one step: an agreed error, no data lost.
rounds = ZeroEngine({"w": np.ones(4, np.float32)}, SGD(lr=0.1), comm=comm, stage=2)
rounds.accumulate({"w": np.ones(4, np.float32)})
rounds.reduce_round(0, {"w": np.ones(4, np.float32)})
expect_error(lambda: rounds.start_reduce(0), "reduce_round(0) after accumulate for that group in the same step")

if rank == 0:
    print("robustness ok")
