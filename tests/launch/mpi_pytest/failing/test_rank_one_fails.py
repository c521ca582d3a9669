"""Fails on purpose: rank 1 fails an assert while the others wait in a barrier it never enters.

Collected only with MPIZERO_DELIBERATE_FAILURES=1; tests/launch/test_mpi_pytest_sessions.py checks
that the job ends quickly with the failure printed instead of hanging.
"""

import pytest

from mpizero.comm.collectives import Collectives

pytestmark = pytest.mark.mpi(min_size=2)


def test_rank_one_fails_while_the_others_wait(comm):
    collectives = Collectives(comm)
    assert comm.Get_rank() != 1, "deliberate failure on rank 1"
    collectives.barrier("the deliberate failure")
