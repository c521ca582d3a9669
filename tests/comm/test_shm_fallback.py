"""A shared-memory filesystem too small for the arena: every rank falls back to MPI together, same bytes."""

import os
import shutil
import subprocess

import pytest
from mpirun import run_mpi_ok

from mpizero.comm.job.launcher import python_under_mpiexec

TRAIN = ["-m", "mpizero", "train", "--width", "1024", "--stage", "2", "--steps", "2"]
TRAIN += ["--global-batch", "8", "--micro-batches", "2", "--log-every", "100"]


def can_mount_a_private_tmpfs() -> str | None:
    """Why this machine cannot give one job its own small /dev/shm, or None if it can."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return "needs root and unshare(1) to mount a small /dev/shm in a private mount namespace"
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    return None if probe.returncode == 0 else f"unshare -m failed: {probe.stderr.decode().strip()}"


@pytest.mark.skipif(can_mount_a_private_tmpfs() is not None, reason=str(can_mount_a_private_tmpfs()))
def test_a_small_dev_shm_falls_back_to_mpi_with_a_notice_and_the_same_bytes(tmp_path):
    run_mpi_ok(2, [*TRAIN, "--save-params", str(tmp_path / "shared.npy")])
    command = " ".join(python_under_mpiexec(2, *TRAIN, "--save-params", str(tmp_path / "small.npy")))
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=8m tmpfs /dev/shm && exec {command}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    notices = [line for line in done.stderr.splitlines() if "no room for the shared-memory reduce-scatter" in line]
    assert len(notices) == 1 and "/dev/shm has" in notices[0], done.stderr
    assert (tmp_path / "small.npy").read_bytes() == (tmp_path / "shared.npy").read_bytes()
