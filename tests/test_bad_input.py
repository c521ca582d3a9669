"""Bad input to any command: one line naming the problem, printed once, exit status 2, before any work.

Each case is a real process: ``python -m mpizero ...`` on one rank, or under
``mpiexec -n 2`` where the rank count matters (rank 1 must stay silent, and
rank 0's output-file check must reach rank 1). ``{tmp}`` stands for a fresh
directory, so ``{tmp}/missing/x`` is a file in a directory that does not exist.
"""

import os
import subprocess
import sys

import pytest
from mpirun import ROOT, run_mpi

# (ranks, command line, a fragment the one error line must contain)
CASES = [
    (1, "train --global-batch 0", "--global-batch: must be >= 1, got 0"),
    (1, "train --lr nan", "--lr: must be a finite number > 0, got 'nan'"),
    (1, "train --lr inf", "--lr: must be a finite number"),
    (1, "train --lr 0", "--lr: must be a finite number > 0"),
    (1, "train --clip-norm nan", "--clip-norm: must be a finite number >= 0"),
    (1, "train --log-every 0", "--log-every: must be >= 1"),
    (1, "train --seed -1", "--seed: must be >= 0, got -1"),
    (1, "train --heads 0", "--heads: must be >= 1"),
    (1, "train --model transformer --heads 3", "--width 64 must be a multiple of --heads 3"),
    (1, "train --width -3", "--width: must be >= 1, got -3"),
    (1, "train --width 0", "--width: must be >= 1, got 0"),
    (1, "train --width 2.5", "--width: must be a whole number, got '2.5'"),
    (1, "train --layers 0", "--layers: must be >= 1"),
    (1, "train --block-size 0", "--block-size: must be >= 1"),
    (1, "train --loss-scale-power 5000", "--loss-scale-power: must be from 0 to 127, got 5000"),
    (1, "train --checkpoint-dir {tmp}/ckpt", "--checkpoint-dir and --checkpoint-every go together"),
    (1, "train --checkpoint-every 5", "--checkpoint-dir and --checkpoint-every go together"),
    (1, "train --checkpoint-dir {tmp}/ckpt --checkpoint-every -2", "--checkpoint-every: must be >= 1, got -2"),
    (1, "train --keep 0", "--keep: must be >= 1, got 0"),
    (1, "train --keep -3", "--keep: must be >= 1, got -3"),
    (1, "train --steps 0", "--steps: must be >= 1"),
    (1, "train --micro-batches 0", "--micro-batches: must be >= 1"),
    (1, "train --global-batch 10 --micro-batches 4", "--global-batch 10 must split into --micro-batches 4"),
    (1, "train --bucket-elems 0", "--bucket-elems: must be >= 1"),
    (1, "train --watchdog -1", "--watchdog: must be a finite number >= 0"),
    (1, "train --stage 4", "--stage: invalid choice: 4"),
    (1, "train --model cnn", "--model: invalid choice: 'cnn'"),
    (1, "train --optimizer lion", "--optimizer: invalid choice: 'lion'"),
    (1, "train --device gpu --precision bf16", "--precision bf16 is not available with --device gpu"),
    (1, "train --save-params {tmp}/missing/p.npy", "--save-params {tmp}/missing/p.npy: directory"),
    (1, "train --memory-json {tmp}/missing/m.json", "--memory-json {tmp}/missing/m.json: directory"),
    (1, "train --save-params {tmp}", "is a directory, not a file"),
    (1, "train --no-such-flag", "unrecognized arguments: --no-such-flag"),
    (1, "verify --batch 0", "--batch: must be >= 1"),
    (1, "verify --clip-norm -1", "--clip-norm: must be a finite number >= 0"),
    (1, "verify --micro-batches 0", "--micro-batches: must be >= 1"),
    (1, "verify --stage 5", "--stage: invalid choice: '5'"),
    (1, "verify --seed -2", "--seed: must be >= 0"),
    (1, "verify --bucket-elems 0", "--bucket-elems: must be >= 1"),
    (1, "estimate --ranks 0 --params 1e9", "--ranks: must be >= 1, got 0"),
    (1, "estimate --ranks 4", "give --params PSI"),
    (1, "estimate --ranks 4 --params -5", "--params: must be a finite number > 0, got '-5'"),
    (1, "estimate --ranks 4 --params nan", "--params: must be a finite number > 0, got 'nan'"),
    (1, "estimate --params 1e9", "required: --ranks"),
    (1, "estimate --ranks 4 --model transformer --width 30", "--width 30 must be a multiple of --heads 4"),
    (1, "estimate --ranks 4 --params 1e9 --k -1", "--k: must be >= 0"),
    (1, "plot partition --ranks 0 -o {tmp}/p.png", "--ranks: must be >= 1, got 0"),
    (1, "plot memory --precision fp8 -o {tmp}/m.png", "--precision: invalid choice: 'fp8'"),
    (1, "plot memory --reduction foo -o {tmp}/m.png", "--reduction: invalid choice: 'foo'"),
    (1, "plot memory --optimizer lion -o {tmp}/m.png", "--optimizer: invalid choice: 'lion'"),
    (1, "plot partition -o {tmp}/missing/x.png", "-o/--output {tmp}/missing/x.png: directory"),
    (1, "plot partition --params 1e8 -o {tmp}/p.png", "--params: must be from 1 to 64, got 100000000"),
    (1, "plot partition -o {tmp}/p.txt", "must end in an image format"),
    (1, "plot -o {tmp}/p.png", "required: figure"),
    (1, "example --stage 0", "--stage: invalid choice: 0"),
    (1, "example --reduction foo", "--reduction: invalid choice: 'foo'"),
    (1, "consolidate {tmp} {tmp}/missing/out.npz", "output {tmp}/missing/out.npz: directory"),
    (1, "consolidate", "required: checkpoint, output"),
    (1, "bogus", "invalid choice: 'bogus'"),
    (1, "", "required: command"),
    (2, "train --global-batch 0", "--global-batch: must be >= 1, got 0"),
    (2, "train --global-batch 1", "--global-batch 1 is smaller than the 2 ranks"),
    (2, "train --micro-batches 1", "--micro-batches 1 is fewer than the 2 ranks"),
    (2, "train --model transformer --heads 3", "--width 64 must be a multiple of --heads 3"),
    (2, "train --checkpoint-dir {tmp}/ckpt", "--checkpoint-dir and --checkpoint-every go together"),
    (2, "train --save-params {tmp}/missing/p.npy", "--save-params {tmp}/missing/p.npy: directory"),
    (2, "verify --steps 0", "--steps: must be >= 1, got 0"),
    (2, "verify --stage 5", "--stage: invalid choice: '5'"),
    (2, "estimate --ranks 0 --params 1e9", "--ranks: must be >= 1, got 0"),
    (2, "plot partition -o {tmp}/missing/x.png", "-o/--output {tmp}/missing/x.png: directory"),
    (2, "consolidate {tmp} {tmp}/missing/out.npz", "output {tmp}/missing/out.npz: directory"),
]


def run(ranks: int, args: list[str]) -> subprocess.CompletedProcess:
    if ranks > 1:
        return run_mpi(ranks, ["-m", "mpizero", *args], timeout=60)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "mpizero", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("ranks, line, fragment", CASES, ids=[f"n{n}: {line}" for n, line, _ in CASES])
def test_bad_input_is_one_line_once_and_exit_2(tmp_path, ranks, line, fragment):
    done = run(ranks, line.replace("{tmp}", str(tmp_path)).split())
    errors = [text for text in done.stderr.splitlines() if text.strip()]
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr and done.stdout == "", (done.stdout, done.stderr)
    assert len(errors) == 1, done.stderr
    assert errors[0].startswith("mpizero: error: ") and fragment.replace("{tmp}", str(tmp_path)) in errors[0], errors
    assert not list(tmp_path.rglob("*.tmp-*")), "a half-written output was left behind"


def test_help_shows_defaults_and_plain_text():
    for command in ("example", "verify", "train", "estimate", "plot", "consolidate"):
        done = run(1, [command, "--help"])
        text = " ".join(done.stdout.split())  # argparse wraps at the terminal width
        assert done.returncode == 0 and "``" not in text, (command, text)
        if command in ("verify", "train"):
            assert "(default: adam" in text and "(default: 300.0)" in text, text


def test_every_flag_has_one_line_of_help():
    import argparse

    from mpizero.cli.main import make_parser

    commands = next(a for a in make_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in commands.choices.items():
        for action in parser._actions:
            if action.help != argparse.SUPPRESS:
                assert action.help and "\n" not in action.help, (name, action.dest)
