"""``python -m mpizero example``: the worked ZeRO step (8 parameters, 4 data-parallel workers).

Run: ``mpiexec -n 4 python -m mpizero example``; any -n works: the four
workers' gradients are spread over the ranks, and at -n 3 the 8 parameters
are padded to 9.
"""

from __future__ import annotations

import argparse

import numpy as np
from mpi4py import MPI

from mpizero.arrays import to_host
from mpizero.cli import options
from mpizero.core.engine import ZeroEngine
from mpizero.core.optim import SGD
from mpizero.core.partition import split_evenly
from mpizero.core.reference import Reference
from mpizero.core.stages import STAGES

INITIAL_PARAMS = np.array([0.1, -0.3, 0.5, 0.2, -0.1, 0.4, -0.2, 0.3], dtype=np.float32)
LOCAL_GRADS = np.array(
    [
        [0.04, -0.02, 0.06, 0.01, -0.03, 0.05, -0.01, 0.02],
        [0.02, -0.04, 0.03, 0.05, -0.01, 0.02, -0.04, 0.03],
        [0.06, -0.01, 0.04, 0.02, -0.02, 0.06, -0.02, 0.01],
        [0.02, -0.03, 0.05, 0.04, -0.04, 0.01, -0.03, 0.04],
    ],
    dtype=np.float32,
)
LR = 0.1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    options.add(parser, "stage", choices=[s for s in STAGES if s > 0])
    options.add(parser, "reduction")


def check(args, world_size: int) -> None:
    """Nothing beyond the parser's choices: the example runs at any world size."""


OUTPUTS: dict[str, str] = {}
INPUTS: dict[str, str] = {}
OUTPUT_DIRS: dict[str, str] = {}
WORK_DIRS: dict[str, str] = {}


def run(args, comm) -> int:
    """Run one step, print the table on rank 0; exit 0 only if it matches the naive update bitwise."""
    rank, size = comm.Get_rank(), comm.Get_size()
    workers = split_evenly(len(LOCAL_GRADS), size, rank)
    engine = ZeroEngine({"params": INITIAL_PARAMS}, SGD(lr=LR), comm=comm, stage=args.stage, reduction=args.reduction)
    group = engine.groups[0]
    engine.step([{"params": LOCAL_GRADS[w]} for w in workers])
    start, stop = group.partition.data_range(rank)
    mine = (
        rank,
        start,
        stop,
        group.partition.shard_padding(rank),
        to_host(group.grad_shard),
        to_host(group.master_shard),
    )
    shards = engine.collectives.gather_object(mine, "the shards")
    with engine.gathered() as full:
        gathered = np.array(to_host(full["params"]))
    naive = Reference({"params": INITIAL_PARAMS}, SGD(lr=LR), reduction=args.reduction)
    averaged = naive.average([{"params": g} for g in LOCAL_GRADS])["params"]
    naive.step([{"params": g} for g in LOCAL_GRADS])
    expected = naive.params["params"]
    match = gathered.tobytes() == expected.tobytes()
    if rank == 0:
        print_table(args.stage, size, group.partition, averaged, shards, gathered, expected, match)
    return 0 if engine.collectives.allreduce_value(match, MPI.LAND, "the verdict") else 1


def print_table(stage, size, partition, averaged, shards, gathered, expected, match) -> None:
    print(f"=== ZeRO Stage {stage} Training Step ({size} ranks, {partition.numel} Parameters) ===")
    print()
    print(f"Initial parameters: {INITIAL_PARAMS}")
    print(f"Averaged gradients: {averaged}")
    if partition.padding:
        padded = f"{partition.numel} parameters padded to {partition.padded_numel}"
        print(f"Padding: {padded} ({partition.shard_numel} per rank)")
    print()
    print("After Reduce-Scatter - each rank owns gradient shard:")
    for rank, start, stop, padding, grad_shard, _ in shards:
        print(f"  Rank {rank} owns params {_owned(start, stop, padding)}: grad_shard = {grad_shard}")
    print()
    print("After optimizer step on each shard:")
    for rank, _, _, _, _, master_shard in shards:
        print(f"  Rank {rank}: updated shard = {master_shard}")
    print()
    print(f"After All-Gather - full updated params: {gathered}")
    print()
    print(f"Expected (naive full-param update): {expected}")
    print(f"Results match: {match}")


def _owned(start: int, stop: int, padding: int) -> str:
    owned = str(list(range(start, stop)))
    return f"{owned} + {padding} padding" if padding else owned
