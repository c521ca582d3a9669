"""The communication paths a job takes, settled once when the engine is built and agreed by every rank.

- reduce-scatter: ``shared`` (every rank on one host: summed straight out of a
  node-shared window), ``two-level`` (several nodes with the same number, more
  than one, of ranks each: the shared window inside each node, MPI between
  nodes among ranks of the same local index, for all-gathers too; see
  ``hierarchical``), ``pieces`` (MPI, host buffers in cache-sized pieces),
  ``mpi`` (one MPI call per buffer) or ``mpi+pieces`` (one call below 64 MiB,
  pieces from there). ``MPIZERO_REDUCE_SCATTER`` asks for one; ``auto``, the
  default, picks ``shared`` on one host, ``two-level`` where it applies and
  ``mpi+pieces`` otherwise.
- device: ``host`` (NumPy buffers), ``cuda-aware`` (device buffers straight to
  MPI), ``pinned`` (through page-locked host buffers in chunks, the default
  when MPI is not CUDA-aware) or ``pageable`` (``MPIZERO_STAGING=pageable``:
  through new host arrays); see ``cuda_aware`` and ``transport``.

Ranks whose environments ask for different paths would make different
collectives and hang, so the choice is part of what ranks agree on at set-up.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, replace

from mpizero.errors import ZeroError

ENV_VAR = "MPIZERO_REDUCE_SCATTER"
CHOICES = ("auto", "shared", "two-level", "pieces", "mpi")
ON_ARENA = ("shared", "two-level")  # the paths that reduce out of the node-shared arena
PIECES_FROM_BYTES = 1 << 26  # measured: one call wins at 32 MiB, pieces at 128 MiB


@dataclass(frozen=True)
class CommPaths:
    """The paths every rank of one job takes; equal on every rank."""

    reduce_scatter: str
    device: str
    nodes: int
    mpi_library: str
    ranks_per_node: tuple[int, ...]

    @property
    def pieces_from_bytes(self) -> float:
        """Host buffers of at least this many bytes are reduce-scattered in pieces (outside the shared window)."""
        return {"pieces": 0, "mpi": math.inf}.get(self.reduce_scatter, PIECES_FROM_BYTES)

    @property
    def two_level(self) -> bool:
        """Whether host reduce-scatters and all-gathers go in two levels (inside nodes, then across)."""
        return self.reduce_scatter == "two-level"

    def without_shared(self) -> CommPaths:
        """The same paths with the shared-memory (or two-level) reduce-scatter replaced by MPI."""
        return replace(self, reduce_scatter="mpi+pieces")

    def runnable(self) -> list[str]:
        """Every reduce-scatter path these ranks can be asked to take (``verify --paths all``): node-shared or two
        levels where they apply, pieces, one MPI call a buffer; none but the one taken on a device, whose buffers
        travel by the device transport whatever is asked."""
        if self.device != "host":
            return [self.reduce_scatter]
        found = []
        for choice in CHOICES[1:]:
            try:
                settle_reduce_scatter(choice, self.nodes, False, self.ranks_per_node)
            except ZeroError:
                continue
            found.append(choice)
        return found

    def describe(self) -> str:
        """One line for a job's header."""
        nodes = f"{self.nodes} node{'s' if self.nodes > 1 else ''}"
        return f"reduce-scatter {self.reduce_scatter}, {self.device} buffers, {nodes}, MPI: {self.mpi_library}"


@contextlib.contextmanager
def asking_for(path: str):
    """Engines built inside take the reduce-scatter ``path`` (as ``MPIZERO_REDUCE_SCATTER`` asks), on every rank
    that enters alike."""
    before = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = path
    try:
        yield
    finally:
        if before is None:
            del os.environ[ENV_VAR]
        else:
            os.environ[ENV_VAR] = before


def requested_reduce_scatter(environ=os.environ) -> str:
    """The reduce-scatter path the environment asks for, checked."""
    value = environ.get(ENV_VAR, "auto")
    if value not in CHOICES:
        raise ZeroError(f"{ENV_VAR} must be one of {', '.join(CHOICES)}, got {value!r}")
    return value


def settle_reduce_scatter(requested: str, nodes: int, on_device: bool, ranks_per_node: tuple[int, ...] = ()) -> str:
    """The reduce-scatter path for an agreed request; raise if the one asked for cannot be used.

    ``ranks_per_node``: how many ranks each node has (one entry per node; empty if unknown).
    """
    if requested == "shared" and (nodes > 1 or on_device):
        where = f"these ranks span {nodes} nodes" if nodes > 1 else "the buffers are on the GPU"
        raise ZeroError(f"{ENV_VAR}=shared needs host buffers and every rank on one host, but {where}")
    even = len(ranks_per_node) == nodes and len(set(ranks_per_node)) == 1 and ranks_per_node[0] > 1
    two_level = nodes > 1 and even and not on_device
    if requested == "two-level" and not two_level:
        where = "the buffers are on the GPU" if on_device else f"the ranks per node are {list(ranks_per_node)}"
        raise ZeroError(
            f"{ENV_VAR}=two-level needs host buffers and several nodes with the same number (> 1) "
            f"of ranks each, but {where}"
        )
    if requested == "auto":
        return "shared" if nodes == 1 and not on_device else "two-level" if two_level else "mpi+pieces"
    return requested


def inter_node_bytes(full_bytes: int, ranks: int, nodes: int, two_level: bool, factor: int = 1) -> int:
    """Bytes one rank sends to other nodes in one collective on ``full_bytes`` (``factor`` 2: all-reduce).

    Assumes ``ranks // nodes`` ranks per node (the flat path's share is exact for pairwise exchange).
    """
    if nodes <= 1:
        return 0
    if two_level:
        return factor * full_bytes * (nodes - 1) // ranks
    return factor * full_bytes * (ranks - ranks // nodes) // ranks
