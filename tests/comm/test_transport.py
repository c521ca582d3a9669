"""How buffers travel (comm/transports/) under real mpiexec at 1-4 ranks, with a stand-in device array."""

import pytest
from mpirun import WORLD_SIZES, run_mpi_ok


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_staging_paths_give_host_mpi_bytes_and_one_rank_moves_nothing(n):
    assert "transport checks ok" in run_mpi_ok(n, ["-m", "mpi4py", "tests/comm/check_transport.py"])
