"""Loading a checkpoint reads only the blocks holding what a rank owns, and resharding from them is exact."""

import re

import pytest
from mpirun import run_mpi_ok

SCRIPT = ["-m", "mpi4py", "tests/checkpoint/checkpoint_reads.py"]


def digest_in(out: str) -> str:
    (digest,) = re.findall(r"^digest (\w+)$", out, re.MULTILINE)
    return digest


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of 4 ranks at stage 3, with 512-byte digest blocks, and its master digest."""
    directory = tmp_path_factory.mktemp("reads")
    return directory, digest_in(run_mpi_ok(4, [*SCRIPT, "save", str(directory)]))


@pytest.mark.parametrize("n, stage", [(1, 0), (2, 3), (3, 1), (4, 2), (3, 0)])
def test_each_rank_reads_the_blocks_it_owns_and_loads_the_saved_state(saved, n, stage):
    directory, digest = saved
    out = run_mpi_ok(n, [*SCRIPT, "load", str(directory), str(stage)])
    assert digest_in(out) == digest
    reads = [tuple(map(int, found)) for found in re.findall(r"^rank \d+ read (\d+) of (\d+)$", out, re.MULTILINE)]
    assert len(reads) == n
    for read, total in reads:
        if stage == 0:  # every rank updates, so loads, everything: all of it, and the digest tables
            assert read > total
        else:  # its shard: about 1/n of the checkpoint (the script bounds it by the blocks of each run)
            assert read < total * 1.5 / n + 4096, (read, total, n)


def test_a_file_that_no_rank_reads_is_still_checked(tmp_path):
    """The last of 4 ranks owns only padding: its file is empty, read by no load, and checked by rank 0."""
    run_mpi_ok(4, [*SCRIPT, "padding", "save", str(tmp_path)])
    assert run_mpi_ok(2, [*SCRIPT, "padding", "load", str(tmp_path)]).strip() == "loaded"
    (checkpoint,) = tmp_path.glob("ckpt-*")
    (checkpoint / "rank00003.bin").write_bytes(b"tampered")
    out = run_mpi_ok(2, [*SCRIPT, "padding", "load", str(tmp_path)])
    assert "refused: cannot load checkpoint: rank 0: " in out and "rank00003.bin: 8 bytes" in out, out
