"""The proof, small: under an address-space cap one rank cannot hold a model's fp32 parameters and Adam state, so
``-n 1`` fails at set-up with an agreed error; ``-n 4`` at stage 3 trains it, bitwise equal to an uncapped run.

The large version is ``benchmarks/bench_bigmodel.py``; this runs its worker at a small size.
"""

import json

from mpirun import run_mpi, run_mpi_ok

CAP_MIB = 896  # Python, NumPy and MPI take about 230 MiB of address space per rank before any training state
WORKER = ["benchmarks/bench_bigmodel.py", "--worker", "--model", "mlp", "--width", "2048", "--layers", "12"]
WORKER += ["--steps", "2", "--micro-batches", "4", "--batch", "2"]


def capped(n: int) -> list[str]:
    return ["-m", "mpi4py", "tests/training/capped.py", str(CAP_MIB), *WORKER]


def rows(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_a_model_one_capped_rank_cannot_hold_trains_on_four_bitwise_equal_to_an_uncapped_run():
    alone = run_mpi(1, capped(1), timeout=60)
    assert alone.returncode != 0
    assert "bad initial values: rank 0: out of memory making group" in alone.stderr, alone.stderr[-2000:]
    four = rows(run_mpi_ok(4, capped(4), timeout=90))
    uncapped = rows(run_mpi_ok(1, ["-m", "mpi4py", *WORKER], timeout=90))[0]
    cap = CAP_MIB << 20
    for row in four:
        assert 16 * row["params"] > cap - row["base_vm"]  # fp32 params + Adam's two moments cannot fit
        assert row["vm_peak"] <= cap
        assert (row["initial"], row["final"]) == (uncapped["initial"], uncapped["final"])
    assert uncapped["initial"] != uncapped["final"]
