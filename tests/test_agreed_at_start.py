"""Every rank runs the same mpizero code and version, or every rank stops at start-up with one line naming
the ranks."""

import json
import shutil

from checkpoint_runs import TRAIN
from mpirun import ROOT, run_mpi


def per_rank(tmp_path, n: int, ranks: dict, *args):
    """Run ``args`` (``-m mpizero ...`` or a script) under ``tests/mpi/per_rank.py`` with ``ranks``' settings."""
    return per_rank_command(tmp_path, n, ranks, *args)()


def per_rank_command(tmp_path, n: int, ranks: dict, *args):
    """``per_rank``, to be run later (its settings file is written now)."""
    settings = tmp_path / "ranks.json"
    settings.write_text(json.dumps(ranks))
    return lambda: run_mpi(n, ["tests/mpi/per_rank.py", str(settings), *map(str, args)], timeout=120)


def one_error(done) -> str:
    errors = [line for line in done.stderr.splitlines() if line.startswith("mpizero: error:")]
    assert done.returncode == 2 and len(errors) == 1, done.stdout + done.stderr
    assert "step " not in done.stdout, done.stdout
    return errors[0]


def test_a_rank_running_changed_code_stops_every_rank_at_start_up(tmp_path):
    changed = tmp_path / "changed"
    shutil.copytree(ROOT / "mpizero", changed / "mpizero", ignore=shutil.ignore_patterns("__pycache__"))
    with open(changed / "mpizero" / "core" / "optim.py", "a") as f:
        f.write("\nBIAS_CORRECTION_OFFSET = 1  # this rank's copy differs\n")
    done = per_rank(tmp_path, 2, {"1": {"path": str(changed)}}, "-m", "mpizero", *TRAIN[2:], "--steps", 2)
    line = one_error(done)
    assert "ranks disagree on the mpizero code (ranks [1] differ from rank 0): rank 0: 'sha256 " in line


ANOTHER_VERSION = """
import sys
from mpi4py import MPI
from mpizero.comm import identity
from mpizero.cli.main import main

if MPI.COMM_WORLD.Get_rank() == 1:
    identity.version = lambda: "9.9.9"
sys.exit(main(["estimate", "--ranks", "2"]))
"""


def test_another_version_on_one_rank_stops_every_rank(tmp_path):
    script = tmp_path / "version.py"
    script.write_text(ANOTHER_VERSION)
    line = one_error(run_mpi(2, [str(script)], timeout=60))
    assert "ranks disagree on the mpizero version (ranks [1] differ from rank 0)" in line and "'9.9.9'" in line
