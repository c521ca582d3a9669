"""Nothing is written over a checkpoint: outputs, new runs, rotation and concurrent runs each leave every
checkpoint's bytes as they were; paths that could not be written are refused before the first step."""

import functools
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from checkpoint_runs import TRAIN, refused, train, tree_digest
from mpirun import rank_pids, run_mpi, start_mpi

from mpizero import SGD, ZeroEngine
from mpizero.checkpoint import catalog, store
from mpizero.checkpoint.manifest import CheckpointError


@pytest.fixture
def own(tmp_path, saved) -> Path:
    """A copy of the saved run's directory (steps 2 and 4): every command below is that run's, or reads it."""
    shutil.copytree(saved, tmp_path / "oc")
    return tmp_path / "oc"


def train_into(oc: Path, steps: int, flag: str, output: Path, resume: bool = False) -> list:
    """The saved run's ``train`` into ``oc`` (resumed from it, or new), with one output."""
    resumed = ["--resume", oc] if resume else []
    return [*TRAIN[2:], "--steps", steps, *resumed, "--checkpoint-dir", oc, "--checkpoint-every", 2, flag, output]


OVER_A_CHECKPOINT = {
    "save-params-over-a-manifest": (
        lambda oc: train_into(oc, 4, "--save-params", oc / "ckpt-00000004" / "manifest.json"),
        "--save-params {oc}/ckpt-00000004/manifest.json lies inside the checkpoint {oc}/ckpt-00000004",
    ),
    "memory-json-over-a-rank-file": (
        lambda oc: train_into(oc, 4, "--memory-json", oc / "ckpt-00000002" / "rank00001.bin"),
        "--memory-json {oc}/ckpt-00000002/rank00001.bin lies inside the checkpoint {oc}/ckpt-00000002",
    ),
    "save-params-where-a-save-will-go": (
        lambda oc: train_into(oc, 6, "--save-params", oc / "ckpt-00000006" / "p.npy", resume=True),
        "--save-params {oc}/ckpt-00000006/p.npy lies inside {oc}/ckpt-00000006, where a save into {oc} puts a",
    ),
    "save-params-over-the-lock": (
        lambda oc: train_into(oc, 6, "--save-params", oc / ".mpizero-lock", resume=True),
        "--save-params {oc}/.mpizero-lock is the lock file of the checkpoint directory {oc}",
    ),
    "save-params-is-a-checkpoint": (
        lambda oc: [*TRAIN[2:], "--steps", 2, "--save-params", oc / "ckpt-00000004"],
        "--save-params {oc}/ckpt-00000004 is the checkpoint {oc}/ckpt-00000004",
    ),
    "consolidate-over-another-checkpoint": (
        lambda oc: ["consolidate", oc / "ckpt-00000002", oc / "ckpt-00000004" / "rank00001.bin"],
        "output {oc}/ckpt-00000004/rank00001.bin lies inside the checkpoint {oc}/ckpt-00000004",
    ),
    "plot-into-a-checkpoint": (
        lambda oc: ["plot", "partition", "-o", oc / "ckpt-00000004" / "partition.png"],
        "-o/--output {oc}/ckpt-00000004/partition.png lies inside the checkpoint {oc}/ckpt-00000004",
    ),
}


@pytest.mark.parametrize("case", OVER_A_CHECKPOINT)
def test_an_output_over_a_checkpoint_is_refused_before_any_work(tmp_path, own, case):
    line, expected = OVER_A_CHECKPOINT[case]
    command = functools.partial(run_mpi, 2, ["-m", "mpizero", *map(str, line(own))])
    refused(tmp_path, own, command, expected.format(oc=own))


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


# Checked before the first step: every output path can be created.


def before_the_first_step(done, expected: str) -> None:
    errors = [text for text in done.stderr.splitlines() if text.startswith("mpizero: error:")]
    assert done.returncode == 2 and len(errors) == 1 and expected in errors[0], done.stderr
    assert "step " not in done.stdout, done.stdout


@pytest.mark.parametrize("length", [244, 300])  # 244: a legal name, but its temporary file adds 12 + the pid's digits
def test_an_output_name_too_long_for_its_temporary_file_is_refused_before_the_first_step(tmp_path, length):
    out = tmp_path / ("p" * (length - 4) + ".npy")
    done = train(2, 2, 2, "--save-params", out, ok=False)
    before_the_first_step(done, "ENAMETOOLONG (File name too long)")
    assert os.listdir(tmp_path) == []


def test_a_checkpoint_dir_past_path_max_is_refused_before_the_first_step(tmp_path):
    deep = tmp_path.joinpath(*["d" * 200] * 21)  # about 4,250 characters: past Linux's PATH_MAX of 4,096
    done = train(2, 2, 2, "--checkpoint-dir", deep, "--checkpoint-every", 1, ok=False)
    before_the_first_step(done, "ENAMETOOLONG (File name too long)")
    assert os.listdir(tmp_path) == []


def test_a_checkpoint_dir_or_output_in_a_symlink_loop_is_refused_before_the_first_step(tmp_path):
    os.symlink("loop", tmp_path / "loop")
    done = train(2, 2, 2, "--checkpoint-dir", tmp_path / "loop" / "ck", "--checkpoint-every", 1, ok=False)
    before_the_first_step(done, "ELOOP (Too many levels of symbolic links)")
    done = train(2, 2, 2, "--save-params", tmp_path / "loop" / "p.npy", ok=False)
    before_the_first_step(done, "ELOOP (Too many levels of symbolic links)")
    assert os.listdir(tmp_path) == ["loop"]


@pytest.fixture
def read_only(tmp_path):
    mount = tmp_path / "ro"
    mount.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mount)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_read_only_place_is_refused_before_the_first_step(read_only):
    done = train(2, 2, 2, "--checkpoint-dir", read_only / "ck", "--checkpoint-every", 1, ok=False)
    before_the_first_step(done, f"--checkpoint-dir {read_only}/ck: {read_only} is not writable")
    done = train(2, 2, 2, "--save-params", read_only / "p.npy", ok=False)
    before_the_first_step(done, f"--save-params {read_only}/p.npy is not writable")


# A save refuses data it could not load back.


def nested(depth: int) -> dict:
    data: dict = {}
    for _ in range(depth - 1):
        data = {"d": data}
    return data


def training(data) -> dict:
    return {"step": 1, "optimizer_steps": 1, "skipped_steps": 0, "loss_scale": None, "data": data}


@pytest.mark.parametrize(
    "data, expected",
    [
        (nested(20), "data nests 20 levels deep; a checkpoint holds at most 14"),
        ({1: "a"}, "data would load back as {'1': 'a'}, not as given"),
        ({"t": (1, 2)}, "data would load back as {'t': [1, 2]}, not as given"),
        ({"x": float("nan")}, "data must be JSON values: Out of range float values are not JSON compliant"),
        ({"a": np.float32(1)}, "data must be JSON values: Object of type float32 is not JSON serializable"),
    ],
)
def test_save_refuses_data_it_could_not_load_back(tmp_path, data, expected):
    engine = ZeroEngine({"w": np.ones(5, np.float32)}, SGD(lr=0.1), stage=1)
    with pytest.raises(CheckpointError, match=re.escape(expected)):
        store.save(engine, str(tmp_path / "ck"), training(data))
    assert os.listdir(tmp_path) == []


def test_the_deepest_data_a_checkpoint_holds_loads_back(tmp_path):
    engine = ZeroEngine({"w": np.ones(5, np.float32)}, SGD(lr=0.1), stage=1)
    path = store.save(engine, str(tmp_path / "ck"), training(nested(14)))
    assert store.load(engine, path).training["data"] == nested(14)
    assert catalog.find_latest(str(tmp_path / "ck")) == (path, [])


def test_a_torch_save_refuses_data_it_could_not_load_back(tmp_path):
    torch = pytest.importorskip("torch", reason="mpizero.torch needs torch: add its CPU build")
    from mpizero.torch import shard

    zero = shard(torch.nn.Linear(3, 2), SGD(lr=0.1), stage=2)
    with pytest.raises(CheckpointError, match="data nests 20 levels deep"):
        zero.save(str(tmp_path / "ck"), data=nested(20))
    assert os.listdir(tmp_path) == []
