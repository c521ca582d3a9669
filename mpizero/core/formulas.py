"""Predicted bytes per rank and per-step traffic: the ZeRO paper's formulas and mpizero's exact ones.

The paper (Rajbhandari et al., 2020) counts model states for mixed-precision
Adam with K = 12 bytes of optimizer state per parameter (fp32 master, momentum,
variance): baseline (2 + 2 + K)Psi, stage 1 2Psi + 2Psi + K Psi/N, stage 2
2Psi + (2 + K)Psi/N, stage 3 (2 + 2 + K)Psi/N. mpizero's own prediction counts
its buffers exactly, padding included, kind by kind as ``memory`` names them.

Across nodes (``nodes`` > 1, ``node_ranks`` ranks on each), a collective on a
full buffer of F bytes over N = nodes * node_ranks ranks sends F(N-1)/N per
rank in all. On the flat path, (N - node_ranks)/(N-1) of that goes to ranks on
other nodes: F(N - node_ranks)/N. On the two-level path a rank sends only its
node's partial sums of the blocks of its across communicator, F/node_ranks
bytes, reduce-scattered over ``nodes`` ranks: F(nodes-1)/N across nodes; the
rest, F(node_ranks-1)/N, stays inside the node (shared memory).
"""

from __future__ import annotations

from dataclasses import dataclass

from mpizero.core.partition import Partition
from mpizero.core.stages import GradientCollective, ShardPlan, sharding, span

PAPER_K = 12


def paper_model_states(psi: float, ranks: int, k: int = PAPER_K) -> dict[str, float]:
    """Model-state bytes per rank for each configuration of the paper's Figure 1."""
    return {
        "baseline": (2 + 2 + k) * psi,
        "stage 1 (Pos)": 2 * psi + 2 * psi + k * psi / ranks,
        "stage 2 (Pos+g)": 2 * psi + (2 + k) * psi / ranks,
        "stage 3 (Pos+g+p)": (2 + 2 + k) * psi / ranks,
    }


@dataclass(frozen=True)
class Setup:
    """What mpizero's buffer sizes depend on."""

    group_numels: tuple[int, ...]
    ranks: int
    stage: int
    param_bytes: int = 4
    wire_bytes: int = 8
    optimizer_states: int = 2
    align: int = 1
    shared_arena: bool = False  # stages 2-3 on one host: one bucket-sized shared buffer for gradients
    nodes: int = 1
    two_level: bool = False  # reduce-scatters and all-gathers in two levels (inside nodes, then across)

    def partitions(self) -> list[Partition]:
        return [Partition(n, self.ranks, self.align) for n in self.group_numels]

    def plans(self) -> list[ShardPlan]:
        """Rank 0's plan for each group (every rank holds the same number of elements)."""
        return [ShardPlan(sharding(self.stage), p, 0) for p in self.partitions()]


def engine_bytes(setup: Setup) -> dict[str, int]:
    """Bytes each rank holds between steps, by kind, as ``ZeroEngine.memory()`` reports them."""
    plans = setup.plans()
    owned = sum(span(p.owned_range) for p in plans)
    return {
        "params": sum(span(p.params_range) for p in plans) * setup.param_bytes,
        "gathered": 0,
        "grads": owned * 4,
        "master": owned * 4,
        "optimizer": owned * 4 * setup.optimizer_states,
        "comm": _comm_bytes(setup, plans),
    }


def _comm_bytes(setup: Setup, plans: list[ShardPlan]) -> int:
    """Kept local gradient buffers (stages 0-1), or else the shared arena of the largest bucket, if any."""
    kept = sum(p.partition.padded_numel for p in plans if p.keeps_local_grads)
    if kept or not setup.shared_arena:
        return kept * setup.wire_bytes
    return max(p.partition.padded_numel for p in plans) * setup.wire_bytes


def traffic_per_step(setup: Setup, rounds: int = 1) -> dict[str, int]:
    """Bytes each rank sends per step, by collective (ring volumes: (N-1)/N of the full buffer per pass).

    ``rounds``: micro-batch rounds per step; stage 3 gathers every unit twice per round.
    """
    n = setup.ranks
    sent = {"reduce_scatter": 0, "allreduce": 0, "allgather": 0}
    for plan in setup.plans():
        padded = plan.partition.padded_numel
        wire, params = padded * setup.wire_bytes, padded * setup.param_bytes
        if plan.gradient_collective is GradientCollective.ALLREDUCE:
            sent["allreduce"] += 2 * wire * (n - 1) // n
        else:
            sent["reduce_scatter"] += wire * (n - 1) // n
        sent["allgather"] += plan.allgathers_per_step(rounds) * (params * (n - 1) // n)
    return sent


def inter_node_bytes(full_bytes: int, ranks: int, nodes: int, two_level: bool, factor: int = 1) -> int:
    """Bytes one rank sends to other nodes in one collective on ``full_bytes`` (``factor`` 2: all-reduce).

    Assumes ``ranks // nodes`` ranks per node (the flat path's share is exact for pairwise exchange).
    """
    if nodes <= 1:
        return 0
    if two_level:
        return factor * full_bytes * (nodes - 1) // ranks
    return factor * full_bytes * (ranks - ranks // nodes) // ranks


def inter_node_per_step(setup: Setup, rounds: int = 1) -> dict[str, int]:
    """Bytes each rank sends to other nodes per step, by collective (see ``inter_node_bytes``)."""
    n, nodes, sent = setup.ranks, setup.nodes, {"reduce_scatter": 0, "allreduce": 0, "allgather": 0}
    for plan in setup.plans():
        padded = plan.partition.padded_numel
        wire, params = padded * setup.wire_bytes, padded * setup.param_bytes
        if plan.gradient_collective is GradientCollective.ALLREDUCE:
            sent["allreduce"] += inter_node_bytes(wire, n, nodes, False, factor=2)
        else:
            sent["reduce_scatter"] += inter_node_bytes(wire, n, nodes, setup.two_level)
        gathered = inter_node_bytes(params, n, nodes, setup.two_level)
        sent["allgather"] += plan.allgathers_per_step(rounds) * gathered
    return sent


def paper_traffic_elements(psi: float, ranks: int, stage: int) -> float:
    """The paper's per-rank volume in elements: 2Psi (stages 0-2) or 3Psi (stage 3), times (N-1)/N."""
    passes = 3 if sharding(stage).params else 2  # stage 3 also gathers parameters in backward
    return passes * psi * (ranks - 1) / ranks


def formula_setup(engine) -> Setup:
    """The ``Setup`` describing a live engine."""
    import numpy as np  # only to tell host buffers from device ones

    return Setup(
        tuple(g.layout.numel for g in engine.groups),
        engine.comm.Get_size(),
        engine.config.stage,
        engine.groups[0].param_dtype.itemsize,
        engine.reduction.wire_dtype.itemsize,
        len(engine.optimizer.state_names),
        engine.config.align,
        engine.collectives.shared and engine.groups[0].xp is np,
        engine.collectives.paths.nodes,
        engine.collectives.paths.two_level,
    )
