"""Bad input to any command: one line naming the problem, printed once, exit status 2, before any work.

Each case is a real process: ``python -m mpizero ...`` on one rank, or under
``mpiexec -n 2`` where the rank count matters (rank 1 must stay silent, and
rank 0's output-file check must reach rank 1). ``{tmp}`` stands for a fresh
directory, so ``{tmp}/missing/x`` is a file in a directory that does not exist.
"""

import os
import stat
import subprocess

import pytest
from mpirun import ROOT, run_mpi, run_python

# (ranks, command line, a fragment the one error line must contain)
CASES = [
    (1, "train --global-batch 0", "--global-batch: must be from 1 to 1099511627776, got 0"),
    (1, "train --lr nan", "--lr: must be a finite number > 0, got 'nan'"),
    (1, "train --lr inf", "--lr: must be a finite number"),
    (1, "train --lr 0", "--lr: must be a finite number > 0"),
    (1, "train --clip-norm nan", "--clip-norm: must be a finite number >= 0"),
    (1, "train --log-every 0", "--log-every: must be from 1 to 2147483647"),
    (1, "train --seed -1", "--seed: must be from 0 to 2147483647, got -1"),
    (1, "train --heads 0", "--heads: must be from 1 to 2147483647"),
    (1, "train --model transformer --heads 3", "--width 64 must be a multiple of --heads 3"),
    (1, "train --width -3", "--width: must be from 1 to 2147483647, got -3"),
    (1, "train --width 0", "--width: must be from 1 to 2147483647, got 0"),
    (1, "train --width 2.5", "--width: must be a whole number, got '2.5'"),
    (1, "train --layers 0", "--layers: must be from 1 to 2147483647"),
    (1, "train --block-size 0", "--block-size: must be from 1 to 2147483647"),
    (1, "train --loss-scale-power 5000", "--loss-scale-power: must be from 0 to 127, got 5000"),
    (1, "train --checkpoint-dir {tmp}/ckpt", "--checkpoint-dir and --checkpoint-every go together"),
    (1, "train --checkpoint-every 5", "--checkpoint-dir and --checkpoint-every go together"),
    (
        1,
        "train --checkpoint-dir {tmp}/ckpt --checkpoint-every -2",
        "--checkpoint-every: must be from 1 to 2147483647, got -2",
    ),
    (1, "train --keep 0", "--keep: must be from 1 to 2147483647, got 0"),
    (1, "train --keep -3", "--keep: must be from 1 to 2147483647, got -3"),
    (1, "train --steps 0", "--steps: must be from 1 to 2147483647"),
    (1, "train --micro-batches 0", "--micro-batches: must be from 1 to 2147483647"),
    (1, "train --global-batch 10 --micro-batches 4", "--global-batch 10 must split into --micro-batches 4"),
    (1, "train --bucket-elems 0", "--bucket-elems: must be from 1 to 2147483647"),
    (1, "train --watchdog -1", "--watchdog: must be a finite number >= 0"),
    (1, "train --watchdog 1e-300", "--watchdog: must be 0 (no watchdog) or at least 1 s"),
    (1, "train --stage 4", "--stage: invalid choice: 4"),
    (1, "train --model cnn", "--model: invalid choice: 'cnn'"),
    (1, "train --optimizer rmsprop", "--optimizer: invalid choice: 'rmsprop'"),
    (1, "train --save-params {tmp}/missing/p.npy", "--save-params {tmp}/missing/p.npy: directory"),
    (1, "train --memory-json {tmp}/missing/m.json", "--memory-json {tmp}/missing/m.json: directory"),
    (1, "train --save-params {tmp}", "is a directory, not a file"),
    (1, "train --no-such-flag", "unrecognized arguments: --no-such-flag"),
    (1, "verify --batch 0", "--batch: must be from 1 to 2147483647"),
    (1, "verify --clip-norm -1", "--clip-norm: must be a finite number >= 0"),
    (1, "verify --micro-batches 0", "--micro-batches: must be from 1 to 2147483647"),
    (1, "verify --stage 5", "--stage: invalid choice: '5'"),
    (1, "verify --seed -2", "--seed: must be from 0 to 2147483647"),
    (1, "verify --bucket-elems 0", "--bucket-elems: must be from 1 to 2147483647"),
    (1, "estimate --ranks 0 --params 1e9", "--ranks: must be from 1 to 2147483647, got 0"),
    (1, "estimate --ranks 4", "give --params PSI"),
    (1, "estimate --ranks 4 --params -5", "--params: must be a finite number > 0, got '-5'"),
    (1, "estimate --ranks 4 --params nan", "--params: must be a finite number > 0, got 'nan'"),
    (1, "estimate --params 1e9", "required: --ranks"),
    (1, "estimate --ranks 4 --model transformer --width 30", "--width 30 must be a multiple of --heads 4"),
    (1, "estimate --ranks 4 --params 1e9 --k -1", "--k: must be from 0 to 2147483647"),
    (1, "plot partition --ranks 0 -o {tmp}/p.png", "--ranks: must be from 1 to 2147483647, got 0"),
    (1, "plot memory --precision fp8 -o {tmp}/m.png", "--precision: invalid choice: 'fp8'"),
    (1, "plot memory --reduction foo -o {tmp}/m.png", "--reduction: invalid choice: 'foo'"),
    (1, "plot memory --optimizer rmsprop -o {tmp}/m.png", "--optimizer: invalid choice: 'rmsprop'"),
    (1, "plot partition -o {tmp}/missing/x.png", "-o/--output {tmp}/missing/x.png: directory"),
    (1, "plot partition --params 1e8 -o {tmp}/p.png", "--params: must be from 1 to 64, got 100000000"),
    (1, "plot partition -o {tmp}/p.txt", "must end in an image format"),
    (1, "plot -o {tmp}/p.png", "required: figure"),
    (1, "example --stage 0", "--stage: invalid choice: 0"),
    (1, "example --reduction foo", "--reduction: invalid choice: 'foo'"),
    (1, "consolidate {tmp} {tmp}/missing/out.npz", "output {tmp}/missing/out.npz: directory"),
    (1, "consolidate", "required: checkpoint, output"),
    (1, "bogus", "invalid choice: 'bogus'"),
    (1, "train --resume-override lr", "--resume-override needs --resume: there is no checkpoint to override"),
    (1, "train --resume {tmp} --resume-override width", "--resume-override names ['width'], not settings"),
    (1, "train --resume {tmp}/missing", "{tmp}/missing: no complete checkpoint found"),
    (1, "train --save-params {tmp}/p --memory-json {tmp}/p", "--memory-json {tmp}/p are the same file"),
    (1, "train --save-params {tmp}/a/../p --memory-json {tmp}/p", "are the same file"),
    (1, "train --save-params /proc/p.npy", "--save-params /proc/p.npy is under /proc: not a place for output"),
    (1, "train --memory-json /sys/m.json", "--memory-json /sys/m.json is under /sys"),
    (1, "train --checkpoint-dir /proc/ck --checkpoint-every 1", "--checkpoint-dir /proc/ck is under /proc"),
    (1, "train --width 1e5", "before the first step: rank 0: predicted memory"),
    (1, "train --model transformer --block-size 100000", "--block-size 100000 is longer than the corpus allows"),
    (1, "consolidate {tmp} /dev/null", "output /dev/null is under /dev: not a place for output"),
    (1, "consolidate {tmp} {tmp}", "output {tmp} is a directory, not a file"),
    (1, "plot partition -o /proc/p.png", "-o/--output /proc/p.png is under /proc"),
    (1, "train --save-params {tmp}/x --checkpoint-dir {tmp}/x --checkpoint-every 1", "is also --checkpoint-dir"),
    (1, "train --keep 3", "--keep needs --checkpoint-dir: there are no checkpoints to keep"),
    (1, "train --steps 3 --checkpoint-dir {tmp}/c --checkpoint-every 5", "--checkpoint-every 5 is more than --steps 3"),
    (1, "train --global-batch 1e9", "before the first step: rank 0: predicted memory"),
    (1, "train --global-batch 1e13", "--global-batch: must be from 1 to 1099511627776"),
    (1, "estimate --ranks 1e300 --model mlp", "--ranks: must be from 1 to 2147483647"),
    (1, "train --steps 1e30", "--steps: must be from 1 to 2147483647, got 1000000000000000019884624838656"),
    (1, "train --seed 1e19", "--seed: must be from 0 to 2147483647"),
    (1, "train --offload-dir=", "--offload-dir: must be a path, got ''"),
    (1, "train --offload-dir {tmp}/x --save-params {tmp}/x", "--save-params {tmp}/x is also --offload-dir"),
    (1, "train --offload-dir {tmp}/x --memory-json {tmp}/x", "--memory-json {tmp}/x is also --offload-dir"),
    (
        1,
        "train --offload-dir {tmp}/c --checkpoint-dir {tmp}/c --checkpoint-every 1",
        "--checkpoint-dir {tmp}/c is also --offload-dir",
    ),
    (
        1,
        "train --offload-dir {tmp}/c/work --checkpoint-dir {tmp}/c --checkpoint-every 1",
        "--offload-dir {tmp}/c/work and --checkpoint-dir {tmp}/c hold one another",
    ),
    (1, "train --checkpoint-dir= --checkpoint-every 2", "--checkpoint-dir: must be a path, got ''"),
    (1, "verify --perturb-rank 5", "--perturb-rank 5 is not a rank of the 1 ranks"),
    (1, "", "required: command"),
    (2, "train --global-batch 0", "--global-batch: must be from 1 to 1099511627776, got 0"),
    (2, "train --global-batch 1", "--global-batch 1 is smaller than the 2 ranks"),
    (2, "train --micro-batches 1", "--micro-batches 1 is fewer than the 2 ranks"),
    (2, "train --model transformer --heads 3", "--width 64 must be a multiple of --heads 3"),
    (2, "train --checkpoint-dir {tmp}/ckpt", "--checkpoint-dir and --checkpoint-every go together"),
    (2, "train --save-params {tmp}/missing/p.npy", "--save-params {tmp}/missing/p.npy: directory"),
    (2, "verify --steps 0", "--steps: must be from 1 to 2147483647, got 0"),
    (2, "verify --stage 5", "--stage: invalid choice: '5'"),
    (2, "estimate --ranks 0 --params 1e9", "--ranks: must be from 1 to 2147483647, got 0"),
    (2, "plot partition -o {tmp}/missing/x.png", "-o/--output {tmp}/missing/x.png: directory"),
    (2, "consolidate {tmp} {tmp}/missing/out.npz", "output {tmp}/missing/out.npz: directory"),
    (2, "train --resume-override lr", "--resume-override needs --resume"),
    (2, "train --model transformer --block-size 100000", "--block-size 100000 is longer than the corpus allows"),
]


def run(ranks: int, args: list[str]) -> subprocess.CompletedProcess:
    if ranks > 1:
        return run_mpi(ranks, ["-m", "mpizero", *args], timeout=60)
    return run_python(["-m", "mpizero", *args], timeout=60, env={"PYTHONPATH": str(ROOT)})


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


def special_files(tmp_path):
    """A FIFO, a character device (a copy of /dev/null's node, where we may make one) and a plain file."""
    os.mkfifo(tmp_path / "fifo")
    found = {"fifo": "a FIFO"}
    try:
        os.mknod(tmp_path / "null", 0o666 | stat.S_IFCHR, os.stat("/dev/null").st_rdev)
        found["null"] = "a character device"
    except PermissionError:
        pass  # not root: the FIFO stands for every file that is not a regular one
    (tmp_path / "file").write_text("x")
    return found


def test_an_output_that_is_not_a_regular_file_is_refused_and_kept(tmp_path):
    for name, kind in special_files(tmp_path).items():
        target = tmp_path / name
        for line in (
            f"train --save-params {target}",
            f"consolidate {tmp_path} {target}",
            f"plot partition -o {target}.png",
        ):
            if line.startswith("plot"):
                os.symlink(target, f"{target}.png")
            done = run(1, line.split())
            assert done.returncode == 2 and f"{target}" in done.stderr and f"is {kind}, not a file" in done.stderr, line
            assert target.exists() and not target.is_file(), f"{line} replaced the {kind}"
            if line.startswith("plot"):
                os.unlink(f"{target}.png")
    done = run(1, ["train", "--checkpoint-dir", str(tmp_path / "file" / "ck"), "--checkpoint-every", "1"])
    assert done.returncode == 2 and "which is a file, not a directory" in done.stderr, done.stderr
    done = run(1, ["train", "--checkpoint-dir", str(tmp_path / "file"), "--checkpoint-every", "1"])
    assert done.returncode == 2 and f"--checkpoint-dir {tmp_path / 'file'} is a file, not a directory" in done.stderr


ONE_RANK_SHORT_OF_MEMORY = """
import sys
from mpi4py import MPI
from mpizero.cli import preflight
from mpizero.cli.main import main

if MPI.COMM_WORLD.Get_rank() == 1:  # this rank's host has almost no memory left
    preflight.available_memory = lambda: 1 << 10
sys.exit(main(["train", "--steps", "2"]))
"""


def test_a_problem_on_one_rank_ends_every_rank_with_exit_2(tmp_path):
    script = tmp_path / "short.py"
    script.write_text(ONE_RANK_SHORT_OF_MEMORY)
    done = run_mpi(3, [str(script)], timeout=60)
    errors = [text for text in done.stderr.splitlines() if text.strip()]
    assert done.returncode == 2 and len(errors) == 1, done.stderr
    assert "before the first step: rank 1: predicted memory" in errors[0] and "1.0 KiB is available" in errors[0]
    assert "step " not in done.stdout, done.stdout


def test_estimate_answers_any_size_at_once():
    done = run(1, ["estimate", "--model", "mlp", "--layers", "1e7", "--ranks", "4"])
    assert done.returncode == 0 and "stage" in done.stdout, done.stderr


def test_an_unreadable_checkpoint_key_is_refused_at_start_up(tmp_path):
    env = {"PYTHONPATH": str(ROOT), "MPIZERO_CHECKPOINT_KEY_FILE": str(tmp_path / "missing")}
    line = f"train --steps 2 --checkpoint-dir {tmp_path}/ck --checkpoint-every 1".split()
    done = run_python(["-m", "mpizero", *line], timeout=60, env=env)
    assert done.returncode == 2 and "the checkpoint key: rank 0: " in done.stderr, done.stderr
    assert "cannot read the key (No such file or directory)" in done.stderr
    assert "step " not in done.stdout and not (tmp_path / "ck").exists()


def test_the_default_micro_batches_are_found_at_once_for_a_prime_global_batch():
    from mpizero.cli.train import smallest_divisor

    assert smallest_divisor(1_000_000_007, 4) == 1_000_000_007 and smallest_divisor(2**40, 3) == 4
    assert all(
        smallest_divisor(n, least) == next(m for m in range(least, n + 1) if n % m == 0)
        for n in range(1, 200)
        for least in range(1, n + 1)
    )


FULL_AT_THE_END = """
import errno, sys
from mpizero.cli.main import main
from mpizero.training import readout

def full(f, numel, tensors):
    next(iter(tensors))  # one tensor in, the disk is full: the other rank is still gathering the units
    raise OSError(errno.ENOSPC, "No space left on device", sys.argv[1])

readout.write_flat = full
sys.exit(main(["train", "--steps", "1", "--save-params", sys.argv[1]]))
"""


def test_an_output_that_fails_after_the_steps_ends_every_rank_with_exit_2(tmp_path):
    script = tmp_path / "full.py"
    script.write_text(FULL_AT_THE_END)
    done = run_mpi(2, [str(script), str(tmp_path / "p.npy")], timeout=60)
    errors = [text for text in done.stderr.splitlines() if text.strip()]
    assert done.returncode == 2 and len(errors) == 1, done.stderr
    assert f"writing the outputs: rank 0: cannot write {tmp_path}/p.npy: ENOSPC" in errors[0], errors


@pytest.fixture
def small_file_system(tmp_path):
    """A 4 MiB tmpfs, unmounted after (mounting needs root)."""
    where = tmp_path / "small"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(where)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a 4 MiB tmpfs here: {mounted.stderr.decode().strip()[:200]}")
    yield where
    subprocess.run(["umount", str(where)], check=True, timeout=60)


def test_offload_files_and_a_checkpoint_that_fit_apart_but_not_together_are_refused_before_step_1(small_file_system):
    """Both ranks' offload files (2.5 MB) fit in 4 MiB, and so would the first checkpoint (1.6 MB), but not both,
    nor the three checkpoints on disk at once while the third is written (``--keep 2``): refused before any work,
    where the run used to take a step and fail a save with ENOSPC."""
    off, ckpt = small_file_system / "off", small_file_system / "ckpt"
    args = ["--stage", "2", "--width", "320", "--steps", "3", "--checkpoint-every", "1"]
    done = run_mpi(2, ["-m", "mpizero", "train", *args, "--offload-dir", str(off), "--checkpoint-dir", str(ckpt)])
    errors = [text for text in done.stderr.splitlines() if text.strip()]
    assert done.returncode == 2 and len(errors) == 1, done.stderr
    said = "mpizero: error: before the first step: ranks [0, 1]: not enough free space for "
    assert errors[0].startswith(said), errors
    assert f"--checkpoint-dir {ckpt} (" in errors[0] and f"--offload-dir {off} (" in errors[0], errors
    assert "step" not in done.stdout and not os.path.exists(ckpt), done.stdout
