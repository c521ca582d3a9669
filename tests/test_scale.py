"""Per-rank costs that must not grow with the number of ranks."""

import re

import pytest
from mpirun import run_mpi_ok

TRAIN = ["-m", "mpizero", "train", "--model", "transformer", "--stage", "3", "--steps", "2"]
TRAIN += ["--global-batch", "16", "--micro-batches", "8", "--log-every", "100"]


def agreement_bytes(n: int) -> int:
    out = run_mpi_ok(n, TRAIN, timeout=180)
    line = next(line for line in out.splitlines() if line.startswith("sent per step:"))
    value, unit = re.search(r"agreement ([\d.]+) (B|KiB)", line).groups()
    return round(float(value) * (1024 if unit == "KiB" else 1))


@pytest.fixture(scope="module")
def agreement():
    return {n: agreement_bytes(n) for n in (2, 8)}


def test_agreement_bytes_per_step_do_not_grow_with_the_number_of_ranks(agreement):
    assert 0 < agreement[8] <= 1.5 * agreement[2], agreement
