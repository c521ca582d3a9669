"""Digests of the master parameters after a stream of gradients, handed in each way. Run:
mpiexec -n N python -m mpi4py tests/core/paired_digests.py

Each step's contributions (12, 7, 1, 5 and 2 of them, with a jump in magnitude that leaves elements beyond the
predicted cap) are split over the ranks, so a rank hands in odd and even numbers of them. They go in as copies
(``keep="copy"``: each encoded on arrival), as arrays given up (``keep="reference"``: paired), through
``step(list)`` (paired), and, at stages 1-3, round by round (``reduce_round``: each round summed over ranks as it
ends, two rounds in one pass), at stages 0-3 (pairing on at 2-3 too, where it is not the default) in groups of
awkward sizes. Rank 0 prints one JSON line: the digest of each run by stage and way, which the test compares with
each other and with the digest the code gave before pairing.
"""

import json

import numpy as np
from mpi4py import MPI

from mpizero import Adam, ZeroEngine, split_evenly

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
SHAPES = {"a": (31, 33), "b": (257,), "c": (17, 3), "d": (1,)}
GROUPS = [["a", "d"], ["b", "c"]]
COUNTS = [12, 7, 1, 5, 2]  # contributions per step, all ranks together
SCALE = [1.0, 1.0, 1e4, 1.0, 1e-3]  # a jump: elements beyond the prediction are kept, a fall: rescaled


def contribution(step: int, index: int) -> dict:
    rng = np.random.default_rng([step, index])
    grads = {}
    for name, shape in SHAPES.items():
        values = rng.standard_normal(shape) * 10.0 ** rng.integers(-3, 3, shape) * SCALE[step]
        grads[name] = values.astype(np.float32)
    return grads


def run(stage: int, way: str) -> str:
    params = {
        n: np.random.default_rng([9, i]).standard_normal(s).astype(np.float32)
        for i, (n, s) in enumerate(SHAPES.items())
    }
    engine = ZeroEngine(params, Adam(lr=1e-2), comm=comm, stage=stage, groups=GROUPS, pair_contributions=True)
    for step, count in enumerate(COUNTS):
        mine = [contribution(step, i) for i in split_evenly(count, size, rank)]
        if way == "step":
            engine.step(mine)
            continue
        while True:
            if way.startswith("rounds"):
                reduce_rounds(engine, mine, -(-count // size), keep=way.split()[1])
            else:
                for grads in mine:
                    engine.accumulate(grads, keep=way)
            if not engine.step().redo:
                break
    return engine.master_digest()


def reduce_rounds(engine, mine: list, rounds: int, keep: str) -> None:
    """Each round reduce-scattered as it ends, group by group, as the trainer and the torch bridge do; a rank with
    fewer contributions than the rounds hands in None."""
    for round_ in range(rounds):
        grads = mine[round_] if round_ < len(mine) else None
        for index in range(len(GROUPS)):
            engine.reduce_round(index, grads, keep=keep)


WAYS = {
    stage: ("copy", "reference", "step") + (("rounds copy", "rounds reference") if stage else ()) for stage in range(4)
}
digests = {f"{stage} {way}": run(stage, way) for stage, ways in WAYS.items() for way in ways}
if rank == 0:
    print(json.dumps(digests))
