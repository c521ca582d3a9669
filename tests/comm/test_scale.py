"""Per-rank costs that must not grow with the number of ranks."""

import json
import pickle
import re
import subprocess
import sys

import pytest
from mpirun import ROOT, run_mpi_ok

from mpizero.checkpoint import scale, shards
from mpizero.core import formulas
from mpizero.training.model import param_shapes
from mpizero.training.registry import Size, entry
from mpizero.training.trainer import DEFAULT_BUCKET_ELEMS, make_groups

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


def measured_rows(n: int, clip: str, rounds: int = 1) -> list[dict]:
    args = ["benchmarks/bench_scale.py", "--worker", "--clip", clip, "--rounds", str(rounds)]
    out = run_mpi_ok(n, args, timeout=180)
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("n, rounds", [(2, 1), (8, 1), (2, 3)])
def test_calls_and_agreement_bytes_per_step_equal_the_formulas(n, rounds):
    """With 3 rounds, stages 2-3 reduce-scatter once per round: 3 times the calls and the bytes."""
    rows = measured_rows(n, "0", rounds)  # without clipping every payload has a fixed size
    assert [row["stage"] for row in rows] == [1, 2, 3]
    for row in rows:
        # set-up: digests and flags (fill's problems and the initial master digest among them) and the salt the
        # checkpoint key is compared by, whatever N; stage 1 on one host also checks /dev/shm's room once per group;
        # where an engine before left node-shared windows, one more agrees which of them are orphaned on every rank;
        # stage 3 on one host agrees once for all groups whether its params can be read in place (no rank has an
        # address-space limit, /dev/shm has room, the blocks lie one after another: ``Collectives.node_params``)
        room_checks = row["groups"] if row["stage"] == 1 else 0
        orphans = 1 if row["earlier_windows"] else 0
        in_place = 3 if row["stage"] == 3 else 0
        assert row["setup_calls"] == {"agreement": 9 + room_checks + orphans + in_place}, row
        assert row["calls"] == row["formula_calls"], row
        assert row["sent"]["agreement"] == row["received"]["agreement"] == row["formula_agreement"], row
        assert {op: row["sent"][op] for op in row["formula_sent"]} == row["formula_sent"], row


def test_clipping_adds_two_agreement_calls_and_at_most_the_norms_bytes():
    for row in measured_rows(8, "1"):
        assert row["calls"] == row["formula_calls"], row
        assert row["calls"]["agreement"] == 4 + row["groups"], row  # flag, one per group, max, sum, losses
        short = row["formula_agreement"] - row["sent"]["agreement"]
        assert 0 <= short <= formulas.NORM_SUM_BYTES - len(pickle.dumps(0)), row


def test_one_save_and_a_reshard_equal_what_the_checkpoint_code_predicts(tmp_path):
    """``scale.one_save`` against a real save at 3 ranks and its load at 2: files, rank 0's file, the manifest's
    size (but for the run's settings), and the bytes rank 0 read, exactly."""
    save = [*TRAIN[:6], "2", "--steps", "1", "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "1"]
    run_mpi_ok(3, save)
    (saved,) = tmp_path.glob("ckpt-*")
    log = run_mpi_ok(2, [*TRAIN[:6], "2", "--steps", "2", "--resume", str(saved)])
    read = int(re.search(r"rank 0 read ([\d,]+) bytes of rank files", log)[1].replace(",", ""))
    model = entry("transformer", Size()).build(entry("transformer", Size()).load())
    groups = [list(g) for g in make_groups(model, 2, DEFAULT_BUCKET_ELEMS)]
    predicted = scale.one_save(param_shapes(model), groups, ["master", "exp_avg", "exp_avg_sq"], 3, 2)
    assert predicted["files"] == len(list(saved.iterdir())) == 4
    assert predicted["rank file"] == (saved / "rank00000.bin").stat().st_size
    assert 0 < (saved / "manifest.json").stat().st_size - predicted["manifest"] < 2048
    assert predicted["reshard reads"] == read
    assert predicted["reshard needs"] < read < predicted["reshard needs"] + 3 * 2 * shards.BLOCK_BYTES * len(groups)


def estimate(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "mpizero", "estimate", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_estimate_scale_prints_stages_1_to_3_and_the_exact_sums_headroom():
    done = estimate("--model", "transformer", "--ranks", "4096", "--micro-batches", "32768", "--scale")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    rows = [
        line.split() for line in lines[[n for n, line in enumerate(lines) if line.startswith("stage  groups")][0] + 1 :]
    ]
    assert [row[0] for row in rows[:3]] == ["1", "2", "3"]
    assert "4,097" in rows[0]  # one file per rank, and the manifest
    assert "take 15 of the int64 sum's 62 bits, leaving 47" in done.stdout


def test_estimate_scale_needs_a_model():
    done = estimate("--params", "7.5e9", "--ranks", "64", "--scale")
    assert done.returncode == 2
    assert done.stderr.strip().endswith(
        "--scale needs --model NAME: the groups and tensors it counts come from the model"
    )
