"""benchmarks/bench_device_counts.py at a small width: its lines as issue 52 names them, and what one mpizero.torch
step at one rank asks of a device, counted on the stand-in, held to that issue's targets: at most one launch a group
a micro-batch, at most two fixed launches a group a step, one host wait a step, no allocation after the first step,
no MPI call at one rank; and at two ranks no allocation after the first step either (round buffers made once)."""

import re
import subprocess
import sys

import pytest
from mpirun import ROOT, run_mpi_ok

pytest.importorskip("torch", reason="the counts benchmark runs mpizero.torch (pip install torch)")
BENCH = ROOT / "benchmarks" / "bench_device_counts.py"
LINE = re.compile(
    r"stage (\d): launches/micro-batch ([\d.]+), fixed launches/step ([\d.]+), syncs/step (\d+), "
    r"allocations/step (\d+), mpi calls/step (\d+)"
)


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
def test_a_step_at_one_rank_meets_the_device_targets_at_every_stage(counted, model):
    groups, stages = counted[model]
    assert sorted(stages) == [0, 1, 2, 3] and groups == {"mlp": 6, "gpt2": 13}[model]
    for stage, (per_micro_batch, fixed, syncs, allocations, mpi_calls) in stages.items():
        assert per_micro_batch <= groups and fixed <= 2 * groups, (stage, stages[stage])
        assert syncs == 1 and allocations == 0 and mpi_calls == 0, (stage, stages[stage])


def test_the_counts_do_not_depend_on_the_width(counted):
    done = subprocess.run(
        [sys.executable, str(BENCH), "--models", "mlp", "--stages", "3", "--width", "48"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    lines = [LINE.fullmatch(line) for line in done.stdout.splitlines() if LINE.fullmatch(line)]
    assert [tuple(float(n) for n in m.groups()[1:]) for m in lines] == [counted["mlp"][1][3]]  # as at width 32


def test_a_step_at_two_ranks_allocates_nothing_on_the_device_after_the_first():
    """At two ranks each round's buffer, the reduce-scatter's block and each group's sum and result are made once
    (``Collectives.scratch``, ``GroupGradients._made_once``): no allocation in steady state at stages 0-2. Stage 3
    allocates each gather's full params (from CuPy's pool on a GPU) and frees them after use, by design: holding
    them would undo what the stage saves."""
    out = run_mpi_ok(2, [str(BENCH), "--models", "mlp", "--width", "32", "--stages", "0", "1", "2"], timeout=300)
    assert out.count("mlp (width 32, 2 ranks), 8 micro-batches: 6 groups") == 1, out  # printed by rank 0
    counts = {int(m.group(1)): m.groups()[1:] for m in map(LINE.fullmatch, out.splitlines()) if m}
    assert sorted(counts) == [0, 1, 2], out
    assert all(int(allocations) == 0 and int(mpi_calls) > 0 for *_, allocations, mpi_calls in counts.values()), out
