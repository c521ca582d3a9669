"""How buffers travel (comm/transports/) under real mpiexec at 1-4 ranks, with a stand-in device array."""

import pytest
from mpirun import WORLD_SIZES, run_mpi_ok


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_staging_paths_give_host_mpi_bytes_and_one_rank_moves_nothing(n):
    assert "transport checks ok" in run_mpi_ok(n, ["-m", "mpi4py", "tests/comm/check_transport.py"])


def test_the_collectives_benchmark_times_both_round_wires():
    """benchmarks/bench_collectives.py runs as its docstring says and prints the int64 and float32 round rows."""
    out = run_mpi_ok(2, ["benchmarks/bench_collectives.py", "--sizes-mib", "1", "--repeat", "1"], timeout=120)
    rows = {line[7:49].strip(): line.split()[-3:] for line in out.splitlines()[2:]}
    for name in ("exact round, i64 wire: encode+RS", "exact round, f32 wire: encode+A2A+widen"):
        seconds, rate, ratio = (float(v) for v in rows[name])
        assert seconds > 0 and rate > 0 and ratio > 0, rows[name]
