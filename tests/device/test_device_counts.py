"""benchmarks/bench_device_counts.py at a small width: its lines as the issue names them, and what one mpizero.torch
step at one rank asks of a device, counted on the stand-in. The targets met are asserted as targets (no MPI call at
one rank, no allocation after the first step, at most a launch a group a micro-batch, one host wait a step at
stage 3); the rest as the ceilings this code reaches, so that a change that adds device work per pass or per step
fails here."""

import re
import subprocess
import sys

import pytest
from mpirun import ROOT

pytest.importorskip("torch", reason="the counts benchmark runs mpizero.torch (pip install torch)")
BENCH = ROOT / "benchmarks" / "bench_device_counts.py"
LINE = re.compile(
    r"stage (\d): launches/micro-batch ([\d.]+), fixed launches/step ([\d.]+), syncs/step (\d+), "
    r"allocations/step (\d+), mpi calls/step (\d+)"
)
# Ceilings reached by this code, per model and stage: fixed launches and syncs (issue 52's targets: 2 a group, and 1;
# left: the step's tail in one launch a group, and the edit watch's two copies at stages 0-2).
CEILINGS = {
    "mlp": {0: (20, 3), 1: (20, 3), 2: (20, 3), 3: (14, 1)},
    "gpt2": {0: (34, 3), 1: (34, 3), 2: (34, 3), 3: (28, 1)},
}


@pytest.fixture(scope="module")
def counted() -> dict:
    """``{model: (groups, {stage: (L, F, Y, A, M)})}`` from one run of the benchmark."""
    done = subprocess.run(
        [sys.executable, str(BENCH), "--width", "32"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    found, model = {}, None
    for line in done.stdout.splitlines():
        header = re.match(r"(\w+) \(.*\), 8 micro-batches: (\d+) groups$", line)
        if header:
            model = header.group(1)
            found[model] = (int(header.group(2)), {})
        elif LINE.fullmatch(line):
            stage, *numbers = LINE.fullmatch(line).groups()
            found[model][1][int(stage)] = tuple(float(n) for n in numbers)
    return found


@pytest.mark.parametrize("model", ["mlp", "gpt2"])
def test_one_rank_launches_a_kernel_a_group_a_pass_allocates_nothing_and_makes_no_mpi_call(counted, model):
    groups, stages = counted[model]
    assert sorted(stages) == [0, 1, 2, 3] and groups == {"mlp": 6, "gpt2": 13}[model]
    for stage, (per_micro_batch, fixed, syncs, allocations, mpi_calls) in stages.items():
        assert per_micro_batch <= groups and allocations == 0 and mpi_calls == 0, (stage, stages[stage])
        reached = (fixed, syncs)
        assert all(n <= ceiling for n, ceiling in zip(reached, CEILINGS[model][stage])), (stage, reached)
    assert stages[3][2] == 1  # the device stats, read back once a step


def test_the_counts_do_not_depend_on_the_width():
    lines = []
    for width in ("16", "48"):
        done = subprocess.run(
            [sys.executable, str(BENCH), "--models", "mlp", "--stages", "0", "3", "--width", width],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr
        lines.append([line for line in done.stdout.splitlines() if LINE.fullmatch(line)])
    assert lines[0] == lines[1] and len(lines[0]) == 2
