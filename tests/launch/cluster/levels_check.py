"""Run under mpiexec across nodes: the two-level collectives against MPI's flat ones, on awkward sizes.

Prints ``two-level ok <path> <nodes>`` on rank 0 when every int64 result is the flat path's bits, every
float32 result is the same on a second run (deterministic), and all-gathers equal MPI's.
"""

import numpy as np
from mpi4py import MPI

from mpizero.comm.collectives import Collectives


def check(collectives: Collectives, block: int, rng: np.random.Generator) -> None:
    comm, size = collectives.comm, collectives.comm.Get_size()
    for dtype in (np.int64, np.float32):
        on_arena = collectives.shared  # as the engine asks: encode into the arena only on a path that reads it
        local = collectives.shared_buffer(size * block, dtype) if on_arena else np.empty(size * block, dtype)
        local[...] = rng.integers(-(2**40), 2**40, size * block).astype(dtype)
        flat = np.empty(block, dtype)
        comm.Reduce_scatter_block(local.copy(), flat, op=MPI.SUM)
        ours, again = np.empty(block, dtype), np.empty(block, dtype)
        kept = local.copy()
        collectives.reduce_scatter(local, ours)
        local[...] = kept
        collectives.reduce_scatter(local, again)
        assert ours.tobytes() == again.tobytes(), f"{dtype.__name__} block {block}: not deterministic"
        if dtype is np.int64:
            assert ours.tobytes() == flat.tobytes(), f"int64 block {block}: differs from MPI's reduce-scatter"
        full, expected = np.empty(size * block, dtype), np.empty(size * block, dtype)
        collectives.allgather(ours, full)
        comm.Allgather(ours, expected)
        assert full.tobytes() == expected.tobytes(), f"{dtype.__name__} block {block}: all-gather differs"
        full[...] = 0
        full[comm.Get_rank() * block : (comm.Get_rank() + 1) * block] = ours
        collectives.allgather_in_place(full)
        assert full.tobytes() == expected.tobytes(), f"{dtype.__name__} block {block}: in-place all-gather differs"


def main() -> None:
    collectives = Collectives(MPI.COMM_WORLD)
    rng = np.random.default_rng(17 + MPI.COMM_WORLD.Get_rank())
    for block in (1, 17, 257, 40_000):
        check(collectives, block, rng)
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(f"two-level ok {collectives.paths.reduce_scatter} {collectives.paths.nodes}", flush=True)


if __name__ == "__main__":
    main()
