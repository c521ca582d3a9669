"""Fails on purpose: the last rank cannot import this module while the others run its test and wait.

Collected only with MPIZERO_DELIBERATE_FAILURES=1; see tests/launch/test_mpi_pytest_sessions.py.
"""

import pytest
from mpi4py import MPI

from mpizero.comm.collectives import Collectives

if MPI.COMM_WORLD.Get_rank() == MPI.COMM_WORLD.Get_size() - 1:
    raise ImportError("deliberate import failure on the last rank")


@pytest.mark.mpi(min_size=2)
def test_the_others_wait_for_the_last_rank(comm):
    Collectives(comm).barrier("the deliberate import failure")
