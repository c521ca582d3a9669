"""The engine with every rank in one pytest session: bitwise, padding, stage 3 gathering, agreed errors.

Run: mpiexec -n N python -m pytest --with-mpi -m mpi tests/launch/mpi_pytest (any N).
"""

import hashlib

import numpy as np
import pytest
from mpi4py import MPI

from mpizero import STAGES, Adam, Reference, ZeroEngine, ZeroError, split_evenly
from mpizero.comm.collectives import Collectives

pytestmark = pytest.mark.mpi

SHAPES = {"w": (17,), "v": (257,), "b": (1,)}  # at N > 1 the 1-element group leaves ranks 1.. only padding
GROUPS = [["w"], ["v"], ["b"]]
MICRO_BATCHES = 5  # uneven over 2, 3 and 4 ranks


def initial_params():
    rng = np.random.default_rng(0)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}


def micro_batch_grads(step, m):
    rng = np.random.default_rng([step, m])
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}


def train(comm, stage, steps=3):
    """Train an engine on ``comm`` and the reference on the same global batches; return both."""
    params, optimizer = initial_params(), Adam(lr=1e-2)
    engine = ZeroEngine(params, optimizer, comm=comm, stage=stage, groups=GROUPS)
    reference = Reference(params, optimizer)
    mine = split_evenly(MICRO_BATCHES, comm.Get_size(), comm.Get_rank())
    for step in range(1, steps + 1):
        batches = [micro_batch_grads(step, m) for m in range(MICRO_BATCHES)]
        engine.step([batches[m] for m in mine])
        reference.step(batches)
    return engine, reference


def digest(params):
    return hashlib.sha256(b"".join(np.ascontiguousarray(v).tobytes() for v in params.values())).hexdigest()


@pytest.mark.parametrize("stage", STAGES)
def test_master_params_equal_reference_bytes(comm, stage):
    engine, reference = train(comm, stage)
    master = engine.master_params()
    assert list(master) == list(SHAPES)
    for name, value in reference.params.items():
        assert master[name].tobytes() == value.tobytes(), (stage, name)


@pytest.mark.mpi(min_size=2)
def test_awkward_sizes_leave_some_rank_only_padding(comm):
    engine, _ = train(comm, 2, steps=1)
    lone = engine.groups[GROUPS.index(["b"])].partition
    assert [lone.data_range(r)[1] - lone.data_range(r)[0] for r in range(comm.Get_size())][1:] == [0] * (
        comm.Get_size() - 1
    )
    assert engine.groups[0].partition.padding == -17 % comm.Get_size()


def test_stage_3_gathered_is_the_reference_and_freed_after(comm):
    engine, reference = train(comm, 3)
    with engine.gathered() as full:
        in_place = engine.groups[0].node_params is not None  # one host: read in place, nothing gathered
        assert (engine.memory()["gathered"] > 0) != in_place
        for name, value in reference.params.items():
            assert np.asarray(full[name]).tobytes() == value.tobytes(), name
    assert engine.memory()["gathered"] == 0


def test_master_params_identical_on_every_rank(comm):
    engine, _ = train(comm, 3, steps=2)
    assert len(set(engine.collectives.allgather_object(digest(engine.master_params()), "digests"))) == 1


def test_result_does_not_depend_on_world_size(comm):
    alone, _ = train(MPI.COMM_SELF, 2)
    together, _ = train(comm, 2)
    assert digest(alone.master_params()) == digest(together.master_params())


def agreed_message(collectives, call) -> str:
    """Run ``call``, expect a ZeroError, and check every rank got the same message."""
    with pytest.raises(ZeroError) as caught:
        call()
    messages = collectives.allgather_object(str(caught.value), "error messages")
    assert len(set(messages)) == 1, messages
    return messages[0]


def test_bad_gradient_shape_on_last_rank_fails_the_same_on_every_rank(comm):
    engine = ZeroEngine(initial_params(), Adam(lr=1e-2), comm=comm, groups=GROUPS)
    last = comm.Get_size() - 1
    grads = micro_batch_grads(1, 0)
    if comm.Get_rank() == last:
        grads["v"] = np.zeros(256, np.float32)
    message = agreed_message(engine.collectives, lambda: engine.step(grads))
    assert f"rank {last}" in message and "'v'" in message and "expected float32[257]" in message


def test_nonfinite_gradient_on_one_rank_fails_the_same_on_every_rank(comm):
    engine = ZeroEngine(initial_params(), Adam(lr=1e-2), comm=comm, stage=3, groups=GROUPS)
    last = comm.Get_size() - 1
    grads = micro_batch_grads(1, 0)
    if comm.Get_rank() == last:
        grads["w"][3] = np.inf
    message = agreed_message(engine.collectives, lambda: engine.step(grads))
    assert "non-finite" in message and f"ranks [{last}]" in message
    engine.step(micro_batch_grads(1, 0))  # still usable afterwards


@pytest.mark.mpi(min_size=2)
def test_ranks_disagreeing_on_the_stage_fail_the_same_on_every_rank(comm):
    stage = 1 + (comm.Get_rank() == 0)
    collectives = Collectives(comm)
    message = agreed_message(collectives, lambda: ZeroEngine(initial_params(), Adam(lr=1e-2), comm=comm, stage=stage))
    assert "ranks disagree on the settings" in message
