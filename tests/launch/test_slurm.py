"""``sbatch launch/slurm.sbatch`` on real SLURM (Slurm's own daemons, brought up for the test): one node and two.

Skipped, with the reason, where slurm-wlm and munge are not installed (``.ci/run``
installs them when it runs as root) or namespace nodes cannot be made.
``tests/launch/test_robustness.py`` runs the same script under a stand-in ``srun``.
"""

import os
import sys

import pytest
from cluster.nodes import TCP_ENV, cluster_or_skip
from mpirun import ROOT, run_mpi_ok
from slurm.daemons import SlurmNode, local_node, pids_with_env, slurm_cluster, unavailable_reason

TRAIN = ["train", "--steps", "3", "--global-batch", "32", "--micro-batches", "8", "--stage", "3"]
JOB_ENV = {
    "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
    "PYTHONPATH": str(ROOT),
    "PYTHON": sys.executable,
}


def skip_without_slurm() -> None:
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"no SLURM: {reason}")


@pytest.fixture(scope="module")
def one_node():
    skip_without_slurm()
    with slurm_cluster([local_node()]) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("reference") / "one-rank.npy"
    run_mpi_ok(1, ["-m", "mpizero", *TRAIN, "--save-params", str(path)])
    return path.read_bytes()


def submit(cluster, sbatch_args: list[str], command: list[str], env: dict | None = None, timeout: float = 90):
    """``sbatch SBATCH_ARGS launch/slurm.sbatch COMMAND`` from the repository root; (final state, job output)."""
    return cluster.sbatch([*sbatch_args, "launch/slurm.sbatch", *command], timeout, {**JOB_ENV, **(env or {})}, ROOT)


def train_bitwise(cluster, tmp_path, reference: bytes, nodes: int, per_node: int, env: dict | None = None) -> str:
    """Train through the script on ``nodes`` x ``per_node`` ranks; assert its parameters are the 1-rank bytes."""
    params = tmp_path / f"params-{nodes}x{per_node}.npy"
    layout = [f"--nodes={nodes}", f"--ntasks-per-node={per_node}"]
    state, out = submit(cluster, layout, [*TRAIN, "--save-params", str(params)], env)
    assert state == "COMPLETED", out + cluster.logs()
    assert params.read_bytes() == reference, out
    return out


def test_one_node_cluster_trains_bitwise_through_the_sbatch_script(one_node, tmp_path, reference):
    out = train_bitwise(one_node, tmp_path, reference, nodes=1, per_node=4)
    assert "1 node(s), 4 ranks, " in out and "/mpiexec -n 4, MPICH" in out  # the wheel's Hydra
    assert "stage 3, 4 ranks" in out and "1 node, MPI: MPICH" in out


def test_one_node_cluster_runs_a_users_script_through_the_sbatch_script(one_node):
    state, out = submit(one_node, ["--ntasks=2"], ["examples/quickstart.py"])
    assert state == "COMPLETED", out + one_node.logs()
    assert "w [ 2.  -1.   0.5] b [0.3]" in out and "'params': 8," in out  # rank 0 holds 2 of the 4 floats


def test_the_script_says_when_python_cannot_import_mpizero(one_node):
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": "", "PYTHON": "python3"}
    state, out = submit(one_node, ["--ntasks=1"], ["example"], env)
    assert state == "FAILED"
    assert "'python3' on" in out and "cannot import mpizero and mpi4py: activate the virtual environment" in out


def test_srun_without_a_pmi_is_refused_rather_than_run_as_singletons(one_node):
    state, out = submit(one_node, ["--ntasks=3"], ["example"], {"MPIZERO_SRUN_MPI": "none"})
    assert state == "FAILED"
    assert "1-rank MPI world, but the launcher started more" in out


def test_two_node_cluster_trains_bitwise_through_the_sbatch_script(tmp_path, reference):
    skip_without_slurm()
    with cluster_or_skip(2) as namespaces:
        nodes = [
            SlurmNode(n.name, n.address, lambda argv, i=n.index: namespaces.command(i, argv)) for n in namespaces.nodes
        ]
        with slurm_cluster(nodes) as cluster:
            for per_node in (2, 4, 4):
                out = train_bitwise(cluster, tmp_path, reference, nodes=2, per_node=per_node, env=TCP_ENV)
                assert f"2 node(s), {2 * per_node} ranks" in out and "2 nodes, MPI: MPICH" in out
    assert not pids_with_env("SLURM_CONF", str(cluster.conf)), "a daemon or rank outlived the cluster"
    assert not cluster.root.exists()
