"""Engines built from a ShardedInit under real mpiexec at 1-4 ranks: identity, agreed errors, set-up memory; and
``train``, which builds its model so."""

import json

import pytest
from mpirun import WORLD_SIZES, run_mpi_ok

CHECKS = ["-m", "mpi4py", "tests/core/check_sharded_init.py"]
MEMORY = ["-m", "mpi4py", "tests/core/setup_memory.py"]
BIG_MLP = ["--model", "mlp", "--width", "2048", "--layers", "17"]  # 67,295,242 parameters: 257 MiB of fp32
BIG_TRAIN = ["-m", "mpizero", "train", *BIG_MLP, "--stage", "3", "--steps", "1", "--global-batch", "4", "--lr", "1e-4"]
MIB = 1 << 20


@pytest.fixture(scope="module")
def outputs():
    return {n: run_mpi_ok(n, CHECKS) for n in WORLD_SIZES}


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_sharded_init_checks_pass(outputs, n):
    assert outputs[n].endswith("sharded init checks ok\n")


def test_initial_and_trained_digests_equal_at_every_world_size_and_stage(outputs):
    lines = {n: [line for line in out.splitlines() if line.startswith("stage ")] for n, out in outputs.items()}
    assert len(lines[1]) == 4
    assert all(found == lines[1] for found in lines.values()), lines
    assert len({line.split(" ", 2)[2] for line in lines[1]}) == 1  # the same values at every stage


def setup_growth(n: int, source: str) -> list[dict]:
    out = run_mpi_ok(n, [*MEMORY, source])
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_set_up_at_stage_3_holds_about_one_nth_of_the_model():
    """Peak RSS growth during set-up under a ShardedInit: what the engine holds (param shard, which is also the
    master, grad and Adam shards: 16 bytes per parameter over n), plus one tensor piece from fill; from full
    arrays, the whole model more."""
    alone, sharded, arrays = setup_growth(1, "sharded"), setup_growth(4, "sharded"), setup_growth(4, "arrays")
    model = alone[0]["model_bytes"]  # fp32 params of the whole model
    piece, slack = model / 16, 8 << 20
    for row in sharded:
        assert sum(row["engine"].values()) == 4 * model / 4, row
        assert row["growth"] < 4 * model / 4 + piece + slack, row
    # the zeroed grad and Adam shards are not resident at set-up (zeros, allocated lazily): one rank alone holds
    # the whole model's params, each of four ranks a quarter of them and one tensor piece (on one host each holds
    # its quarter twice for a moment, its shard then its block of the node-shared params, and MPI's shared memory
    # more: so four ranks' growth is near the whole model's, measured 62-68 MB against 67), saving over half the
    # model each
    assert model < alone[0]["growth"], alone
    assert max(row["growth"] for row in sharded) + model / 2 < alone[0]["growth"], (alone, sharded)
    for row in arrays:
        # the caller's whole model on top (all but the quarter the engine keeps, which the sharded rank holds too)
        assert row["growth"] > max(r["growth"] for r in sharded) + model / 2, (row, sharded)


def test_train_at_stage_3_never_holds_the_whole_model_and_matches_one_rank(tmp_path):
    """``train --stage 3`` on a 67M-parameter MLP at -n 4: each rank's peak RSS over the whole run (set-up, steps,
    evaluation, --save-params) stays within the engine's peak, plus its RSS before set-up, plus 96 MiB, well
    below the whole model's 257 MiB of fp32 params (plus the other ranks' shared sums it maps during a step,
    which its RSS counts though they are theirs); and its parameters are the bytes of -n 1's."""
    for n in (4, 1):
        outputs = ["--save-params", str(tmp_path / f"{n}.npy"), "--memory-json", str(tmp_path / f"{n}.json")]
        run_mpi_ok(n, [*BIG_TRAIN, *outputs, "--log-every", "100"], timeout=120)
    ranks = json.loads((tmp_path / "4.json").read_text())["ranks"]
    assert len(ranks) == 4
    for row in ranks:
        mine = row["rss"] - row["mapped"]
        assert mine <= row["peak_total"] + row["rss_baseline"] + 96 * MIB, {k: v / MIB for k, v in row.items()}
    assert (tmp_path / "4.npy").read_bytes() == (tmp_path / "1.npy").read_bytes()
