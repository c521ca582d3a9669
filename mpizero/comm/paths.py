"""The communication paths a job takes, settled once when the engine is built and agreed by every rank.

- reduce-scatter: ``shared`` (every rank on one host: summed straight out of a
  node-shared window), ``pieces`` (MPI, host buffers in cache-sized pieces),
  ``mpi`` (one MPI call per buffer) or ``mpi+pieces`` (one call below 64 MiB,
  pieces from there). ``MPIZERO_REDUCE_SCATTER`` asks for one; ``auto``, the
  default, picks ``shared`` on one host and ``mpi+pieces`` otherwise.
- device: ``host`` (NumPy buffers), ``cuda-aware`` (device buffers straight to
  MPI) or ``staged`` (through host memory); see ``cuda_aware``.

Ranks whose environments ask for different paths would make different
collectives and hang, so the choice is part of what ranks agree on at set-up.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

from mpizero.core.errors import ZeroError

ENV_VAR = "MPIZERO_REDUCE_SCATTER"
CHOICES = ("auto", "shared", "pieces", "mpi")
PIECES_FROM_BYTES = 1 << 26  # measured: one call wins at 32 MiB, pieces at 128 MiB


@dataclass(frozen=True)
class CommPaths:
    """The paths every rank of one job takes; equal on every rank."""

    reduce_scatter: str
    device: str
    nodes: int
    mpi_library: str

    @property
    def pieces_from_bytes(self) -> float:
        """Host buffers of at least this many bytes are reduce-scattered in pieces (outside the shared window)."""
        return {"pieces": 0, "mpi": math.inf}.get(self.reduce_scatter, PIECES_FROM_BYTES)

    def without_shared(self) -> CommPaths:
        """The same paths with the shared-memory reduce-scatter replaced by MPI."""
        return replace(self, reduce_scatter="mpi+pieces")

    def describe(self) -> str:
        """One line for a job's header."""
        nodes = f"{self.nodes} node{'s' if self.nodes > 1 else ''}"
        return f"reduce-scatter {self.reduce_scatter}, {self.device} buffers, {nodes}, MPI: {self.mpi_library}"


def requested_reduce_scatter(environ=os.environ) -> str:
    """The reduce-scatter path the environment asks for, checked."""
    value = environ.get(ENV_VAR, "auto")
    if value not in CHOICES:
        raise ZeroError(f"{ENV_VAR} must be one of {', '.join(CHOICES)}, got {value!r}")
    return value


def settle_reduce_scatter(requested: str, nodes: int, on_device: bool) -> str:
    """The reduce-scatter path for an agreed request; raise if the one asked for cannot be used."""
    one_host_for_host_buffers = nodes == 1 and not on_device
    if requested == "shared" and not one_host_for_host_buffers:
        where = f"these ranks span {nodes} nodes" if nodes > 1 else "the buffers are on the GPU"
        raise ZeroError(f"{ENV_VAR}=shared needs host buffers and every rank on one host, but {where}")
    if requested == "auto":
        return "shared" if one_host_for_host_buffers else "mpi+pieces"
    return requested
