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

import pickle
from dataclasses import dataclass

from mpizero.comm.paths import inter_node_bytes
from mpizero.core.partition import Partition
from mpizero.core.reduce.reduction import REDUCTIONS
from mpizero.core.reduce.tally import FIXED_FIELDS
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
    round_bytes: int = 4  # a reduce-scatter of one round travels in this type, off shared memory (exact: float32)
    optimizer_states: int = 2
    align: int = 1
    shared_memory: bool = False  # ranks share one host's memory: gradients are summed out of shared windows
    nodes: int = 1
    two_level: bool = False  # reduce-scatters and all-gathers in two levels (inside nodes, then across)
    group_counts: tuple[int, ...] = ()  # how many groups of each size in ``group_numels`` (empty: one each)
    offloaded: bool = False  # the master, optimizer and grad shards live in files (``states``)
    keep_gathered: bool = False  # stage 3's units stay gathered through a step's rounds: gathered once a step

    @property
    def one_host(self) -> bool:
        """Whether every rank shares one host and keeps its states in memory: node-shared blocks are used."""
        return self.shared_memory and self.nodes == 1 and not self.offloaded

    def counts(self) -> tuple[int, ...]:
        return self.group_counts or (1,) * len(self.group_numels)

    def partitions(self) -> list[Partition]:
        return [Partition(n, self.ranks, self.align) for n in self.group_numels]

    def plans(self) -> list[ShardPlan]:
        """Rank 0's plan for each group (every rank holds the same number of elements)."""
        return [ShardPlan(sharding(self.stage), p, 0) for p in self.partitions()]

    def counted_plans(self) -> list[tuple[ShardPlan, int]]:
        """Each distinct group's plan and how many groups have it."""
        return list(zip(self.plans(), self.counts(), strict=True))


def engine_bytes(setup: Setup) -> dict[str, int]:
    """Bytes each rank holds between steps, by kind, as ``ZeroEngine.memory()`` reports them."""
    plans = setup.counted_plans()
    owned = sum(span(p.owned_range) * n for p, n in plans)
    in_memory = 0 if setup.offloaded else 1
    return {
        "params": sum(span(p.params_range) * n for p, n in plans) * setup.param_bytes,
        "gathered": 0,
        "grads": sum(_grad_bytes(setup, p) * n for p, n in plans) * in_memory,
        "master": sum(_master_bytes(setup, p) * n for p, n in plans) * in_memory,  # stage 3 fp32: counted as params
        "optimizer": owned * 4 * setup.optimizer_states * in_memory,
        "comm": _comm_bytes(setup, plans),
    }


def kept_bytes(setup: Setup) -> int:
    """Bytes of full params each rank keeps gathered through a step's passes (``Setup.keep_gathered``, stage 3),
    beside ``engine_bytes``: every group's, but where every rank shares one host and reads them in place."""
    if not setup.keep_gathered or (setup.shared_memory and setup.nodes == 1):  # node-shared: ``build.share_params``
        return 0
    return sum(p.partition.padded_numel * n for p, n in setup.counted_plans() if p.gathers_params) * setup.param_bytes


def offload_bytes(setup: Setup) -> dict[str, int]:
    """Offloaded: the bytes each rank keeps on disk (master, optimizer and grad shards, and room for the streamed
    sums between rounds), and the most it reads into memory at once during an update (the largest group's states,
    ``states.in_turn``)."""
    plans = setup.counted_plans()
    largest = max(_states_bytes(setup, p) for p, _ in plans)
    on_disk = sum((_states_bytes(setup, p) + span(p.owned_range) * setup.wire_bytes) * n for p, n in plans)
    return {"disk": on_disk, "in_memory_peak": largest}  # on disk, the streamed sums' room too


def _states_bytes(setup: Setup, plan: ShardPlan) -> int:
    """One group's fp32 master, optimizer state and grad shards, offloaded."""
    return _master_bytes(setup, plan) + span(plan.owned_range) * 4 * (setup.optimizer_states + 1)


def _grad_bytes(setup: Setup, plan: ShardPlan) -> int:
    """One group's averaged grad shard on this rank: its block of node-shared grads where every rank shares one
    host and needs them whole (stage 0: ``build.share_grads``), else the owned range."""
    return span(plan.shard_range if setup.one_host and plan.shares_averaged_grads else plan.owned_range) * 4


def _master_bytes(setup: Setup, plan: ShardPlan) -> int:
    """One group's separate fp32 master shard (none where it is the params themselves: float32, at every stage)."""
    return 0 if plan.master_is_params(setup.param_bytes) else span(plan.owned_range) * 4


def _comm_bytes(setup: Setup, plans: list[tuple[ShardPlan, int]]) -> int:
    """Kept local gradient buffers (stages 0-1); at stages 2-3 with every rank on one host, each group's
    accumulator of its owner sums (this rank's block of the streamed sum, ``comm.shared.OwnerSums``)."""
    kept = sum(p.partition.padded_numel * n for p, n in plans if p.keeps_local_grads)
    if kept:
        return kept * setup.wire_bytes
    if setup.one_host:  # offloaded: no owner sums
        return sum(span(p.shard_range) * n for p, n in plans) * setup.wire_bytes
    return 0


def traffic_per_step(setup: Setup, rounds: int = 1, reduce_each_round: bool | None = None) -> dict[str, int]:
    """Bytes each rank sends per step, by collective (ring volumes: (N-1)/N of the full buffer per pass).

    ``rounds``: micro-batch rounds per step; stage 3 gathers every unit twice per round (once a step where its
    units are kept gathered: ``Setup.keep_gathered``). ``reduce_each_round``:
    whether the trainer reduce-scatters every round (None: its default, ``ShardPlan.reduces_each_round``).
    """
    n = setup.ranks
    sent = {"reduce_scatter": 0, "allreduce": 0, "allgather": 0}
    for plan, count in setup.counted_plans():
        padded = plan.partition.padded_numel
        wire, params = padded * setup.wire_bytes, padded * setup.param_bytes
        if plan.gradient_collective is GradientCollective.ALLREDUCE:
            sent["allreduce"] += count * (2 * wire * (n - 1) // n)
        else:
            scatters, full = reduce_scatters(setup, plan, rounds, reduce_each_round)
            sent["reduce_scatter"] += count * scatters * (full * (n - 1) // n)
        sent["allgather"] += count * plan.allgathers_per_step(rounds, setup.keep_gathered) * (params * (n - 1) // n)
    return sent


def reduce_scatters(
    setup: Setup, plan: ShardPlan, rounds: int, reduce_each_round: bool | None = None
) -> tuple[int, int]:
    """One group's gradient collectives per step and the full buffer's bytes of each: one per round where the
    trainer reduces each round, narrow unless summed in shared memory (``GroupGradients._scatter_round``), else
    one of the kept local gradients."""
    each_round = plan.reduces_each_round if reduce_each_round is None else reduce_each_round
    if not each_round:
        return 1, plan.partition.padded_numel * setup.wire_bytes
    round_bytes = setup.wire_bytes if setup.shared_memory or setup.two_level else setup.round_bytes
    return rounds, plan.partition.padded_numel * round_bytes


def inter_node_per_step(setup: Setup, rounds: int = 1, reduce_each_round: bool | None = None) -> dict[str, int]:
    """Bytes each rank sends to other nodes per step, by collective (see ``inter_node_bytes``)."""
    n, nodes, sent = setup.ranks, setup.nodes, {"reduce_scatter": 0, "allreduce": 0, "allgather": 0}
    for plan, count in setup.counted_plans():
        padded = plan.partition.padded_numel
        wire, params = padded * setup.wire_bytes, padded * setup.param_bytes
        if plan.gradient_collective is GradientCollective.ALLREDUCE:
            sent["allreduce"] += count * inter_node_bytes(wire, n, nodes, False, factor=2)
        else:
            scatters, full = reduce_scatters(setup, plan, rounds, reduce_each_round)
            sent["reduce_scatter"] += count * scatters * inter_node_bytes(full, n, nodes, setup.two_level)
        gathered = inter_node_bytes(params, n, nodes, setup.two_level)
        sent["allgather"] += count * plan.allgathers_per_step(rounds, setup.keep_gathered) * gathered
    return sent


def paper_traffic_elements(psi: float, ranks: int, stage: int) -> float:
    """The paper's per-rank volume in elements: 2Psi (stages 0-2) or 3Psi (stage 3), times (N-1)/N."""
    passes = 3 if sharding(stage).params else 2  # stage 3 also gathers parameters in backward
    return passes * psi * (ranks - 1) / ranks


def formula_setup(engine, keep_gathered: bool = False) -> Setup:
    """The ``Setup`` describing a live engine (``keep_gathered``: its trainer's, ``Trainer.keep_gathered``)."""
    import numpy as np  # only to tell host buffers from device ones

    return Setup(
        tuple(g.layout.numel for g in engine.groups),
        engine.comm.Get_size(),
        engine.config.stage,
        engine.groups[0].param_dtype.itemsize,
        engine.reduction.wire_dtype.itemsize,
        engine.reduction.round_dtype.itemsize,
        len(engine.bound.state_names),
        engine.config.align,
        engine.collectives.shared and engine.groups[0].xp is np,
        engine.collectives.paths.nodes,
        engine.collectives.paths.two_level,
        offloaded=engine.config.offload is not None,
        keep_gathered=keep_gathered,
    )


# Collective calls and agreement bytes: what grows with the number of ranks and what does not.

FLAG_BYTES = len(pickle.dumps(False))  # a pickled bool, as ``allreduce_value`` sends it
FLOAT_BYTES = len(pickle.dumps(0.5))  # a pickled float: every float pickles to the same length
NORM_SUM_BYTES = len(pickle.dumps(2**62 - 1))  # the norm's fixed-point sum: at most this long (smaller ints: fewer)


def calls_per_step(setup: Setup, rounds: int = 1, clip: bool = True, reduction: str = "exact") -> dict[str, int]:
    """Collective calls each rank makes in one ``Trainer.step`` with no problem, by the op ``Traffic`` counts.

    ``agreement``: the data-loading flag, one ``agree`` per group, the norm's maximum and sum (when clipping
    at stages 1-3), the overflow flag (``native`` reduction) and the losses: none depends on the number of ranks.
    """
    plans = setup.counted_plans()
    calls = {"reduce_scatter": 0, "allreduce": 0, "allgather": 0}
    for plan, count in plans:
        calls[plan.gradient_collective.value] += count * reduce_scatters(setup, plan, rounds, None)[0]
        calls["allgather"] += count * plan.allgathers_per_step(rounds, setup.keep_gathered)
    norm = 2 if clip and plans[0][0].norm_needs_all_ranks else 0
    calls["agreement"] = 1 + sum(setup.counts()) + norm + int(REDUCTIONS[reduction].result_can_overflow) + 1
    return calls


def agreement_bytes_per_step(
    setup: Setup, tensors: tuple[int, ...], micro_batches: int, clip: bool = True, reduction: str = "exact"
) -> int:
    """Agreement bytes each rank hands in (and gets back) in one ``Trainer.step``; ``tensors``: tensors per group.

    Constant in the number of ranks but for the losses, one float64 slot per global micro-batch. With
    clipping the norm's sum is counted at its longest pickle; a smaller sum is up to a few bytes shorter.
    """
    plans = setup.plans()
    per_group = sum(
        8 * (FIXED_FIELDS + 2 * t) * count for t, count in zip(tensors, setup.counts(), strict=True)
    )  # ``tally.agreement_row``: its fixed fields, and a kept flag and a maximum per tensor
    norm = FLOAT_BYTES + NORM_SUM_BYTES if clip and plans[0].norm_needs_all_ranks else 0
    overflow = FLAG_BYTES if REDUCTIONS[reduction].result_can_overflow else 0
    return FLAG_BYTES + per_group + norm + overflow + 8 * micro_batches
