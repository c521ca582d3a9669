"""torch.compile on a sharded model works at stages 0-3 and gives the same bytes at every world size."""

import re

import pytest
from mpirun import run_mpi_ok

pytest.importorskip("torch", reason="mpizero.torch needs torch: add its CPU build (docs/getting-started.md)")


@pytest.fixture(scope="module")
def runs():
    return {}


@pytest.mark.parametrize("n", [1, 2])
def test_compiled_models_give_the_same_bytes_at_every_world_size(n, runs):
    out = run_mpi_ok(n, ["-m", "mpi4py", "tests/torch_bridge/torch_compile.py"], timeout=600)
    runs[n] = dict(re.findall(r"^digest (\d) (\w+)$", out, re.M))
    assert sorted(runs[n]) == ["0", "1", "2", "3"], out
    assert runs[n] == runs[min(runs)], f"-n {n} differs from -n {min(runs)} (stage by stage)"
