"""The worked example and the layer-wise trainer with every rank in one pytest session.

Run: mpiexec -n N python -m pytest --with-mpi -m mpi tests/launch/mpi_pytest (any N).
"""

import argparse

import numpy as np
import pytest

from mpizero import STAGES, AdamW, Reference, ZeroEngine
from mpizero.cli import example
from mpizero.core.precision import PRECISIONS
from mpizero.training.mlp import MLP, regression_batch
from mpizero.training.trainer import Trainer, make_groups, reference_step

pytestmark = pytest.mark.mpi

UPDATED = "full updated params: [ 0.0965 -0.2975  0.4955  0.197  -0.0975  0.3965 -0.1975  0.2975]"
MODEL = MLP((5, 9, 3))
MICRO_BATCHES = 3


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_worked_example_prints_the_readme_numbers(comm, capsys, stage):
    status = example.run(argparse.Namespace(stage=stage, reduction="exact"), comm)
    assert status == 0
    if comm.Get_rank() == 0:
        out = capsys.readouterr().out
        assert UPDATED in out and "Results match: True" in out


@pytest.mark.parametrize("stage", STAGES)
def test_trainer_on_a_tiny_mlp_matches_the_reference_step(comm, stage):
    precision, optimizer = PRECISIONS["fp32"], AdamW(lr=1e-2)
    groups = make_groups(MODEL, stage, bucket_elems=40)
    engine = ZeroEngine(MODEL.init(3), optimizer, comm=comm, groups=groups, stage=stage)
    trainer, reference = Trainer(MODEL, engine, precision), Reference(MODEL.init(3), optimizer)
    for step in range(1, 3):
        batches = [regression_batch(MODEL.widths, 1, step, m, 4) for m in range(MICRO_BATCHES)]
        report = trainer.step(lambda m, batches=batches: batches[m], MICRO_BATCHES)
        assert report.loss == reference_step(MODEL, reference, batches, precision, None), step
    master = engine.master_params()
    for name, value in reference.params.items():
        assert np.asarray(master[name]).tobytes() == value.tobytes(), (stage, name)
