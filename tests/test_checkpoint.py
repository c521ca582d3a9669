"""Sharded checkpoints: resume bit for bit, survive kill -9, reshard, consolidate, refuse bad ones."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from mpirun import run_mpi, run_mpi_ok

TRAIN = [
    "-m",
    "mpizero",
    "train",
    "--model",
    "mlp",
    "--global-batch",
    "24",
    "--micro-batches",
    "6",
    "--log-every",
    "100",
    "--width",
    "48",
]


def train(n, stage, steps, *extra, ok=True, env=None):
    args = [*TRAIN, "--stage", str(stage), "--steps", str(steps), *map(str, extra)]
    return run_mpi_ok(n, args, env=env) if ok else run_mpi(n, args, env=env)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Four steps in one go: the result every resumed or resharded run must reproduce byte for byte."""
    path = tmp_path_factory.mktemp("straight") / "params.npy"
    train(2, 1, 4, "--save-params", path)
    return path.read_bytes()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 4-rank stage 1 run checkpointed every 2 steps."""
    directory = tmp_path_factory.mktemp("saved") / "ckpt"
    train(4, 1, 4, "--checkpoint-dir", directory, "--checkpoint-every", 2, "--keep", 5)
    return directory


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_resume_is_byte_identical_to_a_straight_run(tmp_path, straight, stage):
    directory, out = tmp_path / "ckpt", tmp_path / "resumed.npy"
    train(3, stage, 2, "--checkpoint-dir", directory, "--checkpoint-every", 2)
    log = train(3, stage, 4, "--resume", directory, "--save-params", out)
    assert "resumed from" in log and "after step 2" in log
    assert out.read_bytes() == straight


def test_kill_9_during_a_save_loses_nothing(tmp_path, straight):
    directory, out = tmp_path / "ckpt", tmp_path / "resumed.npy"
    killed = train(
        3, 2, 4, "--checkpoint-dir", directory, "--checkpoint-every", 2, ok=False, env={"MPIZERO_KILL_AT": "save:4:1"}
    )
    assert killed.returncode != 0
    assert not survivors(), "ranks left running after one was killed"
    assert any(".partial-" in name for name in os.listdir(directory))  # the torn save is still there
    log = train(
        3, 2, 4, "--resume", directory, "--checkpoint-dir", directory, "--checkpoint-every", 2, "--save-params", out
    )
    assert "skipping torn checkpoint" in log and "after step 2" in log
    assert out.read_bytes() == straight
    assert sorted(os.listdir(directory)) == ["ckpt-00000002", "ckpt-00000004"]  # stale partial cleaned


def survivors() -> list[str]:
    """Processes of a train run still alive (none may outlive a killed rank)."""
    found = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout.splitlines()
    return [line for line in found if "mpizero train" in line and "ps -eo" not in line]


def test_kill_9_mid_step_ends_the_job_and_training_resumes(tmp_path, straight):
    directory, out = tmp_path / "ckpt", tmp_path / "resumed.npy"
    killed = train(
        3, 3, 4, "--checkpoint-dir", directory, "--checkpoint-every", 2, ok=False, env={"MPIZERO_KILL_AT": "step:3:2"}
    )
    assert killed.returncode != 0 and not survivors()
    train(2, 3, 4, "--resume", directory, "--save-params", out)
    assert out.read_bytes() == straight


@pytest.mark.parametrize("n, stage", [(2, 3), (3, 2), (1, 0)])
def test_reshard_from_four_ranks(tmp_path, straight, saved, n, stage):
    out = tmp_path / "params.npy"
    train(n, stage, 4, "--resume", saved / "ckpt-00000002", "--save-params", out)
    assert out.read_bytes() == straight


def test_reshard_up_from_two_ranks(tmp_path, straight):
    directory, out = tmp_path / "ckpt", tmp_path / "params.npy"
    train(2, 3, 2, "--checkpoint-dir", directory, "--checkpoint-every", 2)
    train(4, 2, 4, "--resume", directory, "--save-params", out)
    assert out.read_bytes() == straight


def test_consolidate_writes_the_trained_parameters_by_name(tmp_path, saved):
    out = tmp_path / "full.npz"
    params = tmp_path / "params.npy"
    train(2, 2, 4, "--resume", saved / "ckpt-00000004", "--save-params", params)  # no more steps to take
    run_mpi_ok(1, ["-m", "mpizero", "consolidate", str(saved), str(out), "--optimizer"])
    with np.load(out, allow_pickle=False) as z:
        names = [n for n in z.files if "/" not in n]
        assert names == ["l0.w", "l0.b", "l1.w", "l1.b", "l2.w", "l2.b"]
        flat = np.concatenate([z[n].reshape(-1) for n in names])
        assert z["l0.w"].shape == (64, 48) and "l0.w/exp_avg_sq" in z.files
    assert flat.tobytes() == np.load(params, allow_pickle=False).tobytes()


def copy_of(saved, tmp_path) -> Path:
    target = tmp_path / "ckpt-00000004"
    shutil.copytree(saved / "ckpt-00000004", target)
    return target


def truncate(path: Path) -> str:
    data = (path / "rank00001-master.npy").read_bytes()
    (path / "rank00001-master.npy").write_bytes(data[:-8])
    return "rank00001-master.npy: "


def flip_a_byte(path: Path) -> str:
    data = bytearray((path / "rank00002-exp_avg.npy").read_bytes())
    data[-1] ^= 1
    (path / "rank00002-exp_avg.npy").write_bytes(bytes(data))
    return "rank00002-exp_avg.npy: checksum mismatch"


def delete_a_file(path: Path) -> str:
    (path / "rank00003-exp_avg_sq.npy").unlink()
    return "rank00003-exp_avg_sq.npy: missing"


def manifest_from_another_model(path: Path) -> str:
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["tensors"][0]["shape"] = [64, 99]
    (path / "manifest.json").write_text(json.dumps(manifest))
    return "saved from another model (l0.w: checkpoint [64, 99] vs model [64, 48])"


def needs_pickle(path: Path) -> str:
    import hashlib

    name = "rank00000-master.npy"
    np.save(path / name, np.array([{"evil": 1}], dtype=object), allow_pickle=True)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"][name]["bytes"] = (path / name).stat().st_size
    manifest["files"][name]["sha256"] = hashlib.sha256((path / name).read_bytes()).hexdigest()
    (path / "manifest.json").write_text(json.dumps(manifest))
    return "would need pickle to load; refusing"


@pytest.mark.parametrize("damage", [truncate, flip_a_byte, delete_a_file, manifest_from_another_model, needs_pickle])
def test_bad_checkpoints_fail_on_every_rank_naming_file_and_problem(tmp_path, saved, damage):
    path = copy_of(saved, tmp_path)
    expected = damage(path)
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    done = train(3, 2, 6, "--resume", path, "--checkpoint-dir", tmp_path, "--checkpoint-every", 1, ok=False)
    assert done.returncode == 2, done.stderr  # every rank raised the same error and exited cleanly
    assert "cannot load checkpoint" in done.stderr and expected in done.stderr, done.stderr
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before  # nothing overwritten
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000004"]  # nothing new written


def test_resume_refuses_different_data_settings(saved):
    done = train(2, 1, 6, "--global-batch", 12, "--resume", saved, ok=False)  # the last --global-batch wins
    assert done.returncode == 2 and "--global-batch 24 (this run: 12)" in done.stderr, done.stderr
