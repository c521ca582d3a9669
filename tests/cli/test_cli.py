"""``python -m mpizero example``, ``verify`` and ``train`` as a user runs them."""

import re

import pytest
from mpirun import ROOT, WORLD_SIZES, run_mpi, run_mpi_ok, run_python

# The worked example's printed numbers (shared/reference/zero-worked-example.txt).
AVERAGED = "Averaged gradients: [ 0.035 -0.025  0.045  0.03  -0.025  0.035 -0.025  0.025]"
UPDATED = "full updated params: [ 0.0965 -0.2975  0.4955  0.197  -0.0975  0.3965 -0.1975  0.2975]"
EXPECTED = "Expected (naive full-param update): [ 0.0965 -0.2975  0.4955  0.197  -0.0975  0.3965 -0.1975  0.2975]"
SHARDS_AT_4 = [
    "Rank 0 owns params [0, 1]: grad_shard = [ 0.035 -0.025]",
    "Rank 1 owns params [2, 3]: grad_shard = [0.045 0.03 ]",
    "Rank 2 owns params [4, 5]: grad_shard = [-0.025  0.035]",
    "Rank 3 owns params [6, 7]: grad_shard = [-0.025  0.025]",
    "Rank 0: updated shard = [ 0.0965 -0.2975]",
    "Rank 1: updated shard = [0.4955 0.197 ]",
    "Rank 2: updated shard = [-0.0975  0.3965]",
    "Rank 3: updated shard = [-0.1975  0.2975]",
]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_example_prints_the_reference_numbers(n):
    out = run_mpi_ok(n, ["-m", "mpizero", "example"])
    for line in (AVERAGED, UPDATED, EXPECTED, "Results match: True"):
        assert line in out
    if n == 4:
        assert all(line in out for line in SHARDS_AT_4)
    if n == 3:
        assert "8 parameters padded to 9" in out and "Rank 2 owns params [6, 7] + 1 padding" in out


@pytest.mark.parametrize("stage", [1, 3])
def test_example_other_stages(stage):
    out = run_mpi_ok(3, ["-m", "mpizero", "example", "--stage", str(stage)])
    assert f"ZeRO Stage {stage}" in out and UPDATED in out and "Results match: True" in out


@pytest.mark.parametrize(
    "n, optimizer",
    [(n, "adam") for n in WORLD_SIZES]
    + [(n, o) for n in (2, 3) for o in ("sgd", "adamw")]
    + [(3, "lion"), (4, "lion"), (2, "muon"), (4, "muon")],
)
def test_verify_is_bitwise_at_every_stage(n, optimizer):
    """At 3 ranks with Adam on every reduce-scatter path this host can take (``--paths all``): node-shared, then
    pieces and one MPI call a buffer, whose stage 2-3 rounds travel as float32 and are widened by their owner."""
    every_path = (n, optimizer) == (3, "adam")
    paths = ["--paths", "all"] if every_path else []
    out = run_mpi_ok(n, ["-m", "mpizero", "verify", "--optimizer", optimizer, "--micro-batches", "5", *paths])
    lines = [line for line in out.splitlines() if line.startswith("stage ")]
    vias = ["", "  reduce-scatter pieces", "  reduce-scatter mpi"] if every_path else [""]
    assert len(lines) == 4 * len(vias), out
    for (stage, via), line in zip([(s, v) for s in range(4) for v in vias], lines):
        assert line.startswith(f"stage {stage}{via}  ranks {n}"), line
        assert ": bitwise; optimizer semantics within" in line, line
        assert "reduction exact" in line and "held/rank" in line and "sent/step" in line


def test_verify_names_the_first_mismatch_when_a_shard_is_perturbed():
    done = run_mpi(3, ["-m", "mpizero", "verify", "--stage", "2", "--perturb-rank", "1"])
    assert done.returncode == 1
    # in float32 the master shard is this rank's block of the params, the first buffer compared
    assert "MISMATCH at step 1 on rank 1: params" in done.stdout
    assert "engine" in done.stdout and "!= reference" in done.stdout


def test_verify_native_reports_a_tolerance_never_bitwise():
    out = run_mpi_ok(4, ["-m", "mpizero", "verify", "--reduction", "native", "--stage", "2"])
    assert "within tolerance" in out and "not bitwise" in out and ": bitwise" not in out


def test_bad_cli_value_is_rejected_by_argparse():
    done = run_mpi(2, ["-m", "mpizero", "verify", "--stage", "5"])
    assert done.returncode == 2 and "invalid choice: '5'" in done.stderr


@pytest.mark.parametrize(
    "setting", ["shared", "pieces", "mpi"], ids=["shared", "pieces", "one-call"]
)  # "mpi" would be read as pytest-mpi's marker
def test_verify_is_bitwise_with_either_reduce_scatter(setting):
    out = run_mpi_ok(3, ["-m", "mpizero", "verify", "--steps", "3"], env={"MPIZERO_REDUCE_SCATTER": setting})
    assert out.count(": bitwise") == 4, out


def test_train_default_micro_batches_work_at_more_than_four_ranks():
    out = run_mpi_ok(5, ["-m", "mpizero", "train", "--steps", "1", "--log-every", "1"], timeout=180)
    assert "5 ranks" in out and "held-out accuracy" in out


def test_train_finds_its_data_from_a_directory_holding_another_mpizero(tmp_path):
    """A folder named mpizero without ``__init__.py`` in the working directory cannot shadow the package.

    ``python -m`` puts the working directory first on ``sys.path``, but a folder without
    ``__init__.py`` is only a namespace-package candidate: Python keeps looking and the real
    package wins; the data are then found through that package's resources, not the working
    directory. (A folder *with* ``__init__.py`` is a package and shadows any import of that name.)
    """
    (tmp_path / "mpizero" / "training" / "data").mkdir(parents=True)
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = run_python(["-m", "mpizero", "train", "--steps", "1", "--log-every", "1"], env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "held-out accuracy" in done.stdout


@pytest.mark.parametrize("args, redone", [([], "2"), (["--micro-batches", "3,120", "--scale-headroom", "0"], "3")])
def test_verify_redoes_a_step_whose_micro_batches_jump_and_stays_bitwise(args, redone):
    """By default step 2 has one micro-batch and step 3 four per rank: step 3's scale prediction misses and it is
    redone (as is step 1, which has none); a list cycles the counts, here 40-fold up and down."""
    out = run_mpi_ok(2, ["-m", "mpizero", "verify", "--stage", "2", "--steps", "4", *args])
    assert f"redone {redone}  " in out and ": bitwise; optimizer semantics within" in out, out


def test_verify_is_bitwise_when_most_elements_go_beyond_the_predicted_cap():
    """No headroom: most steps hold elements beyond the cap and add them at a coarser scale; every step is exact,
    and none is redone but the first (it measures)."""
    out = run_mpi_ok(3, ["-m", "mpizero", "verify", "--steps", "5", "--micro-batches", "7", "--scale-headroom", "0"])
    lines = [line for line in out.splitlines() if line.startswith("stage ")]
    assert len(lines) == 4 and all(": bitwise; optimizer semantics within" in line for line in lines), out
    counts = [re.search(r"redone (\d+)  kept (\d+):", line).groups() for line in lines]
    assert all(redone == "1" and int(kept) >= 1 for redone, kept in counts), counts  # the kept path ran
