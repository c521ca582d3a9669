"""Nothing is written over a checkpoint: new runs, rotation and concurrent runs each leave every checkpoint's
bytes as they were."""

import functools
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
from checkpoint_runs import TRAIN, refused, train, tree_digest
from mpirun import rank_pids, run_mpi, start_mpi


@pytest.fixture
def own(tmp_path, saved) -> Path:
    """A copy of the saved run's directory (steps 2 and 4): every command below is that run's, or reads it."""
    shutil.copytree(saved, tmp_path / "oc")
    return tmp_path / "oc"


def test_a_new_run_in_a_directory_holding_its_own_checkpoints_is_refused_naming_resume(tmp_path, own):
    command = functools.partial(train, 2, 2, 2, "--checkpoint-dir", own, "--checkpoint-every", 2, "--keep", 1, ok=False)
    expected = f"{own} holds this run's checkpoints up to step 4 (ckpt-00000004): continue it with --resume {own}"
    refused(tmp_path, own, command, expected)


def test_a_resumed_run_rotates_away_only_older_checkpoints(tmp_path, own):
    newer = tree_digest(own / "ckpt-00000004")
    train(2, 2, 3, "--resume", own / "ckpt-00000002", "--checkpoint-dir", own, "--checkpoint-every", 1, "--keep", 1)
    assert sorted(os.listdir(own)) == ["ckpt-00000003", "ckpt-00000004"]
    assert tree_digest(own / "ckpt-00000004") == newer


def test_a_torn_checkpoint_of_the_run_does_not_block_continuing_there(tmp_path, own):
    """A kill during rotation (of an older mpizero) left ckpt-00000006 without its manifest."""
    shutil.copytree(own / "ckpt-00000004", own / "ckpt-00000006", ignore=shutil.ignore_patterns("manifest.json"))
    log = train(2, 2, 6, "--resume", own, "--checkpoint-dir", own, "--checkpoint-every", 2)
    assert f"skipping {own}/ckpt-00000006 (torn: no manifest, the save did not finish)" in log
    assert f"resumed from {own}/ckpt-00000004 after step 4" in log
    assert sorted(os.listdir(own)) == ["ckpt-00000004", "ckpt-00000006"]
    assert (own / "ckpt-00000006" / "manifest.json").is_file()


def test_two_runs_at_once_in_one_directory_are_refused_naming_the_other(tmp_path):
    line = [*TRAIN, "--stage", "2", "--steps", "100000", "--checkpoint-dir", str(tmp_path / "ck")]
    first = start_mpi(1, [*line, "--checkpoint-every", "1", "--log-every", "1"])
    try:
        while "saved" not in first.stdout.readline():
            assert first.poll() is None, first.stderr.read()
        second = run_mpi(1, [*line, "--checkpoint-every", "1"], timeout=60)
        pid = rank_pids(first)[0]
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.communicate()
    errors = [text for text in second.stderr.splitlines() if text.startswith("mpizero: error:")]
    assert second.returncode == 2 and len(errors) == 1, second.stderr
    assert f"{tmp_path}/ck is in use by another run (run " in errors[0] and f"process {pid} on " in errors[0]
    assert "step " not in second.stdout


def test_a_directory_whose_manifest_is_a_fifo_says_why_nothing_was_found(tmp_path):
    (tmp_path / "ck" / "ckpt-00000002").mkdir(parents=True)
    os.mkfifo(tmp_path / "ck" / "ckpt-00000002" / "manifest.json")
    start = time.monotonic()
    done = train(2, 2, 4, "--resume", tmp_path / "ck", ok=False)
    assert done.returncode == 2 and time.monotonic() - start < 60, done.stderr
    assert f"{tmp_path}/ck: no complete checkpoint found; skipping {tmp_path}/ck/ckpt-00000002 (" in done.stderr
    assert "manifest.json is a FIFO, not a regular file: refused without reading it" in done.stderr
