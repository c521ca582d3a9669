"""The disk tier (``DiskOffload``) under real mpiexec at 1-4 ranks: same bytes as in memory and as the
reference, states on disk between steps, checkpoints across tiers and stages, agreed errors."""

import io
import json
import os
import re

import numpy as np
import pytest
from checkpoint_runs import train
from mpirun import WORLD_SIZES, run_mpi, run_mpi_ok

from mpizero import DiskOffload, ZeroConfig

CHECKS = ["-m", "mpi4py", "tests/core/check_offload.py"]


@pytest.fixture(scope="module")
def digests(tmp_path_factory):
    return {n: run_mpi_ok(n, [*CHECKS, str(tmp_path_factory.mktemp(f"offload{n}"))]) for n in WORLD_SIZES}


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_offload_checks_pass(digests, n):
    assert digests[n].endswith("offload checks ok\n"), digests[n]


def test_an_offloaded_run_gives_the_same_bytes_at_every_world_size(digests):
    assert len({out.split()[1] for out in digests.values()}) == 1, digests


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Four steps in memory, in one go: what every offloaded run below must give byte for byte."""
    path = tmp_path_factory.mktemp("straight") / "params.npy"
    train(2, 3, 4, "--save-params", path)
    return path.read_bytes()


@pytest.mark.parametrize(("n", "stage"), [(1, 0), (3, 2), (4, 3)])
def test_train_with_an_offload_dir_gives_the_in_memory_bytes(tmp_path, straight, n, stage):
    """Its parameters, and those its checkpoint (written from the offload files) consolidates to."""
    out, offload, ckpt, full = tmp_path / "params.npy", tmp_path / "offload", tmp_path / "ckpt", tmp_path / "full.npz"
    log = train(
        n, stage, 4, "--offload-dir", offload, "--save-params", out, "--checkpoint-dir", ckpt, "--checkpoint-every", 4
    )
    assert out.read_bytes() == straight, log
    assert "memory on rank 0:  params" in log and " on disk " in log, log
    assert os.listdir(offload) == []  # every rank's directory removed at exit
    run_mpi_ok(1, ["-m", "mpizero", "consolidate", str(ckpt / "ckpt-00000004"), str(full)])
    with np.load(full, allow_pickle=False) as saved:
        flat = np.concatenate([saved[name].reshape(-1) for name in saved.files])
    assert flat.tobytes() == np.load(io.BytesIO(straight), allow_pickle=False).tobytes()


def test_kill_9_in_an_offloaded_update_resumes_to_the_same_bytes(tmp_path, straight):
    """Rank 1 dies with its states half written back; the run resumes from its last checkpoint, offloaded."""
    directory, out, offload = tmp_path / "ckpt", tmp_path / "resumed.npy", tmp_path / "offload"
    saving = ["--checkpoint-dir", directory, "--checkpoint-every", 2, "--offload-dir", offload]
    killed = train(3, 3, 4, *saving, ok=False, env={"MPIZERO_KILL_AT": "update:3:1"})
    assert killed.returncode != 0 and len(os.listdir(offload)) == 3, killed.stderr  # left behind
    train(2, 2, 4, "--resume", directory, "--offload-dir", offload, "--save-params", out)
    assert out.read_bytes() == straight
    assert os.listdir(offload) == []  # the killed run's directories went at the next start on this host


def test_an_offload_dir_inside_a_checkpoint_is_refused_before_any_work(tmp_path):
    directory = tmp_path / "ckpt"
    train(2, 1, 2, "--checkpoint-dir", directory, "--checkpoint-every", 2)
    refused = train(2, 1, 2, "--offload-dir", directory / "ckpt-00000002" / "here", ok=False)
    assert refused.returncode == 2
    assert "--offload-dir" in refused.stderr and "lies inside the checkpoint" in refused.stderr, refused.stderr


def torch_run(stage: int, steps: int = 3, **settings):
    """A torch recipe (AdamW, StepLR, clip_grad_norm_, two backward passes a step) on one rank; its sharded model
    and optimizer."""
    import torch

    import mpizero.torch as zt

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    zero = zt.shard(model, optimizer, stage=stage, **settings)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)
    for step in range(steps):
        for m in range(2):
            model(torch.full((3, 8), 0.1 * (step + m + 1))).pow(2).sum().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
    return zero, optimizer


@pytest.mark.parametrize("stage", [0, 3])
def test_a_torch_recipe_offloaded_gives_the_in_memory_bytes_and_state_dicts(tmp_path, stage):
    import torch

    zero, optimizer = torch_run(stage)
    offloaded, offloaded_optimizer = torch_run(stage, offload=DiskOffload(str(tmp_path)))
    masters = {name: a.tobytes() for name, a in zero.master_params().items()}
    assert {name: a.tobytes() for name, a in offloaded.master_params().items()} == masters
    state, offloaded_state = optimizer.state_dict()["state"], offloaded_optimizer.state_dict()["state"]
    assert all(torch.equal(state[i][k], offloaded_state[i][k]) for i in state for k in state[i])
    fresh, fresh_optimizer = torch_run(stage, steps=0, offload=DiskOffload(str(tmp_path)))
    fresh_optimizer.load_state_dict(optimizer.state_dict())  # into the offload file
    fresh.load_state_dict(zero.state_dict())
    assert {name: a.tobytes() for name, a in fresh.master_params().items()} == masters
    assert all(torch.equal(state[i][k], fresh_optimizer.state_dict()["state"][i][k]) for i in state for k in state[i])


OFFLOAD_CAP_MIB = 850  # measured at -n 2: offloaded, at most 733 MiB of address space a rank; in memory, 965
BIG = ["benchmarks/bench_bigmodel.py", "--worker", "--model", "mlp", "--width", "2048", "--layers", "12"]
BIG += ["--steps", "2", "--micro-batches", "2", "--batch", "1"]


def test_under_a_cap_the_in_memory_run_exceeds_the_offloaded_run_trains_to_its_bytes(tmp_path):
    """The small version of ``bench_bigmodel.py --offload-dir``: 46M parameters at -n 2 under an address-space cap
    that the in-memory run exceeds; offloaded, they train to the bytes of an uncapped in-memory run."""
    capped = ["-m", "mpi4py", "tests/training/capped.py", str(OFFLOAD_CAP_MIB), *BIG]
    in_memory = run_mpi(2, capped, timeout=90)
    assert in_memory.returncode != 0 and "Unable to allocate" in in_memory.stderr, in_memory.stderr[-2000:]
    offloaded = big_rows(run_mpi_ok(2, [*capped, "--offload-dir", str(tmp_path)], timeout=90))
    uncapped = big_rows(run_mpi_ok(2, ["-m", "mpi4py", *BIG], timeout=90))
    for row, twin in zip(offloaded, uncapped, strict=True):
        assert row["vm_peak"] <= OFFLOAD_CAP_MIB << 20 < twin["vm_peak"]
        assert (row["initial"], row["final"]) == (twin["initial"], twin["final"])
        assert row["read_bytes"] == row["written_bytes"] > 0  # in: moments, gradient; out: gradient, then moments
    assert uncapped[0]["initial"] != uncapped[0]["final"]


def big_rows(out: str) -> list[dict]:
    return sorted((json.loads(line) for line in out.splitlines() if line.startswith("{")), key=lambda r: r["rank"])


def test_estimate_offload_says_what_lives_on_disk_and_how_large_a_model_fits():
    out = run_mpi_ok(1, ["-m", "mpizero", "estimate", "--model", "mlp", "--ranks", "4", "--offload"] + FITS)
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line[:1].isdigit()}
    assert rows["3"][-3:] == ["20.0", "B", f"{8e9 / 20:.3g}"]  # 2 moments and the gradient, 4 bytes each; 8 of sums
    # stage 0: every rank its whole moments and gradient and 8 bytes of sums; the master is the params (float32)
    assert [row[-1] for row in rows.values()] == [f"{8e9 / per:.3g}" for per in (80, 20, 20, 20)]


FITS = ["--ram", "1e12", "--disk", "8e9"]  # memory to spare: the disk decides


def test_parameters_on_a_device_are_refused_at_the_door(tmp_path):
    """The tier keeps host arrays: a device engine (here the CPU stand-in for CuPy) is refused before set-up."""
    from mpizero import SGD, ZeroEngine, ZeroError, standin

    params = {"w": standin.asarray(np.ones(4, np.float32))}
    with pytest.raises(ZeroError, match="DiskOffload keeps host arrays, but the parameters live on the standin device"):
        ZeroEngine(params, SGD(lr=0.1), offload=DiskOffload(str(tmp_path)))
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda: ZeroConfig(offload="disk"), "offload must be DiskOffload(directory) or None, got 'disk'"),
        (lambda: DiskOffload(""), "DiskOffload needs a directory's path, got ''"),
        (lambda: DiskOffload(None), "DiskOffload needs a directory's path, got None"),
    ],
)
def test_the_offload_setting_is_typed(make, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        make()
