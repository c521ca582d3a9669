"""The engine under real mpiexec at 1-4 ranks: bitwise, memory, agreed errors, staging."""

import pytest
from mpirun import WORLD_SIZES, run_mpi_ok

CHECKS = ["-m", "mpi4py", "tests/core/check_engine.py"]


@pytest.fixture(scope="module")
def digests():
    return {n: run_mpi_ok(n, CHECKS, env={"MPIZERO_CUDA_AWARE": "0"}) for n in WORLD_SIZES}


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_engine_checks_pass(digests, n):
    assert digests[n].startswith("digest ")


def test_same_global_batch_gives_identical_bytes_at_every_world_size(digests):
    assert len(set(digests.values())) == 1, digests
