"""Checking one's own model (mpizero.torch.check, python -m mpizero check) and the GPT-2 recipe example: the same
bytes at every world size, and a difference named when a recipe breaks the promise."""

import re

import numpy as np
import pytest
from mpirun import ROOT, run_mpi, run_mpi_ok

pytest.importorskip("torch", reason="mpizero.torch needs torch: add its CPU build (docs/getting-started.md)")
pytest.importorskip("transformers", reason="the GPT-2 recipe needs transformers: pip install transformers")

EXAMPLE = str(ROOT / "examples" / "gpt2_recipe.py")


@pytest.mark.parametrize("n", [3])  # its bytes at 1 and 4 ranks: the example's own test below
def test_check_finds_the_gpt2_recipe_bitwise_at_every_stage(n):
    out = run_mpi_ok(n, ["-m", "mpizero", "check", f"{EXAMPLE}:recipe", "--steps", "2"], timeout=300)
    assert len(re.findall(r"^stage \d  ranks \d  bitwise: 2 steps", out, re.M)) == 4, out


def test_check_names_the_first_difference_of_a_recipe_that_depends_on_the_rank(tmp_path):
    recipe = tmp_path / "ranked.py"
    recipe.write_text(
        "import torch\nfrom mpi4py import MPI\nfrom mpizero.torch import Recipe\n\n"
        "def recipe():\n"
        "    torch.manual_seed(0)\n"
        "    model = torch.nn.Linear(3, 2)\n"
        "    batch = lambda step, index: torch.full((2, 3), float(index + MPI.COMM_WORLD.rank))  # a bug\n"
        "    loss = lambda model, x: model(x).square().mean()\n"
        "    return Recipe(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, loss, micro_batches=2)\n"
    )
    done = run_mpi(2, ["-m", "mpizero", "check", f"{recipe}:recipe", "--stage", "1"], timeout=120)
    assert done.returncode == 1 and re.search(r"MISMATCH at step 1: master (weight|bias)\[", done.stdout), done


def test_check_refuses_a_recipe_it_cannot_import():
    done = run_mpi(1, ["-m", "mpizero", "check", "no_such_module:recipe"], timeout=60)
    assert done.returncode == 2 and "cannot import 'no_such_module'" in done.stderr, done


@pytest.fixture(scope="module")
def example_runs():
    return {}


@pytest.mark.parametrize("n", [1, 4])  # 2 ranks: test_torch_users.py's GPT-2; 3: the check above
def test_the_gpt2_example_trains_to_the_same_bytes_at_1_and_4_ranks(n, example_runs, tmp_path):
    args = [EXAMPLE, "--steps", "3", "--micro-batches", "4", "--width", "64", "--checkpoint-dir", str(tmp_path)]
    log = run_mpi_ok(n, [*args, "--checkpoint-every", "3"], timeout=300)
    assert re.search(r"^step    2  loss \d", log, re.M), log  # the global loss, on rank 0
    (saved,) = tmp_path.glob("ckpt-*")
    run_mpi_ok(1, ["-m", "mpizero", "consolidate", str(saved), str(tmp_path / "params.npz")], timeout=120)
    with np.load(tmp_path / "params.npz") as found:
        example_runs[n] = {name: found[name].tobytes() for name in found.files}
    assert example_runs[n] == example_runs[min(example_runs)], f"-n {n} differs from -n {min(example_runs)}"
