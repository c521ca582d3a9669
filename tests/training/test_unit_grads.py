"""The layer-wise trainer lets go of each unit's gradients as soon as they are handed in."""

import weakref

from mpi4py import MPI

from mpizero import AdamW, ZeroEngine
from mpizero.core.precision import PRECISIONS
from mpizero.training.datasets import Digits
from mpizero.training.mlp import MLP
from mpizero.training.trainer import Trainer, make_groups


def test_a_units_gradients_are_gone_before_the_next_units_backward_at_stage_3():
    """Else two units' full-size weight gradients peak together (the CLI's stage-3 RSS, issue 38 pt 6). The native
    reduction keeps no elements beyond a predicted range, so nothing but the trainer could hold them."""
    model, digits = MLP((64, 24, 24, 10), objective="xent"), Digits.load()
    groups = make_groups(model, 3, bucket_elems=700)
    engine = ZeroEngine(model.init(7), AdamW(lr=1e-2), comm=MPI.COMM_WORLD, groups=groups, stage=3, reduction="native")
    trainer = Trainer(model, engine, PRECISIONS["fp32"])
    produced, alive = [], []

    class Watched:
        """A unit whose backward counts the earlier units' gradients still alive, then notes its own."""

        def __init__(self, unit) -> None:
            self.unit = unit

        def __getattr__(self, name: str):
            return getattr(self.unit, name)

        def backward(self, dout, cache, params):
            alive.append(sum(ref() is not None for ref in produced))
            dout, grads = self.unit.backward(dout, cache, params)
            produced.extend(weakref.ref(g) for g in grads.values())
            return dout, grads

    trainer.units = [Watched(unit) for unit in trainer.units]
    for step in (1, 2):
        trainer.step(lambda m, step=step: digits.micro_batch(1, step, m, 6, 2), 2)
    assert len(alive) == 2 * 2 * len(trainer.units)  # every unit's backward, each micro-batch and step
    assert alive == [0] * len(alive), "an earlier unit's gradients were still alive at a backward"
