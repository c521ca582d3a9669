"""The README's and the docs' example scripts are the files the tests run, and they train to the right answer."""

import pytest
from docblocks import named
from mpirun import ROOT, WORLD_SIZES, run_mpi_ok


def test_readme_shows_exactly_the_quickstart_script():
    block = named("quickstart")
    assert block == (ROOT / "examples" / "quickstart.py").read_text()
    assert len(block.splitlines()) <= 22


@pytest.mark.parametrize(("kind", "name"), [("NumPy", "quickstart"), ("PyTorch", "torch-quickstart")])
def test_readme_headings_count_the_example_lines(kind, name):
    lines = len(named(name).splitlines())
    assert f"## A {kind} model in {lines} lines\n" in (ROOT / "README.md").read_text()


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_quickstart_trains_at_any_world_size(n):
    out = run_mpi_ok(n, ["examples/quickstart.py"])
    assert "w [ 2.  -1.   0.5] b [0.3]" in out
    shard_bytes = 4 * -(-4 // n)  # stage 3: rank 0 keeps only its shard of the 4 float32 parameters
    assert f"'params': {shard_bytes}," in out


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_accumulate_example_trains_at_any_world_size(n):
    out = run_mpi_ok(n, ["examples/accumulate.py"])
    assert "w [ 2.  -1.   0.5] b [0.3]" in out


def test_ruff_is_clean():
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "mpizero", "tests", "examples", "benchmarks"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
