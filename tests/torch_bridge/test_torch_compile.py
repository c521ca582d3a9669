"""torch.compile on a sharded model works at stages 0-3: compiled whole, the same bytes at every world size stage
by stage; compiled unit by unit, one digest at every stage and world size."""

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
    found = re.findall(r"^digest (\w+) (\d) (\w+) (True|False)$", out, re.M)
    runs[n] = {(how, stage): digest for how, stage, digest, _ in found}
    warned = [(how, stage) for how, stage, _, said in found if said == "True"]
    assert warned == [("whole", "3")], found  # said where the bytes differ from stages 0-2's, nowhere else
    assert sorted(runs[n]) == [(how, str(stage)) for how in ("units", "whole") for stage in range(4)], out
    assert runs[n] == runs[min(runs)], f"-n {n} differs from -n {min(runs)} (stage by stage)"
    assert len({runs[n]["units", str(stage)] for stage in range(4)}) == 1, runs[n]  # one digest at every stage
