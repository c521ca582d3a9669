"""The pytest sessions in tests/launch/mpi_pytest, every rank in the session, launched under mpiexec at 1-4 ranks.

Each session runs as ``mpiexec -n N python -m pytest --with-mpi -m mpi ...`` with a
timeout, as a cluster user would run it; the deliberate failure in
``tests/launch/mpi_pytest/failing`` shows that one failing rank ends the job.
"""

import re
import subprocess
import sys
import time

import pytest
from docblocks import named
from mpirun import ROOT, WORLD_SIZES, run_mpi

SESSION = ["-m", "pytest", "--with-mpi", "-m", "mpi", "-q", "-p", "no:cacheprovider"]
SESSION_DIR = "tests/launch/mpi_pytest"
ENV = {"MPIZERO_CUDA_AWARE": "0"}


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_every_rank_runs_the_session_and_rank_0_reports(n):
    done = run_mpi(n, [*SESSION, SESSION_DIR], timeout=120, env=ENV)
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    summaries = re.findall(r"(\d+) passed", done.stdout)
    assert len(summaries) == 1, f"expected one summary (rank 0's), got {summaries}"
    assert int(summaries[0]) >= 10, done.stdout
    assert "failed" not in done.stdout


@pytest.mark.parametrize(
    ("module", "printed"),
    [
        (
            "test_rank_one_fails.py",
            ["rank 1 of 3: tests/launch/mpi_pytest/failing/", "failed in call", "deliberate failure"],
        ),
        ("test_import_fails_on_last_rank.py", ["rank 2 of 3: tests/launch/mpi_pytest/failing/", "failed to collect"]),
    ],
)
def test_a_failure_on_one_rank_ends_every_rank_quickly(module, printed):
    start = time.monotonic()
    env = {**ENV, "MPIZERO_DELIBERATE_FAILURES": "1"}
    done = run_mpi(3, [*SESSION, f"{SESSION_DIR}/failing/{module}"], timeout=60, env=env)
    elapsed = time.monotonic() - start
    assert done.returncode != 0, done.stdout
    assert elapsed < 30, f"the job took {elapsed:.1f} s to end"
    for text in printed:
        assert text in done.stderr, done.stderr


def test_plain_pytest_skips_them_and_says_how_to_run_them():
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", SESSION_DIR]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout
    assert "passed" not in done.stdout and re.search(r"\d+ skipped", done.stdout), done.stdout
    assert "run under mpiexec: mpiexec -n N python -m pytest --with-mpi -m mpi tests/launch/mpi_pytest" in done.stdout
    assert "failing" not in done.stdout, "the deliberate failures must stay out of normal collection"


def test_readme_testing_example_runs_as_shown(tmp_path):
    (tmp_path / "conftest.py").write_text(named("testing-conftest"))
    (tmp_path / "test_my_engine.py").write_text(named("testing-example"))
    done = run_mpi(3, [*SESSION, str(tmp_path)], timeout=120, env=ENV)
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert re.findall(r"(\d+) passed", done.stdout) == ["1"], done.stdout
