"""Which processes a communicator joins, named as ``MPI.COMM_WORLD`` names them: the same on every one of them."""

from __future__ import annotations

from mpi4py import MPI


def world_ranks(comm: MPI.Comm) -> tuple[int, ...]:
    """``comm``'s ranks as ``MPI.COMM_WORLD`` numbers them, in ``comm``'s order."""
    group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return tuple(group.Translate_ranks(list(range(comm.Get_size())), world))
    finally:
        group.Free()
        world.Free()
