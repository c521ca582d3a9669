"""Every rank runs the same mpizero code and version and holds the same checkpoint key, or every rank stops at
start-up with one line naming the ranks; a key is never shown, and a key that cannot be read is refused at once."""

import hmac
import json
import os
import re
import shutil
import time

import pytest
from checkpoint_runs import TRAIN, copy_of, refused, train
from mpirun import ROOT, run_mpi

from mpizero.checkpoint_key import KEY_FILE_VARIABLE, KEY_VARIABLE
from mpizero.comm import agree
from mpizero.comm.agree import Concealed


def per_rank(tmp_path, n: int, ranks: dict, *args):
    """Run ``args`` (``-m mpizero ...`` or a script) under ``tests/core/per_rank.py`` with ``ranks``' settings."""
    return per_rank_command(tmp_path, n, ranks, *args)()


def per_rank_command(tmp_path, n: int, ranks: dict, *args):
    """``per_rank``, to be run later (its settings file is written now)."""
    settings = tmp_path / "ranks.json"
    settings.write_text(json.dumps(ranks))
    return lambda: run_mpi(n, ["tests/core/per_rank.py", str(settings), *map(str, args)], timeout=120)


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
from mpizero.comm.job import identity
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


@pytest.mark.parametrize(
    "keys",
    [{"0": "the key", "1": "another key"}, {"1": "a key on rank 1 only"}],
    ids=["different-keys", "one-rank-only"],
)
def test_ranks_with_different_keys_stop_before_the_first_step(tmp_path, saved, keys):
    path = copy_of(saved, tmp_path)  # unsigned: a rank with a key must refuse it
    ranks = {rank: {"env": {KEY_VARIABLE: key}} for rank, key in keys.items()}
    args = ["-m", "mpizero", *TRAIN[2:], "--steps", 6, "--resume", path, "--checkpoint-dir", tmp_path / "ck"]
    line = refused(tmp_path, path, per_rank_command(tmp_path, 2, ranks, *args, "--checkpoint-every", 2), "")
    assert "ranks disagree on the checkpoint key (ranks [1] differ from rank 0): rank 0: '" in line
    assert f"'a key from {KEY_VARIABLE}'" in line  # where the key came from, and nothing of the key
    assert not any(key in line for key in keys.values()) and not re.search(r"[0-9a-f]{8}", line), line


def test_keys_are_compared_by_a_salted_digest_in_constant_time_and_never_shown():
    shown = f"a key from {KEY_VARIABLE}"
    one, same, other = (Concealed(shown, hmac.digest(b"salt", key, "sha256")) for key in (b"k1", b"k1", b"k2"))
    assert one == same and one != other and repr(one) == repr(other) == repr(shown)
    assert agree._digest({"the key": one}) == agree._digest({"the key": same}) != agree._digest({"the key": other})


ENGINE = """
import numpy as np
from mpi4py import MPI
from mpizero import SGD, ZeroEngine, ZeroError

try:
    ZeroEngine({"w": np.ones(5, np.float32)}, SGD(lr=0.1), stage=1, watchdog=30.0)
    outcome = "built"
except ZeroError as error:
    outcome = f"refused: {error}"
if MPI.COMM_WORLD.Get_rank() == 0:
    print(outcome)
"""


def test_an_engine_on_ranks_with_different_keys_is_refused_at_set_up(tmp_path):
    script = tmp_path / "engine.py"
    script.write_text(ENGINE)
    done = per_rank(tmp_path, 2, {"1": {"env": {KEY_VARIABLE: "only rank 1"}}}, script)
    assert done.returncode == 0 and "refused: ranks disagree on the checkpoint key (ranks [1]" in done.stdout


@pytest.mark.parametrize("action", ["save", "load"])
def test_a_key_changed_after_set_up_is_agreed_where_it_is_used(tmp_path, action):
    done = run_mpi(2, ["tests/core/key_at_use.py", action, str(tmp_path / "ck")], timeout=60)
    assert done.returncode == 0, done.stderr
    assert "refused: ranks disagree on the checkpoint key (ranks [1] differ from rank 0)" in done.stdout
    saved = sorted(os.listdir(tmp_path / "ck")) if (tmp_path / "ck").exists() else []
    assert saved == ([] if action == "save" else ["ckpt-00000001"])


@pytest.mark.parametrize("kind", ["variable", "file"])
def test_an_empty_key_is_refused(tmp_path, kind):
    (tmp_path / "key").write_bytes(b"")
    env = {KEY_VARIABLE: ""} if kind == "variable" else {KEY_FILE_VARIABLE: str(tmp_path / "key")}
    line = one_error(train(2, 2, 2, "--checkpoint-dir", tmp_path / "ck", "--checkpoint-every", 1, ok=False, env=env))
    expected = "is set but empty" if kind == "variable" else "the key file is empty"
    assert "the checkpoint key: ranks [0, 1]: " in line and expected in line
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("kind", ["a FIFO", "a character device"])
def test_a_key_file_that_could_block_is_refused_at_once_by_its_type(tmp_path, kind):
    path = tmp_path / "key.fifo"
    if kind == "a FIFO":
        os.mkfifo(path)
    else:
        path = "/dev/zero"
    start, env = time.monotonic(), {KEY_FILE_VARIABLE: str(path)}
    line = one_error(train(2, 2, 2, "--checkpoint-dir", tmp_path / "ck", "--checkpoint-every", 1, ok=False, env=env))
    assert time.monotonic() - start < 30
    assert f"{KEY_FILE_VARIABLE}={path} is {kind}, not a regular file: refused without reading it" in line
