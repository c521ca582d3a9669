"""Output files: written whole or not at all; the checks that refuse a clobbering output before any work."""

import argparse
import json
import os

import pytest

from mpizero import files
from mpizero.cli import outputs, preflight, train
from mpizero.training.registry import Size, entry


def test_write_replaces_whole_and_leaves_no_temporary_file(tmp_path):
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    files.write(str(target), lambda f: f.write(b"new"))
    assert target.read_bytes() == b"new" and os.listdir(tmp_path) == ["out.bin"]

    def fails(f):
        f.write(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        files.write(str(target), fails)
    assert target.read_bytes() == b"new" and os.listdir(tmp_path) == ["out.bin"]


def test_write_refuses_what_is_not_a_regular_file(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(files.OutputError, match="fifo is a FIFO, not a file: refusing to replace it"):
        files.write(str(tmp_path / "fifo"), lambda f: f.write(b"x"))
    assert not (tmp_path / "fifo").is_file()


def test_one_file_under_two_names_is_refused(tmp_path):
    (tmp_path / "a").write_text("x")
    os.link(tmp_path / "a", tmp_path / "hard")
    os.symlink(tmp_path / "a", tmp_path / "soft")
    for other in ("hard", "soft", "sub/../a"):
        (tmp_path / "sub").mkdir(exist_ok=True)
        found = files.output_problems({"--x": str(tmp_path / "a"), "--y": str(tmp_path / other)}, {}, {})
        assert found and "are the same file" in found[0], other
    assert files.output_problems({"--x": str(tmp_path / "a"), "--y": str(tmp_path / "b")}, {}, {}) == []


def test_an_output_inside_an_input_is_refused_and_a_sibling_is_not(tmp_path):
    (tmp_path / "ck").mkdir()
    inside = files.output_problems({"out": str(tmp_path / "ck" / "x.npz")}, {"checkpoint": str(tmp_path / "ck")}, {})
    assert inside == [
        f"out {tmp_path}/ck/x.npz lies inside the input checkpoint {tmp_path}/ck: it would be overwritten"
    ]
    assert files.output_problems({"out": str(tmp_path / "ck2.npz")}, {"checkpoint": str(tmp_path / "ck")}, {}) == []


def test_free_space_is_summed_per_file_system(tmp_path):
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    assert files.space_problems([("--a", str(tmp_path / "a"), 1), ("--b", str(tmp_path / "new" / "b"), 1)]) == []
    (problem,) = files.space_problems(
        [("--a", str(tmp_path / "a"), free), ("--b", str(tmp_path / "b"), 1), ("--b", str(tmp_path / "b"), 2)]
    )
    expected = f"not enough free space for --a {tmp_path}/a ({free:,} bytes) and --b {tmp_path}/b (3 bytes) on one "
    assert problem.startswith(expected + f"file system: about {free + 3:,} bytes needed together"), problem


def test_free_space_is_read_where_a_folder_went_meanwhile(tmp_path, monkeypatch):
    """Another rank's trial save makes a checkpoint folder and removes it: a path under it, found existing and
    gone before its file system is read, is looked up again from its nearest ancestor (it failed in CI)."""
    trial = tmp_path / "ckpt"
    trial.mkdir()
    statvfs = os.statvfs

    def vanishing(path):
        if os.fspath(path) == str(trial):
            trial.rmdir()
        return statvfs(path)

    monkeypatch.setattr(os, "statvfs", vanishing)
    assert files.space_problems([("--checkpoint-dir", str(trial), 1)]) == []
    assert not trial.exists()


def test_every_ranks_path_problems_are_said_once_naming_the_ranks_only_they_have():
    found = [["a"], ["a", "b"], ["b", "c"]]
    assert outputs.on_every_rank(found) == ["a", "ranks [1, 2]: b", "rank 2: c"]
    assert outputs.on_every_rank([[], []]) == []


def test_the_checkpoints_to_come_count_those_a_resumed_run_finds_on_disk(tmp_path):
    """A fresh run has at most ``--keep`` + 1 checkpoints on disk at once (the next written while the newest stay);
    a resumed run's newest are there already, and its saves up to the step it resumes after are made."""
    args = argparse.Namespace(checkpoint_dir=str(tmp_path), steps=100, checkpoint_every=10, keep=2, resume=None)
    assert preflight.checkpoints_to_come(args) == 3
    for step in (70, 80):  # the run's two newest
        (tmp_path / f"ckpt-{step:08d}").mkdir()
        (tmp_path / f"ckpt-{step:08d}" / "manifest.json").write_text(json.dumps({"training": {"step": step}}))
    args.resume = str(tmp_path)  # after the newest, 80
    assert preflight.checkpoints_to_come(args) == 1
    args.keep = 4  # room for three more: two saves ahead
    assert preflight.checkpoints_to_come(args) == 2
    args.steps = 89  # no save ahead
    assert preflight.checkpoints_to_come(args) == 0
    args.steps, args.keep, args.resume = 100, 2, str(tmp_path / "ckpt-00000070")  # 80 saved again beside it
    assert preflight.checkpoints_to_come(args) == 1
    args.keep = 5  # three saves ahead, and room for four more
    assert preflight.checkpoints_to_come(args) == 3


def test_the_preflight_counts_the_params_kept_gathered_where_they_are_not_read_in_place():
    """``train --stage 3 --keep-gathered`` holds every unit's full params through a step: counted per rank across
    hosts, not where every rank shares one host and reads them in place."""
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    plain = parser.parse_args(["--model", "mlp", "--stage", "3"])
    kept = parser.parse_args(["--model", "mlp", "--stage", "3", "--keep-gathered"])
    task = entry("mlp", Size.of(plain))
    units = task.unit_runs(task.load())
    params = sum(sum(unit.tensors) * unit.count for unit in units)
    predicted = {
        (args.keep_gathered, one_host): preflight.predicted_bytes(args, units, 4, one_host)
        for args in (plain, kept)
        for one_host in (False, True)
    }
    assert predicted[True, True] == predicted[False, True] == predicted[False, False]
    assert 4 * params <= predicted[True, False] - predicted[False, False] < 4.01 * params  # and the padding
