"""Errors every rank agrees on, so no rank is left waiting in a collective.

A problem one rank can see (a bad shape, a NaN) is shared with all ranks by a
small collective before anyone enters the next data collective; then every
rank raises the same ``ZeroError``, naming the ranks and their values.
"""

from __future__ import annotations

from collections.abc import Hashable


class ZeroError(RuntimeError):
    """An error raised identically on every rank of the communicator."""


def raise_if_any(comm, problem: str | None, context: str) -> None:
    """Collectively check ``problem`` (None when fine); raise on every rank if any rank has one."""
    problems = comm.allgather(problem)
    bad = [f"rank {rank}: {text}" for rank, text in enumerate(problems) if text]
    if bad:
        raise ZeroError(f"{context}: " + "; ".join(bad))


def raise_unless_equal(comm, value: Hashable, what: str) -> None:
    """Raise on every rank unless all ranks hold the same ``value``, naming who differs."""
    values = comm.allgather(value)
    differing = [rank for rank, v in enumerate(values) if v != values[0]]
    if differing:
        shown = "; ".join(f"rank {r}: {values[r]!r}" for r in [0, *differing[:3]])
        raise ZeroError(f"ranks disagree on {what} (ranks {differing} differ from rank 0): {shown}")
