"""Two-level reduce-scatter and all-gather for ranks on several nodes, several ranks on each.

Glossary:
- node: the ranks that share memory (``Split_type(COMM_TYPE_SHARED)``); every
  node has the same number of ranks (``paths`` settles this path only then).
- local index: a rank's place on its node.
- across communicator: the ranks with the same local index, one per node.
- block: what one rank owns. Block ``r`` of a buffer of ``world_size`` blocks
  belongs to world rank ``r``, exactly as on the flat path
  (``Partition.shard_range``), wherever the ranks were placed.

Reduce-scatter: every rank has encoded its full buffer into its segment of the
node's shared arena. Inside the node, the rank with local index ``l`` sums,
from every segment of its node, the blocks owned by the ranks of its across
communicator, in across order, into a buffer of ``nodes`` blocks. Across nodes,
those buffers are reduce-scattered over the across communicator: each rank
receives the sum of its own block. Only ``1/ranks_per_node`` of the full buffer
leaves a rank for other nodes, against all of it on the flat path.

All-gather, the reverse: across nodes, the ranks of an across communicator
gather their blocks (nonblocking, so it overlaps computation as the flat
``Iallgather`` does); inside the node, once that completes, each rank puts
what it gathered into its shared segment and every rank copies every
segment's blocks into place.

Int64 (exact) sums are the same bits in any order, so the same as MPI's flat
reduce-scatter; float32 (native) sums follow a fixed order (the node's ranks
in order, then MPI's across nodes): deterministic, not the flat path's bits.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from mpizero.comm.reduce_scatter import reduce_scatter_in_pieces
from mpizero.comm.shared import SharedArena, sum_block


class TwoLevel:
    """The across communicator, who owns which block, and the two-level collectives on host buffers."""

    def __init__(self, comm: MPI.Comm, node: MPI.Comm, watchdog) -> None:
        """Split ``comm`` by local index (collective on every rank of ``comm``)."""
        self.comm, self.node, self.watchdog = comm, node, watchdog
        with watchdog.waiting("set-up: splitting ranks by local index"):
            self.across = comm.Split(node.Get_rank(), comm.Get_rank())
            own = self.across.allgather(comm.Get_rank())
            # owners[l][j]: the world rank of across rank j among the ranks with local index l on this node
            self.owners: list[list[int]] = node.allgather(own)
        self.gather_arena = SharedArena(comm, node, watchdog)

    @property
    def own_owners(self) -> list[int]:
        """World ranks of this rank's across communicator, in across order."""
        return self.owners[self.node.Get_rank()]

    def reduce_scatter(self, arena: SharedArena, send: np.ndarray, recv: np.ndarray, pieces_from_bytes) -> None:
        """Sum ``send`` (in ``arena``; world_size blocks of ``len(recv)``) over every rank; keep this rank's block."""
        block = recv.size
        partial = np.empty(len(self.own_owners) * block, send.dtype)  # this node's sums of the across blocks
        with arena.reading(send) as views:
            for j, owner in enumerate(self.own_owners):
                sum_block(views, owner * block, partial[j * block : (j + 1) * block])
        with self.watchdog.waiting("reduce-scatter across nodes"):
            if partial.nbytes >= pieces_from_bytes:
                reduce_scatter_in_pieces(self.across, partial, recv)
            else:
                self.across.Reduce_scatter_block(partial, recv, op=MPI.SUM)

    def start_allgather(self, send: np.ndarray | None, full: np.ndarray):
        """Start gathering every rank's block into ``full`` (world_size blocks); return (request, finish).

        ``send`` None: this rank's block of ``full``. The request is the across-node all-gather, in flight
        while the caller computes; ``finish``, once it completes, copies the node's blocks into place.
        """
        block = full.size // self.comm.Get_size()
        mine = self.comm.Get_rank() * block
        send = full[mine : mine + block].copy() if send is None else send
        across = np.empty(len(self.own_owners) * block, full.dtype)  # this rank's across blocks, in across order
        with self.watchdog.waiting("all-gather across nodes"):
            request = self.across.Iallgather(send, across)
        return request, lambda: self._gather_node(across, full, block)

    def _gather_node(self, across: np.ndarray, full: np.ndarray, block: int) -> None:
        """Copy every node rank's across blocks, through the shared arena, into ``full`` (collective on the node)."""
        shared = self.gather_arena.buffer(across.size, across.dtype)
        shared[...] = across
        with self.gather_arena.reading(shared) as views:
            for segment, owners in zip(views, self.owners):
                for j, owner in enumerate(owners):
                    full[owner * block : (owner + 1) * block] = segment[j * block : (j + 1) * block]
