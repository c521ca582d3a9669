"""Rank 1 raises in the middle of stage 3's forward at step 2; the whole job must end in seconds.

Run: mpiexec -n N python -m mpi4py tests/launch/raise_in_forward.py
"""

from dataclasses import dataclass

from mpi4py import MPI

from mpizero import Adam, ZeroEngine
from mpizero.core.precision import PRECISIONS
from mpizero.training.model import unit_names
from mpizero.training.trainer import Trainer
from mpizero.training.transformer import Transformer

comm = MPI.COMM_WORLD
base = Transformer(vocab=11, block_size=8, width=16, heads=2, n_layer=3)
state = {"step": 0}


@dataclass(frozen=True)
class Failing:
    unit: object

    def param_shapes(self):
        return self.unit.param_shapes()

    def forward(self, x, params):
        if comm.Get_rank() == 1 and state["step"] == 2:
            raise ValueError("boom on rank 1 inside block h1")
        return self.unit.forward(x, params)

    def backward(self, dout, cache, params):
        return self.unit.backward(dout, cache, params)


@dataclass(frozen=True)
class Model:
    def init(self, seed):
        return base.init(seed)

    @property
    def units(self):
        units = base.units
        units[2] = Failing(units[2])
        return units

    def loss(self, out, target):
        return base.loss(out, target)


model = Model()
engine = ZeroEngine(model.init(0), Adam(lr=1e-3), comm=comm, stage=3, groups=unit_names(model))
trainer = Trainer(model, engine, PRECISIONS["fp32"])
import numpy as np  # noqa: E402

for step in range(1, 4):
    state["step"] = step
    tokens = np.random.default_rng(step).integers(0, 11, size=(2, 9))
    trainer.step(lambda m, t=tokens: (t[:, :-1], t[:, 1:]), comm.Get_size())
