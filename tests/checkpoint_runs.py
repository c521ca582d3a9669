"""What the checkpoint tests share: the training command, a saved 4-rank checkpoint, and refusal checks."""

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from mpirun import run_mpi, run_mpi_ok

from mpizero.checkpoint import manifest as manifest_format

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


@pytest.fixture(scope="session")
def saved(tmp_path_factory):
    """A 4-rank stage 1 run checkpointed every 2 steps."""
    directory = tmp_path_factory.mktemp("saved") / "ckpt"
    train(4, 1, 4, "--checkpoint-dir", directory, "--checkpoint-every", 2, "--keep", 5)
    return directory


def copy_of(saved, tmp_path) -> Path:
    target = tmp_path / "ckpt-00000004"
    shutil.copytree(saved / "ckpt-00000004", target)
    return target


def tree_digest(path: Path) -> str:
    """One sha256 over every file name and byte under ``path``."""
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*")):
        digest.update(str(file.relative_to(path)).encode() + b"\0")
        if file.is_file():
            digest.update(file.read_bytes())
    return digest.hexdigest()


def refused(tmp_path, path: Path, command, expected: str):
    """Run ``command``; assert exit 2, ``expected`` in the one error line, and no byte changed or added."""
    before, listing = tree_digest(path), sorted(os.listdir(tmp_path))
    done = command()
    assert done.returncode == 2, done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("mpizero: error:")]
    assert len(errors) == 1 and expected in errors[0], done.stderr
    assert tree_digest(path) == before  # nothing overwritten
    assert sorted(os.listdir(tmp_path)) == listing  # nothing new written
    return errors[0]


def resume_from(path: Path, tmp_path, *extra, n=2):
    return lambda: train(
        n, 2, 6, "--resume", path, "--checkpoint-dir", tmp_path, "--checkpoint-every", 1, *extra, ok=False
    )


def consolidate_from(path: Path, tmp_path):
    args = ["-m", "mpizero", "consolidate", str(path), str(tmp_path / "full.npz"), "--optimizer"]
    return lambda: run_mpi(2, args)


def edit(path: Path, change, seal: bool = True) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    change(manifest)
    if seal:
        manifest["checksum"] = manifest_format.checksum(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))
