"""Sharded checkpoints: resume bit for bit, survive kill -9, reshard, consolidate, refuse bad ones."""

import functools
import io
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from checkpoint_runs import TRAIN, copy_of, refused, resume_from, train
from mpirun import ROOT, run_mpi, run_mpi_ok

from mpizero.checkpoint import catalog, store
from mpizero.checkpoint import manifest as manifest_format

TAG = "MPIZERO_TEST_RUN"


def tagged() -> tuple[str, dict]:
    """A fresh tag and the environment that marks every process of one launch with it."""
    tag = secrets.token_hex(8)
    return tag, {TAG: tag}


def started_with(tag: str) -> list[str]:
    """Command lines of live processes carrying ``tag`` in their environment: only the launch we made.

    mpiexec passes its environment to the proxies and ranks, so this sees our
    ranks even if a launcher starts its own session, and never another job's.
    """
    marker, found = f"{TAG}={tag}".encode(), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                found.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:  # gone, or not ours to read
            continue
    return found


def exec_finished(pid: int, wait: float = 10.0) -> None:
    """Wait until ``pid`` shows its environment: Popen can return while exec is still laying out the new one."""
    deadline = time.monotonic() + wait
    while not Path(f"/proc/{pid}/environ").read_bytes() and time.monotonic() < deadline:
        time.sleep(0.01)


def survivors(tag: str, wait: float = 10.0) -> list[str]:
    """Processes of the launch marked ``tag`` still alive after ``wait`` seconds (none may outlive a killed rank)."""
    deadline = time.monotonic() + wait
    while (alive := started_with(tag)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Four steps in one go: the result every resumed or resharded run must reproduce byte for byte."""
    path = tmp_path_factory.mktemp("straight") / "params.npy"
    train(2, 1, 4, "--save-params", path)
    return path.read_bytes()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_resume_is_byte_identical_to_a_straight_run(tmp_path, straight, stage):
    directory, out = tmp_path / "ckpt", tmp_path / "resumed.npy"
    train(3, stage, 2, "--checkpoint-dir", directory, "--checkpoint-every", 2)
    log = train(3, stage, 4, "--resume", directory, "--save-params", out)
    assert "resumed from" in log and "after step 2" in log
    assert out.read_bytes() == straight


def test_kill_9_during_a_save_loses_nothing(tmp_path, straight):
    directory, out = tmp_path / "ckpt", tmp_path / "resumed.npy"
    train_killed_at(directory, stage=2, point="save:4:1")
    assert any(".partial-" in name for name in os.listdir(directory))  # the torn save is still there
    log = train(
        3, 2, 4, "--resume", directory, "--checkpoint-dir", directory, "--checkpoint-every", 2, "--save-params", out
    )
    assert "(torn: a save or a deletion that did not finish)" in log and "after step 2" in log
    assert out.read_bytes() == straight
    assert sorted(os.listdir(directory)) == ["ckpt-00000002", "ckpt-00000004"]  # stale partial cleaned


def train_killed_at(directory, stage: int, point: str) -> None:
    """Train 3 ranks with checkpoints every 2 steps and SIGKILL at ``point`` (``MPIZERO_KILL_AT``); assert the job
    failed and none of its processes outlived it."""
    tag, env = tagged()
    args = ["--checkpoint-dir", directory, "--checkpoint-every", 2]
    killed = train(3, stage, 4, *args, ok=False, env={**env, "MPIZERO_KILL_AT": point})
    assert killed.returncode != 0
    assert not survivors(tag), "ranks left running after one was killed"


def kill_9_mid_step(directory) -> None:
    """Kill rank 2 of 3 at step 3."""
    train_killed_at(directory, stage=3, point="step:3:2")


def test_the_survivor_check_sees_our_ranks_and_nothing_else():
    tag, env = tagged()
    printed = run_mpi_ok(2, ["-c", f"import os; print(os.environ.get({TAG!r}))"], env=env)
    assert printed.count(tag) == 2  # mpiexec hands the tag to every rank (their lines may interleave)
    ours = subprocess.Popen(["sleep", "30"], env={**os.environ, **env})
    other = subprocess.Popen(["sleep", "31"])
    try:
        for proc in (ours, other):
            exec_finished(proc.pid)
        assert started_with(tag) == ["sleep 30 "]
    finally:
        for proc in (ours, other):
            proc.kill()
            proc.wait()


def test_kill_9_mid_step_ends_the_job_and_training_resumes(tmp_path, straight):
    directory, out = tmp_path / "ckpt", tmp_path / "resumed.npy"
    kill_9_mid_step(directory)
    train(2, 3, 4, "--resume", directory, "--save-params", out)
    assert out.read_bytes() == straight


def test_kill_9_check_ignores_an_unrelated_train_job(tmp_path):
    """Another ``mpizero train`` on the machine (its own session) is neither counted nor touched."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "mpizero", *TRAIN[2:], "--steps", "1000000"]
    other = subprocess.Popen(command, cwd=tmp_path, env=env, start_new_session=True, stdout=subprocess.DEVNULL)
    try:
        kill_9_mid_step(tmp_path / "ckpt")
        assert other.poll() is None, "the unrelated job should still be running beside the check"
    finally:
        os.killpg(other.pid, signal.SIGKILL)
        other.wait()


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


def test_consolidate_writes_the_trained_parameters_by_name(tmp_path, saved, straight):
    out = tmp_path / "full.npz"
    run_mpi_ok(1, ["-m", "mpizero", "consolidate", str(saved), str(out), "--optimizer"])
    with np.load(out, allow_pickle=False) as z:
        names = [n for n in z.files if "/" not in n]
        assert names == ["l0.w", "l0.b", "l1.w", "l1.b", "l2.w", "l2.b"]
        flat = np.concatenate([z[n].reshape(-1) for n in names])
        assert z["l0.w"].shape == (64, 48) and "l0.w/exp_avg_sq" in z.files
    assert flat.tobytes() == np.load(io.BytesIO(straight), allow_pickle=False).tobytes()


def test_another_optimizer_is_refused(tmp_path, saved):
    path = copy_of(saved, tmp_path)
    expected = "manifest.json: field optimizer.type: checkpoint AdamW, this run Adam"
    refused(tmp_path, path, resume_from(path, tmp_path, "--optimizer", "adam"), expected)


def test_another_learning_rate_is_refused_unless_overridden(tmp_path, saved):
    path = copy_of(saved, tmp_path)
    expected = "manifest.json: field optimizer.groups[0].hyper.lr: checkpoint 0.003, this run 0.001"
    refused(tmp_path, path, resume_from(path, tmp_path, "--lr", 0.001), expected)
    refused(tmp_path, path, resume_from(path, tmp_path, "--resume-override", "momentum"), "--resume-override names")
    log = train(2, 2, 5, "--resume", path, "--lr", 0.001, "--resume-override", "lr")
    assert "after step 4" in log


def test_resume_refuses_different_data_settings(tmp_path, saved):
    path = copy_of(saved, tmp_path)
    expected = "manifest.json: field training.settings.global_batch: checkpoint 24, this run --global-batch 12"
    refused(tmp_path, path, resume_from(path, tmp_path, "--global-batch", 12), expected)  # the last flag wins


def test_keep_below_one_is_refused(tmp_path):
    with pytest.raises(ValueError, match="keep must be >= 1 .*, got 0"):
        store.save(None, str(tmp_path), {"step": 1}, keep=0)
    done = train(2, 2, 2, "--checkpoint-dir", tmp_path / "ckpt", "--checkpoint-every", 1, "--keep", 0, ok=False)
    assert done.returncode == 2 and "--keep: must be from 1 to 2147483647, got 0" in done.stderr, done.stderr
    assert not (tmp_path / "ckpt").exists()


def small_disk(tmp_path, kib: int):
    """A tmpfs of ``kib`` KiB: a real full disk (ENOSPC); one save of this test's model is about 80 KiB."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(mount)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    return mount


def mounted(tmp_path, kib: int):
    """A tmpfs of ``kib`` KiB for the test, unmounted after it."""
    mount = small_disk(tmp_path, kib)
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


@pytest.fixture
def tiny_disk(tmp_path):
    yield from mounted(tmp_path, 16)


@pytest.fixture
def disk_for_one_save(tmp_path):
    yield from mounted(tmp_path, 64)


def test_too_little_free_space_is_refused_before_the_first_step(tiny_disk):
    done = train(2, 2, 2, "--checkpoint-dir", tiny_disk, "--checkpoint-every", 2, ok=False)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("mpizero: error:")]
    assert len(errors) == 1 and "before the first step" in errors[0], done.stderr
    assert f"not enough free space for --checkpoint-dir {tiny_disk}" in errors[0] and "step " not in done.stdout
    assert os.listdir(tiny_disk) == []


def test_a_full_disk_names_the_os_error_and_leaves_nothing(disk_for_one_save):
    """A second save that does not fit (``train`` refuses such a run up front: ``test_bad_input``) fails on every
    rank with the OS's error, and its partial files are removed."""
    said = run_mpi_ok(2, ["-m", "mpi4py", "tests/checkpoint/full_disk.py", str(disk_for_one_save)]).splitlines()
    assert said[0].startswith("refused: ") and "ENOSPC (No space left on device)" in said[0], said
    assert ".bin" in said[0], said
    assert said[1] == "holds ['ckpt-00000002']"  # the partial second save was removed


# A run owns its checkpoint directory.


def run_of(path: Path) -> str:
    return json.loads((path / "manifest.json").read_text())["training"]["run"]


@pytest.mark.parametrize("keep", [None, 1])
def test_another_runs_directory_is_refused_naming_both_runs(tmp_path, saved, keep):
    directory = tmp_path / "ckpt"
    shutil.copytree(saved, directory)
    extra = [] if keep is None else ["--keep", keep]
    theirs = run_of(directory / "ckpt-00000004")
    command = functools.partial(
        train, 2, 2, 2, "--seed", 1, "--checkpoint-dir", directory, "--checkpoint-every", 1, *extra, ok=False
    )
    line = refused(tmp_path, directory, command, f"{directory} holds checkpoints of another run")
    assert f"(run {theirs})" in line and "this run is " in line and theirs not in line.split("this run is ")[1]


def test_a_resumed_run_keeps_its_identity_and_its_directory(tmp_path, saved, straight):
    directory, out = tmp_path / "ckpt", tmp_path / "params.npy"
    shutil.copytree(saved, directory)  # its step 4 is replaced by the same run's step 4, moved aside first
    train(
        2,
        2,
        4,
        "--resume",
        directory / "ckpt-00000002",
        "--checkpoint-dir",
        directory,
        "--checkpoint-every",
        1,
        "--keep",
        1,
        "--save-params",
        out,
    )
    assert out.read_bytes() == straight
    assert os.listdir(directory) == ["ckpt-00000004"]
    assert run_of(directory / "ckpt-00000004") == run_of(saved / "ckpt-00000002")


def fake_checkpoint(directory: Path, name: str, step: int, run: str) -> Path:
    """A directory holding just enough of a manifest for listing: its step and run."""
    (directory / name).mkdir(parents=True)
    (directory / name / "manifest.json").write_text(json.dumps({"training": {"step": step, "run": run}}))
    return directory / name


def test_a_copy_moved_aside_is_not_taken_for_the_newest(tmp_path):
    """A crash after a re-save of step 4 was renamed into place, before its older copy was removed."""
    fake_checkpoint(tmp_path, "ckpt-00000004", 4, "a" * 16)
    fake_checkpoint(tmp_path, f"ckpt-00000004.replaced-{'a' * 16}-0a1b2c3d", 4, "a" * 16)
    assert catalog.find_latest(str(tmp_path)) == (str(tmp_path / "ckpt-00000004"), [])


def test_a_checkpoint_whose_step_is_unreadable_is_left_by_rotation(tmp_path, saved, straight):
    directory, out = tmp_path / "ckpt", tmp_path / "params.npy"
    shutil.copytree(saved, directory)
    odd = directory / "ckpt-00000001"
    shutil.copytree(directory / "ckpt-00000002", odd)
    manifest = json.loads((odd / "manifest.json").read_text())
    manifest["training"]["step"] = 1.5
    (odd / "manifest.json").write_text(json.dumps(manifest))
    train(
        2,
        1,
        4,
        "--resume",
        directory / "ckpt-00000002",
        "--checkpoint-dir",
        directory,
        "--keep",
        1,
        "--checkpoint-every",
        2,
        "--save-params",
        out,
    )
    assert out.read_bytes() == straight
    assert sorted(os.listdir(directory)) == ["ckpt-00000001", "ckpt-00000004"]


def test_a_block_size_that_is_not_a_power_of_two_is_refused_before_any_collective(tmp_path):
    with pytest.raises(ValueError, match=r"block_bytes must be a power of two in \[512, 1073741824\], got 1000"):
        store.save(None, str(tmp_path), {"step": 1}, block_bytes=1000)


def test_rotation_deletes_only_the_runs_older_checkpoints_and_never_a_newer_one(tmp_path):
    ours, theirs = "a" * 16, "b" * 16
    for step in (1, 2, 4, 6):
        fake_checkpoint(tmp_path, f"ckpt-{step:08d}", step, ours)
    fake_checkpoint(tmp_path, "other", 1, theirs)
    written = fake_checkpoint(tmp_path, "ckpt-00000003", 3, ours)  # resumed from 2: 4 and 6 are newer
    (tmp_path / f"ckpt-00000003.partial-{ours}-0000").mkdir()
    (tmp_path / f"ckpt-00000002.removing-{ours}-0000").mkdir()  # a rotation that was killed midway
    (tmp_path / f"ckpt-00000009.partial-{ours}-0000").mkdir()
    (tmp_path / f"ckpt-00000001.partial-{theirs}-0000").mkdir()
    (tmp_path / "ckpt-00000001.replaced-x").mkdir()  # torn, of no known run: left alone
    catalog.rotate(str(tmp_path), 2, ours, str(written))
    assert sorted(os.listdir(tmp_path)) == [
        "ckpt-00000001.partial-" + theirs + "-0000",
        "ckpt-00000001.replaced-x",
        "ckpt-00000002",
        "ckpt-00000003",
        "ckpt-00000004",
        "ckpt-00000006",
        "ckpt-00000009.partial-" + ours + "-0000",
        "other",
    ]
    catalog.rotate(str(tmp_path), 1, ours, str(written))
    assert {"ckpt-00000003", "ckpt-00000004", "ckpt-00000006"} <= set(os.listdir(tmp_path))
    assert "ckpt-00000002" not in os.listdir(tmp_path)


def test_a_rotation_killed_midway_leaves_a_torn_checkpoint_of_the_run(tmp_path, monkeypatch):
    ours = "a" * 16
    for step in (2, 4):
        fake_checkpoint(tmp_path, f"ckpt-{step:08d}", step, ours)
    monkeypatch.setattr(shutil, "rmtree", lambda path: os.unlink(os.path.join(path, "manifest.json")))
    catalog.rotate(str(tmp_path), 1, ours, str(tmp_path / "ckpt-00000004"))
    (torn,) = [f for f in catalog.catalog(str(tmp_path)) if f.path != str(tmp_path / "ckpt-00000004")]
    assert torn.run == ours and torn.step == 2 and not torn.complete
    assert catalog.owner_problem(str(tmp_path), ours, continuing=True) is None


def test_a_checkpoint_is_recognised_by_its_manifest_whatever_its_name(tmp_path, saved, straight):
    copy, out = tmp_path / "my copy", tmp_path / "params.npy"
    shutil.copytree(saved / "ckpt-00000002", copy)
    assert catalog.resolve(str(copy)) == (str(copy), [])
    train(2, 3, 4, "--resume", copy, "--save-params", out)
    assert out.read_bytes() == straight
    shutil.copytree(saved / "ckpt-00000004", tmp_path / "newest, renamed")
    assert catalog.find_latest(str(tmp_path))[0] == str(tmp_path / "newest, renamed")


# A resumed run is the same run.


def test_a_changed_setting_is_refused_on_resume_unless_overridden(tmp_path, saved):
    path = copy_of(saved, tmp_path)
    expected = "field training.settings.clip_norm: checkpoint 1.0, this run --clip-norm 0.5"
    line = refused(tmp_path, path, resume_from(path, tmp_path, "--clip-norm", 0.5), expected)
    assert "--resume-override clip-norm" in line
    expected = "field training.settings.precision: checkpoint 'fp32', this run --precision 'fp16'"
    refused(tmp_path, path, resume_from(path, tmp_path, "--precision", "fp16"), expected)
    log = train(2, 2, 5, "--resume", path, "--clip-norm", 0.5, "--resume-override", "clip-norm")
    assert "after step 4" in log


def test_every_setting_that_changes_the_numbers_is_compared():
    from mpizero.checkpoint import compat
    from mpizero.cli.train import FIXED_SETTINGS, RUN_SETTINGS

    saved = {name: 1 for name in RUN_SETTINGS}
    for name in RUN_SETTINGS:
        with pytest.raises(manifest_format.CheckpointError, match=f"field training.settings.{name}: checkpoint 1"):
            compat.check_settings(saved, {**saved, name: 2}, "m.json")
        compat.check_settings(saved, {**saved, name: 2}, "m.json", overrides=[name])
    assert {"clip_norm", "precision", "reduction", "global_batch", "micro_batches", "accumulate", "seed"} <= set(
        RUN_SETTINGS
    ) - set(FIXED_SETTINGS)


def test_steps_at_or_below_the_checkpoints_step_are_refused(tmp_path, saved):
    path = copy_of(saved, tmp_path)
    command = functools.partial(train, 2, 2, 4, "--resume", path, "--save-params", tmp_path / "p.npy", ok=False)
    refused(tmp_path, path, command, f"--steps 4 does not go past step 4, where {path} ended")


# Outputs never clobber inputs.


def test_consolidate_into_its_own_checkpoint_is_refused(tmp_path, saved):
    path = copy_of(saved, tmp_path)
    args = ["-m", "mpizero", "consolidate", str(path), str(path / "rank00000.bin")]
    refused(tmp_path, path, lambda: run_mpi(2, args), f"lies inside the checkpoint {path}: it would be overwritten")
    args = ["-m", "mpizero", "consolidate", str(tmp_path), str(path / "manifest.json")]
    refused(tmp_path, path, lambda: run_mpi(1, args), f"manifest.json lies inside the checkpoint {path}")


def test_save_params_inside_the_resumed_checkpoint_is_refused(tmp_path, saved):
    path = copy_of(saved, tmp_path)
    command = functools.partial(train, 1, 2, 6, "--resume", path, "--save-params", path / "rank00000.bin", ok=False)
    refused(tmp_path, path, command, f"--save-params {path}/rank00000.bin lies inside the checkpoint {path}")
