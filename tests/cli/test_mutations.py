"""A test of the tests: deliberate bugs in a copy of the package must make ``verify`` fail.

Each mutation edits the source text of a copy of ``mpizero/`` (the original
text must be found, so a refactor that moves it fails here rather than testing
nothing) and runs ``verify`` on the copy through ``PYTHONPATH``. The unmutated
copy passes (the control), so a failure is the mutation's doing.
"""

import shutil

import pytest
from mpirun import ROOT, run_mpi

from mpizero.core.reduce import kernels

TIMEOUT = 60

# name: (file, original text, mutated text, world size, verify arguments)
MUTATIONS = {
    "last shard offset by one": (
        "core/partition.py",
        "start = rank * self.shard_numel\n",
        "start = rank * self.shard_numel - (rank == self.world_size - 1)\n",
        3,
        ["--stage", "2"],
    ),
    "a rank's earlier micro-batches dropped": (
        "training/trainer.py",
        "self._hand_in(g, grads if batch is not None else None, last_round)",
        "self._hand_in(g, grads if batch is not None and last_round else None, last_round)",
        2,
        ["--stage", "2"],
    ),
    "bias correction one step late": (
        "core/optim/adam.py",
        '"step_size": hyper.lr / (1.0 - beta1**step),',
        '"step_size": hyper.lr / (1.0 - beta1 ** (step + 1)),',
        2,
        ["--stage", "1"],
    ),
    "AdamW decay coupled to the gradient": (
        "core/optim/adam.py",
        "if h.weight_decay and h.decoupled_weight_decay:",
        "if False:",
        2,
        ["--stage", "1", "--optimizer", "adamw"],
    ),
    "the redo of a step whose scale prediction missed, disabled": (
        "core/reduce/scales.py",
        "return predict(largest, count, headroom), prediction is not None",
        "return predict(largest, count, headroom), False",
        2,
        ["--stage", "2", "--micro-batches", "3,120", "--scale-headroom", "0"],  # 40 times the micro-batches at step 2
    ),
    "padding of the parameters not zeroed": (
        "core/group.py",
        "held = xp.zeros(held_stop - held_start, dtype=np.float32)  # the padding stays zero",
        "held = xp.full(held_stop - held_start, 0.5, dtype=np.float32)  # stale data in the padding",
        3,
        ["--stage", "3"],
    ),
    "fp16 gradients never unscaled": (
        "training/trainer.py",
        "inverse = np.float32(1.0 / loss_scale)",
        "inverse = np.float32(1.0)",
        2,
        ["--stage", "2", "--precision", "fp16"],
    ),
    "the float32 wire widened wrong (rounds that travel by MPI; the default path on one host has none)": (
        "core/reduce/kernels.py",
        "            total[start:stop] += piece\n",
        "            total[start:stop] += np.abs(piece)\n",
        2,
        ["--stage", "2", "--paths", "all"],
    ),
    "the compiled encode truncates instead of rounding (its self-test refuses it, verify says so)": (
        "core/reduce/arithmetic.py",
        'f"({mask} ? nearbyintf({a}) : 0.0f)"',
        'f"({mask} ? truncf({a}) : 0.0f)"',
        2,
        ["--stage", "2"],
    ),
}
CAUGHT = ("MISMATCH at step", "optimizer semantics OUTSIDE", "compiled kernels NOT USED")


def compiled_kernels() -> bool:
    """Whether this machine compiles the host kernels (the truncating encode is a mutant of one)."""
    return kernels.backend().startswith("compiled")


def verify_copy(tmp_path, n: int, args: list[str], *mutations):
    """Copy the package into ``tmp_path``, apply each ``(file, old, new)``, and run ``verify`` on the copy."""
    shutil.copytree(ROOT / "mpizero", tmp_path / "mpizero", ignore=shutil.ignore_patterns("__pycache__"))
    for file, old, new in mutations:
        path = tmp_path / "mpizero" / file
        source = path.read_text()
        assert source.count(old) == 1, f"{file}: the text to mutate is gone: {old!r}"
        path.write_text(source.replace(old, new))
    # -P: the working directory (the original package) does not shadow the copy on PYTHONPATH
    argv = ["-P", "-m", "mpizero", "verify", "--steps", "3", *args]
    return run_mpi(n, argv, TIMEOUT, env={"PYTHONPATH": str(tmp_path)})


def test_wire_padding_is_never_read(tmp_path):
    """Stale data in the padding of the local grads buffer cannot leak: only tensor segments are decoded.

    So not zeroing it is an equivalent mutant, not a bug verify could see; if this fails, padding became
    part of a result and the zeroing in ``reduction._spans`` is load-bearing.
    """
    mutation = (
        "core/reduce/reduction.py",
        "total[max(layout.numel, start) - start :] = 0  # the padding",
        "total[max(layout.numel, start) - start :] = 12345  # stale data in the padding",
    )
    done = verify_copy(tmp_path, 3, ["--stage", "all"], mutation)
    assert done.returncode == 0 and done.stdout.count(": bitwise; optimizer semantics within") == 4, done.stdout


def test_unmutated_copy_passes(tmp_path):
    done = verify_copy(tmp_path, 3, ["--stage", "2"])
    assert done.returncode == 0, done.stdout + done.stderr
    assert ": bitwise; optimizer semantics within" in done.stdout


@pytest.mark.parametrize("name", MUTATIONS)
def test_mutation_is_caught_by_verify(tmp_path, name):
    if "compiled" in name and not compiled_kernels():
        pytest.skip("no compiled host kernels here (no C compiler, or MPIZERO_HOST_KERNELS=numpy)")
    file, old, new, n, args = MUTATIONS[name]
    done = verify_copy(tmp_path, n, args, (file, old, new))
    assert done.returncode == 1, f"{name}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert any(caught in done.stdout for caught in CAUGHT), done.stdout


SKIPPING_VERIFY = """
import functools, sys
from mpizero.cli import verify
from mpizero.cli.main import main
from mpizero.core.precision import LossScaler

verify.Trainer = functools.partial(verify.Trainer, initial_loss_scale=2.0**24)
verify.LossScaler = functools.partial(LossScaler, 2.0**24)
taken = verify.RecordingReference.step
def counted(self, contributions):
    done = taken(self, contributions)
    print("SKIPPED" if not done else "TAKEN", flush=True)
    return done
verify.RecordingReference.step = counted
sys.exit(main(["verify", "--precision", "fp16", "--stage", "2", "--steps", "12"]))
"""


def test_fp16_skipped_steps_are_skipped_by_the_documented_optimizer_too(tmp_path):
    script = tmp_path / "skipping.py"
    script.write_text(SKIPPING_VERIFY)
    done = run_mpi(2, [str(script)], TIMEOUT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SKIPPED" in done.stdout and "TAKEN" in done.stdout, done.stdout
    assert ": bitwise; optimizer semantics within" in done.stdout


def test_a_precision_bug_shared_with_the_reference_is_caught_by_the_fp32_gradient_check(tmp_path):
    """The same "never unscaled" bug in the trainer and in the reference: bitwise agrees, the fp32 comparison not."""
    engine = MUTATIONS["fp16 gradients never unscaled"][:3]
    reference = ("core/reference.py", "/ np.float32(loss_scale)", "/ np.float32(1.0)")
    done = verify_copy(tmp_path, 1, ["--stage", "1", "--precision", "fp16"], engine, reference)
    assert done.returncode == 1, done.stdout + done.stderr
    assert ": bitwise;" in done.stdout and "fp16 gradients OUTSIDE 2e-03 of fp32" in done.stdout, done.stdout
