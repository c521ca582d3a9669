"""Several nodes: namespace nodes on this machine (``cluster/nodes.py``), MPI over TCP on a real link between them.

Each node has its own hostname, so MPI sees two nodes (``Split_type(COMM_TYPE_SHARED)`` splits them) and
mpizero takes its multi-node paths: two-level reduce-scatter and all-gather, or the flat one when asked.
Every test that trains checks bytes, not tolerances, and that the gradients really crossed the link.
Skipped, with the reason, where network namespaces cannot be made (not root, say).
"""

import dataclasses
import hashlib
import os
import re
import signal
import time

import numpy as np
import pytest
from cluster.nodes import NETNS_DIR, cluster_or_skip, kill_session, nodes
from mpirun import ROOT, rank_pids, run_mpi_ok

from mpizero.comm import paths
from mpizero.comm.traffic import Traffic
from mpizero.core import formulas
from mpizero.errors import ZeroError

WIDTH, STEPS = 96, 4
TRAIN = ["-m", "mpizero", "train", "--model", "mlp", "--width", str(WIDTH), "--global-batch", "24"]
TRAIN += ["--micro-batches", "6", "--log-every", "100"]
FLAT = {paths.ENV_VAR: "mpi"}
BESIDE = r"(\w+) ([\d.]+ \w+) \(formula ([\d.]+ \w+)\)"  # ``train``'s "op measured (formula predicted)"


@pytest.fixture(scope="module")
def cluster():
    with cluster_or_skip(2) as made:
        yield made


def run_ok(cluster, ranks_per_node, args, env=None, timeout=120, ranks=0) -> str:
    done = cluster.mpiexec(ranks_per_node, [str(a) for a in args], timeout=timeout, env=env, cwd=ROOT, ranks=ranks)
    assert done.returncode == 0, f"exit {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    return done.stdout


def train(cluster, ranks_per_node, stage, steps, *extra, env=None, ranks=0) -> str:
    return run_ok(cluster, ranks_per_node, [*TRAIN, "--stage", stage, "--steps", steps, *extra], env, ranks=ranks)


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def link_sent(cluster, node: int = 1) -> int:
    return cluster.link_bytes(node)[0]


def gradient_bytes_per_step(parameters: int, ranks: int = 4, nodes: int = 2, two_level: bool = True) -> int:
    """Exact-reduction gradient bytes one node must send to the other per step (one round): ranks/nodes ranks'
    share of the node's int64 sums (two levels), or of every rank's float32 round (flat)."""
    padded = -(-parameters // ranks) * ranks
    return paths.inter_node_bytes(padded * (8 if two_level else 4), ranks, nodes, two_level) * (ranks // nodes)


def parameters(log: str) -> int:
    return int(log.split(" parameters")[0].rsplit(" ", 1)[1].replace(",", ""))


# Plain tests: the settling of the path and the formulas, without namespaces.


def test_two_level_is_settled_only_for_even_multi_rank_nodes_on_host_buffers():
    assert paths.settle_reduce_scatter("auto", 2, False, (2, 2)) == "two-level"
    assert paths.settle_reduce_scatter("auto", 3, False, (4, 4, 4)) == "two-level"
    assert paths.settle_reduce_scatter("auto", 2, False, (1, 1)) == "mpi+pieces"
    assert paths.settle_reduce_scatter("auto", 2, False, (1, 3)) == "mpi+pieces"
    assert paths.settle_reduce_scatter("auto", 2, True, (2, 2)) == "mpi+pieces"
    assert paths.settle_reduce_scatter("auto", 1, False, (4,)) == "shared"
    assert paths.settle_reduce_scatter("mpi", 2, False, (2, 2)) == "mpi"
    with pytest.raises(ZeroError, match=r"two-level needs .* but the ranks per node are \[1, 3\]"):
        paths.settle_reduce_scatter("two-level", 2, False, (1, 3))
    with pytest.raises(ZeroError, match="two-level needs .* but the buffers are on the GPU"):
        paths.settle_reduce_scatter("two-level", 2, True, (2, 2))


def test_inter_node_bytes_fall_to_one_over_ranks_per_node():
    full = 3 << 20
    assert paths.inter_node_bytes(full, 4, 1, False) == 0
    assert paths.inter_node_bytes(full, 4, 2, False) == full // 2  # flat: to the 2 of 3 peers elsewhere
    assert paths.inter_node_bytes(full, 4, 2, True) == full // 4
    assert paths.inter_node_bytes(full, 12, 3, True) * 4 == paths.inter_node_bytes(full, 12, 3, False)
    traffic = Traffic()
    traffic.record("reduce_scatter", full, 4, nodes=2, two_level=True)
    assert traffic.sent["reduce_scatter"] == 3 * full // 4 and traffic.inter_node["reduce_scatter"] == full // 4
    assert traffic.intra_node("reduce_scatter") == full // 2


def test_setup_predicts_inter_node_traffic_by_level():
    flat = formulas.Setup((1000, 24), ranks=4, stage=2, nodes=2)
    two = formulas.Setup((1000, 24), ranks=4, stage=2, nodes=2, two_level=True)
    by_flat, by_two = formulas.inter_node_per_step(flat), formulas.inter_node_per_step(two)
    # flat: one round's exact values cross as float32 (4 bytes); two levels: the node's int64 sums, a quarter each
    assert by_flat["reduce_scatter"] == 1024 * 4 // 2 and by_two["reduce_scatter"] == 1024 * 8 // 4
    assert by_two["allgather"] * 2 == by_flat["allgather"] > 0


def test_kept_units_gather_once_a_step_and_hold_every_units_params_off_one_host():
    across = formulas.Setup((1000, 24), ranks=4, stage=3, nodes=2, two_level=True)
    kept = dataclasses.replace(across, keep_gathered=True)
    gathered = {rounds: formulas.inter_node_per_step(across, rounds)["allgather"] for rounds in (1, 3)}
    once = {rounds: formulas.inter_node_per_step(kept, rounds)["allgather"] for rounds in (1, 3)}
    assert gathered[3] == 3 * gathered[1] == 6 * once[1] == 6 * once[3] > 0  # forward and backward, each round
    assert formulas.kept_bytes(kept) == (1000 + 24) * 4 and formulas.kept_bytes(across) == 0
    one_host = formulas.Setup((1000, 24), ranks=4, stage=3, shared_memory=True, keep_gathered=True)
    assert formulas.kept_bytes(one_host) == 0  # read in place
    assert formulas.kept_bytes(dataclasses.replace(kept, stage=2)) == 0  # the full params are always held there


# On namespace nodes.


def test_nodes_are_made_apart_and_always_torn_down():
    with cluster_or_skip(2) as first:
        with pytest.raises(RuntimeError, match="inside the block"), nodes(3) as second:
            assert not set(netns_names(first)) & set(netns_names(second))
            shown = second.run(2, ["sh", "-c", "hostname; grep node0 /etc/hosts"]).stdout.split()
            assert shown == ["node2", second.nodes[0].address, "node0"]
            raise RuntimeError("inside the block")
        assert not any((NETNS_DIR / name).exists() for name in netns_names(second))
        assert all((NETNS_DIR / name).exists() for name in netns_names(first))
    assert not any((NETNS_DIR / name).exists() for name in netns_names(first))


def netns_names(cluster) -> list[str]:
    return [cluster.bridge_netns, *(n.netns for n in cluster.nodes)]


def test_two_level_collectives_are_flat_bits_and_cross_the_link(cluster):
    before = link_sent(cluster)
    out = run_ok(cluster, [2, 2], ["-m", "mpi4py", "tests/launch/cluster/levels_check.py"])
    assert "two-level ok two-level 2" in out
    assert link_sent(cluster) - before > 40_000 * 8 // 2  # at least the largest int64 reduce-scatter's share


def test_two_level_holds_with_ranks_dealt_round_the_nodes(cluster, tmp_path):
    """Ranks 0 and 2 on node 0, 1 and 3 on node 1: local index and block order no longer agree."""
    out = run_ok(cluster, [1, 1], ["-m", "mpi4py", "tests/launch/cluster/levels_check.py"], ranks=4)
    assert "two-level ok two-level 2" in out
    for label, ranks_per_node, ranks in (("dealt", [1, 1], 4), ("one", [1], 0)):
        train(cluster, ranks_per_node, 3, 2, "--save-params", tmp_path / f"{label}.npy", ranks=ranks)
    assert sha256(tmp_path / "dealt.npy") == sha256(tmp_path / "one.npy")


def test_two_level_holds_on_three_nodes():
    with cluster_or_skip(3) as three:
        for ranks_per_node, ranks in (([2, 2, 2], 0), ([1, 1, 1], 6)):
            out = run_ok(three, ranks_per_node, ["-m", "mpi4py", "tests/launch/cluster/levels_check.py"], ranks=ranks)
            assert "two-level ok two-level 3" in out


def test_verify_is_bitwise_at_2x2(cluster):
    out = run_ok(cluster, [2, 2], ["-m", "mpizero", "verify", "--stage", "all"])
    assert out.count(": bitwise") == 4 and "ranks 4" in out, out


def test_train_params_are_byte_identical_at_2x2_1x4_and_1(cluster, tmp_path):
    digests, crossed = {}, {}
    for label, per_node, env in (("1", [1], None), ("1x4", [4], None), ("2x2", [2, 2], None), ("flat", [2, 2], FLAT)):
        before = link_sent(cluster)
        log = train(cluster, per_node, 2, STEPS, "--save-params", tmp_path / f"{label}.npy", env=env)
        digests[label], crossed[label] = sha256(tmp_path / f"{label}.npy"), link_sent(cluster) - before
    assert len(set(digests.values())) == 1, digests
    assert crossed["1x4"] < 10_000, crossed  # one node: nothing to send
    grads = STEPS * gradient_bytes_per_step(parameters(log))
    assert crossed["2x2"] >= grads, (crossed, grads)
    assert crossed["flat"] >= STEPS * gradient_bytes_per_step(parameters(log), two_level=False), crossed
    assert crossed["2x2"] < crossed["flat"], crossed  # the gathers cross once per node pair, not per rank


def test_stage_3_kept_gathered_is_byte_identical_and_gathers_once_a_step_across(cluster, tmp_path):
    """``train --keep-gathered``: the same bytes, one all-gather of each unit a step across the link, not two a
    round (6 micro-batches at 4 ranks: 2 rounds), as the formula says; the torch bridge's option across hosts."""
    crossed = {}
    for label, extra in (("each-pass", []), ("kept", ["--keep-gathered"])):
        before = link_sent(cluster)
        log = train(cluster, [2, 2], 3, STEPS, "--save-params", tmp_path / f"{label}.npy", *extra)
        crossed[label] = link_sent(cluster) - before
        across = re.findall(BESIDE, log.split("to other nodes:")[1].splitlines()[0])
        assert [op for op, _, _ in across] == ["reduce_scatter", "allreduce", "allgather"], log
        assert all(measured == formula for _, measured, formula in across), (label, across)  # kept: 1 a step
    assert sha256(tmp_path / "each-pass.npy") == sha256(tmp_path / "kept.npy")
    assert crossed["kept"] < crossed["each-pass"], crossed
    out = run_ok(cluster, [2, 2], ["-m", "mpi4py", "tests/torch_bridge/torch_kept.py"], timeout=180)
    for check in ("gathers", "join", "edits", "refused"):  # "edits": gathered into buffers of the ranks' own
        assert f"{check} ok" in out, out


def test_a_rank_joined_at_stage_3_ends_each_gather_with_the_others_across_nodes(cluster):
    """A rank with no micro-batch in a step serves the others' gathers from ``join()``, each ending at once; their
    prefetches end at once too, in step with it (the two-level all-gather ends with a node-wide copy): the job
    hung in that copy before. The bytes are one rank's."""
    script = ["-m", "mpi4py", "tests/torch_bridge/torch_idle_rank.py"]
    digests = {}
    for label, out in (("2x2", run_ok(cluster, [2, 2], script)), ("1", run_mpi_ok(1, script))):
        digests[label] = dict(re.findall(r"^digest (\d) (\w+)$", out, re.M))
    assert sorted(digests["1"]) == ["2", "3"] and digests["2x2"] == digests["1"], digests


def test_native_reduction_is_deterministic_at_2x2(cluster, tmp_path):
    for run in ("a", "b"):
        train(cluster, [2, 2], 3, 2, "--reduction", "native", "--save-params", tmp_path / f"{run}.npy")
    assert sha256(tmp_path / "a.npy") == sha256(tmp_path / "b.npy")


def test_resume_across_a_node_count_change_is_byte_identical(cluster, tmp_path):
    checkpoints, resumed, straight = tmp_path / "ckpt", tmp_path / "resumed.npy", tmp_path / "straight.npy"
    train(cluster, [2, 2], 3, 2, "--checkpoint-dir", checkpoints, "--checkpoint-every", 2)
    log = train(cluster, [2], 3, STEPS, "--resume", checkpoints, "--save-params", resumed)
    assert "2 ranks" in log, log
    train(cluster, [2, 2], 3, STEPS, "--save-params", straight)
    assert sha256(resumed) == sha256(straight)
    assert np.load(resumed).size == parameters(log)


def test_a_rank_killed_on_the_other_node_ends_the_whole_job(cluster):
    proc, ranks = cluster.start_mpiexec([2, 2], [*TRAIN, "--stage", "2", "--steps", "100000"], cwd=ROOT), {}
    try:
        ranks = wait_for_ranks(proc, 4)
        victim = ranks[3]
        assert os.readlink(f"/proc/{victim}/ns/net") == f"net:[{os.stat(NETNS_DIR / cluster.nodes[1].netns).st_ino}]"
        time.sleep(1.0)  # let it train
        os.kill(victim, signal.SIGKILL)
        started = time.monotonic()
        proc.communicate(timeout=60)
        assert proc.returncode != 0
        while any(alive(pid) for pid in ranks.values()) and time.monotonic() - started < 30:
            time.sleep(0.1)  # the proxies are still killing their ranks
        survivors = [pid for pid in ranks.values() if alive(pid)]
        assert not survivors, f"ranks {survivors} outlived the job by 30 s"
    finally:
        kill_session(proc)
        for pid in filter(alive, ranks.values()):
            os.kill(pid, signal.SIGKILL)  # ours, left by a failed assertion


def wait_for_ranks(proc, count: int, seconds: float = 60) -> dict[int, int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        ranks = rank_pids(proc)
        if len(ranks) == count:
            return ranks
        assert proc.poll() is None, f"mpiexec ended early: {proc.communicate()}"
        time.sleep(0.2)
    raise AssertionError(f"{count} ranks did not start within {seconds}s")


def alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
