"""Fixtures for tests that every rank of ``mpiexec -n N python -m pytest --with-mpi -m mpi`` runs together.

Plain ``python -m pytest`` skips them, saying how to run them;
``tests/launch/test_mpi_pytest_sessions.py`` launches them at 1-4 ranks.
"""

import os
from pathlib import Path

import pytest

RUN_UNDER_MPIEXEC = "run under mpiexec: mpiexec -n N python -m pytest --with-mpi -m mpi tests/launch/mpi_pytest"
DELIBERATE_FAILURES = "MPIZERO_DELIBERATE_FAILURES"  # set to collect failing/, whose tests fail on purpose

collect_ignore = [] if os.environ.get(DELIBERATE_FAILURES) == "1" else ["failing"]


@pytest.hookimpl(tryfirst=True)  # the first skip mark gives the reason; pytest-mpi's would only name the flag
def pytest_collection_modifyitems(config, items):
    if config.getoption("--with-mpi") or config.getoption("--only-mpi"):
        return
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents and item.get_closest_marker("mpi") is not None:
            item.add_marker(pytest.mark.skip(reason=RUN_UNDER_MPIEXEC))


@pytest.fixture
def comm():
    """The world communicator every rank of the session shares."""
    from mpi4py import MPI

    return MPI.COMM_WORLD
