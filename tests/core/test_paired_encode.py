"""The paired encode (two contributions in one pass over the int64 sum) gives the bytes of one encode each.

``tests/core/paired_digests.py`` hands the same gradient streams in as copies (encoded on arrival), as arrays given
up (paired), through ``step(list)`` (paired) and round by round (rounds paired) at stages 0-3; every run must end on
the digest the code gave before the paired encode existed (5ee64b8), at every world size.
"""

import json

import pytest
from mpirun import WORLD_SIZES, run_mpi_ok

BEFORE_PAIRING = "8130d26b3ce927f0971931b68e3e103e"


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_paired_and_single_encodes_give_the_digest_of_before(n):
    digests = json.loads(run_mpi_ok(n, ["-m", "mpi4py", "tests/core/paired_digests.py"], timeout=180))
    assert len(digests) == 18 and set(digests.values()) == {BEFORE_PAIRING}, digests


def test_rounds_paired_off_shared_memory_travel_alike_on_every_rank():
    """Off the shared arena a round of one contribution crosses as float32 and a pair as int64: the choice follows
    the rounds, alike on every rank, not what each rank hands in (a rank with fewer contributions hands in None)."""
    env = {"MPIZERO_REDUCE_SCATTER": "mpi"}
    digests = json.loads(run_mpi_ok(3, ["-m", "mpi4py", "tests/core/paired_digests.py"], timeout=180, env=env))
    assert len(digests) == 18 and set(digests.values()) == {BEFORE_PAIRING}, digests
