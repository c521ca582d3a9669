"""The standard torch recipe runs on mpizero.torch unchanged: torch.optim optimizers with parameter groups, LR
schedulers, clip_grad_norm_, dropout and BatchNorm keyed to the data, checkpoints that continue the schedule."""

import re

import pytest
from mpirun import WORLD_SIZES, run_mpi_ok

pytest.importorskip("torch", reason="mpizero.torch needs torch: add its CPU build (docs/getting-started.md)")

SCRIPT = ["-m", "mpi4py", "tests/torch_bridge/torch_recipe.py"]


def digests(out: str) -> dict:
    return {int(stage): rest for stage, rest in re.findall(r"^digest (\d) (\w+ \w+ \w+)$", out, re.M)}


@pytest.fixture(scope="module")
def runs():
    return {}


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_masters_buffers_and_eval_outputs_are_the_same_bytes_at_every_stage_and_world_size(n, runs):
    found = digests(run_mpi_ok(n, SCRIPT, timeout=300))
    assert sorted(found) == [0, 1, 2, 3] and len(set(found.values())) == 1, found
    runs[n] = found[0]
    assert runs[n] == runs[min(runs)], f"-n {n} differs from -n {min(runs)}"


@pytest.mark.parametrize("n", [3])  # one resharding resume: saved at 2 ranks, stage 3; resumed at 3, stage 1
def test_a_resume_at_another_world_size_and_stage_mid_schedule_equals_the_straight_run(tmp_path_factory, n, runs):
    saved = tmp_path_factory.getbasetemp() / "recipe-checkpoints"
    if not saved.exists():  # saved at -n 2, stage 3, after 4 of the schedule's 8 steps
        run_mpi_ok(2, [*SCRIPT, "--stages", "3", "--save", str(saved), "--until", "4"], timeout=300)
    straight = runs.get(1) or digests(run_mpi_ok(1, [*SCRIPT, "--stages", "0"], timeout=300))[0]
    resumed = digests(run_mpi_ok(n, [*SCRIPT, "--stages", "1", "--resume", str(saved)], timeout=300))
    assert resumed == {1: straight}
