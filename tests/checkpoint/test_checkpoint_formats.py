"""A checkpoint of the previous format, written by the last release that wrote it, resumes (issue 53, point 4).

``data/format5-mlp-stage2-step2`` was written by commit 093a1be (the last with ``mpizero-checkpoint-5``), at one
rank: ``python -m mpizero train --model mlp --width 16 --layers 2 --stage 2 --steps 4 --global-batch 8
--log-every 100 --checkpoint-dir ck5 --checkpoint-every 2`` (its ``ckpt-00000002``). That release's straight run
saved the same ``--save-params`` bytes as this one's.
"""

import json
import shutil
from pathlib import Path

import pytest
from mpirun import run_mpi_ok

from mpizero.checkpoint import formats, manifest
from mpizero.errors import CheckpointError

SAVED = Path(__file__).parent / "data" / "format5-mlp-stage2-step2"
RUN = ["-m", "mpizero", "train", "--model", "mlp", "--width", "16", "--layers", "2", "--global-batch", "8"]
RUN += ["--log-every", "100", "--steps", "4"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> bytes:
    """This release's straight four steps' parameters."""
    out = tmp_path_factory.mktemp("straight") / "params.npz"
    run_mpi_ok(1, [*RUN, "--stage", "2", "--save-params", str(out)], timeout=180)
    return out.read_bytes()


@pytest.mark.parametrize("n, stage", [(1, 2), (3, 3)])
def test_a_format_5_checkpoint_resumes_to_the_straight_runs_bytes(tmp_path, straight, n, stage):
    """At the world size and stage it was saved at, and at others."""
    checkpoint = tmp_path / "ckpt-00000002"
    shutil.copytree(SAVED, checkpoint)
    out = tmp_path / "params.npz"
    args = [*RUN, "--stage", str(stage), "--resume", str(checkpoint), "--save-params", str(out)]
    run_mpi_ok(n, args, timeout=180)
    assert out.read_bytes() == straight


def test_a_format_5_manifest_reads_as_format_6():
    read = manifest.read(str(SAVED), None)
    assert read["format"] == formats.CURRENT and read["replicated"] == []
    (group,) = read["optimizer"]["groups"]
    assert group["params"] == [t["name"] for t in read["tensors"]]
    assert group["hyper"] == {
        "lr": 0.003,
        "betas": [0.9, 0.999],
        "eps": 1e-08,
        "weight_decay": 0.01,
        "amsgrad": False,
        "maximize": False,
        "decoupled_weight_decay": True,
    }
    assert set(read["scales"].values()) == {None}


def test_a_format_5_manifest_is_still_checked_as_written(tmp_path):
    """Its checksum covers what it holds as saved; a format before it is refused naming both it reads."""
    for edit, expected in [
        (lambda m: m["optimizer"]["hyper"].update(lr=0.1), "field checksum"),
        (lambda m: m.update(format="mpizero-checkpoint-4"), "this mpizero reads 'mpizero-checkpoint-5' and"),
    ]:
        checkpoint = tmp_path / "edited"
        shutil.rmtree(checkpoint, ignore_errors=True)
        shutil.copytree(SAVED, checkpoint)
        held = json.loads((checkpoint / "manifest.json").read_text())
        edit(held)
        (checkpoint / "manifest.json").write_text(json.dumps(held))
        with pytest.raises(CheckpointError, match=expected):
            manifest.read(str(checkpoint), None)
