"""``mpizero.testing`` on every rank: a faithful engine passes, a one-ulp change on one rank is named everywhere.

Run: mpiexec -n N python -m pytest --with-mpi -m mpi tests/launch/mpi_pytest (any N).
"""

import numpy as np
import pytest

from mpizero import SGD, Reference, ZeroEngine
from mpizero.testing import assert_bitwise_equal, bitwise_mismatch

pytestmark = pytest.mark.mpi

INITIAL = {"w": np.linspace(-1, 1, 17, dtype=np.float32), "b": np.float32([0.5])}


def one_step(comm, stage):
    """One SGD step on the engine and the reference, every rank contributing its own gradients."""
    rank, size = comm.Get_rank(), comm.Get_size()
    grads = [{n: np.full_like(v, 0.25 * (r + 1)) for n, v in INITIAL.items()} for r in range(size)]
    engine = ZeroEngine(INITIAL, SGD(lr=0.1), comm=comm, stage=stage, groups=[["w"], ["b"]])
    reference = Reference(INITIAL, SGD(lr=0.1))
    engine.step(grads[rank])
    reference.step(grads)
    return engine, reference


@pytest.mark.parametrize("stage", [0, 3])
def test_faithful_engine_passes(comm, stage):
    engine, reference = one_step(comm, stage)
    assert bitwise_mismatch(engine, reference) is None
    assert_bitwise_equal(engine, reference)


@pytest.mark.parametrize("stage", [0, 2])
def test_one_ulp_on_the_last_rank_is_reported_the_same_on_every_rank(comm, stage):
    engine, reference = one_step(comm, stage)
    last = comm.Get_size() - 1
    group = engine.groups[0]
    start = group.partition.shard_range(last)[0]  # the last rank's first owned element of "w"
    if comm.Get_rank() == last:
        shard = group.master_shard
        at = start - group.owned_range[0]
        shard[at] = np.nextafter(shard[at], np.float32(np.inf))
    message = bitwise_mismatch(engine, reference)
    assert message is not None and f"'w'[{start}]" in message and "1 of 17 elements differ" in message
    assert len(set(engine.collectives.allgather_object(message, "messages"))) == 1
    with pytest.raises(AssertionError) as caught:
        assert_bitwise_equal(engine, reference)
    assert str(caught.value) == message
